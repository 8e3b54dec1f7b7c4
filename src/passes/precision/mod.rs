//! `precision(dtype=fp16|bf16, keep=Op1;Op2)`: mixed-precision compute with float32 master
//! parameters and float32 accumulators (DESIGN.md section 5).
//!
//! The forward and backward compute of the main graph runs in half precision where that is
//! safe; everything that holds or updates state stays float32:
//!
//! - **Master parameters** stay float32 graph inputs; a compute node that wants one in half
//!   reads `Cast(p)` (one shared cast per parameter, `p.fp16`), so the optimizer in the apply
//!   region sees and updates the float32 values.
//! - **Data inputs** keep their float32 interface and are cast once at entry (`x.fp16`).
//! - **Float constants** read by half nodes are converted (a half copy `c.fp16` of the
//!   initializer; the float32 original stays for float32 readers, or `dce` drops it).
//!   Constants beyond the half range become infinite; the report counts them.
//! - **Gradients** reach grad-accum's accumulators as float32: the accumulation `Add` is
//!   float32 state math, so a gradient computed in half is cast to float32 there
//!   (`fc1.weight_grad.fp32`). The accumulators, the window normalisation, loss scaling's
//!   unscale and check, the optimizer and AGC therefore all see float32.
//! - **The apply region** (the `If`'s branches, or the `Where` form's update math, which
//!   grad-accum, loss-scale, optimizer and agc stamp) is not touched: everything it reads
//!   from the main graph is float32 (a half value gets a cast on the way in).
//! - **Graph outputs** (the loss, state) stay float32 under their names.
//!
//! # Which nodes compute in half
//!
//! The rules are those of PyTorch's autocast (a lower-precision list, a float32 list, and
//! type promotion for everything else), applied to the graph as it is after `legalize-ort`
//! (standard ops only), node by node in topological order:
//!
//! 1. State math stays float32: nodes stamped by grad-accum, loss-scale, optimizer or agc,
//!    and control flow (`If`, `Loop`, `Scan`) with its bodies.
//! 2. The block list (`keep`) stays float32: by default [`DEFAULT_KEEP`]: the losses
//!    (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss), Softmax and LogSoftmax, the
//!    accumulating reductions (ReduceSum, ReduceMean, ReduceSumSquare, ReduceL1, ReduceL2,
//!    ReduceLogSum, ReduceLogSumExp, ReduceProd, CumSum) and scatters (ScatterElements,
//!    ScatterND: the gradients of MaxPool and Gather scatter-add), the normalisations
//!    (BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization,
//!    LpNormalization, MeanVarianceNormalization, RMSNormalization and ORT's fused
//!    layer norms), and the range-sensitive pointwise ops Exp, Log, Pow, Sqrt, Reciprocal
//!    and Softplus.
//! 3. An op whose ONNX schema at the model's opset does not admit the half type stays
//!    float32 (e.g. with bf16 at opset 17: Conv, MaxPool, ConstantOfShape, OneHot; the
//!    table is generated from onnx's schemas by `scripts/precision-schema.py`). With bf16
//!    so does an op ONNX Runtime's CUDA provider has no bf16 kernel for (Greater, Pad,
//!    SpaceToDepth, MaxPool, LogSoftmax, ...; `cuda_bf16.rs`, generated from ONNX Runtime's
//!    kernel table by `scripts/ort-cuda-bf16.py`): that provider is the only runtime that
//!    runs bf16, and a bf16 node it lacks does not load. Other domains: only com.microsoft
//!    FusedMatMul, Gelu and FastGelu may go half.
//! 4. The matrix products, MatMul, Gemm, Conv, ConvTranspose, Einsum and FusedMatMul,
//!    compute in half.
//! 5. Every other op follows its float inputs (type promotion): float32 if any of them is
//!    float32, else half if any is half. Parameters, data inputs, constants and values
//!    computed from constants alone (`Cast(Size(x))`, `ConstantOfShape`, `OneHot` of
//!    constants) are *weak*: they do not vote, and take the precision their readers want
//!    (a `Cast(.., to=FLOAT)` or `ConstantOfShape` read by half nodes is retargeted to
//!    half). The backward seed (dL/dL, the training signature's seed) is float32 like the
//!    loss, not weak.
//!
//! Promotion is what keeps whole regions float32 in lowered graphs without naming their
//! pieces: once a blocked op produces a float32 value, the elementwise ops reading it are
//! float32 too, up to the next matrix product. In the backward pass the gradient starts
//! from the float32 seed, so it flows in float32 back through the loss's elementwise ops
//! (as autocast's float32 loss functions do) and turns half at the first matrix product.
//! So the lowered SoftmaxCrossEntropyLoss gradient (`Exp(log_prob) - onehot`, times
//! `dy / N`), the softmax and log-softmax gradients (their `ReduceSum` and `Exp`), and the
//! BatchNorm and LayerNorm lowerings and gradients (built on `ReduceMean`, `ReduceSum`,
//! `Sqrt`, `Reciprocal`) all stay float32; the weight gradient of a following
//! MatMul/Gemm/Conv is computed in half and cast to float32 for its accumulator. Everything
//! between a normalisation and the next matrix product (the CNN's Relu and MaxPool after
//! BatchNorm) stays float32 as well.
//!
//! A cast sits wherever a value's precision differs from what its reader computes in; the
//! printed graph ([`crate::ir::print`], as `inspect --graph` prints it, and the snapshots)
//! shows each as a node ending `# precision`. Stale `value_info` element types are updated.
//! docs/precision.md has the engines' half-precision support and measured differences.
//!
//! # Options
//!
//! - `dtype=fp16|bf16` (required).
//! - `keep=A;B;...` replaces the block list; `keep=+A;-B` adds to and removes from the
//!   default list; `keep=none` empties it (only rules 1, 3 and 4 then decide).
//!
//! # Position
//!
//! After `grad-accum`, `loss-scale`, `optimizer` (and `agc`) and after `legalize-ort`, which
//! turns ORT's training ops into the standard ops these rules know; before `dce` (which
//! drops constants left unread) and `lower-for-tract` (whose lowerings take the element type
//! of their inputs). The CLI's `rewrite --precision fp16|bf16` builds that pipeline.

mod cuda_bf16;
mod schema;

use std::collections::{BTreeSet, HashMap, HashSet};

use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, attr_tensor, Builder};
use crate::ir::{BodyId, Model, NodeId, Use, ValueDef, ValueId, PASS_KEY};
use crate::proto::{attribute_proto::AttributeType, type_proto};
use crate::proto::{AttributeProto, TensorProto};

pub const PASS: &str = "precision";

use crate::proto::elem::{BFLOAT16, FLOAT, FLOAT16};

/// The default block list: ops that stay float32 (see the module documentation).
pub const DEFAULT_KEEP: &[&str] = &[
    // Losses.
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    // Softmax and log-softmax.
    "Softmax",
    "LogSoftmax",
    // Reductions that accumulate.
    "ReduceSum",
    "ReduceMean",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceProd",
    "CumSum",
    // Scatters: in training graphs they accumulate (reduction=add), e.g. the gradients of
    // MaxPool and Gather.
    "ScatterElements",
    "ScatterND",
    // Normalisations.
    "BatchNormalization",
    "LayerNormalization",
    "InstanceNormalization",
    "GroupNormalization",
    "LpNormalization",
    "MeanVarianceNormalization",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    // Range-sensitive pointwise ops.
    "Exp",
    "Log",
    "Pow",
    "Sqrt",
    "Reciprocal",
    "Softplus",
];

/// Ops that compute in half whenever the opset admits it (autocast's lower-precision list).
pub const HALF_OPS: &[&str] = &[
    "MatMul",
    "Gemm",
    "Conv",
    "ConvTranspose",
    "Einsum",
    "FusedMatMul",
];

/// com.microsoft ops whose ORT schemas admit float16 and bfloat16.
const HALF_COM_MICROSOFT: &[&str] = &["FusedMatMul", "Gelu", "FastGelu"];

/// Passes whose nodes are state math (float32 always).
const STATE_PASSES: &[&str] = &["grad-accum", "loss-scale", "optimizer", "agc"];

/// The half-precision type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfType {
    Fp16,
    Bf16,
}

impl HalfType {
    /// The ONNX element type.
    pub fn elem_type(self) -> i32 {
        match self {
            HalfType::Fp16 => FLOAT16,
            HalfType::Bf16 => BFLOAT16,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            HalfType::Fp16 => "fp16",
            HalfType::Bf16 => "bf16",
        }
    }

    /// The bits of `x` in this type (round to nearest even; beyond the range: infinite).
    fn bits(self, x: f32) -> (u16, bool) {
        match self {
            HalfType::Fp16 => {
                let h = half::f16::from_f32(x);
                (h.to_bits(), h.is_finite())
            }
            HalfType::Bf16 => {
                let h = half::bf16::from_f32(x);
                (h.to_bits(), h.is_finite())
            }
        }
    }
}

impl std::str::FromStr for HalfType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp16" | "float16" => Ok(HalfType::Fp16),
            "bf16" | "bfloat16" => Ok(HalfType::Bf16),
            other => Err(format!("dtype={other}: expected fp16 or bf16")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Precision {
    pub dtype: HalfType,
    /// Op types kept float32 (the block list).
    pub keep: BTreeSet<String>,
}

fn spec_error(message: String) -> PassError {
    PassError::Spec {
        spec: PASS.into(),
        message,
    }
}

fn fail(message: String) -> PassError {
    PassError::Other {
        pass: PASS.into(),
        message,
    }
}

fn default_keep() -> BTreeSet<String> {
    DEFAULT_KEEP.iter().map(|s| s.to_string()).collect()
}

/// `keep=`: `A;B` replaces the default list, `+A;-B` edits it, `none` empties it.
pub fn parse_keep(text: Option<&str>) -> Result<BTreeSet<String>, PassError> {
    let Some(text) = text else {
        return Ok(default_keep());
    };
    let tokens: Vec<&str> = text
        .split(';')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    if tokens.is_empty() || tokens == ["none"] {
        return Ok(BTreeSet::new());
    }
    let signed = tokens.iter().filter(|t| t.starts_with(['+', '-'])).count();
    if signed != 0 && signed != tokens.len() {
        return Err(spec_error(format!(
            "keep={text}: either list the ops to keep float32 (A;B) or edit the default list (+A;-B), not both"
        )));
    }
    let valid =
        |op: &str| !op.is_empty() && op.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    let mut keep = if signed == 0 {
        BTreeSet::new()
    } else {
        default_keep()
    };
    for token in tokens {
        let (add, op) = match token.strip_prefix('-') {
            Some(op) => (false, op),
            None => (true, token.strip_prefix('+').unwrap_or(token)),
        };
        if !valid(op) {
            return Err(spec_error(format!("keep={text}: '{op}' is not an op type")));
        }
        if add {
            keep.insert(op.to_string());
        } else {
            keep.remove(op);
        }
    }
    Ok(keep)
}

impl Precision {
    pub fn new(dtype: HalfType) -> Self {
        Precision {
            dtype,
            keep: default_keep(),
        }
    }

    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&["dtype", "keep"])?;
        let dtype = options
            .get("dtype")
            .ok_or_else(|| spec_error("dtype=fp16 or dtype=bf16 is required".into()))?
            .parse::<HalfType>()
            .map_err(spec_error)?;
        Ok(Precision {
            dtype,
            keep: parse_keep(options.get("keep"))?,
        })
    }

    /// Whether `op` of `domain` may compute in the half type at `opset`: its schema
    /// admits the type and, for bf16, the one runtime that runs bf16 (ONNX Runtime's CUDA
    /// provider) has a kernel for it. fp16 needs no such check: where a provider lacks an
    /// fp16 kernel ONNX Runtime computes the node in float32 between casts it inserts.
    fn half_capable(&self, domain: &str, op: &str, opset: i64) -> bool {
        match crate::ir::normalize_domain(domain) {
            "" => {
                let schema_admits = schema::HALF_SINCE
                    .iter()
                    .find(|(o, ..)| *o == op)
                    .is_some_and(|(_, f16, bf16)| {
                        let since = match self.dtype {
                            HalfType::Fp16 => *f16,
                            HalfType::Bf16 => *bf16,
                        };
                        since > 0 && opset >= since as i64
                    });
                schema_admits
                    && match self.dtype {
                        HalfType::Fp16 => true,
                        HalfType::Bf16 => cuda_bf16_kernel(op, opset),
                    }
            }
            "com.microsoft" => HALF_COM_MICROSOFT.contains(&op),
            _ => false,
        }
    }
}

/// Whether ONNX Runtime's CUDA provider has a bfloat16 kernel for `op` at `opset`
/// ([`cuda_bf16::CUDA_BF16`]).
fn cuda_bf16_kernel(op: &str, opset: i64) -> bool {
    cuda_bf16::CUDA_BF16.iter().any(|&(o, first, last)| {
        o == op && opset >= first as i64 && (last == 0 || opset <= last as i64)
    })
}

impl Pass for Precision {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Precision
    }

    fn spec(&self) -> String {
        let dtype = self.dtype.as_str();
        if self.keep == default_keep() {
            format!("{PASS}(dtype={dtype})")
        } else if self.keep.is_empty() {
            format!("{PASS}(dtype={dtype},keep=none)")
        } else {
            let keep: Vec<&str> = self.keep.iter().map(String::as_str).collect();
            format!("{PASS}(dtype={dtype},keep={})", keep.join(";"))
        }
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        if !cx.window().is_some_and(|w| w.optimized()) {
            return Err(fail(
                "no optimized apply region: run precision after grad-accum, loss-scale and optimizer (they build float32 state math on the gradients), and after legalize-ort".into(),
            ));
        }
        if let Some(n) = model.all_nodes().find(|n| {
            let p = &model.node(*n).proto;
            crate::ops::is_training_only(p.domain(), p.op_type())
        }) {
            let p = &model.node(n).proto;
            return Err(PassError::Node {
                pass: PASS.into(),
                node: p.name().to_string(),
                op: p.op_type().to_string(),
                message: "a training-only op: run legalize-ort before precision".into(),
            });
        }
        let weak: HashSet<String> = cx
            .signature
            .data_inputs
            .iter()
            .map(|d| d.name.clone())
            .chain(cx.signature.params.iter().map(|p| p.name.clone()))
            .collect();
        let seed = cx.signature.seed.clone();
        let mut analysis = Analysis::new(model, self, weak, seed)?;
        analysis.classify();
        analysis.resolve_weak();
        let plan = analysis.finish();
        rewrite(model, self.dtype, plan)
    }
}

// ---- analysis ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Prec {
    F32,
    Half,
}

/// How a float value votes in type promotion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// A value computed in this precision.
    Strong(Prec),
    /// Takes the precision its readers want: parameters, data inputs, constants and what
    /// is computed from them alone.
    Weak,
}

/// Why a float node computes as it does (for the report).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Why {
    State,
    Keep,
    NoHalfType,
    UnknownType,
    HalfOp,
    Promoted,
    Weak,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// No float input or output whose type matters.
    Untouched,
    Fixed(Prec, Why),
    /// Weak: decided by its readers.
    Pending,
}

struct Analysis<'a> {
    model: &'a Model,
    pass: &'a Precision,
    opset: i64,
    /// Graph inputs that are weak (data inputs and parameters).
    weak_inputs: HashSet<String>,
    /// The backward seed's name: float32, not weak.
    seed: Option<String>,
    order: Vec<NodeId>,
    elem: HashMap<ValueId, i32>,
    class: HashMap<ValueId, Class>,
    mode: HashMap<NodeId, Mode>,
}

/// What the rewrite needs: each main-graph node's precision, and the precision of each
/// float value.
struct Plan {
    order: Vec<NodeId>,
    mode: HashMap<NodeId, Mode>,
    elem: HashMap<ValueId, i32>,
    /// Float values computed in half.
    half_values: HashSet<ValueId>,
    opset: i64,
}

fn declared_elem(model: &Model, v: ValueId) -> Option<i32> {
    match model.value_type(v) {
        Some(t) => t.tensor_elem(),
        None => None,
    }
}

fn attr<'p>(proto: &'p crate::proto::NodeProto, name: &str) -> Option<&'p AttributeProto> {
    proto.attribute.iter().find(|a| a.name() == name)
}

fn stamp(proto: &crate::proto::NodeProto) -> Option<&str> {
    proto
        .metadata_props
        .iter()
        .find(|p| p.key() == PASS_KEY)
        .map(|p| p.value())
}

/// Whether input `slot` of `node` is read without regard to its element type.
fn any_type_slot(model: &Model, node: NodeId, slot: usize) -> bool {
    let p = &model.node(node).proto;
    match p.op_type() {
        "Shape" | "Size" => true,
        "Cast" => attr(p, "to").map(|a| a.i() as i32) != Some(FLOAT),
        "CastLike" => slot == 0,
        _ => false,
    }
}

/// Whether input `slot` of `node` is float32 whatever the node computes in: the schema
/// types it `tensor(float)` alone (Resize's and Upsample's scales).
fn float32_slot(model: &Model, node: NodeId, slot: usize) -> bool {
    let p = &model.node(node).proto;
    let plain = p.domain().is_empty() || p.domain() == "ai.onnx";
    plain
        && match p.op_type() {
            "Resize" => slot == 2,
            "Upsample" => slot == 1,
            _ => false,
        }
}

impl<'a> Analysis<'a> {
    fn new(
        model: &'a Model,
        pass: &'a Precision,
        weak_inputs: HashSet<String>,
        seed: Option<String>,
    ) -> Result<Self, PassError> {
        let mut a = Analysis {
            model,
            pass,
            opset: model.opset("").unwrap_or(1),
            weak_inputs,
            seed,
            // Captures of subgraphs count as reads.
            order: crate::ir::topological_order(model, BodyId::MAIN),
            elem: HashMap::new(),
            class: HashMap::new(),
            mode: HashMap::new(),
        };
        a.infer_types()?;
        Ok(a)
    }

    /// Element types of every main-graph value; refuses graphs that already compute in
    /// half.
    fn infer_types(&mut self) -> Result<(), PassError> {
        let model = self.model;
        let main = model.main();
        let sources: Vec<ValueId> = main
            .inputs
            .iter()
            .map(|(v, _)| *v)
            .chain(main.initializers.iter().map(|(v, _)| *v))
            .collect();
        for v in sources {
            if let Some(e) = declared_elem(model, v) {
                self.elem.insert(v, e);
            }
        }
        for &n in &self.order {
            let node = model.node(n);
            for (slot, out) in node.outputs.iter().enumerate() {
                let Some(out) = *out else { continue };
                if let Some(e) = declared_elem(model, out).or_else(|| self.rule(n, slot)) {
                    self.elem.insert(out, e);
                }
            }
        }
        if let Some((v, e)) = self
            .elem
            .iter()
            .filter(|(_, e)| matches!(**e, FLOAT16 | BFLOAT16))
            .min_by_key(|(v, _)| **v)
        {
            return Err(fail(format!(
                "value '{}' is already {}: precision converts float32 graphs, once (a model stored in half precision trains in it without --precision, its parameters as float32 masters)",
                model.name(*v),
                crate::ir::print::elem_type_name(*e)
            )));
        }
        Ok(())
    }

    /// The element type of output `slot` of `n` from its op's rule (`ir::dtype`), with the
    /// types found so far.
    fn rule(&self, n: NodeId, slot: usize) -> Option<i32> {
        let node = self.model.node(n);
        let input = |i: usize| {
            node.inputs
                .get(i)
                .copied()
                .flatten()
                .and_then(|v| self.elem.get(&v).copied())
        };
        let branch_output = |s: usize| {
            node.subgraphs
                .first()
                .and_then(|sub| self.model.body(sub.body).outputs.get(s))
                .and_then(
                    |(v, info)| match info.r#type.as_ref().and_then(|t| t.tensor_elem()) {
                        Some(e) => Some(e),
                        None => declared_elem(self.model, *v),
                    },
                )
        };
        crate::ir::dtype::output_elem(&node.proto, slot, input, branch_output)
    }

    fn is_float(&self, v: ValueId) -> bool {
        self.elem.get(&v) == Some(&FLOAT)
    }

    /// The float inputs of `n` whose type matters, by slot.
    fn float_inputs(&self, n: NodeId) -> Vec<(usize, ValueId)> {
        self.model
            .node(n)
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(slot, v)| v.map(|v| (slot, v)))
            .filter(|(slot, v)| {
                self.is_float(*v)
                    && !any_type_slot(self.model, n, *slot)
                    && !float32_slot(self.model, n, *slot)
            })
            .collect()
    }

    fn float_outputs(&self, n: NodeId) -> Vec<ValueId> {
        self.model
            .node(n)
            .outputs
            .iter()
            .flatten()
            .copied()
            .filter(|v| self.is_float(*v))
            .collect()
    }

    /// How a float node computes before promotion: fixed, half op, promoted or weak source.
    fn kind(&self, n: NodeId) -> Mode {
        let node = self.model.node(n);
        let p = &node.proto;
        let (domain, op) = (p.domain(), p.op_type());
        let float_in = self.float_inputs(n);
        let float_out = self.float_outputs(n);
        if float_in.is_empty() && float_out.is_empty() {
            return Mode::Untouched;
        }
        if !node.subgraphs.is_empty() || stamp(p).is_some_and(|s| STATE_PASSES.contains(&s)) {
            return Mode::Fixed(Prec::F32, Why::State);
        }
        if self.pass.keep.contains(op) {
            return Mode::Fixed(Prec::F32, Why::Keep);
        }
        if !self.pass.half_capable(domain, op, self.opset) {
            return Mode::Fixed(Prec::F32, Why::NoHalfType);
        }
        // A float value of unknown type would keep float32 under a half node.
        let unknown_input = node.inputs.iter().enumerate().any(|(slot, v)| {
            v.is_some_and(|v| !self.elem.contains_key(&v)) && !any_type_slot(self.model, n, slot)
        });
        let unknown_output = node
            .outputs
            .iter()
            .flatten()
            .any(|v| !self.elem.contains_key(v));
        if unknown_input || unknown_output {
            return Mode::Fixed(Prec::F32, Why::UnknownType);
        }
        let weak_source = match op {
            "Constant" | "ConstantOfShape" => true,
            // Cast(non-float -> FLOAT); a float -> FLOAT cast follows its input.
            "Cast" => float_in.is_empty(),
            _ => false,
        };
        if weak_source {
            return Mode::Pending;
        }
        if HALF_OPS.contains(&op) {
            return Mode::Fixed(Prec::Half, Why::HalfOp);
        }
        // Promotion: float32 outvotes half; weak values do not vote.
        let classes: Vec<Class> = float_in
            .iter()
            .map(|(_, v)| {
                self.class
                    .get(v)
                    .copied()
                    .unwrap_or(Class::Strong(Prec::F32))
            })
            .collect();
        for p in [Prec::F32, Prec::Half] {
            if classes.contains(&Class::Strong(p)) {
                return Mode::Fixed(p, Why::Promoted);
            }
        }
        Mode::Pending
    }

    /// Forward over the topological order: each float node's mode and its outputs' class.
    fn classify(&mut self) {
        let model = self.model;
        let main = model.main();
        for (v, _) in &main.inputs {
            let class = if self.weak_inputs.contains(model.name(*v)) {
                Class::Weak
            } else {
                Class::Strong(Prec::F32)
            };
            self.class.insert(*v, class);
        }
        for (v, _) in &main.initializers {
            let class = if self.seed.as_deref() == Some(model.name(*v)) {
                Class::Strong(Prec::F32)
            } else {
                Class::Weak
            };
            self.class.entry(*v).or_insert(class);
        }
        for i in 0..self.order.len() {
            let n = self.order[i];
            let mode = self.kind(n);
            self.mode.insert(n, mode);
            for out in model.node(n).outputs.iter().flatten() {
                let class = match mode {
                    Mode::Pending => Class::Weak,
                    Mode::Fixed(p, _) => Class::Strong(p),
                    Mode::Untouched => Class::Strong(Prec::F32),
                };
                self.class.insert(*out, class);
            }
        }
    }

    /// The precision a reader wants for a value (`None`: any).
    fn want(&self, u: Use) -> Option<Prec> {
        match u {
            Use::Output { .. } => Some(Prec::F32),
            Use::Node { node, slot } => {
                if self.model.node(node).body != BodyId::MAIN {
                    return Some(Prec::F32);
                }
                if any_type_slot(self.model, node, slot) {
                    return None;
                }
                if float32_slot(self.model, node, slot) {
                    return Some(Prec::F32);
                }
                match self.mode.get(&node) {
                    Some(Mode::Fixed(p, _)) => Some(*p),
                    Some(Mode::Untouched) => None,
                    // A reader not yet decided (only in a cyclic graph): float32.
                    Some(Mode::Pending) | None => Some(Prec::F32),
                }
            }
        }
    }

    /// Backward over the topological order: a weak node computes in float32 when any
    /// reader wants float32, else in half when any wants half, else float32.
    fn resolve_weak(&mut self) {
        for i in (0..self.order.len()).rev() {
            let n = self.order[i];
            if self.mode.get(&n) != Some(&Mode::Pending) {
                continue;
            }
            let wants: Vec<Prec> = self
                .float_outputs(n)
                .into_iter()
                .flat_map(|v| self.model.uses(v).to_vec())
                .filter_map(|u| self.want(u))
                .collect();
            let p = if wants.contains(&Prec::F32) || wants.is_empty() {
                Prec::F32
            } else {
                Prec::Half
            };
            self.mode.insert(n, Mode::Fixed(p, Why::Weak));
        }
    }

    fn finish(self) -> Plan {
        let mut half_values = HashSet::new();
        for &n in &self.order {
            if let Some(Mode::Fixed(Prec::Half, _)) = self.mode.get(&n) {
                half_values.extend(self.float_outputs(n));
            }
        }
        Plan {
            order: self.order,
            mode: self.mode,
            elem: self.elem,
            half_values,
            opset: self.opset,
        }
    }
}

// ---- rewrite ----------------------------------------------------------------------------

/// `t` (float32) as the half type; also the count of finite values that became infinite.
fn tensor_to_half(t: &TensorProto, dtype: HalfType) -> Result<(TensorProto, usize), String> {
    if t.data_type() != FLOAT {
        return Err(format!(
            "is {}, not float",
            crate::ir::print::elem_type_name(t.data_type())
        ));
    }
    let values: Vec<f32> = match &t.raw_data {
        Some(raw) => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect(),
        None => t.float_data.clone(),
    };
    let count = t.dims.iter().product::<i64>().max(0) as usize;
    if values.len() != count {
        return Err(format!(
            "holds {} values for dims {:?} (external data is not supported)",
            values.len(),
            t.dims
        ));
    }
    let mut raw = Vec::with_capacity(2 * count);
    let mut overflowed = 0;
    for x in values {
        let (bits, finite) = dtype.bits(x);
        if x.is_finite() && !finite {
            overflowed += 1;
        }
        raw.extend(bits.to_le_bytes());
    }
    Ok((
        TensorProto {
            dims: t.dims.clone(),
            data_type: Some(dtype.elem_type()),
            raw_data: Some(raw),
            name: t.name.clone(),
            ..Default::default()
        },
        overflowed,
    ))
}

struct Rewriter<'m> {
    model: &'m mut Model,
    dtype: HalfType,
    converted: HashMap<(ValueId, Prec), ValueId>,
    casts: usize,
    constants: usize,
    overflowed: usize,
}

impl Rewriter<'_> {
    fn elem(&self, p: Prec) -> i32 {
        match p {
            Prec::F32 => FLOAT,
            Prec::Half => self.dtype.elem_type(),
        }
    }

    fn suffix(&self, p: Prec) -> &'static str {
        match p {
            Prec::F32 => "fp32",
            Prec::Half => self.dtype.as_str(),
        }
    }

    /// `v` in precision `p`: a converted constant, or a (shared) cast in the main graph.
    fn convert(&mut self, v: ValueId, p: Prec) -> Result<ValueId, PassError> {
        if let Some(c) = self.converted.get(&(v, p)) {
            return Ok(*c);
        }
        let hint = format!("{}.{}", self.model.name(v), self.suffix(p));
        let constant = matches!(self.model.value(v).def, ValueDef::Initializer { body } if body == BodyId::MAIN);
        let c = match (p, constant.then(|| self.model.initializer(v)).flatten()) {
            (Prec::Half, Some(t)) => {
                let (t, overflowed) = tensor_to_half(t, self.dtype)
                    .map_err(|m| fail(format!("constant '{}' {m}", self.model.name(v))))?;
                self.constants += 1;
                self.overflowed += overflowed;
                self.model.add_initializer(BodyId::MAIN, &hint, t)
            }
            _ => {
                self.casts += 1;
                let to = self.elem(p) as i64;
                let cast = Builder::new(self.model, BodyId::MAIN, PASS).op(
                    "Cast",
                    &[v],
                    vec![attr_int("to", to)],
                    &hint,
                );
                // The cast keeps its source's shape: declare it, so that later lowerings
                // that need a rank (FusedMatMul's transposes for tract) find it.
                if let Some(mut ty) = self.model.value_type(v) {
                    if let Some(crate::proto::type_proto::Value::TensorType(t)) = &mut ty.value {
                        t.elem_type = Some(to as i32);
                        self.model.set_value_type(cast, ty);
                    }
                }
                cast
            }
        };
        self.converted.insert((v, p), c);
        Ok(c)
    }

    /// Makes node `n` produce half: its `to`, `value` attributes.
    fn retarget(&mut self, n: NodeId) -> Result<(), PassError> {
        let half = self.dtype.elem_type();
        let dtype = self.dtype;
        let node_name = self.model.node(n).proto.name().to_string();
        let proto = &mut self.model.node_mut(n).proto;
        let bad = |m: String| fail(format!("node '{node_name}': {m}"));
        match proto.op_type() {
            "Cast" => {
                for a in proto.attribute.iter_mut().filter(|a| a.name() == "to") {
                    a.i = Some(half as i64);
                }
            }
            "ConstantOfShape" => {
                let zero = TensorProto {
                    dims: vec![1],
                    data_type: Some(FLOAT),
                    raw_data: Some(0f32.to_le_bytes().to_vec()),
                    ..Default::default()
                };
                let value = attr(proto, "value")
                    .and_then(|a| a.t.clone())
                    .unwrap_or(zero);
                let (t, overflowed) =
                    tensor_to_half(&value, dtype).map_err(|m| bad(format!("value {m}")))?;
                self.overflowed += overflowed;
                proto.attribute.retain(|a| a.name() != "value");
                proto.attribute.push(attr_tensor("value", t));
            }
            "Constant" => {
                let value = proto.attribute.iter().find_map(|a| match a.name() {
                    "value" => a.t.clone(),
                    "value_float" => Some(crate::ir::builder::tensor_f32(&[], &[a.f()])),
                    "value_floats" => Some(crate::ir::builder::tensor_f32(
                        &[a.floats.len() as i64],
                        &a.floats,
                    )),
                    _ => None,
                });
                let value = value.ok_or_else(|| bad("a Constant without a float value".into()))?;
                let (t, overflowed) =
                    tensor_to_half(&value, dtype).map_err(|m| bad(format!("value {m}")))?;
                self.overflowed += overflowed;
                proto
                    .attribute
                    .retain(|a| !matches!(a.name(), "value" | "value_float" | "value_floats"));
                proto.attribute.push(AttributeProto {
                    name: Some("value".into()),
                    r#type: Some(AttributeType::Tensor as i32),
                    t: Some(t),
                    ..Default::default()
                });
            }
            _ => {}
        }
        Ok(())
    }
}

fn rewrite(model: &mut Model, dtype: HalfType, plan: Plan) -> Result<PassReport, PassError> {
    let precision_of = |v: ValueId| {
        if plan.half_values.contains(&v) {
            Prec::Half
        } else {
            Prec::F32
        }
    };
    let mut r = Rewriter {
        model,
        dtype,
        converted: HashMap::new(),
        casts: 0,
        constants: 0,
        overflowed: 0,
    };
    let mut counts: HashMap<(Prec, Why), usize> = HashMap::new();

    // Every main-graph node reads its float inputs in its own precision.
    for &n in &plan.order {
        let Some(Mode::Fixed(p, why)) = plan.mode.get(&n).copied() else {
            continue;
        };
        *counts.entry((p, why)).or_default() += 1;
        if p == Prec::Half {
            r.retarget(n)?;
        }
        let inputs: Vec<(usize, ValueId)> = r
            .model
            .node(n)
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(slot, v)| v.map(|v| (slot, v)))
            .collect();
        for (slot, v) in inputs {
            if plan.elem.get(&v) != Some(&FLOAT) || any_type_slot(r.model, n, slot) {
                continue;
            }
            let want = if float32_slot(r.model, n, slot) {
                Prec::F32
            } else {
                p
            };
            if precision_of(v) != want {
                let c = r.convert(v, want)?;
                r.model.set_input(n, slot, Some(c));
            }
        }
    }

    // Half values read outside the main graph's compute: subgraphs and graph outputs.
    let mut half: Vec<ValueId> = plan.half_values.iter().copied().collect();
    half.sort();
    for v in half {
        for u in r.model.uses(v).to_vec() {
            match u {
                Use::Node { node, slot } if r.model.node(node).body != BodyId::MAIN => {
                    let c = r.convert(v, Prec::F32)?;
                    r.model.set_input(node, slot, Some(c));
                }
                Use::Output { body, index } if body != BodyId::MAIN => {
                    let c = r.convert(v, Prec::F32)?;
                    r.model.set_output(body, index, c);
                }
                Use::Output { body, index } => {
                    // A graph output keeps its name and float32 type: the cast takes both
                    // (once, should the value be listed as an output twice).
                    let renamed = r.converted.contains_key(&(v, Prec::F32))
                        && r.model
                            .body(body)
                            .outputs
                            .iter()
                            .any(|(o, _)| r.converted.get(&(v, Prec::F32)) == Some(o));
                    let c = r.convert(v, Prec::F32)?;
                    r.model.set_output(body, index, c);
                    if !renamed {
                        let name = r.model.name(v).to_string();
                        let retired = r.model.names.fresh(&format!("{name}.{}", dtype.as_str()));
                        r.model.values[v.0 as usize].name = retired;
                        r.model.values[c.0 as usize].name = name;
                    }
                }
                Use::Node { .. } => {}
            }
        }
    }

    // Declared types of values now computed in half.
    let half_elem = dtype.elem_type();
    for (v, info) in &mut r.model.body_mut(BodyId::MAIN).value_info {
        if plan.half_values.contains(v) {
            if let Some(type_proto::Value::TensorType(t)) =
                info.r#type.as_mut().and_then(|t| t.value.as_mut())
            {
                t.elem_type = Some(half_elem);
            }
        }
    }

    let count = |p: Prec, why: &[Why]| -> usize {
        why.iter()
            .map(|w| counts.get(&(p, *w)).copied().unwrap_or(0))
            .sum()
    };
    let half_nodes = count(Prec::Half, &[Why::HalfOp, Why::Promoted, Why::Weak]);
    let kept = count(Prec::F32, &[Why::Keep]);
    let promoted = count(Prec::F32, &[Why::Promoted, Why::Weak]);
    let no_type = count(Prec::F32, &[Why::NoHalfType, Why::UnknownType]);
    let name = dtype.as_str();
    let mut notes = vec![
        format!(
            "{half_nodes} compute nodes in {name}; float32: {kept} block-listed, {promoted} by promotion, {no_type} without {name} at opset {}",
            plan.opset
        ),
        format!(
            "{} casts, {} constants converted",
            r.casts, r.constants
        ),
    ];
    if r.overflowed > 0 {
        notes.push(format!(
            "{} constant values beyond the {name} range became infinite",
            r.overflowed
        ));
    }
    Ok(PassReport {
        changed: half_nodes > 0 || r.casts > 0,
        added: r.casts,
        removed: 0,
        notes,
    })
}
