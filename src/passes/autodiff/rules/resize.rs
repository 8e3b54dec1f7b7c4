//! Resize. Every mode of ONNX's Resize but crop-and-resize is linear in X and separable:
//! along each resized axis `d`, output position `o` is a fixed weighted sum of input
//! positions, `Y = X ×_d A_d` with `A_d[o, i]` the weight of input `i` in output `o`. So
//!
//! ```text
//! dX = dY ×_d A_dᵀ, axis by axis            (a MatMul with a constant [out, in] matrix)
//! nearest, output o reading input floor(o / s), s = out / in whole:
//!   dX = ReduceSum(Reshape(dY, [.., in, s, ..]), the s axes)      (no matrix)
//! ```
//!
//! The weights follow the ONNX operator's definition, as ONNX Runtime computes them (in
//! float32 for the coordinate, so that a nearest index lands where the forward's does):
//!
//! ```text
//! x = transform(o)   half_pixel (o + ½)/s - ½; pytorch_half_pixel the same, 0 when out = 1;
//!                    half_pixel_symmetric, align_corners o·(in-1)/(out-1), asymmetric o/s,
//!                    tf_half_pixel_for_nn (o + ½)/s
//! nearest   i = round(x) by nearest_mode, clamped to [0, in-1]                weight 1
//! linear    x clamped to [0, in-1]; i0 = ⌊x⌋, i1 = min(i0 + 1, in-1)          1 - r, r
//! cubic     i = ⌊x⌋-1 .. ⌊x⌋+2 clamped (or dropped and renormalised with
//!           exclude_outside), Keys' weights with a = cubic_coeff_a, r = x - ⌊x⌋
//! ```
//!
//! `s` is the given scale, or out / in when the node gives sizes. The rule needs each
//! resized axis's input and output lengths (constant scales or sizes, or declared shapes).
//! The dense matrix costs out·in multiply-adds per output row, against the sparse
//! forward's 1-4: cheap beside the convolutions around an upsampling at feature-map sizes,
//! and exact.
//!
//! Not supported (a clear error naming the node): opsets before 11, tf_crop_and_resize,
//! keep_aspect_ratio_policy other than stretch, antialias when downsampling, and resizing
//! an axis whose length is not known.

use super::super::shapes::{constant_tensor, shape_value, Dim};
use super::{Grad, InputGrads};
use crate::ir::builder::{attr_int, attr_ints, tensor_f32, tensor_f64, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{Model, NodeId, ValueDef, ValueId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

/// The most weights one axis's matrix may hold.
const MAX_WEIGHTS: i64 = super::MAX_CONSTANT_ELEMENTS;

/// How one axis is resized.
#[derive(Clone, Debug, PartialEq)]
struct AxisPlan {
    axis: usize,
    input: usize,
    output: usize,
    /// The scale the coordinate transform divides by.
    scale: f32,
}

/// What the rule reads from the node: the attributes that shape the weights.
struct Settings {
    mode: String,
    transform: String,
    nearest_mode: String,
    cubic_a: f32,
    exclude_outside: bool,
}

fn attr_string_or(
    model: &Model,
    node: NodeId,
    name: &str,
    default: &str,
) -> Result<String, String> {
    Ok(model
        .node(node)
        .proto
        .attr_string(name)?
        .unwrap_or_else(|| default.to_string()))
}

/// The values of a constant float32 vector: an initializer, a `Constant`, or a `Concat`
/// of such (what the legacy torch exporter writes for `scale_factor`).
fn floats_of(model: &Model, v: ValueId) -> Option<Vec<f32>> {
    if let Some(t) = constant_tensor(model, v) {
        let t = crate::data::Tensor::from_tensor_proto(t).ok()?;
        return Some(t.as_f32()?.iter().copied().collect());
    }
    let ValueDef::Node { node, slot: 0 } = model.value(v).def else {
        return None;
    };
    let n = model.node(node);
    match (n.proto.domain(), n.proto.op_type()) {
        // The dynamo exporter writes scales as `Constant(value_floats)`.
        ("", "Constant") => n
            .proto
            .attr("value_floats")
            .map(|a| a.floats.clone())
            .or_else(|| n.proto.attr("value_float").map(|a| vec![a.f()])),
        ("", "Concat") => n
            .inputs
            .iter()
            .map(|i| i.and_then(|i| floats_of(model, i)))
            .collect::<Option<Vec<_>>>()
            .map(|parts| parts.concat()),
        ("", "Identity") => n
            .inputs
            .first()
            .copied()
            .flatten()
            .and_then(|i| floats_of(model, i)),
        _ => None,
    }
}

/// The resized axes of `node` for an input of dims `x` (`Err`: why the rule cannot say).
fn plan(
    model: &Model,
    node: NodeId,
    x: &[Dim],
    y: Option<&[Dim]>,
    dims_of: &dyn Fn(ValueId) -> Option<Vec<Dim>>,
) -> Result<Vec<AxisPlan>, String> {
    let n = model.node(node);
    let p = &n.proto;
    let rank = x.len();
    let input = |i: usize| n.inputs.get(i).copied().flatten();
    if let Some(policy) = p.attr_string("keep_aspect_ratio_policy")? {
        if policy != "stretch" {
            return Err(format!(
                "keep_aspect_ratio_policy '{policy}' is not supported"
            ));
        }
    }
    let axes: Vec<usize> = match p.attr_ints("axes")? {
        Some(a) => a
            .iter()
            .map(|a| {
                let a = if *a < 0 { a + rank as i64 } else { *a };
                usize::try_from(a)
                    .ok()
                    .filter(|a| *a < rank)
                    .ok_or_else(|| format!("axis {a} is out of range for rank {rank}"))
            })
            .collect::<Result<_, _>>()?,
        None => (0..rank).collect(),
    };
    let scales = input(2)
        .and_then(|v| floats_of(model, v))
        .filter(|s| !s.is_empty());
    // Sizes a model computes keep the axes it does not resize as `Shape(X)` (MobileViT's
    // `interpolate(size=...)`: the batch and channels, then constant H and W), and may read
    // the sizes of other values (through the TorchScript exporter, the map it folds back to).
    let x_value = input(0);
    let sizes = input(3)
        .and_then(|v| {
            shape_value(model, v, &|s| match Some(s) == x_value {
                true => Some(x.to_vec()),
                false => dims_of(s),
            })
        })
        .filter(|s| !s.is_empty());
    if input(3).is_some() && sizes.is_none() && scales.is_none() && y.is_none() {
        return Err("its sizes are not constant and its output shape is not known".into());
    }
    let mut out = Vec::new();
    for (k, &axis) in axes.iter().enumerate() {
        let known_in = x[axis].known();
        let given_scale = scales.as_ref().and_then(|s| s.get(k).copied());
        let output: Option<Dim> = match (&sizes, given_scale, known_in) {
            (Some(s), ..) => s.get(k).cloned(),
            (None, Some(s), Some(i)) => Some(Dim::Known((i as f64 * s as f64).floor() as i64)),
            _ => y.and_then(|y| y.get(axis)).cloned(),
        };
        // Unchanged: the same length, or the same named one (the batch).
        let unchanged = output
            .as_ref()
            .is_some_and(|o| *o == x[axis] && *o != Dim::Unknown);
        if given_scale == Some(1.0) || (given_scale.is_none() && unchanged) {
            continue;
        }
        let (Some(input_len), Some(output_len)) = (known_in, output.as_ref().and_then(Dim::known))
        else {
            return Err(format!(
                "the length of axis {axis} before or after resizing is not known"
            ));
        };
        if input_len <= 0 || output_len <= 0 {
            return Err(format!("axis {axis} resizes {input_len} to {output_len}"));
        }
        if output_len.saturating_mul(input_len) > MAX_WEIGHTS {
            return Err(format!(
                "axis {axis} resizes {input_len} to {output_len}: the gradient's {output_len} x {input_len} weights are more than {MAX_WEIGHTS}"
            ));
        }
        let scale = given_scale.unwrap_or(output_len as f32 / input_len as f32);
        if !(scale.is_finite() && scale > 0.0) {
            return Err(format!("axis {axis} has scale {scale}"));
        }
        out.push(AxisPlan {
            axis,
            input: input_len as usize,
            output: output_len as usize,
            scale,
        });
    }
    Ok(out)
}

/// The output dims for the shape facts: the input's, with each resized axis's new length,
/// or unknown lengths of the same rank where the node does not tell them.
pub fn output_dims(
    model: &Model,
    node: NodeId,
    x: &[Dim],
    dims_of: &dyn Fn(ValueId) -> Option<Vec<Dim>>,
) -> Vec<Dim> {
    let Ok(plans) = plan(model, node, x, None, dims_of) else {
        return vec![Dim::Unknown; x.len()];
    };
    let mut dims = x.to_vec();
    for a in plans {
        dims[a.axis] = Dim::Known(a.output as i64);
    }
    dims
}

fn settings(model: &Model, node: NodeId) -> Result<Settings, String> {
    let p = &model.node(node).proto;
    Ok(Settings {
        mode: attr_string_or(model, node, "mode", "nearest")?,
        transform: attr_string_or(model, node, "coordinate_transformation_mode", "half_pixel")?,
        nearest_mode: attr_string_or(model, node, "nearest_mode", "round_prefer_floor")?,
        cubic_a: p.attr_float("cubic_coeff_a")?.unwrap_or(-0.75),
        exclude_outside: p.attr_int("exclude_outside")?.unwrap_or(0) != 0,
    })
}

/// The input coordinate output position `o` reads, in float32 as ONNX Runtime computes it.
fn source_coordinate(s: &Settings, a: &AxisPlan, o: usize) -> Result<f32, String> {
    let (o, scale) = (o as f32, a.scale);
    let (input, output) = (a.input as f32, a.output as f32);
    Ok(match s.transform.as_str() {
        "half_pixel" => (o + 0.5) / scale - 0.5,
        "pytorch_half_pixel" if a.output > 1 => (o + 0.5) / scale - 0.5,
        "pytorch_half_pixel" => 0.0,
        "half_pixel_symmetric" => {
            let adjustment = output / (scale * input);
            let centre = input / 2.0;
            centre * (1.0 - adjustment) + (o + 0.5) / scale - 0.5
        }
        "align_corners" if a.output > 1 => o * (input - 1.0) / (output - 1.0),
        "align_corners" => 0.0,
        "asymmetric" => o / scale,
        // Removed from ONNX at opset 13, still run by ONNX Runtime, and what tf2onnx writes
        // for Keras's UpSampling2D.
        "tf_half_pixel_for_nn" => (o + 0.5) / scale,
        other => {
            return Err(format!(
                "coordinate_transformation_mode '{other}' is not supported"
            ))
        }
    })
}

fn nearest_index(mode: &str, x: f32) -> Result<f32, String> {
    let is_half = x.fract().abs() == 0.5;
    Ok(match mode {
        "round_prefer_floor" if is_half => x.floor(),
        "round_prefer_ceil" if is_half => x.ceil(),
        "round_prefer_floor" | "round_prefer_ceil" => x.round(),
        "floor" => x.floor(),
        "ceil" => x.ceil(),
        other => return Err(format!("nearest_mode '{other}' is not supported")),
    })
}

/// Keys' cubic convolution weights of the taps ⌊x⌋-1 .. ⌊x⌋+2, at r = x - ⌊x⌋.
fn cubic_weights(a: f64, r: f64) -> [f64; 4] {
    let outer = |t: f64| ((a * t - 5.0 * a) * t + 8.0 * a) * t - 4.0 * a;
    let inner = |t: f64| ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0;
    [outer(r + 1.0), inner(r), inner(1.0 - r), outer(2.0 - r)]
}

/// `A[o][i]`, the weight of input position `i` in output position `o`.
fn weights(s: &Settings, a: &AxisPlan) -> Result<Vec<Vec<f64>>, String> {
    let last = a.input as i64 - 1;
    let clamp = |i: i64| i.clamp(0, last) as usize;
    let mut matrix = vec![vec![0.0f64; a.input]; a.output];
    for (o, row) in matrix.iter_mut().enumerate() {
        let x = source_coordinate(s, a, o)?;
        match s.mode.as_str() {
            "nearest" => row[clamp(nearest_index(&s.nearest_mode, x)? as i64)] = 1.0,
            "linear" => {
                let x = x.clamp(0.0, last as f32);
                let i0 = x.floor() as i64;
                let r = (x - x.floor()) as f64;
                row[clamp(i0)] += 1.0 - r;
                row[clamp(i0 + 1)] += r;
            }
            "cubic" => {
                let base = x.floor() as i64;
                let taps = cubic_weights(s.cubic_a as f64, (x - x.floor()) as f64);
                let inside = |i: i64| (0..=last).contains(&i);
                let kept: f64 = (0..4)
                    .filter(|t| !s.exclude_outside || inside(base - 1 + t))
                    .map(|t| taps[t as usize])
                    .sum();
                for (t, w) in taps.iter().enumerate() {
                    let i = base - 1 + t as i64;
                    if s.exclude_outside {
                        if inside(i) {
                            row[i as usize] += w / kept;
                        }
                    } else {
                        row[clamp(i)] += w;
                    }
                }
            }
            other => return Err(format!("mode '{other}' is not supported")),
        }
    }
    Ok(matrix)
}

/// Whether the axis repeats each input position `out / in` times in order (nearest
/// upsampling by a whole factor): its gradient sums blocks instead of multiplying.
fn whole_repeat(matrix: &[Vec<f64>], a: &AxisPlan) -> Option<usize> {
    if !a.output.is_multiple_of(a.input) {
        return None;
    }
    let factor = a.output / a.input;
    let repeats = matrix.iter().enumerate().all(|(o, row)| {
        row.iter()
            .enumerate()
            .all(|(i, w)| *w == if i == o / factor { 1.0 } else { 0.0 })
    });
    repeats.then_some(factor)
}

pub fn resize(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let x = cx.input(node, 0)?;
    let y = cx.forward_output(node, 0)?;
    let h = format!("{}_grad", cx.model().name(x));
    if cx.opset() < 11 {
        return Err(cx.error(
            node,
            "Resize before opset 11 has other coordinate rules; export with opset 11 or later"
                .into(),
        ));
    }
    let refuse = |cx: &Grad<'_>, m: String| cx.error(node, m);
    let model = cx.model();
    let s = settings(model, node).map_err(|m| refuse(cx, m))?;
    if s.transform == "tf_crop_and_resize" {
        return Err(refuse(
            cx,
            "coordinate_transformation_mode 'tf_crop_and_resize' is not supported".into(),
        ));
    }
    let x_dims = cx.facts(x).dims.ok_or_else(|| {
        refuse(
            cx,
            format!(
                "the rank of '{}' is neither declared nor derivable",
                cx.model().name(x)
            ),
        )
    })?;
    let y_dims = cx.facts(y).dims;
    let plans = plan(cx.model(), node, &x_dims, y_dims.as_deref(), &|v| {
        cx.facts(v).dims
    })
    .map_err(|m| refuse(cx, m))?;
    let antialias = cx.int_attr(node, "antialias", 0)? != 0;
    if antialias && s.mode != "nearest" && plans.iter().any(|a| a.output < a.input) {
        return Err(refuse(
            cx,
            "antialias when downsampling is not supported".into(),
        ));
    }
    let elem = cx.elem(node, x)?;
    let rank = x_dims.len();
    let mut g = dy;
    // Last axis first: each step turns one axis from its output length to its input length.
    for a in plans.iter().rev() {
        let matrix = weights(&s, a).map_err(|m| refuse(cx, m))?;
        g = match whole_repeat(&matrix, a) {
            Some(factor) => sum_blocks(cx, g, a, factor, &h),
            None => apply_transposed(cx, g, a, &matrix, elem, rank, &h)?,
        };
    }
    let facts = cx.facts(x);
    cx.shapes.set(g, facts);
    let mut out = vec![None; wants.len().max(1)];
    out[0] = Some(g);
    Ok(out)
}

/// Nearest upsampling by a whole factor along `a.axis`: view the axis as
/// [input, factor] and sum the factor away.
fn sum_blocks(cx: &mut Grad<'_>, g: ValueId, a: &AxisPlan, factor: usize, h: &str) -> ValueId {
    let g_shape = cx.op("Shape", &[g], vec![], h);
    let split = split_axis(cx, g, g_shape, a.axis, a.input as i64, factor as i64, h);
    cx.reduce("ReduceSum", split, &[a.axis as i64 + 1], false, h)
}

/// `Reshape(g, shape(g)[..axis] ++ [input, factor] ++ shape(g)[axis+1..])`.
fn split_axis(
    cx: &mut Grad<'_>,
    g: ValueId,
    g_shape: ValueId,
    axis: usize,
    input: i64,
    factor: i64,
    h: &str,
) -> ValueId {
    let mut parts = Vec::new();
    if axis > 0 {
        let (starts, ends) = (cx.ints(&[0]), cx.ints(&[axis as i64]));
        parts.push(cx.op("Slice", &[g_shape, starts, ends], vec![], h));
    }
    parts.push(cx.ints(&[input, factor]));
    let (starts, ends) = (cx.ints(&[axis as i64 + 1]), cx.ints(&[i64::MAX]));
    parts.push(cx.op("Slice", &[g_shape, starts, ends], vec![], h));
    let shape = cx.op("Concat", &parts, vec![attr_int("axis", 0)], h);
    cx.op("Reshape", &[g, shape], vec![], h)
}

/// `g ×_axis Aᵀ`: a MatMul with the constant matrix, the axis moved last and back.
fn apply_transposed(
    cx: &mut Grad<'_>,
    g: ValueId,
    a: &AxisPlan,
    matrix: &[Vec<f64>],
    elem: i32,
    rank: usize,
    h: &str,
) -> Result<ValueId, PassError> {
    let flat: Vec<f64> = matrix.iter().flatten().copied().collect();
    let dims = [a.output as i64, a.input as i64];
    // float64 models get float64 weights; every other type float32 ones, cast to the
    // model's type where that is a half type.
    let tensor = if elem == DataType::Double as i32 {
        tensor_f64(&dims, &flat)
    } else {
        let as_f32: Vec<f32> = flat.iter().map(|w| *w as f32).collect();
        tensor_f32(&dims, &as_f32)
    };
    let name = format!("{h}_resize_weights");
    let mut w =
        cx.b.model
            .add_initializer(crate::ir::BodyId::MAIN, &name, tensor);
    if elem != DataType::Double as i32 && elem != DataType::Float as i32 {
        w = cx.op("Cast", &[w], vec![attr_int("to", elem as i64)], h);
    }
    Ok(matmul_along(cx, g, w, a.axis, rank, h))
}

/// `g[.., o, ..] -> Σ_o g[.., o, ..] · W[o, i]` along `axis`.
fn matmul_along(
    cx: &mut Grad<'_>,
    g: ValueId,
    w: ValueId,
    axis: usize,
    rank: usize,
    h: &str,
) -> ValueId {
    if axis + 1 == rank {
        return cx.op("MatMul", &[g, w], vec![], h);
    }
    let mut perm: Vec<i64> = (0..rank as i64).collect();
    perm.swap(axis, rank - 1);
    let moved = cx.op("Transpose", &[g], vec![attr_ints("perm", &perm)], h);
    let product = cx.op("MatMul", &[moved, w], vec![], h);
    cx.op("Transpose", &[product], vec![attr_ints("perm", &perm)], h)
}
