//! `legalize-ort`: lowers the ops that only ONNX Runtime's training build has to standard
//! ONNX ops, so any maintained runtime runs ORT's training graphs. One file per op; each
//! lowering reads like the op's math.
//!
//! Contract of a lowering: it emits standard nodes computing every used output of the node,
//! moves the uses there ([`Lowering::replace`]) and leaves the node itself to this module,
//! which removes it. An attribute value it does not implement is an error naming the node,
//! the op and the attribute; a silently wrong graph is never an option.

mod adamw_optimizer;
mod batch_norm_grad;
mod batch_norm_internal;
mod batch_normalization;
mod conv_grad;
mod cumsum_integer;
mod div_grad;
mod dropout_draw;
mod dropout_grad;
mod fast_gelu_grad;
mod fused_matmul;
mod gather_grad;
mod gelu;
mod gelu_grad;
mod gemm_half;
pub mod half_in_float32;
mod in_place_accumulator;
mod layer_norm_grad;
mod leaky_relu_grad;
mod log_softmax_grad;
pub mod loop_as_scan;
mod max_pool_grad;
mod max_unpool;
mod quick_gelu_grad;
mod relu_grad;
mod reverse_sequence;
mod scale;
mod sgd_optimizer;
mod sigmoid_grad;
mod softmax_cross_entropy_loss;
mod softmax_cross_entropy_loss_grad;
mod softmax_grad;
mod tanh_grad;
mod util;
pub mod while_as_counted;

/// Optimizer updates for per-parameter tensors (the optimizer pass lowers ORT's
/// optimizer_model.onnx, whose sequences are graph inputs, with these).
pub use adamw_optimizer::{lower_adamw_for_params, AdamW, AdamWNext, AdamWSlots};
pub use sgd_optimizer::lower_sgd_for_params;

use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{Builder, NodeAttributes};
use crate::ir::{Model, NodeId, ValueId};

pub const PASS: &str = "legalize-ort";

/// The lowerings `lower-for-tract` adds to these, by the nodes they take: float16 `Gemm`
/// (tract mixes float32 constants into its own expansion), integer `CumSum` (tract cannot
/// sum the symbolic dims it folds shapes into), `ReverseSequence` (tract has none) and a
/// Dropout that drops (tract runs only the inference form).
pub const TRACT_LOWERINGS: &[(TakesFn, LowerFn)] = &[
    (gemm_half::is_half_gemm, gemm_half::lower),
    (cumsum_integer::is_integer_cumsum, cumsum_integer::lower),
    (
        reverse_sequence::is_reverse_sequence,
        reverse_sequence::lower,
    ),
    (dropout_draw::is_drawing_dropout, dropout_draw::lower),
];

/// Lowers every node of `model` (its subgraphs included) that one of [`TRACT_LOWERINGS`]
/// takes; new nodes are stamped with `stamp`.
pub fn lower_for_tract(model: &mut Model, stamp: &'static str) -> Result<PassReport, PassError> {
    let mut report = PassReport::default();
    // While loops that count to a bound as counted Loops, then counted Loops as Scans
    // (tract has no Loop), in that order.
    type Rewrite = fn(&mut Model, NodeId, &'static str) -> Result<usize, PassError>;
    let loop_rewrites: [(TakesFn, Rewrite); 2] = [
        (while_as_counted::takes, while_as_counted::rewrite),
        (loop_as_scan::takes, loop_as_scan::rewrite),
    ];
    for (takes, rewrite) in loop_rewrites {
        let targets: Vec<NodeId> = model.all_nodes().filter(|n| takes(model, *n)).collect();
        for node in targets {
            report.added += rewrite(model, node, stamp)?;
            report.changed = true;
        }
    }
    let mut constants = util::Constants::default();
    let mut state = Vec::new();
    for (takes, lower) in TRACT_LOWERINGS {
        let targets: Vec<NodeId> = model.all_nodes().filter(|n| takes(model, *n)).collect();
        for node in targets {
            let mut lowering = Lowering {
                b: Builder::new(model, model.node(node).body, stamp),
                state: &mut state,
                constants: &mut constants,
                window: None,
                running_var: super::RunningVar::Biased,
            };
            lower_and_remove(&mut lowering, *lower, node, &mut report)?;
        }
    }
    Ok(report)
}

/// Runs `lower` on `node`, then removes the node (the contract in the module docs), and
/// counts both in `report`.
fn lower_and_remove(
    lowering: &mut Lowering<'_, '_>,
    lower: LowerFn,
    node: NodeId,
    report: &mut PassReport,
) -> Result<(), PassError> {
    lower(lowering, node)?;
    report.added += lowering.b.added;
    let model = &mut *lowering.b.model;
    model
        .remove_node(node)
        .map_err(|e| node_error(model, node, format!("lowering left an output in use: {e}")))?;
    report.removed += 1;
    report.changed = true;
    Ok(())
}

type LowerFn = fn(&mut Lowering<'_, '_>, NodeId) -> Result<(), PassError>;

/// Whether a lowering takes a node.
type TakesFn = fn(&Model, NodeId) -> bool;

/// (domain, op_type, lowering). ORT registers MaxPoolGrad in the default domain.
const LOWERINGS: &[(&str, &str, LowerFn)] = &[
    (
        "com.microsoft",
        "InPlaceAccumulatorV2",
        in_place_accumulator::lower,
    ),
    ("com.microsoft", "ReluGrad", relu_grad::lower),
    ("com.microsoft", "SigmoidGrad", sigmoid_grad::lower),
    ("com.microsoft", "GeluGrad", gelu_grad::lower),
    ("com.microsoft", "SoftmaxGrad_13", softmax_grad::lower),
    ("com.microsoft", "Scale", scale::lower),
    (
        "com.microsoft",
        "SoftmaxCrossEntropyLossGrad",
        softmax_cross_entropy_loss_grad::lower,
    ),
    ("", "MaxPoolGrad", max_pool_grad::lower),
    ("com.microsoft", "ConvGrad", conv_grad::lower),
    (
        "com.microsoft",
        "BatchNormInternal",
        batch_norm_internal::lower,
    ),
    (
        "com.microsoft",
        "BatchNormalizationGrad",
        batch_norm_grad::lower,
    ),
    (
        "com.microsoft",
        "LayerNormalizationGrad",
        layer_norm_grad::lower,
    ),
    ("com.microsoft", "AdamWOptimizer", adamw_optimizer::lower),
    ("com.microsoft", "SGDOptimizerV2", sgd_optimizer::lower),
    // Beyond the ops of our generated graphs: what ORT's gradient builder emits for other
    // common forward ops (docs/legalize-ops.md has the full list with its status).
    ("com.microsoft", "TanhGrad", tanh_grad::lower),
    ("com.microsoft", "LeakyReluGrad", leaky_relu_grad::lower),
    ("com.microsoft", "BiasGeluGrad_dX", gelu_grad::lower_bias),
    ("com.microsoft", "FastGeluGrad", fast_gelu_grad::lower),
    (
        "com.microsoft",
        "BiasFastGeluGrad_dX",
        fast_gelu_grad::lower_bias,
    ),
    ("com.microsoft", "QuickGeluGrad", quick_gelu_grad::lower),
    ("com.microsoft", "SoftmaxGrad", softmax_grad::lower_v1),
    (
        "com.microsoft",
        "LogSoftmaxGrad",
        log_softmax_grad::lower_v1,
    ),
    (
        "com.microsoft",
        "LogSoftmaxGrad_13",
        log_softmax_grad::lower,
    ),
    ("com.microsoft", "DropoutGrad", dropout_grad::lower),
    ("com.microsoft", "GatherGrad", gather_grad::lower),
    (
        "com.microsoft",
        "GatherElementsGrad",
        gather_grad::lower_elements,
    ),
    ("com.microsoft", "GatherNDGrad", gather_grad::lower_nd),
    ("com.microsoft", "DivGrad", div_grad::lower),
    (
        "com.microsoft",
        "SimplifiedLayerNormalizationGrad",
        layer_norm_grad::lower_simplified,
    ),
];

/// Ops standard ONNX Runtime has but other engines lack; lowered only when asked.
const OPTIONAL_LOWERINGS: &[(&str, &str, &str, LowerFn)] = &[
    (
        "fused-matmul",
        "com.microsoft",
        "FusedMatMul",
        fused_matmul::lower,
    ),
    ("gelu", "com.microsoft", "Gelu", gelu::lower),
    (
        "batch-norm",
        "",
        "BatchNormalization",
        batch_normalization::lower,
    ),
    (
        "sce",
        "",
        "SoftmaxCrossEntropyLoss",
        softmax_cross_entropy_loss::lower,
    ),
    (
        "nll",
        "",
        "NegativeLogLikelihoodLoss",
        softmax_cross_entropy_loss::lower_nll,
    ),
    ("max-unpool", "", "MaxUnpool", max_unpool::lower),
];

#[derive(Clone, Debug, Default)]
pub struct LegalizeOrt {
    /// Also lower com.microsoft FusedMatMul (standard ORT has it; tract does not).
    pub fused_matmul: bool,
    /// Also lower com.microsoft Gelu.
    pub gelu: bool,
    /// Also lower inference-mode BatchNormalization (standard; tract needs constant params).
    pub batch_norm: bool,
    /// Also lower the forward SoftmaxCrossEntropyLoss (standard ONNX; tract lacks it).
    pub sce: bool,
    /// Also lower the forward NegativeLogLikelihoodLoss (standard ONNX; tract lacks it).
    pub nll: bool,
    /// Also lower MaxUnpool (standard ONNX, what MaxPoolGrad becomes; tract lacks it).
    pub max_unpool: bool,
    /// The variance BatchNorm running variances move with (from the pass context, set by
    /// `autodiff`; not an option of the pass).
    pub running_var: super::RunningVar,
}

impl LegalizeOrt {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&[
            "fused-matmul",
            "gelu",
            "batch-norm",
            "sce",
            "nll",
            "max-unpool",
        ])?;
        Ok(LegalizeOrt {
            fused_matmul: options.parse("fused-matmul")?.unwrap_or(false),
            gelu: options.parse("gelu")?.unwrap_or(false),
            batch_norm: options.parse("batch-norm")?.unwrap_or(false),
            sce: options.parse("sce")?.unwrap_or(false),
            nll: options.parse("nll")?.unwrap_or(false),
            max_unpool: options.parse("max-unpool")?.unwrap_or(false),
            running_var: super::RunningVar::Biased,
        })
    }

    fn lowering_for(&self, domain: &str, op: &str) -> Option<LowerFn> {
        let domain = crate::ir::normalize_domain(domain);
        LOWERINGS
            .iter()
            .find(|(d, o, _)| *d == domain && *o == op)
            .map(|(_, _, f)| *f)
            .or_else(|| {
                OPTIONAL_LOWERINGS
                    .iter()
                    .filter(|(option, ..)| match *option {
                        "fused-matmul" => self.fused_matmul,
                        "gelu" => self.gelu,
                        "batch-norm" => self.batch_norm,
                        "sce" => self.sce,
                        "nll" => self.nll,
                        "max-unpool" => self.max_unpool,
                        _ => false,
                    })
                    .find(|(_, d, o, _)| *d == domain && *o == op)
                    .map(|(.., f)| *f)
            })
    }
}

impl Pass for LegalizeOrt {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Legalize
    }

    /// Nothing that only ONNX Runtime's training build runs is left.
    fn ensures(&self, model: &Model, _cx: &PassContext<'_>) -> Result<(), PassError> {
        let left = model.all_nodes().find(|&n| {
            let p = &model.node(n).proto;
            crate::ops::is_training_only(p.domain(), p.op_type())
        });
        match left {
            None => Ok(()),
            Some(n) => Err(crate::passes::broken(
                PASS,
                format!(
                    "training-only op {} ('{}') is left",
                    model.node(n).proto.op_type(),
                    model.node(n).proto.name()
                ),
            )),
        }
    }

    fn spec(&self) -> String {
        let mut options = Vec::new();
        if self.fused_matmul {
            options.push("fused-matmul=true");
        }
        if self.gelu {
            options.push("gelu=true");
        }
        if self.batch_norm {
            options.push("batch-norm=true");
        }
        if self.sce {
            options.push("sce=true");
        }
        if self.nll {
            options.push("nll=true");
        }
        if self.max_unpool {
            options.push("max-unpool=true");
        }
        crate::passes::spec_text(PASS, &options)
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        let lowerings = LegalizeOrt {
            running_var: cx.bn_running_var(),
            ..self.clone()
        };
        let (window, state) = cx.bn_window();
        lowerings.lower_model(model, PASS, state, window)
    }
}

impl LegalizeOrt {
    /// The pass's work, for passes that reuse these lowerings (`lower-for-tract`): new nodes
    /// are stamped with `stamp`; `state` receives state that a lowering makes explicit.
    pub fn lower_model(
        &self,
        model: &mut Model,
        stamp: &'static str,
        state: &mut Vec<crate::state::StateEntry>,
        window: Option<&mut crate::passes::window::Window>,
    ) -> Result<PassReport, PassError> {
        let targets: Vec<NodeId> = model.all_nodes().collect();
        self.lower_nodes(model, stamp, state, window, &targets)
    }

    /// [`lower_model`](Self::lower_model) restricted to `targets` (the autodiff lowers the
    /// gradient ops it emitted this way, before the window exists).
    pub fn lower_nodes(
        &self,
        model: &mut Model,
        stamp: &'static str,
        state: &mut Vec<crate::state::StateEntry>,
        mut window: Option<&mut crate::passes::window::Window>,
        targets: &[NodeId],
    ) -> Result<PassReport, PassError> {
        let mut report = PassReport::default();
        let targets = targets.to_vec();
        let mut constants = util::Constants::default();
        for node in targets {
            if half_in_float32::takes(model, node) {
                report.added += half_in_float32::widen(model, node, stamp);
                report.changed = true;
            }
            let proto = &model.node(node).proto;
            let (domain, op) = (proto.domain().to_string(), proto.op_type().to_string());
            let Some(lower) = self.lowering_for(&domain, &op) else {
                if crate::ops::is_training_only(&domain, &op)
                    || crate::ir::normalize_domain(&domain) == "com.microsoft"
                        && !crate::ops::is_standard_contrib(&op)
                {
                    return Err(node_error(
                        model,
                        node,
                        "no lowering to standard ONNX exists for this op".into(),
                    ));
                }
                continue;
            };
            let mut lowering = Lowering {
                b: Builder::new(model, model.node(node).body, stamp),
                state: &mut *state,
                constants: &mut constants,
                window: window.as_deref_mut(),
                running_var: self.running_var,
            };
            lower_and_remove(&mut lowering, lower, node, &mut report)?;
        }
        // A lowering can orphan producers (e.g. a flag nobody reads); drop what is dead.
        report.removed += super::dce::eliminate_dead_code(model);
        drop_unused_opsets(model);
        Ok(report)
    }
}

/// Declares only the opset domains still used (the main domain always stays).
fn drop_unused_opsets(model: &mut Model) {
    let used: std::collections::HashSet<String> = model
        .all_nodes()
        .map(|n| crate::ir::normalize_domain(model.node(n).proto.domain()).to_string())
        .collect();
    let function_domains: Vec<String> = model
        .header
        .functions
        .iter()
        .map(|f| f.domain().to_string())
        .collect();
    model.header.opset_import.retain(|o| {
        let d = crate::ir::normalize_domain(o.domain());
        d.is_empty() || used.contains(d) || function_domains.iter().any(|f| f == d)
    });
}

pub(crate) fn node_error(model: &Model, node: NodeId, message: String) -> PassError {
    let p = &model.node(node).proto;
    let op = if p.domain().is_empty() {
        p.op_type().to_string()
    } else {
        format!("{}::{}", p.domain(), p.op_type())
    };
    PassError::Node {
        pass: PASS.into(),
        node: p.name().to_string(),
        op,
        message,
    }
}

/// What a lowering works with: a builder in the node's body, and the state manifest (for
/// state that a lowering makes explicit: accumulation buffers, BatchNorm running statistics).
pub struct Lowering<'m, 'c> {
    pub b: Builder<'m>,
    pub state: &'c mut Vec<crate::state::StateEntry>,
    /// Constants minted in this run of the pass, shared between lowerings.
    pub constants: &'c mut util::Constants,
    /// The window, when grad-accum opened one and BatchNorm running statistics pool per
    /// window (`bn_stats=window`); `None`: they move at every micro-step.
    pub window: Option<&'c mut crate::passes::window::Window>,
    /// The variance BatchNorm running variances move with.
    pub running_var: super::RunningVar,
}

impl Lowering<'_, '_> {
    pub fn model(&self) -> &Model {
        self.b.model
    }

    /// Input `slot` of `node`, or an error naming it when absent.
    pub fn input(&self, node: NodeId, slot: usize) -> Result<ValueId, PassError> {
        self.model()
            .node(node)
            .inputs
            .get(slot)
            .copied()
            .flatten()
            .ok_or_else(|| {
                node_error(
                    self.model(),
                    node,
                    format!("input {slot} is required but absent"),
                )
            })
    }

    /// Input `slot` of `node` when present.
    pub fn optional_input(&self, node: NodeId, slot: usize) -> Option<ValueId> {
        self.model().node(node).inputs.get(slot).copied().flatten()
    }

    /// Output `slot` of `node` when present and used.
    pub fn used_output(&self, node: NodeId, slot: usize) -> Option<ValueId> {
        self.model()
            .node(node)
            .outputs
            .get(slot)
            .copied()
            .flatten()
            .filter(|v| !self.model().uses(*v).is_empty())
    }

    /// Moves the uses of output `slot` of `node` to `value` (keeping a graph output's name).
    pub fn replace(&mut self, node: NodeId, slot: usize, value: ValueId) {
        if let Some(old) = self.model().node(node).outputs.get(slot).copied().flatten() {
            self.b.model.replace_value(old, value);
        }
    }

    pub fn int_attr(&self, node: NodeId, name: &str, default: i64) -> Result<i64, PassError> {
        Ok(self.int_attr_given(node, name)?.unwrap_or(default))
    }

    /// An int attribute, `None` when the node does not have it.
    pub fn int_attr_given(&self, node: NodeId, name: &str) -> Result<Option<i64>, PassError> {
        self.model()
            .node(node)
            .proto
            .attr_int(name)
            .map_err(|m| node_error(self.model(), node, m))
    }

    pub fn float_attr(&self, node: NodeId, name: &str, default: f32) -> Result<f32, PassError> {
        Ok(self.float_attr_given(node, name)?.unwrap_or(default))
    }

    /// A float attribute, `None` when the node does not have it.
    pub fn float_attr_given(&self, node: NodeId, name: &str) -> Result<Option<f32>, PassError> {
        self.model()
            .node(node)
            .proto
            .attr_float(name)
            .map_err(|m| node_error(self.model(), node, m))
    }

    pub fn ints_attr(&self, node: NodeId, name: &str) -> Result<Option<Vec<i64>>, PassError> {
        self.model()
            .node(node)
            .proto
            .attr_ints(name)
            .map_err(|m| node_error(self.model(), node, m))
    }

    pub fn string_attr(&self, node: NodeId, name: &str) -> Result<Option<String>, PassError> {
        self.model()
            .node(node)
            .proto
            .attr_string(name)
            .map_err(|m| node_error(self.model(), node, m))
    }

    /// An error about an attribute value outside what the lowering implements.
    pub fn unsupported(&self, node: NodeId, attribute: &str, detail: String) -> PassError {
        node_error(
            self.model(),
            node,
            format!("attribute '{attribute}': {detail} is not supported by the lowering"),
        )
    }
}
