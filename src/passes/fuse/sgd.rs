//! The SGD-family update of each parameter, as the optimizer pass writes it (2-7
//! elementwise ops), as one [`SgdUpdate`](crate::fused_ops::SGD_UPDATE) node (see
//! [`super`]). Anchored at each `Sub` whose first operand is a graph input of the main
//! graph the step's manifest calls a parameter, and whose result leaves its body (the
//! parameter's next value, or its loss-scale gate `Where(ok, p', p)`):
//!
//! ```text
//! p' = Sub(p, Mul(lr, d))
//! d  = g                                    (SGD)
//!    | buf' = Add(Mul(buf, mu), g)           (momentum: d = buf')
//!    | Add(g, Mul(buf', mu))                 (Nesterov, buf' as above, the same mu)
//! g  = Add(g0, Mul(p, wd)) with L2, else g0
//! ```
//!
//! A momentum buffer must be a state input (a moment) and its next value leave the body too. AdamW runs first: its decay
//! `Sub(p, Mul(p, k))` has the parameter, not a scalar, where `lr` stands.

use super::{
    float32_or_unknown, gradient_prologue, input, made_by, output, param_rank, read_only_by,
    scalar_or_unknown, StateNames, PASS,
};
use crate::fused_ops::{sgd_slot, DOMAIN, SGD_UPDATE};
use crate::ir::builder::{attr_int, Builder};
use crate::ir::{BodyId, Model, NodeId, Use, ValueDef, ValueId};

/// Fuses every SGD-family update found in any body of `model`; returns how many.
pub fn fuse_sgd(model: &mut Model, state: &StateNames) -> usize {
    let anchors: Vec<NodeId> = model
        .all_nodes()
        .filter(|&n| super::is_op(model, n, "Sub", 2))
        .collect();
    let matches: Vec<Update> = anchors
        .into_iter()
        .filter_map(|n| match_update(model, n, state))
        .collect();
    for u in &matches {
        let mut inputs = vec![None; sgd_slot::COUNT];
        inputs[sgd_slot::PARAM] = Some(u.param);
        inputs[sgd_slot::GRAD] = Some(u.grad);
        inputs[sgd_slot::LR] = Some(u.lr);
        if let Some(m) = &u.momentum {
            inputs[sgd_slot::BUF] = Some(m.buf);
            inputs[sgd_slot::MU] = Some(m.mu);
        }
        inputs[sgd_slot::WD] = u.wd;
        if let Some((x, addend, divisor)) = u.prologue {
            inputs[sgd_slot::GRAD] = Some(x);
            inputs[sgd_slot::GRAD_ADDEND] = addend;
            inputs[sgd_slot::GRAD_DIVISOR] = Some(divisor);
        }
        // Every fixed slot is written, the omitted ones empty: ONNX Runtime counts them
        // before the variadic ordering inputs (`fused_ops`).
        let mut replaced = vec![u.param_next];
        replaced.extend(u.momentum.as_ref().map(|m| m.buf_next));
        let hints: Vec<String> = replaced
            .iter()
            .map(|&v| format!("{}.fused", model.name(v)))
            .collect();
        let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
        let nesterov = u.momentum.as_ref().is_some_and(|m| m.nesterov);
        let node = Builder::new(model, u.body, PASS).node(
            SGD_UPDATE,
            DOMAIN,
            &inputs,
            &hints,
            vec![attr_int("nesterov", i64::from(nesterov))],
        );
        for (slot, old) in replaced.into_iter().enumerate() {
            let new = model.output(node, slot);
            model.replace_value(old, new);
        }
    }
    matches.len()
}

struct Momentum {
    buf: ValueId,
    mu: ValueId,
    nesterov: bool,
    buf_next: ValueId,
}

struct Update {
    body: BodyId,
    param: ValueId,
    grad: ValueId,
    lr: ValueId,
    momentum: Option<Momentum>,
    wd: Option<ValueId>,
    prologue: Option<(ValueId, Option<ValueId>, ValueId)>,
    param_next: ValueId,
}

fn match_update(model: &Model, sub: NodeId, state: &StateNames) -> Option<Update> {
    let body = model.node(sub).body;
    let param = input(model, sub, 0)?;
    let param_next = output(model, sub);
    // A parameter is a graph input of the main graph, and its next value leaves the body.
    if !is_state(model, param, &state.params) || !leaves_body(model, param_next) {
        return None;
    }
    let step = made_by(model, input(model, sub, 1)?, "Mul", body)?;
    if model.uses(output(model, step)).len() != 1 {
        return None;
    }
    let (lr, d) = (input(model, step, 0)?, input(model, step, 1)?);
    // The direction: Nesterov's look-ahead, the momentum buffer, or the gradient itself.
    let (momentum, g, mut readers) = match momentum_of(model, d, body, state) {
        Some((m, g, readers)) => (Some(m), g, readers),
        None => (None, d, vec![step]),
    };
    // L2: g = Add(g0, Mul(p, wd)), read only inside the update.
    let (grad, wd) = match made_by(model, g, "Add", body) {
        Some(add) if read_only_by(model, g, &readers) => {
            let decay = made_by(model, input(model, add, 1)?, "Mul", body);
            match decay {
                Some(mul) if input(model, mul, 0)? == param => {
                    readers = vec![add];
                    (input(model, add, 0)?, Some(input(model, mul, 1)?))
                }
                _ => (g, None),
            }
        }
        _ => (g, None),
    };
    let rank = param_rank(model, param)?;
    let scalars = [Some(lr), momentum.as_ref().map(|m| m.mu), wd];
    let tensors = [Some(param), Some(grad), momentum.as_ref().map(|m| m.buf)];
    let ok = tensors
        .iter()
        .flatten()
        .all(|&t| float32_or_unknown(model, t))
        && scalars
            .iter()
            .flatten()
            .all(|&s| float32_or_unknown(model, s) && scalar_or_unknown(model, s, rank));
    // The scalar learning rate is what tells an update from `a - b·c` of tensors.
    if !ok || model.value_type(lr).is_none() && !is_scalar_initializer(model, lr) {
        return None;
    }
    let prologue = gradient_prologue(model, grad, &readers, rank);
    Some(Update {
        body,
        param,
        grad,
        lr,
        momentum,
        wd,
        prologue,
        param_next,
    })
}

/// d as Nesterov's `Add(g, Mul(buf', mu))` or the momentum buffer's `Add(Mul(buf, mu), g)`:
/// the momentum, the gradient, and the nodes of the update that read the gradient.
fn momentum_of(
    model: &Model,
    d: ValueId,
    body: BodyId,
    state: &StateNames,
) -> Option<(Momentum, ValueId, Vec<NodeId>)> {
    let buffer = |b_next: ValueId| -> Option<(ValueId, ValueId, ValueId, NodeId)> {
        let add = made_by(model, b_next, "Add", body)?;
        let decayed = made_by(model, input(model, add, 0)?, "Mul", body)?;
        let buf = input(model, decayed, 0)?;
        is_state(model, buf, &state.moments).then_some(())?;
        Some((
            input(model, decayed, 0)?,
            input(model, decayed, 1)?,
            input(model, add, 1)?,
            add,
        ))
    };
    // Nesterov first: its direction is also an Add, of the gradient and the look-ahead.
    if let Some(dir) = made_by(model, d, "Add", body) {
        let g = input(model, dir, 0)?;
        if let Some(look) = made_by(model, input(model, dir, 1)?, "Mul", body) {
            let b_next = input(model, look, 0)?;
            if let Some((buf, mu, g2, add)) = buffer(b_next) {
                if g2 == g && input(model, look, 1)? == mu && leaves_body(model, b_next) {
                    let m = Momentum {
                        buf,
                        mu,
                        nesterov: true,
                        buf_next: b_next,
                    };
                    return Some((m, g, vec![add, dir]));
                }
            }
        }
    }
    let (buf, mu, g, add) = buffer(d)?;
    leaves_body(model, d).then_some(())?;
    let m = Momentum {
        buf,
        mu,
        nesterov: false,
        buf_next: d,
    };
    Some((m, g, vec![add]))
}

/// Whether `v` leaves its body, itself or through loss scaling's gate `Where(ok, v, old)`
/// (a state's next value leaves the apply region).
fn leaves_body(model: &Model, v: ValueId) -> bool {
    let out = |v: ValueId| {
        model
            .uses(v)
            .iter()
            .any(|u| matches!(u, Use::Output { .. }))
    };
    out(v)
        || model.uses(v).iter().any(|u| match *u {
            Use::Node { node, slot: 1 } => {
                super::is_op(model, node, "Where", 3) && out(output(model, node))
            }
            _ => false,
        })
}

/// `v` is the main graph's input of that name (the manifest's state).
fn is_state(model: &Model, v: ValueId, names: &std::collections::BTreeSet<String>) -> bool {
    matches!(model.value(v).def, ValueDef::Input { body: BodyId::MAIN })
        && names.contains(model.name(v))
}

fn is_scalar_initializer(model: &Model, v: ValueId) -> bool {
    model
        .initializer(v)
        .is_some_and(|t| t.dims.iter().product::<i64>() == 1)
}
