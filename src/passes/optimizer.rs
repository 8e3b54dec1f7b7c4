//! `optimizer(kind=..., lr=..., ...)`: the parameter update inside the apply region, on the
//! window's normalised gradient G. The learning rate is an initializer-backed input
//! (`ga.lr`) so a host can schedule it; bias correction counts optimizer steps t (1 at the
//! first applied window), never micro-steps.
//!
//! - `sgd`:       p <- p - lr (G + wd p)
//! - `momentum`:  b <- mu b + (G + wd p);  p <- p - lr b                   (PyTorch SGD)
//! - `nesterov`:  b <- mu b + (G + wd p);  p <- p - lr (G + wd p + mu b)
//! - `adam`:      Adam with L2 (G + wd p), bias-corrected as PyTorch Adam
//! - `adamw`:     ONNX Runtime's AdamWOptimizer exactly, with m <- b1 m + (1-b1) G,
//!   v <- b2 v + (1-b2) G^2, c1 = 1 - b1^t, c2 = 1 - b2^t (computed in double, as ORT does):
//!   - adam_mode 1 (Hugging Face): p <- p - (lr sqrt(c2)/c1) m / (sqrt(v) + eps); then
//!     p <- p - lr wd p
//!   - adam_mode 0 (PyTorch): p <- p - lr wd p; then p <- p - lr m / (c1 (sqrt(v/c2) + eps))
//!
//! The order of floating-point operations follows ORT's kernels, so results agree with the
//! training build to float rounding.

use super::legalize::{lower_adamw_for_params, AdamW, AdamWSlots};
use super::window::{Param, StateDecl, StateSlot, Window, WindowError};
use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, tensor_f32, Builder};
use crate::ir::{BodyId, Model, ValueId};
use crate::proto::tensor_proto::DataType;
use crate::signature::OptimizerSpec;
use crate::state::Role;

pub const PASS: &str = "optimizer";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sgd,
    Momentum,
    Nesterov,
    Adam,
    AdamW,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Sgd => "sgd",
            Kind::Momentum => "momentum",
            Kind::Nesterov => "nesterov",
            Kind::Adam => "adam",
            Kind::AdamW => "adamw",
        }
    }
}

impl std::str::FromStr for Kind {
    type Err = String;

    fn from_str(text: &str) -> Result<Kind, String> {
        [
            Kind::Sgd,
            Kind::Momentum,
            Kind::Nesterov,
            Kind::Adam,
            Kind::AdamW,
        ]
        .into_iter()
        .find(|k| k.as_str() == text)
        .ok_or_else(|| format!("kind={text}: expected sgd, momentum, nesterov, adam or adamw"))
    }
}

value_enum!(Kind: Kind::Sgd, Kind::Momentum, Kind::Nesterov, Kind::Adam, Kind::AdamW);

/// Whose Adam formula (and defaults) the update follows. The frameworks differ by 17-46%
/// of the update after 8 steps on real models (measured), so this is not a detail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Formula {
    /// torch.optim.Adam / AdamW / SGD: eps 1e-8 added to sqrt(v / c2), decoupled decay
    /// before the step (ORT's adam_mode 0), lr 1e-3, AdamW weight decay 1e-2.
    Torch,
    /// ONNX Runtime's AdamWOptimizer (adam_mode 1, eps 1e-6): the default for ORT artifacts.
    Ort,
    /// Keras Adam: bias corrections folded into the learning rate, eps 1e-7 added to
    /// sqrt(v) (ORT's adam_mode 1), lr 1e-3, no decay.
    Keras,
}

impl Formula {
    pub fn as_str(self) -> &'static str {
        match self {
            Formula::Torch => "torch",
            Formula::Ort => "ort",
            Formula::Keras => "keras",
        }
    }
}

impl std::str::FromStr for Formula {
    type Err = String;

    fn from_str(text: &str) -> Result<Formula, String> {
        [Formula::Torch, Formula::Ort, Formula::Keras]
            .into_iter()
            .find(|f| f.as_str() == text)
            .ok_or_else(|| format!("formula={text}: expected torch, ort or keras"))
    }
}

value_enum!(Formula: Formula::Torch, Formula::Ort, Formula::Keras);

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Optimizer {
    /// Whose formula and defaults (default: ORT's for ORT artifacts, torch's for a forward
    /// model differentiated by autodiff).
    pub formula: Option<Formula>,
    pub kind: Option<Kind>,
    pub lr: Option<f32>,
    pub weight_decay: Option<f32>,
    pub beta1: Option<f32>,
    pub beta2: Option<f32>,
    pub eps: Option<f32>,
    pub momentum: Option<f32>,
    pub adam_mode: Option<i64>,
    pub correct_bias: Option<bool>,
    /// Adam family: parameters of at most this many elements are updated together as one
    /// flat tensor (default [`FUSE_SMALL_ELEMENTS`]; 0 turns it off).
    pub fuse_small: Option<i64>,
    /// Parameters (`*`, `?` globs on their names) trained without weight decay: torch's
    /// parameter group with `weight_decay=0` (biases and norms, as nanoGPT and most
    /// transformer recipes train them).
    pub no_decay: Vec<String>,
}

/// Below about a thousand elements an elementwise op costs its dispatch (~0.4 µs on ONNX
/// Runtime's CPU provider), not its arithmetic, and Adam is ~15 such ops per tensor: biases,
/// norms and other small tensors are cheaper updated as one flat tensor (Concat in, Split
/// out: 7 passes over their bytes). Above this size the extra passes cost more than the
/// dispatches they save. The update is elementwise, so flat or not it is bit-identical.
pub const FUSE_SMALL_ELEMENTS: i64 = 1024;

/// Hyperparameters after defaults from the producer's optimizer and the command line.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    pub kind: Kind,
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub momentum: f32,
    pub adam_mode: i64,
    pub correct_bias: bool,
    pub formula: Formula,
}

/// The kind of optimizer the producer configured.
fn producer_kind(producer: Option<&crate::signature::Optimizer>) -> Option<Kind> {
    producer.map(|o| match o.spec {
        OptimizerSpec::Adamw { .. } => Kind::AdamW,
        OptimizerSpec::Sgd => Kind::Sgd,
    })
}

fn fail(message: String) -> PassError {
    PassError::Other {
        pass: PASS.into(),
        message,
    }
}

impl Resolved {
    /// The hyperparameters that matter for this kind, for reports.
    pub fn describe(&self) -> String {
        let mut text = format!("{} lr={}", self.kind.as_str(), self.lr);
        if self.weight_decay != 0.0 {
            text.push_str(&format!(" weight_decay={}", self.weight_decay));
        }
        match self.kind {
            Kind::Sgd => {}
            Kind::Momentum | Kind::Nesterov => {
                text.push_str(&format!(" momentum={}", self.momentum))
            }
            Kind::Adam | Kind::AdamW => {
                text.push_str(&format!(
                    " beta1={} beta2={} eps={:e} correct_bias={}",
                    self.beta1, self.beta2, self.eps, self.correct_bias
                ));
                if self.kind == Kind::AdamW {
                    text.push_str(&format!(" adam_mode={}", self.adam_mode));
                }
                if self.formula != Formula::Ort {
                    text.push_str(&format!(" formula={}", self.formula.as_str()));
                }
            }
        }
        text
    }
}

impl Optimizer {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&[
            "kind",
            "lr",
            "weight_decay",
            "beta1",
            "beta2",
            "eps",
            "momentum",
            "adam_mode",
            "correct_bias",
            "fuse_small",
            "formula",
            "no_decay",
        ])?;
        let formula = options
            .get("formula")
            .map(|f| {
                f.parse::<Formula>().map_err(|message| PassError::Spec {
                    spec: PASS.into(),
                    message,
                })
            })
            .transpose()?;
        let spec_error = |message: String| PassError::Spec {
            spec: PASS.into(),
            message,
        };
        let kind = options
            .get("kind")
            .map(|k| k.parse::<Kind>().map_err(spec_error))
            .transpose()?;
        Ok(Optimizer {
            formula,
            kind,
            lr: options.parse("lr")?,
            weight_decay: options.parse("weight_decay")?,
            beta1: options.parse("beta1")?,
            beta2: options.parse("beta2")?,
            eps: options.parse("eps")?,
            momentum: options.parse("momentum")?,
            adam_mode: options.parse("adam_mode")?,
            correct_bias: options.parse("correct_bias")?,
            fuse_small: options.parse("fuse_small")?,
            no_decay: options
                .get("no_decay")
                .map(|v| {
                    v.split('|')
                        .filter(|g| !g.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default(),
        })
    }

    /// Fills unset hyperparameters from the producer's optimizer (ORT's optimizer_model.onnx
    /// and checkpoint), then from the usual defaults.
    pub fn resolve(
        &self,
        producer: Option<&crate::signature::Optimizer>,
    ) -> Result<Resolved, PassError> {
        self.resolve_for(producer, false)
    }

    /// [`resolve`](Self::resolve) for a model of a framework (`framework`: a forward model
    /// the autodiff differentiated), whose defaults are torch's unless a producer's
    /// optimizer or `formula` says otherwise.
    pub fn resolve_for(
        &self,
        producer: Option<&crate::signature::Optimizer>,
        framework: bool,
    ) -> Result<Resolved, PassError> {
        let formula = self.formula.unwrap_or(if producer.is_none() && framework {
            Formula::Torch
        } else {
            Formula::Ort
        });
        let p_kind = producer_kind(producer);
        let p_adamw = producer.and_then(|o| o.spec.adamw());
        let theirs = |field: fn(&AdamW) -> f32| p_adamw.as_ref().map(field);
        let kind = self.kind.or(p_kind).ok_or_else(|| {
            fail("no optimizer given and the producer configured none: use --optimizer sgd|momentum|nesterov|adam|adamw (with --lr; a forward model's defaults are torch.optim's)".into())
        })?;
        let framework_lr = (formula != Formula::Ort).then_some(1e-3);
        let lr = self
            .lr
            .or_else(|| producer.and_then(|o| o.learning_rate))
            .or(framework_lr)
            .ok_or_else(|| {
                fail("no learning rate given and the checkpoint records none: use --lr".into())
            })?;
        let same_family = p_kind == Some(kind);
        let pick = |mine: Option<f32>, theirs: Option<f32>, default: f32| {
            mine.or(if same_family { theirs } else { None })
                .unwrap_or(default)
        };
        let resolved = Resolved {
            kind,
            lr,
            weight_decay: pick(
                self.weight_decay,
                theirs(|a| a.weight_decay),
                match (kind, formula) {
                    (Kind::AdamW, Formula::Keras) => 0.004,
                    (Kind::AdamW, _) => 0.01,
                    _ => 0.0,
                },
            ),
            // The same for every formula: ORT's, torch's and Keras's.
            beta1: pick(self.beta1, theirs(|a| a.beta1), AdamW::default().beta1),
            beta2: pick(self.beta2, theirs(|a| a.beta2), AdamW::default().beta2),
            eps: pick(
                self.eps,
                theirs(|a| a.epsilon),
                match (kind, formula) {
                    (_, Formula::Keras) => 1e-7,
                    (Kind::AdamW, Formula::Ort) => 1e-6,
                    _ => 1e-8,
                },
            ),
            momentum: self.momentum.unwrap_or(0.9),
            adam_mode: self
                .adam_mode
                .or(p_adamw
                    .as_ref()
                    .filter(|_| same_family)
                    .map(|a| a.adam_mode))
                .unwrap_or(if formula == Formula::Torch { 0 } else { 1 }),
            formula,
            correct_bias: self
                .correct_bias
                .or(p_adamw
                    .as_ref()
                    .filter(|_| same_family)
                    .map(|a| a.correct_bias))
                .unwrap_or(true),
        };
        if !(0..=1).contains(&resolved.adam_mode) {
            return Err(fail(format!(
                "adam_mode={} (ORT knows 0 and 1)",
                resolved.adam_mode
            )));
        }
        resolved.check()?;
        Ok(resolved)
    }
}

impl Resolved {
    /// The AdamW update the Adam family lowers to ([`lower_adamw_for_params`]): AdamW as
    /// resolved; Adam as PyTorch's, i.e. no decoupled decay (the pass adds L2 to the
    /// gradient instead) in mode 0; Keras's Adam in mode 1 with its decimal complements.
    pub fn adamw(&self) -> AdamW {
        AdamW {
            beta1: self.beta1,
            beta2: self.beta2,
            epsilon: self.eps,
            weight_decay: if self.kind == Kind::AdamW {
                self.weight_decay
            } else {
                0.0
            },
            correct_bias: self.correct_bias,
            // PyTorch's Adam is AdamW mode 0 without decay; without bias correction both
            // modes are the same update, and ORT only implements that case in mode 1.
            adam_mode: if self.kind == Kind::Adam {
                if self.formula == Formula::Keras {
                    1
                } else if self.correct_bias {
                    0
                } else {
                    1
                }
            } else {
                self.adam_mode
            },
            decimal_complements: self.formula == Formula::Keras,
        }
    }

    /// Hyperparameters outside what the update is defined for are an error naming them
    /// (a negative or NaN learning rate trains backwards or to NaN, without a word).
    fn check(&self) -> Result<(), PassError> {
        let bad = |name: &str, v: f32, want: &str| fail(format!("{name}={v}: must be {want}"));
        if !self.lr.is_finite() || self.lr < 0.0 {
            return Err(bad("lr", self.lr, "finite and not negative"));
        }
        if !self.weight_decay.is_finite() || self.weight_decay < 0.0 {
            return Err(bad(
                "weight_decay",
                self.weight_decay,
                "finite and not negative",
            ));
        }
        match self.kind {
            Kind::Sgd => {}
            Kind::Momentum | Kind::Nesterov => {
                if !(0.0..1.0).contains(&self.momentum) {
                    return Err(bad("momentum", self.momentum, "in [0, 1)"));
                }
            }
            Kind::Adam | Kind::AdamW => {
                for (name, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
                    if !(0.0..1.0).contains(&v) {
                        return Err(bad(name, v, "in [0, 1)"));
                    }
                }
                if !self.eps.is_finite() || self.eps <= 0.0 {
                    return Err(bad("eps", self.eps, "finite and above 0"));
                }
            }
        }
        Ok(())
    }
}

impl Optimizer {
    /// The options given that `kind` does not use (they would be ignored without a word).
    pub fn ignored_options(&self, kind: Kind) -> Vec<&'static str> {
        let adam = matches!(kind, Kind::Adam | Kind::AdamW);
        let momentum = matches!(kind, Kind::Momentum | Kind::Nesterov);
        [
            ("beta1", self.beta1.is_some() && !adam),
            ("beta2", self.beta2.is_some() && !adam),
            ("eps", self.eps.is_some() && !adam),
            ("correct_bias", self.correct_bias.is_some() && !adam),
            ("fuse_small", self.fuse_small.is_some() && !adam),
            ("adam_mode", self.adam_mode.is_some() && kind != Kind::AdamW),
            ("momentum", self.momentum.is_some() && !momentum),
        ]
        .into_iter()
        .filter(|(_, ignored)| *ignored)
        .map(|(name, _)| name)
        .collect()
    }

    /// Every hyperparameter the update uses, with where its value came from: given, the
    /// producer's optimizer (ORT's optimizer_model.onnx and checkpoint), or a default.
    pub fn recipe(
        &self,
        producer: Option<&crate::signature::Optimizer>,
        framework: bool,
        hp: &Resolved,
    ) -> crate::recipe::Section {
        use crate::recipe::Origin;
        let p_kind = producer_kind(producer);
        let same_family = p_kind == Some(hp.kind);
        let adamw = matches!(producer.map(|o| &o.spec), Some(OptimizerSpec::Adamw { .. }));
        // Given, else the artifacts' (when they configure this kind and that value), else
        // the default.
        let origin = |mine: bool, theirs: bool| match (mine, theirs && same_family) {
            (true, _) => Origin::Given,
            (false, true) => Origin::Artifacts,
            _ => Origin::Default,
        };
        let whose = match (hp.formula, hp.kind) {
            (Formula::Ort, Kind::AdamW) => "ONNX Runtime AdamWOptimizer's default".to_string(),
            (Formula::Ort, _) => "torch.optim's default".to_string(),
            (f, _) => format!("{} default", f.as_str()),
        };
        let mut s = crate::recipe::Section::new(PASS);
        s.set(
            "kind",
            hp.kind.as_str(),
            origin(self.kind.is_some(), p_kind.is_some()),
        );
        match (p_kind, self.kind) {
            (Some(p), Some(k)) if p != k => s.note(
                "kind",
                format!(
                    "the artifacts configure {}: their hyperparameters are not used for {}",
                    p.as_str(),
                    k.as_str()
                ),
            ),
            (None, _) if !framework => s.note("kind", "the producer configured no optimizer"),
            _ => {}
        }
        s.set(
            "formula",
            hp.formula.as_str(),
            match self.formula {
                Some(_) => Origin::Given,
                None => Origin::Default,
            },
        );
        if self.formula.is_none() {
            s.note(
                "formula",
                match hp.formula {
                    Formula::Torch => "a forward model trains like torch.optim",
                    _ => "ONNX Runtime's formulas for ONNX Runtime artifacts",
                },
            );
        }
        let lr_origin = match (self.lr, producer.and_then(|o| o.learning_rate)) {
            (Some(_), _) => Origin::Given,
            (None, Some(_)) => Origin::Artifacts,
            (None, None) => Origin::Default,
        };
        s.set_f32("lr", hp.lr, lr_origin);
        match lr_origin {
            Origin::Artifacts => s.note("lr", "the checkpoint's optimizer group"),
            Origin::Default => s.note("lr", whose.clone()),
            Origin::Given => s.note("lr", "train --lr overrides it for a run"),
        }
        s.set_f32(
            "weight_decay",
            hp.weight_decay,
            origin(self.weight_decay.is_some(), adamw),
        );
        let family_default = |s: &mut crate::recipe::Section, name: &str| {
            if s.get(name).is_some_and(|x| x.from == Origin::Default) {
                s.note(name, whose.clone());
            }
        };
        family_default(&mut s, "weight_decay");
        match hp.kind {
            Kind::Sgd => {}
            Kind::Momentum | Kind::Nesterov => {
                s.set_f32(
                    "momentum",
                    hp.momentum,
                    origin(self.momentum.is_some(), false),
                );
            }
            Kind::Adam | Kind::AdamW => {
                s.set_f32("beta1", hp.beta1, origin(self.beta1.is_some(), adamw));
                s.set_f32("beta2", hp.beta2, origin(self.beta2.is_some(), adamw));
                s.set_f32("eps", hp.eps, origin(self.eps.is_some(), adamw));
                for name in ["beta1", "beta2", "eps"] {
                    family_default(&mut s, name);
                }
                s.set(
                    "correct_bias",
                    hp.correct_bias,
                    origin(self.correct_bias.is_some(), adamw),
                );
                if hp.kind == Kind::AdamW {
                    s.set(
                        "adam_mode",
                        hp.adam_mode,
                        origin(self.adam_mode.is_some(), adamw),
                    );
                    s.note(
                        "adam_mode",
                        match hp.adam_mode {
                            0 => "0: decay before the step, eps added to sqrt(v/c2) (torch)",
                            _ => "1: eps added to sqrt(v), decay after the step (Hugging Face)",
                        },
                    );
                }
                s.set(
                    "fuse_small",
                    self.fuse_small.unwrap_or(FUSE_SMALL_ELEMENTS),
                    origin(self.fuse_small.is_some(), false),
                );
                s.note(
                    "fuse_small",
                    "parameters of at most this many elements updated as one tensor (same numbers)",
                );
            }
        }
        s
    }
}

impl Pass for Optimizer {
    fn name(&self) -> &'static str {
        PASS
    }

    /// The window, not yet optimized.
    fn requires(&self, _model: &Model, cx: &PassContext<'_>) -> Result<(), PassError> {
        super::requires_window(cx, PASS)?;
        if cx.window().is_some_and(|w| w.optimized()) {
            return Err(fail("the apply region already has an optimizer".into()));
        }
        Ok(())
    }

    /// Every parameter has its update, and the window knows it has an optimizer.
    fn ensures(&self, _model: &Model, cx: &PassContext<'_>) -> Result<(), PassError> {
        match cx.window().is_some_and(|w| w.optimized()) {
            true => Ok(()),
            false => Err(super::broken(PASS, "the window has no optimizer".into())),
        }
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Optimize
    }

    fn spec(&self) -> String {
        let mut options = Vec::new();
        if let Some(k) = self.kind {
            options.push(format!("kind={}", k.as_str()));
        }
        let floats = [
            ("lr", self.lr),
            ("weight_decay", self.weight_decay),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("momentum", self.momentum),
        ];
        for (name, value) in floats {
            if let Some(v) = value {
                options.push(format!("{name}={v}"));
            }
        }
        if let Some(m) = self.adam_mode {
            options.push(format!("adam_mode={m}"));
        }
        if let Some(f) = self.formula {
            options.push(format!("formula={}", f.as_str()));
        }
        if let Some(c) = self.correct_bias {
            options.push(format!("correct_bias={c}"));
        }
        if let Some(n) = self.fuse_small {
            options.push(format!("fuse_small={n}"));
        }
        if !self.no_decay.is_empty() {
            options.push(format!("no_decay={}", self.no_decay.join("|")));
        }
        super::spec_text(PASS, &options)
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        let framework = matches!(
            cx.signature.source,
            crate::signature::Source::Forward { .. }
        );
        let hp = self
            .resolve_for(cx.signature.optimizer.as_ref(), framework)
            .map_err(|e| match &cx.signature.source {
                // The optimizer and the learning rate live beside training_model.onnx.
                crate::signature::Source::OrtTrainingGraph { file } => fail(format!(
                    "{}; {} is an ONNX Runtime training graph given alone: pass the artifacts folder that holds it with its checkpoint and optimizer_model.onnx (its parameters are in the checkpoint)",
                    e.to_string().trim_start_matches("optimizer: "),
                    file.display()
                )),
                _ => e,
            })?;
        let mut section = self.recipe(cx.signature.optimizer.as_ref(), framework, &hp);
        // Which parameters decay: all but those `no_decay` names.
        let params = cx.window_mut(PASS)?.params().to_vec();
        let decays: Vec<bool> = params
            .iter()
            .map(|p| {
                !self
                    .no_decay
                    .iter()
                    .any(|g| super::autodiff::glob_match(g, p.name()))
            })
            .collect();
        if !self.no_decay.is_empty() {
            let exempt: Vec<&str> = params
                .iter()
                .zip(&decays)
                .filter(|(_, d)| !**d)
                .map(|(p, _)| p.name())
                .collect();
            if exempt.is_empty() {
                return Err(fail(format!(
                    "no_decay={}: names no trainable parameter",
                    self.no_decay.join("|")
                )));
            }
            section.set(
                "no_decay",
                self.no_decay.join("|"),
                crate::recipe::Origin::Given,
            );
            section.note(
                "no_decay",
                format!(
                    "{} of {} parameters without weight decay: {}",
                    exempt.len(),
                    decays.len(),
                    first_names(&exempt)
                ),
            );
        }
        cx.recipe.push(section);
        let (window, state) = cx.window_and_state(PASS)?;
        let nodes_before = model.all_nodes().count();
        let lr = model.add_input(
            BodyId::MAIN,
            "ga.lr",
            crate::ir::tensor_type(DataType::Float as i32, &[]),
            Some(tensor_f32(&[], &[hp.lr])),
        );
        if matches!(hp.kind, Kind::Adam | Kind::AdamW) {
            let fuse_small = self.fuse_small.unwrap_or(FUSE_SMALL_ELEMENTS);
            adam_family(model, window, state, &hp, lr, fuse_small, &decays)?;
        }
        let undecayed = Resolved {
            weight_decay: 0.0,
            ..hp.clone()
        };
        for (i, &decay) in decays.iter().enumerate() {
            let p = window.params()[i].clone();
            let (name, value, grad) = (p.name(), p.value(), p.grad());
            let hp = if decay { &hp } else { &undecayed };
            let next = match hp.kind {
                Kind::Adam | Kind::AdamW => continue,
                Kind::Sgd => {
                    let mut b = window.builder(model, PASS);
                    let g = with_l2(&mut b, hp, grad, value, name);
                    let step = b.op("Mul", &[lr, g], vec![], &format!("{name}.sgd_step"));
                    b.op("Sub", &[value, step], vec![], &format!("{name}.updated"))
                }
                Kind::Momentum | Kind::Nesterov => {
                    let buf = moment(model, window, state, &p, "momentum");
                    let mut b = window.builder(model, PASS);
                    let g = with_l2(&mut b, hp, grad, value, name);
                    let mu = b.scalar_f32("ga.mu", hp.momentum);
                    let decayed = b.op(
                        "Mul",
                        &[buf.input(), mu],
                        vec![],
                        &format!("{name}.momentum_decayed"),
                    );
                    let buf_next = b.op(
                        "Add",
                        &[decayed, g],
                        vec![],
                        &format!("{name}.momentum_new"),
                    );
                    let direction = if hp.kind == Kind::Nesterov {
                        let look = b.op(
                            "Mul",
                            &[buf_next, mu],
                            vec![],
                            &format!("{name}.nesterov_look"),
                        );
                        b.op(
                            "Add",
                            &[g, look],
                            vec![],
                            &format!("{name}.nesterov_direction"),
                        )
                    } else {
                        buf_next
                    };
                    let step = b.op("Mul", &[lr, direction], vec![], &format!("{name}.sgd_step"));
                    let next = b.op("Sub", &[value, step], vec![], &format!("{name}.updated"));
                    window
                        .set_next(model, buf, buf_next)
                        .map_err(window_error)?;
                    next
                }
            };
            window
                .set_next(model, p.slot(), next)
                .map_err(window_error)?;
        }
        window.mark_optimized(lr);
        Ok(PassReport {
            changed: true,
            added: model.all_nodes().count().saturating_sub(nodes_before),
            removed: 0,
            notes: {
                let mut notes = vec![hp.describe()];
                let ignored = self.ignored_options(hp.kind);
                if !ignored.is_empty() {
                    let text = format!(
                        "warning: {} ignored: {} takes no such option",
                        ignored.join(", "),
                        hp.kind.as_str()
                    );
                    notes.push(text);
                }
                notes
            },
        })
    }
}

/// g + wd * p when weight decay is coupled into the gradient (SGD family, Adam).
fn with_l2(b: &mut Builder<'_>, hp: &Resolved, g: ValueId, p: ValueId, name: &str) -> ValueId {
    if hp.weight_decay == 0.0 {
        return g;
    }
    let wd = b.scalar_f32("ga.weight_decay", hp.weight_decay);
    let decay = b.op("Mul", &[p, wd], vec![], &format!("{name}.l2"));
    b.op("Add", &[g, decay], vec![], &format!("{name}.grad_l2"))
}

fn window_error(e: WindowError) -> PassError {
    e.in_pass(PASS)
}

/// A zero-initialised optimizer moment of `p`, declared in the window.
fn moment(
    model: &mut Model,
    window: &mut Window,
    state: &mut Vec<crate::state::StateEntry>,
    p: &Param,
    which: &str,
) -> StateSlot {
    let zeros = tensor_f32(
        p.dims(),
        &vec![0.0; p.dims().iter().product::<i64>().max(0) as usize],
    );
    let name = format!("ga.{which}.{}", p.name());
    window.declare(
        model,
        state,
        StateDecl::new(&name, zeros, Role::Moment).of(p.name()),
    )
}

/// Adam and AdamW through the one implementation of ONNX Runtime's AdamW update
/// ([`lower_adamw_for_params`]): AdamW as configured; Adam as PyTorch's, i.e. the
/// gradient with L2 (G + wd p) and no decoupled decay. Parameters of at most `fuse_small`
/// elements are updated as one flat tensor ([`FUSE_SMALL_ELEMENTS`]), per decay group:
/// `decays[i]` false trains parameter i without weight decay (`no_decay`).
fn adam_family(
    model: &mut Model,
    window: &mut Window,
    state: &mut Vec<crate::state::StateEntry>,
    hp: &Resolved,
    lr: ValueId,
    fuse_small: i64,
    decays: &[bool],
) -> Result<(), PassError> {
    let undecayed = Resolved {
        weight_decay: 0.0,
        ..hp.clone()
    };
    let mut slots = Vec::new();
    let mut moment_slots = Vec::new();
    for (i, &decay) in decays.iter().enumerate() {
        let p = window.params()[i].clone();
        let m = moment(model, window, state, &p, "m");
        let v = moment(model, window, state, &p, "v");
        let mut b = window.builder(model, PASS);
        let hp = if decay { hp } else { &undecayed };
        let grad = if hp.kind == Kind::Adam {
            with_l2(&mut b, hp, p.grad(), p.value(), p.name())
        } else {
            p.grad()
        };
        slots.push(AdamWSlots {
            param: p.value(),
            grad,
            m: m.input(),
            v: v.input(),
        });
        moment_slots.push((m, v));
    }
    let mut per_param = vec![None; window.params().len()];
    for (decay, group_hp) in [(true, hp), (false, &undecayed)] {
        let members: Vec<usize> = (0..slots.len()).filter(|&i| decays[i] == decay).collect();
        if members.is_empty() {
            continue;
        }
        update_group(
            model,
            window,
            &group_hp.adamw(),
            lr,
            fuse_small,
            &slots,
            &members,
            &mut per_param,
        )?;
    }
    let param_slots: Vec<StateSlot> = window.params().iter().map(Param::slot).collect();
    for ((p_slot, n), (m_slot, v_slot)) in param_slots.into_iter().zip(per_param).zip(moment_slots)
    {
        let (param, m, v) = n.expect("every parameter updated");
        window
            .set_next(model, p_slot, param)
            .map_err(window_error)?;
        window.set_next(model, m_slot, m).map_err(window_error)?;
        window.set_next(model, v_slot, v).map_err(window_error)?;
    }
    Ok(())
}

/// The AdamW update of the parameters `members` (indices into `slots` and the window's
/// parameters) with one set of hyperparameters; their next (param, m, v) go into
/// `per_param`.
#[allow(clippy::too_many_arguments)]
fn update_group(
    model: &mut Model,
    window: &mut Window,
    adamw: &AdamW,
    lr: ValueId,
    fuse_small: i64,
    slots: &[AdamWSlots],
    members: &[usize],
    per_param: &mut [Option<(ValueId, ValueId, ValueId)>],
) -> Result<(), PassError> {
    // Which parameters share the flat update: float32 ones of at most `fuse_small`
    // elements, when there are two or more (Split with sizes as an input needs opset 13).
    let small: Vec<usize> = match model.opset("").unwrap_or(0) >= 13 {
        true => members
            .iter()
            .copied()
            .filter(|&i| {
                let p = &window.params()[i];
                p.elem_type() == DataType::Float as i32 && numel(p.dims()) <= fuse_small
            })
            .collect(),
        false => Vec::new(),
    };
    let small = if small.len() >= 2 { small } else { Vec::new() };

    let mut b = window.builder(model, PASS);
    let singles: Vec<usize> = members
        .iter()
        .copied()
        .filter(|i| !small.contains(i))
        .collect();
    let mut update_slots: Vec<AdamWSlots> = singles.iter().map(|&i| slots[i]).collect();
    let dims: Vec<Vec<i64>> = small
        .iter()
        .map(|&i| window.params()[i].dims().to_vec())
        .collect();
    if !small.is_empty() {
        let flat = |b: &mut Builder<'_>, pick: fn(&AdamWSlots) -> ValueId, hint: &str| {
            let members: Vec<ValueId> = small.iter().map(|&i| pick(&slots[i])).collect();
            flatten(b, &members, &dims, hint)
        };
        update_slots.push(AdamWSlots {
            param: flat(&mut b, |s| s.param, "ga.small_params"),
            grad: flat(&mut b, |s| s.grad, "ga.small_grads"),
            m: flat(&mut b, |s| s.m, "ga.small_m"),
            v: flat(&mut b, |s| s.v, "ga.small_v"),
        });
    }
    let mut next = lower_adamw_for_params(&mut b, adamw, lr, window.step(), None, &update_slots)
        .map_err(|(attribute, detail)| fail(format!("{attribute}: {detail} is not supported")))?;
    // Back to one (param, m, v) per parameter.
    if !small.is_empty() {
        let group = next.pop().expect("the flat group's update");
        let names = |suffix: &str| -> Vec<String> {
            small
                .iter()
                .map(|&i| format!("{}.{suffix}", window.params()[i].name()))
                .collect()
        };
        let params = unflatten(&mut b, group.param, &dims, &names("updated"));
        let ms = unflatten(&mut b, group.m, &dims, &names("m_next"));
        let vs = unflatten(&mut b, group.v, &dims, &names("v_next"));
        for (k, &i) in small.iter().enumerate() {
            per_param[i] = Some((params[k], ms[k], vs[k]));
        }
    }
    for (&i, n) in singles.iter().zip(next) {
        per_param[i] = Some((n.param, n.m, n.v));
    }
    Ok(())
}

/// Up to five names, then how many more.
fn first_names(names: &[&str]) -> String {
    match names.len() {
        0..=5 => names.join(", "),
        n => format!("{}, ... ({} more)", names[..5].join(", "), n - 5),
    }
}

fn numel(dims: &[i64]) -> i64 {
    dims.iter().product()
}

/// The members as one rank-1 tensor, in order.
fn flatten(b: &mut Builder<'_>, members: &[ValueId], dims: &[Vec<i64>], hint: &str) -> ValueId {
    let mut parts = Vec::with_capacity(members.len());
    let mut flat_shape = None;
    for (&v, d) in members.iter().zip(dims) {
        parts.push(if d.len() == 1 {
            v
        } else {
            let flat_shape = *flat_shape.get_or_insert_with(|| b.ints("ga.flat_shape", &[-1]));
            let name = format!("{}.flat", b.model.name(v));
            b.op("Reshape", &[v, flat_shape], vec![], &name)
        });
    }
    b.op("Concat", &parts, vec![attr_int("axis", 0)], hint)
}

/// A flat tensor made by [`flatten`] cut back into tensors of `dims`.
fn unflatten(
    b: &mut Builder<'_>,
    flat: ValueId,
    dims: &[Vec<i64>],
    names: &[String],
) -> Vec<ValueId> {
    let sizes: Vec<i64> = dims.iter().map(|d| numel(d)).collect();
    let sizes = b.ints("ga.flat_sizes", &sizes);
    let hints: Vec<String> = names.iter().map(|n| format!("{n}.flat")).collect();
    let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
    let split = b.node(
        "Split",
        "",
        &[Some(flat), Some(sizes)],
        &hints,
        vec![attr_int("axis", 0)],
    );
    let mut out = Vec::with_capacity(dims.len());
    for (k, (d, name)) in dims.iter().zip(names).enumerate() {
        let piece = b.model.output(split, k);
        out.push(if d.len() == 1 {
            piece
        } else {
            let shape = b.ints("ga.shape", d);
            b.op("Reshape", &[piece, shape], vec![], name)
        });
    }
    out
}
