//! The AdamW update of each parameter, as
//! `legalize::adamw_optimizer::lower_adamw_for_params` writes it (12-16 elementwise ops),
//! as one [`AdamWUpdate`](crate::fused_ops::ADAMW_UPDATE) node (see [`super`]).
//!
//! What is matched, anchored at each `Sqrt` (operand order as the lowering writes it):
//!
//! ```text
//! m' = Add(Mul(m, α), Mul(g, 1-α))          v' = Add(Mul(v, β), Mul(Mul(g, 1-β), g))
//! mode 1: δ = Div(Mul(m', lr), Add(Sqrt(v'), ε));            p' = Sub(p, δ)
//!         with decay: s = Sub(p, δ); p' = Sub(s, Mul(s, lr_wd))
//! mode 0: δ = Div(Mul(m', lr), Mul(Add(Sqrt(Div(v', c)), ε), a)); p' = Sub(d, δ)
//!         d = Sub(p, Mul(p, lr_wd)) with decay, else p
//! ```
//!
//! The same g feeds both moments; the window's mean gradient folds in
//! ([`super::gradient_prologue`]).

use super::{
    float32_or_unknown, gradient_prologue, input, is_op, made_by, output, param_rank,
    scalar_or_unknown, sole_use, PASS,
};
use crate::fused_ops::{adamw_slot, ADAMW_UPDATE, DOMAIN};
use crate::ir::builder::Builder;
use crate::ir::{BodyId, Model, NodeId, Use, ValueId};

/// Fuses every AdamW update found in any body of `model`; returns how many.
pub fn fuse_adamw(model: &mut Model) -> usize {
    let anchors: Vec<NodeId> = model
        .all_nodes()
        .filter(|&n| is_op(model, n, "Sqrt", 1))
        .collect();
    let matches: Vec<Update> = anchors
        .into_iter()
        .filter_map(|n| match_update(model, n))
        .collect();
    for u in &matches {
        let mut inputs = vec![None; adamw_slot::COUNT];
        inputs[adamw_slot::PARAM] = Some(u.param);
        inputs[adamw_slot::GRAD] = Some(u.grad);
        inputs[adamw_slot::M] = Some(u.m);
        inputs[adamw_slot::V] = Some(u.v);
        inputs[adamw_slot::ALPHA] = Some(u.alpha);
        inputs[adamw_slot::ONE_MINUS_ALPHA] = Some(u.one_minus_alpha);
        inputs[adamw_slot::BETA] = Some(u.beta);
        inputs[adamw_slot::ONE_MINUS_BETA] = Some(u.one_minus_beta);
        inputs[adamw_slot::EPSILON] = Some(u.epsilon);
        inputs[adamw_slot::LR] = Some(u.lr);
        if let Some((a, c)) = u.corrections {
            inputs[adamw_slot::A] = Some(a);
            inputs[adamw_slot::C] = Some(c);
        }
        inputs[adamw_slot::LR_WD] = u.lr_wd;
        if let Some((x, addend, divisor)) = u.prologue {
            inputs[adamw_slot::GRAD] = Some(x);
            inputs[adamw_slot::GRAD_ADDEND] = addend;
            inputs[adamw_slot::GRAD_DIVISOR] = Some(divisor);
        }
        // Every fixed slot is written, the omitted ones empty: ONNX Runtime counts them
        // before the variadic ordering inputs (`fused_ops`).
        let hints = [u.param_next, u.m_next, u.v_next].map(|v| format!("{}.fused", model.name(v)));
        let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
        let node = Builder::new(model, u.body, PASS).node(
            ADAMW_UPDATE,
            DOMAIN,
            &inputs,
            &hints,
            Vec::new(),
        );
        for (slot, old) in [u.param_next, u.m_next, u.v_next].into_iter().enumerate() {
            let new = model.output(node, slot);
            model.replace_value(old, new);
        }
    }
    matches.len()
}

/// One matched update: its operands and the three values it replaces.
struct Update {
    body: BodyId,
    param: ValueId,
    grad: ValueId,
    m: ValueId,
    v: ValueId,
    alpha: ValueId,
    one_minus_alpha: ValueId,
    beta: ValueId,
    one_minus_beta: ValueId,
    epsilon: ValueId,
    lr: ValueId,
    corrections: Option<(ValueId, ValueId)>,
    lr_wd: Option<ValueId>,
    /// g = (x + addend) / divisor, computed in the kernel: `(x, addend, divisor)`.
    prologue: Option<(ValueId, Option<ValueId>, ValueId)>,
    param_next: ValueId,
    m_next: ValueId,
    v_next: ValueId,
}

fn match_update(model: &Model, sqrt: NodeId) -> Option<Update> {
    let body = model.node(sqrt).body;
    let x = input(model, sqrt, 0)?;
    // Mode 0 divides v' by c under the root; mode 1 takes the root of v' itself.
    let (v_next, c) = match made_by(model, x, "Div", body) {
        Some(div) => (input(model, div, 0)?, Some(input(model, div, 1)?)),
        None => (x, None),
    };
    let (v, beta, grad, one_minus_beta, v_readers) = second_moment(model, v_next, body)?;
    let root = output(model, sqrt);
    let plus_eps = sole_use(model, root, "Add", 0)?;
    let epsilon = input(model, plus_eps, 1)?;
    let (denom_node, a) = match c {
        Some(_) => {
            let times_a = sole_use(model, output(model, plus_eps), "Mul", 0)?;
            (times_a, Some(input(model, times_a, 1)?))
        }
        None => (plus_eps, None),
    };
    let div = sole_use(model, output(model, denom_node), "Div", 1)?;
    let num = made_by(model, input(model, div, 0)?, "Mul", body)?;
    let (m_next, lr) = (input(model, num, 0)?, input(model, num, 1)?);
    let (m, alpha, g2, one_minus_alpha, m_reader) = first_moment(model, m_next, body)?;
    if g2 != grad {
        return None;
    }
    let step = sole_use(model, output(model, div), "Sub", 1)?;
    let base = input(model, step, 0)?;
    let stepped = output(model, step);
    let (param, lr_wd, param_next) = match c {
        // Mode 0: the decay comes first, p - p·lr_wd, then the step.
        Some(_) => match decayed(model, base, body) {
            Some((p, k)) => (p, Some(k), stepped),
            None => (base, None, stepped),
        },
        // Mode 1: the step comes first, then s - s·lr_wd.
        None => match decay_of(model, stepped) {
            Some((k, next)) => (base, Some(k), next),
            None => (base, None, stepped),
        },
    };
    let corrections = match (a, c) {
        (Some(a), Some(c)) => Some((a, c)),
        _ => None,
    };
    let scalars = [
        Some(alpha),
        Some(one_minus_alpha),
        Some(beta),
        Some(one_minus_beta),
        Some(epsilon),
        Some(lr),
        a,
        c,
        lr_wd,
    ];
    let rank = param_rank(model, param)?;
    let readers = [m_reader, v_readers[0], v_readers[1]];
    let prologue = gradient_prologue(model, grad, &readers, rank);
    let float_tensors = [param, grad, m, v]
        .iter()
        .all(|&t| float32_or_unknown(model, t));
    let scalars_ok = scalars
        .iter()
        .flatten()
        .all(|&s| float32_or_unknown(model, s) && scalar_or_unknown(model, s, rank));
    (float_tensors && scalars_ok).then_some(Update {
        body,
        param,
        grad,
        m,
        v,
        alpha,
        one_minus_alpha,
        beta,
        one_minus_beta,
        epsilon,
        lr,
        corrections,
        lr_wd,
        prologue,
        param_next,
        m_next,
        v_next,
    })
}

/// v' = Add(Mul(v, β), Mul(Mul(g, 1-β), g)) -> (v, β, g, 1-β, the two nodes reading g).
fn second_moment(
    model: &Model,
    v_next: ValueId,
    body: BodyId,
) -> Option<(ValueId, ValueId, ValueId, ValueId, [NodeId; 2])> {
    let add = made_by(model, v_next, "Add", body)?;
    let old = made_by(model, input(model, add, 0)?, "Mul", body)?;
    let new = made_by(model, input(model, add, 1)?, "Mul", body)?;
    let scaled = made_by(model, input(model, new, 0)?, "Mul", body)?;
    let g = input(model, scaled, 0)?;
    (input(model, new, 1)? == g).then_some(())?;
    Some((
        input(model, old, 0)?,
        input(model, old, 1)?,
        g,
        input(model, scaled, 1)?,
        [scaled, new],
    ))
}

/// m' = Add(Mul(m, α), Mul(g, 1-α)) -> (m, α, g, 1-α, the node reading g).
fn first_moment(
    model: &Model,
    m_next: ValueId,
    body: BodyId,
) -> Option<(ValueId, ValueId, ValueId, ValueId, NodeId)> {
    let add = made_by(model, m_next, "Add", body)?;
    let old = made_by(model, input(model, add, 0)?, "Mul", body)?;
    let new = made_by(model, input(model, add, 1)?, "Mul", body)?;
    Some((
        input(model, old, 0)?,
        input(model, old, 1)?,
        input(model, new, 0)?,
        input(model, new, 1)?,
        new,
    ))
}

/// d = Sub(p, Mul(p, k)) -> (p, k).
fn decayed(model: &Model, d: ValueId, body: BodyId) -> Option<(ValueId, ValueId)> {
    let sub = made_by(model, d, "Sub", body)?;
    let p = input(model, sub, 0)?;
    let decay = made_by(model, input(model, sub, 1)?, "Mul", body)?;
    (input(model, decay, 0)? == p).then_some((p, input(model, decay, 1)?))
}

/// s read exactly by Mul(s, k) and Sub(s, that Mul) -> (k, the Sub's output).
fn decay_of(model: &Model, s: ValueId) -> Option<(ValueId, ValueId)> {
    let [a, b] = model.uses(s) else {
        return None;
    };
    let node_of = |u: &Use| match *u {
        Use::Node { node, slot: 0 } => Some(node),
        _ => None,
    };
    let (x, y) = (node_of(a)?, node_of(b)?);
    let (mul, sub) = match (is_op(model, x, "Mul", 2), is_op(model, y, "Mul", 2)) {
        (true, false) => (x, y),
        (false, true) => (y, x),
        _ => return None,
    };
    (is_op(model, sub, "Sub", 2) && input(model, sub, 1)? == output(model, mul))
        .then_some((input(model, mul, 1)?, output(model, sub)))
}
