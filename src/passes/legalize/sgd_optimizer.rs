//! `com.microsoft::SGDOptimizerV2(lr, params, grads [, update]) -> (update_completed
//! [, params'])`: plain SGD over sequences of tensors, in place:
//!
//! ```text
//! p ← p - lr · g
//! ```
//!
//! Sequences, state and the update flag are handled as for AdamWOptimizer (see
//! `adamw_optimizer`): the sequences must be SequenceConstructs of this graph (else the
//! optimizer pass uses [`lower_sgd_for_params`]), next values of graph inputs become
//! graph outputs `<param>.next` with `param` state, and a false `update` keeps `p`.

use super::adamw_optimizer::{
    expose_state, same_lengths, scalar_of, sequence_elements, updated_flag, updated_sequence,
};
use super::Lowering;
use crate::ir::builder::Builder;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::state::Role;

/// Emits `p - lr·g` for each `(p, g)` of `params` into `b`'s body; `lr` float `[]` or `[1]`;
/// with `update`, a bool that when false keeps `p`. Next values are named `<param>.next`.
pub fn lower_sgd_for_params(
    b: &mut Builder<'_>,
    lr: ValueId,
    update: Option<ValueId>,
    params: &[(ValueId, ValueId)],
) -> Vec<ValueId> {
    let mut rank0 = None;
    let lr = scalar_of(b, &mut rank0, lr, "lr");
    let update = update.map(|u| scalar_of(b, &mut rank0, u, "update"));
    params
        .iter()
        .map(|&(p, g)| {
            let next = format!("{}.next", b.model.name(p));
            let step = b.op(
                "Mul",
                &[g, lr],
                vec![],
                &format!("{}.update", b.model.name(p)),
            );
            match update {
                None => b.op("Sub", &[p, step], vec![], &next),
                Some(u) => {
                    let stepped = b.op("Sub", &[p, step], vec![], &format!("{next}.staged"));
                    b.op("Where", &[u, stepped, p], vec![], &next)
                }
            }
        })
        .collect()
}

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let lr = l.input(node, 0)?;
    let update = l.optional_input(node, 3);
    let params = sequence_elements(l, node, 1)?;
    let grads = sequence_elements(l, node, 2)?;
    same_lengths(l, node, &[&params, &grads])?;
    let pairs: Vec<(ValueId, ValueId)> =
        params.iter().copied().zip(grads.iter().copied()).collect();
    let next = lower_sgd_for_params(&mut l.b, lr, update, &pairs);

    updated_flag(l, node, lr, update);
    updated_sequence(l, node, 1, &next);
    for (p, n) in params.iter().zip(&next) {
        expose_state(l, node, *p, *n, Role::Param, None);
    }
    Ok(())
}
