//! Gradient rules: one per forward op (grouped by family, one file each), each opening with
//! its math. A rule gets the forward node and the gradient of each of its outputs (`None`
//! for an output nothing downstream differentiates) and returns the gradient of each input
//! the sweep asks for (`wants`), already summed back to that input's shape where the op
//! broadcasts.
//!
//! Vocabulary: rules emit standard ONNX ops, or one of the gradient ops of ONNX Runtime's
//! training build whose lowering to standard ops `legalize-ort` already has (`ReluGrad`,
//! `ConvGrad`, `MaxPoolGrad`, `LayerNormalizationGrad`, `SoftmaxCrossEntropyLossGrad`, ...).
//! Those lowerings were checked against the training build's kernels, so the math of such
//! an op lives in one place (its file under `passes/legalize/`) whichever front door the
//! gradient graph came through; the autodiff pass lowers them before it returns, so what it
//! writes is standard ONNX only.

mod activation;
mod conv;
pub(in crate::passes::autodiff) mod einsum;
mod elementwise;
mod grid_sample;
mod loss;
mod matmul;
mod norm;
mod pool;
mod reduce;
pub(in crate::passes::autodiff) mod resize;
mod scatter;
mod shape;
pub use shape::dropout_drops;
mod softmax;
mod trig;

use std::collections::HashMap;

use super::shapes::{Dim, Facts, Shapes};
use crate::ir::builder::{tensor_i64, Builder, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{Model, NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::{AttributeProto, TensorProto};

pub(super) const PASS: &str = super::PASS;

/// Gradients of a node's inputs, by input slot.
pub type InputGrads = Vec<Option<ValueId>>;

/// `rule(cx, node, dY per output, wants per input)`.
pub type RuleFn =
    fn(&mut Grad<'_>, NodeId, &[Option<ValueId>], &[bool]) -> Result<InputGrads, PassError>;

/// (op_type, rule) for the default domain.
/// The most elements a constant a gradient rule builds may hold (a resize axis's 4096 x
/// 4096 matrix, a pooling kernel spread over its channels; 64 MiB in float32): beyond it
/// the gradient would cost more than any real layer justifies, and attributes from a bad
/// file must not allocate without bound.
pub const MAX_CONSTANT_ELEMENTS: i64 = 1 << 24;

const RULES: &[(&str, RuleFn)] = &[
    ("Add", elementwise::add),
    ("Sub", elementwise::sub),
    ("Mul", elementwise::mul),
    ("Div", elementwise::div),
    ("Neg", elementwise::neg),
    ("Pow", elementwise::pow),
    ("Sqrt", elementwise::sqrt),
    ("Reciprocal", elementwise::reciprocal),
    ("Exp", elementwise::exp),
    ("Log", elementwise::log),
    ("Abs", elementwise::abs),
    ("Erf", elementwise::erf),
    ("Sum", elementwise::sum),
    ("Mean", elementwise::mean),
    ("Min", elementwise::min_max),
    ("Max", elementwise::min_max),
    ("Where", elementwise::where_),
    ("Relu", activation::relu),
    ("Sigmoid", activation::sigmoid),
    ("Tanh", activation::tanh),
    ("LeakyRelu", activation::leaky_relu),
    ("Elu", activation::elu),
    ("Gelu", activation::gelu),
    ("HardSigmoid", activation::hard_sigmoid),
    ("HardSwish", activation::hard_swish),
    ("Softplus", activation::softplus),
    ("Clip", activation::clip),
    ("MatMul", matmul::matmul),
    ("Gemm", matmul::gemm_rule),
    ("Conv", conv::conv),
    ("ConvTranspose", conv::conv_transpose),
    ("MaxPool", pool::max_pool),
    ("AveragePool", pool::average_pool),
    ("GlobalAveragePool", pool::global_average_pool),
    ("LayerNormalization", norm::layer_norm),
    ("GroupNormalization", norm::group_norm),
    ("InstanceNormalization", norm::instance_norm),
    ("Softmax", softmax::softmax),
    ("LogSoftmax", softmax::log_softmax),
    ("ReduceSum", reduce::reduce_sum),
    ("ReduceMean", reduce::reduce_mean),
    ("ReduceSumSquare", reduce::reduce_sum_square),
    ("ReduceL2", reduce::reduce_l2),
    ("ReduceMax", reduce::reduce_max_min),
    ("ReduceMin", reduce::reduce_max_min),
    ("Reshape", shape::reshape_like),
    ("Flatten", shape::reshape_like),
    ("Squeeze", shape::reshape_like),
    ("Unsqueeze", shape::reshape_like),
    ("Identity", shape::identity),
    ("Transpose", shape::transpose),
    ("Expand", shape::expand),
    ("Concat", shape::concat),
    ("Split", shape::split),
    ("Slice", shape::slice),
    ("Pad", shape::pad),
    ("Tile", shape::tile),
    ("Cast", shape::cast),
    ("CastLike", shape::cast),
    ("Dropout", shape::dropout),
    ("Gather", shape::gather),
    ("GatherElements", shape::gather_elements),
    ("SoftmaxCrossEntropyLoss", loss::softmax_cross_entropy),
    ("NegativeLogLikelihoodLoss", loss::negative_log_likelihood),
    ("Sin", trig::sin),
    ("Cos", trig::cos),
    ("Tan", trig::tan),
    ("Asin", trig::asin),
    ("Acos", trig::acos),
    ("Atan", trig::atan),
    ("Sinh", trig::sinh),
    ("Cosh", trig::cosh),
    ("Asinh", trig::asinh),
    ("Acosh", trig::acosh),
    ("Atanh", trig::atanh),
    ("Softsign", activation::softsign),
    ("Selu", activation::selu),
    ("Celu", activation::celu),
    ("ThresholdedRelu", activation::thresholded_relu),
    ("Shrink", activation::shrink),
    ("Mish", activation::mish),
    ("Swish", activation::swish),
    ("PRelu", activation::prelu),
    ("Mod", elementwise::fmod),
    ("ReduceLogSumExp", reduce::reduce_log_sum_exp),
    ("ReduceLogSum", reduce::reduce_log_sum),
    ("ReduceL1", reduce::reduce_l1),
    ("GlobalMaxPool", reduce::global_max_pool),
    ("Trilu", shape::trilu),
    ("ReverseSequence", shape::reverse_sequence),
    ("TopK", shape::top_k),
    ("CumSum", shape::cum_sum),
    ("DepthToSpace", shape::depth_to_space),
    ("SpaceToDepth", shape::space_to_depth),
    ("Einsum", einsum::einsum),
    ("Resize", resize::resize),
    ("ScatterElements", scatter::scatter_elements),
    ("ScatterND", scatter::scatter_nd),
    ("GatherND", scatter::gather_nd),
    ("LpNormalization", norm::lp_normalization),
    ("LRN", norm::lrn),
    ("GridSample", grid_sample::grid_sample),
    ("RMSNormalization", norm::rms_norm),
    ("MeanVarianceNormalization", norm::mean_variance_norm),
    ("ReduceProd", reduce::reduce_prod),
];

/// Rules for ops outside the default domain.
const DOMAIN_RULES: &[(&str, &str, RuleFn)] = &[
    (
        "com.microsoft",
        "BatchNormInternal",
        norm::batch_norm_internal,
    ),
    ("com.microsoft", "Gelu", activation::gelu),
];

/// Ops whose outputs carry no gradient: integer and boolean results, shape computations,
/// piecewise-constant functions (zero derivative almost everywhere). Differentiation stops
/// at them instead of failing.
pub const NON_DIFFERENTIABLE: &[&str] = &[
    "Shape",
    "Size",
    "Range",
    "ConstantOfShape",
    "Constant",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "Not",
    "And",
    "Or",
    "Xor",
    "ArgMax",
    "ArgMin",
    "NonZero",
    "Sign",
    "Floor",
    "Ceil",
    "Round",
    "Hardmax",
    "IsNaN",
    "IsInf",
    "EyeLike",
    "OneHot",
    "BitShift",
];

/// Ops that draw random numbers (no gradient either: [`is_non_differentiable`]); a body the
/// backward recomputes cannot hold them (`if_grad`).
pub const RANDOM: &[&str] = &[
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Bernoulli",
    "Multinomial",
];

/// Whether an op of the default domain carries no gradient ([`NON_DIFFERENTIABLE`],
/// [`RANDOM`]).
pub fn is_non_differentiable(op: &str) -> bool {
    NON_DIFFERENTIABLE.contains(&op) || RANDOM.contains(&op)
}

/// Inputs that carry no gradient even when they are float tensors: `CastLike` takes only
/// the element type of its second input (the torch exporter's `CastLike(0, x)` must not
/// make a constant depend on the parameters behind `x`); a loss's class weights are
/// settings, not parameters (PyTorch's `nll_loss`/`cross_entropy` have no derivative for
/// them, and the legacy exporter leaves a `weight` buffer as a plain initializer); Resize's
/// region and scales are geometry (tf2onnx writes Keras's UpSampling2D scales as a float
/// initializer), whose gradient the rule does not give; a Dropout's ratio is a setting
/// (torch has no derivative for `p`; an exporter may leave it a float initializer).
pub fn carries_gradient(op: &str, slot: usize) -> bool {
    !matches!(
        (op, slot),
        ("CastLike", 1)
            | ("Dropout", 1)
            | ("SoftmaxCrossEntropyLoss", 2)
            | ("NegativeLogLikelihoodLoss", 2)
            | ("Resize", 1 | 2)
    )
}

pub fn rule_for(domain: &str, op: &str) -> Option<RuleFn> {
    let domain = crate::ir::normalize_domain(domain);
    if domain.is_empty() {
        RULES.iter().find(|(o, _)| *o == op).map(|(_, r)| *r)
    } else {
        DOMAIN_RULES
            .iter()
            .find(|(d, o, _)| *d == domain && *o == op)
            .map(|(.., r)| *r)
    }
}

/// See `Grad::unary_parts`.
pub struct UnaryParts {
    pub dy: ValueId,
    pub x: ValueId,
    pub y: ValueId,
    pub hint: String,
}

/// Whether `wants` asks for the gradient of input `slot` (a malformed node with fewer
/// inputs than the op has simply asks for nothing there).
pub fn wanted(wants: &[bool], slot: usize) -> bool {
    wants.get(slot).copied().unwrap_or(false)
}

/// The emitter the rules build with: a builder in the main graph stamped `autodiff`, the
/// forward graph's shape facts, and constants shared by all rules.
pub struct Grad<'m> {
    pub b: Builder<'m>,
    pub shapes: &'m mut Shapes,
    constants: HashMap<(i32, Vec<i64>, Vec<u8>), ValueId>,
    shape_of: HashMap<ValueId, ValueId>,
}

pub fn node_error(model: &Model, node: NodeId, message: String) -> PassError {
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

impl<'m> Grad<'m> {
    pub fn new(b: Builder<'m>, shapes: &'m mut Shapes) -> Self {
        Grad {
            b,
            shapes,
            constants: HashMap::new(),
            shape_of: HashMap::new(),
        }
    }

    pub fn model(&self) -> &Model {
        self.b.model
    }

    pub fn opset(&self) -> i64 {
        self.model().opset("").unwrap_or(1)
    }

    pub fn error(&self, node: NodeId, message: String) -> PassError {
        node_error(self.model(), node, message)
    }

    pub fn input(&self, node: NodeId, slot: usize) -> Result<ValueId, PassError> {
        self.opt_input(node, slot)
            .ok_or_else(|| self.error(node, format!("input {slot} is required but absent")))
    }

    pub fn opt_input(&self, node: NodeId, slot: usize) -> Option<ValueId> {
        self.model().node(node).inputs.get(slot).copied().flatten()
    }

    /// An output of a node a rule built (a gradient op makes every output it is given a
    /// hint for, so the slot is present). A forward node's output: `forward_output`.
    pub fn output(&self, node: NodeId, slot: usize) -> ValueId {
        self.model().output(node, slot)
    }

    /// The rule of an elementwise function of one input whose derivative is a tensor the
    /// caller builds from X and Y: `dX = dY · slope(X, Y)`.
    pub fn by_slope(
        &mut self,
        node: NodeId,
        dys: &[Option<ValueId>],
        slope: impl FnOnce(&mut Self, ValueId, ValueId, &str) -> Result<ValueId, PassError>,
    ) -> Result<InputGrads, PassError> {
        let UnaryParts { dy, x, y, hint } = self.unary_parts(node, dys)?;
        let s = slope(self, x, y, &hint)?;
        Ok(vec![Some(self.op_like("Mul", &[dy, s], vec![], &hint, x))])
    }

    /// Output `slot` of a node a rule built, recorded as having the shape and type of
    /// `like` (a gradient op's result is shaped like the input it is the gradient of).
    pub fn output_like(&mut self, node: NodeId, slot: usize, like: ValueId) -> ValueId {
        let v = self.output(node, slot);
        let facts = self.facts(like);
        self.shapes.set(v, facts);
        v
    }

    /// Output `slot` of the forward node, or an error naming it when the model omits it.
    pub fn forward_output(&self, node: NodeId, slot: usize) -> Result<ValueId, PassError> {
        self.model()
            .node(node)
            .outputs
            .get(slot)
            .copied()
            .flatten()
            .ok_or_else(|| self.error(node, format!("output {slot} is required but absent")))
    }

    /// The gradient reaching output `slot`. The sweep calls a rule only when some output
    /// of the node has one, so for a single-output op this never fails; multi-output rules
    /// look at `dys` themselves first (a missing gradient is zero) and use this for the
    /// output they need. The error names the node rather than panicking.
    pub fn dy(
        &self,
        node: NodeId,
        dys: &[Option<ValueId>],
        slot: usize,
    ) -> Result<ValueId, PassError> {
        dys.get(slot).copied().flatten().ok_or_else(|| {
            self.error(
                node,
                format!("no gradient reaches output {slot}, which the gradient rule needs"),
            )
        })
    }

    /// What most single-input rules start from: dY (output 0's gradient), X (input 0), Y
    /// (output 0) and the hint `<X>_grad` for the values the rule makes.
    pub fn unary_parts(
        &self,
        node: NodeId,
        dys: &[Option<ValueId>],
    ) -> Result<UnaryParts, PassError> {
        let dy = self.dy(node, dys, 0)?;
        let x = self.input(node, 0)?;
        let y = self.forward_output(node, 0)?;
        let hint = format!("{}_grad", self.model().name(x));
        Ok(UnaryParts { dy, x, y, hint })
    }

    pub fn int_attr(&self, node: NodeId, name: &str, default: i64) -> Result<i64, PassError> {
        let v = self.model().node(node).proto.attr_int(name);
        Ok(v.map_err(|m| self.error(node, m))?.unwrap_or(default))
    }

    pub fn float_attr(&self, node: NodeId, name: &str, default: f32) -> Result<f32, PassError> {
        let v = self.model().node(node).proto.attr_float(name);
        Ok(v.map_err(|m| self.error(node, m))?.unwrap_or(default))
    }

    pub fn ints_attr(&self, node: NodeId, name: &str) -> Result<Option<Vec<i64>>, PassError> {
        let v = self.model().node(node).proto.attr_ints(name);
        v.map_err(|m| self.error(node, m))
    }

    pub fn string_attr(&self, node: NodeId, name: &str) -> Result<Option<String>, PassError> {
        let v = self.model().node(node).proto.attr_string(name);
        v.map_err(|m| self.error(node, m))
    }

    /// The forward node's attributes, for a gradient op that takes the same ones.
    pub fn attrs_of(&self, node: NodeId, keep: &[&str]) -> Vec<AttributeProto> {
        self.model()
            .node(node)
            .proto
            .attribute
            .iter()
            .filter(|a| keep.contains(&a.name()))
            .cloned()
            .collect()
    }

    pub fn facts(&self, v: ValueId) -> Facts {
        self.shapes.get(v)
    }

    pub fn rank(&self, v: ValueId) -> Option<usize> {
        self.facts(v).rank()
    }

    /// The element type of `v`, or an error naming the node and the value.
    pub fn elem(&self, node: NodeId, v: ValueId) -> Result<i32, PassError> {
        self.facts(v).elem.ok_or_else(|| {
            self.error(
                node,
                format!(
                    "the element type of '{}' is neither declared nor derivable",
                    self.model().name(v)
                ),
            )
        })
    }

    /// The rank of `v`, or an error naming the node and the value.
    pub fn need_rank(&self, node: NodeId, v: ValueId) -> Result<usize, PassError> {
        self.rank(v).ok_or_else(|| {
            self.error(
                node,
                format!(
                    "the rank of '{}' is neither declared nor derivable",
                    self.model().name(v)
                ),
            )
        })
    }

    /// A default-domain node with one output; its value gets the facts `like` has.
    pub fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId {
        self.b.op(op_type, inputs, attributes, hint)
    }

    /// The same, recording that the result has the shape and type of `like`.
    pub fn op_like(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
        like: ValueId,
    ) -> ValueId {
        let v = self.b.op(op_type, inputs, attributes, hint);
        let facts = self.facts(like);
        self.shapes.set(v, facts);
        v
    }

    /// An ONNX Runtime gradient op (lowered by `legalize-ort` before the pass returns).
    pub fn ort_op(
        &mut self,
        op_type: &str,
        inputs: &[Option<ValueId>],
        output_hints: &[&str],
        attributes: Vec<AttributeProto>,
    ) -> NodeId {
        self.b.model.require_opset("com.microsoft", 1);
        self.b
            .node(op_type, "com.microsoft", inputs, output_hints, attributes)
    }

    /// A constant initializer (one per distinct value: the same tensor twice is one
    /// initializer), its facts recorded.
    pub fn constant(&mut self, hint: &str, tensor: TensorProto) -> ValueId {
        let key = (
            tensor.data_type(),
            tensor.dims.clone(),
            tensor.raw_data.clone().unwrap_or_default(),
        );
        if let Some(v) = self.constants.get(&key) {
            return *v;
        }
        let dims = tensor.dims.clone();
        let elem = tensor.data_type();
        let v = self.b.model.add_initializer(self.b.body, hint, tensor);
        self.shapes.set(
            v,
            Facts {
                elem: Some(elem),
                dims: Some(dims.into_iter().map(Dim::Known).collect()),
            },
        );
        self.constants.insert(key, v);
        v
    }

    /// A scalar of element type `elem`.
    pub fn scalar(&mut self, elem: i32, value: f64) -> ValueId {
        let hint = format!("c_{}", format!("{value}").replace(['.', '-'], "_"));
        self.constant(&hint, crate::ir::emit::scalar_tensor(elem, value))
    }

    /// The one-element zero of `elem`: ConstantOfShape's `value` for zeros of that type.
    pub fn zero_value(elem: i32) -> TensorProto {
        TensorProto {
            data_type: Some(elem),
            dims: vec![1],
            raw_data: Some(vec![0u8; super::elem_size(elem)]),
            ..Default::default()
        }
    }

    /// Zeros of the shape and element type of `like` (a gradient that is zero: an output
    /// nothing differentiates, the positions a scatter overwrote).
    pub fn zeros_like(
        &mut self,
        node: NodeId,
        like: ValueId,
        hint: &str,
    ) -> Result<ValueId, PassError> {
        let value = Self::zero_value(self.elem(node, like)?);
        let shape = self.shape_of(like);
        Ok(self.op_like(
            "ConstantOfShape",
            &[shape],
            vec![crate::ir::builder::attr_tensor("value", value)],
            hint,
            like,
        ))
    }

    /// A scalar with the element type of `like`.
    pub fn scalar_like(
        &mut self,
        node: NodeId,
        like: ValueId,
        value: f64,
    ) -> Result<ValueId, PassError> {
        let elem = self.elem(node, like)?;
        Ok(self.scalar(elem, value))
    }

    /// An int64 vector constant.
    pub fn ints(&mut self, values: &[i64]) -> ValueId {
        let parts: Vec<String> = values
            .iter()
            .map(|a| {
                if *a < 0 {
                    format!("m{}", -a)
                } else {
                    a.to_string()
                }
            })
            .collect();
        let hint = format!("i_{}", parts.join("_"));
        self.constant(&hint, tensor_i64(&[values.len() as i64], values))
    }

    /// `Shape(x)`, one node per value however many rules ask, or a constant when `x`'s
    /// dims are all known.
    pub fn shape_of(&mut self, x: ValueId) -> ValueId {
        if let Some(dims) = self.facts(x).static_dims() {
            return self.ints(&dims);
        }
        if let Some(s) = self.shape_of.get(&x) {
            return *s;
        }
        let hint = format!("{}_shape", self.model().name(x));
        let s = self.op("Shape", &[x], vec![], &hint);
        self.shape_of.insert(x, s);
        s
    }

    /// `dy` (the gradient of a broadcast result `y`) summed back to the shape of `x`:
    /// the leading axes `x` lacks are summed away, and so are the axes where `x` has size
    /// 1 and `y` does not. An axis whose size the shape facts cannot tell (`x`'s dim
    /// unknown, or named otherwise than `y`'s) is decided at run time
    /// ([`Grad::unbroadcast_at_run_time`]): assuming it is not broadcast made a gradient of
    /// the wrong shape when it was (BERT's position ids through the TorchScript exporter
    /// lost their row axis that way, and failed at run time; a gradient that only
    /// continues elementwise would have been silently wrong).
    ///
    /// `y` is taken to be the broadcast of `node`'s inputs (an elementwise op's result);
    /// [`Grad::unbroadcast_from`] names the operands otherwise.
    pub fn unbroadcast(
        &mut self,
        node: NodeId,
        dy: ValueId,
        y: ValueId,
        x: ValueId,
    ) -> Result<ValueId, PassError> {
        let inputs = &self.model().node(node).inputs;
        let peers: Vec<ValueId> = inputs
            .iter()
            .flatten()
            .copied()
            .filter(|v| *v != x)
            .collect();
        self.unbroadcast_from(node, dy, y, x, Some(&peers))
    }

    /// [`Grad::unbroadcast`] where `y`'s shape is the broadcast of `x` and `peers` (`None`:
    /// not known). Where no peer has an axis of `x` or has it of size 1, `y`'s size there
    /// is `x`'s, whatever the facts know of either.
    pub fn unbroadcast_from(
        &mut self,
        node: NodeId,
        dy: ValueId,
        y: ValueId,
        x: ValueId,
        peers: Option<&[ValueId]>,
    ) -> Result<ValueId, PassError> {
        let (fx, fy) = (self.facts(x), self.facts(y));
        let peer_dims: Option<Vec<Option<Vec<Dim>>>> =
            peers.map(|p| p.iter().map(|v| self.facts(*v).dims).collect());
        let (Some(dx), Some(dyd)) = (fx.dims.clone(), fy.dims.clone()) else {
            if fx.dims.is_some() && fx.dims == fy.dims {
                return Ok(dy);
            }
            return Err(self.error(
                node,
                format!(
                    "summing the gradient of '{}' back to the shape of '{}' needs both ranks, which are neither declared nor derivable",
                    self.model().name(y),
                    self.model().name(x)
                ),
            ));
        };
        let lead = dyd.len().saturating_sub(dx.len());
        let mut axes: Vec<i64> = (0..lead as i64).collect();
        let mut unsure = Vec::new();
        for (i, d) in dx.iter().enumerate() {
            let j = i + lead;
            match broadcast(d, dyd.get(j)) {
                Broadcast::Yes => axes.push(j as i64),
                Broadcast::No => {}
                Broadcast::Unsure
                    if peer_dims
                        .as_ref()
                        .is_some_and(|p| y_axis_is_xs(p, dyd.len(), j)) => {}
                Broadcast::Unsure => unsure.push(j),
            }
        }
        if !unsure.is_empty() {
            return Ok(self.unbroadcast_at_run_time(dy, y, x, lead, &axes, &unsure));
        }
        if axes.is_empty() {
            return Ok(dy);
        }
        let hint = format!("{}_grad", self.model().name(x));
        // Only leading axes: one ReduceSum without keepdims gives x's shape exactly.
        if axes.len() == lead {
            let summed = self.reduce("ReduceSum", dy, &axes, false, &hint);
            self.shapes.set(summed, fx);
            return Ok(summed);
        }
        if lead == 0 {
            let summed = self.reduce("ReduceSum", dy, &axes, true, &hint);
            self.shapes.set(summed, fx);
            return Ok(summed);
        }
        let summed = self.reduce("ReduceSum", dy, &axes, true, &format!("{hint}_sum"));
        let shape = self.shape_of(x);
        let out = self.op_like("Reshape", &[summed, shape], vec![], &hint, x);
        Ok(out)
    }

    /// [`Grad::unbroadcast`] where the axes `unsure` of `y` (numbered in `y`, whose first
    /// `lead` axes `x` lacks) may or may not be broadcast from `x`, and the axes `summed`
    /// certainly are. Each unsure axis `j` of `dy` is split in two, `(x_j, y_j + 1 - x_j)`:
    /// `(1, y_j)` where `x` is broadcast, `(y_j, 1)` where it is not (and `(0, 1)` or
    /// `(1, 0)` for empty axes, so no division is needed); the second part is summed with
    /// the certain axes, and the result takes `x`'s shape. Exact either way; where the axis
    /// turns out not to be broadcast, it costs one pass over `dy` (a sum over axes of
    /// size 1).
    fn unbroadcast_at_run_time(
        &mut self,
        dy: ValueId,
        y: ValueId,
        x: ValueId,
        lead: usize,
        summed: &[i64],
        unsure: &[usize],
    ) -> ValueId {
        let y_dims = self.facts(y).dims.unwrap_or_default();
        let y_dims = y_dims.as_slice();
        let hint = format!("{}_grad", self.model().name(x));
        let x_shape = self.shape_of(x);
        let mut pieces = Vec::new();
        let mut axes = Vec::new();
        let mut kept_from = 0;
        for j in 0..y_dims.len() {
            if !unsure.contains(&j) {
                if summed.contains(&(j as i64)) {
                    axes.push((j + unsure.iter().filter(|&&u| u < j).count()) as i64);
                }
                continue;
            }
            if kept_from < j {
                pieces.push(self.dims_of(y, y_dims, kept_from..j));
            }
            kept_from = j + 1;
            let i = self.ints(&[(j - lead) as i64]);
            let x_j = self.op("Gather", &[x_shape, i], vec![], &format!("{hint}_dim"));
            let y_j_plus_one = match y_dims[j] {
                Dim::Known(n) => self.ints(&[n.saturating_add(1)]),
                _ => {
                    let y_j = self.dims_of(y, y_dims, j..j + 1);
                    let one = self.ints(&[1]);
                    self.add(y_j, one, &format!("{hint}_dim"))
                }
            };
            let rest = self.sub(y_j_plus_one, x_j, &format!("{hint}_dim"));
            axes.push((j + unsure.iter().filter(|&&u| u < j).count() + 1) as i64);
            pieces.extend([x_j, rest]);
        }
        if kept_from < y_dims.len() {
            pieces.push(self.dims_of(y, y_dims, kept_from..y_dims.len()));
        }
        let split_shape = self.op(
            "Concat",
            &pieces,
            vec![crate::ir::builder::attr_int("axis", 0)],
            &format!("{hint}_split_shape"),
        );
        let split = self.op(
            "Reshape",
            &[dy, split_shape],
            vec![],
            &format!("{hint}_split"),
        );
        let reduced = self.reduce("ReduceSum", split, &axes, true, &format!("{hint}_sum"));
        self.op_like("Reshape", &[reduced, x_shape], vec![], &hint, x)
    }

    /// The dims `range` of `v` (whose dims are `dims`) as a 1-D int64 tensor: a constant
    /// when they are known, else gathered from `Shape(v)`.
    fn dims_of(&mut self, v: ValueId, dims: &[Dim], range: std::ops::Range<usize>) -> ValueId {
        if let Some(known) = dims[range.clone()]
            .iter()
            .map(Dim::known)
            .collect::<Option<Vec<_>>>()
        {
            return self.ints(&known);
        }
        let shape = self.shape_of(v);
        let positions: Vec<i64> = range.map(|k| k as i64).collect();
        let positions = self.ints(&positions);
        self.op(
            "Gather",
            &[shape, positions],
            vec![],
            &format!("{}_dims", self.model().name(v)),
        )
    }

    /// `Expand(dy_kept, Shape(x))`: a reduction's gradient spread back over `x`.
    pub fn expand_to(&mut self, dy: ValueId, x: ValueId, hint: &str) -> ValueId {
        let shape = self.shape_of(x);
        self.op_like("Expand", &[dy, shape], vec![], hint, x)
    }
}

/// Whether an axis of `x` of size `x_dim` is broadcast to the result's `y_dim` (facts
/// only; [`Grad::unbroadcast`]).
#[derive(Debug, PartialEq)]
enum Broadcast {
    Yes,
    No,
    /// Either, as the run-time sizes decide.
    Unsure,
}

fn broadcast(x_dim: &Dim, y_dim: Option<&Dim>) -> Broadcast {
    match (x_dim, y_dim) {
        (Dim::Known(1), Some(Dim::Known(1))) => Broadcast::No,
        // Summing an axis of size 1, should y's turn out to be 1 too, changes nothing.
        (Dim::Known(1), _) => Broadcast::Yes,
        // Any other size is y's own.
        (Dim::Known(_), _) => Broadcast::No,
        // y has size 1 there, so x has too.
        (_, Some(Dim::Known(1))) => Broadcast::No,
        (Dim::Symbol(a), Some(Dim::Symbol(b))) if a == b => Broadcast::No,
        _ => Broadcast::Unsure,
    }
}

/// Whether axis `j` of a result of rank `rank` can only have its size from the operand
/// that is not among `peers`: every peer lacks the axis or has it of size 1.
fn y_axis_is_xs(peers: &[Option<Vec<Dim>>], rank: usize, j: usize) -> bool {
    peers.iter().all(|p| match p {
        Some(d) => match (j + d.len()).checked_sub(rank) {
            None => true,
            Some(k) => d.get(k) == Some(&Dim::Known(1)),
        },
        None => false,
    })
}

impl Emit for Grad<'_> {
    fn opset(&self) -> i64 {
        Grad::opset(self)
    }

    fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId {
        self.b.op(op_type, inputs, attributes, hint)
    }

    fn axes(&mut self, axes: &[i64]) -> ValueId {
        self.ints(axes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(s: &str) -> Dim {
        Dim::Symbol(s.into())
    }

    #[test]
    fn which_axes_are_broadcast_from_the_facts_alone() {
        use Broadcast::*;
        let k = Dim::Known;
        let cases = [
            (k(1), Some(k(4)), Yes),
            (k(1), Some(named("N")), Yes),
            (k(1), Some(Dim::Unknown), Yes),
            (k(1), Some(k(1)), No),
            (k(4), Some(k(4)), No),
            (k(4), Some(Dim::Unknown), No),
            (named("N"), Some(named("N")), No),
            (Dim::Unknown, Some(k(1)), No),
            (named("N"), Some(named("M")), Unsure),
            (named("N"), Some(k(4)), Unsure),
            (Dim::Unknown, Some(k(4)), Unsure),
            (Dim::Unknown, Some(Dim::Unknown), Unsure),
        ];
        for (x, y, expected) in cases {
            assert_eq!(broadcast(&x, y.as_ref()), expected, "{x:?} against {y:?}");
        }
    }

    /// y = x + b with b of shape [8] (a bias) or [1, 8]: y's batch is x's, unknown or not;
    /// with b of [?, 8] or of an unknown rank it may be either's.
    #[test]
    fn an_axis_no_peer_has_is_the_operands_own() {
        let k = Dim::Known;
        assert!(y_axis_is_xs(&[Some(vec![k(8)])], 2, 0));
        assert!(y_axis_is_xs(&[Some(vec![k(1), k(8)])], 2, 0));
        assert!(!y_axis_is_xs(&[Some(vec![Dim::Unknown, k(8)])], 2, 0));
        assert!(!y_axis_is_xs(&[Some(vec![k(8)]), None], 2, 0));
        assert!(!y_axis_is_xs(&[Some(vec![k(8)])], 2, 1));
        assert!(y_axis_is_xs(&[], 2, 0));
    }
}
