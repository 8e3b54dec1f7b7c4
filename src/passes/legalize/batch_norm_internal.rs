//! `com.microsoft::BatchNormInternal(X, scale, B, mean, var; epsilon, momentum) ->
//! (Y, running_mean, running_var, saved_mean, saved_inv_std)`: BatchNorm in training mode,
//! normalising with the batch's own statistics over all axes but 1.
//!
//! ```text
//! saved_mean    = Σ X / n                     batch_var = Σ (X - saved_mean)² / n   (biased)
//! saved_inv_std = sqrt(1 / (batch_var + epsilon))
//! Y             = X · g + (B - saved_mean · g),   g = saved_inv_std · scale
//! running_mean  = mean · momentum + saved_mean · (1 - momentum)
//! running_var   = var  · momentum + batch_var  · (1 - momentum)
//! ```
//!
//! With `RunningVar::Unbiased` (PyTorch's convention, chosen by `autodiff` for a model
//! torch exported) the running variance moves with `batch_var · n / (n - 1)` instead, `n`
//! the batch's values per channel (per window: the window's `K·n`); the normalisation
//! itself stays biased, as in torch.
//!
//! All in the kernel's order of operations: the variance sums each image's squared norm
//! (ReduceSumSquare over the spatial axes) over the batch, and Y is one per-channel affine
//! pass (inference-mode BatchNormalization with mean 0, variance 1, epsilon 0, see
//! `batch_norm_grad::affine`) with the kernel's `g` and shift; everything else is on `[C]`
//! vectors. Four full-size passes: the mean, `X - mean`, its squared norms, Y.
//!
//! Not standard BatchNormalization with `training_mode=1`, although its outputs are the
//! same (biased variance, momentum weighting the old value; measured): it does not give the
//! saved statistics, engines such as tract lack it, and ONNX Runtime (1.19 and 1.31) aliases
//! its running outputs to its mean and var inputs, which goes wrong when those are
//! initializers (measured: with two equal constant inputs both outputs return the variance,
//! and a shared constant is overwritten for the next run), so the statistics cannot be had
//! from it by feeding constants with momentum 0 either.
//!
//! State: the graph leaves the running outputs unconnected while the training build writes
//! them in place into the `mean` and `var` inputs. Here they become values that are graph
//! outputs `<input>.next`, recorded as `bn_stat` state of those inputs.

use super::{node_error, Lowering};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, NodeId, ValueDef, ValueId};
use crate::passes::window::{StateDecl, Window};
use crate::passes::{PassError, RunningVar};
use crate::state::{Role, StateEntry};

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let x = l.input(node, 0)?;
    let scale = l.input(node, 1)?;
    let bias = l.input(node, 2)?;
    let mean = l.input(node, 3)?;
    let var = l.input(node, 4)?;
    let epsilon = l.float_attr(node, "epsilon", 1e-5)?;
    let momentum = l.float_attr(node, "momentum", 0.9)?;
    let training_mode = l.int_attr(node, "training_mode", 1)?;
    if training_mode != 1 {
        return Err(l.unsupported(node, "training_mode", format!("{training_mode}")));
    }
    for stat in [mean, var] {
        let model = l.model();
        if model.value(stat).def != (ValueDef::Input { body: BodyId::MAIN })
            || model.node(node).body != BodyId::MAIN
        {
            return Err(node_error(
                model,
                node,
                format!(
                    "running statistic '{}' is not a graph input of the main graph, so its in-place update cannot become state",
                    model.name(stat)
                ),
            ));
        }
    }
    let elem = l.float_type(node, x)?;

    // Y and the batch statistics (mean, biased variance), per channel.
    let rank = l.rank(x).ok_or_else(|| {
        node_error(
            l.model(),
            node,
            format!("the rank of X ('{}') is not declared", l.model().name(x)),
        )
    })?;
    let stats = BatchStats::compute(l, x, scale, rank, elem);
    // Y = X · (scale · inv_std) + (B - mean · scale · inv_std), as the kernel computes it.
    let inv_std = stats.inv_std(l, epsilon, elem);
    let gain = l.op("Mul", &[inv_std, scale], vec![], "gain");
    let shift = l.op("Mul", &[stats.mean, gain], vec![], "shift");
    let shift = l.op("Sub", &[bias, shift], vec![], "shift");
    let y = super::batch_norm_grad::affine(l, x, gain, shift, scale, elem, "Y");
    l.replace(node, 0, y);
    l.replace(node, 3, stats.mean);
    l.replace(node, 4, inv_std);
    // The lowering is given the window only when the statistics pool per window.
    match l.window.take() {
        Some(window) => {
            // Out of `l` for the call, which borrows `l` too; back whatever the result.
            let result =
                pool_per_window(l, &mut *window, node, [mean, var], &stats, momentum, elem);
            l.window = Some(window);
            result
        }
        None => {
            let keep = l.scalar("momentum", elem, momentum as f64);
            let take = l.scalar("one_minus_momentum", elem, (1.0 - momentum) as f64);
            let [next_mean, next_var] = [mean, var].map(|v| format!("{}.next", l.model().name(v)));
            let running_mean = running(l, mean, stats.mean, keep, take, &next_mean);
            let batch_var = match l.running_var {
                RunningVar::Biased => stats.var,
                RunningVar::Unbiased => {
                    let bessel = bessel_factor(l, stats.count, elem, "bessel");
                    l.op("Mul", &[stats.var, bessel], vec![], "batch_var_unbiased")
                }
            };
            let running_var = running(l, var, batch_var, keep, take, &next_var);
            for (slot, input, next) in [(1, mean, running_mean), (2, var, running_var)] {
                l.replace(node, slot, next);
                expose_state(l, input, next);
            }
            Ok(())
        }
    }
}

/// Running statistics updated once per window from the window's pooled batch statistics:
///
/// ```text
/// every micro-step:  S1 += mean_i ;  S2 += var_i + mean_i²          (state, zeroed per window)
/// at the boundary:   mean = S1 / n ;  var = S2 / n - mean²           (n micro-steps)
///                    running = momentum · running + (1 - momentum) · (mean, var)
/// ```
///
/// For equal micro-batches this is exactly the window's batch mean and biased variance,
/// so K micro-batches of B move the running statistics like one batch of K·B; with
/// `RunningVar::Unbiased` the variance is that batch's unbiased one, `· K·n / (K·n - 1)`.
fn pool_per_window(
    l: &mut Lowering<'_, '_>,
    window: &mut Window,
    node: NodeId,
    [mean, var]: [ValueId; 2],
    stats: &BatchStats,
    momentum: f32,
    elem: i32,
) -> Result<(), PassError> {
    let main = BodyId::MAIN;
    let channels = match l
        .model()
        .value_type(mean)
        .map(|t| crate::signature::TensorInfo::of("", Some(&t)).shape)
    {
        Some(shape) if shape.len() == 1 && shape[0].parse::<i64>().is_ok() => {
            shape[0].parse::<i64>().unwrap_or(0)
        }
        _ => {
            return Err(node_error(
                l.model(),
                node,
                format!(
                    "running statistic '{}' has no static [C] shape, needed to pool it per window",
                    l.model().name(mean)
                ),
            ))
        }
    };
    let mean_sq = l.op("Mul", &[stats.mean, stats.mean], vec![], "batch_mean_sq");
    let second_moment = l.op("Add", &[stats.var, mean_sq], vec![], "batch_second_moment");
    let zeros = crate::ir::builder::tensor_f32(&[channels], &vec![0.0; channels as usize]);
    let mut sums = Vec::new();
    for (stat, contribution, what) in [
        (mean, stats.mean, "mean_sum"),
        (var, second_moment, "second_moment_sum"),
    ] {
        let name = format!("ga.bn.{}.{what}", l.model().name(stat));
        let stat_name = l.model().name(stat).to_string();
        let (slot, total) = window.declare_running(
            l.b.model,
            l.state,
            StateDecl::new(&name, zeros.clone(), Role::BnStat).of(&stat_name),
            |model, input| {
                crate::ir::builder::Builder::new(model, main, super::PASS).op(
                    "Add",
                    &[input, contribution],
                    vec![],
                    &format!("{name}.new"),
                )
            },
        );
        let zero =
            l.b.model
                .add_initializer(window.body(), &format!("{name}.zero"), zeros.clone());
        window
            .set_next(l.b.model, slot, zero)
            .map_err(|e| e.in_pass(super::PASS))?;
        sums.push(total);
    }
    let mut b = window.builder(l.b.model, super::PASS);
    let n = b.op(
        "Cast",
        &[window.count()],
        vec![crate::ir::builder::attr_int("to", elem as i64)],
        "bn_micro_steps",
    );
    let pooled_mean = b.op("Div", &[sums[0], n], vec![], "bn_window_mean");
    let second = b.op("Div", &[sums[1], n], vec![], "bn_window_second_moment");
    let pooled_mean_sq = b.op(
        "Mul",
        &[pooled_mean, pooled_mean],
        vec![],
        "bn_window_mean_sq",
    );
    let pooled_var = b.op("Sub", &[second, pooled_mean_sq], vec![], "bn_window_var");
    let pooled_var = match l.running_var {
        RunningVar::Biased => pooled_var,
        RunningVar::Unbiased => {
            // The window's values per channel: K micro-batches of n.
            let total = b.op("Mul", &[stats.count, n], vec![], "bn_window_count");
            let one = b.scalar_f32("bn_one", 1.0);
            let less_one = b.op("Sub", &[total, one], vec![], "bn_window_count_less_one");
            let less_one = b.op("Max", &[less_one, one], vec![], "bn_window_count_less_one");
            let bessel = b.op("Div", &[total, less_one], vec![], "bn_window_bessel");
            b.op(
                "Mul",
                &[pooled_var, bessel],
                vec![],
                "bn_window_var_unbiased",
            )
        }
    };
    let keep = b.scalar_f32("bn_momentum", momentum);
    let take = b.scalar_f32("bn_one_minus_momentum", 1.0 - momentum);
    for (stat, pooled) in [(mean, pooled_mean), (var, pooled_var)] {
        let name = l.model().name(stat).to_string();
        let mut b = window.builder(l.b.model, super::PASS);
        let old = b.op("Mul", &[stat, keep], vec![], &format!("{name}.running_old"));
        let new = b.op(
            "Mul",
            &[pooled, take],
            vec![],
            &format!("{name}.running_window"),
        );
        let next = b.op("Add", &[old, new], vec![], &format!("{name}.running_next"));
        let slot = window.declare(
            l.b.model,
            l.state,
            StateDecl::existing(stat, Role::BnStat).of(&name),
        );
        window
            .set_next(l.b.model, slot, next)
            .map_err(|e| e.in_pass(super::PASS))?;
    }
    Ok(())
}

/// `n / max(n - 1, 1)`: Bessel's correction for `n` values (one value has no spread to
/// correct, and torch refuses such a batch in training).
fn bessel_factor(l: &mut Lowering<'_, '_>, n: ValueId, elem: i32, hint: &str) -> ValueId {
    let one = l.scalar("one", elem, 1.0);
    let less_one = l.op("Sub", &[n, one], vec![], "n_less_one");
    let less_one = l.op("Max", &[less_one, one], vec![], "n_less_one");
    l.op("Div", &[n, less_one], vec![], hint)
}

/// `keep · old + take · batch`
fn running(
    l: &mut Lowering<'_, '_>,
    old: ValueId,
    batch: ValueId,
    keep: ValueId,
    take: ValueId,
    hint: &str,
) -> ValueId {
    let a = l.op("Mul", &[old, keep], vec![], "running_old");
    let b = l.op("Mul", &[batch, take], vec![], "running_batch");
    l.op("Add", &[a, b], vec![], hint)
}

/// Makes `next` the graph output carrying the next value of state input `input`.
fn expose_state(l: &mut Lowering<'_, '_>, input: ValueId, next: ValueId) {
    let m = &mut *l.b.model;
    let already_output = m.uses(next).iter().any(|u| {
        matches!(
            u,
            crate::ir::Use::Output {
                body: BodyId::MAIN,
                ..
            }
        )
    });
    if !already_output {
        let ty = m.value_type(input);
        m.add_output(BodyId::MAIN, next, ty);
    }
    let input_name = m.name(input).to_string();
    l.state.push(StateEntry {
        input: input_name.clone(),
        output: m.name(next).to_string(),
        role: Role::BnStat,
        param: Some(input_name),
    });
}

/// The batch statistics: per-channel mean and biased variance, `[C]`.
struct BatchStats {
    mean: ValueId,
    var: ValueId,
    /// The values per channel, `n` (a float scalar).
    count: ValueId,
}

impl BatchStats {
    /// In the kernel's order: the mean by one reduction; the variance as the sum over the
    /// batch of each image's squared norm of `X - mean`, divided by `n`.
    fn compute(
        l: &mut Lowering<'_, '_>,
        x: ValueId,
        scale: ValueId,
        rank: usize,
        elem: i32,
    ) -> BatchStats {
        let axes: Vec<i64> = std::iter::once(0).chain(2..rank as i64).collect();
        let mean_kept = l.reduce("ReduceMean", x, &axes, true, "batch_mean");
        let centered = l.op("Sub", &[x, mean_kept], vec![], "centered");
        let squares = if rank > 2 {
            let spatial: Vec<i64> = (2..rank as i64).collect();
            let per_image = l.reduce(
                "ReduceSumSquare",
                centered,
                &spatial,
                false,
                "squared_norms",
            );
            l.reduce("ReduceSum", per_image, &[0], false, "sum_of_squares")
        } else {
            l.reduce("ReduceSumSquare", centered, &[0], false, "sum_of_squares")
        };
        let n = super::batch_norm_grad::per_channel_count(l, x, scale, elem);
        let var = l.op("Div", &[squares, n], vec![], "batch_var");
        let flat = l.int64s("flat", &[-1]);
        let mean = l.op("Reshape", &[mean_kept, flat], vec![], "saved_mean");
        BatchStats {
            mean,
            var,
            count: n,
        }
    }

    /// `sqrt(1 / (var + epsilon))`, in the training build's order of operations.
    fn inv_std(&self, l: &mut Lowering<'_, '_>, epsilon: f32, elem: i32) -> ValueId {
        let eps = l.scalar("epsilon", elem, epsilon as f64);
        let shifted = l.op("Add", &[self.var, eps], vec![], "var_eps");
        let inverse = l.op("Reciprocal", &[shifted], vec![], "inv_var");
        l.op("Sqrt", &[inverse], vec![], "saved_inv_std")
    }
}
