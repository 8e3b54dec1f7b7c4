//! `loss-scale(init=65536,growth=2,backoff=0.5,interval=2000,min=1,hysteresis=1)` and
//! `loss-scale(static=S)`: window-granular loss scaling with PyTorch GradScaler's semantics
//! (DESIGN.md section 5) and DeepSpeed's hysteresis as an option. Runs after `grad-accum`
//! and before `optimizer` (and before anything else that reads the window's gradient).
//!
//! ```text
//! every micro-step:  seed' = isfinite(loss) ? seed * S : NaN   (S frozen within the window)
//!                    acc_p += scaled gradient          (grad-accum's fp32 accumulators)
//! at the boundary:   G_p  = G_p / S                    (the window's normalised gradient)
//!                    ok   = no element of any G_p is NaN or inf
//!                           (sum_p ReduceSum(Cast(IsNaN(G_p) or IsInf(G_p))) == 0)
//!   ok:      update parameters and moments; opt_step += 1; tracker += 1;
//!            tracker == interval: S <- min(S * growth, FLT_MAX), tracker <- 0
//!   not ok:  parameters, moments and opt_step keep their values (bit for bit);
//!            S <- max(S * backoff, min), tracker <- 0            (hysteresis=1)
//!   both:    accumulators, micro_step and weight_sum reset as every window does
//! ```
//!
//! The check counts the non-finite elements with `IsNaN` and `IsInf`: exact for inf and NaN,
//! never fooled by a sum of large finite values overflowing, and nothing an engine may
//! simplify. (It used to sum `G_p * 0`, which is NaN exactly when some element is not finite
//! — but tract simplifies `x * 0` to a zero constant, so on tract a poisoned window was
//! applied; tests/loss_scale.rs measures that.)
//!
//! The loss is checked too, at every micro-step: a non-finite loss replaces the scaled seed
//! by NaN, so the micro-step's gradients are NaN and the window is skipped even if its
//! gradients would have been finite. Non-finite inputs are caught through the loss and the
//! gradients they reach (an input that reaches neither cannot change the update). BatchNorm
//! running statistics that move once per window (`bn_stats=window`) are held back with the
//! parameters; with `bn_stats=micro` they move at every micro-step and are not.
//!
//! State (all routed through the apply region, so it changes only at a window boundary):
//!
//! - `ga.loss_scale` (float32 scalar, role `loss_scale`): S.
//! - `ga.loss_scale.tracker` (int64 scalar, role `growth_tracker`): GradScaler's growth
//!   tracker, the finite windows since the last growth or backoff. With `hysteresis=H > 1`
//!   the same counter also holds the run of non-finite windows as a negative number: a
//!   non-finite window makes it `-b` (b = consecutive non-finite windows); S backs off when
//!   b reaches H, and from then on at every further consecutive non-finite window (the
//!   counter stays at `-(H-1)`), until a finite window starts a new finite run at 1. That
//!   is DeepSpeed's `consecutive_hysteresis=true`; with H = 1 the counter is never negative
//!   and this is GradScaler exactly.
//!
//! The static form multiplies by the constant S and divides it out again; it has no state
//! and never changes S, but still skips a non-finite window (as DeepSpeed's static scaler
//! does). A power-of-two S is exact: training is bit-identical to no scaling.
//!
//! The skip works through [`Window::set_gate`]: the parameters, moments and the
//! optimizer-step counter that later passes route keep their old values unless `ok`. The
//! `ga.applied` output becomes false on a skipped window and `ga.skipped` is true there.
//!
//! Unlike GradScaler the scale is capped at the float32 maximum when it grows (as flax's
//! DynamicScale), so it can never become inf and stick there; and a non-finite window at
//! the minimum scale skips without aborting (DeepSpeed raises there).

use super::window::{StateDecl, Window, WindowError};
use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, tensor_f32, tensor_i64, Builder};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, Model, ValueId};
use crate::proto::tensor_proto::DataType;
use crate::state::Role;

pub const PASS: &str = "loss-scale";

/// Dynamic scaling hyperparameters (GradScaler's names and defaults, plus `min` and
/// DeepSpeed's `hysteresis`).
#[derive(Clone, Debug, PartialEq)]
pub struct Dynamic {
    pub init: f32,
    pub growth: f32,
    pub backoff: f32,
    /// Finite windows (optimizer steps) between growths.
    pub interval: i64,
    pub min: f32,
    /// Consecutive non-finite windows before the first backoff.
    pub hysteresis: i64,
}

impl Default for Dynamic {
    fn default() -> Self {
        Dynamic {
            init: 65536.0,
            growth: 2.0,
            backoff: 0.5,
            interval: 2000,
            min: 1.0,
            hysteresis: 1,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum LossScale {
    Dynamic(Dynamic),
    Static(f32),
}

const DYNAMIC_OPTIONS: [&str; 6] = ["init", "growth", "backoff", "interval", "min", "hysteresis"];

fn spec_error(message: String) -> PassError {
    PassError::Spec {
        spec: PASS.into(),
        message,
    }
}

fn fail(message: String) -> PassError {
    PassError::Other {
        pass: PASS.into(),
        message,
    }
}

/// A float for a spec string: plain for ordinary magnitudes, exponent form for huge or tiny
/// ones (both parse back to the same f32).
fn number(v: f32) -> String {
    if v != 0.0 && !(1e-4..1e7).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

impl LossScale {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        let mut known = DYNAMIC_OPTIONS.to_vec();
        known.push("static");
        options.only(&known)?;
        if let Some(s) = options.parse::<f32>("static")? {
            if let Some(k) = DYNAMIC_OPTIONS.iter().find(|k| options.get(k).is_some()) {
                return Err(spec_error(format!(
                    "static={} fixes the scale; option {k} is for dynamic scaling only",
                    options.get("static").unwrap_or_default()
                )));
            }
            if !(s.is_finite() && s > 0.0) {
                return Err(spec_error(format!(
                    "static={s}: the scale must be positive and finite"
                )));
            }
            return Ok(LossScale::Static(s));
        }
        let d = Dynamic::default();
        let d = Dynamic {
            init: options.parse("init")?.unwrap_or(d.init),
            growth: options.parse("growth")?.unwrap_or(d.growth),
            backoff: options.parse("backoff")?.unwrap_or(d.backoff),
            interval: options.parse("interval")?.unwrap_or(d.interval),
            min: options.parse("min")?.unwrap_or(d.min),
            hysteresis: options.parse("hysteresis")?.unwrap_or(d.hysteresis),
        };
        let positive = |name: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(spec_error(format!(
                    "{name}={v}: must be positive and finite"
                )))
            }
        };
        positive("init", d.init)?;
        positive("min", d.min)?;
        positive("backoff", d.backoff)?;
        if !(d.growth.is_finite() && d.growth >= 1.0) {
            return Err(spec_error(format!(
                "growth={}: must be at least 1",
                d.growth
            )));
        }
        if d.backoff > 1.0 {
            return Err(spec_error(format!(
                "backoff={}: must be at most 1",
                d.backoff
            )));
        }
        if d.interval < 1 {
            return Err(spec_error(format!(
                "interval={}: must be at least 1",
                d.interval
            )));
        }
        if d.hysteresis < 1 {
            return Err(spec_error(format!(
                "hysteresis={}: must be at least 1",
                d.hysteresis
            )));
        }
        Ok(LossScale::Dynamic(d))
    }
}

impl LossScale {
    /// The resolved settings (the pipeline marks those the spec gave).
    fn recipe(&self) -> crate::recipe::Section {
        use crate::recipe::Origin::Default;
        let mut s = crate::recipe::Section::new(PASS);
        match self {
            LossScale::Static(v) => s.set_f32("static", *v, Default),
            LossScale::Dynamic(d) => {
                s.set_f32("init", d.init, Default);
                s.set_f32("growth", d.growth, Default);
                s.set_f32("backoff", d.backoff, Default);
                s.set("interval", d.interval, Default);
                s.note("interval", "finite windows between growths");
                s.set_f32("min", d.min, Default);
                s.set("hysteresis", d.hysteresis, Default);
                s.note("hysteresis", "overflowing windows before a backoff");
            }
        }
        s
    }
}

impl Pass for LossScale {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::LossScale
    }

    /// The window, before the optimizer (the scale decides whether its update happens).
    fn requires(&self, _model: &Model, cx: &PassContext<'_>) -> Result<(), PassError> {
        super::requires_window(cx, PASS)?;
        if cx.window().is_some_and(|w| w.optimized()) {
            return Err(fail(
                "the apply region already has an optimizer; run loss-scale before optimizer (it decides whether the update happens)".into(),
            ));
        }
        Ok(())
    }

    fn spec(&self) -> String {
        match self {
            LossScale::Static(s) => format!("{PASS}(static={})", number(*s)),
            LossScale::Dynamic(d) => format!(
                "{PASS}(init={},growth={},backoff={},interval={},min={},hysteresis={})",
                number(d.init),
                number(d.growth),
                number(d.backoff),
                d.interval,
                number(d.min),
                d.hysteresis
            ),
        }
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        cx.window_mut(PASS)?;
        cx.recipe.push(self.recipe());
        self.scale(model, cx)
    }
}

fn window_error(e: WindowError) -> PassError {
    e.in_pass(PASS)
}

impl LossScale {
    fn scale(&self, model: &mut Model, cx: &mut PassContext<'_>) -> Result<PassReport, PassError> {
        let window = cx.window_mut(PASS)?;
        if window.gated() {
            return Err(fail(
                "the apply region is already gated (loss-scale runs once)".into(),
            ));
        }
        if window.clipped() {
            return Err(fail(
                "agc already clipped the gradients; run loss-scale before agc (it unscales them first)".into(),
            ));
        }
        let main = BodyId::MAIN;
        let seed_name = cx.signature.seed.clone().ok_or_else(|| {
            fail("the training signature has no backward seed to scale; name the scalar initializer that seeds the backward pass (--seed)".into())
        })?;
        let seed = model.lookup(main, &seed_name).ok_or_else(|| {
            fail(format!(
                "the backward seed '{seed_name}' is not a value of the graph"
            ))
        })?;
        let seed_type = model
            .value_type(seed)
            .and_then(|t| t.tensor_elem())
            .unwrap_or(DataType::Float as i32);
        let seed_uses: Vec<_> = model
            .uses(seed)
            .iter()
            .filter_map(|u| match u {
                crate::ir::Use::Node { node, slot } => Some((*node, *slot)),
                crate::ir::Use::Output { .. } => None,
            })
            .collect();
        if seed_uses.is_empty() {
            return Err(fail(format!(
                "the backward seed '{seed_name}' feeds nothing; there is no backward pass to scale"
            )));
        }
        let loss_name = cx.signature.loss.clone();
        let nodes_before = model.all_nodes().count();
        let state_before = cx.state.len();
        let (window, state) = cx.window_and_state(PASS)?;

        // S: state for dynamic scaling (its next value set at the boundary, below), a
        // constant for static.
        let (scale, scale_slot) = match self {
            LossScale::Dynamic(d) => {
                let slot = window.declare_deferred(
                    model,
                    StateDecl::new("ga.loss_scale", tensor_f32(&[], &[d.init]), Role::LossScale),
                );
                (slot.input(), Some(slot))
            }
            LossScale::Static(s) => (
                model.add_initializer(main, "ga.loss_scale", tensor_f32(&[], &[*s])),
                None,
            ),
        };

        // Every micro-step: the seed times S, or NaN when the loss is not finite, so that a
        // non-finite loss poisons this micro-step's gradients (and with them the window's
        // check) even where its gradients would have come out finite.
        let loss = model.lookup(main, &loss_name).ok_or_else(|| {
            fail(format!(
                "the loss '{loss_name}' is not a value of the graph"
            ))
        })?;
        let loss_decl = model.value_type(loss);
        let loss_type = loss_decl
            .as_ref()
            .and_then(|t| t.tensor_elem())
            .unwrap_or(DataType::Float as i32);
        let loss_is_scalar = loss_decl
            .and_then(|t| t.tensor_dims())
            .is_some_and(|d| d.is_empty());
        {
            let mut b = Builder::new(model, main, PASS);
            let s = if seed_type == DataType::Float as i32 {
                scale
            } else {
                b.op(
                    "Cast",
                    &[scale],
                    vec![attr_int("to", seed_type as i64)],
                    "ga.loss_scale_cast",
                )
            };
            let scaled = b.op("Mul", &[seed, s], vec![], &format!("{seed_name}.scaled"));
            let loss_f = if loss_type == DataType::Float as i32 {
                loss
            } else {
                b.op(
                    "Cast",
                    &[loss],
                    vec![attr_int("to", DataType::Float as i64)],
                    "ga.loss_scale.loss_f32",
                )
            };
            let loss_bad = if loss_is_scalar {
                nonfinite_mask(&mut b, loss_f, "ga.loss_scale.loss")
            } else {
                nonfinite_any(&mut b, loss_f, "ga.loss_scale.loss")
            };
            let nan = b.scalar_f32("ga.loss_scale.nan", f32::NAN);
            let nan = if seed_type == DataType::Float as i32 {
                nan
            } else {
                b.op(
                    "Cast",
                    &[nan],
                    vec![attr_int("to", seed_type as i64)],
                    "ga.loss_scale.nan_cast",
                )
            };
            let seeded = b.op(
                "Where",
                &[loss_bad, nan, scaled],
                vec![],
                &format!("{seed_name}.scaled_if_finite_loss"),
            );
            for (node, slot) in seed_uses {
                model.set_input(node, slot, Some(seeded));
            }
        }

        // At the boundary: unscale, then one finiteness check over every gradient: how many
        // elements are NaN or infinite, counted exactly (IsNaN, IsInf), never by arithmetic
        // that an engine could simplify away.
        let mut checks = Vec::with_capacity(window.params().len());
        {
            let mut b = window.builder(model, PASS);
            for p in window.params_mut() {
                let unscaled = b.op(
                    "Div",
                    &[p.grad(), scale],
                    vec![],
                    &format!("{}.unscaled_grad", p.name()),
                );
                checks.push(nonfinite_count(
                    &mut b,
                    unscaled,
                    &format!("{}.unscaled_grad", p.name()),
                ));
                p.set_grad(unscaled);
            }
        }
        let ok = {
            let mut b = window.builder(model, PASS);
            let total = match checks.as_slice() {
                [one] => *one,
                many => b.op("Sum", many, vec![], "ga.loss_scale.nonfinite_count"),
            };
            let zero = b.scalar_f32("ga.loss_scale.zero", 0.0);
            let bad = b.op("Greater", &[total, zero], vec![], "ga.loss_scale.nonfinite");
            b.op("Not", &[bad], vec![], "ga.loss_scale.finite")
        };
        window.set_gate(model, ok).map_err(window_error)?;

        if let (LossScale::Dynamic(d), Some(scale_slot)) = (self, scale_slot) {
            let tracker = window.declare_deferred(
                model,
                StateDecl::new(
                    "ga.loss_scale.tracker",
                    tensor_i64(&[], &[0]),
                    Role::GrowthTracker,
                ),
            );
            let (scale_next, tracker_next) =
                dynamic_update(model, window, d, ok, scale, tracker.input());
            window
                .set_deferred(model, state, scale_slot, scale_next)
                .map_err(window_error)?;
            window
                .set_deferred(model, state, tracker, tracker_next)
                .map_err(window_error)?;
        }

        // Metrics: `ga.applied` is true only when the update happened; `ga.skipped` marks a
        // window boundary whose update was dropped.
        let applied = window
            .gate_applied(model, ok, "ga.applied_finite")
            .map_err(window_error)?;
        let bool_type = Some(crate::ir::tensor_type(DataType::Bool as i32, &[]));
        let skipped = Builder::new(model, main, PASS).op(
            "Xor",
            &[window.apply(), applied],
            vec![],
            "ga.skipped",
        );
        model.add_output(main, skipped, bool_type);

        let mut notes = vec![match self {
            LossScale::Static(s) => format!("static scale {}", number(*s)),
            LossScale::Dynamic(d) => format!(
                "dynamic scale from {}, x{} every {} finite windows, x{} after {} non-finite, min {}",
                number(d.init),
                number(d.growth),
                d.interval,
                number(d.backoff),
                d.hysteresis,
                number(d.min)
            ),
        }];
        notes.push(format!(
            "gradients of {} parameter{} unscaled and checked",
            window.params().len(),
            if window.params().len() == 1 { "" } else { "s" }
        ));
        if state.len() > state_before {
            notes.push(format!("{} state pairs", state.len() - state_before));
        }
        Ok(PassReport {
            changed: true,
            added: model.all_nodes().count().saturating_sub(nodes_before),
            removed: 0,
            notes,
        })
    }
}

/// `Or(IsNaN(x), IsInf(x))`, elementwise.
fn nonfinite_mask(b: &mut Builder<'_>, x: ValueId, hint: &str) -> ValueId {
    let nan = b.op("IsNaN", &[x], vec![], &format!("{hint}.is_nan"));
    let inf = b.op("IsInf", &[x], vec![], &format!("{hint}.is_inf"));
    b.or(nan, inf, &format!("{hint}.nonfinite_mask"))
}

/// The number of NaN or infinite elements of float32 `x`, as a float32 scalar (exact up to
/// 2^24, and positive whenever there is one).
fn nonfinite_count(b: &mut Builder<'_>, x: ValueId, hint: &str) -> ValueId {
    let mask = nonfinite_mask(b, x, hint);
    let ones = b.op(
        "Cast",
        &[mask],
        vec![attr_int("to", DataType::Float as i64)],
        &format!("{hint}.nonfinite_f32"),
    );
    b.op(
        "ReduceSum",
        &[ones],
        vec![attr_int("keepdims", 0)],
        &format!("{hint}.nonfinite_count"),
    )
}

/// A bool scalar: whether float32 `x` (a scalar or not) holds a NaN or an infinity.
fn nonfinite_any(b: &mut Builder<'_>, x: ValueId, hint: &str) -> ValueId {
    let count = nonfinite_count(b, x, hint);
    let zero = b.scalar_f32(&format!("{hint}.zero"), 0.0);
    b.op(
        "Greater",
        &[count, zero],
        vec![],
        &format!("{hint}.nonfinite"),
    )
}

/// Next S and tracker at a window boundary, inside the region's body.
fn dynamic_update(
    model: &mut Model,
    window: &Window,
    d: &Dynamic,
    ok: ValueId,
    scale: ValueId,
    tracker: ValueId,
) -> (ValueId, ValueId) {
    let mut b = window.builder(model, PASS);
    let one = b.scalar_i64("ga.loss_scale.one", 1);
    let zero = b.scalar_i64("ga.loss_scale.zero_windows", 0);

    // Finite: tracker += 1 (a run of non-finite windows, negative, ends: it restarts at 1);
    // grow at `interval`, capped at the float32 maximum.
    let run = if d.hysteresis > 1 {
        b.max(tracker, zero, "ga.loss_scale.finite_run")
    } else {
        tracker
    };
    let counted = b.add(run, one, "ga.loss_scale.tracker_inc");
    let interval = b.scalar_i64("ga.loss_scale.interval", d.interval);
    let grow = b.greater_or_equal(counted, interval, "ga.loss_scale.grow");
    let growth = b.scalar_f32("ga.loss_scale.growth", d.growth);
    let grown = b.mul(scale, growth, "ga.loss_scale.grown");
    let cap = b.scalar_f32("ga.loss_scale.max", f32::MAX);
    let grown = b.min(grown, cap, "ga.loss_scale.grown_capped");
    let scale_finite = b.select(grow, grown, scale, "ga.loss_scale.if_finite");
    let tracker_finite = b.select(grow, zero, counted, "ga.loss_scale.tracker_if_finite");

    // Non-finite: back off (not below min), after `hysteresis` consecutive such windows.
    let backoff = b.scalar_f32("ga.loss_scale.backoff", d.backoff);
    let reduced = b.mul(scale, backoff, "ga.loss_scale.reduced");
    let min = b.scalar_f32("ga.loss_scale.min", d.min);
    let backed_off = b.max(reduced, min, "ga.loss_scale.backed_off");
    let (scale_bad, tracker_bad) = if d.hysteresis > 1 {
        let negated = b.neg(tracker, "ga.loss_scale.neg_tracker");
        let bad_before = b.max(negated, zero, "ga.loss_scale.bad_run");
        let bad = b.add(bad_before, one, "ga.loss_scale.bad_run_inc");
        let hysteresis = b.scalar_i64("ga.loss_scale.hysteresis", d.hysteresis);
        let spent = b.greater_or_equal(bad, hysteresis, "ga.loss_scale.hysteresis_spent");
        let scale_bad = b.select(spent, backed_off, scale, "ga.loss_scale.if_nonfinite");
        let kept_run = b.scalar_i64("ga.loss_scale.spent_run", -(d.hysteresis - 1));
        let neg_bad = b.neg(bad, "ga.loss_scale.neg_bad_run");
        let tracker_bad = b.select(
            spent,
            kept_run,
            neg_bad,
            "ga.loss_scale.tracker_if_nonfinite",
        );
        (scale_bad, tracker_bad)
    } else {
        (backed_off, zero)
    };

    let scale_next = b.select(ok, scale_finite, scale_bad, "ga.loss_scale.updated");
    let tracker_next = b.select(
        ok,
        tracker_finite,
        tracker_bad,
        "ga.loss_scale.tracker_updated",
    );
    (scale_next, tracker_next)
}
