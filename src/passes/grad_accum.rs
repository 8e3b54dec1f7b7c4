//! `grad-accum(steps=K, normalize=mean|sum|weighted[=INPUT], apply=if|where)`: turns a
//! gradient graph into one micro-step of a K-micro-step window.
//!
//! Per micro-step i of a window (state in brackets):
//!
//! ```text
//! count     = [micro_step] + 1
//! acc_p'    = [acc_p] + w_i * g_p           (w_i = 1 unless weighted)
//! wsum'     = [weight_sum] + w_i            (weighted only)
//! apply     = count >= K  or  flush
//! if apply:  G_p = acc_p' / denom           (mean: count, weighted: wsum', sum: 1)
//!            optimizer(p, G_p) ... ; acc_p, micro_step, weight_sum <- 0 ; opt_step += 1
//! else:      acc_p <- acc_p' ; micro_step <- count ; everything else unchanged
//! ```
//!
//! `mean` divides by the micro-steps actually accumulated, so a window flushed early is
//! still an average. `weighted` makes uneven micro-batches and ignored labels exact: with a
//! mean-reduced loss, w_i * g_i is the micro-batch's *sum* gradient, and dividing by the
//! window's total weight gives the gradient of the whole window's mean loss.
//!
//! ONNX Runtime's own accumulation machinery (InPlaceAccumulatorV2, its buffers and
//! `lazy_reset_grad`) is removed: the accumulators here replace it.

use super::window::{ApplyMode, StateDecl, Trigger, Window};
use super::{BnStats, Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, attr_tensor, tensor_f32, Builder, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, Model, ValueId};
use crate::proto::tensor_proto::DataType;
use crate::state::Role;

pub const PASS: &str = "grad-accum";

#[derive(Clone, Debug, PartialEq)]
pub enum Normalize {
    Mean,
    Sum,
    /// Weighted by a data input (`Some(name)`), or by the count of non-ignored labels of
    /// the mean-reduced SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss that produces the
    /// loss (`None`).
    Weighted(Option<String>),
}

impl Normalize {
    /// The text of grad-accum's `normalize=` option.
    pub fn text(&self) -> String {
        match self {
            Normalize::Mean => "mean".to_string(),
            Normalize::Sum => "sum".to_string(),
            Normalize::Weighted(None) => "weighted".to_string(),
            Normalize::Weighted(Some(input)) => format!("weighted:{input}"),
        }
    }
}

impl std::str::FromStr for Normalize {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "mean" => Ok(Normalize::Mean),
            "sum" => Ok(Normalize::Sum),
            "weighted" => Ok(Normalize::Weighted(None)),
            other => match other.strip_prefix("weighted:") {
                Some(input) => Ok(Normalize::Weighted(Some(input.to_string()))),
                None => Err(format!(
                    "normalize={other}: expected mean, sum, weighted or weighted:INPUT"
                )),
            },
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct GradAccum {
    pub steps: i64,
    pub normalize: Normalize,
    pub apply: ApplyMode,
    /// When BatchNorm running statistics move (lowered by legalize-ort after this pass).
    pub bn_stats: BnStats,
}

/// The pass's defaults: K = 1, mean, an `If`, statistics per window.
impl Default for GradAccum {
    fn default() -> Self {
        GradAccum {
            steps: 1,
            normalize: Normalize::Mean,
            apply: ApplyMode::If,
            bn_stats: BnStats::Window,
        }
    }
}

impl GradAccum {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&["steps", "normalize", "apply", "bn_stats"])?;
        let spec_error = |message: String| PassError::Spec {
            spec: PASS.into(),
            message,
        };
        let default = GradAccum::default();
        let steps: i64 = options.parse("steps")?.unwrap_or(default.steps);
        if steps < 1 {
            return Err(spec_error(format!("steps={steps}: must be at least 1")));
        }
        let word = |key: &str, default: &'static str| options.get(key).unwrap_or(default);
        Ok(GradAccum {
            steps,
            normalize: word("normalize", "mean").parse().map_err(spec_error)?,
            apply: word("apply", default.apply.as_str())
                .parse()
                .map_err(spec_error)?,
            bn_stats: word("bn_stats", default.bn_stats.as_str())
                .parse()
                .map_err(spec_error)?,
        })
    }

    /// The options as spec text: every one but `bn_stats=window` (the pass's own spec,
    /// recorded in a step), or with `changed_only` just those that differ from the
    /// defaults (a [`super::plan::StepPlan`]'s, so that the recipe tells the defaults
    /// apart).
    pub fn options_text(&self, changed_only: bool) -> Vec<String> {
        let default = GradAccum::default();
        let mut options = Vec::new();
        if !changed_only || self.steps != default.steps {
            options.push(format!("steps={}", self.steps));
        }
        if !changed_only || self.normalize != default.normalize {
            options.push(format!("normalize={}", self.normalize.text()));
        }
        if !changed_only || self.apply != default.apply {
            options.push(format!("apply={}", self.apply.as_str()));
        }
        // bn_stats=window is the default and stays implicit either way.
        if self.bn_stats != default.bn_stats {
            options.push(format!("bn_stats={}", self.bn_stats.as_str()));
        }
        options
    }
}

fn fail(message: String) -> PassError {
    PassError::Other {
        pass: PASS.into(),
        message,
    }
}

impl GradAccum {
    /// The resolved settings (the pipeline marks those the spec gave).
    fn recipe(&self) -> crate::recipe::Section {
        use crate::recipe::Origin::Default;
        let mut s = crate::recipe::Section::new(PASS);
        s.set("steps", self.steps, Default);
        let normalize = self.normalize.text();
        s.set("normalize", normalize, Default);
        match &self.normalize {
            Normalize::Mean => s.note(
                "normalize",
                "the window's gradient sum over its micro-steps",
            ),
            Normalize::Sum => s.note("normalize", "the window's gradient sum, not divided"),
            Normalize::Weighted(None) => s.note(
                "normalize",
                "weights: the count of non-ignored labels of the loss",
            ),
            Normalize::Weighted(Some(input)) => {
                s.note("normalize", format!("weights: data input '{input}'"))
            }
        }
        s.set("apply", self.apply.as_str(), Default);
        s.set("bn_stats", self.bn_stats.as_str(), Default);
        s
    }
}

impl Pass for GradAccum {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Accumulate
    }

    fn spec(&self) -> String {
        super::spec_text(PASS, &self.options_text(false))
    }

    /// The window is open, with the parameters it updates.
    fn ensures(&self, _model: &Model, cx: &PassContext<'_>) -> Result<(), PassError> {
        match cx.window() {
            Some(w) if !w.params().is_empty() => Ok(()),
            Some(_) => Err(super::broken(PASS, "the window has no parameter".into())),
            None => Err(super::broken(PASS, "no apply region opened".into())),
        }
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        if let crate::signature::Source::Step { file, pipeline, .. } = &cx.signature.source {
            return Err(fail(format!(
                "{} is already a training step written by onnx-ga rewrite (pipeline: {pipeline}): train it (onnx-ga train {0} --data ...), or rewrite the training graph it was made from (an artifacts folder, a training graph or a forward model)",
                file.display()
            )));
        }
        if cx.window().is_some() {
            return Err(fail(
                "the graph already has an apply region (grad-accum runs once)".into(),
            ));
        }
        cx.recipe.push(self.recipe());
        if cx.state.iter().any(|s| s.role == Role::Accumulator) {
            return Err(fail(
                "ORT's accumulators were already legalized; run grad-accum before legalize-ort"
                    .into(),
            ));
        }
        let nodes_before = model.all_nodes().count();
        let removed = remove_ort_accumulation(model, cx)?;
        let main = BodyId::MAIN;

        let trainable: Vec<(String, String, i32, Vec<i64>)> = cx
            .signature
            .trainable()
            .map(|p| {
                (
                    p.name.clone(),
                    p.grad.clone().unwrap_or_default(),
                    p.elem_type,
                    p.dims.clone(),
                )
            })
            .collect();
        if trainable.is_empty() {
            return Err(fail(
                "the training signature has no trainable parameters".into(),
            ));
        }

        // Control inputs a host may change between windows, the counters, the apply flag.
        let trigger = Trigger::new(model, self.steps);
        let count = trigger.count();
        let weight = match &self.normalize {
            Normalize::Weighted(source) => Some(micro_batch_weight(model, cx, source.as_deref())?),
            _ => None,
        };

        let window_error = |e: super::window::WindowError| e.in_pass(PASS);
        let mut window =
            Window::open(model, self.apply, trigger, &mut cx.state).map_err(window_error)?;

        let denominator = match &self.normalize {
            Normalize::Mean => Some(window.builder(model, PASS).op(
                "Cast",
                &[count],
                vec![attr_int("to", DataType::Float as i64)],
                "ga.micro_steps_f",
            )),
            Normalize::Sum => None,
            Normalize::Weighted(_) => {
                let weight = weight.expect("weighted has a weight");
                let (slot, new_sum) = window.declare_running(
                    model,
                    &mut cx.state,
                    StateDecl::new("ga.weight_sum", tensor_f32(&[], &[0.0]), Role::WeightSum),
                    |model, weight_sum| {
                        Builder::new(model, main, PASS).op(
                            "Add",
                            &[weight_sum, weight],
                            vec![],
                            "ga.weight_sum_new",
                        )
                    },
                );
                let zero = window
                    .builder(model, PASS)
                    .scalar_f32("ga.zero_weight", 0.0);
                window.set_next(model, slot, zero).map_err(window_error)?;
                Some(new_sum)
            }
        };

        for (name, grad_name, elem_type, dims) in trainable {
            let param = model
                .lookup(main, &name)
                .ok_or_else(|| fail(format!("parameter '{name}' is not a value of the graph")))?;
            let grad = model.lookup(main, &grad_name).ok_or_else(|| {
                fail(format!(
                    "gradient '{grad_name}' of parameter '{name}' is not a value of the graph"
                ))
            })?;
            if elem_type != DataType::Float as i32 {
                return Err(fail(format!(
                    "parameter '{name}' is not float32; fp32 master parameters are required"
                )));
            }
            let zeros = tensor_f32(
                &dims,
                &vec![0.0; dims.iter().product::<i64>().max(0) as usize],
            );
            let acc_name = format!("ga.acc.{name}");
            let (acc_slot, acc_new) = window.declare_running(
                model,
                &mut cx.state,
                StateDecl::new(&acc_name, zeros, Role::Accumulator).of(&name),
                |model, acc| {
                    let contribution = match weight {
                        Some(w) => Builder::new(model, main, PASS).op(
                            "Mul",
                            &[grad, w],
                            vec![],
                            &format!("{name}.weighted_grad"),
                        ),
                        None => grad,
                    };
                    Builder::new(model, main, PASS).op(
                        "Add",
                        &[acc, contribution],
                        vec![],
                        &format!("ga.acc.{name}.sum"),
                    )
                },
            );
            let mut b = window.builder(model, PASS);
            let shape = b.ints(&format!("ga.shape.{name}"), &dims);
            let zeroed = b.op(
                "ConstantOfShape",
                &[shape],
                vec![attr_tensor("value", tensor_f32(&[1], &[0.0]))],
                &format!("ga.acc.{name}.zero"),
            );
            let normalized = match denominator {
                Some(d) => b.op("Div", &[acc_new, d], vec![], &format!("{name}.window_grad")),
                None => acc_new,
            };
            window
                .set_next(model, acc_slot, zeroed)
                .map_err(window_error)?;
            window.add_param(
                model,
                &mut cx.state,
                name,
                param,
                normalized,
                elem_type,
                dims,
            );
        }

        // The `applied` metric is the apply flag itself (until loss-scale narrows it).
        window.publish_applied(model);

        let added = model.all_nodes().count() + removed - nodes_before;
        cx.open_window(window, self.bn_stats);
        Ok(PassReport {
            changed: true,
            added,
            removed,
            notes: vec![format!("{} state pairs", cx.state.len())],
        })
    }
}

/// Removes ORT's accumulation buffers, their InPlaceAccumulatorV2 nodes and flag outputs,
/// and `lazy_reset_grad`. Returns the number of nodes removed.
fn remove_ort_accumulation(
    model: &mut Model,
    cx: &mut PassContext<'_>,
) -> Result<usize, PassError> {
    let main = BodyId::MAIN;
    let mut removed = 0;
    let accumulations: Vec<_> = cx
        .signature
        .params
        .iter()
        .filter_map(|p| p.accumulation.clone())
        .collect();
    for acc in &accumulations {
        if let Some(index) = model
            .main()
            .outputs
            .iter()
            .position(|(v, _)| model.name(*v) == acc.flag_output)
        {
            model.remove_output(main, index);
        }
        let node = model
            .all_nodes()
            .find(|n| model.node(*n).proto.name() == acc.node);
        if let Some(node) = node {
            model
                .remove_node(node)
                .map_err(|e| fail(format!("cannot remove ORT accumulator '{}': {e}", acc.node)))?;
            removed += 1;
        }
        if let Some(buffer) = model.lookup(main, &acc.buffer_input) {
            model
                .remove_input(buffer)
                .map_err(|e| fail(format!("ORT buffer '{}': {e}", acc.buffer_input)))?;
        }
    }
    if let Some(reset) = cx.signature.lazy_reset_grad.clone() {
        if let Some(v) = model.lookup(main, &reset) {
            model
                .remove_input(v)
                .map_err(|e| fail(format!("'{reset}': {e}")))?;
        }
    }
    for p in &mut cx.signature.params {
        p.accumulation = None;
    }
    cx.signature.lazy_reset_grad = None;
    Ok(removed)
}

/// The weight w_i of this micro-batch, as a float32 scalar in the main graph.
fn micro_batch_weight(
    model: &mut Model,
    cx: &mut PassContext<'_>,
    source: Option<&str>,
) -> Result<ValueId, PassError> {
    let main = BodyId::MAIN;
    if let Some(input) = source {
        let v = model.lookup(main, input).ok_or_else(|| {
            fail(format!(
                "weight input '{input}' is not a value of the graph"
            ))
        })?;
        let mut b = Builder::new(model, main, PASS);
        let f = b.op(
            "Cast",
            &[v],
            vec![attr_int("to", DataType::Float as i64)],
            "ga.weight_f",
        );
        return Ok(b.op(
            "ReduceSum",
            &[f],
            vec![attr_int("keepdims", 0)],
            "ga.weight",
        ));
    }
    // The count of labels that the mean-reduced loss averages over (SoftmaxCrossEntropyLoss
    // and NegativeLogLikelihoodLoss weigh their labels alike: inputs labels, class weights).
    let loss = cx.signature.loss.clone();
    let loss_value = model
        .lookup(main, &loss)
        .ok_or_else(|| fail(format!("loss '{loss}' not found")))?;
    let Some((node, 0)) = model.producer(loss_value) else {
        return Err(fail(format!("normalize=weighted without an input needs the loss '{loss}' to be output 0 of a SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss; name a weight input instead (normalize=weighted:INPUT)")));
    };
    let proto = model.node(node).proto.clone();
    let op = proto.op_type().to_string();
    if !matches!(
        op.as_str(),
        "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss"
    ) {
        return Err(fail(format!(
            "normalize=weighted without an input counts labels of a SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss, but the loss comes from {} ('{}'); name a weight input (normalize=weighted:INPUT)",
            proto.op_type(),
            proto.name()
        )));
    }
    let reduction = proto
        .attr_string("reduction")
        .map_err(fail)?
        .unwrap_or_else(|| "mean".into());
    if reduction != "mean" {
        return Err(fail(format!(
            "{op} '{}' has reduction={reduction}; in-graph weights need mean",
            proto.name()
        )));
    }
    let labels = model.node(node).inputs[1].ok_or_else(|| fail(format!("{op} without labels")))?;
    let class_weights = model.node(node).inputs.get(2).copied().flatten();
    let ignore_index = proto.attr_int("ignore_index").map_err(fail)?;
    // The label constants take the labels' type: int64, or int32 (which the loss accepts
    // too; an int64 constant beside int32 labels would not type-check).
    let label_elem = match model.value_type(labels).and_then(|t| t.tensor_elem()) {
        Some(e) if e == DataType::Int32 as i32 => e,
        _ => DataType::Int64 as i32,
    };
    let label_scalar = |b: &mut Builder<'_>, hint: &str, value: i64| {
        let t = crate::proto::TensorProto {
            data_type: Some(label_elem),
            raw_data: crate::ir::emit::scalar_bytes(label_elem, value as f64),
            ..Default::default()
        };
        b.constant(hint, t)
    };
    let mut b = Builder::new(model, main, PASS);
    // Whether each label is ignored: computed once, where it is first needed.
    let mut ignored: Option<ValueId> = None;
    let mut is_ignored = |b: &mut Builder<'_>, ii: i64| {
        *ignored.get_or_insert_with(|| {
            let ignore = label_scalar(b, "ga.ignore_index", ii);
            b.equal(labels, ignore, "ga.label_is_ignored")
        })
    };
    // Per-label weight: the class weight of the label (1 without weights), 0 when ignored.
    let mut per_label = match class_weights {
        Some(w) => {
            // Gather needs a valid index even for ignored labels: clamp them to 0 first.
            let safe = match ignore_index {
                Some(ii) => {
                    let ignored = is_ignored(&mut b, ii);
                    let zero = label_scalar(&mut b, "ga.zero_label", 0);
                    b.select(ignored, zero, labels, "ga.safe_labels")
                }
                None => labels,
            };
            b.op("Gather", &[w, safe], vec![], "ga.label_weight")
        }
        None => {
            let shape = b.op("Shape", &[labels], vec![], "ga.labels_shape");
            b.op(
                "ConstantOfShape",
                &[shape],
                vec![attr_tensor("value", tensor_f32(&[1], &[1.0]))],
                "ga.label_one",
            )
        }
    };
    if let Some(ii) = ignore_index {
        let ignored = is_ignored(&mut b, ii);
        let zero = b.scalar_f32("ga.zero_weight_f", 0.0);
        per_label = b.select(ignored, zero, per_label, "ga.label_weight_kept");
    }
    Ok(b.op(
        "ReduceSum",
        &[per_label],
        vec![attr_int("keepdims", 0)],
        "ga.weight",
    ))
}
