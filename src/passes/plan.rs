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
//! before the optimizer, after normalisation and unscaling; `legalize-ort` once the
//! optimizer has written its math; half precision once only standard ops are left; `dce`;
//! the lowering for tract last.

use super::spec_text;

/// `grad-accum`'s settings (`None`: the pass's default).
#[derive(Clone, Debug, PartialEq)]
pub struct Accumulation {
    /// Micro-batches per optimizer step (K; default 1).
    pub steps: i64,
    /// `mean` (the default), `sum` or `weighted:INPUT`.
    pub normalize: Option<String>,
    /// How the update is applied: `if` (the default) or `where`.
    pub apply: Option<String>,
    /// BatchNorm running statistics: `window` (the default) or `micro`.
    pub bn_stats: Option<String>,
}

impl Default for Accumulation {
    fn default() -> Self {
        Accumulation {
            steps: 1,
            normalize: None,
            apply: None,
            bn_stats: None,
        }
    }
}

/// Adaptive gradient clipping: `clip` and the rest of `agc`'s options as spec text
/// (`eps=...`, `include_final=true`, `exclude=...`, `axes=...`).
#[derive(Clone, Debug, PartialEq)]
pub struct AgcPlan {
    pub clip: f32,
    pub options: Vec<String>,
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

/// What to build.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPlan {
    pub accumulation: Accumulation,
    /// The `loss-scale` pass spec (`None`: no loss scaling).
    pub loss_scale: Option<String>,
    pub agc: Option<AgcPlan>,
    /// The optimizer pass itself: its options are its fields (`None`: the producer's or
    /// the formula's default).
    pub optimizer: super::optimizer::Optimizer,
    /// `fp16` or `bf16` (`None`: float32).
    pub precision: Option<String>,
    pub engine: TargetEngine,
}

impl StepPlan {
    /// The pipeline spec, in the order the module documentation explains.
    pub fn spec(&self) -> String {
        let mut passes = vec![self.accumulation.spec()];
        if let Some(loss_scale) = &self.loss_scale {
            passes.push(loss_scale.clone());
        }
        if let Some(agc) = &self.agc {
            let mut options = vec![format!("clip={}", agc.clip)];
            options.extend(agc.options.iter().cloned());
            passes.push(spec_text(super::agc::PASS, &options));
        }
        passes.push(super::Pass::spec(&self.optimizer));
        passes.push(super::legalize::PASS.to_string());
        if let Some(half) = &self.precision {
            passes.push(format!("{}(dtype={half})", super::precision::PASS));
        }
        passes.push("dce".to_string());
        if self.engine == TargetEngine::Tract {
            passes.push(super::lower_for_tract::PASS.to_string());
        }
        passes.join(",")
    }
}

impl Accumulation {
    fn spec(&self) -> String {
        let mut options = Vec::new();
        if self.steps != 1 {
            options.push(format!("steps={}", self.steps));
        }
        // A value equal to grad-accum's default is not printed either.
        for (key, value, default) in [
            ("normalize", &self.normalize, "mean"),
            ("apply", &self.apply, "if"),
            ("bn_stats", &self.bn_stats, "window"),
        ] {
            match value {
                Some(v) if v != default => options.push(format!("{key}={v}")),
                _ => {}
            }
        }
        spec_text(super::grad_accum::PASS, &options)
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
            accumulation: Accumulation {
                steps: 4,
                normalize: Some("mean".into()),
                apply: Some("where".into()),
                ..Default::default()
            },
            loss_scale: Some("loss-scale".into()),
            agc: Some(AgcPlan {
                clip: 0.01,
                options: vec!["eps=0.001".into()],
            }),
            optimizer: super::super::optimizer::Optimizer {
                kind: Some("adamw".parse().unwrap()),
                lr: Some(0.01),
                ..Default::default()
            },
            precision: Some("fp16".into()),
            engine: TargetEngine::Tract,
        };
        assert_eq!(
            plan.spec(),
            "grad-accum(steps=4,apply=where),loss-scale,\
             agc(clip=0.01,eps=0.001),optimizer(kind=adamw,lr=0.01),legalize-ort,\
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
        assert!(refused("optimizer,grad-accum").contains("run grad-accum before optimizer"));
        assert!(refused("grad-accum,grad-accum,optimizer").contains("grad-accum runs once"));
        let e = refused("grad-accum,optimizer,precision(dtype=fp16),legalize-ort");
        assert!(e.contains("run legalize-ort before precision"), "{e}");
        // dce and legalize-training take any place.
        assert!(super::super::Pipeline::parse("dce,grad-accum,dce,optimizer,dce").is_ok());
    }
}
