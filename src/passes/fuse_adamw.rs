//! `fuse-adamw`: finds the standard-op AdamW update of each parameter, as
//! `legalize::adamw_optimizer::lower_adamw_for_params` writes it, and replaces it by one
//! [`AdamWUpdate`](crate::fused_ops::ADAMW_UPDATE) node, in memory, for an engine that has
//! that kernel (ONNX Runtime on the CPU). The step file is never fused: it stays standard
//! ONNX.
//!
//! Why: the lowering is 12-16 elementwise ops per parameter, each a full pass over the
//! parameter's bytes; the fused kernel makes one pass (benches/README.md, "Real model
//! sizes": the MLP's apply was 6.9 ms per window of 7.5 MB parameters).
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
//! The same g feeds both moments. When g is read by nothing else and is `Div(x, K)` of a
//! scalar, the division moves into the kernel, and with it `x = Add(acc, d)` when that sum
//! is read only there (the window's mean gradient: two passes over memory fewer). p', m'
//! and v' take the fused node's outputs; the matched
//! nodes are then dead and removed (a matched value something else also reads keeps its
//! node, so the rewrite never changes what the graph computes). Ops with attributes, other
//! domains or non-float32 operands are left alone.

use crate::fused_ops::{adamw_slot, ADAMW_UPDATE, DOMAIN, DOMAIN_VERSION};
use crate::ir::builder::Builder;
use crate::ir::{normalize_domain, BodyId, Model, NodeId, Use, ValueId};
use crate::proto::elem;

pub const PASS: &str = "fuse-adamw";

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
        while inputs.last() == Some(&None) {
            inputs.pop();
        }
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
    if !matches.is_empty() {
        model.require_opset(DOMAIN, DOMAIN_VERSION);
        super::dce::eliminate_dead_code(model);
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
    let (v, beta, grad, one_minus_beta) = second_moment(model, v_next, body)?;
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
    let (m, alpha, g2, one_minus_alpha) = first_moment(model, m_next, body)?;
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
    let prologue = gradient_prologue(model, grad, body, rank);
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

/// g = Div(x, K) with g read only by the update (both moments: three reads), K a scalar;
/// x = Add(acc, d) read only by that Div -> `(acc, Some(d), K)`, else `(x, None, K)`.
fn gradient_prologue(
    model: &Model,
    g: ValueId,
    body: BodyId,
    rank: usize,
) -> Option<(ValueId, Option<ValueId>, ValueId)> {
    let uses = model.uses(g);
    let only_moments = uses.len() == 3
        && uses.iter().all(|u| {
            matches!(u, Use::Node { node, .. } if is_op(model, *node, "Mul", 2)
                && model.node(*node).body == body)
        });
    if !only_moments {
        return None;
    }
    let div = made_by(model, g, "Div", body)?;
    let (x, divisor) = (input(model, div, 0)?, input(model, div, 1)?);
    let divisor_ok = float32_or_unknown(model, divisor) && scalar_or_unknown(model, divisor, rank);
    if !divisor_ok || !float32_or_unknown(model, x) {
        return None;
    }
    let sum = made_by(model, x, "Add", body).filter(|_| model.uses(x).len() == 1);
    Some(match sum {
        Some(add) => (input(model, add, 0)?, Some(input(model, add, 1)?), divisor),
        None => (x, None, divisor),
    })
}

/// v' = Add(Mul(v, β), Mul(Mul(g, 1-β), g)) -> (v, β, g, 1-β).
fn second_moment(
    model: &Model,
    v_next: ValueId,
    body: BodyId,
) -> Option<(ValueId, ValueId, ValueId, ValueId)> {
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
    ))
}

/// m' = Add(Mul(m, α), Mul(g, 1-α)) -> (m, α, g, 1-α).
fn first_moment(
    model: &Model,
    m_next: ValueId,
    body: BodyId,
) -> Option<(ValueId, ValueId, ValueId, ValueId)> {
    let add = made_by(model, m_next, "Add", body)?;
    let old = made_by(model, input(model, add, 0)?, "Mul", body)?;
    let new = made_by(model, input(model, add, 1)?, "Mul", body)?;
    Some((
        input(model, old, 0)?,
        input(model, old, 1)?,
        input(model, new, 0)?,
        input(model, new, 1)?,
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

/// `op` (standard domain, no attributes, `arity` inputs, one output).
fn is_op(model: &Model, n: NodeId, op: &str, arity: usize) -> bool {
    let node = model.node(n);
    node.proto.op_type() == op
        && normalize_domain(node.proto.domain()).is_empty()
        && node.proto.attribute.is_empty()
        && node.inputs.len() == arity
        && node.inputs.iter().all(Option::is_some)
        && node.outputs.len() == 1
}

/// The node of `op` in `body` that makes `v`.
fn made_by(model: &Model, v: ValueId, op: &str, body: BodyId) -> Option<NodeId> {
    let (n, _) = model.producer(v)?;
    let arity = if op == "Sqrt" { 1 } else { 2 };
    (is_op(model, n, op, arity) && model.node(n).body == body).then_some(n)
}

/// The one node reading `v`, when it is `op` reading it at `slot`.
fn sole_use(model: &Model, v: ValueId, op: &str, slot: usize) -> Option<NodeId> {
    match model.uses(v) {
        [Use::Node { node, slot: s }] if *s == slot && is_op(model, *node, op, 2) => Some(*node),
        _ => None,
    }
}

fn input(model: &Model, n: NodeId, slot: usize) -> Option<ValueId> {
    model.node(n).inputs.get(slot).copied().flatten()
}

fn output(model: &Model, n: NodeId) -> ValueId {
    model.output(n, 0)
}

/// The declared rank of a parameter (0 when not declared, as for the flat group of small
/// parameters: then only rank-0 scalars are taken); `None` when it is not float32.
fn param_rank(model: &Model, p: ValueId) -> Option<usize> {
    if !float32_or_unknown(model, p) {
        return None;
    }
    Some(
        model
            .value_type(p)
            .and_then(|t| t.tensor_dims())
            .map_or(0, |d| d.len()),
    )
}

fn float32_or_unknown(model: &Model, v: ValueId) -> bool {
    match model.value_type(v).and_then(|t| t.tensor_elem()) {
        Some(e) => e == elem::FLOAT,
        None => true,
    }
}

/// A scalar must not broadcast the parameter to a larger rank (the kernel's outputs take
/// the parameter's shape): declared rank at most the parameter's, one element.
fn scalar_or_unknown(model: &Model, v: ValueId, param_rank: usize) -> bool {
    let Some(dims) = model.value_type(v).and_then(|t| t.tensor_dims()) else {
        return true;
    };
    dims.len() <= param_rank
        && dims
            .iter()
            .all(|d| matches!(d, crate::proto::DeclaredDim::Known(1)))
}

/// `model` with its AdamW updates fused, and how many there were (the model itself, borrowed,
/// when it has none). Inputs, outputs and metadata stay as they are.
pub fn prepare(
    model: &crate::proto::ModelProto,
) -> Result<(std::borrow::Cow<'_, crate::proto::ModelProto>, usize), super::PassError> {
    fn has_sqrt(g: &crate::proto::GraphProto) -> bool {
        g.node.iter().any(|n| {
            n.op_type() == "Sqrt"
                || n.attribute
                    .iter()
                    .any(|a| a.g.as_ref().is_some_and(has_sqrt) || a.graphs.iter().any(has_sqrt))
        })
    }
    if !model.graph.as_ref().is_some_and(has_sqrt) {
        return Ok((std::borrow::Cow::Borrowed(model), 0));
    }
    let mut ir = Model::from_proto(model.clone());
    let fused = fuse_adamw(&mut ir);
    if fused == 0 {
        return Ok((std::borrow::Cow::Borrowed(model), 0));
    }
    crate::ir::verify::verify(&ir).map_err(|errors| super::PassError::Verify {
        pass: PASS.into(),
        errors,
    })?;
    Ok((std::borrow::Cow::Owned(ir.to_proto()), fused))
}
