//! `autodiff(...)`: reverse-mode differentiation of a forward model, in standard ONNX ops.
//!
//! Input: a forward model (what `torch.onnx.export`, tf2onnx or onnx helper code write),
//! parameters as initializers. Output: the gradient graph the rest of the pipeline trains:
//! the model's inputs plus the labels, the loss as output 0, and per trainable parameter `p`
//! a value `p_grad` (a graph output too when the pass runs alone), the backward seeded by
//! a scalar initializer `<loss>_grad` = 1 (scaling it scales every gradient: grad-accum's
//! 1/K and loss scaling use that).
//!
//! ```text
//! normalise   BatchNorm -> training form, Dropout -> training mode, SplitToSequence -> Split
//! loss        L = loss_fn(Y, labels)                    (or --loss: the model's own scalar)
//! select      P = float initializers L depends on, minus --freeze, within --trainable
//! sweep       for each node n in reverse topological order, with dY_j = Σ of the
//!             gradient contributions to its outputs:  dX_i += rule_n(dY)_i
//!             for the inputs X_i that depend on some parameter
//! ```
//!
//! Control flow: a Loop is unrolled where its trip count is known before the run, else
//! differentiated by a Loop running backwards (`loop_grad`); an If is replaced by its branch
//! where the shape facts decide the condition, else differentiated by an If on the same
//! condition (`if_grad`).
//!
//! Only nodes on a path from a parameter to the loss are differentiated; a gradient that
//! reaches no parameter is never built. Shape computations (integer tensors, `Shape`,
//! `Range`, comparisons) carry no gradient and are left alone. An op on such a path
//! without a rule stops the pass with an error naming the node, the op and a parameter
//! that needs it.

mod expand_attention;
mod fold_ints;
pub mod half_model;
mod if_grad;
mod loop_grad;
mod loop_parts;
mod loss_fn;
mod normalize;
pub mod rules;
mod scan_as_loop;
pub mod shapes;
pub mod tf2onnx_constants;
pub mod torch_signature;
mod unroll_loop;
mod unroll_rnn;

use std::collections::{HashMap, HashSet};

pub use half_model::stored_in_float16;
pub use loop_parts::is_loop;
pub use loss_fn::{LossFn, LossSpec};
pub use normalize::{DropoutMode, LoopMode};

use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::Builder;
use crate::ir::{topological_order, BodyId, Model, NodeId, ValueDef, ValueId};
use crate::proto::{tensor_proto::DataType, TensorProto};
use crate::signature::{Param, Source, TensorInfo};
use rules::Grad;
use shapes::Shapes;

pub const PASS: &str = "autodiff";

/// What to differentiate.
#[derive(Clone, Debug, PartialEq)]
pub enum Objective {
    /// Append a loss function to a model output.
    LossFn(LossSpec),
    /// The model already computes a scalar loss: differentiate it.
    Existing(String),
}

#[derive(Clone, Debug)]
pub struct Autodiff {
    pub objective: Objective,
    /// `--freeze GLOB`: parameters kept constant.
    pub freeze: Vec<String>,
    /// `--trainable GLOB`: when given, only matching parameters train.
    pub trainable: Vec<String>,
    pub dropout: DropoutMode,
    /// `loops=`: unroll the Loops whose trip count is known before the run, or keep every
    /// Loop a Loop.
    pub loops: LoopMode,
    /// Expose every `p_grad` as a graph output (the gradient graph alone); off when later
    /// passes consume the gradients.
    pub grads_as_outputs: bool,
    /// The variance BatchNorm running variances move with (`bn_var=`); by default the
    /// convention of the framework that exported the model ([`running_var_of`]).
    pub bn_var: Option<super::RunningVar>,
}

/// The running-variance convention of the framework that wrote `model`: PyTorch's BatchNorm
/// moves it with the batch's unbiased variance (its exporter names itself `pytorch`); ONNX's
/// BatchNormalization, ONNX Runtime's training build and Keras with the biased one.
pub fn running_var_of(model: &Model) -> super::RunningVar {
    match model.header.producer_name() {
        "pytorch" => super::RunningVar::Unbiased,
        _ => super::RunningVar::Biased,
    }
}

fn fail(message: String) -> PassError {
    PassError::Other {
        pass: PASS.into(),
        message,
    }
}

/// `|`-separated globs in a spec option (commas separate options).
fn globs(options: &PassOptions, key: &str) -> Vec<String> {
    options
        .get(key)
        .map(|v| {
            v.split('|')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

impl Autodiff {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&[
            "loss_fn",
            "output",
            "labels",
            "class_axis",
            "ignore_index",
            "reduction",
            "loss",
            "freeze",
            "trainable",
            "dropout",
            "loops",
            "grads",
            "bn_var",
        ])?;
        let spec_err = |message: String| PassError::Spec {
            spec: options.pass.clone(),
            message,
        };
        let objective = match (options.get("loss_fn"), options.get("loss")) {
            (Some(_), Some(_)) => return Err(spec_err("give loss_fn or loss, not both".into())),
            (None, Some(loss)) => Objective::Existing(loss.to_string()),
            (Some(f), None) => {
                let function = LossFn::parse(f).ok_or_else(|| {
                    spec_err(format!("loss_fn={f}: expected cross-entropy, nll, mse, l1 or bce-logits"))
                })?;
                let sum = match options.get("reduction").unwrap_or("mean") {
                    "mean" => false,
                    "sum" => true,
                    other => return Err(spec_err(format!("reduction={other}: expected mean or sum"))),
                };
                Objective::LossFn(LossSpec {
                    function,
                    output: options.get("output").map(str::to_string),
                    labels: options.get("labels").unwrap_or("labels").to_string(),
                    class_axis: options.parse("class_axis")?.unwrap_or(-1),
                    ignore_index: options.parse("ignore_index")?,
                    sum,
                })
            }
            (None, None) => return Err(spec_err("needs loss_fn=... (a loss on a model output) or loss=NAME (the model's own scalar loss)".into())),
        };
        let dropout = match options.get("dropout").unwrap_or("train") {
            "train" => DropoutMode::Train,
            "off" => DropoutMode::Off,
            other => return Err(spec_err(format!("dropout={other}: expected train or off"))),
        };
        let loops = match options.get("loops").unwrap_or("unroll") {
            "unroll" => LoopMode::Unroll,
            "keep" => LoopMode::Keep,
            other => return Err(spec_err(format!("loops={other}: expected unroll or keep"))),
        };
        let grads_as_outputs = match options.get("grads").unwrap_or("outputs") {
            "outputs" => true,
            "internal" => false,
            other => {
                return Err(spec_err(format!(
                    "grads={other}: expected outputs or internal"
                )))
            }
        };
        Ok(Autodiff {
            objective,
            freeze: globs(options, "freeze"),
            trainable: globs(options, "trainable"),
            dropout,
            loops,
            grads_as_outputs,
            bn_var: options.parse("bn_var")?,
        })
    }
}

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Differentiate
    }

    fn spec(&self) -> String {
        let mut o = Vec::new();
        match &self.objective {
            Objective::Existing(l) => o.push(format!("loss={l}")),
            Objective::LossFn(s) => {
                o.push(format!("loss_fn={}", s.function.as_str()));
                if let Some(out) = &s.output {
                    o.push(format!("output={out}"));
                }
                if s.labels != "labels" {
                    o.push(format!("labels={}", s.labels));
                }
                if s.class_axis != -1 {
                    o.push(format!("class_axis={}", s.class_axis));
                }
                if let Some(i) = s.ignore_index {
                    o.push(format!("ignore_index={i}"));
                }
                if s.sum {
                    o.push("reduction=sum".into());
                }
            }
        }
        if !self.freeze.is_empty() {
            o.push(format!("freeze={}", self.freeze.join("|")));
        }
        if !self.trainable.is_empty() {
            o.push(format!("trainable={}", self.trainable.join("|")));
        }
        if self.dropout == DropoutMode::Off {
            o.push("dropout=off".into());
        }
        if self.loops == LoopMode::Keep {
            o.push("loops=keep".into());
        }
        if !self.grads_as_outputs {
            o.push("grads=internal".into());
        }
        if let Some(v) = self.bn_var {
            o.push(format!("bn_var={}", v.as_str()));
        }
        super::spec_text(PASS, &o)
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        if cx.signature.params.iter().any(|p| p.trainable) {
            return Err(fail(
                "the input already is a gradient graph (it has trainable parameters with gradients); autodiff takes a forward model".into(),
            ));
        }
        let nodes_before = model.all_nodes().count();
        let readers = forward_readers(model);
        let convention = running_var_of(model);
        let differentiated = differentiate(model, self)?;
        if differentiated.batch_norms > 0 {
            let running_var = self.bn_var.unwrap_or(convention);
            cx.set_bn_running_var(running_var);
            let mut section = crate::recipe::Section::new(PASS);
            section.set(
                "bn_var",
                running_var.as_str(),
                crate::recipe::Origin::Default,
            );
            let mut note = match running_var {
                super::RunningVar::Unbiased => "running variances move with the batch's unbiased variance (n - 1), as PyTorch's BatchNorm".to_string(),
                super::RunningVar::Biased => "running variances move with the batch's biased variance (n), as ONNX's BatchNormalization, ONNX Runtime's training build and Keras".to_string(),
            };
            if self.bn_var.is_none() {
                note.push_str(match convention {
                    super::RunningVar::Unbiased => "; the model's producer is pytorch",
                    super::RunningVar::Biased => "; the model's producer is not pytorch",
                });
            }
            section.note("bn_var", note);
            cx.recipe.push(section);
        }
        let mut report = PassReport {
            changed: true,
            ..Default::default()
        };
        report.notes.push(format!(
            "{} trainable parameters ({} elements), loss '{}'",
            differentiated.trainable.len(),
            differentiated
                .trainable
                .iter()
                .map(|p| p.element_count())
                .sum::<u64>(),
            differentiated.loss
        ));
        if !differentiated.frozen.is_empty() {
            report
                .notes
                .push(format!("{} frozen", differentiated.frozen.len()));
        }
        // Every float initializer the loss reaches is trainable, constants written as
        // initializers too (an attention scale, an epsilon): say so for the one-element
        // ones, which are rarely meant to learn.
        let scalars: Vec<&str> = differentiated
            .trainable
            .iter()
            .filter(|p| p.element_count() == 1)
            .map(|p| p.name.as_str())
            .collect();
        if !scalars.is_empty() {
            report.notes.push(format!(
                "training one-element initializers {} (constants? keep them with --freeze)",
                scalars.join(", ")
            ));
        }
        if !differentiated.tf2onnx_constants.is_empty() {
            report.notes.push(format!(
                "{} initializers of tf2onnx's export are constants, not trained (numbers and constant ops): {}; --trainable names any that should train",
                differentiated.tf2onnx_constants.len(),
                first_few(&differentiated.tf2onnx_constants)
            ));
        }
        if differentiated.scans > 0 {
            report.notes.push(format!(
                "{} Scan{} rewritten as the Loop{} {} (below)",
                differentiated.scans,
                if differentiated.scans == 1 { "" } else { "s" },
                if differentiated.scans == 1 { "" } else { "s" },
                if differentiated.scans == 1 {
                    "it is"
                } else {
                    "they are"
                },
            ));
        }
        if !differentiated.unrolled_loops.is_empty() {
            let loops: Vec<String> = differentiated
                .unrolled_loops
                .iter()
                .map(|(name, trips)| format!("{name} x{trips}"))
                .collect();
            let plural = if loops.len() == 1 { "" } else { "s" };
            report.notes.push(format!(
                "{} Loop{plural} unrolled into {} iterations: {}",
                loops.len(),
                if loops.len() == 1 { "its" } else { "their" },
                first_few(&loops)
            ));
        }
        if !differentiated.kept_loops.is_empty() {
            let loops: Vec<String> = differentiated
                .kept_loops
                .iter()
                .map(|(name, why)| format!("{name} ({why})"))
                .collect();
            report.notes.push(format!(
                "{} Loop{} not unrolled, differentiated by a Loop over the iterations backwards (what each iteration carried in kept, the rest recomputed): {}",
                loops.len(),
                if loops.len() == 1 { "" } else { "s" },
                first_few(&loops)
            ));
        }
        if !differentiated.decided_ifs.is_empty() {
            let ifs: Vec<String> = differentiated
                .decided_ifs
                .iter()
                .map(|(name, branch)| format!("{name} ({})", branch.attribute()))
                .collect();
            report.notes.push(format!(
                "{} If{} decided before the run (by the shapes, or by an unrolled iteration), replaced by the branch taken: {}",
                ifs.len(),
                if ifs.len() == 1 { "" } else { "s" },
                first_few(&ifs)
            ));
        }
        if !differentiated.kept_ifs.is_empty() {
            report.notes.push(format!(
                "{} If{} on data kept, differentiated by an If on the same condition (the branch taken recomputed in the backward): {}",
                differentiated.kept_ifs.len(),
                if differentiated.kept_ifs.len() == 1 { "" } else { "s" },
                first_few(&differentiated.kept_ifs)
            ));
        }
        if differentiated.half_masters > 0 || !differentiated.half_inputs.is_empty() {
            let inputs = match differentiated.half_inputs.as_slice() {
                [] => String::new(),
                names => format!(
                    "; data input{} {} float32, cast to half at entry",
                    if names.len() == 1 { "" } else { "s" },
                    first_few(names)
                ),
            };
            report.notes.push(format!(
                "the model is stored in half precision: {} parameters train as float32 masters, read through Casts to their type (the forward computes in half as the file does; the loss in float32){inputs}",
                differentiated.half_masters
            ));
        }
        if !differentiated.absent_torch_parameters.is_empty() {
            report.notes.push(format!(
                "torch's parameters {} are not in the file: torch exports tied weights once, under one of their names (that tensor trains for all of them), and unused parameters not at all",
                first_few(&differentiated.absent_torch_parameters)
            ));
        }
        report
            .notes
            .extend(export_warnings(model, &readers, &differentiated));
        let nodes_after = model.all_nodes().count();
        report.added = nodes_after.saturating_sub(nodes_before);
        update_signature(model, cx, &differentiated);
        Ok(report)
    }
}

/// How many forward nodes read each initializer's values (by name), before
/// differentiation; shape computations (`Shape`, `CastLike`'s target type) do not count.
fn forward_readers(model: &Model) -> HashMap<String, usize> {
    model
        .main()
        .initializers
        .iter()
        .map(|(v, _)| {
            let mut nodes: Vec<NodeId> = model
                .uses(*v)
                .iter()
                .filter_map(|u| match u {
                    crate::ir::Use::Node { node, slot } => {
                        let op = model.node(*node).proto.op_type();
                        let reads_values =
                            differentiable(model, *node) && !(op == "CastLike" && *slot == 1);
                        reads_values.then_some(*node)
                    }
                    crate::ir::Use::Output { .. } => None,
                })
                .collect();
            nodes.sort();
            nodes.dedup();
            (model.name(*v).to_string(), nodes.len())
        })
        .collect()
}

/// Signs that the exporter changed the network before we saw it, measured on torch 2.15's
/// dynamo export with its default `optimize=True`: equal-valued initializers merged into one
/// tensor that several layers then share (every LayerNorm weight of a GPT), and parameters
/// renamed `val_<n>` when BatchNorm is folded into the convolution before it (the folded
/// network trains differently). Tied weights can be meant (an embedding shared with the
/// output layer), so these are notes, not errors.
fn export_warnings(
    model: &Model,
    readers: &HashMap<String, usize>,
    d: &Differentiated,
) -> Vec<String> {
    let mut notes = Vec::new();
    let shared: Vec<String> = d
        .trainable
        .iter()
        .filter(|p| p.element_count() > 1)
        .filter_map(|p| {
            let n = *readers.get(&p.name)?;
            (n > 1).then(|| format!("{} ({n} nodes)", p.name))
        })
        .collect();
    if !shared.is_empty() {
        notes.push(format!(
            "trained as one tensor each, read by several nodes: {}; if the model does not tie them, the exporter merged equal initializers (torch.onnx.export(dynamo=True) does unless optimize=False)",
            shared.join(", ")
        ));
    }
    let torch = model.header.producer_name() == "pytorch";
    let anonymous: Vec<&str> = d
        .trainable
        .iter()
        .map(|p| p.name.as_str())
        .filter(|n| {
            n.strip_prefix("val_")
                .is_some_and(|r| r.chars().all(|c| c.is_ascii_digit()))
        })
        .collect();
    if torch && !anonymous.is_empty() {
        notes.push(format!(
            "trainable initializers without a torch name: {} (torch's exporter rewrote them: with the default optimize=True it folds BatchNorm into the convolution, which trains a different network; export with optimize=False)",
            anonymous.join(", ")
        ));
    }
    notes
}

/// torch's parameter list when the model has one and `--trainable` does not choose the set
/// itself, with the parameters it lists that the file does not hold; an error when torch's
/// parameters were rewritten by its exporter (which tensors are the parameters can no
/// longer be told).
///
/// Measured on torch 2.15: with `optimize=False` every initializer of the file is a target
/// of the signature, and a listed parameter is absent only when torch exported one tensor for
/// several names (tied weights: GPT-2's and Gemma's `lm_head.weight` is their token
/// embedding; the file holds it once) or the graph does not use it. With the default
/// `optimize=True` parameters are absent because they were rewritten, and the file always
/// holds floating-point initializers the signature does not name (`val_<n>`, `embedding_1`,
/// ...): that pair is the refusal.
fn torch_parameters(
    model: &Model,
    options: &Autodiff,
) -> Result<Option<TorchParameters>, PassError> {
    let Some(signature) = signature_in_force(model, options) else {
        return Ok(None);
    };
    let initializers: Vec<&str> = model
        .main()
        .initializers
        .iter()
        .filter(|(v, _)| {
            model
                .initializer(*v)
                .is_some_and(|t| is_float(t.data_type()))
        })
        .map(|(v, _)| model.name(*v))
        .collect();
    let absent: Vec<String> = signature
        .parameters
        .iter()
        .filter(|p| !initializers.contains(&p.as_str()))
        .cloned()
        .collect();
    let unnamed: Vec<&str> = initializers
        .iter()
        .copied()
        .filter(|i| !signature.names(i))
        .collect();
    if absent.is_empty() || unnamed.is_empty() {
        return Ok(Some(TorchParameters { signature, absent }));
    }
    Err(fail(format!(
        "torch's export lists {} parameters, {} of them are not initializers of this model ({}), and it holds initializers torch does not name ({}): its exporter rewrote them (torch.onnx.export's default optimize=True transposes weights into val_<n> tensors, folds BatchNorm into convolutions and merges equal tensors), so which tensors are the parameters cannot be told. Export with optimize=False, or name the trainable set with --trainable GLOB",
        signature.parameters.len(),
        absent.len(),
        first_few(&absent),
        first_few(&unnamed),
    )))
}

/// torch's signature in force, and the parameters it lists that the file does not hold.
struct TorchParameters {
    signature: torch_signature::TorchSignature,
    absent: Vec<String>,
}

/// Up to six names, then how many more.
fn first_few<S: AsRef<str>>(names: &[S]) -> String {
    let shown: Vec<&str> = names.iter().take(6).map(AsRef::as_ref).collect();
    match names.len() - shown.len() {
        0 => shown.join(", "),
        more => format!("{}, and {more} more", shown.join(", ")),
    }
}

/// Whether tf2onnx's constants are told from its variables (`tf2onnx_constants`): in its
/// exports, unless `--trainable` chooses the set itself.
fn tf2onnx_rules_in_force(model: &Model, options: &Autodiff) -> bool {
    options.trainable.is_empty() && tf2onnx_constants::exported_by_tf2onnx(model)
}

/// torch's recorded signature, unless `--trainable` chooses the set itself.
fn signature_in_force(
    model: &Model,
    options: &Autodiff,
) -> Option<torch_signature::TorchSignature> {
    torch_signature::TorchSignature::of(model).filter(|_| options.trainable.is_empty())
}

/// What differentiation produced, in signature terms.
pub struct Differentiated {
    pub loss: String,
    pub seed: String,
    pub labels: Option<String>,
    pub trainable: Vec<Param>,
    /// BatchNorm running statistics and frozen parameters that are graph inputs.
    pub frozen: Vec<Param>,
    /// Parameters torch's signature lists that the file does not hold (tied to one it
    /// holds, or unused).
    pub absent_torch_parameters: Vec<String>,
    /// Float initializers of a tf2onnx export left untrained as its constants.
    pub tf2onnx_constants: Vec<String>,
    /// BatchNorm layers turned to their training form.
    pub batch_norms: usize,
    /// Loops unrolled into their iterations: name and trip count.
    pub unrolled_loops: Vec<(String, usize)>,
    /// Loops left as Loops (`loop_grad` differentiates them): name and why they were not
    /// unrolled.
    pub kept_loops: Vec<(String, String)>,
    /// Ifs whose condition the shape facts decide, replaced by the branch they take: name
    /// and branch.
    pub decided_ifs: Vec<(String, crate::ir::inline::Branch)>,
    /// Ifs on data left as Ifs (`if_grad` differentiates those the gradient passes).
    pub kept_ifs: Vec<String>,
    /// Scans rewritten as Loops (then unrolled or kept as any Loop).
    pub scans: usize,
    /// Half-precision parameters made float32 masters, and half data inputs made float32
    /// (`half_model`).
    pub half_masters: usize,
    pub half_inputs: Vec<String>,
}

/// The gradient graph the autodiff pass `spec` (an `autodiff(...)` element) builds from the
/// forward model at `path`, for `inspect`: nothing is written. Also lists the floating-point
/// initializers that are not trained, each with the reason.
pub fn differentiated_graph(
    path: &std::path::Path,
    spec: &str,
) -> anyhow::Result<(crate::signature::TrainingGraph, Vec<Untrained>)> {
    use anyhow::Context;
    let proto = crate::model::load_model_with_data(path)?;
    let mut graph = crate::signature::forward(proto, path);
    let options = super::parse_spec(spec)?;
    let [options] = options.as_slice() else {
        anyhow::bail!("internal: '{spec}' is not one autodiff pass");
    };
    let mut pass = Autodiff::from_options(options)?;
    let floats: Vec<(String, Vec<i64>)> = graph
        .model
        .main()
        .initializers
        .iter()
        .filter_map(|(v, _)| {
            let t = graph.model.initializer(*v)?;
            is_float(t.data_type()).then(|| (graph.model.name(*v).to_string(), t.dims.clone()))
        })
        .collect();
    let mut cx = PassContext::new(&mut graph.signature, None);
    pass.run(&mut graph.model, &mut cx)
        .with_context(|| path.display().to_string())?;
    let torch = signature_in_force(&graph.model, &pass);
    let tf2onnx = tf2onnx_rules_in_force(&graph.model, &pass);
    let untrained = floats
        .into_iter()
        .filter(|(name, _)| graph.signature.param(name).is_none())
        .map(|(name, dims)| {
            let reason = if pass.freeze.iter().any(|g| glob_match(g, &name)) {
                UntrainedReason::Frozen
            } else if !pass.trainable.is_empty()
                && !pass.trainable.iter().any(|g| glob_match(g, &name))
            {
                UntrainedReason::OutsideTrainable
            } else if torch.as_ref().is_some_and(|t| !t.is_parameter(&name)) {
                UntrainedReason::NotATorchParameter
            } else if tf2onnx && tf2onnx_constants::is_constant(&name, &dims) {
                UntrainedReason::Tf2onnxConstant
            } else {
                UntrainedReason::Unreached
            };
            Untrained { name, dims, reason }
        })
        .collect();
    Ok((graph, untrained))
}

/// A floating-point initializer of a forward model that autodiff does not train.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Untrained {
    pub name: String,
    pub dims: Vec<i64>,
    pub reason: UntrainedReason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum UntrainedReason {
    /// Matched by `--freeze`.
    Frozen,
    /// Not matched by `--trainable`.
    OutsideTrainable,
    /// The loss does not depend on it differentiably (a constant, shape data, an unused
    /// output branch).
    Unreached,
    /// torch's export lists it as a buffer or a constant, not a parameter.
    NotATorchParameter,
    /// A constant of a tf2onnx export (`tf2onnx_constants`).
    Tf2onnxConstant,
}

impl UntrainedReason {
    pub fn describe(self) -> &'static str {
        match self {
            UntrainedReason::Frozen => "frozen (--freeze)",
            UntrainedReason::OutsideTrainable => "outside --trainable",
            UntrainedReason::Unreached => "the loss does not reach it",
            UntrainedReason::NotATorchParameter => {
                "not a parameter in torch's export (a buffer or a constant)"
            }
            UntrainedReason::Tf2onnxConstant => {
                "a constant in tf2onnx's export (a number or a constant op)"
            }
        }
    }
}

/// `spec` with the autodiff pass `autodiff` in front, or in place of a bare `autodiff`
/// element. The gradients stay graph outputs only when autodiff is the whole pipeline.
pub fn with_autodiff(spec: &str, autodiff: &str) -> Result<String, PassError> {
    let parts = super::parse_spec(spec)?;
    let others = parts.iter().filter(|p| p.pass != PASS).count();
    let autodiff = if others > 0 {
        let inner = autodiff.strip_prefix(PASS).unwrap_or("");
        match inner.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
            Some(opts) if !opts.is_empty() => format!("{PASS}({opts},grads=internal)"),
            _ => format!("{PASS}(grads=internal)"),
        }
    } else {
        // Alone, the gradient graph still gets legalize-ort: BatchNorm's training form
        // lowers to standard ops (its running statistics become state outputs).
        format!("{autodiff},{}", super::legalize::PASS)
    };
    let rest: Vec<String> = super::split_spec(spec)?
        .into_iter()
        .filter(|p| p != PASS && !p.starts_with(&format!("{PASS}(")))
        .collect();
    Ok(std::iter::once(autodiff)
        .chain(rest)
        .collect::<Vec<_>>()
        .join(","))
}

fn update_signature(model: &Model, cx: &mut PassContext<'_>, d: &Differentiated) {
    let s = &mut *cx.signature;
    s.loss = d.loss.clone();
    s.seed = Some(d.seed.clone());
    s.params = d.trainable.iter().chain(&d.frozen).cloned().collect();
    let is_param = |name: &str| s.params.iter().any(|p| p.name == name);
    let data: Vec<TensorInfo> = model
        .main()
        .inputs
        .iter()
        .filter(|(v, _)| model.initializer(*v).is_none() && !is_param(model.name(*v)))
        .map(|(v, info)| TensorInfo::of(model.name(*v), info.r#type.as_ref()))
        .collect();
    s.data_inputs = data;
    if let Source::Forward { differentiated, .. } = &mut s.source {
        *differentiated = true;
    }
}

use crate::ir::is_float_elem as is_float;

/// Bytes per element of the numeric types.
pub(crate) fn elem_size(elem: i32) -> usize {
    match elem {
        x if x == DataType::Double as i32 || x == DataType::Int64 as i32 => 8,
        x if x == DataType::Float as i32 || x == DataType::Int32 as i32 => 4,
        x if x == DataType::Float16 as i32 || x == DataType::Bfloat16 as i32 => 2,
        _ => 1,
    }
}

/// `*` matches any run of characters, `?` one character.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some('*'), _) => go(&p[1..], n) || (!n.is_empty() && go(p, &n[1..])),
            (Some('?'), Some(_)) => go(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &n[1..]),
            _ => false,
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    go(&p, &n)
}

fn param_of(model: &Model, v: ValueId, trainable: bool, grad: Option<String>) -> Param {
    let t = model.initializer(v);
    Param {
        name: model.name(v).to_string(),
        elem_type: t.map(|t| t.data_type()).unwrap_or(0),
        dims: t.map(|t| t.dims.clone()).unwrap_or_default(),
        trainable,
        grad,
        accumulation: None,
    }
}

/// The loss of `spec` appended to `model` as the pass appends it; returns (loss, labels
/// input). For a host that computes the loss a step was trained on without differentiating
/// it (`crate::evaluate`: the validation loss).
pub fn append_loss(model: &mut Model, spec: &LossSpec) -> Result<(ValueId, ValueId), PassError> {
    let shapes = Shapes::infer(model);
    loss_fn::append(model, spec, &shapes)
}

/// The gradient rule of node `n`, which the gradient of some parameter (`origin`) must
/// pass, or `None` for a Loop or an If (`loop_grad`, `if_grad`); an error naming the node, the op
/// and that parameter when there is neither.
fn check_rule(
    model: &Model,
    n: NodeId,
    origin: &HashMap<ValueId, ValueId>,
) -> Result<Option<rules::RuleFn>, PassError> {
    let node = model.node(n);
    let (domain, op) = (node.proto.domain(), node.proto.op_type());
    let param = node
        .inputs
        .iter()
        .flatten()
        .copied()
        .chain(node.subgraphs.iter().flat_map(|s| model.captures(s.body)))
        .find_map(|v| origin.get(&v))
        .map(|p| model.name(*p).to_string())
        .unwrap_or_default();
    let control_flow = match (loop_parts::is_loop(model, n), if_grad::is_if(model, n)) {
        (true, _) => Some(("Loop", loop_grad::why_not(model, n))),
        (false, true) => Some(("If", if_grad::why_not(model, n))),
        (false, false) => None,
    };
    if let Some((op, why_not)) = control_flow {
        return match why_not {
            None => Ok(None),
            Some(why) => Err(rules::node_error(
                model,
                n,
                format!("parameter '{param}' needs the gradient through this {op}, and it has none: {why}"),
            )),
        };
    }
    let rule = rules::rule_for(domain, op).ok_or_else(|| {
        let op_name = if domain.is_empty() {
            op.to_string()
        } else {
            format!("{domain}::{op}")
        };
        rules::node_error(
            model,
            n,
            format!("no gradient rule for {op_name}; parameter '{param}' needs the gradient through it (freeze it with --freeze, or file an issue)"),
        )
    })?;
    if !node.subgraphs.is_empty() {
        return Err(rules::node_error(
            model,
            n,
            "differentiating through control flow (subgraphs) is not supported".into(),
        ));
    }
    Ok(Some(rule))
}

/// The whole transformation; see the module docs.
pub fn differentiate(model: &mut Model, options: &Autodiff) -> Result<Differentiated, PassError> {
    let main = BodyId::MAIN;
    // Only the model's own initializers can be parameters: the normalisation's and the
    // loss's constants (an attention's scale, a -inf bias) are not; and where torch's
    // exporter recorded its parameter list, only those (`torch_signature`); in a tf2onnx
    // export, not its constants (`tf2onnx_constants`).
    let own: HashSet<ValueId> = model.main().initializers.iter().map(|(v, _)| *v).collect();
    let (torch, absent_torch_parameters) = match torch_parameters(model, options)? {
        Some(TorchParameters { signature, absent }) => (Some(signature), absent),
        None => (None, Vec::new()),
    };
    let tf2onnx = tf2onnx_rules_in_force(model, options);
    let folded = match tf2onnx {
        true => tf2onnx_constants::folded_batch_norms(model),
        false => Vec::new(),
    };
    if !folded.is_empty() {
        return Err(fail(format!(
            "tf2onnx folded BatchNormalization layers into the convolutions before them ({} tensors: {}): the file computes inference arithmetic, a different network to train (no batch statistics; the scale and shift are gone). Export with tf2onnx's Conv + BatchNormalization fold taken out, as graphs/forward/generate_keras.py's export_kept does (README.md, \"From Keras\"), or choose the trainable set with --trainable GLOB",
            folded.len(),
            first_few(&folded)
        )));
    }
    let normalized = normalize::normalize(model, options.dropout, options.loops, PASS)?;
    // The Loops left (differentiated as Loops where the gradient passes them), with why
    // they were not unrolled.
    let kept_loops: Vec<(String, String)> = model
        .body_nodes(main)
        .filter(|n| loop_parts::is_loop(model, *n))
        .map(|n| {
            let name = match model.node(n).proto.name() {
                "" => "Loop".to_string(),
                name => name.to_string(),
            };
            let why = match options.loops {
                LoopMode::Keep => "--loops keep".to_string(),
                LoopMode::Unroll => unroll_loop::why_not(model, n).unwrap_or_default(),
            };
            (name, why)
        })
        .collect();
    let kept_ifs: Vec<String> = model
        .body_nodes(main)
        .filter(|n| if_grad::is_if(model, *n))
        .map(|n| match model.node(n).proto.name() {
            "" => "If".to_string(),
            name => name.to_string(),
        })
        .collect();
    // A model stored in half precision: float32 data in (`half_model`).
    let half_inputs = half_model::float32_inputs(model, PASS);
    let mut shapes = Shapes::infer(model);

    // The loss.
    let (loss, labels) = match &options.objective {
        Objective::LossFn(spec) => {
            let (loss, labels) = loss_fn::append(model, spec, &shapes)?;
            shapes = Shapes::infer(model);
            (loss, Some(labels))
        }
        Objective::Existing(name) => (loss_fn::existing(model, name, &shapes)?, None),
    };
    let loss_name = model.name(loss).to_string();

    // Candidates: float initializers (not BatchNorm statistics), named by the globs.
    let candidates: Vec<ValueId> = model
        .main()
        .initializers
        .iter()
        .map(|(v, _)| *v)
        .filter(|v| own.contains(v) && !normalized.bn_stats.contains(v))
        .filter(|v| {
            torch
                .as_ref()
                .is_none_or(|t| t.is_parameter(model.name(*v)))
        })
        .filter(|v| {
            model
                .initializer(*v)
                .is_some_and(|t| is_float(t.data_type()))
        })
        .collect();
    // tf2onnx's constants leave the candidates (`tf2onnx_constants`), named in the report.
    let (candidates, tf2onnx_constants): (Vec<ValueId>, Vec<ValueId>) =
        candidates.into_iter().partition(|v| {
            !tf2onnx
                || model
                    .initializer(*v)
                    .is_some_and(|i| !tf2onnx_constants::is_constant(model.name(*v), &i.dims))
        });
    // A glob may name BatchNorm statistics and tf2onnx's constants (never trained anyway)
    // without complaint.
    let matchable: Vec<ValueId> = candidates
        .iter()
        .copied()
        .chain(normalized.bn_stats.iter().copied())
        .chain(tf2onnx_constants.iter().copied())
        .collect();
    for glob in &options.freeze {
        if !matchable.iter().any(|v| glob_match(glob, model.name(*v))) {
            return Err(fail(format!(
                "--freeze '{glob}' matches no floating-point initializer of the model"
            )));
        }
    }
    for glob in &options.trainable {
        if !candidates.iter().any(|v| glob_match(glob, model.name(*v))) {
            return Err(fail(format!(
                "--trainable '{glob}' matches no floating-point initializer of the model"
            )));
        }
    }
    let selected: Vec<ValueId> = candidates
        .iter()
        .copied()
        .filter(|v| {
            let n = model.name(*v);
            (options.trainable.is_empty() || options.trainable.iter().any(|g| glob_match(g, n)))
                && !options.freeze.iter().any(|g| glob_match(g, n))
        })
        .collect();

    let needed = differentiable_ancestors(model, &shapes, BodyId::MAIN, &[loss]);
    let params: Vec<ValueId> = selected
        .iter()
        .copied()
        .filter(|v| needed.contains(v))
        .collect();
    if params.is_empty() {
        // Parameters fed as graph inputs (ONNX Runtime's eval_model.onnx) have no value here.
        let fed: Vec<&str> = model
            .main()
            .inputs
            .iter()
            .map(|(v, _)| *v)
            .filter(|v| model.initializer(*v).is_none() && needed.contains(v))
            .filter(|v| shapes.get(*v).elem.is_some_and(is_float))
            .map(|v| model.name(v))
            .collect();
        if selected.is_empty() && fed.len() > 1 {
            return Err(fail(format!(
                "the loss '{loss_name}' depends on no initializer; it reads the float graph inputs {}: parameters fed as inputs (as in ONNX Runtime's eval_model.onnx) cannot be trained here: give the model its parameters as initializers (`onnx-ga export MODEL --state S`), or rewrite the artifacts folder",
                fed.join(", ")
            )));
        }
        return Err(fail(format!(
            "the loss '{loss_name}' depends on no trainable parameter (candidates: {})",
            if selected.is_empty() {
                "none".to_string()
            } else {
                selected
                    .iter()
                    .map(|v| model.name(*v).to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        )));
    }

    // Half parameters train as float32 masters read through Casts (`half_model`).
    let half_masters = half_model::float32_masters(model, &params, PASS);
    if half_masters > 0 {
        shapes = Shapes::infer(model);
    }

    // The seed: dL/dL = 1, shaped like the loss.
    let loss_facts = shapes.get(loss);
    let loss_elem = loss_facts.elem.unwrap_or(DataType::Float as i32);
    let loss_dims: Vec<i64> = loss_facts.static_dims().unwrap_or_default();
    let seed_tensor = {
        let b = Builder::new(model, main, PASS);
        let count = loss_dims.iter().product::<i64>().max(1) as usize;
        let bytes: Vec<u8> = (0..count)
            .flat_map(|_| match loss_elem {
                x if x == DataType::Double as i32 => 1f64.to_le_bytes().to_vec(),
                x if x == DataType::Float16 as i32 => half::f16::ONE.to_le_bytes().to_vec(),
                x if x == DataType::Bfloat16 as i32 => half::bf16::ONE.to_le_bytes().to_vec(),
                _ => 1f32.to_le_bytes().to_vec(),
            })
            .collect();
        b.model.add_initializer(
            main,
            &format!("{loss_name}_grad"),
            TensorProto {
                dims: loss_dims.clone(),
                data_type: Some(loss_elem),
                raw_data: Some(bytes),
                ..Default::default()
            },
        )
    };
    shapes.set(seed_tensor, loss_facts.clone());
    let seed_name = model.name(seed_tensor).to_string();

    let grad_values = backward(model, &mut shapes, loss, seed_tensor, &params)?;
    let trainable: Vec<(ValueId, String)> = params
        .iter()
        .zip(&grad_values)
        .map(|(p, g)| (*p, model.name(*g).to_string()))
        .collect();
    shapes::declare(model, &shapes);

    // Interface: parameters become inputs backed by their initializers; outputs are the loss
    // and the gradients (which keeps them alive until a later pass consumes them).
    for (p, _) in &trainable {
        model.promote_initializer_to_input(*p);
    }
    while !model.main().outputs.is_empty() {
        model.remove_output(main, 0);
    }
    let loss_ty = crate::ir::tensor_type(loss_elem, &loss_dims);
    model.add_output(main, loss, Some(loss_ty));
    for ((p, _), g) in trainable.iter().zip(&grad_values) {
        let t = model
            .initializer(*p)
            .map(|t| crate::ir::tensor_type(t.data_type(), &t.dims));
        model.add_output(main, *g, t);
    }

    // Lower the gradient ops of ORT's vocabulary right away: what the pass writes is
    // standard ONNX (BatchNormInternal waits for legalize-ort: its statistics become state
    // in the window grad-accum makes).
    lower_gradient_ops(model)?;
    super::dce::eliminate_dead_code(model);
    if !options.grads_as_outputs {
        while model.main().outputs.len() > 1 {
            model.remove_output(main, 1);
        }
    }

    let trainable_params = trainable
        .iter()
        .map(|(p, g)| param_of(model, *p, true, Some(g.clone())))
        .collect();
    let frozen = normalized
        .bn_stats
        .iter()
        .map(|v| param_of(model, *v, false, None))
        .collect();
    Ok(Differentiated {
        loss: loss_name,
        seed: seed_name,
        labels: labels.map(|l| model.name(l).to_string()),
        trainable: trainable_params,
        frozen,
        absent_torch_parameters,
        tf2onnx_constants: tf2onnx_constants
            .iter()
            .map(|v| model.name(*v).to_string())
            .collect(),
        batch_norms: normalized.batch_norms,
        unrolled_loops: normalized.loops,
        kept_loops,
        decided_ifs: normalized.ifs,
        kept_ifs,
        scans: normalized.scans,
        half_masters,
        half_inputs,
    })
}

/// Whether a node passes gradients (not a shape computation, comparison, ...).
fn differentiable(model: &Model, n: NodeId) -> bool {
    let p = &model.node(n).proto;
    let plain = p.domain().is_empty() || p.domain() == "ai.onnx";
    !(plain && rules::is_non_differentiable(p.op_type()))
}

/// Values the `roots` depend on differentiably in `body` (not through shape computations,
/// comparisons or integer tensors); what a node's subgraphs read counts as its input.
fn differentiable_ancestors(
    model: &Model,
    shapes: &Shapes,
    body: BodyId,
    roots: &[ValueId],
) -> HashSet<ValueId> {
    let order = topological_order(model, body);
    let mut needed: HashSet<ValueId> = roots.iter().copied().collect();
    for &n in order.iter().rev() {
        let node = model.node(n);
        let reaches = node
            .outputs
            .iter()
            .flatten()
            .any(|v| needed.contains(v) && shapes.get(*v).elem.map(is_float).unwrap_or(true));
        if reaches && differentiable(model, n) {
            let op = node.proto.op_type();
            needed.extend(
                node.inputs
                    .iter()
                    .enumerate()
                    .filter(|(slot, _)| rules::carries_gradient(op, *slot))
                    .filter_map(|(_, v)| *v),
            );
            for sub in &node.subgraphs {
                needed.extend(model.captures(sub.body));
            }
        }
    }
    needed
}

/// The reverse sweep: the gradient of `y` (seeded with `seed`, dL/dy) with respect to each
/// of `params`, each named `<param>_grad` where that name is free. Gradient ops of ORT's
/// vocabulary are left for the caller to lower.
pub fn backward(
    model: &mut Model,
    shapes: &mut Shapes,
    loss: ValueId,
    seed_tensor: ValueId,
    params: &[ValueId],
) -> Result<Vec<ValueId>, PassError> {
    let main = BodyId::MAIN;
    let mut cx = Grad::new(Builder::new(model, main, PASS), shapes);
    let sums = sweep(&mut cx, &[(loss, seed_tensor)], params)?;

    // Parameter gradients, named p_grad.
    let mut grad_values = Vec::new();
    for (p, g) in params.iter().zip(sums) {
        let Some(g) = g else {
            return Err(fail(format!(
                "parameter '{}' got no gradient",
                cx.model().name(*p)
            )));
        };
        // A gradient that is a graph input or initializer itself (never in practice) or
        // shared with another parameter gets its own named copy.
        let g = if !matches!(cx.model().value(g).def, ValueDef::Node { .. })
            || grad_values.contains(&g)
        {
            let hint = format!("{}_grad", cx.model().name(*p));
            cx.op("Identity", &[g], vec![], &hint)
        } else {
            g
        };
        // `p_grad` may already name an intermediate of some rule: that value takes g's name.
        let name = format!("{}_grad", cx.model().name(*p));
        match cx.model().lookup(main, &name) {
            Some(holder) if holder != g => cx.b.model.swap_names(holder, g),
            Some(_) => {}
            None => cx.b.model.rename(g, &name),
        }
        grad_values.push(g);
    }
    Ok(grad_values)
}

/// The gradient of a node holding a body (`loop_grad`, `if_grad`): the contributions to
/// the values it reads, its body's captures included, as (value, contribution) pairs.
type ControlFlowRule = fn(
    &mut Grad<'_>,
    NodeId,
    &[Option<ValueId>],
    &dyn Fn(ValueId) -> bool,
) -> Result<Vec<(ValueId, ValueId)>, PassError>;

/// The reverse sweep over the body `cx` builds in: from `seeds` (a value and its gradient),
/// the gradient of each of `targets` (values of that body or of an enclosing one), the sum of
/// its contributions, or `None` where none reaches it.
pub(crate) fn sweep(
    cx: &mut Grad<'_>,
    seeds: &[(ValueId, ValueId)],
    targets: &[ValueId],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let body = cx.b.body;
    let order = topological_order(cx.model(), body);
    let roots: Vec<ValueId> = seeds.iter().map(|(v, _)| *v).collect();
    let needed = differentiable_ancestors(cx.model(), cx.shapes, body, &roots);
    // Values that depend on a target, each with one target it depends on (for errors).
    let mut origin: HashMap<ValueId, ValueId> = targets.iter().map(|p| (*p, *p)).collect();
    for &n in &order {
        let model = cx.model();
        let node = model.node(n);
        let op = node.proto.op_type();
        let captured = node.subgraphs.iter().flat_map(|s| model.captures(s.body));
        let Some(from) = node
            .inputs
            .iter()
            .enumerate()
            .filter(|(slot, _)| rules::carries_gradient(op, *slot))
            .filter_map(|(_, v)| *v)
            .chain(captured)
            .find_map(|v| origin.get(&v).copied())
        else {
            continue;
        };
        if !differentiable(model, n) {
            continue;
        }
        for out in node.outputs.iter().flatten() {
            let float = cx.shapes.get(*out).elem.map(is_float).unwrap_or(true);
            if float && needed.contains(out) {
                origin.insert(*out, from);
            }
        }
    }
    let reached = |model: &Model, n: NodeId, origin: &HashMap<ValueId, ValueId>| {
        let node = model.node(n);
        let op = node.proto.op_type();
        let by_input = node.inputs.iter().enumerate().any(|(slot, v)| {
            rules::carries_gradient(op, slot) && v.is_some_and(|v| origin.contains_key(&v))
        });
        by_input
            || node.subgraphs.iter().any(|s| {
                model
                    .captures(s.body)
                    .iter()
                    .any(|v| origin.contains_key(v))
            })
    };

    // Every op the gradient must pass has a rule, checked before the sweep: the error then
    // names the op that stops it, not a later rule's missing shape facts.
    for &n in &order {
        let model = cx.model();
        let feeds_loss = model
            .node(n)
            .outputs
            .iter()
            .flatten()
            .any(|v| needed.contains(v));
        if reached(model, n, &origin) && feeds_loss && differentiable(model, n) {
            check_rule(model, n, &origin)?;
        }
    }

    // The sweep.
    let mut contributions: HashMap<ValueId, Vec<ValueId>> = HashMap::new();
    for (v, g) in seeds {
        contributions.entry(*v).or_default().push(*g);
    }
    for &n in order.iter().rev() {
        let node = cx.model().node(n);
        let outputs: Vec<Option<ValueId>> = node.outputs.clone();
        let inputs: Vec<Option<ValueId>> = node.inputs.clone();
        let op = node.proto.op_type().to_string();
        if !outputs
            .iter()
            .flatten()
            .any(|v| contributions.contains_key(v))
        {
            continue;
        }
        if !reached(cx.model(), n, &origin) || !differentiable(cx.model(), n) {
            continue;
        }
        let dys: Vec<Option<ValueId>> = outputs
            .iter()
            .map(|o| o.and_then(|v| sum_contributions(cx, v, contributions.remove(&v))))
            .collect();
        let control_flow = match (
            loop_parts::is_loop(cx.model(), n),
            if_grad::is_if(cx.model(), n),
        ) {
            (true, _) => Some(loop_grad::gradients as ControlFlowRule),
            (false, true) => Some(if_grad::gradients as ControlFlowRule),
            (false, false) => None,
        };
        if let Some(gradients) = control_flow {
            let grads = gradients(cx, n, &dys, &|v| origin.contains_key(&v))?;
            for (input, g) in grads {
                contributions.entry(input).or_default().push(g);
            }
            continue;
        }
        let wants: Vec<bool> = inputs
            .iter()
            .enumerate()
            .map(|(slot, i)| {
                rules::carries_gradient(&op, slot) && i.is_some_and(|v| origin.contains_key(&v))
            })
            .collect();
        let rule = check_rule(cx.model(), n, &origin)?
            .ok_or_else(|| cx.error(n, "internal: no gradient rule".into()))?;
        let grads = rule(cx, n, &dys, &wants)?;
        // A rule's gradient has its input's shape and type.
        for (slot, g) in grads.iter().enumerate() {
            if let (Some(g), Some(Some(x))) = (g, inputs.get(slot)) {
                if cx.facts(*g) == shapes::Facts::default() {
                    let f = cx.facts(*x);
                    cx.shapes.set(*g, f);
                }
            }
        }
        for (slot, g) in grads.into_iter().enumerate() {
            let (Some(g), true) = (g, wants.get(slot).copied().unwrap_or(false)) else {
                continue;
            };
            let Some(input) = cx.model().node(n).inputs[slot] else {
                continue;
            };
            contributions.entry(input).or_default().push(g);
        }
    }

    Ok(targets
        .iter()
        .map(|t| sum_contributions(cx, *t, contributions.remove(t)))
        .collect())
}

/// The sum of a value's gradient contributions (one Add per extra contribution, in the
/// order the sweep made them).
fn sum_contributions(
    cx: &mut Grad<'_>,
    v: ValueId,
    parts: Option<Vec<ValueId>>,
) -> Option<ValueId> {
    let parts = parts?;
    let mut iter = parts.into_iter();
    let first = iter.next()?;
    let hint = format!("{}_grad", cx.model().name(v));
    Some(iter.fold(first, |acc, g| {
        cx.op_like("Add", &[acc, g], vec![], &hint, v)
    }))
}

/// Runs legalize-ort's lowerings over the gradient ops the rules emitted (everything but
/// BatchNormInternal, whose running statistics need the window).
pub fn lower_gradient_ops(model: &mut Model) -> Result<(), PassError> {
    let pending: Vec<NodeId> = model
        .all_nodes()
        .filter(|n| {
            let p = &model.node(*n).proto;
            crate::ops::is_training_only(p.domain(), p.op_type())
                && p.op_type() != "BatchNormInternal"
        })
        .collect();
    if pending.is_empty() {
        return Ok(());
    }
    let mut state = Vec::new();
    super::legalize::LegalizeOrt::default()
        .lower_nodes(model, PASS, &mut state, None, &pending)
        .map(|_| ())
}
