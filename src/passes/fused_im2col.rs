//! The weight gradient's unfolding on onnx-ga's `Im2Col` kernel, in memory, for an ONNX
//! Runtime session: the `Conv` with identity filters that `passes/legalize/conv_grad.rs`
//! writes to unfold X (`unfold`: `Conv(X, Tile(I, [C, 1, 1, 1]); group C)`, I the `kh·kw`
//! one-hot taps) becomes `Im2Col(X)` with the same window ([`crate::fused_ops`] has what it
//! computes). The step file is never rewritten: it stays standard ONNX.
//!
//! Why: ONNX Runtime runs that `Conv` as a grouped convolution, per channel an unfolding
//! and a GEMM by the identity, so every tap is written twice and multiplied by one; on the
//! ResNet-8 at B 32 the unfoldings took more time than the weight gradients' GEMMs
//! (benches/README.md, "Run M"). The kernel writes each tap once.
//!
//! Matched: a 2-D `Conv` of the main graph without bias, with explicit pads (or none), whose
//! weight is that identity, tiled over `group` channels (or alone, for one channel).
//! Bit-identical for finite inputs (see `fused_ops::im2col`).

use super::autodiff::shapes::{constant_ints, constant_tensor, Shapes};
use crate::fused_ops::{DOMAIN, IM2COL};
use crate::ir::builder::{attr_ints, Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "fused-im2col";

/// A session's model with its unfoldings on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// Unfoldings rewritten.
    pub unfoldings: usize,
}

/// `model` with every unfolding the module's pattern matches on `Im2Col`; `None` when none
/// is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "Conv") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    let found: Vec<(NodeId, Unfolding)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| unfolding(&ir, &shapes, n).map(|u| (n, u)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (conv, u) in &found {
        let cols = ir.output(*conv, 0);
        let hint = format!("{}.fused", ir.name(cols));
        let attrs = vec![
            attr_ints("kernel_shape", &u.kernel),
            attr_ints("strides", &u.strides),
            attr_ints("pads", &u.pads),
            attr_ints("dilations", &u.dilations),
        ];
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            IM2COL,
            DOMAIN,
            &[Some(u.x)],
            &[&hint],
            attrs,
        );
        let fused = ir.output(node, 0);
        ir.replace_value(cols, fused);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        unfoldings: found.len(),
    }))
}

/// One matched unfolding: its input and window.
struct Unfolding {
    x: ValueId,
    kernel: Vec<i64>,
    strides: Vec<i64>,
    pads: Vec<i64>,
    dilations: Vec<i64>,
}

fn unfolding(model: &Model, shapes: &Shapes, conv: NodeId) -> Option<Unfolding> {
    let node = model.node(conv);
    let standard = node.proto.op_type() == "Conv"
        && normalize_domain(node.proto.domain()).is_empty()
        && node.body == BodyId::MAIN
        && node.inputs.len() == 2
        && node.outputs.len() == 1;
    if !standard {
        return None;
    }
    let known = [
        "group",
        "kernel_shape",
        "strides",
        "pads",
        "dilations",
        "auto_pad",
    ];
    if !super::only_attributes(&node.proto, &known) {
        return None;
    }
    if !matches!(
        node.proto.attr_string("auto_pad").ok()?.as_deref(),
        None | Some("NOTSET")
    ) {
        return None;
    }
    let ints = |name: &str, len: usize, default: i64| -> Option<Vec<i64>> {
        let v = node
            .proto
            .attr_ints(name)
            .ok()?
            .unwrap_or(vec![default; len]);
        (v.len() == len && v.iter().all(|&d| d >= 0)).then_some(v)
    };
    let kernel = node.proto.attr_ints("kernel_shape").ok()??;
    let [kh, kw] = kernel[..] else {
        return None;
    };
    let strides = ints("strides", 2, 1)?;
    let pads = ints("pads", 4, 0)?;
    let dilations = ints("dilations", 2, 1)?;
    if strides.contains(&0) || dilations.contains(&0) || kh < 1 || kw < 1 {
        return None;
    }
    let group = node.proto.attr_int("group").ok()?.unwrap_or(1);
    let (x, w) = (node.inputs[0]?, node.inputs[1]?);
    let facts = shapes.get(x);
    let x_ok = facts.elem.is_none_or(|e| e == DataType::Float as i32)
        && facts.rank().is_none_or(|r| r == 4)
        && facts
            .dims
            .as_ref()
            .and_then(|d| d.get(1)?.known())
            .is_none_or(|c| c == group);
    let taps = kh * kw;
    (x_ok && tiled_identity(model, w, taps, [kh, kw], group)).then_some(Unfolding {
        x,
        kernel,
        strides,
        pads,
        dilations,
    })
}

/// `w` is the one-hot taps `[taps, 1, kh, kw]` tiled over `channels` (`Tile(I, [channels,
/// 1, 1, 1])`, or I itself for one channel).
fn tiled_identity(model: &Model, w: ValueId, taps: i64, kernel: [i64; 2], channels: i64) -> bool {
    let identity = match model.producer(w) {
        Some((tile, 0)) if model.node(tile).proto.op_type() == "Tile" => {
            let n = model.node(tile);
            let standard = normalize_domain(n.proto.domain()).is_empty() && n.inputs.len() == 2;
            let repeats = n
                .inputs
                .get(1)
                .copied()
                .flatten()
                .and_then(|r| constant_ints(model, r));
            match (standard, repeats, n.inputs[0]) {
                (true, Some(r), Some(i)) if r == [channels, 1, 1, 1] => i,
                _ => return false,
            }
        }
        _ if channels == 1 => w,
        _ => return false,
    };
    let Some(t) = constant_tensor(model, identity) else {
        return false;
    };
    if t.dims != [taps, 1, kernel[0], kernel[1]] {
        return false;
    }
    let Some(values) = crate::data::Tensor::from_tensor_proto(t)
        .ok()
        .and_then(|t| t.as_f32().map(|a| a.iter().copied().collect::<Vec<f32>>()))
    else {
        return false;
    };
    let taps = taps as usize;
    values.len() == taps * taps
        && values
            .iter()
            .enumerate()
            .all(|(k, &v)| v == if k / taps == k % taps { 1.0 } else { 0.0 })
}
