//! The gradient of an `If` whose condition is known only at run time (a branch on data:
//! `torch.cond`, TensorFlow's `tf.cond`): a second If on the same condition, each of its
//! branches the gradient of its forward twin. An If the shape facts decide is no If by then:
//! `normalize` inlines the branch it takes.
//!
//! ```text
//! forward    Y = If(c)   then: () -> Y_then      else: () -> Y_else
//!            W: the outer values the branches read (parameters, activations)
//! backward   dW = If(c)  then: Y_then recomputed;  dW = dY · ∂Y_then/∂W   (the rules)
//!                        else: Y_else recomputed;  dW = dY · ∂Y_else/∂W
//!            zeros for a W the branch does not read or its gradient does not reach
//! ```
//!
//! The branch's intermediates are recomputed in the backward, not kept: the two branches
//! compute different intermediates while an If returns one list from both, so the forward
//! could keep them only padded to both branches' sets. The branch taken runs twice per
//! step, as a kept Loop's body does (`loop_grad`).
//!
//! Control flow inside a branch (an If, a Loop) is recomputed with it and differentiated by
//! the same sweep: a nested If by a nested backward If, a Loop by `loop_grad`.
//!
//! Not differentiated (the error says why): a branch drawing random numbers or normalising
//! with batch statistics (Dropout, the random ops, BatchNormalization), at any depth: its
//! recomputation would draw again, and the normalisation that turns those into their
//! training forms (`normalize`) works on the main graph.

use std::collections::HashMap;

use crate::ir::builder::Builder;
use crate::ir::inline::Branch;
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::passes::PassError;

use super::loop_parts::{computed_here, not_copied, not_recomputable, recompute};
use super::rules::Grad;
use super::shapes::type_of_facts;
use super::{is_float, PASS};

/// Whether node `n` is an If (default domain).
pub fn is_if(model: &Model, n: NodeId) -> bool {
    let p = &model.node(n).proto;
    p.op_type() == "If" && crate::ir::normalize_domain(p.domain()).is_empty()
}

/// Why the If `n` has no gradient here, when it has none.
pub fn why_not(model: &Model, n: NodeId) -> Option<String> {
    let branches = match branches(model, n) {
        Ok(b) => b,
        Err(why) => return Some(why),
    };
    for (branch, body) in [Branch::Then, Branch::Else].into_iter().zip(branches) {
        let label = branch.attribute();
        if let Some(why) = not_recomputable(model, body, label, false) {
            return Some(why);
        }
        if let Some(why) = not_copied(model, body) {
            return Some(format!("its {label}: {why}"));
        }
        let want = model.node(n).outputs.len();
        let have = model.body(body).outputs.len();
        if have != want {
            return Some(format!(
                "its {label} returns {have} values for {want} outputs"
            ));
        }
    }
    None
}

fn branches(model: &Model, n: NodeId) -> Result<[BodyId; 2], String> {
    let get = |b: Branch| {
        model
            .if_branch(n, b)
            .ok_or_else(|| format!("it has no {}", b.attribute()))
    };
    Ok([get(Branch::Then)?, get(Branch::Else)?])
}

/// The gradient contributions of the If `n` (the gradients `dys` reach its outputs), as
/// (value, contribution) pairs: the outer values its branches read that `depends` on a
/// parameter.
pub fn gradients(
    cx: &mut Grad<'_>,
    n: NodeId,
    dys: &[Option<ValueId>],
    depends: &dyn Fn(ValueId) -> bool,
) -> Result<Vec<(ValueId, ValueId)>, PassError> {
    let forward = branches(cx.model(), n).map_err(|why| cx.error(n, why))?;
    let Some(Some(condition)) = cx.model().node(n).inputs.first().copied() else {
        return Err(cx.error(n, "it has no condition".into()));
    };
    let mut wanted: Vec<ValueId> = forward
        .iter()
        .flat_map(|b| cx.model().captures(*b))
        .filter(|w| cx.facts(*w).elem.is_some_and(is_float) && depends(*w))
        .collect();
    wanted.sort();
    wanted.dedup();
    // Only the float outputs a gradient reaches seed the backward.
    let seeded: Vec<(usize, ValueId)> = dys
        .iter()
        .enumerate()
        .filter_map(|(slot, d)| Some((slot, (*d)?)))
        .filter(|(slot, _)| {
            let out = cx.model().node(n).outputs.get(*slot).copied().flatten();
            out.is_some_and(|o| cx.facts(o).elem.is_some_and(is_float))
        })
        .collect();
    if wanted.is_empty() || seeded.is_empty() {
        return Ok(Vec::new());
    }

    let hints: Vec<String> = wanted
        .iter()
        .map(|w| format!("{}_grad", cx.model().name(*w)))
        .collect();
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    let back = cx.b.node("If", "", &[Some(condition)], &hint_refs, vec![]);
    for (slot, w) in wanted.iter().enumerate() {
        let out = cx.model().output(back, slot);
        let facts = cx.facts(*w);
        cx.shapes.set(out, facts);
    }
    for (branch, body) in [Branch::Then, Branch::Else].into_iter().zip(forward) {
        let back_body = cx.b.model.add_subgraph(back, branch.attribute());
        let mut inner = Grad::new(
            Builder::new(&mut *cx.b.model, back_body, PASS),
            &mut *cx.shapes,
        );
        branch_gradient(&mut inner, n, body, &seeded, &wanted)?;
    }
    Ok(wanted
        .iter()
        .enumerate()
        .map(|(slot, w)| (*w, cx.model().output(back, slot)))
        .collect())
}

/// One branch of the backward If, built by `g` in its body: the forward branch `forward`
/// recomputed, the rules' sweep from its outputs (seeded by the If outputs' gradients) to
/// the outer values `wanted`, each gradient a branch output (zeros where none reaches it).
fn branch_gradient(
    g: &mut Grad<'_>,
    n: NodeId,
    forward: BodyId,
    seeded: &[(usize, ValueId)],
    wanted: &[ValueId],
) -> Result<(), PassError> {
    let mut copies = HashMap::new();
    recompute(g, forward, &mut copies);
    let returned: Vec<ValueId> = g
        .model()
        .body(forward)
        .outputs
        .iter()
        .map(|(v, _)| *v)
        .collect();
    // A branch may return an outer value itself: its gradient is the seed.
    let seeds: Vec<(ValueId, ValueId)> = seeded
        .iter()
        .filter_map(|(slot, d)| {
            let y = *returned.get(*slot)?;
            Some((copies.get(&y).copied().unwrap_or(y), *d))
        })
        .collect();
    let sums = super::sweep(g, &seeds, wanted)?;
    let body = g.b.body;
    for (w, sum) in wanted.iter().zip(sums) {
        let hint = format!("{}_grad", g.model().name(*w));
        let out = match sum {
            Some(gw) => computed_here(g, gw, &hint),
            None => g.zeros_like(n, *w, &hint)?,
        };
        let facts = g.facts(*w);
        g.b.model.add_output(body, out, type_of_facts(&facts));
    }
    Ok(())
}
