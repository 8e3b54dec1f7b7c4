//! The plan of a step: what the user asked for (accumulation, loss scaling, AGC, the
//! optimizer, precision, the target engine), typed, and the one place that orders the
//! passes. The CLI fills it from its flags; [`StepPlan::spec`] prints the pipeline spec,
//! the format a step records and `--pipeline` takes. Only settings that differ from a
//! pass's defaults are printed, so the recipe a step records tells the defaults apart.
//!
//! The order, and why (each pass also declares its [`super::Phase`], which the pipeline
//! checks): `grad-accum` (after `autodiff` for a forward model, which
//! [`super::autodiff::with_autodiff`] puts first with its own options); loss
//! scaling right after it, so AGC and the optimizer see unscaled gradients; AGC right
//! before the optimizer, after normalisation and unscaling; clipping by the global norm
//! after AGC, so that the optimizer's gradient keeps the bound whatever AGC did; `legalize-ort` once the
//! optimizer has written its math; half precision once only standard ops are left; `dce`;
//! the lowering for tract last.

use super::agc::Selection;
use super::grad_accum::GradAccum;
use super::precision::HalfType;
use super::spec_text;

/// Adaptive gradient clipping: the `agc` pass's options, `eps` kept apart from its default
/// so that the recipe tells a given one from the default.
#[derive(Clone, Debug, PartialEq)]
pub struct AgcPlan {
    pub clip: f32,
    /// `None`: the pass's default.
    pub eps: Option<f32>,
    pub selection: Selection,
}

/// Loss scaling as asked for: only the dynamic settings given are printed (the pass's
/// defaults fill in the rest), so the recipe tells a given value from a default.
#[derive(Clone, Debug, PartialEq)]
pub enum LossScalePlan {
    Dynamic {
        init: Option<f32>,
        interval: Option<i64>,
        hysteresis: Option<i64>,
    },
    Static(f32),
}

impl LossScalePlan {
    /// Dynamic scaling with every setting at the pass's default.
    pub const DYNAMIC: LossScalePlan = LossScalePlan::Dynamic {
        init: None,
        interval: None,
        hysteresis: None,
    };

    /// The `loss-scale` pass's spec.
    pub fn spec(&self) -> String {
        let options = match self {
            LossScalePlan::Static(s) => vec![format!("static={s:e}")],
            LossScalePlan::Dynamic {
                init,
                interval,
                hysteresis,
            } => {
                let mut options = Vec::new();
                if let Some(v) = init {
                    options.push(format!("init={v:e}"));
                }
                if let Some(v) = interval {
                    options.push(format!("interval={v}"));
                }
                if let Some(v) = hysteresis {
                    options.push(format!("hysteresis={v}"));
                }
                options
            }
        };
        spec_text(super::loss_scale::PASS, &options)
    }
}

/// The engine the step is written for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TargetEngine {
    /// ONNX Runtime (standard, CPU or CUDA).
    #[default]
    Ort,
    /// tract: the ops it lacks are lowered in the step itself.
    Tract,
}

impl TargetEngine {
    /// The word of `rewrite --engine`.
    pub fn as_str(self) -> &'static str {
        match self {
            TargetEngine::Ort => "ort",
            TargetEngine::Tract => "tract",
        }
    }
}

value_enum!(TargetEngine: TargetEngine::Ort, TargetEngine::Tract);

/// What to build.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPlan {
    /// The grad-accum pass itself; only the settings that differ from its defaults are
    /// printed.
    pub accumulation: GradAccum,
    /// Loss scaling (`None`: none).
    pub loss_scale: Option<LossScalePlan>,
    pub agc: Option<AgcPlan>,
    /// Clipping by the global norm: its `max_norm` (`None`: none).
    pub clip_norm: Option<f32>,
    /// The optimizer pass itself: its options are its fields (`None`: the producer's or
    /// the formula's default).
    pub optimizer: super::optimizer::Optimizer,
    /// Half precision (`None`: float32).
    pub precision: Option<HalfType>,
    pub engine: TargetEngine,
}

impl StepPlan {
    /// The pipeline spec, in the order the module documentation explains.
    pub fn spec(&self) -> String {
        let mut passes = vec![spec_text(
            super::grad_accum::PASS,
            &self.accumulation.options_text(true),
        )];
        if let Some(loss_scale) = &self.loss_scale {
            passes.push(loss_scale.spec());
        }
        if let Some(agc) = &self.agc {
            let options = super::agc::options_text(agc.clip, agc.eps, &agc.selection);
            passes.push(spec_text(super::agc::PASS, &options));
        }
        if let Some(max_norm) = self.clip_norm {
            let options = super::clip_norm::options_text(max_norm);
            passes.push(spec_text(super::clip_norm::PASS, &options));
        }
        passes.push(super::Pass::spec(&self.optimizer));
        passes.push(super::legalize::PASS.to_string());
        if let Some(half) = &self.precision {
            passes.push(format!(
                "{}(dtype={})",
                super::precision::PASS,
                half.as_str()
            ));
        }
        passes.push("dce".to_string());
        if self.engine == TargetEngine::Tract {
            passes.push(super::lower_for_tract::PASS.to_string());
        }
        passes.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_plan_is_accumulate_optimize_legalize() {
        assert_eq!(
            StepPlan::default().spec(),
            "grad-accum,optimizer,legalize-ort,dce"
        );
    }

    #[test]
    fn every_piece_takes_its_place() {
        let plan = StepPlan {
            accumulation: GradAccum {
                steps: 4,
                normalize: super::super::grad_accum::Normalize::Mean,
                apply: super::super::window::ApplyMode::Where,
                ..Default::default()
            },
            loss_scale: Some(LossScalePlan::DYNAMIC),
            agc: Some(AgcPlan {
                clip: 0.01,
                eps: Some(0.001),
                selection: Selection::default(),
            }),
            clip_norm: Some(1.5),
            optimizer: super::super::optimizer::Optimizer {
                kind: Some("adamw".parse().unwrap()),
                lr: Some(0.01),
                ..Default::default()
            },
            precision: Some(HalfType::Fp16),
            engine: TargetEngine::Tract,
        };
        assert_eq!(
            plan.spec(),
            "grad-accum(steps=4,apply=where),loss-scale,\
             agc(clip=0.01,eps=0.001),clip-norm(max_norm=1.5),optimizer(kind=adamw,lr=0.01),legalize-ort,\
             precision(dtype=fp16),dce,lower-for-tract"
        );
        // What it prints, the pipeline takes.
        assert!(super::super::Pipeline::parse(&plan.spec()).is_ok());
    }

    #[test]
    fn a_bad_order_is_refused_before_any_graph() {
        let refused = |spec: &str| match super::super::Pipeline::parse(spec) {
            Ok(_) => panic!("{spec} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(refused("grad-accum,optimizer,agc(clip=0.1)").contains("run agc before optimizer"));
        assert!(
            refused("grad-accum,optimizer,clip-norm").contains("run clip-norm before optimizer")
        );
        assert!(refused("grad-accum,clip-norm,clip-norm,optimizer").contains("clip-norm runs once"));
        assert!(refused("optimizer,grad-accum").contains("run grad-accum before optimizer"));
        assert!(refused("grad-accum,grad-accum,optimizer").contains("grad-accum runs once"));
        let e = refused("grad-accum,optimizer,precision(dtype=fp16),legalize-ort");
        assert!(e.contains("run legalize-ort before precision"), "{e}");
        // dce and legalize-training take any place.
        assert!(super::super::Pipeline::parse("dce,grad-accum,dce,optimizer,dce").is_ok());
    }
}
