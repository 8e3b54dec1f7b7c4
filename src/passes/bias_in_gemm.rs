//! A linear layer's bias added inside its product, in memory, for an ONNX Runtime session.
//!
//! Exporters write `Linear` on an input of more than two axes (a transformer's `[B, T, d]`)
//! as a `MatMul` and an `Add` of the bias: the product writes `[B·T, N]` floats, then the
//! `Add` reads them back and writes another `[B·T, N]`. A `Gemm` takes the bias as its C
//! input: ONNX Runtime copies the bias into each row of Y and the product accumulates onto
//! it (MLAS with beta = 1), so the second pass over Y and the second buffer go. Standard ops
//! only; the step file is never rewritten.
//!
//! ```text
//! Y = Add(MatMul(A[.., K], W[K, N]), b[N])
//!   ->  Y = Reshape(Gemm(Reshape(A, [-1, K]), W, b), [d0, .., N])
//! ```
//!
//! Reshape moves no data. Matched: W of static shape `[K, N]`, b of shape `[N]`, both
//! float32, the product read by the `Add` alone, and A either
//!
//! - of rank at least 3 with at most one of its leading axes unknown: Y's shape is a
//!   constant, that axis its -1;
//! - or of unknown rank or more unknown axes (a transformer's heads merged by a `Reshape`
//!   to a shape computed at run time): Y's shape is computed too,
//!   `Concat(Shape(A, end = -1), [N])` (opset 15 on).
//!
//! A rank-2 A is left to ONNX Runtime, whose own optimizer fuses that case. Within float32
//! rounding, not bit for bit: the bias enters the sum first instead of last (`b + Σ`
//! against `Σ + b`, over MLAS's blocks of K).

use super::autodiff::shapes::{Dim, Facts, Shapes};
use super::fuse::{input, is_op, read_only_by};
use crate::ir::builder::{attr_int, Builder};
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "bias-in-gemm";

/// A session's model with its linear layers' biases inside their products.
pub struct Rewritten {
    pub model: ModelProto,
    /// `MatMul` + `Add` pairs rewritten.
    pub biases: usize,
}

/// `model` with every pair the module's pattern matches on one `Gemm`; `None` when none is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "MatMul") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    // `Shape`'s `end` attribute, for a shape computed at run time, is opset 15's.
    let shape_end = ir.opset("").is_some_and(|v| v >= 15);
    let found: Vec<(NodeId, Found)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| linear_with_bias(&ir, &shapes, n, shape_end).map(|found| (n, found)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (add, found) in &found {
        let y = ir.output(*add, 0);
        let hint = format!("{}.gemm", ir.name(y));
        let mut b = Builder::new(&mut ir, BodyId::MAIN, PASS);
        let rows = b.ints(&format!("{hint}.rows"), &[-1, found.k]);
        let a2 = b.op("Reshape", &[found.a, rows], vec![], &hint);
        let product = b.op("Gemm", &[a2, found.w, found.bias], vec![], &hint);
        let shape = match &found.shape {
            YShape::Known(dims) => b.ints(&format!("{hint}.shape"), dims),
            YShape::AtRunTime { n } => {
                let leading = b.op("Shape", &[found.a], vec![attr_int("end", -1)], &hint);
                let last = b.ints(&format!("{hint}.columns"), &[*n]);
                b.op("Concat", &[leading, last], vec![attr_int("axis", 0)], &hint)
            }
        };
        let reshaped = b.op("Reshape", &[product, shape], vec![], &hint);
        ir.replace_value(y, reshaped);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        biases: found.len(),
    }))
}

/// A `MatMul` + bias `Add` the pass rewrites.
struct Found {
    a: ValueId,
    w: ValueId,
    bias: ValueId,
    /// The contracted axis: A's last, W's first.
    k: i64,
    shape: YShape,
}

/// The product's shape, which the result is reshaped back to.
enum YShape {
    /// Known but for at most one leading axis of A, which is -1.
    Known(Vec<i64>),
    /// A's leading axes and N, read at run time.
    AtRunTime { n: i64 },
}

/// The pattern of the module's comment, ending at the `Add` `add`; a shape known only at
/// run time when `shape_end` (the `Shape` op has `end`).
fn linear_with_bias(model: &Model, shapes: &Shapes, add: NodeId, shape_end: bool) -> Option<Found> {
    if !is_op(model, add, "Add", 2) || model.node(add).body != BodyId::MAIN {
        return None;
    }
    let operands = [input(model, add, 0)?, input(model, add, 1)?];
    let (matmul, bias) = operands.into_iter().enumerate().find_map(|(i, v)| {
        let (n, 0) = model.producer(v)? else {
            return None;
        };
        let is_product = is_op(model, n, "MatMul", 2) && read_only_by(model, v, &[add]);
        is_product.then_some((n, operands[1 - i]))
    })?;
    let (a, w) = (input(model, matmul, 0)?, input(model, matmul, 1)?);
    let float32 = |f: &Facts| f.elem == Some(DataType::Float as i32);
    let (fa, fw, fb) = (shapes.get(a), shapes.get(w), shapes.get(bias));
    if !float32(&fw) || !float32(&fb) {
        return None;
    }
    let [k, n] = fw.static_dims()?[..] else {
        return None;
    };
    if fb.static_dims()? != [n] {
        return None;
    }
    // A's type is W's when the graph is valid (a MatMul's operands share theirs), so an
    // unknown one is float32 too.
    if fa.elem.is_some_and(|e| e != DataType::Float as i32) {
        return None;
    }
    let at_run_time = shape_end.then_some(YShape::AtRunTime { n });
    let shape = match &fa.dims {
        None => at_run_time?,
        Some(a_dims) => {
            let (last, leading) = a_dims.split_last()?;
            if leading.len() < 2 || last.known().is_some_and(|d| d != k) {
                return None;
            }
            let unknown = leading
                .iter()
                .filter(|d| !matches!(d, Dim::Known(_)))
                .count();
            if unknown > 1 {
                at_run_time?
            } else {
                let mut dims: Vec<i64> = leading.iter().map(|d| d.known().unwrap_or(-1)).collect();
                dims.push(n);
                YShape::Known(dims)
            }
        }
    };
    Some(Found {
        a,
        w,
        bias,
        k,
        shape,
    })
}
