//! The learning rate by optimizer step (`train --warmup W --decay linear|cosine
//! --decay-steps T --min-lr M`), set on the step's learning-rate input before each window.
//!
//! For optimizer step `w` (0-based, counted from the start of training: micro-step `g` is in
//! window `g / K`, so a resumed run continues the schedule), with `lr` the step's learning
//! rate (or `--lr`):
//!
//! - warm-up: `lr · (w + 1) / W` while `w < W` (the first update already moves; it rises
//!   linearly to `lr` at step `W - 1`);
//! - then decay over `p = (w - W) / (T - W)`, clamped to `[0, 1]`:
//!   `M + (lr - M) · f(p)`, with `f(p) = 1 - p` (linear) or `(1 + cos(π p)) / 2` (cosine),
//!   so it reaches `M` at step `T` and stays there;
//! - `--decay none` (the default) keeps `lr` after the warm-up.
//!
//! Computed in float64, rounded once to the float32 the step takes.

/// How the learning rate falls after the warm-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Decay {
    /// Constant.
    #[default]
    None,
    /// Linearly to the minimum at the decay step.
    Linear,
    /// Along half a cosine to the minimum at the decay step.
    Cosine,
}

/// A schedule for a base learning rate.
#[derive(Clone, Debug, PartialEq)]
pub struct LrSchedule {
    pub base: f64,
    /// Optimizer steps of linear warm-up (0: none).
    pub warmup: u64,
    pub decay: Decay,
    /// The optimizer step at which the decay reaches `min` (used unless `decay` is `None`).
    pub decay_steps: u64,
    pub min: f64,
}

impl LrSchedule {
    /// Checks the schedule ([`check_flags`], and the minimum at most `base`).
    pub fn new(
        base: f64,
        warmup: u64,
        decay: Decay,
        decay_steps: Option<u64>,
        min: f64,
    ) -> Result<LrSchedule, String> {
        let decay_steps = check_flags(warmup, decay, decay_steps, min)?;
        if min > base {
            return Err(format!(
                "--min-lr {min} must not exceed the learning rate {base}"
            ));
        }
        Ok(LrSchedule {
            base,
            warmup,
            decay,
            decay_steps,
            min,
        })
    }

    /// The learning rate of optimizer step `window` (0-based).
    pub fn at(&self, window: u64) -> f32 {
        if window < self.warmup {
            return (self.base * (window + 1) as f64 / self.warmup as f64) as f32;
        }
        let progress = match self.decay {
            Decay::None => return self.base as f32,
            _ => ((window - self.warmup) as f64 / (self.decay_steps - self.warmup) as f64).min(1.0),
        };
        let fraction = match self.decay {
            Decay::Linear => 1.0 - progress,
            _ => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        };
        (self.min + (self.base - self.min) * fraction) as f32
    }
}

/// Checks the flags of a schedule before anything is read: a decay needs a decay step after
/// the warm-up (returned; 0 without a decay), a decay step needs a decay, and the minimum is
/// finite and not negative.
pub fn check_flags(
    warmup: u64,
    decay: Decay,
    decay_steps: Option<u64>,
    min: f64,
) -> Result<u64, String> {
    if !(min.is_finite() && min >= 0.0) {
        return Err(format!("--min-lr {min} must be finite and not negative"));
    }
    match (decay, decay_steps) {
        (Decay::None, None) => Ok(0),
        (Decay::None, Some(_)) => {
            Err("--decay-steps is given without --decay linear|cosine".into())
        }
        (_, None) => Err("--decay linear|cosine needs --decay-steps T".into()),
        (_, Some(t)) if t <= warmup => Err(format!(
            "--decay-steps {t} must be after the warm-up's {warmup} optimizer steps"
        )),
        (_, Some(t)) => Ok(t),
    }
}
