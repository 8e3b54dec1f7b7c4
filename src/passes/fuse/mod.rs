//! The fused optimizer updates: passes that find the standard-op update of each parameter,
//! as the optimizer pass writes it, and replace it by one node of onnx-ga's fused operators
//! ([`crate::fused_ops`]), in memory, for an engine that has their kernels (ONNX Runtime on
//! the CPU: `engine::ort_ops`). The step file is never fused: it stays standard ONNX.
//!
//! Why: the standard-op updates are 4-16 elementwise ops per parameter, each a full pass
//! over the parameter's bytes; a fused kernel makes one pass (benches/README.md, "Run E").
//!
//! - [`adamw`]: Adam and AdamW (`AdamWUpdate`);
//! - [`adamw_group`]: the AdamW updates of a session that updates nothing in place as one
//!   `AdamWUpdates` node;
//! - [`sgd`]: SGD, momentum and Nesterov (`SgdUpdate`);
//! - [`accumulate`]: the window's gradient sum (`AccumulateGrad`), with in-place updates;
//! - [`accumulate_product`]: a weight gradient made inside its accumulator
//!   (`AccumulateProduct`), with in-place updates;
//! - [`apply_kept_sum`]: an apply's update told the accumulator it reads, whose kept
//!   products it may add itself;
//! - [`apply_product`]: an apply's own weight gradient made inside its update;
//! - [`in_place`]: the gate of every fused node, and which states the session may update in
//!   place.
//!
//! Both match by structure, with the operand order the optimizer pass writes, and fold in
//! the window's mean gradient `(acc + d) / K` when nothing else reads it
//! ([`gradient_prologue`]). The replaced values take the fused node's outputs; the matched
//! nodes are then dead and removed (a matched value something else also reads keeps its
//! node, so the rewrite never changes what the graph computes). Ops with attributes, other
//! domains or non-float32 operands are left alone.

pub mod accumulate;
pub mod accumulate_product;
pub mod adamw;
pub mod adamw_group;
pub mod apply_kept_sum;
pub mod apply_product;
pub mod host;
pub mod in_place;
pub mod sgd;

pub use in_place::InPlacePlan;

use crate::ir::{normalize_domain, BodyId, Model, NodeId, Use, ValueId};
use crate::proto::elem;

pub const PASS: &str = "fuse-optimizer";

/// A session's model prepared for the fused kernels.
pub struct Prepared<'m> {
    /// The model with its updates fused (the model itself, borrowed, when nothing was).
    pub model: std::borrow::Cow<'m, crate::proto::ModelProto>,
    /// Optimizer updates fused (AdamW and SGD; accumulations are not counted).
    pub fused: usize,
    /// Parameters' AdamW updates run by `AdamWUpdates` nodes ([`adamw_group`]).
    pub grouped: usize,
    /// Weight gradients made inside their accumulators ([`accumulate_product`]).
    pub products: usize,
    /// Weight gradients made inside the apply's optimizer updates ([`apply_product`]).
    pub apply_products: usize,
    /// The states the session updates in place (empty unless asked for).
    pub in_place: InPlacePlan,
    /// The updates of those states the host runs after the session ([`host`]), when it
    /// runs them all.
    pub host_updates: Option<host::HostUpdates>,
}

/// How [`prepare`] prepares a session.
#[derive(Clone, Copy, Debug, Default)]
pub struct FuseOptions {
    /// Fuse the accumulations too, gate every fused node, and plan in-place updates.
    pub in_place: bool,
    /// The session is the window-start specialisation: accumulators it does not read go
    /// in place as well ([`in_place`]).
    pub window_start: bool,
    /// A session whose in-place states hold fewer elements in all runs apart, as if
    /// `in_place` were off ([`in_place::MIN_SESSION_ELEMENTS`] is the trainer's default),
    /// unless the host updates them all (`host_updates`).
    pub min_in_place_total: i64,
    /// With `in_place`: weight gradients made inside their accumulators
    /// ([`accumulate_product`]), where the session does not give its updates to the host.
    pub products: bool,
    /// With `products`: the apply's own weight gradients made inside its updates
    /// ([`apply_product`]).
    pub apply_products: bool,
    /// With `in_place`: a session whose every in-place state is a fused update's or
    /// accumulation's, and which holds fewer elements in them than this, gives those
    /// kernels to the host ([`host`]).
    pub host_updates: Option<i64>,
}

/// `model` (a step, or a specialisation of the step `manifest` describes) with its
/// optimizer updates fused, and with `options.in_place` its accumulations too and the plan
/// of its in-place updates. Inputs and outputs stay as they are, except the gate's input
/// ([`in_place::gate`]), which has a default.
pub fn prepare<'m>(
    model: &'m crate::proto::ModelProto,
    manifest: &crate::state::Manifest,
    options: FuseOptions,
) -> Result<Prepared<'m>, super::PassError> {
    use crate::state::Role;
    // Every update this fuses gives a parameter (or, in place, an accumulator) its next
    // value: a session that returns none has nothing to fuse, and is not copied into the IR
    // for nothing.
    let next_values: std::collections::BTreeSet<&str> = manifest
        .state
        .iter()
        .filter(|e| e.role == Role::Param || (options.in_place && e.role == Role::Accumulator))
        .map(|e| e.output.as_str())
        .collect();
    let graph_outputs = model
        .graph
        .as_ref()
        .map(|g| g.output.as_slice())
        .unwrap_or(&[]);
    let untouched = |model| Prepared {
        model: std::borrow::Cow::Borrowed(model),
        fused: 0,
        grouped: 0,
        products: 0,
        apply_products: 0,
        in_place: InPlacePlan::default(),
        host_updates: None,
    };
    if !graph_outputs.iter().any(|o| next_values.contains(o.name())) {
        return Ok(untouched(model));
    }
    let state = StateNames::of(manifest);
    let mut ir = Model::from_proto(model.clone());
    // AdamW first: its weight decay `Sub(p, Mul(p, k))` must not be read as an SGD step.
    let fused = adamw::fuse_adamw(&mut ir) + sgd::fuse_sgd(&mut ir, &state);
    if !options.in_place {
        if fused == 0 {
            return Ok(untouched(model));
        }
        // Nothing in place: one dispatch for the AdamW updates.
        let grouped = adamw_group::group_adamw(&mut ir);
        return finish(ir, fused, grouped, InPlacePlan::default());
    }
    if let Some(max_elements) = options.host_updates {
        let host = for_host_updates(ir.clone(), manifest, options, fused, max_elements)?;
        if let Some(prepared) = host {
            return Ok(prepared);
        }
    }
    let products = match options.products {
        true => accumulate_product::fuse_accumulate_products(&mut ir, manifest),
        false => 0,
    };
    let accumulations = products + accumulate::fuse_accumulate(&mut ir, manifest);
    let keep = in_place::gate(&mut ir, manifest);
    // The replaced nodes must be gone first: they still read the states.
    super::dce::eliminate_dead_code(&mut ir);
    let apply_products = match options.products {
        true => {
            apply_kept_sum::name_kept_sums(&mut ir, manifest);
            let made = match options.apply_products {
                true => apply_product::fuse_apply_products(&mut ir),
                false => 0,
            };
            // The products' own nodes are dead now.
            super::dce::eliminate_dead_code(&mut ir);
            made
        }
        false => 0,
    };
    let plan = in_place::plan(&mut ir, manifest, keep, options.window_start);
    if fused + accumulations == 0 {
        // Nothing fused (a window start): the model as it was, with the plan (unread
        // accumulators) over it, at any size: the kept binding writes them without a kernel
        // or any work per run (`engine::kept_binding`).
        return Ok(Prepared {
            in_place: plan,
            ..untouched(model)
        });
    }
    if in_place::elements(&ir, &plan) < options.min_in_place_total {
        let apart = match options.window_start && products > 0 {
            // A window start too small for kernels: its products made by the standard ops,
            // its unread accumulators still in place (as above).
            true => FuseOptions {
                products: false,
                ..options
            },
            false => FuseOptions {
                in_place: false,
                ..options
            },
        };
        return prepare(model, manifest, apart);
    }
    let prepared = finish(ir, fused, 0, plan)?;
    Ok(Prepared {
        products,
        apply_products,
        ..prepared
    })
}

/// The session of `ir` (its updates fused) with every update in place run by the host
/// ([`host`]): the flat groups cut into their members first, so that each member's state
/// goes in place, and every accumulation fused. `None` when the plan puts a state in place
/// that no such kernel writes (a window start's unread accumulators), or the states hold
/// `max_elements` or more: then the session is prepared as without the host.
fn for_host_updates(
    mut ir: Model,
    manifest: &crate::state::Manifest,
    options: FuseOptions,
    fused: usize,
    max_elements: i64,
) -> Result<Option<Prepared<'static>>, super::PassError> {
    adamw_group::unflatten_all(&mut ir);
    accumulate::fuse_accumulate(&mut ir, manifest);
    let keep = in_place::gate(&mut ir, manifest);
    super::dce::eliminate_dead_code(&mut ir);
    let plan = in_place::plan(&mut ir, manifest, keep, options.window_start);
    if in_place::elements(&ir, &plan) >= max_elements {
        return Ok(None);
    }
    let Some(updates) = host::peel(&mut ir, &plan) else {
        return Ok(None);
    };
    let mut prepared = finish(ir, fused, 0, plan)?;
    prepared.host_updates = Some(updates);
    Ok(Some(prepared))
}

/// The fused model, cleaned and checked.
fn finish(
    mut ir: Model,
    fused: usize,
    grouped: usize,
    in_place: InPlacePlan,
) -> Result<Prepared<'static>, super::PassError> {
    ir.require_opset(crate::fused_ops::DOMAIN, crate::fused_ops::DOMAIN_VERSION);
    super::dce::eliminate_dead_code(&mut ir);
    crate::ir::verify::verify(&ir).map_err(|errors| super::PassError::Verify {
        pass: PASS.into(),
        errors,
    })?;
    Ok(Prepared {
        model: std::borrow::Cow::Owned(ir.to_proto()),
        fused,
        grouped,
        products: 0,
        apply_products: 0,
        in_place,
        host_updates: None,
    })
}

/// The state inputs the step's manifest names as parameters and as optimizer moments.
pub struct StateNames {
    pub params: std::collections::BTreeSet<String>,
    pub moments: std::collections::BTreeSet<String>,
}

impl StateNames {
    fn of(manifest: &crate::state::Manifest) -> StateNames {
        use crate::state::Role;
        let named = |role: Role| {
            manifest
                .state
                .iter()
                .filter(|e| e.role == role)
                .map(|e| e.input.clone())
                .collect()
        };
        StateNames {
            params: named(Role::Param),
            moments: named(Role::Moment),
        }
    }
}

/// The window's mean gradient folded into a kernel: g = Div(x, K), K a scalar, when every
/// read of g is one of `readers` (the update's own nodes); and x = Add(acc, d) when that sum
/// is read only by the Div -> `(acc, Some(d), K)`, else `(x, None, K)`.
pub(crate) fn gradient_prologue(
    model: &Model,
    g: ValueId,
    readers: &[NodeId],
    rank: usize,
) -> Option<(ValueId, Option<ValueId>, ValueId)> {
    if !read_only_by(model, g, readers) {
        return None;
    }
    let body = model.node(*readers.first()?).body;
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

/// Every read of `v` is by one of `readers` (not a graph output either).
pub(crate) fn read_only_by(model: &Model, v: ValueId, readers: &[NodeId]) -> bool {
    model
        .uses(v)
        .iter()
        .all(|u| matches!(u, Use::Node { node, .. } if readers.contains(node)))
}

/// `op` (standard domain, no attributes, `arity` inputs, one output).
pub(crate) fn is_op(model: &Model, n: NodeId, op: &str, arity: usize) -> bool {
    let node = model.node(n);
    node.proto.op_type() == op
        && normalize_domain(node.proto.domain()).is_empty()
        && node.proto.attribute.is_empty()
        && node.inputs.len() == arity
        && node.inputs.iter().all(Option::is_some)
        && node.outputs.len() == 1
}

/// The node of `op` in `body` that makes `v`.
pub(crate) fn made_by(model: &Model, v: ValueId, op: &str, body: BodyId) -> Option<NodeId> {
    let (n, _) = model.producer(v)?;
    let arity = if op == "Sqrt" { 1 } else { 2 };
    (is_op(model, n, op, arity) && model.node(n).body == body).then_some(n)
}

/// The one node reading `v`, when it is `op` reading it at `slot`.
pub(crate) fn sole_use(model: &Model, v: ValueId, op: &str, slot: usize) -> Option<NodeId> {
    match model.uses(v) {
        [Use::Node { node, slot: s }] if *s == slot && is_op(model, *node, op, 2) => Some(*node),
        _ => None,
    }
}

pub(crate) fn input(model: &Model, n: NodeId, slot: usize) -> Option<ValueId> {
    model.node(n).inputs.get(slot).copied().flatten()
}

pub(crate) fn output(model: &Model, n: NodeId) -> ValueId {
    model.output(n, 0)
}

/// The declared rank of a parameter (0 when not declared, as for the flat group of small
/// parameters: then only rank-0 scalars are taken); `None` when it is not float32.
pub(crate) fn param_rank(model: &Model, p: ValueId) -> Option<usize> {
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

/// Each accumulator of `manifest` that `model`'s main graph has, as (its input, its next
/// value).
pub(crate) fn accumulators(
    model: &Model,
    manifest: &crate::state::Manifest,
) -> Vec<(ValueId, ValueId)> {
    manifest
        .state
        .iter()
        .filter(|e| e.role == crate::state::Role::Accumulator)
        .filter_map(|e| {
            Some((
                model.lookup(BodyId::MAIN, &e.input)?,
                model.lookup(BodyId::MAIN, &e.output)?,
            ))
        })
        .collect()
}

/// The window's sum `next = Add(acc, d)` (or `Add(d, acc)`) in the main graph, `acc` read
/// only there and of a declared static float32 shape: the `Add` and the gradient `d`. What
/// [`accumulate`] and [`accumulate_product`] fuse.
pub(crate) fn accumulation(
    model: &Model,
    (acc, next): (ValueId, ValueId),
) -> Option<(NodeId, ValueId)> {
    let (add, _) = model.producer(next)?;
    let main_add = is_op(model, add, "Add", 2) && model.node(add).body == BodyId::MAIN;
    if !main_add || output(model, add) != next {
        return None;
    }
    let (a, b) = (input(model, add, 0)?, input(model, add, 1)?);
    let gradient = match (a == acc, b == acc) {
        (true, false) => b,
        (false, true) => a,
        _ => return None,
    };
    let only_here = matches!(model.uses(acc), [Use::Node { node, .. }] if *node == add);
    let float32 = static_float32_shape(model, acc).is_some();
    (only_here && float32).then_some((add, gradient))
}

/// The fully known shape of `v` when it is declared float32 with one.
pub(crate) fn static_float32_shape(model: &Model, v: ValueId) -> Option<Vec<i64>> {
    let ty = model.value_type(v)?;
    if ty.tensor_elem()? != elem::FLOAT {
        return None;
    }
    ty.tensor_dims()?
        .iter()
        .map(|d| match d {
            crate::proto::DeclaredDim::Known(k) => Some(*k),
            _ => None,
        })
        .collect()
}

pub(crate) fn float32_or_unknown(model: &Model, v: ValueId) -> bool {
    match model.value_type(v).and_then(|t| t.tensor_elem()) {
        Some(e) => e == elem::FLOAT,
        None => true,
    }
}

/// A scalar must not broadcast the parameter to a larger rank (the kernel's outputs take
/// the parameter's shape): declared rank at most the parameter's, one element.
pub(crate) fn scalar_or_unknown(model: &Model, v: ValueId, param_rank: usize) -> bool {
    let Some(dims) = model.value_type(v).and_then(|t| t.tensor_dims()) else {
        return true;
    };
    dims.len() <= param_rank
        && dims
            .iter()
            .all(|d| matches!(d, crate::proto::DeclaredDim::Known(1)))
}
