//! Passes and the pipeline that runs them.
//!
//! A pass rewrites the IR in place and reports what it did. Each declares its [`Phase`]:
//! the pipeline refuses passes out of phase order (or a once-only pass twice) before it
//! touches a graph, runs them in order, counts the nodes each added and removed, and, when
//! asked (always in tests and debug builds), verifies the graph after each one, naming the
//! pass in any error. A pipeline can be written as a spec string:
//! `grad-accum(steps=4,normalize=mean),optimizer(kind=adamw,lr=0.01),legalize-ort,dce`.
//! [`plan::StepPlan`] is the one place that orders the passes of a step.

pub mod agc;
pub mod autodiff;
pub mod bias_in_gemm;
pub mod clip_norm;
pub mod dce;
pub mod fit_opset;
pub mod fuse;
pub mod fused_batch_norm;
pub mod fused_col2im;
pub mod fused_conv_weight_grad;
pub mod fused_gelu;
pub mod fused_gelu_grad;
pub mod fused_im2col;
pub mod fused_layer_norm_grad;
pub mod fused_leading_sum;
pub mod fused_relu_grad;
pub mod fused_transpose;
pub mod grad_accum;
pub mod legalize;
pub mod legalize_training;
pub mod loss_scale;
pub mod lower_for_cuda;
pub mod lower_for_tract;
pub mod nchwc_conv;
pub mod optimizer;
pub mod plan;
pub mod precision;
pub mod window;

use std::collections::BTreeMap;
use std::fmt;

/// Every attribute of `node` is one of `names`: a pattern that knows what those mean may
/// match it; any other attribute might change what the node computes.
pub(crate) fn only_attributes(node: &crate::proto::NodeProto, names: &[&str]) -> bool {
    node.attribute.iter().all(|a| names.contains(&a.name()))
}

/// Some node of `model`'s main graph is an `op`: the cheap test before a session's
/// in-memory rewrite builds the IR.
pub(crate) fn has_op(model: &crate::proto::ModelProto, op: &str) -> bool {
    model
        .graph
        .as_ref()
        .is_some_and(|g| g.node.iter().any(|n| n.op_type() == op))
}

/// The node making `v` (at output 0, its only output) when it is `op` of the standard
/// domain in the main graph; its attributes are the caller's to check.
pub(crate) fn made_by(model: &Model, v: crate::ir::ValueId, op: &str) -> Option<crate::ir::NodeId> {
    let (n, 0) = model.producer(v)? else {
        return None;
    };
    let node = model.node(n);
    (node.proto.op_type() == op
        && crate::ir::normalize_domain(node.proto.domain()).is_empty()
        && node.body == crate::ir::BodyId::MAIN
        && node.outputs.len() == 1)
        .then_some(n)
}

/// The shape facts of a session's model before its in-memory rewrites onto onnx-ga's
/// kernels, by value name: inferred once, on first use, for every pass that reads them. A
/// value that kept its name through the rewrites is the same value, so its facts from
/// before hold, and say more than those inferred through onnx-ga's operators (which shape
/// inference does not know).
pub struct FactsBefore<'m> {
    model: &'m crate::proto::ModelProto,
    by_name: std::cell::OnceCell<std::collections::HashMap<String, autodiff::shapes::Facts>>,
}

impl<'m> FactsBefore<'m> {
    /// `model`: the session's model before the rewrites.
    pub fn new(model: &'m crate::proto::ModelProto) -> FactsBefore<'m> {
        FactsBefore {
            model,
            by_name: std::cell::OnceCell::new(),
        }
    }

    fn by_name(&self) -> &std::collections::HashMap<String, autodiff::shapes::Facts> {
        self.by_name.get_or_init(|| {
            let before = Model::from_proto(self.model.clone());
            let shapes = autodiff::shapes::Shapes::infer(&before);
            (0..before.values.len())
                .map(|v| crate::ir::ValueId(v as u32))
                .map(|v| (before.name(v).to_string(), shapes.get(v)))
                .collect()
        })
    }
}

/// The shape facts of a session's model part-way through its rewrites: [`FactsBefore`]
/// where a value kept its name, else inferred on the model as it is now.
pub(crate) struct SessionFacts<'b> {
    before: &'b std::collections::HashMap<String, autodiff::shapes::Facts>,
    now: autodiff::shapes::Shapes,
}

impl<'b> SessionFacts<'b> {
    pub(crate) fn new(before: &'b FactsBefore<'_>, now: &Model) -> SessionFacts<'b> {
        SessionFacts {
            before: before.by_name(),
            now: autodiff::shapes::Shapes::infer(now),
        }
    }

    /// The facts of `v`, a value of the model given as `now`.
    pub(crate) fn get(&self, now: &Model, v: crate::ir::ValueId) -> autodiff::shapes::Facts {
        match self.before.get(now.name(v)) {
            Some(before) => before.clone(),
            None => self.now.get(v),
        }
    }
}

/// The end of a session's in-memory rewrite onto onnx-ga's fused kernels
/// ([`fused_batch_norm`], [`fused_gelu`], [`fused_gelu_grad`], [`fused_im2col`], [`fused_relu_grad`]): the fused domain
/// required, the replaced nodes removed, the graph verified.
pub(crate) fn finish_in_memory(
    mut ir: Model,
    pass: &str,
) -> Result<crate::proto::ModelProto, PassError> {
    ir.require_opset(crate::fused_ops::DOMAIN, crate::fused_ops::DOMAIN_VERSION);
    dce::eliminate_dead_code(&mut ir);
    verify::verify(&ir).map_err(|errors| PassError::Verify {
        pass: pass.into(),
        errors,
    })?;
    Ok(ir.to_proto())
}

use crate::checkpoint::Checkpoint;
use crate::ir::{verify, Model};
use crate::signature::TrainingSignature;

/// What a pass needs besides the graph.
pub struct PassContext<'a> {
    pub signature: &'a mut TrainingSignature,
    pub checkpoint: Option<&'a Checkpoint>,
    /// State pairs created so far (graph input -> graph output carrying its next value).
    pub state: Vec<crate::state::StateEntry>,
    /// The window, once grad-accum has opened it; passes borrow it
    /// ([`window_mut`](Self::window_mut)), nobody takes it out but the step builder.
    window: Option<window::Window>,
    /// When BatchNorm running statistics move: a choice of the BatchNorm lowering
    /// (legalize-ort), written as grad-accum's option `bn_stats` because it only means
    /// something for a window; kept here, not in the window, and given to the lowering as
    /// the window or none ([`bn_window`](Self::bn_window)).
    bn_stats: BnStats,
    /// Which variance the running variance moves with: a choice of the BatchNorm lowering
    /// made by `autodiff` (the convention of the framework the forward model came from).
    bn_running_var: RunningVar,
    /// The recipe so far: at most one section per pass run, with its resolved settings
    /// (the pipeline adds an empty one for a pass that reports none).
    pub recipe: Vec<crate::recipe::Section>,
}

/// When BatchNorm running statistics move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BnStats {
    /// Once per window, from the window's pooled batch statistics (mean of means; mean of
    /// variances plus variance of means): for equal micro-batches exactly the statistics of
    /// the window as one batch.
    Window,
    /// At every micro-step from that micro-batch's statistics, as ONNX Runtime's training
    /// build does (in place at each train_step).
    Micro,
}

impl BnStats {
    /// The word in grad-accum's `bn_stats=` option and `--bn-stats`.
    pub fn as_str(self) -> &'static str {
        match self {
            BnStats::Window => "window",
            BnStats::Micro => "micro",
        }
    }
}

impl std::str::FromStr for BnStats {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "window" => Ok(BnStats::Window),
            "micro" => Ok(BnStats::Micro),
            other => Err(format!("bn_stats={other}: expected window or micro")),
        }
    }
}

value_enum!(BnStats: BnStats::Window, BnStats::Micro);

/// The variance a BatchNorm layer's running variance moves with, from the batch's `n`
/// values per channel. The normalisation itself always uses the biased one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RunningVar {
    /// `Σ (x - mean)² / n`: ONNX's BatchNormalization, ONNX Runtime's training build and
    /// Keras.
    #[default]
    Biased,
    /// `Σ (x - mean)² / (n - 1)` (Bessel's correction): PyTorch's BatchNorm.
    Unbiased,
}

impl RunningVar {
    /// The word in autodiff's `bn_var=` option and `--bn-var`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunningVar::Biased => "biased",
            RunningVar::Unbiased => "unbiased",
        }
    }
}

impl std::str::FromStr for RunningVar {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "biased" => Ok(RunningVar::Biased),
            "unbiased" => Ok(RunningVar::Unbiased),
            other => Err(format!("bn_var={other}: expected biased or unbiased")),
        }
    }
}

value_enum!(RunningVar: RunningVar::Biased, RunningVar::Unbiased);

impl<'a> PassContext<'a> {
    pub fn new(signature: &'a mut TrainingSignature, checkpoint: Option<&'a Checkpoint>) -> Self {
        PassContext {
            signature,
            checkpoint,
            state: Vec::new(),
            window: None,
            bn_stats: BnStats::Window,
            bn_running_var: RunningVar::Biased,
            recipe: Vec::new(),
        }
    }

    /// The window, if grad-accum opened one.
    pub fn window(&self) -> Option<&window::Window> {
        self.window.as_ref()
    }

    /// The window for `pass` to fill, or the error "no apply region: run grad-accum before
    /// PASS".
    pub fn window_mut(&mut self, pass: &str) -> Result<&mut window::Window, PassError> {
        self.window.as_mut().ok_or_else(|| no_window(pass))
    }

    /// The window and the state manifest together, for a pass that declares state.
    pub fn window_and_state(
        &mut self,
        pass: &str,
    ) -> Result<(&mut window::Window, &mut Vec<crate::state::StateEntry>), PassError> {
        match self.window.as_mut() {
            Some(w) => Ok((w, &mut self.state)),
            None => Err(no_window(pass)),
        }
    }

    /// Opens the window (grad-accum, once), with its BatchNorm policy.
    fn open_window(&mut self, window: window::Window, bn_stats: BnStats) {
        self.window = Some(window);
        self.bn_stats = bn_stats;
    }

    /// For the BatchNorm lowering: the window when the running statistics pool per window
    /// (`bn_stats=window`), else none (they move at every micro-step); and the manifest.
    pub fn bn_window(
        &mut self,
    ) -> (
        Option<&mut window::Window>,
        &mut Vec<crate::state::StateEntry>,
    ) {
        let window = match self.bn_stats {
            BnStats::Window => self.window.as_mut(),
            BnStats::Micro => None,
        };
        (window, &mut self.state)
    }

    /// Which variance the BatchNorm lowering moves running variances with.
    pub fn bn_running_var(&self) -> RunningVar {
        self.bn_running_var
    }

    /// Set by `autodiff`, which knows where the forward model came from.
    pub fn set_bn_running_var(&mut self, running_var: RunningVar) {
        self.bn_running_var = running_var;
    }

    /// The window, for the step builder once the pipeline has run.
    pub fn take_window(&mut self) -> Option<window::Window> {
        self.window.take()
    }
}

fn no_window(pass: &str) -> PassError {
    PassError::Other {
        pass: pass.into(),
        message: format!("no apply region: run grad-accum before {pass}"),
    }
}

/// What a pass did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassReport {
    pub changed: bool,
    pub added: usize,
    pub removed: usize,
    pub notes: Vec<String>,
}

impl fmt::Display for PassReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.changed {
            return write!(f, "unchanged");
        }
        write!(f, "changed, +{} nodes, -{} nodes", self.added, self.removed)?;
        for note in &self.notes {
            write!(f, "; {note}")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// A node the pass cannot handle: names the node, the op and the reason.
    #[error("{pass}: node '{node}' ({op}): {message}")]
    Node {
        pass: String,
        node: String,
        op: String,
        message: String,
    },
    #[error("{pass}: {message}")]
    Other { pass: String, message: String },
    #[error("after pass {pass}: {errors}")]
    Verify {
        pass: String,
        errors: verify::VerifyErrors,
    },
    #[error("pipeline spec '{spec}': {message}")]
    Spec { spec: String, message: String },
}

/// Where a pass stands in a step's pipeline: passes of a phase run after those of every
/// earlier phase. Why this order: the gradients exist (differentiate) before they are
/// accumulated; loss scaling, then AGC, see the window's gradients before the optimizer
/// consumes them; ONNX Runtime's training ops are lowered before precision halves what is
/// left, and the lowering for tract comes last. `Anywhere` passes (dce, legalize-training)
/// take any place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Differentiate,
    Accumulate,
    LossScale,
    Clip,
    Optimize,
    Legalize,
    Precision,
    Lower,
    Anywhere,
}

impl Phase {
    /// A pass of this phase runs at most once in a pipeline. (Precision twice is refused
    /// by the pass, which says which dtype the step already has.)
    fn once(self) -> bool {
        !matches!(
            self,
            Phase::Anywhere | Phase::Legalize | Phase::Precision | Phase::Lower
        )
    }
}

pub trait Pass {
    /// The name used in pipeline specs and provenance stamps.
    fn name(&self) -> &'static str;
    /// Its place in a pipeline ([`Phase`]).
    fn phase(&self) -> Phase {
        Phase::Anywhere
    }
    /// The spec of this pass with its options, e.g. `grad-accum(steps=4,normalize=mean)`.
    fn spec(&self) -> String {
        self.name().to_string()
    }
    /// What must hold before [`run`](Self::run); the pipeline checks it before the pass
    /// touches the graph (an error here is the user's: a pipeline that cannot work).
    fn requires(&self, _model: &Model, _cx: &PassContext<'_>) -> Result<(), PassError> {
        Ok(())
    }
    fn run(&mut self, model: &mut Model, cx: &mut PassContext<'_>)
        -> Result<PassReport, PassError>;
    /// What [`run`](Self::run) guarantees, checked by the pipeline right after it, before
    /// the verifier (an error here is a bug in the pass, reported as [`broken`]).
    fn ensures(&self, _model: &Model, _cx: &PassContext<'_>) -> Result<(), PassError> {
        Ok(())
    }
}

/// The error of a pass whose [`Pass::ensures`] does not hold after its run.
pub fn broken(pass: &str, what: String) -> PassError {
    PassError::Other {
        pass: pass.into(),
        message: format!("internal error: the pass broke its own guarantee: {what}"),
    }
}

/// [`Pass::requires`] of a pass that works in the apply region: grad-accum ran before.
pub fn requires_window(cx: &PassContext<'_>, pass: &str) -> Result<(), PassError> {
    match cx.window() {
        Some(_) => Ok(()),
        None => Err(no_window(pass)),
    }
}

/// For a pass that changes the window's gradients (a clipping): the window is open and no
/// optimizer has consumed them yet.
pub fn requires_unconsumed_gradients(cx: &PassContext<'_>, pass: &str) -> Result<(), PassError> {
    requires_window(cx, pass)?;
    match cx.window().is_some_and(|w| w.optimized()) {
        true => Err(PassError::Other {
            pass: pass.into(),
            message: format!(
                "the optimizer already consumed the gradients: run {pass} before optimizer"
            ),
        }),
        false => Ok(()),
    }
}

/// The spec text of a pass: `name`, or `name(a=1,b=2)` when it has options.
pub fn spec_text<S: AsRef<str>>(name: &str, options: &[S]) -> String {
    if options.is_empty() {
        name.to_string()
    } else {
        let options: Vec<&str> = options.iter().map(AsRef::as_ref).collect();
        format!("{name}({})", options.join(","))
    }
}

/// Options of one pass in a spec string: `name(key=value,...)`.
#[derive(Clone, Debug, Default)]
pub struct PassOptions {
    pub pass: String,
    values: BTreeMap<String, String>,
}

impl PassOptions {
    fn error(&self, message: String) -> PassError {
        PassError::Spec {
            spec: self.pass.clone(),
            message,
        }
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    /// The options given, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.values.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn parse<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>, PassError> {
        self.get(key)
            .map(|v| {
                v.parse::<T>()
                    .map_err(|_| self.error(format!("option {key}={v} is not a valid value")))
            })
            .transpose()
    }

    /// Fails on options the pass does not know, so a typo never silently does nothing.
    pub fn only(&self, known: &[&str]) -> Result<(), PassError> {
        match self.values.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(self.error(format!(
                "unknown option '{k}' (known: {})",
                known.join(", ")
            ))),
            None => Ok(()),
        }
    }
}

/// The pass elements of `a,b(x=1,y=2),c`: split at top-level commas, trimmed, empty ones
/// dropped.
pub fn split_spec(spec: &str) -> Result<Vec<String>, PassError> {
    let err = |message: &str| PassError::Spec {
        spec: spec.to_string(),
        message: message.to_string(),
    };
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut current = String::new();
    for c in spec.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ => {}
        }
        if depth < 0 {
            return Err(err("unbalanced ')'"));
        }
        if c == ',' && depth == 0 {
            parts.push(std::mem::take(&mut current));
        } else {
            current.push(c);
        }
    }
    if depth != 0 {
        return Err(err("unbalanced '('"));
    }
    parts.push(current);
    Ok(parts
        .into_iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect())
}

/// Splits `a,b(x=1,y=2),c` at top-level commas and parses each pass's options.
pub fn parse_spec(spec: &str) -> Result<Vec<PassOptions>, PassError> {
    let err = |message: String| PassError::Spec {
        spec: spec.to_string(),
        message,
    };
    split_spec(spec)?
        .into_iter()
        .map(|p| {
            let (name, args) = match p.split_once('(') {
                Some((name, rest)) => {
                    let args = rest
                        .strip_suffix(')')
                        .ok_or_else(|| err(format!("'{p}' does not end in ')'")))?;
                    (name.trim().to_string(), args.to_string())
                }
                None => (p.clone(), String::new()),
            };
            let mut values = BTreeMap::new();
            for kv in args.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| err(format!("option '{kv}' of {name} is not key=value")))?;
                values.insert(k.trim().to_string(), v.trim().to_string());
            }
            Ok(PassOptions { pass: name, values })
        })
        .collect()
}

/// Builds a pass from its options.
pub fn make_pass(options: &PassOptions) -> Result<Box<dyn Pass>, PassError> {
    match options.pass.as_str() {
        "legalize-ort" => Ok(Box::new(legalize::LegalizeOrt::from_options(options)?)),
        "legalize-training" => Ok(Box::new(
            legalize_training::LegalizeTraining::from_options(options)?,
        )),
        "autodiff" => Ok(Box::new(autodiff::Autodiff::from_options(options)?)),
        "grad-accum" => Ok(Box::new(grad_accum::GradAccum::from_options(options)?)),
        "optimizer" => Ok(Box::new(optimizer::Optimizer::from_options(options)?)),
        "agc" => Ok(Box::new(agc::Agc::from_options(options)?)),
        "clip-norm" => Ok(Box::new(clip_norm::ClipNorm::from_options(options)?)),
        "loss-scale" => Ok(Box::new(loss_scale::LossScale::from_options(options)?)),
        "precision" => Ok(Box::new(precision::Precision::from_options(options)?)),
        "fit-opset" => Ok(Box::new(fit_opset::FitOpset::from_options(options)?)),
        "lower-for-tract" => {
            options.only(&[])?;
            Ok(Box::new(lower_for_tract::LowerForTract))
        }
        "dce" => {
            options.only(&[])?;
            Ok(Box::new(dce::DeadCodeElimination))
        }
        other => Err(PassError::Spec {
            spec: other.to_string(),
            message: "unknown pass (known: autodiff, grad-accum, agc, clip-norm, loss-scale, optimizer, legalize-ort, legalize-training, precision, lower-for-tract, fit-opset, dce)".into(),
        }),
    }
}

/// An ordered list of passes.
pub struct Pipeline {
    pub passes: Vec<Box<dyn Pass>>,
    /// Verify after every pass (on in tests and debug builds; `--verify` in release).
    pub verify_each: bool,
}

impl Pipeline {
    pub fn parse(spec: &str) -> Result<Pipeline, PassError> {
        let passes = parse_spec(spec)?
            .iter()
            .map(make_pass)
            .collect::<Result<Vec<_>, _>>()?;
        check_order(spec, &passes)?;
        Ok(Pipeline {
            passes,
            verify_each: cfg!(debug_assertions),
        })
    }

    /// The canonical spec of the whole pipeline.
    pub fn spec(&self) -> String {
        self.passes
            .iter()
            .map(|p| p.spec())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<Vec<(String, PassReport)>, PassError> {
        check_order(&self.spec(), &self.passes)?;
        let mut reports = Vec::new();
        for pass in &mut self.passes {
            let sections = cx.recipe.len();
            let before: std::collections::HashSet<_> = model.all_nodes().collect();
            pass.requires(model, cx)?;
            let mut report = pass.run(model, cx)?;
            pass.ensures(model, cx)?;
            // Counted here, not by each pass: a pass that replaced one node by two added
            // two and removed one (not "+1 nodes").
            let after: std::collections::HashSet<_> = model.all_nodes().collect();
            report.added = after.difference(&before).count();
            report.removed = before.difference(&after).count();
            cx.recipe.truncate(sections + 1);
            if cx.recipe.len() == sections {
                cx.recipe.push(crate::recipe::Section::new(pass.name()));
            }
            if self.verify_each {
                verify::verify(model).map_err(|errors| PassError::Verify {
                    pass: pass.spec(),
                    errors,
                })?;
            }
            reports.push((pass.spec(), report));
        }
        if cx.window().is_some_and(|w| !w.optimized()) {
            return Err(PassError::Other {
                pass: "pipeline".into(),
                message: "grad-accum made an apply region but no optimizer pass filled it; add optimizer(...)".into(),
            });
        }
        if let Some(name) = cx.window().and_then(|w| w.unset_state(model)) {
            return Err(PassError::Other {
                pass: "pipeline".into(),
                message: format!(
                    "state '{name}' was declared in the window but never given its next value"
                ),
            });
        }
        Ok(reports)
    }
}

/// Refuses passes out of [`Phase`] order, and a once-only pass given twice, naming both.
fn check_order(spec: &str, passes: &[Box<dyn Pass>]) -> Result<(), PassError> {
    let err = |message: String| PassError::Spec {
        spec: spec.to_string(),
        message,
    };
    for (i, later) in passes.iter().enumerate() {
        let phase = later.phase();
        if phase == Phase::Anywhere {
            continue;
        }
        for earlier in &passes[..i] {
            if earlier.name() == later.name() && phase.once() {
                return Err(err(format!("{} runs once", later.name())));
            }
            if earlier.phase() != Phase::Anywhere && earlier.phase() > phase {
                let mut message = format!("run {} before {}", later.name(), earlier.name());
                if let Some(why) = phase_rule(earlier.phase()) {
                    message.push_str(": ");
                    message.push_str(why);
                }
                return Err(err(message));
            }
        }
    }
    Ok(())
}

/// The rule of a phase whose place is not obvious from the pass names.
fn phase_rule(phase: Phase) -> Option<&'static str> {
    match phase {
        Phase::Precision => Some(
            "run precision after grad-accum, loss-scale and optimizer (they build float32 state \
             math on the gradients), and after legalize-ort",
        ),
        _ => None,
    }
}

/// `model` rewritten in memory by `lower` (an engine's lowerings, applied by the engine to a
/// finished step, outside any pipeline): the step must hold no training-only op (a lowering
/// that would make state means it was never rewritten), and the result is verified.
pub(crate) fn lowered_in_memory(
    model: &crate::proto::ModelProto,
    pass: &str,
    lower: impl FnOnce(
        &mut crate::ir::Model,
        &mut Vec<crate::state::StateEntry>,
    ) -> Result<(), PassError>,
) -> Result<crate::proto::ModelProto, PassError> {
    let mut ir = crate::ir::Model::from_proto(model.clone());
    let mut state = Vec::new();
    lower(&mut ir, &mut state)?;
    if !state.is_empty() {
        return Err(PassError::Other {
            pass: pass.into(),
            message: "the model still holds training-only ops: rewrite it first".into(),
        });
    }
    crate::ir::verify::verify(&ir).map_err(|errors| PassError::Verify {
        pass: pass.into(),
        errors,
    })?;
    Ok(ir.to_proto())
}

#[cfg(test)]
mod contract_tests {
    use super::*;
    use crate::ir::builder::Builder;
    use crate::ir::BodyId;

    fn signature() -> TrainingSignature {
        TrainingSignature {
            source: crate::signature::Source::Plain {
                file: "m.onnx".into(),
            },
            data_inputs: Vec::new(),
            loss: "loss".into(),
            seed: None,
            params: Vec::new(),
            lazy_reset_grad: None,
            optimizer: None,
        }
    }

    fn one_relu() -> Model {
        let mut model = Model::from_proto(crate::proto::ModelProto {
            ir_version: Some(8),
            graph: Some(Default::default()),
            ..Default::default()
        });
        let ty = crate::ir::tensor_type(crate::proto::elem::FLOAT, &[2]);
        let x = model.add_input(BodyId::MAIN, "x", ty.clone(), None);
        let y = Builder::new(&mut model, BodyId::MAIN, "test").op("Relu", &[x], vec![], "y");
        model.add_output(BodyId::MAIN, y, Some(ty));
        model
    }

    /// A pass that leaves a dead node while claiming dce's guarantee.
    struct LeavesDeadNode;
    impl Pass for LeavesDeadNode {
        fn name(&self) -> &'static str {
            "leaves-dead-node"
        }
        fn run(
            &mut self,
            model: &mut Model,
            _: &mut PassContext<'_>,
        ) -> Result<PassReport, PassError> {
            let x = model.graph_inputs()[0];
            Builder::new(model, BodyId::MAIN, "test").op("Neg", &[x], vec![], "unused");
            Ok(PassReport::default())
        }
        fn ensures(&self, model: &Model, cx: &PassContext<'_>) -> Result<(), PassError> {
            dce::DeadCodeElimination.ensures(model, cx)
        }
    }

    #[test]
    fn a_broken_guarantee_is_an_internal_error_naming_the_pass() {
        let mut model = one_relu();
        let mut sig = signature();
        let mut cx = PassContext::new(&mut sig, None);
        let mut pipeline = Pipeline {
            passes: vec![Box::new(LeavesDeadNode)],
            verify_each: true,
        };
        let e = pipeline.run(&mut model, &mut cx).unwrap_err().to_string();
        assert!(
            e.contains("dce") && e.contains("broke its own guarantee") && e.contains("is dead"),
            "{e}"
        );
    }

    /// A pass that needs the window is refused before it touches the graph.
    #[test]
    fn an_unmet_requirement_stops_the_pipeline_before_the_pass_runs() {
        for spec in ["optimizer", "agc(clip=0.01)", "loss-scale"] {
            let mut model = one_relu();
            let nodes = model.all_nodes().count();
            let mut sig = signature();
            let mut cx = PassContext::new(&mut sig, None);
            let e = Pipeline::parse(spec)
                .unwrap()
                .run(&mut model, &mut cx)
                .unwrap_err()
                .to_string();
            assert!(e.contains("run grad-accum before"), "{spec}: {e}");
            assert_eq!(
                model.all_nodes().count(),
                nodes,
                "{spec}: the graph was touched"
            );
            assert!(cx.recipe.is_empty(), "{spec}: the pass ran");
        }
    }
}
