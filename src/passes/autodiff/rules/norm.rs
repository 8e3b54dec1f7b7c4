//! Normalisations, differentiated with the statistics their forward saved (Layer, Batch) or
//! recomputes (Group, Instance).
//!
//! ```text
//! LayerNormalization   Y = scale · x̂ + B,  x̂ = (X - mean) · inv_std over the axes [axis, rank)
//!   B' = dY · scale · inv_std
//!   dX = B' - mean_N(B') - x̂ · mean_N(B' · x̂);   dScale = Σ_L dY · x̂;   dB = Σ_L dY
//! BatchNorm (training)  the same per channel over all axes but 1:
//!   dX = k (dY - Σ dY / n - x̂ · Σ(dY · x̂) / n),  k = scale · inv_std
//! GroupNormalization  per instance n and group g of C/G channels, over its M = C/G · |spatial|
//!   elements: x̂ = (X - μ) · r, r = 1/sqrt(σ² + ε) (σ² biased), Y = γ · x̂ + β with γ, β per
//!   channel (opset 21) or per group (opset 18: one value for the group's channels)
//!   g = dY · γ;   dX = r · (g - mean_M(g) - x̂ · mean_M(g · x̂))
//!   dγ = Σ_{n, spatial} dY · x̂,  dβ = Σ_{n, spatial} dY   (per channel; opset 18: also
//!   summed over the group's channels)
//! InstanceNormalization  the same with G = C (one channel per group), γ, β per channel
//! LpNormalization  Y = X / n along `axis`, n = ||X||_p (p = 1 or 2)
//!   dX = (dY - s · Σ_axis(dY · Y)) / n,  s = Y (p = 2), sign(X) (p = 1)
//! RMSNormalization (opset 23)  over the N elements of axes [axis, rank), in `stash_type`:
//!   r = 1/sqrt(mean_N(X²) + ε), n = X · r, Y = n · scale
//!   g = dY · scale;   dX = r · (g - n · mean_N(g · n));   dScale = Σ dY · n (to its shape)
//! MeanVarianceNormalization  over `axes` (default [0, 2, 3]), ε = 1e-9 added to σ, not σ²:
//!   c = X - mean(X), σ = sqrt(mean(X²) - mean(X)²), d = σ + ε, Y = c / d
//!   dX = (dY - mean(dY) - (c / σ) · mean(dY · Y)) / d
//! LRN  over a window of `size` channels, W(c) = [c - ⌊(size-1)/2⌋, c + ⌈(size-1)/2⌉] ∩ [0, C):
//!   S[c] = Σ_{i ∈ W(c)} X[i]²,  s = bias + (α / size) · S,  Y = X · s^-β
//!   dX[j] = dY[j] · s[j]^-β - (2αβ / size) · X[j] · Σ_{c : j ∈ W(c)} dY[c] · X[c] · s[c]^(-β-1)
//! ```
//!
//! LRN's two channel-window sums are each one MatMul by a 0/1 band matrix [C, C] over the view
//! [N, C, -1] (the band for S, its transpose for the sum over the windows holding j), so C must
//! be known; the forward's S is recomputed (LRN outputs only Y).
//!
//! Neither forward saves its statistics, so the rule recomputes them from X in the view
//! `[N, G, M]` (`Reshape(X, [0, G, -1])`; Reshape back to X's shape at the end) with
//! standard ops: ReduceMean, Sub, Mul, Add, Sqrt, Reciprocal. Opset 21's `stash_type` (the
//! precision of the first stage) is honoured where it widens: a float16/bfloat16 X with
//! stash_type 1 gets its statistics and dX in float32, as the forward computes them.
//!
//! A gradient reaching LayerNormalization's own Mean or InvStdDev output adds
//! `(dMean - dInvStdDev · InvStdDev³ · (X - Mean)) / N` to dX (`layer_norm_stats_grad`);
//! BatchNorm's statistics outputs are not differentiated (an error names the node).
//!
//! The forward's optional statistics outputs (LayerNormalization's `Mean`, `InvStdDev`;
//! BatchNormInternal's saved mean and inverse deviation) are switched on so the backward
//! reuses them instead of recomputing; `LayerNormalizationGrad` and
//! `BatchNormalizationGrad` (lowered by legalize-ort) hold the formulas above.
//! A forward BatchNormalization reaches this rule as BatchNormInternal: the normalisation
//! step of the autodiff turns every BatchNorm into its training form first.

use super::super::shapes::Dim;
use super::{wanted, Grad, InputGrads};
use crate::ir::builder::{attr_int, tensor_f32};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

fn grads_out(
    cx: &mut Grad<'_>,
    node: NodeId,
    g: NodeId,
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let mut out = vec![None; wants.len()];
    for slot in 0..3.min(wants.len()) {
        if wants[slot] {
            let like = cx.input(node, slot)?;
            out[slot] = Some(cx.output_like(g, slot, like));
        }
    }
    if wants.iter().skip(3).any(|w| *w) {
        return Err(cx.error(
            node,
            "the gradient with respect to running statistics is not defined".into(),
        ));
    }
    Ok(out)
}

fn hints(cx: &Grad<'_>, node: NodeId) -> Vec<String> {
    (0..3)
        .map(|i| match cx.opt_input(node, i) {
            Some(v) => format!("{}_grad", cx.model().name(v)),
            None => "norm_bias_grad".into(),
        })
        .collect()
}

pub fn layer_norm(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let at = |slot: usize| dys.get(slot).copied().flatten();
    let (dy, d_mean, d_inv_std) = (at(0), at(1), at(2));
    if dy.is_none() && d_mean.is_none() && d_inv_std.is_none() {
        // No gradient reaches any output: all input gradients are zero.
        return Ok(vec![None; wants.len()]);
    }
    let (x, scale) = (cx.input(node, 0)?, cx.input(node, 1)?);
    // Checked here, where the error can name the user's node, when the rank is known; the
    // lowering of the gradient op checks again against what it knows.
    if let Some(rank) = cx.facts(x).rank() {
        let (axis, rank) = (cx.int_attr(node, "axis", -1)?, rank as i64);
        if !(-rank..rank).contains(&axis) {
            return Err(cx.error(
                node,
                format!("attribute 'axis' = {axis} is out of range for rank {rank}"),
            ));
        }
    }
    let y = cx.model().name(cx.forward_output(node, 0)?).to_string();
    let mean = cx.b.model.ensure_node_output(node, 1, &format!("{y}_mean"));
    let inv_std =
        cx.b.model
            .ensure_node_output(node, 2, &format!("{y}_inv_std"));
    let mut out = match dy {
        Some(dy) => {
            let attrs = cx.attrs_of(node, &["axis"]);
            let h = hints(cx, node);
            let h: Vec<&str> = h.iter().map(String::as_str).collect();
            let g = cx.ort_op(
                "LayerNormalizationGrad",
                &[Some(dy), Some(x), Some(scale), Some(mean), Some(inv_std)],
                &h,
                attrs,
            );
            grads_out(cx, node, g, wants)?
        }
        None => vec![None; wants.len()],
    };
    if (d_mean.is_some() || d_inv_std.is_some()) && wanted(wants, 0) {
        let extra = layer_norm_stats_grad(cx, node, x, mean, inv_std, d_mean, d_inv_std)?;
        out[0] = Some(match out[0] {
            Some(g) => {
                let h = format!("{}_grad", cx.model().name(x));
                cx.op_like("Add", &[g, extra], vec![], &h, x)
            }
            None => extra,
        });
    }
    Ok(out)
}

/// LayerNormalization's statistics outputs, over the N elements of each normalised group
/// (axes [axis, rank)), in the statistics' type U (`stash_type`, float32 by default):
///
/// ```text
/// Mean = Σ X / N                      dX += dMean / N
/// InvStdDev = (Σ (X - Mean)² / N + ε)^(-1/2)
///                                     dX += -dInvStdDev · InvStdDev³ · (X - Mean) / N
/// ```
///
/// (the Mean inside the variance contributes nothing: Σ (X - Mean) = 0).
fn layer_norm_stats_grad(
    cx: &mut Grad<'_>,
    node: NodeId,
    x: ValueId,
    mean: ValueId,
    inv_std: ValueId,
    d_mean: Option<ValueId>,
    d_inv_std: Option<ValueId>,
) -> Result<ValueId, PassError> {
    let elem = cx.elem(node, x)?;
    let rank = cx.need_rank(node, x)? as i64;
    let axis = cx.int_attr(node, "axis", -1)?;
    let axis = if axis < 0 { axis + rank } else { axis };
    if axis < 0 || axis >= rank {
        return Err(cx.error(
            node,
            format!("attribute 'axis' is out of range for rank {rank}"),
        ));
    }
    let stats = cx.int_attr(node, "stash_type", DataType::Float as i64)? as i32;
    let h = format!("{}_grad", cx.model().name(x));
    let xu = cast(cx, x, elem, stats, &h);
    let dims = cx.facts(x).dims.unwrap_or_default();
    let count: Option<i64> = (axis..rank)
        .map(|a| dims.get(a as usize).and_then(Dim::known))
        .product();
    let n = match count {
        Some(c) => cx.scalar(stats, c as f64),
        None => {
            let axes: Vec<i64> = (axis..rank).collect();
            let shape = cx.shape_of(x);
            let idx = cx.ints(&axes);
            let sizes = cx.op("Gather", &[shape, idx], vec![], &h);
            let c = cx.reduce("ReduceProd", sizes, &[0], false, &h);
            cx.op("Cast", &[c], vec![attr_int("to", stats as i64)], &h)
        }
    };
    let mut sum = None;
    if let Some(d) = d_inv_std {
        let diff = cx.op("Sub", &[xu, mean], vec![], &h);
        let sq = cx.op("Mul", &[inv_std, inv_std], vec![], &h);
        let cube = cx.op("Mul", &[sq, inv_std], vec![], &h);
        let k = cx.op("Mul", &[d, cube], vec![], &h);
        let t = cx.op("Mul", &[k, diff], vec![], &h);
        sum = Some(cx.op("Neg", &[t], vec![], &h));
    }
    if let Some(d) = d_mean {
        sum = Some(match sum {
            Some(t) => cx.op("Add", &[t, d], vec![], &h),
            None => {
                let shape = cx.shape_of(x);
                cx.op("Expand", &[d, shape], vec![], &h)
            }
        });
    }
    let Some(sum) = sum else {
        return Err(cx.error(
            node,
            "internal: no statistics gradient to differentiate".into(),
        ));
    };
    let scaled = cx.op("Div", &[sum, n], vec![], &h);
    let g = cast(cx, scaled, stats, elem, &h);
    let f = cx.facts(x);
    cx.shapes.set(g, f);
    Ok(g)
}

pub fn batch_norm_internal(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    if dys.iter().skip(1).any(Option::is_some) {
        return Err(cx.error(
            node,
            "the gradient through BatchNorm's statistics outputs is not supported".into(),
        ));
    }
    let Some(dy) = dys.first().copied().flatten() else {
        return Ok(vec![None; wants.len()]);
    };
    let (x, scale) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let y = cx.model().name(cx.forward_output(node, 0)?).to_string();
    let saved_mean =
        cx.b.model
            .ensure_node_output(node, 3, &format!("{y}_saved_mean"));
    let saved_inv_std =
        cx.b.model
            .ensure_node_output(node, 4, &format!("{y}_saved_inv_std"));
    let h = hints(cx, node);
    let h: Vec<&str> = h.iter().map(String::as_str).collect();
    let g = cx.ort_op(
        "BatchNormalizationGrad",
        &[
            Some(dy),
            Some(x),
            Some(scale),
            Some(saved_mean),
            Some(saved_inv_std),
        ],
        &h,
        vec![],
    );
    grads_out(cx, node, g, wants)
}

pub fn group_norm(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let groups = cx.int_attr(node, "num_groups", 0)?;
    if groups <= 0 {
        return Err(cx.error(
            node,
            format!("attribute 'num_groups' = {groups}: expected a positive number of groups"),
        ));
    }
    // Opset 21 changed scale and bias from one value per group to one per channel.
    let per_channel = cx.opset() >= 21;
    grouped(cx, node, dys, wants, Some(groups), per_channel)
}

pub fn instance_norm(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    grouped(cx, node, dys, wants, None, true)
}

/// `Cast(v, to)` unless `v` already has element type `to`.
fn cast(cx: &mut Grad<'_>, v: ValueId, from: i32, to: i32, hint: &str) -> ValueId {
    if from == to {
        v
    } else {
        cx.op("Cast", &[v], vec![attr_int("to", to as i64)], hint)
    }
}

/// Group (`groups` = Some(G)) or instance (None: G = C) normalisation's gradients; scale
/// and bias per channel or (`per_channel` false) per group.
fn grouped(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
    groups: Option<i64>,
    per_channel: bool,
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let (x, scale) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let elem = cx.elem(node, x)?;
    let rank = cx.need_rank(node, x)?;
    if rank < 2 {
        return Err(cx.error(
            node,
            format!(
                "'{}' has rank {rank}; the normalisation needs [N, C, ...]",
                cx.model().name(x)
            ),
        ));
    }
    let channels = cx.facts(x).dims.and_then(|d| d.get(1).and_then(Dim::known));
    if let (Some(g), Some(c)) = (groups, channels) {
        if c % g != 0 {
            return Err(cx.error(
                node,
                format!("{c} channels do not divide into num_groups = {g}"),
            ));
        }
    }
    let expected = if per_channel { channels } else { groups };
    if let (Some(e), Some(got)) = (expected, cx.facts(scale).static_dims()) {
        if got != [e] {
            let per = if per_channel { "channel" } else { "group" };
            return Err(cx.error(
                node,
                format!(
                    "scale '{}' has shape {got:?}; opset {} wants one value per {per} ([{e}])",
                    cx.model().name(scale),
                    cx.opset()
                ),
            ));
        }
    }
    let eps = cx.float_attr(node, "epsilon", 1e-5)? as f64;
    let narrow = elem == DataType::Float16 as i32 || elem == DataType::Bfloat16 as i32;
    let stash = if groups.is_some() && cx.opset() >= 21 {
        cx.int_attr(node, "stash_type", 1)?
    } else {
        0
    };
    let work = if narrow && stash == DataType::Float as i64 {
        DataType::Float as i32
    } else {
        elem
    };
    let h = format!("{}_grad", cx.model().name(x));
    let hs = format!("{}_grad", cx.model().name(scale));
    let hb = match cx.opt_input(node, 2) {
        Some(b) => format!("{}_grad", cx.model().name(b)),
        None => "norm_bias_grad".into(),
    };

    // The statistics, recomputed: X as [N, G, M].
    let view = cx.ints(&[0, groups.unwrap_or(0), -1]);
    let xg = cx.op("Reshape", &[x, view], vec![], &h);
    let xg = cast(cx, xg, elem, work, &h);
    let mu = cx.reduce("ReduceMean", xg, &[2], true, &h);
    let xc = cx.op("Sub", &[xg, mu], vec![], &h);
    let sq = cx.op("Mul", &[xc, xc], vec![], &h);
    let var = cx.reduce("ReduceMean", sq, &[2], true, &h);
    let eps = cx.scalar(work, eps);
    let var_eps = cx.op("Add", &[var, eps], vec![], &h);
    let std = cx.op("Sqrt", &[var_eps], vec![], &h);
    let r = cx.op("Reciprocal", &[std], vec![], &h);
    let xhat = cx.op("Mul", &[xc, r], vec![], &h);

    let mut out = vec![None; wants.len()];
    let spatial_axes: Vec<i64> = std::iter::once(0).chain(2..rank as i64).collect();
    // g = dY · γ in the [N, G, M] view; dγ and dβ.
    let g = if per_channel {
        if wanted(wants, 1) {
            let shape = cx.shape_of(x);
            let xhat_t = cast(cx, xhat, work, elem, &hs);
            let xhat_t = cx.op_like("Reshape", &[xhat_t, shape], vec![], &hs, x);
            let p = cx.op_like("Mul", &[dy, xhat_t], vec![], &hs, x);
            out[1] = Some(cx.reduce("ReduceSum", p, &spatial_axes, false, &hs));
        }
        if wanted(wants, 2) {
            out[2] = Some(cx.reduce("ReduceSum", dy, &spatial_axes, false, &hb));
        }
        let axes: Vec<i64> = (1..rank as i64 - 1).collect();
        let gamma = if axes.is_empty() {
            scale
        } else {
            cx.unsqueeze(scale, &axes, &h)
        };
        let gy = cx.op_like("Mul", &[dy, gamma], vec![], &h, x);
        let gg = cx.op("Reshape", &[gy, view], vec![], &h);
        cast(cx, gg, elem, work, &h)
    } else {
        let dyg = cx.op("Reshape", &[dy, view], vec![], &h);
        if wanted(wants, 1) {
            let xhat_t = cast(cx, xhat, work, elem, &hs);
            let p = cx.op("Mul", &[dyg, xhat_t], vec![], &hs);
            out[1] = Some(cx.reduce("ReduceSum", p, &[0, 2], false, &hs));
        }
        if wanted(wants, 2) {
            out[2] = Some(cx.reduce("ReduceSum", dyg, &[0, 2], false, &hb));
        }
        let gamma = cx.unsqueeze(scale, &[1], &h);
        let gg = cx.op("Mul", &[dyg, gamma], vec![], &h);
        cast(cx, gg, elem, work, &h)
    };
    for (slot, g) in out.iter().enumerate().take(3).skip(1) {
        if let (Some(v), Some(like)) = (*g, cx.opt_input(node, slot)) {
            let f = cx.facts(like);
            cx.shapes.set(v, f);
        }
    }
    if wanted(wants, 0) {
        let m1 = cx.reduce("ReduceMean", g, &[2], true, &h);
        let gx = cx.op("Mul", &[g, xhat], vec![], &h);
        let m2 = cx.reduce("ReduceMean", gx, &[2], true, &h);
        let centred = cx.op("Sub", &[g, m1], vec![], &h);
        let along = cx.op("Mul", &[xhat, m2], vec![], &h);
        let inner = cx.op("Sub", &[centred, along], vec![], &h);
        let dxg = cx.op("Mul", &[inner, r], vec![], &h);
        let dxg = cast(cx, dxg, work, elem, &h);
        let shape = cx.shape_of(x);
        out[0] = Some(cx.op_like("Reshape", &[dxg, shape], vec![], &h, x));
    }
    Ok(out)
}

pub fn lp_normalization(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let p = cx.int_attr(node, "p", 2)?;
    if p != 1 && p != 2 {
        return Err(cx.error(node, format!("p = {p} is not a norm ONNX defines (1 or 2)")));
    }
    let (dy, x, y) = (
        cx.dy(node, dys, 0)?,
        cx.input(node, 0)?,
        cx.forward_output(node, 0)?,
    );
    let rank = cx.need_rank(node, x)? as i64;
    let axis = cx.int_attr(node, "axis", -1)?;
    let axis = if axis < 0 { axis + rank } else { axis };
    if !(0..rank).contains(&axis) {
        return Err(cx.error(node, format!("axis is out of range for rank {rank}")));
    }
    let h = format!("{}_grad", cx.model().name(x));
    let norm = if p == 2 {
        let squares = cx.op("Mul", &[x, x], vec![], &h);
        let sum = cx.reduce("ReduceSum", squares, &[axis], true, &h);
        cx.op("Sqrt", &[sum], vec![], &h)
    } else {
        let magnitudes = cx.op("Abs", &[x], vec![], &h);
        cx.reduce("ReduceSum", magnitudes, &[axis], true, &h)
    };
    let dy_y = cx.op("Mul", &[dy, y], vec![], &h);
    let projection = cx.reduce("ReduceSum", dy_y, &[axis], true, &h);
    let direction = if p == 2 {
        y
    } else {
        cx.op("Sign", &[x], vec![], &h)
    };
    let along = cx.op("Mul", &[direction, projection], vec![], &h);
    let tangent = cx.op("Sub", &[dy, along], vec![], &h);
    let mut out = vec![None; wants.len().max(1)];
    out[0] = Some(cx.op_like("Div", &[tangent, norm], vec![], &h, x));
    Ok(out)
}

pub fn rms_norm(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (dy, x, scale, y) = (
        cx.dy(node, dys, 0)?,
        cx.input(node, 0)?,
        cx.input(node, 1)?,
        cx.forward_output(node, 0)?,
    );
    let elem = cx.elem(node, x)?;
    let rank = cx.need_rank(node, x)? as i64;
    let axis = cx.int_attr(node, "axis", -1)?;
    let axis = if axis < 0 { axis + rank } else { axis };
    if !(0..rank).contains(&axis) {
        return Err(cx.error(node, format!("axis is out of range for rank {rank}")));
    }
    let axes: Vec<i64> = (axis..rank).collect();
    // The forward computes in `stash_type` (float32 by default, whatever X's type is).
    let work = cx.int_attr(node, "stash_type", DataType::Float as i64)? as i32;
    let epsilon = cx.float_attr(node, "epsilon", 1e-5)? as f64;
    let h = format!("{}_grad", cx.model().name(x));
    let xw = cast(cx, x, elem, work, &h);
    let squares = cx.op("Mul", &[xw, xw], vec![], &h);
    let mean_square = cx.reduce("ReduceMean", squares, &axes, true, &h);
    let eps = cx.scalar(work, epsilon);
    let shifted = cx.op("Add", &[mean_square, eps], vec![], &h);
    let rms = cx.op("Sqrt", &[shifted], vec![], &h);
    let r = cx.op("Reciprocal", &[rms], vec![], &h);
    let n = cx.op("Mul", &[xw, r], vec![], &h);
    let mut out = vec![None; wants.len().max(2)];
    if wanted(wants, 1) {
        let hs = format!("{}_grad", cx.model().name(scale));
        // The forward casts the normalised X back to X's type before scaling it.
        let n_x = cast(cx, n, work, elem, &hs);
        let per_element = cx.op_like("Mul", &[dy, n_x], vec![], &hs, y);
        out[1] = Some(cx.unbroadcast(node, per_element, y, scale)?);
    }
    if wanted(wants, 0) {
        let g = cx.op("Mul", &[dy, scale], vec![], &h);
        let g = cast(cx, g, elem, work, &h);
        let gn = cx.op("Mul", &[g, n], vec![], &h);
        let projection = cx.reduce("ReduceMean", gn, &axes, true, &h);
        let along = cx.op("Mul", &[n, projection], vec![], &h);
        let tangent = cx.op("Sub", &[g, along], vec![], &h);
        let dx = cx.op("Mul", &[tangent, r], vec![], &h);
        let dx = cast(cx, dx, work, elem, &h);
        let facts = cx.facts(x);
        cx.shapes.set(dx, facts);
        out[0] = Some(dx);
    }
    out.truncate(wants.len().max(1));
    Ok(out)
}

pub fn mean_variance_norm(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (dy, x, y) = (
        cx.dy(node, dys, 0)?,
        cx.input(node, 0)?,
        cx.forward_output(node, 0)?,
    );
    let rank = cx.need_rank(node, x)? as i64;
    let axes = cx.ints_attr(node, "axes")?.unwrap_or_else(|| vec![0, 2, 3]);
    let axes: Vec<i64> = axes
        .iter()
        .map(|&a| if a < 0 { a + rank } else { a })
        .collect();
    if let Some(a) = axes.iter().find(|a| !(0..rank).contains(*a)) {
        return Err(cx.error(node, format!("axis {a} is out of range for rank {rank}")));
    }
    let h = format!("{}_grad", cx.model().name(x));
    // The forward's statistics, as its function body computes them.
    let mean = cx.reduce("ReduceMean", x, &axes, true, &h);
    let squares = cx.op("Mul", &[x, x], vec![], &h);
    let mean_of_squares = cx.reduce("ReduceMean", squares, &axes, true, &h);
    let square_of_mean = cx.op("Mul", &[mean, mean], vec![], &h);
    let variance = cx.op("Sub", &[mean_of_squares, square_of_mean], vec![], &h);
    let sigma = cx.op("Sqrt", &[variance], vec![], &h);
    let eps = cx.scalar_like(node, x, 1e-9)?;
    let d = cx.op("Add", &[sigma, eps], vec![], &h);
    let centred = cx.op("Sub", &[x, mean], vec![], &h);
    let direction = cx.op("Div", &[centred, sigma], vec![], &h);
    let mean_dy = cx.reduce("ReduceMean", dy, &axes, true, &h);
    let dy_y = cx.op("Mul", &[dy, y], vec![], &h);
    let projection = cx.reduce("ReduceMean", dy_y, &axes, true, &h);
    let along = cx.op("Mul", &[direction, projection], vec![], &h);
    let less_mean = cx.op("Sub", &[dy, mean_dy], vec![], &h);
    let tangent = cx.op("Sub", &[less_mean, along], vec![], &h);
    let mut out = vec![None; wants.len().max(1)];
    out[0] = Some(cx.op_like("Div", &[tangent, d], vec![], &h, x));
    Ok(out)
}

pub fn lrn(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (dy, x) = (cx.dy(node, dys, 0)?, cx.input(node, 0)?);
    let size = cx.int_attr(node, "size", 0)?;
    if size < 1 {
        return Err(cx.error(node, format!("size {size} is not a positive window")));
    }
    let alpha = cx.float_attr(node, "alpha", 1e-4)? as f64;
    let beta = cx.float_attr(node, "beta", 0.75)? as f64;
    let bias = cx.float_attr(node, "bias", 1.0)? as f64;
    let elem = cx.elem(node, x)?;
    let rank = cx.need_rank(node, x)?;
    let channels = match cx.facts(x).dims.as_ref().and_then(|d| d.get(1).cloned()) {
        Some(Dim::Known(c)) if rank >= 3 => c,
        _ => {
            return Err(cx.error(
                node,
                format!(
                    "the channel count (axis 1) of '{}' must be known, and its rank at least 3",
                    cx.model().name(x)
                ),
            ))
        }
    };
    if channels * channels > super::MAX_CONSTANT_ELEMENTS {
        return Err(cx.error(
            node,
            format!("{channels} channels: the [C, C] window matrix would be too large"),
        ));
    }
    let h = format!("{}_grad", cx.model().name(x));
    // band[c][i] = 1 where i ∈ W(c); its transpose sums over the windows that hold i.
    let (before, after) = ((size - 1) / 2, size / 2);
    let c = channels as usize;
    let mut band = vec![0f32; c * c];
    let mut band_t = vec![0f32; c * c];
    for row in 0..channels {
        for col in (row - before).max(0)..=(row + after).min(channels - 1) {
            band[(row * channels + col) as usize] = 1.0;
            band_t[(col * channels + row) as usize] = 1.0;
        }
    }
    let matrix = |cx: &mut Grad<'_>, values: Vec<f32>, hint: &str| {
        let m = cx.constant(hint, tensor_f32(&[channels, channels], &values));
        if elem == DataType::Float as i32 {
            m
        } else {
            cx.cast_to(m, elem, hint)
        }
    };
    let band = matrix(cx, band, "lrn_window");
    let band_t = matrix(cx, band_t, "lrn_window_t");
    let view = cx.ints(&[0, channels, -1]);
    let shape = cx.shape_of(x);
    let window_sum = |cx: &mut Grad<'_>, m: ValueId, t: ValueId, hint: &str| {
        let flat = cx.op("Reshape", &[t, view], vec![], hint);
        let summed = cx.op("MatMul", &[m, flat], vec![], hint);
        cx.op_like("Reshape", &[summed, shape], vec![], hint, x)
    };

    let squares = cx.mul(x, x, &format!("{h}_sq"));
    let sum = window_sum(cx, band, squares, &format!("{h}_window_sum"));
    let k = cx.scalar(elem, alpha / size as f64);
    let b = cx.scalar(elem, bias);
    let scaled = cx.mul(k, sum, &h);
    let s = cx.add(b, scaled, &format!("{h}_s"));
    let neg_beta = cx.scalar(elem, -beta);
    let s_pow = cx.pow(s, neg_beta, &format!("{h}_s_pow")); // s^-β
    let direct = cx.mul(dy, s_pow, &format!("{h}_direct"));
    let s_pow_1 = cx.div(s_pow, s, &format!("{h}_s_pow1")); // s^(-β-1)
    let dy_x = cx.mul(dy, x, &h);
    let through = cx.mul(dy_x, s_pow_1, &h);
    let gathered = window_sum(cx, band_t, through, &format!("{h}_window_back"));
    let coefficient = cx.scalar(elem, 2.0 * alpha * beta / size as f64);
    let x_scaled = cx.mul(coefficient, x, &h);
    let cross = cx.mul(x_scaled, gathered, &h);
    let mut out = vec![None; wants.len().max(1)];
    out[0] = Some(cx.op_like("Sub", &[direct, cross], vec![], &h, x));
    Ok(out)
}
