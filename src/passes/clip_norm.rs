//! `clip-norm(max_norm=1.0)`: the window's normalised gradients clipped by their global norm,
//! in the apply region between normalisation (and unscaling) and the optimizer, as
//! `torch.nn.utils.clip_grad_norm_(parameters, max_norm)` clips a full batch's:
//!
//! ```text
//! total  = || ( ||G_1||, ||G_2||, ..., ||G_n|| ) ||      (2-norms; the norm of the norms)
//! factor = min(max_norm / (total + 1e-6), 1)
//! G_i   <- G_i · factor                                   (every trainable parameter)
//! ```
//!
//! The per-parameter norms are `ReduceL2` over all axes, stacked (`Unsqueeze`, `Concat`)
//! and reduced again, in torch's order; a window under the limit is multiplied by exactly
//! one. A non-finite total makes every gradient non-finite, as in torch (whose
//! `error_if_nonfinite` defaults to false); loss scaling skips such a window.
//!
//! Unlike AGC (`agc`), which clips each unit against its own weights, this bounds the
//! update's overall size; both may run, in the order the pipeline gives.

use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, Builder};
use crate::ir::emit::Emit;
use crate::ir::Model;

pub const PASS: &str = "clip-norm";

/// torch's guard against a zero norm (`clip_grad_norm_` adds it to the total).
const EPSILON: f32 = 1e-6;

/// The pass.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipNorm {
    /// The largest global norm a window's gradient keeps.
    pub max_norm: f32,
}

impl ClipNorm {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&["max_norm"])?;
        let max_norm: f32 = options.parse("max_norm")?.unwrap_or(1.0);
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(PassError::Spec {
                spec: PASS.into(),
                message: format!("max_norm={max_norm}: must be a positive number"),
            });
        }
        Ok(ClipNorm { max_norm })
    }
}

/// The options a plan prints for `max_norm`.
pub fn options_text(max_norm: f32) -> Vec<String> {
    vec![format!("max_norm={max_norm}")]
}

impl Pass for ClipNorm {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Clip
    }

    /// The window, its gradients not yet consumed by an optimizer.
    fn requires(&self, _model: &Model, cx: &PassContext<'_>) -> Result<(), PassError> {
        super::requires_unconsumed_gradients(cx, PASS)
    }

    fn spec(&self) -> String {
        super::spec_text(PASS, &options_text(self.max_norm))
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        let mut section = crate::recipe::Section::new(PASS);
        section.set_f32("max_norm", self.max_norm, crate::recipe::Origin::Default);
        cx.recipe.push(section);
        let window = cx.window_mut(PASS)?;
        if window.params().is_empty() {
            return Ok(PassReport {
                changed: false,
                notes: vec!["no trainable parameter to clip".into()],
                ..Default::default()
            });
        }
        let nodes_before = model.all_nodes().count();
        let body = window.body();
        let (max_norm, epsilon, one) = {
            let mut b = window.builder(model, PASS);
            (
                b.scalar_f32("clip_norm.max_norm", self.max_norm),
                b.scalar_f32("clip_norm.epsilon", EPSILON),
                b.scalar_f32("clip_norm.one", 1.0),
            )
        };
        let mut b = Builder::new(model, body, PASS);
        // ||G_i|| as a one-element vector each, then the norm of their concatenation.
        let norms: Vec<_> = window
            .params()
            .iter()
            .map(|p| {
                let hint = format!("clip_norm.{}.norm", p.name());
                let norm = match p.dims().is_empty() {
                    true => b.abs(p.grad(), &hint),
                    false => b.reduce("ReduceL2", p.grad(), &[], false, &hint),
                };
                b.unsqueeze(norm, &[0], &format!("{hint}_1"))
            })
            .collect();
        let stacked = b.op(
            "Concat",
            &norms,
            vec![attr_int("axis", 0)],
            "clip_norm.norms",
        );
        let total = b.reduce("ReduceL2", stacked, &[], false, "clip_norm.total");
        let guarded = b.add(total, epsilon, "clip_norm.total_eps");
        let ratio = b.div(max_norm, guarded, "clip_norm.ratio");
        let factor = b.min(ratio, one, "clip_norm.factor");
        let mut names = Vec::new();
        for p in window.params_mut() {
            let grad = b.mul(p.grad(), factor, &format!("{}.clip_norm_grad", p.name()));
            p.set_grad(grad);
            names.push(p.name().to_string());
        }
        window.mark_clipped();
        Ok(PassReport {
            changed: true,
            added: model.all_nodes().count().saturating_sub(nodes_before),
            removed: 0,
            notes: vec![format!(
                "max_norm={}; the global norm of {} gradients: {}",
                self.max_norm,
                names.len(),
                names.join(", ")
            )],
        })
    }
}
