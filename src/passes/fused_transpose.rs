//! Transposes that keep the last axis last on onnx-ga's `RowTranspose` kernel, in memory,
//! for an ONNX Runtime session: `Transpose(X; perm)` with `perm[r-1] = r-1` becomes
//! `RowTranspose(X; perm)` ([`crate::fused_ops`] has what it computes). The step file is
//! never rewritten: it stays standard ONNX. A copy of every element: the same bits.
//!
//! Why: ONNX Runtime 1.31.1 moves the rows of a transformer's head split and merge
//! (`[B, T, H, D]` <-> `[B, H, T, D]`) slowly and on one thread; the kernel copies whole
//! rows, spread over the session's threads (benches/README.md, "Run AF").
//!
//! Matched: a `Transpose` of the main graph with a `perm` attribute of rank 3 or more that
//! moves some axis and keeps the last one last, a float32 X of that rank whose last
//! dimension is at least [`MIN_ROW`] or not known (facts from the model before onnx-ga's
//! operators, as `passes::fused_leading_sum` reads them). Exported transformers compute
//! their head shapes at run time (`Reshape` by a `Concat` of `Shape`s), so the head size is
//! often not known here; the kernel copies rows of any length.

use super::autodiff::shapes::Facts;
use crate::fused_ops::{DOMAIN, ROW_TRANSPOSE};
use crate::ir::builder::{attr_ints, Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "fused-transpose";

/// The fewest elements in a row for which the pass rewrites: a shorter row is a short copy,
/// where ONNX Runtime's own element-wise transposes are made for.
pub const MIN_ROW: i64 = 16;

/// A session's model with its row transposes on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// `Transpose` nodes rewritten.
    pub transposes: usize,
}

/// `model` with every transpose the module's pattern matches on `RowTranspose`; `None` when
/// none is. `facts_from`: the same model before onnx-ga's operators replaced some of its
/// nodes.
pub fn rewrite(
    model: &ModelProto,
    facts_from: &super::FactsBefore<'_>,
) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "Transpose") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let session_facts = super::SessionFacts::new(facts_from, &ir);
    let facts = |v: ValueId| session_facts.get(&ir, v);
    let found: Vec<(NodeId, ValueId, Vec<i64>)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| row_transpose(&ir, n, &facts).map(|(x, perm)| (n, x, perm)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (transpose, x, perm) in &found {
        let y = ir.output(*transpose, 0);
        let hint = format!("{}.rows", ir.name(y));
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            ROW_TRANSPOSE,
            DOMAIN,
            &[Some(*x)],
            &[&hint],
            vec![attr_ints("perm", perm)],
        );
        ir.place_after(node, *transpose);
        let fused = ir.output(node, 0);
        ir.replace_value(y, fused);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        transposes: found.len(),
    }))
}

/// The pattern of the module's comment at `transpose`: X and the permutation.
fn row_transpose(
    model: &Model,
    transpose: NodeId,
    facts: &dyn Fn(ValueId) -> Facts,
) -> Option<(ValueId, Vec<i64>)> {
    let node = model.node(transpose);
    let p = &node.proto;
    if node.body != BodyId::MAIN
        || p.op_type() != "Transpose"
        || !normalize_domain(p.domain()).is_empty()
        || !super::only_attributes(p, &["perm"])
        || node.inputs.len() != 1
        || node.outputs.len() != 1
    {
        return None;
    }
    let x = node.inputs[0]?;
    let perm = p.attr_ints("perm").ok()??;
    let rank = perm.len() as i64;
    let permutation = {
        let mut sorted = perm.clone();
        sorted.sort_unstable();
        sorted.iter().copied().eq(0..rank)
    };
    let moves = perm.iter().copied().ne(0..rank);
    if rank < 3 || !permutation || !moves || perm[perm.len() - 1] != rank - 1 {
        return None;
    }
    let f = facts(x);
    let row = match f.dims.as_ref() {
        Some(d) if d.len() == perm.len() => d.last().and_then(|d| d.known()),
        _ => return None,
    };
    (f.elem == Some(DataType::Float as i32) && row.is_none_or(|r| r >= MIN_ROW))
        .then_some((x, perm))
}
