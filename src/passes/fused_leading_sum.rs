//! Sums over leading axes on onnx-ga's `LeadingSum` kernel, in memory, for an ONNX Runtime
//! session: `ReduceSum(X, axes = [0, j))` becomes `LeadingSum(X; axes = j)`, with the same
//! `keepdims` and the session's thread count (the kernel's tasks); [`crate::fused_ops`] has
//! what it computes. The step file is never rewritten: it stays standard ONNX.
//! Bit-identical: the kernel adds each column's rows in ONNX Runtime's order.
//!
//! Why: backward graphs sum over the batch this way (a linear layer's bias gradient; the
//! convolutions' weight gradients, summed over the images, `passes/legalize/conv_grad.rs`),
//! and ONNX Runtime 1.31.1's `ReduceSum` of that shape is slow, slower on two threads than
//! on one: `[32, 18432]` over axis 0 72 µs on one thread, 733 on two (benches/README.md,
//! "Run AA").
//!
//! Matched: a float32 X of known rank r (or a Y of known rank without `keepdims`), the
//! axes a constant set that is `[0, j)` for some 0 < j < r. The kernel reads the sizes at run time, so nothing else about X need be known.
//! A sum over every axis is left alone: ONNX Runtime adds those in Eigen's vectorised
//! order, not row by row, so the kernel would not give its bits (nor its speed, on one
//! column).
//!
//! It runs after onnx-ga's other kernels took theirs (the layer-norm and BatchNorm
//! gradients sum over leading axes inside their kernels), so it reads the element types of
//! the model as it stood before them: its values keep their names, and the facts do not
//! pass through onnx-ga's operators.

use super::autodiff::shapes::{constant_ints, Facts};
use super::fuse::input;
use crate::fused_ops::{DOMAIN, LEADING_SUM};
use crate::ir::builder::{attr_int, Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "fused-leading-sum";

/// A session's model with its sums over leading axes on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// `ReduceSum` nodes rewritten.
    pub sums: usize,
}

/// `model` with every sum the module's pattern matches on `LeadingSum`; `None` when none
/// is. `facts_from`: the same model before onnx-ga's operators replaced some of its nodes.
/// `threads`: the session's, over which each kernel spreads its columns.
pub fn rewrite(
    model: &ModelProto,
    facts_from: &super::FactsBefore<'_>,
    threads: usize,
) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "ReduceSum") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let session_facts = super::SessionFacts::new(facts_from, &ir);
    let facts = |v: ValueId| session_facts.get(&ir, v);
    let found: Vec<(NodeId, ValueId, Leading)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| leading_sum(&ir, n, &facts).map(|(x, sum)| (n, x, sum)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for &(sum, x, Leading { axes, keepdims }) in &found {
        let y = ir.output(sum, 0);
        let hint = format!("{}.fused", ir.name(y));
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            LEADING_SUM,
            DOMAIN,
            &[Some(x)],
            &[&hint],
            vec![
                attr_int("axes", axes),
                attr_int("keepdims", keepdims),
                attr_int("threads", threads as i64),
            ],
        );
        ir.place_after(node, sum);
        let fused = ir.output(node, 0);
        ir.replace_value(y, fused);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        sums: found.len(),
    }))
}

/// What a matched sum keeps: how many leading axes it sums, and `keepdims`.
#[derive(Clone, Copy)]
struct Leading {
    axes: i64,
    keepdims: i64,
}

/// The pattern of the module's comment at `sum`: X and the sum's attributes.
fn leading_sum(
    model: &Model,
    sum: NodeId,
    facts: &dyn Fn(ValueId) -> Facts,
) -> Option<(ValueId, Leading)> {
    let node = model.node(sum);
    let p = &node.proto;
    if node.body != BodyId::MAIN
        || p.op_type() != "ReduceSum"
        || !normalize_domain(p.domain()).is_empty()
        || !super::only_attributes(p, &["axes", "keepdims", "noop_with_empty_axes"])
        || node.outputs.len() != 1
    {
        return None;
    }
    let x = input(model, sum, 0)?;
    let axes = match input(model, sum, 1) {
        Some(axes) => constant_ints(model, axes)?,
        // Before opset 13 the axes are an attribute; absent, the sum is over every axis
        // (or none): left as written.
        None => p.attr_ints("axes").ok()??,
    };
    let keepdims = p.attr_int("keepdims").ok()?.unwrap_or(1);
    let (fx, fy) = (facts(x), facts(model.output(sum, 0)));
    let float32 = Some(DataType::Float as i32);
    if fx.elem != float32 && fy.elem != float32 {
        return None;
    }
    // X's rank, or else Y's plus the axes summed away (without keepdims; a loss gradient's
    // shape is often not inferred, its bias gradient's is declared).
    let rank = match (fx.rank(), fy.rank()) {
        (Some(rank), _) => rank as i64,
        (None, Some(kept)) if keepdims == 0 && axes.iter().all(|&a| a >= 0) => {
            (kept + axes.len()) as i64
        }
        _ => return None,
    };
    let mut axes: Vec<i64> = axes
        .into_iter()
        .map(|a| if a < 0 { a + rank } else { a })
        .collect();
    axes.sort_unstable();
    axes.dedup();
    let leading = !axes.is_empty()
        && (axes.len() as i64) < rank
        && axes.iter().enumerate().all(|(i, &a)| a == i as i64);
    leading.then_some((
        x,
        Leading {
            axes: axes.len() as i64,
            keepdims: (keepdims != 0) as i64,
        },
    ))
}
