//! Transposed convolutions as one batched product and onnx-ga's `Col2Im` kernel, in memory,
//! for an ONNX Runtime session on two threads or more: `ConvTranspose(dY, W)` becomes
//!
//! ```text
//! cols = MatMul(Transpose(Reshape(W, [M, C·kh·kw])), Reshape(dY, [0, M, Hi·Wi]))
//! dX   = Col2Im(cols, dY, [B]; channels C, the window, output_padding)
//! ```
//!
//! ([`crate::fused_ops`] has what `Col2Im` computes). The step file is never rewritten: it
//! stays standard ONNX. These are the data gradients of the strided convolutions (the
//! stride-1 ones go on the blocked kernels first, `passes::nchwc_conv`, where they qualify),
//! and a model's own transposed convolutions (a decoder's upsampling, with its bias B).
//!
//! Why: ONNX Runtime's CPU `ConvTranspose` runs one image at a time, a GEMM on the thread
//! pool and then the folding on the calling thread alone, so on two threads it barely
//! speeds up (the ResNet-8 at B 32: 2.9 ms on one thread, 2.2 on two, for its four). Here
//! the product covers every image in one call, and the folding spreads whole planes over
//! the threads. On one thread the batched product's columns (every image's at once, out of
//! cache by the time they are folded) cost more than the per-image loop saves: the pass
//! leaves one-thread sessions alone (benches/README.md, "Run AC").
//!
//! Bit-identical: ONNX Runtime's kernel is this same product per image (`Wᵀ · dY`, the
//! GEMM summing over M in one order) and the same folding, each output element adding its
//! taps in order from zero, then the bias (tests/fused_col2im.rs compares bits).
//!
//! Matched: a `ConvTranspose` of the main graph with one group, 2-D, explicit pads (or
//! none), no `output_shape`, and a float32 weight of static shape.

use super::autodiff::shapes::Shapes;
use crate::fused_ops::{COL2IM, DOMAIN};
use crate::ir::builder::{attr_int, attr_ints, Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "fused-col2im";

/// The fewest session threads for which the pass rewrites (see the module's comment).
pub const MIN_THREADS: usize = 2;

/// A session's model with its transposed convolutions on `Col2Im`.
pub struct Rewritten {
    pub model: ModelProto,
    /// `ConvTranspose` nodes rewritten.
    pub foldings: usize,
}

/// `model` with every transposed convolution the module's pattern matches as a product and
/// `Col2Im`; `None` when none is, or when `threads` is below [`MIN_THREADS`].
pub fn rewrite(model: &ModelProto, threads: usize) -> Result<Option<Rewritten>, super::PassError> {
    if threads < MIN_THREADS || !super::has_op(model, "ConvTranspose") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    let found: Vec<(NodeId, Transposed)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| transposed(&ir, &shapes, n).map(|t| (n, t)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (conv, t) in &found {
        let dx = ir.output(*conv, 0);
        let hint = format!("{}.col2im", ir.name(dx));
        let [m, c, kh, kw] = t.weight;
        let mut b = Builder::new(&mut ir, BodyId::MAIN, PASS);
        let flat = b.ints(&format!("{hint}.weight_shape"), &[m, t.rows]);
        let w2 = b.op("Reshape", &[t.w, flat], vec![], &format!("{hint}.weight"));
        // ONNX Runtime fuses this Transpose into the product (FusedMatMul with transA),
        // as its ConvTranspose's GEMM reads W.
        let wt = b.op(
            "Transpose",
            &[w2],
            vec![attr_ints("perm", &[1, 0])],
            &format!("{hint}.weight_t"),
        );
        let rows = b.ints(&format!("{hint}.dy_shape"), &[0, m, t.plane.unwrap_or(-1)]);
        let dy2 = b.op("Reshape", &[t.dy, rows], vec![], &format!("{hint}.dy"));
        let cols = b.op("MatMul", &[wt, dy2], vec![], &format!("{hint}.cols"));
        let node = b.node(
            COL2IM,
            DOMAIN,
            &[Some(cols), Some(t.dy), t.bias],
            &[&hint],
            vec![
                attr_int("channels", c),
                attr_ints("kernel_shape", &[kh, kw]),
                attr_ints("strides", &t.strides),
                attr_ints("pads", &t.pads),
                attr_ints("dilations", &t.dilations),
                attr_ints("output_padding", &t.output_padding),
            ],
        );
        // Where the ConvTranspose ran, in order (see `Model::place_after`).
        let mut anchor = *conv;
        for value in [flat, w2, wt, rows, dy2, cols] {
            if let Some((made_by, _)) = ir.producer(value) {
                ir.place_after(made_by, anchor);
                anchor = made_by;
            }
        }
        ir.place_after(node, anchor);
        let folded = ir.output(node, 0);
        ir.replace_value(dx, folded);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        foldings: found.len(),
    }))
}

/// One matched transposed convolution.
struct Transposed {
    dy: ValueId,
    w: ValueId,
    bias: Option<ValueId>,
    /// W's `[M, C, kh, kw]`.
    weight: [i64; 4],
    /// `C·kh·kw`, the product's rows.
    rows: i64,
    /// `Hi·Wi`, when dY's spatial sizes are known.
    plane: Option<i64>,
    strides: Vec<i64>,
    pads: Vec<i64>,
    dilations: Vec<i64>,
    output_padding: Vec<i64>,
}

fn transposed(model: &Model, shapes: &Shapes, conv: NodeId) -> Option<Transposed> {
    let node = model.node(conv);
    let p = &node.proto;
    let standard = p.op_type() == "ConvTranspose"
        && normalize_domain(p.domain()).is_empty()
        && node.body == BodyId::MAIN
        && (2..=3).contains(&node.inputs.len())
        && node.outputs.len() == 1;
    let known = [
        "group",
        "kernel_shape",
        "strides",
        "pads",
        "dilations",
        "output_padding",
        "auto_pad",
    ];
    if !standard || !super::only_attributes(p, &known) {
        return None;
    }
    if !matches!(
        p.attr_string("auto_pad").ok()?.as_deref(),
        None | Some("NOTSET")
    ) || p.attr_int("group").ok()?.unwrap_or(1) != 1
    {
        return None;
    }
    let (dy, w) = (node.inputs[0]?, node.inputs[1]?);
    let (fw, fdy) = (shapes.get(w), shapes.get(dy));
    let float32 = Some(DataType::Float as i32);
    if fw.elem != float32 || fdy.elem.is_some_and(|e| Some(e) != float32) {
        return None;
    }
    let weight: [i64; 4] = fw.static_dims()?.try_into().ok()?;
    if weight.iter().any(|&d| d < 1) || fdy.rank().is_some_and(|r| r != 4) {
        return None;
    }
    // Checked: the sizes come from the model file.
    let rows = weight[1].checked_mul(weight[2])?.checked_mul(weight[3])?;
    if p.attr_ints("kernel_shape")
        .ok()?
        .is_some_and(|k| k != weight[2..])
    {
        return None;
    }
    let ints = |name: &str, len: usize, default: i64, least: i64| -> Option<Vec<i64>> {
        let v = p.attr_ints(name).ok()?.unwrap_or(vec![default; len]);
        (v.len() == len && v.iter().all(|&d| d >= least)).then_some(v)
    };
    let plane = fdy
        .dims
        .as_ref()
        .and_then(|d| d.get(2)?.known()?.checked_mul(d.get(3)?.known()?));
    let bias = node.inputs.get(2).copied().flatten();
    if bias.is_some_and(|b| shapes.get(b).elem.is_some_and(|e| Some(e) != float32)) {
        return None;
    }
    Some(Transposed {
        dy,
        w,
        bias,
        weight,
        rows,
        plane,
        strides: ints("strides", 2, 1, 1)?,
        pads: ints("pads", 4, 0, 0)?,
        dilations: ints("dilations", 2, 1, 1)?,
        output_padding: ints("output_padding", 2, 0, 0)?,
    })
}
