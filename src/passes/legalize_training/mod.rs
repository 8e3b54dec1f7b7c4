//! `legalize-training`: lowers the ops of ONNX's own training domain,
//! `ai.onnx.preview.training`, to standard ONNX ops (default domain only), so that standard
//! ONNX Runtime, which registers none of them, runs the model with the same inputs and
//! outputs. One file per op; each opens with the op's math, as the ONNX operator spec
//! (`onnx/defs/training/defs.cc`) and its reference implementation state it.
//!
//! - `Adam`, `Adagrad`, `Momentum`: one optimizer step over any number of tensors
//!   (variadic inputs `R, T, X1..Xn, G1..Gn, [V1..Vn], [H1..Hn]`, outputs `X1_new..Xn_new,
//!   ...`), every attribute implemented. They are functional (no in-place state): every
//!   output keeps its value and, as a graph output, its name.
//! - `Gradient`: needs onnx-ga's reverse-mode autodiff (`gradient.rs`).
//!
//! Types, as the spec constrains them: `R` is float or double (T1), `T` int64 (T2), the
//! optimized tensors float or double (T3), possibly another type than `R`. The scalar
//! factors that depend on `R` and `T` (bias corrections, learning-rate decay) are computed
//! once per node in double, as the reference implementation's numpy does, and rounded once to
//! T3; the per-element math runs in T3 with the attributes rounded to T3. An attribute
//! that makes a term vanish (`norm_coefficient = 0`, `decay_factor = 0`, `beta = 1`, ...)
//! emits no node for it.
//!
//! Contract of a lowering (as in `legalize-ort`): it emits standard nodes computing every
//! used output of the node and moves the uses there; this module removes the node. An
//! attribute or input outside the spec is an error naming the node, the op and what is
//! wrong; a silently wrong graph is never an option.

mod adagrad;
mod adam;
mod gradient;
mod momentum;

use std::collections::HashMap;
use std::path::Path;

use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, tensor_i64, Builder, NodeAttributes};
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::proto::{AttributeProto, TensorProto};
use crate::signature::{ExplicitRoles, SignatureError, TrainingGraph};

pub const PASS: &str = "legalize-training";

/// The domain of ONNX's training ops.
pub const DOMAIN: &str = "ai.onnx.preview.training";

/// The default-domain opset imported when a model declares none (the backend test models
/// of these ops import only the training domain). 13 is the newest IR version 7 allows; every
/// op the lowerings emit has had its current form since opset 9.
const DEFAULT_OPSET: i64 = 13;
const MIN_IR_VERSION: i64 = 7;
/// `Where`, and `Greater` on int64, exist from opset 9.
const MIN_OPSET: i64 = 9;

pub(super) use crate::proto::elem::{DOUBLE, FLOAT, INT64};

type LowerFn = fn(&mut Lowering<'_, '_>, NodeId) -> Result<(), PassError>;

/// The lowering of each op of the domain.
const LOWERINGS: &[(&str, LowerFn)] = &[
    ("Gradient", gradient::lower_gradient),
    ("Adam", adam::lower),
    ("Adagrad", adagrad::lower),
    ("Momentum", momentum::lower),
];

#[derive(Clone, Debug, Default)]
pub struct LegalizeTraining;

impl LegalizeTraining {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&[])?;
        Ok(LegalizeTraining)
    }
}

impl Pass for LegalizeTraining {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(
        &mut self,
        model: &mut Model,
        _cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        lower_model(model)
    }
}

/// The pass's work on `model`: every node of the training domain lowered, the domain's
/// opset import dropped once nothing uses it.
pub fn lower_model(model: &mut Model) -> Result<PassReport, PassError> {
    let mut report = PassReport::default();
    let is_training = |model: &Model, n: NodeId| {
        crate::ir::normalize_domain(model.node(n).proto.domain()) == DOMAIN
    };
    // Gradient first: it differentiates the graph as written, before the optimizers that
    // consume its outputs are rewritten.
    let mut targets: Vec<NodeId> = model
        .all_nodes()
        .filter(|n| is_training(model, *n))
        .collect();
    targets.sort_by_key(|n| model.node(*n).proto.op_type() != "Gradient");
    if !targets.is_empty() {
        ensure_default_opset(model, targets[0])?;
    }
    let mut constants = HashMap::new();
    for node in targets {
        let op = model.node(node).proto.op_type().to_string();
        let Some((_, lower)) = LOWERINGS.iter().find(|(o, _)| *o == op) else {
            return Err(node_error(
                model,
                node,
                format!(
                    "no lowering to standard ONNX exists for this op (lowered: {})",
                    LOWERINGS
                        .iter()
                        .map(|(o, _)| *o)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        let body = model.node(node).body;
        let mut lowering = Lowering {
            b: Builder::new(model, body, PASS),
            constants: &mut constants,
        };
        lower(&mut lowering, node)?;
        report.added += lowering.b.added;
        model
            .remove_node(node)
            .map_err(|e| node_error(model, node, format!("lowering left an output in use: {e}")))?;
        report.removed += 1;
        report.changed = true;
    }
    if drop_training_opset(model) {
        report.changed = true;
        report
            .notes
            .push(format!("dropped the {DOMAIN} opset import"));
    }
    Ok(report)
}

/// The emitted ops need the default domain at opset 9 or newer: imported when the model
/// declares none (raising an older IR version to 7), an error naming `node` when it
/// declares an older one (raising it would change the meaning of the model's other ops).
fn ensure_default_opset(model: &mut Model, node: NodeId) -> Result<(), PassError> {
    match model.opset("") {
        Some(v) if v >= MIN_OPSET => Ok(()),
        Some(v) => Err(node_error(
            model,
            node,
            format!(
                "the model imports the default domain at opset {v}; the lowering emits Where and \
                 int64 Greater, which need opset {MIN_OPSET} or newer"
            ),
        )),
        None => {
            model.require_opset("", DEFAULT_OPSET);
            if model.header.ir_version() < MIN_IR_VERSION {
                model.header.ir_version = Some(MIN_IR_VERSION);
            }
            Ok(())
        }
    }
}

/// Drops the training domain's opset import when no node (and no model-local function)
/// uses the domain any more. True when it did.
fn drop_training_opset(model: &mut Model) -> bool {
    let used = model
        .all_nodes()
        .any(|n| crate::ir::normalize_domain(model.node(n).proto.domain()) == DOMAIN)
        || model
            .header
            .functions
            .iter()
            .any(|f| f.domain() == DOMAIN || f.node.iter().any(|n| n.domain() == DOMAIN));
    let before = model.header.opset_import.len();
    if !used {
        model.header.opset_import.retain(|o| o.domain() != DOMAIN);
    }
    model.header.opset_import.len() != before
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

/// True when every pass of the pipeline `spec` works on the graph alone and reads no training
/// roles (loss, parameters, gradients): `legalize-training` and `dce`.
pub fn reads_no_signature(spec: &str) -> bool {
    match super::parse_spec(spec) {
        Ok(passes) => {
            !passes.is_empty()
                && passes
                    .iter()
                    .all(|p| matches!(p.pass.as_str(), PASS | "dce"))
        }
        Err(_) => false,
    }
}

/// Opens `path` for the pipeline `spec`, as [`crate::signature::open`] does, except that a
/// single `.onnx` file whose training signature cannot be made out (a plain model, no roles
/// given) is accepted as it is when the pipeline reads no signature
/// ([`reads_no_signature`]): a plain signature with every graph input as data and no loss
/// or parameters. So `rewrite MODEL.onnx --pipeline legalize-training -o OUT.onnx` works on
/// any model; artifacts folders, ORT training graphs and steps open as usual.
pub fn open_for_pipeline(
    path: &Path,
    roles: &ExplicitRoles,
    spec: &str,
) -> Result<TrainingGraph, SignatureError> {
    let unsigned_ok = path.is_file()
        && roles.loss.is_none()
        && roles.seed.is_none()
        && roles.grads.is_empty()
        && reads_no_signature(spec);
    if !unsigned_ok {
        return crate::signature::open(path, roles);
    }
    let proto = crate::model::load_model_with_data(path)?;
    match crate::signature::from_model(proto.clone(), roles, path) {
        Ok(graph) => Ok(graph),
        Err(SignatureError::Inconsistent { .. }) => Ok(unsigned(proto, path)),
        Err(e) => Err(e),
    }
}

/// `proto` with a signature saying nothing but its data inputs.
fn unsigned(proto: crate::proto::ModelProto, path: &Path) -> TrainingGraph {
    crate::signature::without_roles(
        proto,
        crate::signature::Source::Plain {
            file: path.to_path_buf(),
        },
    )
}

/// What a lowering works with: a builder in the node's body and the scalar constants
/// minted so far in this run of the pass (one initializer per body, type and value).
pub struct Lowering<'m, 'c> {
    pub b: Builder<'m>,
    constants: &'c mut Constants,
}

/// Constants minted in one run of the pass, by (body, element type, dims, bytes).
type Constants = HashMap<(BodyId, i32, Vec<i64>, Vec<u8>), ValueId>;

impl Lowering<'_, '_> {
    pub fn model(&self) -> &Model {
        self.b.model
    }

    pub fn error(&self, node: NodeId, message: String) -> PassError {
        node_error(self.model(), node, message)
    }

    /// A required float attribute (Momentum has no defaults).
    pub fn required_float(&self, node: NodeId, name: &str) -> Result<f32, PassError> {
        self.float_attr(node, name)?
            .ok_or_else(|| self.error(node, format!("required attribute '{name}' is missing")))
    }

    pub fn float_attr(&self, node: NodeId, name: &str) -> Result<Option<f32>, PassError> {
        self.model()
            .node(node)
            .proto
            .attr_float(name)
            .map_err(|m| self.error(node, m))
    }

    pub fn string_attr(&self, node: NodeId, name: &str) -> Result<Option<String>, PassError> {
        self.model()
            .node(node)
            .proto
            .attr_string(name)
            .map_err(|m| self.error(node, m))
    }

    /// Fails on attributes the op does not define, so a misspelt one never silently keeps
    /// its default.
    pub fn only_attributes(&self, node: NodeId, known: &[&str]) -> Result<(), PassError> {
        match self
            .model()
            .node(node)
            .proto
            .attribute
            .iter()
            .find(|a| !known.contains(&a.name()))
        {
            Some(a) => Err(self.error(
                node,
                format!(
                    "unknown attribute '{}' (the op defines: {})",
                    a.name(),
                    known.join(", ")
                ),
            )),
            None => Ok(()),
        }
    }

    /// The declared element type of `v`, if any.
    pub fn elem_type(&self, v: ValueId) -> Option<i32> {
        self.model().value_type(v)?.tensor_elem()
    }

    /// The declared rank of `v`, if any.
    pub fn rank(&self, v: ValueId) -> Option<usize> {
        Some(self.model().value_type(v)?.tensor_dims()?.len())
    }

    /// The optimizer's operands, split by its variadic layout: `R`, `T`, then `per_tensor`
    /// groups of n tensors each (`X1..Xn, G1..Gn, ...`); outputs are `outputs_per_tensor`
    /// groups of n (`X1_new..Xn_new, ...`), trailing or empty ones omitted.
    pub fn optimizer_operands(
        &self,
        node: NodeId,
        per_tensor: &[&str],
        outputs_per_tensor: &[&str],
    ) -> Result<Operands, PassError> {
        let n = self.model().node(node);
        let layout = || {
            let inputs: Vec<String> = per_tensor.iter().map(|s| format!("{s}1..{s}n")).collect();
            let outputs: Vec<String> = outputs_per_tensor
                .iter()
                .map(|s| format!("{s}1_new..{s}n_new"))
                .collect();
            format!(
                "inputs R, T, {}; outputs {}",
                inputs.join(", "),
                outputs.join(", ")
            )
        };
        let k = per_tensor.len();
        if n.inputs.len() < 2 + k || !(n.inputs.len() - 2).is_multiple_of(k) {
            return Err(self.error(
                node,
                format!(
                    "{} inputs do not fit the op's layout ({}, n >= 1)",
                    n.inputs.len(),
                    layout()
                ),
            ));
        }
        let count = (n.inputs.len() - 2) / k;
        if n.outputs.len() > outputs_per_tensor.len() * count {
            return Err(self.error(
                node,
                format!(
                    "{} outputs for {count} optimized tensors: at most {} ({})",
                    n.outputs.len(),
                    outputs_per_tensor.len() * count,
                    layout()
                ),
            ));
        }
        let mut inputs = Vec::with_capacity(n.inputs.len());
        for (slot, v) in n.inputs.iter().enumerate() {
            let name = match slot {
                0 => "R".to_string(),
                1 => "T".to_string(),
                s => format!("{}{}", per_tensor[(s - 2) / count], (s - 2) % count + 1),
            };
            inputs.push(v.ok_or_else(|| {
                self.error(
                    node,
                    format!("input {slot} ({name}) is required but absent"),
                )
            })?);
        }
        let outputs = (0..outputs_per_tensor.len() * count)
            .map(|slot| {
                n.outputs
                    .get(slot)
                    .copied()
                    .flatten()
                    .filter(|v| !self.model().uses(*v).is_empty())
            })
            .collect();
        let r = inputs[0];
        let t = inputs[1];
        if let Some(e) = self.elem_type(r).filter(|e| !matches!(*e, FLOAT | DOUBLE)) {
            return Err(self.type_error(node, r, "R", e, "float or double"));
        }
        if let Some(e) = self.elem_type(t).filter(|e| *e != INT64) {
            return Err(self.type_error(node, t, "T", e, "int64"));
        }
        Ok(Operands {
            r,
            t,
            count,
            inputs: inputs[2..].to_vec(),
            outputs,
        })
    }

    fn type_error(&self, node: NodeId, v: ValueId, role: &str, elem: i32, want: &str) -> PassError {
        self.error(
            node,
            format!(
                "input {role} ('{}') has element type {}; the op takes {want}",
                self.model().name(v),
                crate::ir::print::elem_type_name(elem)
            ),
        )
    }

    /// The element type T3 of optimized tensor `i`: what its inputs and outputs declare (they
    /// must agree, float or double), float when none declares one (a wrong guess fails when
    /// the runtime loads the model, never silently).
    pub fn tensor_type(&self, node: NodeId, ops: &Operands, i: usize) -> Result<i32, PassError> {
        let n = self.model().node(node);
        let values = ops
            .group(i)
            .chain(
                (0..ops.outputs.len() / ops.count)
                    .filter_map(|g| n.outputs.get(g * ops.count + i).copied().flatten()),
            )
            .collect::<Vec<_>>();
        let mut found: Option<(i32, ValueId)> = None;
        for v in values {
            let Some(e) = self.elem_type(v) else { continue };
            if !matches!(e, FLOAT | DOUBLE) {
                return Err(self.error(
                    node,
                    format!(
                        "'{}' has element type {}; the op optimizes float or double tensors",
                        self.model().name(v),
                        crate::ir::print::elem_type_name(e)
                    ),
                ));
            }
            match found {
                Some((f, other)) if f != e => {
                    return Err(self.error(
                        node,
                        format!(
                            "'{}' is {} but '{}' is {}: the tensors of one optimized variable share a type",
                            self.model().name(other),
                            crate::ir::print::elem_type_name(f),
                            self.model().name(v),
                            crate::ir::print::elem_type_name(e)
                        ),
                    ))
                }
                Some(_) => {}
                None => found = Some((e, v)),
            }
        }
        Ok(found.map(|(e, _)| e).unwrap_or(FLOAT))
    }

    /// An initializer holding `tensor`, shared with every other request for the same value
    /// in this body.
    fn constant(&mut self, hint: &str, tensor: TensorProto) -> ValueId {
        let key = (
            self.b.body,
            tensor.data_type(),
            tensor.dims.clone(),
            tensor.raw_data.clone().unwrap_or_default(),
        );
        if let Some(v) = self.constants.get(&key) {
            return *v;
        }
        let v = self.b.model.add_initializer(self.b.body, hint, tensor);
        self.constants.insert(key, v);
        v
    }

    /// A rank-0 constant `value` of float type `elem` (float or double).
    pub fn scalar(&mut self, hint: &str, elem: i32, value: f64) -> ValueId {
        let raw = match elem {
            DOUBLE => value.to_le_bytes().to_vec(),
            _ => (value as f32).to_le_bytes().to_vec(),
        };
        let tensor = TensorProto {
            data_type: Some(if elem == DOUBLE { DOUBLE } else { FLOAT }),
            raw_data: Some(raw),
            ..Default::default()
        };
        self.constant(hint, tensor)
    }

    /// A rank-0 int64 constant.
    pub fn scalar_i64(&mut self, hint: &str, value: i64) -> ValueId {
        self.constant(hint, tensor_i64(&[], &[value]))
    }

    /// `v` as a rank-0 tensor: itself when declared rank 0, else `Reshape(v, [])` (the spec's
    /// `R` and `T` are scalars; a `[1]` would widen rank-0 outputs, more elements fail at run
    /// time).
    pub fn scalar_of(&mut self, v: ValueId, hint: &str) -> ValueId {
        if self.rank(v) == Some(0) {
            return v;
        }
        let shape = self.constant("rank0", tensor_i64(&[0], &[]));
        self.op("Reshape", &[v, shape], vec![], hint)
    }

    /// `x` as element type `to`; `x` itself when it is declared with that type.
    pub fn cast(&mut self, x: ValueId, to: i32, hint: &str) -> ValueId {
        if self.elem_type(x) == Some(to) {
            return x;
        }
        self.op("Cast", &[x], vec![attr_int("to", to as i64)], hint)
    }

    /// `x`, of element type `from`, as element type `to`.
    pub fn convert(&mut self, x: ValueId, from: i32, to: i32, hint: &str) -> ValueId {
        if from == to {
            return x;
        }
        self.op("Cast", &[x], vec![attr_int("to", to as i64)], hint)
    }

    /// A default-domain node with one output.
    pub fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId {
        self.b.op(op_type, inputs, attributes, hint)
    }

    /// `T > 0`, the spec's test for "not the first iteration".
    pub fn after_first_step(&mut self, t: ValueId) -> ValueId {
        let zero = self.scalar_i64("zero_i64", 0);
        self.op("Greater", &[t, zero], vec![], "T_positive")
    }

    /// Output `slot` of `node` now carries `value` (a graph output keeps its name).
    pub fn replace(&mut self, node: NodeId, slot: usize, value: ValueId) {
        if let Some(old) = self.model().node(node).outputs.get(slot).copied().flatten() {
            self.b.model.replace_value(old, value);
        }
    }

    /// The name of `v`, for hints.
    pub fn name(&self, v: ValueId) -> String {
        self.model().name(v).to_string()
    }
}

/// An optimizer node's operands (see [`Lowering::optimizer_operands`]).
pub struct Operands {
    pub r: ValueId,
    pub t: ValueId,
    /// n, the number of optimized tensors.
    pub count: usize,
    /// The per-tensor inputs, `X1..Xn, G1..Gn, ...`.
    inputs: Vec<ValueId>,
    /// Each output slot, `None` when absent or unused.
    outputs: Vec<Option<ValueId>>,
}

impl Operands {
    /// Per-tensor input `role` (0 = X, 1 = G, ...) of tensor `i`.
    pub fn input(&self, role: usize, i: usize) -> ValueId {
        self.inputs[role * self.count + i]
    }

    /// The inputs of tensor `i`: `Xi, Gi, ...`.
    fn group(&self, i: usize) -> impl Iterator<Item = ValueId> + '_ {
        (0..self.inputs.len() / self.count).map(move |role| self.input(role, i))
    }

    /// The output slot of output `role` (0 = X_new, ...) of tensor `i`.
    pub fn slot(&self, role: usize, i: usize) -> usize {
        role * self.count + i
    }

    /// True when output `role` of tensor `i` is present and used.
    pub fn used(&self, role: usize, i: usize) -> bool {
        self.outputs
            .get(self.slot(role, i))
            .is_some_and(|o| o.is_some())
    }
}

/// A scalar of a node's lowering made once per element type that asks for it (the
/// optimized tensors of one node may differ in type).
#[derive(Default)]
pub struct PerType(Vec<(i32, ValueId)>);

impl PerType {
    pub fn get(
        &mut self,
        l: &mut Lowering<'_, '_>,
        elem: i32,
        make: impl FnOnce(&mut Lowering<'_, '_>, i32) -> ValueId,
    ) -> ValueId {
        if let Some((_, v)) = self.0.iter().find(|(e, _)| *e == elem) {
            return *v;
        }
        let v = make(l, elem);
        self.0.push((elem, v));
        v
    }
}
