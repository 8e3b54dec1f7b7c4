//! Static shape facts of the forward graph, as far as they can be known before running it:
//! the rank of a value and each dimension as a number, a name (`batch`, or a product of
//! names and a number, `2*batch`) or unknown.
//!
//! Why the autodiff needs them: the gradient of a broadcasting op must be summed back to
//! the shape of each input (`Add(X[N,16], b[16])` gives `db = ReduceSum(dY, axes=[0])`),
//! and which axes broadcast is a static question when ranks and the size-1 dimensions are
//! known. Exporters declare most intermediate shapes (`value_info`), hand-built graphs often
//! none, so the declared types are completed by a forward propagation over the ops models
//! use. A dimension is never guessed: what cannot be derived is unknown, and a rule that
//! needs it says so (or falls back to a form computed at run time, as the sum of a
//! broadcast does). An unknown size a node makes is given a name of its own
//! ([`Dim::invented`], `?7`), so that the values it passes on unchanged are seen to share
//! it: equal names are equal sizes, different names may or may not be.

use std::collections::HashMap;

use super::fold_ints::fold_dims;
use crate::ir::builder::NodeAttributes;
use crate::ir::inline::Branch;
use crate::ir::{topological_order, BodyId, Model, NodeId, ValueDef, ValueId};
use crate::proto::{tensor_proto::DataType, type_proto, TensorProto};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Known(i64),
    Symbol(String),
    Unknown,
}

impl Dim {
    pub fn known(&self) -> Option<i64> {
        match self {
            Dim::Known(d) => Some(*d),
            _ => None,
        }
    }

    /// A size the inference cannot work out, given a name of its own (`?7`) so that the
    /// values it passes on unchanged are seen to share it: the residual `Add` of two
    /// activations whose batch was lost in a `Reshape` is then known not to broadcast.
    /// Never written to a file: [`type_of`] leaves it open.
    fn invented(number: usize) -> Dim {
        Dim::Symbol(format!("?{number}"))
    }

    /// Whether this is, or has a factor that is, a name [`Dim::invented`] made (a model's
    /// own names never start with `?`; one that did would only be hidden from the types
    /// written back).
    pub fn is_invented(&self) -> bool {
        matches!(self, Dim::Symbol(s) if s.split('*').any(|f| f.starts_with('?')))
    }

    /// The size as a [`Monomial`]: a number, or a named size such as `N`, or a product
    /// such as `2*N` (as [`Monomial::dim`] writes them, and as ONNX Runtime's symbolic
    /// shape inference names them too).
    pub(super) fn monomial(&self) -> Option<Monomial> {
        match self {
            Dim::Known(k) => Some(Monomial {
                coefficient: *k,
                names: Vec::new(),
            }),
            Dim::Symbol(s) => {
                let mut m = Monomial {
                    coefficient: 1,
                    names: Vec::new(),
                };
                for factor in s.split('*') {
                    match factor.parse::<i64>() {
                        Ok(k) => m.coefficient = m.coefficient.checked_mul(k)?,
                        Err(_) if !factor.is_empty() => m.names.push(factor.to_string()),
                        // `a**b`: not a product, an opaque name.
                        Err(_) => {
                            return Some(Monomial {
                                coefficient: 1,
                                names: vec![s.clone()],
                            })
                        }
                    }
                }
                m.names.sort();
                Some(m)
            }
            Dim::Unknown => None,
        }
    }
}

/// A size as `coefficient × names`, the names sorted: what a `Reshape` that merges the
/// batch with the heads (`[N, H, T, d] -> [N*H, T, d]`, BLOOM's and Swin's attention) and
/// the one that splits them again keep of the batch's name.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Monomial {
    coefficient: i64,
    names: Vec<String>,
}

impl Monomial {
    /// As a dim; a named product with a negative coefficient is not a size (and would
    /// make `Equal(.., -1)` fold wrongly), so it is unknown.
    pub(super) fn dim(self) -> Dim {
        match (self.coefficient, self.names.len()) {
            (k, 0) | (k @ 0, _) => Dim::Known(k),
            (k, _) if k < 0 => Dim::Unknown,
            (1, _) => Dim::Symbol(self.names.join("*")),
            (k, _) => Dim::Symbol(format!("{k}*{}", self.names.join("*"))),
        }
    }

    /// `self × other` (`None` on overflow).
    pub(super) fn times(&self, other: &Monomial) -> Option<Monomial> {
        let mut names = [self.names.clone(), other.names.clone()].concat();
        names.sort();
        Some(Monomial {
            coefficient: self.coefficient.checked_mul(other.coefficient)?,
            names,
        })
    }

    /// `self / other` where it divides exactly: a positive coefficient dividing this one,
    /// every name of `other` one of these.
    pub(super) fn over(&self, other: &Monomial) -> Option<Monomial> {
        if other.coefficient <= 0 || self.coefficient % other.coefficient != 0 {
            return None;
        }
        let mut names = self.names.clone();
        for name in &other.names {
            let at = names.iter().position(|n| n == name)?;
            names.remove(at);
        }
        Some(Monomial {
            coefficient: self.coefficient / other.coefficient,
            names,
        })
    }
}

/// The product of `dims` (a named product where names take part; unknown where a dim is,
/// or the product overflows).
pub(super) fn product(dims: &[Dim]) -> Dim {
    dims.iter()
        .try_fold(
            Monomial {
                coefficient: 1,
                names: Vec::new(),
            },
            |acc, d| acc.times(&d.monomial()?),
        )
        .map_or(Dim::Unknown, Monomial::dim)
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Known(d) => write!(f, "{d}"),
            Dim::Symbol(s) if !self.is_invented() => f.write_str(s),
            _ => f.write_str("?"),
        }
    }
}

/// Element type and dims of a value (either part may be unknown).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Facts {
    pub elem: Option<i32>,
    pub dims: Option<Vec<Dim>>,
}

impl Facts {
    pub fn rank(&self) -> Option<usize> {
        self.dims.as_ref().map(Vec::len)
    }

    /// Every dim as a number, when all are known.
    pub fn static_dims(&self) -> Option<Vec<i64>> {
        self.dims.as_ref()?.iter().map(Dim::known).collect()
    }
}

/// Facts for every value of the main graph.
#[derive(Default)]
pub struct Shapes {
    facts: HashMap<ValueId, Facts>,
    /// How many sizes [`Dim::invented`] has named.
    invented: usize,
}

impl Shapes {
    pub fn get(&self, v: ValueId) -> Facts {
        self.facts.get(&v).cloned().unwrap_or_default()
    }

    pub fn set(&mut self, v: ValueId, facts: Facts) {
        self.facts.insert(v, facts);
    }

    /// Declared types, completed by propagation in topological order.
    pub fn infer(model: &Model) -> Shapes {
        let mut shapes = Shapes::default();
        for v in 0..model.values.len() {
            let v = ValueId(v as u32);
            let declared = declared(model, v);
            if declared != Facts::default() {
                shapes.facts.insert(v, declared);
            }
        }
        shapes.propagate(model, BodyId::MAIN);
        shapes
    }

    /// Completes the facts of the values `body`'s nodes compute by propagation in
    /// topological order, from what is known of what they read (a Loop body's, its inputs'
    /// facts set first).
    pub fn propagate(&mut self, model: &Model, body: BodyId) {
        for node in topological_order(model, body) {
            let inferred = match (loop_body(model, node), if_branches(model, node)) {
                (Some(loop_body), _) => self.infer_loop(model, node, loop_body),
                (None, Some(branches)) => self.infer_if(model, branches),
                (None, None) => infer_node(model, self, node),
            };
            for (slot, facts) in inferred.into_iter().enumerate() {
                let Some(Some(out)) = model.node(node).outputs.get(slot).copied() else {
                    continue;
                };
                let mut merged = merge(self.get(out), facts);
                for d in merged.dims.iter_mut().flatten() {
                    if *d == Dim::Unknown {
                        *d = Dim::invented(self.invented);
                        self.invented += 1;
                    }
                }
                self.facts.insert(out, merged);
            }
        }
    }
}

/// The body of `node` when it is a Loop (default domain).
fn loop_body(model: &Model, node: NodeId) -> Option<BodyId> {
    match super::loop_parts::is_loop(model, node) {
        true => model.subgraph(node, "body"),
        false => None,
    }
}

/// The then and else branches of `node` when it is an If (default domain).
fn if_branches(model: &Model, node: NodeId) -> Option<(BodyId, BodyId)> {
    match super::if_grad::is_if(model, node) {
        true => Some((
            model.if_branch(node, Branch::Then)?,
            model.if_branch(node, Branch::Else)?,
        )),
        false => None,
    }
}

impl Shapes {
    /// The facts of an If's branches, then of its outputs: what both branches agree on
    /// (the element type, and each axis the same in both; an If's branches may return
    /// different shapes).
    fn infer_if(&mut self, model: &Model, (then, otherwise): (BodyId, BodyId)) -> Vec<Facts> {
        self.propagate(model, then);
        self.propagate(model, otherwise);
        let outputs =
            |b: BodyId| -> Vec<ValueId> { model.body(b).outputs.iter().map(|(v, _)| *v).collect() };
        outputs(then)
            .into_iter()
            .zip(outputs(otherwise))
            .map(|(a, b)| agreed(self.get(a), self.get(b)))
            .collect()
    }

    /// The facts of a Loop's body, then of its outputs: the body's last carried values and
    /// its scan outputs stacked. The body's inputs are as declared, else the iteration
    /// number and condition scalars (ONNX), and a carried value as its starting value; where
    /// the body changes that shape, only the element type and rank are kept, and the body is
    /// propagated again.
    fn infer_loop(&mut self, model: &Model, node: NodeId, body: BodyId) -> Vec<Facts> {
        let n = model.node(node);
        let inputs: Vec<ValueId> = model.body(body).inputs.iter().map(|(v, _)| *v).collect();
        let outputs: Vec<ValueId> = model.body(body).outputs.iter().map(|(v, _)| *v).collect();
        let carried = inputs.len().saturating_sub(2);
        if outputs.len() < 1 + carried {
            return Vec::new();
        }
        let undeclared = |shapes: &Shapes, v: ValueId| shapes.get(v) == Facts::default();
        for (slot, elem) in [(0, DataType::Int64 as i32), (1, DataType::Bool as i32)] {
            if let Some(v) = inputs.get(slot).copied().filter(|v| undeclared(self, *v)) {
                self.set(
                    v,
                    Facts {
                        elem: Some(elem),
                        dims: Some(Vec::new()),
                    },
                );
            }
        }
        let mut assumed = Vec::new();
        for k in 0..carried {
            let v = inputs[2 + k];
            let start = n.inputs.get(2 + k).copied().flatten();
            if let (true, Some(start)) = (undeclared(self, v), start) {
                self.set(v, self.get(start));
                assumed.push(k);
            }
        }
        self.propagate(model, body);
        let mut changed = false;
        for k in assumed {
            let (v, next) = (inputs[2 + k], outputs[1 + k]);
            let (start, after) = (self.get(v), self.get(next));
            if start.dims != after.dims {
                let dims = match (&start.dims, &after.dims) {
                    (Some(a), Some(b)) if a.len() == b.len() => Some(vec![Dim::Unknown; a.len()]),
                    _ => None,
                };
                self.set(
                    v,
                    Facts {
                        elem: start.elem,
                        dims,
                    },
                );
                changed = true;
            }
        }
        if changed {
            // What was propagated from the assumed shapes is forgotten first.
            for inner in topological_order(model, body) {
                for out in model.node(inner).outputs.iter().flatten() {
                    self.facts.insert(*out, declared(model, *out));
                }
            }
            self.propagate(model, body);
        }
        (1..outputs.len())
            .map(|slot| {
                let each = self.get(outputs[slot]);
                match slot <= carried {
                    true => each,
                    false => stacked(&each),
                }
            })
            .collect()
    }
}

/// What two values' facts agree on: an element type both have, and the axes of equal
/// rank that are the same in both (unknown where they differ).
fn agreed(a: Facts, b: Facts) -> Facts {
    let elem = match (a.elem, b.elem) {
        (Some(x), Some(y)) if x != y => None,
        (x, y) => x.or(y),
    };
    let dims = match (a.dims, b.dims) {
        (Some(x), Some(y)) if x.len() == y.len() => Some(
            x.into_iter()
                .zip(y)
                .map(|(x, y)| match x == y {
                    true => x,
                    false => Dim::Unknown,
                })
                .collect(),
        ),
        _ => None,
    };
    Facts { elem, dims }
}

/// `[unknown] + facts`: a value stacked over a Loop's iterations.
pub fn stacked(facts: &Facts) -> Facts {
    Facts {
        elem: facts.elem,
        dims: facts.dims.as_ref().map(|d| {
            std::iter::once(Dim::Unknown)
                .chain(d.iter().cloned())
                .collect()
        }),
    }
}

/// The type a subgraph's input or output is declared with, from its `facts`: a tensor of
/// its element type with its dims where the rank is known, symbolic dims left open (a
/// symbol names a dim of the main graph's inputs, and a runtime that binds symbols graph by
/// graph, as tract does, would not unify the body's with the main graph's); `None` when
/// the element type is not known.
pub fn type_of_facts(facts: &Facts) -> Option<crate::proto::TypeProto> {
    let open = |d: &Dim| match d {
        Dim::Symbol(_) => Dim::Unknown,
        d => d.clone(),
    };
    let facts = &Facts {
        elem: facts.elem,
        dims: facts.dims.as_ref().map(|d| d.iter().map(open).collect()),
    };
    let elem = facts.elem?;
    Some(match &facts.dims {
        Some(dims) => type_of(elem, dims),
        None => crate::proto::TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem),
                shape: None,
            })),
            ..Default::default()
        },
    })
}

/// Declared beats inferred where it says something, but for a declared symbol that the
/// inference names otherwise: the model is only valid if they agree, and the inferred size
/// or symbol is the one the values it was computed from share. (torch's TorchScript
/// exporter declares its outputs with symbols of their own, `Addlogits_dim_0` for the
/// batch of `logits = Add(MatMul(h, W), b)`: declared, the batch of the product looked
/// possibly broadcast against it, and its gradient needed a sum decided at run time.)
/// Inferred fills what the declaration leaves open.
fn merge(declared: Facts, inferred: Facts) -> Facts {
    let elem = declared.elem.or(inferred.elem);
    let dims = match (declared.dims, inferred.dims) {
        (Some(d), Some(i)) if d.len() == i.len() => Some(
            d.into_iter()
                .zip(i)
                .map(|(d, i)| match (d, i) {
                    (Dim::Unknown, i) => i,
                    (Dim::Symbol(_), i @ Dim::Known(_)) => i,
                    (Dim::Symbol(_), i @ Dim::Symbol(_)) if !i.is_invented() => i,
                    (d, _) => d,
                })
                .collect(),
        ),
        (Some(d), _) => Some(d),
        (None, i) => i,
    };
    Facts { elem, dims }
}

fn declared(model: &Model, v: ValueId) -> Facts {
    if let Some(t) = model.initializer(v) {
        return Facts {
            elem: Some(t.data_type()),
            dims: Some(t.dims.iter().map(|d| Dim::Known(*d)).collect()),
        };
    }
    use crate::proto::DeclaredDim;
    match model.value_type(v) {
        Some(t) => Facts {
            elem: t.tensor_elem(),
            dims: t.tensor_dims().map(|dims| {
                dims.into_iter()
                    .map(|d| match d {
                        DeclaredDim::Known(x) => Dim::Known(x),
                        DeclaredDim::Symbol(p) => Dim::Symbol(p),
                        DeclaredDim::Unknown => Dim::Unknown,
                    })
                    .collect()
            }),
        },
        None => Facts::default(),
    }
}

/// The int64 values of a constant 1-D (or scalar) tensor: an initializer that is not a
/// graph input, or a `Constant` node's value.
///
/// Small integer computations over constants (the shape arithmetic exporters write:
/// `Reshape(Constant, Constant)`, `Concat` of unsqueezed scalars, `Cast`, `Gather` at a
/// constant index, elementwise integer arithmetic) are folded here, as far as 16 nodes up.
pub fn constant_ints(model: &Model, v: ValueId) -> Option<Vec<i64>> {
    all_known(fold_dims(model, &|_| None, v, 16)?)
}

/// The int64 values of `v` where they are known before running: a constant (see
/// [`constant_ints`]), or shape arithmetic on values whose dims are known (`Shape(x)`
/// sliced, multiplied, concatenated; exporters compute slice bounds that way).
pub fn known_ints(model: &Model, shapes: &Shapes, v: ValueId) -> Option<Vec<i64>> {
    all_known(fold_dims(model, &|x| shapes.get(x).dims, v, 16)?)
}

fn all_known(dims: Vec<Dim>) -> Option<Vec<i64>> {
    dims.iter().map(Dim::known).collect()
}

/// The value of `v` as dims where `Shape(x)` reads x's dims from `dims_of` (a named dim of
/// the batch stays a name): how far a computed shape is known.
pub fn shape_value(
    model: &Model,
    v: ValueId,
    dims_of: &dyn Fn(ValueId) -> Option<Vec<Dim>>,
) -> Option<Vec<Dim>> {
    fold_dims(model, dims_of, v, 16)
}

/// How many windows of `span` (the dilated kernel) a convolution or pooling slides over an
/// axis of `size` with `pads` (begin, end), by ONNX: `floor((size + pads - span) / stride) +
/// 1`, or `ceil` in ceil_mode, where a window that would start in the end padding is
/// dropped. None when there is none.
pub fn pool_windows(
    size: i64,
    span: i64,
    stride: i64,
    pads: (i64, i64),
    ceil_mode: bool,
) -> Option<i64> {
    if stride < 1 || size < 1 {
        return None;
    }
    // Checked: the attributes come from the file.
    let free = size
        .checked_add(pads.0)?
        .checked_add(pads.1)?
        .checked_sub(span)?;
    let mut windows = match ceil_mode {
        true => -((-free).div_euclid(stride)) + 1,
        false => free.div_euclid(stride) + 1,
    };
    if ceil_mode && windows > 1 && (windows - 1).checked_mul(stride)? >= size + pads.0 {
        windows -= 1;
    }
    (windows >= 1).then_some(windows)
}

/// The one float32 value of a constant scalar (or one-element tensor).
pub fn constant_f32(model: &Model, v: ValueId) -> Option<f32> {
    let t = crate::data::Tensor::from_tensor_proto(constant_tensor(model, v)?).ok()?;
    let a = t.as_f32()?;
    (a.len() == 1).then(|| a.iter().next().copied())?
}

pub fn constant_tensor(model: &Model, v: ValueId) -> Option<&TensorProto> {
    match model.value(v).def {
        ValueDef::Initializer { .. } => model.initializer(v),
        ValueDef::Node { node, .. } => {
            let n = model.node(node);
            if n.proto.op_type() == "Constant" && n.proto.domain().is_empty() {
                n.proto.attr("value").and_then(|a| a.t.as_ref())
            } else {
                None
            }
        }
        _ => None,
    }
}

pub(super) fn tensor_ints(t: &TensorProto) -> Option<Vec<i64>> {
    let raw = t.raw_data.as_deref().unwrap_or(&[]);
    match t.data_type() {
        x if x == DataType::Int64 as i32 => Some(if raw.is_empty() {
            t.int64_data.clone()
        } else {
            raw.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        }),
        // Booleans as 1 and 0 (stored a byte each, or in int32_data).
        x if x == DataType::Bool as i32 => Some(if raw.is_empty() {
            t.int32_data.iter().map(|v| (*v != 0) as i64).collect()
        } else {
            raw.iter().map(|b| (*b != 0) as i64).collect()
        }),
        x if x == DataType::Int32 as i32 => Some(if raw.is_empty() {
            t.int32_data.iter().map(|v| *v as i64).collect()
        } else {
            raw.chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64)
                .collect()
        }),
        _ => None,
    }
}

/// Ops whose (first) output has the shape and type of their first input.
const SAME_AS_INPUT: &[&str] = &[
    "Relu",
    "LeakyRelu",
    "Elu",
    "Selu",
    "Celu",
    "Gelu",
    "Sigmoid",
    "HardSigmoid",
    "HardSwish",
    "Tanh",
    "Softplus",
    "Softsign",
    "Exp",
    "Log",
    "Neg",
    "Abs",
    "Sqrt",
    "Reciprocal",
    "Erf",
    "Sin",
    "Cos",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Sinh",
    "Cosh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Shrink",
    "ThresholdedRelu",
    "Sign",
    "Floor",
    "Ceil",
    "Round",
    "Identity",
    "Softmax",
    "LogSoftmax",
    "Hardmax",
    "Clip",
    "Dropout",
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "InstanceNormalization",
    "Not",
    "Mish",
    "Trilu",
    "CumSum",
    "ReverseSequence",
    "ScatterElements",
    "ScatterND",
    "LpNormalization",
    "LRN",
    "RMSNormalization",
    "MeanVarianceNormalization",
    "Swish",
];

/// Elementwise ops with multidirectional (numpy) broadcasting.
const BROADCASTING: &[&str] = &[
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Sum",
    "Mean",
    "Where",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "And",
    "Or",
    "Xor",
    "PRelu",
    "Mod",
];

fn infer_node(model: &Model, shapes: &Shapes, node: NodeId) -> Vec<Facts> {
    let n = model.node(node);
    let p = &n.proto;
    if p.domain() == "com.microsoft"
        && matches!(
            p.op_type(),
            "BatchNormInternal" | "Gelu" | "FastGelu" | "QuickGelu"
        )
    {
        let x = n
            .inputs
            .first()
            .copied()
            .flatten()
            .map(|v| shapes.get(v))
            .unwrap_or_default();
        return vec![x];
    }
    if !p.domain().is_empty() && p.domain() != "ai.onnx" {
        return Vec::new();
    }
    let input = |i: usize| -> Facts {
        n.inputs
            .get(i)
            .copied()
            .flatten()
            .map(|v| shapes.get(v))
            .unwrap_or_default()
    };
    let int = |name: &str| p.attr_int(name).ok().flatten();
    let ints = |name: &str| p.attr_ints(name).ok().flatten();
    let op = p.op_type();
    let x = input(0);
    let with_dims = |elem: Option<i32>, dims: Option<Vec<Dim>>| Facts { elem, dims };
    match op {
        // Draws of the input's shape, of type `dtype` (the input's when absent).
        "RandomNormalLike" | "RandomUniformLike" | "Bernoulli" => {
            let elem = int("dtype").map(|t| t as i32).or(x.elem);
            vec![with_dims(elem, x.dims.clone())]
        }
        _ if SAME_AS_INPUT.contains(&op) => {
            let mut out = vec![x.clone()];
            if op == "Dropout" {
                out.push(with_dims(Some(DataType::Bool as i32), x.dims.clone()));
            }
            if op == "LayerNormalization" {
                // Mean and InvStdDev: X's dims with the normalised axes [axis, rank) at 1,
                // of type stash_type (float32 by default).
                let stats = int("stash_type").unwrap_or(DataType::Float as i64) as i32;
                let dims = x.dims.as_ref().map(|d| {
                    let rank = d.len() as i64;
                    let axis = int("axis").unwrap_or(-1);
                    let axis = if axis < 0 { axis + rank } else { axis };
                    d.iter()
                        .enumerate()
                        .map(|(i, dim)| {
                            if i as i64 >= axis {
                                Dim::Known(1)
                            } else {
                                dim.clone()
                            }
                        })
                        .collect()
                });
                out.push(with_dims(Some(stats), dims.clone()));
                out.push(with_dims(Some(stats), dims));
            }
            out
        }
        _ if BROADCASTING.contains(&op) => {
            let inputs: Vec<Facts> = (0..n.inputs.len()).map(input).collect();
            let elem = match op {
                "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or"
                | "Xor" => Some(DataType::Bool as i32),
                "Where" => inputs.get(1).and_then(|f| f.elem),
                _ => inputs.iter().find_map(|f| f.elem),
            };
            vec![with_dims(elem, broadcast(&inputs))]
        }
        "IsNaN" | "IsInf" => vec![with_dims(Some(DataType::Bool as i32), x.dims)],
        "Cast" => vec![with_dims(int("to").map(|t| t as i32), x.dims)],
        "CastLike" => vec![with_dims(input(1).elem, x.dims)],
        "Shape" => {
            // Opset 15 slices the shape with `start` and `end` (negative from the back).
            let len = x.rank().map(|r| {
                let r = r as i64;
                let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r);
                let start = clamp(int("start").unwrap_or(0));
                let end = clamp(int("end").unwrap_or(r));
                (end - start).max(0)
            });
            vec![with_dims(
                Some(DataType::Int64 as i32),
                len.map(|l| vec![Dim::Known(l)]),
            )]
        }
        "Size" => vec![with_dims(Some(DataType::Int64 as i32), Some(Vec::new()))],
        "MatMul" => vec![with_dims(x.elem, matmul(&x, &input(1)))],
        "Gemm" => {
            let (a, b) = (x.dims.clone(), input(1).dims);
            let dims = match (a, b) {
                (Some(a), Some(b)) if a.len() == 2 && b.len() == 2 => {
                    let m = if int("transA") == Some(1) {
                        &a[1]
                    } else {
                        &a[0]
                    };
                    let nn = if int("transB") == Some(1) {
                        &b[0]
                    } else {
                        &b[1]
                    };
                    Some(vec![m.clone(), nn.clone()])
                }
                _ => None,
            };
            vec![with_dims(x.elem, dims)]
        }
        "Transpose" => {
            let dims = x.dims.map(|d| {
                let perm = ints("perm").unwrap_or_else(|| (0..d.len() as i64).rev().collect());
                perm.iter()
                    .map(|i| d.get(*i as usize).cloned().unwrap_or(Dim::Unknown))
                    .collect()
            });
            vec![with_dims(x.elem, dims)]
        }
        "Reshape" => {
            let target_v = n.inputs.get(1).copied().flatten();
            let allowzero = int("allowzero") == Some(1);
            // The target read symbolically (sizes taken from Shape(..) of values with known
            // or named dims), or at least its length gives the rank.
            let dims = match target_v.and_then(|v| fold_dims(model, &|x| shapes.get(x).dims, v, 16))
            {
                Some(t) => Some(reshape_dims(x.dims.as_deref(), &t, allowzero)),
                None => target_v
                    .and_then(|v| shapes.get(v).static_dims())
                    .and_then(|d| d.first().map(|r| vec![Dim::Unknown; (*r).max(0) as usize])),
            };
            vec![with_dims(x.elem, dims)]
        }
        "Flatten" => {
            let dims = x.dims.map(|d| {
                let axis = int("axis").unwrap_or(1);
                let axis = if axis < 0 {
                    axis + d.len() as i64
                } else {
                    axis
                } as usize;
                vec![
                    product(&d[..axis.min(d.len())]),
                    product(&d[axis.min(d.len())..]),
                ]
            });
            vec![with_dims(x.elem, dims)]
        }
        "Unsqueeze" | "Squeeze" => {
            let axes = ints("axes").or_else(|| {
                n.inputs
                    .get(1)
                    .copied()
                    .flatten()
                    .and_then(|v| known_ints(model, shapes, v))
            });
            let dims = x.dims.and_then(|d| squeeze_like(op, d, axes));
            vec![with_dims(x.elem, dims)]
        }
        "Concat" => {
            let inputs: Vec<Facts> = (0..n.inputs.len()).map(input).collect();
            vec![with_dims(x.elem, concat(&inputs, int("axis").unwrap_or(0)))]
        }
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceL2" | "ReduceL1"
        | "ReduceSumSquare" | "ReduceProd" | "ReduceLogSumExp" | "ReduceLogSum" => {
            let axes = ints("axes").or_else(|| {
                n.inputs
                    .get(1)
                    .copied()
                    .flatten()
                    .and_then(|v| known_ints(model, shapes, v))
            });
            let keep = int("keepdims").unwrap_or(1) == 1;
            let noop = int("noop_with_empty_axes").unwrap_or(0) == 1;
            let dims = x.dims.and_then(|d| {
                let rank = d.len() as i64;
                let axes: Vec<i64> = match axes {
                    Some(a) if !a.is_empty() => {
                        a.iter().map(|a| (a + rank) % rank.max(1)).collect()
                    }
                    Some(_) | None if noop && n.inputs.get(1).copied().flatten().is_none() => {
                        return Some(d)
                    }
                    None if n.inputs.get(1).copied().flatten().is_some() => return None,
                    _ => (0..rank).collect(),
                };
                Some(
                    d.into_iter()
                        .enumerate()
                        .filter_map(|(i, dim)| match (axes.contains(&(i as i64)), keep) {
                            (true, true) => Some(Dim::Known(1)),
                            (true, false) => None,
                            (false, _) => Some(dim),
                        })
                        .collect(),
                )
            });
            vec![with_dims(x.elem, dims)]
        }
        "TopK" => {
            // Values and indices: X's dims with K along the axis.
            let k = n
                .inputs
                .get(1)
                .copied()
                .flatten()
                .and_then(|v| known_ints(model, shapes, v))
                .and_then(|k| k.first().copied());
            let dims = x.dims.map(|mut d| {
                let rank = d.len() as i64;
                let axis = int("axis").unwrap_or(-1);
                let axis = if axis < 0 { axis + rank } else { axis };
                if let Some(slot) = usize::try_from(axis).ok().and_then(|a| d.get_mut(a)) {
                    *slot = k.map_or(Dim::Unknown, Dim::Known);
                }
                d
            });
            vec![
                with_dims(x.elem, dims.clone()),
                with_dims(Some(DataType::Int64 as i32), dims),
            ]
        }
        "Einsum" => {
            let equation = p.attr_string("equation").ok().flatten().unwrap_or_default();
            let dims = super::rules::einsum::Equation::parse(&equation)
                .ok()
                .and_then(|eq| {
                    let inputs: Vec<Option<Vec<Dim>>> =
                        (0..n.inputs.len()).map(|i| input(i).dims).collect();
                    eq.output_dims(&inputs)
                });
            vec![with_dims(x.elem, dims)]
        }
        "GridSample" => {
            // [N, C] of X, then the grid's spatial dims ([N, H_out, W_out, 2]).
            let grid = input(1).dims;
            let dims = match (x.dims.as_deref(), grid.as_deref()) {
                (Some(xd), Some(gd)) if xd.len() >= 2 && gd.len() == xd.len() => Some(
                    xd[..2]
                        .iter()
                        .cloned()
                        .chain(gd[1..gd.len() - 1].iter().cloned())
                        .collect(),
                ),
                _ => None,
            };
            vec![with_dims(x.elem, dims)]
        }
        "Resize" => {
            let dims = x.dims.as_ref().map(|d| {
                super::rules::resize::output_dims(model, node, d, &|v| shapes.get(v).dims)
            });
            vec![with_dims(x.elem, dims)]
        }
        "LSTM" | "GRU" | "RNN" => {
            // Y [S, dirs, N, H], Y_h and Y_c [dirs, N, H] (layout 1: N first).
            let hidden = int("hidden_size").map_or(Dim::Unknown, Dim::Known);
            let dirs = match p.attr_string("direction").ok().flatten().as_deref() {
                Some("bidirectional") => 2,
                _ => 1,
            };
            let batch_first = int("layout") == Some(1);
            let (seq, batch) = match x.dims.as_deref() {
                Some([a, b, _]) if batch_first => (b.clone(), a.clone()),
                Some([a, b, _]) => (a.clone(), b.clone()),
                _ => (Dim::Unknown, Dim::Unknown),
            };
            let dirs = Dim::Known(dirs);
            let (y, state) = if batch_first {
                (
                    vec![batch.clone(), seq, dirs.clone(), hidden.clone()],
                    vec![batch, dirs, hidden],
                )
            } else {
                (
                    vec![seq, dirs.clone(), batch.clone(), hidden.clone()],
                    vec![dirs, batch, hidden],
                )
            };
            vec![
                with_dims(x.elem, Some(y)),
                with_dims(x.elem, Some(state.clone())),
                with_dims(x.elem, Some(state)),
            ]
        }
        "DepthToSpace" | "SpaceToDepth" => {
            // [N, C, H, W] <-> [N, C / b², H b, W b].
            let b = int("blocksize").filter(|b| *b > 0);
            let dims = x.dims.filter(|d| d.len() == 4).map(|d| {
                let scale = |dim: &Dim, up: bool| match (dim.known(), b) {
                    (Some(v), Some(b)) if up => v.checked_mul(b).map_or(Dim::Unknown, Dim::Known),
                    (Some(v), Some(b)) if v % b == 0 => Dim::Known(v / b),
                    _ => Dim::Unknown,
                };
                let to_space = op == "DepthToSpace";
                let area = b.and_then(|b| b.checked_mul(b));
                let channels = match (d[1].known(), area) {
                    (Some(c), Some(a)) if to_space && c % a == 0 => Dim::Known(c / a),
                    (Some(c), Some(a)) if !to_space => {
                        c.checked_mul(a).map_or(Dim::Unknown, Dim::Known)
                    }
                    _ => Dim::Unknown,
                };
                vec![
                    d[0].clone(),
                    channels,
                    scale(&d[2], to_space),
                    scale(&d[3], to_space),
                ]
            });
            vec![with_dims(x.elem, dims)]
        }
        "GlobalAveragePool" | "GlobalMaxPool" => {
            let dims = x.dims.map(|d| {
                d.iter()
                    .enumerate()
                    .map(|(i, dim)| if i < 2 { dim.clone() } else { Dim::Known(1) })
                    .collect()
            });
            vec![with_dims(x.elem, dims)]
        }
        "Conv" | "MaxPool" | "AveragePool" => {
            let w = input(1);
            let dims = x.dims.and_then(|d| {
                let spatial = d.len().checked_sub(2)?;
                let kernel: Vec<Option<i64>> = match op {
                    "Conv" => match ints("kernel_shape") {
                        Some(k) => k.into_iter().map(Some).collect(),
                        None => w.dims.as_ref()?.iter().skip(2).map(Dim::known).collect(),
                    },
                    _ => ints("kernel_shape")?.into_iter().map(Some).collect(),
                };
                let strides = ints("strides").unwrap_or(vec![1; spatial]);
                let dilations = ints("dilations").unwrap_or(vec![1; spatial]);
                let pads = ints("pads").unwrap_or(vec![0; 2 * spatial]);
                let auto_pad = p.attr_string("auto_pad").ok().flatten().unwrap_or_default();
                let ceil = int("ceil_mode") == Some(1);
                let channels = match op {
                    "Conv" => w
                        .dims
                        .as_ref()
                        .and_then(|w| w.first().cloned())
                        .unwrap_or(Dim::Unknown),
                    _ => d[1].clone(),
                };
                let mut out = vec![d[0].clone(), channels];
                for i in 0..spatial {
                    let size = d[i + 2].known();
                    let k = kernel.get(i).copied().flatten();
                    let (s, dl) = (
                        strides.get(i).copied().unwrap_or(1),
                        dilations.get(i).copied().unwrap_or(1),
                    );
                    let dim = match (size, k, auto_pad.as_str()) {
                        (Some(h), _, "SAME_UPPER" | "SAME_LOWER") => Some((h + s - 1) / s),
                        (Some(h), Some(k), "" | "NOTSET" | "VALID") => {
                            let (b, e) = if auto_pad == "VALID" {
                                (0, 0)
                            } else {
                                (
                                    pads.get(i).copied().unwrap_or(0),
                                    pads.get(i + spatial).copied().unwrap_or(0),
                                )
                            };
                            pool_windows(h, (k - 1) * dl + 1, s, (b, e), ceil)
                        }
                        _ => None,
                    };
                    out.push(dim.map(Dim::Known).unwrap_or(Dim::Unknown));
                }
                Some(out)
            });
            let mut out = vec![with_dims(x.elem, dims.clone())];
            if op == "MaxPool" {
                out.push(with_dims(Some(DataType::Int64 as i32), dims));
            }
            out
        }
        "ConvTranspose" => {
            // Y per spatial axis: s·(X-1) + output_padding + (k-1)·d + 1 - pads, or the
            // `output_shape` attribute; C_out = W[1] · group.
            let w = input(1);
            let dims = x.dims.and_then(|d| {
                let spatial = d.len().checked_sub(2)?;
                let kernel: Vec<Option<i64>> = match ints("kernel_shape") {
                    Some(k) => k.into_iter().map(Some).collect(),
                    None => w.dims.as_ref()?.iter().skip(2).map(Dim::known).collect(),
                };
                let at = |name: &str, i: usize, default: i64| {
                    ints(name)
                        .and_then(|v| v.get(i).copied())
                        .unwrap_or(default)
                };
                let auto_pad = p.attr_string("auto_pad").ok().flatten().unwrap_or_default();
                let output_shape = ints("output_shape");
                let group = int("group").unwrap_or(1);
                let channels = w
                    .dims
                    .as_ref()
                    .and_then(|w| w.get(1).and_then(Dim::known))
                    .map_or(Dim::Unknown, |c| Dim::Known(c * group));
                let mut out = vec![d[0].clone(), channels];
                for i in 0..spatial {
                    let size = d[i + 2].known();
                    let s = at("strides", i, 1);
                    let dim = match (&output_shape, size, auto_pad.as_str()) {
                        (Some(o), ..) if o.len() >= spatial => Some(o[o.len() - spatial + i]),
                        (Some(_), ..) => None,
                        (None, Some(h), "SAME_UPPER" | "SAME_LOWER") => Some(h * s),
                        (None, Some(h), "" | "NOTSET" | "VALID") => {
                            kernel.get(i).copied().flatten().map(|k| {
                                let span = (k - 1) * at("dilations", i, 1) + 1;
                                let pads = if auto_pad == "VALID" {
                                    0
                                } else {
                                    at("pads", i, 0) + at("pads", i + spatial, 0)
                                };
                                s * (h - 1) + at("output_padding", i, 0) + span - pads
                            })
                        }
                        _ => None,
                    };
                    out.push(dim.map_or(Dim::Unknown, Dim::Known));
                }
                Some(out)
            });
            vec![with_dims(x.elem, dims)]
        }
        "Gather" => {
            let idx = input(1);
            let dims = match (x.dims, idx.dims) {
                (Some(d), Some(i)) => {
                    let axis = int("axis").unwrap_or(0);
                    let axis = if axis < 0 {
                        axis + d.len() as i64
                    } else {
                        axis
                    } as usize;
                    (axis < d.len()).then(|| {
                        let mut out = d[..axis].to_vec();
                        out.extend(i);
                        out.extend_from_slice(&d[axis + 1..]);
                        out
                    })
                }
                _ => None,
            };
            vec![with_dims(x.elem, dims)]
        }
        "GatherElements" => vec![with_dims(x.elem, input(1).dims)],
        // Y = I.dims[:-1] + X.dims[b + k:], k = I.dims[-1], b = batch_dims.
        "GatherND" => {
            let b = int("batch_dims").unwrap_or(0);
            let dims = match (x.dims, input(1).dims) {
                (Some(d), Some(i)) if b >= 0 => i
                    .last()
                    .and_then(Dim::known)
                    .and_then(|k| usize::try_from(b.checked_add(k)?).ok())
                    .filter(|&from| from <= d.len())
                    .map(|from| {
                        let mut out = i[..i.len() - 1].to_vec();
                        out.extend_from_slice(&d[from..]);
                        out
                    }),
                _ => None,
            };
            vec![with_dims(x.elem, dims)]
        }
        "Pad" => {
            let pads = ints("pads").or_else(|| {
                n.inputs
                    .get(1)
                    .copied()
                    .flatten()
                    .and_then(|v| known_ints(model, shapes, v))
            });
            let axes = n
                .inputs
                .get(3)
                .copied()
                .flatten()
                .and_then(|v| known_ints(model, shapes, v));
            let dims = x.dims.map(|d| {
                let rank = d.len() as i64;
                let Some(pads) = pads else {
                    return vec![Dim::Unknown; d.len()];
                };
                let axes: Vec<i64> = axes
                    .unwrap_or_else(|| (0..rank).collect())
                    .iter()
                    .map(|a| if *a < 0 { a + rank } else { *a })
                    .collect();
                let k = axes.len();
                let mut out = d.clone();
                for (j, a) in axes.iter().enumerate() {
                    let a = *a as usize;
                    let (b, e) = (pads.get(j), pads.get(j + k));
                    if (b, e) == (Some(&0), Some(&0)) {
                        // Not padded: the size stays, a named one too (Swin pads H and W
                        // only, its batch a name).
                    } else if let (Some(size), Some(b), Some(e)) =
                        (d.get(a).and_then(Dim::known), b, e)
                    {
                        out[a] = Dim::Known(size + b + e);
                    } else if a < out.len() {
                        out[a] = Dim::Unknown;
                    }
                }
                out
            });
            vec![with_dims(x.elem, dims)]
        }
        "Tile" => {
            let reps = n
                .inputs
                .get(1)
                .copied()
                .flatten()
                .and_then(|v| known_ints(model, shapes, v));
            let dims = x.dims.map(|d| match reps {
                Some(r) if r.len() == d.len() => d
                    .iter()
                    .zip(&r)
                    .map(|(d, r)| match (d, r) {
                        (_, 1) => d.clone(),
                        (Dim::Known(v), r) => Dim::Known(v * r),
                        _ => Dim::Unknown,
                    })
                    .collect(),
                _ => vec![Dim::Unknown; d.len()],
            });
            vec![with_dims(x.elem, dims)]
        }
        "Range" => vec![with_dims(x.elem, Some(vec![range_len(model, shapes, n)]))],
        "ConstantOfShape" => {
            let t = p
                .attr("value")
                .and_then(|a| a.t.as_ref())
                .map(|t| t.data_type());
            let shape = n.inputs.first().copied().flatten();
            let dims = shape.and_then(|v| match known_ints(model, shapes, v) {
                Some(c) => Some(c.into_iter().map(Dim::Known).collect()),
                None => shapes
                    .get(v)
                    .static_dims()
                    .and_then(|d| d.first().map(|r| vec![Dim::Unknown; *r as usize])),
            });
            vec![with_dims(t.or(Some(DataType::Float as i32)), dims)]
        }
        "Split" => {
            let outputs = n.outputs.len();
            let axis = int("axis").unwrap_or(0);
            let sizes = ints("split").or_else(|| {
                n.inputs
                    .get(1)
                    .copied()
                    .flatten()
                    .and_then(|v| known_ints(model, shapes, v))
            });
            (0..outputs)
                .map(|o| {
                    let dims = x.dims.as_ref().and_then(|d| {
                        let a = if axis < 0 {
                            axis + d.len() as i64
                        } else {
                            axis
                        } as usize;
                        let total = d.get(a)?.known();
                        let size = match &sizes {
                            Some(s) => s.get(o).copied(),
                            None => total
                                .filter(|t| t % outputs as i64 == 0)
                                .map(|t| t / outputs as i64),
                        };
                        let mut out = d.clone();
                        out[a] = size.map(Dim::Known).unwrap_or(Dim::Unknown);
                        Some(out)
                    });
                    with_dims(x.elem, dims)
                })
                .collect()
        }
        "Slice" => {
            // Bounds computed from known dims (`x[:, :Shape(y)[1]]`) count as known.
            let c = |i: usize| {
                n.inputs
                    .get(i)
                    .copied()
                    .flatten()
                    .and_then(|v| known_ints(model, shapes, v))
            };
            let dims = x.dims.map(|d| {
                let rank = d.len() as i64;
                let (Some(starts), Some(ends)) = (c(1), c(2)) else {
                    // Bounds known only at run time: the axes sliced are unknown, the
                    // others keep their dims (BERT's position ids, a [1, 512] buffer
                    // sliced on axis 1, stay one row).
                    let Some(axes) = c(3) else {
                        return vec![Dim::Unknown; d.len()];
                    };
                    let mut out = d.clone();
                    for axis in axes {
                        let a = if axis < 0 { axis + rank } else { axis };
                        if let Some(dim) = usize::try_from(a).ok().and_then(|a| out.get_mut(a)) {
                            *dim = Dim::Unknown;
                        }
                    }
                    return out;
                };
                let axes = c(3).unwrap_or_else(|| (0..starts.len() as i64).collect());
                let steps = c(4).unwrap_or_else(|| vec![1; starts.len()]);
                let mut out = d.clone();
                for (j, axis) in axes.iter().enumerate() {
                    let a = if *axis < 0 { axis + rank } else { *axis } as usize;
                    let Some(size) = d.get(a).and_then(Dim::known) else {
                        if a < out.len() {
                            out[a] = Dim::Unknown;
                        }
                        continue;
                    };
                    let (Some(start), Some(end)) = (starts.get(j), ends.get(j)) else {
                        out[a] = Dim::Unknown;
                        continue;
                    };
                    let len = slice_len(size, *start, *end, steps.get(j).copied().unwrap_or(1));
                    out[a] = len.map(Dim::Known).unwrap_or(Dim::Unknown);
                }
                out
            });
            vec![with_dims(x.elem, dims)]
        }
        "Constant" => {
            // Whichever of its value attributes it has: a tensor, or a scalar or 1-D list.
            let known = |elem: DataType, dims: &[i64]| {
                with_dims(
                    Some(elem as i32),
                    Some(dims.iter().map(|d| Dim::Known(*d)).collect()),
                )
            };
            let facts = if let Some(t) = p.attr("value").and_then(|a| a.t.as_ref()) {
                with_dims(
                    Some(t.data_type()),
                    Some(t.dims.iter().map(|d| Dim::Known(*d)).collect()),
                )
            } else if p.attr("value_float").is_some() {
                known(DataType::Float, &[])
            } else if p.attr("value_int").is_some() {
                known(DataType::Int64, &[])
            } else if let Some(a) = p.attr("value_floats") {
                known(DataType::Float, &[a.floats.len() as i64])
            } else if let Some(a) = p.attr("value_ints") {
                known(DataType::Int64, &[a.ints.len() as i64])
            } else {
                Facts::default()
            };
            vec![facts]
        }
        "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" => {
            let reduction = p
                .attr_string("reduction")
                .ok()
                .flatten()
                .unwrap_or("mean".into());
            let loss = if reduction == "none" {
                input(1).dims
            } else {
                Some(Vec::new())
            };
            vec![with_dims(x.elem, loss), x.clone()]
        }
        "Expand" => {
            let target_v = n.inputs.get(1).copied().flatten();
            // A named batch in the target stays a name (torch's `expand(B, -1)`, a Where over
            // the batch size, folds to [batch, T]).
            let target = target_v.and_then(|v| fold_dims(model, &|x| shapes.get(x).dims, v, 16));
            // A target that does not fold: its length still gives the rank, and a dimension of
            // X other than 1 survives.
            let computed = || {
                let rank = *target_v
                    .and_then(|v| shapes.get(v).static_dims())?
                    .first()? as usize;
                let xd = x.dims.clone()?;
                let out = rank.max(xd.len());
                Some(
                    (0..out)
                        .map(|i| match (i + xd.len()).checked_sub(out).map(|j| &xd[j]) {
                            Some(Dim::Known(d)) if *d != 1 => Dim::Known(*d),
                            _ => Dim::Unknown,
                        })
                        .collect(),
                )
            };
            if target.is_none() {
                return vec![with_dims(x.elem, computed())];
            }
            let dims = target.and_then(|t| {
                let t: Vec<Facts> = vec![
                    x.clone(),
                    Facts {
                        elem: None,
                        dims: Some(t),
                    },
                ];
                broadcast(&t)
            });
            vec![with_dims(x.elem, dims)]
        }
        _ => Vec::new(),
    }
}

/// How many values `Range(start, limit, delta)` makes: `ceil((limit - start) / delta)`
/// when the three fold, and the limit's name for `Range(0, T, 1)` (torch's `arange(T)`
/// over a named length).
fn range_len(model: &Model, shapes: &Shapes, n: &crate::ir::Node) -> Dim {
    let scalar = |i: usize| {
        let v = n.inputs.get(i).copied().flatten()?;
        match fold_dims(model, &|x| shapes.get(x).dims, v, 16)?.as_slice() {
            [d] => Some(d.clone()),
            _ => None,
        }
    };
    match (scalar(0), scalar(1), scalar(2)) {
        (Some(Dim::Known(start)), Some(Dim::Known(limit)), Some(Dim::Known(delta)))
            if delta != 0 =>
        {
            let len = limit
                .checked_sub(start)
                .and_then(|span| span.checked_add(delta - delta.signum()))
                .and_then(|span| span.checked_div(delta));
            len.map_or(Dim::Unknown, |l| Dim::Known(l.max(0)))
        }
        (Some(Dim::Known(0)), Some(limit @ Dim::Symbol(_)), Some(Dim::Known(1))) => limit,
        _ => Dim::Unknown,
    }
}

fn slice_len(size: i64, start: i64, end: i64, step: i64) -> Option<i64> {
    slice_range(size, start, end, step).map(|(_, len)| len)
}

/// What `Slice` takes from an axis of `size` elements: the first index it reads and how
/// many it reads (`first + j·step` for `j < len`), `None` for step 0. The ONNX rules:
/// negative starts and ends count from the end; then, for a positive step, both clamp to
/// [0, size]; for a negative step, start clamps to [0, size-1] and end to [-1, size-1].
pub fn slice_range(size: i64, start: i64, end: i64, step: i64) -> Option<(i64, i64)> {
    if step == 0 {
        return None;
    }
    let clamp = |v: i64, lo: i64, hi: i64| v.max(lo).min(hi);
    let norm = |v: i64| if v < 0 { v.saturating_add(size) } else { v };
    let (s, e) = if step > 0 {
        (clamp(norm(start), 0, size), clamp(norm(end), 0, size))
    } else {
        (
            clamp(norm(start), 0, size - 1),
            clamp(norm(end), -1, size - 1),
        )
    };
    let len = if step > 0 {
        (e - s).max(0).saturating_add(step - 1) / step
    } else {
        (s - e).max(0).saturating_add(-(step + 1)) / step.saturating_neg()
    };
    Some((s, len.max(0)))
}

/// Numpy broadcasting of several shapes (unknown when any rank is unknown).
pub fn broadcast(inputs: &[Facts]) -> Option<Vec<Dim>> {
    let dims: Vec<&Vec<Dim>> = inputs
        .iter()
        .map(|f| f.dims.as_ref())
        .collect::<Option<_>>()?;
    let rank = dims.iter().map(|d| d.len()).max().unwrap_or(0);
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let mut dim = Dim::Known(1);
        for d in &dims {
            let Some(j) = (i + d.len()).checked_sub(rank) else {
                continue;
            };
            dim = match (dim, &d[j]) {
                (Dim::Known(1), other) => other.clone(),
                (current, Dim::Known(1)) => current,
                (Dim::Known(a), Dim::Known(b)) if a == *b => Dim::Known(a),
                (Dim::Symbol(a), Dim::Symbol(b)) if a == *b => Dim::Symbol(a),
                (Dim::Known(a), _) => Dim::Known(a),
                (_, Dim::Known(b)) => Dim::Known(*b),
                _ => Dim::Unknown,
            };
        }
        out.push(dim);
    }
    Some(out)
}

fn matmul(a: &Facts, b: &Facts) -> Option<Vec<Dim>> {
    let (a, b) = (a.dims.as_ref()?, b.dims.as_ref()?);
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let (a2, b2) = (a.len() == 1, b.len() == 1);
    let a = if a2 {
        vec![Dim::Known(1), a[0].clone()]
    } else {
        a.clone()
    };
    let b = if b2 {
        vec![b[0].clone(), Dim::Known(1)]
    } else {
        b.clone()
    };
    let batch = broadcast(&[
        Facts {
            elem: None,
            dims: Some(a[..a.len() - 2].to_vec()),
        },
        Facts {
            elem: None,
            dims: Some(b[..b.len() - 2].to_vec()),
        },
    ])?;
    let mut out = batch;
    if !a2 {
        out.push(a[a.len() - 2].clone());
    }
    if !b2 {
        out.push(b[b.len() - 1].clone());
    }
    Some(out)
}

/// `Reshape`'s output for a target of dims: `Known(0)` copies the input's dim (unless
/// `allowzero`), `Known(-1)` is what the input's size leaves once the other target dims
/// are divided out (named sizes dividing by name: `[N, 2, 8, 8]` to `[-1, 8, 8]` is
/// `[2*N, 8, 8]`), named sizes pass.
fn reshape_dims(input: Option<&[Dim]>, target: &[Dim], allowzero: bool) -> Vec<Dim> {
    let mut out: Vec<Dim> = target
        .iter()
        .enumerate()
        .map(|(i, t)| match t {
            Dim::Known(0) if !allowzero => input
                .and_then(|d| d.get(i).cloned())
                .unwrap_or(Dim::Unknown),
            Dim::Known(-1) => Dim::Unknown,
            other => other.clone(),
        })
        .collect();
    if let (Some(minus), Some(input)) = (target.iter().position(|t| *t == Dim::Known(-1)), input) {
        let others: Vec<Dim> = out
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != minus)
            .map(|(_, d)| d.clone())
            .collect();
        let left = product(input)
            .monomial()
            .zip(product(&others).monomial())
            .and_then(|(total, rest)| total.over(&rest));
        if let Some(left) = left {
            out[minus] = left.dim();
        }
    }
    out
}

fn squeeze_like(op: &str, d: Vec<Dim>, axes: Option<Vec<i64>>) -> Option<Vec<Dim>> {
    if op == "Unsqueeze" {
        let axes = axes?;
        let rank = (d.len() + axes.len()) as i64;
        let axes: Vec<i64> = axes
            .iter()
            .map(|a| if *a < 0 { a + rank } else { *a })
            .collect();
        let mut rest = d.into_iter();
        Some(
            (0..rank)
                .map(|i| {
                    if axes.contains(&i) {
                        Dim::Known(1)
                    } else {
                        rest.next().unwrap_or(Dim::Unknown)
                    }
                })
                .collect(),
        )
    } else {
        let rank = d.len() as i64;
        match axes {
            Some(axes) => {
                let axes: Vec<i64> = axes
                    .iter()
                    .map(|a| if *a < 0 { a + rank } else { *a })
                    .collect();
                Some(
                    d.into_iter()
                        .enumerate()
                        .filter(|(i, _)| !axes.contains(&(*i as i64)))
                        .map(|(_, d)| d)
                        .collect(),
                )
            }
            None if d.iter().all(|x| x.known().is_some()) => {
                Some(d.into_iter().filter(|x| *x != Dim::Known(1)).collect())
            }
            None => None,
        }
    }
}

fn concat(inputs: &[Facts], axis: i64) -> Option<Vec<Dim>> {
    let first = inputs.first()?.dims.clone()?;
    let rank = first.len() as i64;
    let a = if axis < 0 { axis + rank } else { axis } as usize;
    let mut out = first;
    let mut total = Some(0i64);
    for f in inputs {
        let d = f.dims.as_ref()?;
        total = match (total, d.get(a).and_then(Dim::known)) {
            (Some(t), Some(x)) => Some(t + x),
            _ => None,
        };
    }
    if a < out.len() {
        out[a] = total.map(Dim::Known).unwrap_or(Dim::Unknown);
    }
    Some(out)
}

/// Declares the derived type of every node output that the model leaves undeclared (the
/// lowerings of `legalize-ort` read declared types). In the main graph with its shape; in
/// a body (an If branch, a Loop body, the backward's copies of them) the element type
/// alone: a Loop body's facts hold for every iteration only as far as the element type
/// and rank go, and the lowerings need no more there.
pub fn declare(model: &mut Model, shapes: &Shapes) {
    let outputs: Vec<ValueId> = model
        .all_nodes()
        .flat_map(|n| {
            model
                .node(n)
                .outputs
                .iter()
                .flatten()
                .copied()
                .collect::<Vec<_>>()
        })
        .collect();
    for v in outputs {
        if model.value_type(v).is_some() {
            continue;
        }
        let f = shapes.get(v);
        let ty = match (model.defining_body(v) == BodyId::MAIN, f.elem, f.dims) {
            (true, Some(elem), Some(dims)) => type_of(elem, &dims),
            (false, Some(elem), _) => crate::proto::TypeProto {
                value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                    elem_type: Some(elem),
                    shape: None,
                })),
                ..Default::default()
            },
            _ => continue,
        };
        model.set_value_type(v, ty);
    }
}

/// The tensor type of element type `elem` and `dims` (named sizes as `dim_param`, unknown
/// ones left open).
pub fn type_of(elem: i32, dims: &[Dim]) -> crate::proto::TypeProto {
    use crate::proto::tensor_shape_proto::dimension::Value as D;
    let mut ty = crate::ir::tensor_type(elem, &vec![0; dims.len()]);
    if let Some(type_proto::Value::TensorType(t)) = &mut ty.value {
        if let Some(shape) = t.shape.as_mut() {
            for (slot, d) in shape.dim.iter_mut().zip(dims) {
                slot.value = match d {
                    Dim::Known(x) => Some(D::DimValue(*x)),
                    d if d.is_invented() => None,
                    Dim::Symbol(s) => Some(D::DimParam(s.clone())),
                    Dim::Unknown => None,
                };
            }
        }
    }
    ty
}

#[cfg(test)]
mod dtype_agreement {
    use super::*;

    /// The element types these shape facts infer agree with the one table of element-type
    /// rules (`ir::dtype`) wherever both give one, on every node of the shipped forward
    /// models (each op's rule seen from the same input types).
    #[test]
    fn inferred_element_types_agree_with_ir_dtype() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("graphs/forward");
        let mut compared = 0;
        for dir in std::fs::read_dir(&root).unwrap() {
            let dir = dir.unwrap().path();
            for name in ["legacy.onnx", "keras.onnx", "dynamo.onnx"] {
                let path = dir.join(name);
                if !path.exists() {
                    continue;
                }
                let proto = crate::model::load_model_with_data(&path).unwrap();
                let model = Model::from_proto(proto);
                let shapes = Shapes::infer(&model);
                for node in topological_order(&model, BodyId::MAIN) {
                    let n = model.node(node);
                    let input = |i: usize| {
                        n.inputs
                            .get(i)
                            .copied()
                            .flatten()
                            .and_then(|v| shapes.get(v).elem)
                    };
                    for (slot, facts) in infer_node(&model, &shapes, node).iter().enumerate() {
                        let rule = crate::ir::dtype::output_elem(&n.proto, slot, input, |_| None);
                        if let (Some(ours), Some(rule)) = (facts.elem, rule) {
                            assert_eq!(
                                ours,
                                rule,
                                "{}: {} '{}' output {slot}",
                                path.display(),
                                n.proto.op_type(),
                                n.proto.name()
                            );
                            compared += 1;
                        }
                    }
                }
            }
        }
        assert!(compared > 500, "only {compared} outputs compared");
    }
}

#[cfg(test)]
mod computed_shapes {
    use super::*;

    fn facts_of(text: &str, name: &str) -> Facts {
        let model = Model::from_proto(crate::ir::text::parse_model(text).unwrap());
        let shapes = Shapes::infer(&model);
        let v = model.lookup(BodyId::MAIN, name).unwrap();
        shapes.get(v)
    }

    /// The dims, invented names shown as unknown.
    fn dims(f: Facts) -> Vec<Dim> {
        let open = |d: Dim| if d.is_invented() { Dim::Unknown } else { d };
        f.dims.unwrap().into_iter().map(open).collect()
    }

    /// A batch lost in a `Reshape` whose target only the run knows gets a name of its own,
    /// which the ops after it pass on: the residual `Add` of `h` and `relu(h)` is seen not
    /// to broadcast, and `Add(h, k)` with another unknown batch is not taken for the same.
    /// The type written for `h` leaves the invented name open.
    #[test]
    fn an_unknown_size_is_named_for_the_values_that_share_it() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,8] x, int64[2] target, float[M,8] k) => (float[?,8] out, float[?,8] other) {\n\
              h = Reshape(x, target)\n\
              r = Relu(h)\n\
              out = Add(h, r)\n\
              other = Add(h, k)\n\
            }\n";
        let model = Model::from_proto(crate::ir::text::parse_model(text).unwrap());
        let shapes = Shapes::infer(&model);
        let dims = |name| {
            shapes
                .get(model.lookup(BodyId::MAIN, name).unwrap())
                .dims
                .unwrap()
        };
        let batch = dims("h")[0].clone();
        assert!(batch.is_invented(), "{batch:?}");
        assert_eq!(dims("r")[0], batch);
        assert_eq!(dims("out")[0], batch);
        assert!(dims("other")[0].is_invented() && dims("other")[0] != batch);
        let written = type_of(1, &dims("h"));
        let Some(type_proto::Value::TensorType(t)) = written.value else {
            panic!("{written:?}")
        };
        assert_eq!(t.shape.unwrap().dim[0].value, None);
    }

    /// MobileViT's `interpolate(size=(6, 8))`: Resize sizes of `Shape(x)[0:2] ++ [6, 8]`, the
    /// batch named, not known.
    #[test]
    fn resize_to_sizes_computed_from_its_input_keeps_the_named_batch() {
        let text = "<ir_version: 9, opset_import: [\"\" : 19]>\n\
            g (float[N,2,3,4] x) => (float[N,2,6,8] y) {\n\
              lead = Shape<end = 2>(x)\n\
              hw = Constant<value_ints = [6, 8]>()\n\
              sizes = Concat<axis = 0>(lead, hw)\n\
              y = Resize<mode = \"linear\">(x, , , sizes)\n\
            }\n";
        assert_eq!(
            dims(facts_of(text, "y")),
            [
                Dim::Symbol("N".into()),
                Dim::Known(2),
                Dim::Known(6),
                Dim::Known(8)
            ]
        );
    }

    /// BERT's position ids through torch's TorchScript exporter: a [1, 6] buffer sliced on
    /// axis 1 to a length only the run knows (here a graph input). The row axis stays 1, so
    /// an Add with [N, T, H] embeddings is seen to
    /// broadcast over the batch (its gradient summed there; before, dY went to the position
    /// table's scatter unsummed and failed at run time).
    #[test]
    fn slice_to_a_computed_length_keeps_the_axes_it_does_not_slice() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,4] x, int64[1] end) => (int64[1,?] out) {\n\
              ids = Constant<value = int64[1,6] {0, 1, 2, 3, 4, 5}>()\n\
              zero = Constant<value_ints = [0]>()\n\
              one = Constant<value_ints = [1]>()\n\
              y = Slice(ids, zero, end, one)\n\
              out = Identity(y)\n\
            }\n";
        assert_eq!(dims(facts_of(text, "y")), [Dim::Known(1), Dim::Unknown]);
    }

    /// BLOOM's ALiBi slopes: `Expand(s, ConstantOfShape(Shape(Concat(..)), 1))`, a target of
    /// ones whose length is the length of a computed shape. Shape-like inputs fold through
    /// Shape of values whose dims are known, not only constants.
    #[test]
    fn expand_to_ones_of_a_computed_length_has_its_rank() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,8] x, float[2,1,3] s) => (float[2,1,3] out) {\n\
              n = Shape<end = 1>(x)\n\
              three = Constant<value_ints = [2, 3]>()\n\
              target_dims = Concat<axis = 0>(n, three)\n\
              rank = Shape(target_dims)\n\
              ones = ConstantOfShape<value = int64[1] {1}>(rank)\n\
              y = Expand(s, ones)\n\
              out = Identity(y)\n\
            }\n";
        assert_eq!(
            dims(facts_of(text, "y")),
            [Dim::Known(2), Dim::Known(1), Dim::Known(3)]
        );
    }

    /// torch's `expand(batch, -1)` through the TorchScript exporter (BERT's token type ids):
    /// the target `Where(Equal(shape, -1), ones, shape)` over `[batch, 8]`, the batch a name.
    /// A named size is never -1, so the target folds to `[N, 8]` and the batch stays named
    /// (it was unknown, and every elementwise op after it looked possibly broadcast).
    #[test]
    fn expand_to_a_target_with_minus_ones_replaced_keeps_the_named_batch() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (int64[N,8] x, int64[1,8] ids) => (int64[N,8] out) {\n\
              n = Shape<end = 1>(x)\n\
              t = Shape<start = 1, end = 2>(x)\n\
              wanted = Concat<axis = 0>(n, t)\n\
              count = Shape(wanted)\n\
              ones = ConstantOfShape<value = int64[1] {1}>(count)\n\
              minus = Constant<value_int = -1>()\n\
              minus_ones = Mul(ones, minus)\n\
              keep = Equal(wanted, minus_ones)\n\
              target = Where(keep, ones, wanted)\n\
              y = Expand(ids, target)\n\
              out = Identity(y)\n\
            }\n";
        assert_eq!(
            dims(facts_of(text, "y")),
            [Dim::Symbol("N".into()), Dim::Known(8)]
        );
    }

    /// BLOOM's attention merges the batch with the heads and splits them again, with
    /// targets computed from `Shape`: the sizes stay named products (`2*N`), so the scores
    /// of two such reshapes are seen to have one batch.
    #[test]
    fn merged_and_split_batches_keep_their_names() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,2,8,4] x) => (float[?,8,4] merged, float[?,2,8,4] split, float[?,2,8,4] back, float[?,4] rows, float[?,4] flat, float[?,4] odd) {\n\
              batch = Shape<end = 1>(x)\n\
              two = Constant<value_ints = [2]>()\n\
              three = Constant<value_ints = [3]>()\n\
              heads = Mul(batch, two)\n\
              rest = Constant<value_ints = [8, 4]>()\n\
              target = Concat<axis = 0>(heads, rest)\n\
              merged = Reshape(x, target)\n\
              minus = Constant<value_ints = [-1, 2, 8, 4]>()\n\
              split = Reshape(merged, minus)\n\
              first = Shape<end = 1>(merged)\n\
              n = Div(first, two)\n\
              rest2 = Constant<value_ints = [2, 8, 4]>()\n\
              target2 = Concat<axis = 0>(n, rest2)\n\
              back = Reshape(merged, target2)\n\
              minus4 = Constant<value_ints = [-1, 4]>()\n\
              rows = Reshape(x, minus4)\n\
              flat = Flatten<axis = 3>(x)\n\
              m = Div(first, three)\n\
              four = Constant<value_ints = [4]>()\n\
              target3 = Concat<axis = 0>(m, four)\n\
              odd = Reshape(merged, target3)\n\
            }\n";
        let named = |s: &str| Dim::Symbol(s.into());
        assert_eq!(
            dims(facts_of(text, "merged")),
            [named("2*N"), Dim::Known(8), Dim::Known(4)]
        );
        let n = [named("N"), Dim::Known(2), Dim::Known(8), Dim::Known(4)];
        assert_eq!(dims(facts_of(text, "split")), n);
        assert_eq!(dims(facts_of(text, "back")), n);
        assert_eq!(dims(facts_of(text, "rows")), [named("16*N"), Dim::Known(4)]);
        assert_eq!(dims(facts_of(text, "flat")), [named("16*N"), Dim::Known(4)]);
        // 2*N over 3 does not divide: not known.
        assert_eq!(dims(facts_of(text, "odd")), [Dim::Unknown, Dim::Known(4)]);
    }

    /// `Range` makes `ceil((limit - start) / delta)` values when the three fold (BLOOM's
    /// `arange` over the sequence length), and `T` values for `Range(0, T, 1)` with `T`
    /// named; a delta of 0 or a limit only the run knows stays unknown.
    #[test]
    fn range_lengths_fold() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,8] x, int64 k) => (int64[?] a, int64[?] b, int64[?] c, int64[?] d, int64[?] e) {\n\
              zero = Constant<value_int = 0>()\n\
              one = Constant<value_int = 1>()\n\
              three = Constant<value_int = 3>()\n\
              minus_two = Constant<value_int = -2>()\n\
              width = Shape<start = 1, end = 2>(x)\n\
              w = Squeeze(width)\n\
              batch = Shape<end = 1>(x)\n\
              nb = Squeeze(batch)\n\
              a = Range(zero, w, one)\n\
              b = Range(w, zero, minus_two)\n\
              c = Range(one, w, three)\n\
              d = Range(zero, nb, one)\n\
              e = Range(zero, k, one)\n\
            }\n";
        let len = |name| dims(facts_of(text, name));
        assert_eq!(len("a"), [Dim::Known(8)]);
        assert_eq!(len("b"), [Dim::Known(4)]);
        assert_eq!(len("c"), [Dim::Known(3)]);
        assert_eq!(len("d"), [Dim::Symbol("N".into())]);
        assert_eq!(len("e"), [Dim::Unknown]);
    }

    /// Swin pads H and W to a multiple of its window, the pads computed: the batch, not
    /// padded, keeps its name.
    #[test]
    fn pad_keeps_the_named_size_of_an_axis_it_does_not_pad() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,3,5] x) => (float[N,4,8] y) {\n\
              pads = Constant<value_ints = [0, 0, 1, 0, 1, 2]>()\n\
              y = Pad(x, pads)\n\
            }\n";
        assert_eq!(
            dims(facts_of(text, "y")),
            [Dim::Symbol("N".into()), Dim::Known(4), Dim::Known(8)]
        );
    }

    /// A declared output named by the exporter (`Addlogits_dim_0`) yields to the name the
    /// inference carries from the inputs, so the product it adds a bias to is not taken for
    /// a broadcast operand; a declared size beats an inferred name.
    #[test]
    fn an_inferred_size_or_name_beats_a_declared_name() {
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,6,4] h, float[4,32] w, float[32] b) => (float[Addlogits_dim_0,Addlogits_dim_1,32] logits) {\n\
              p = MatMul(h, w)\n\
              logits = Add(p, b)\n\
            }\n";
        assert_eq!(
            dims(facts_of(text, "logits")),
            [Dim::Symbol("N".into()), Dim::Known(6), Dim::Known(32)]
        );
        let text = "<ir_version: 9, opset_import: [\"\" : 17]>\n\
            g (float[N,6,4] h, float[4,32] w) => (float[8,6,32] p) {\n\
              p = MatMul(h, w)\n\
            }\n";
        assert_eq!(
            dims(facts_of(text, "p")),
            [Dim::Known(8), Dim::Known(6), Dim::Known(32)]
        );
    }

    /// GroupNorm's scale as torch writes it: unsqueezed over `Range(1, rank - 1, 1)`.
    #[test]
    fn unsqueeze_over_a_constant_range_has_its_rank() {
        let text = "<ir_version: 9, opset_import: [\"\" : 19]>\n\
            g (float[4] w) => (float[4,1,1] y) {\n\
              one = Constant<value_int = 1>()\n\
              three = Constant<value_int = 3>()\n\
              limit = Sub(three, one)\n\
              axes = Range(one, limit, one)\n\
              y = Unsqueeze(w, axes)\n\
            }\n";
        assert_eq!(
            dims(facts_of(text, "y")),
            [Dim::Known(4), Dim::Known(1), Dim::Known(1)]
        );
    }

    /// ceil_mode windows: one past the end (5 -> 3 of kernel 2), none starting in the end
    /// padding (4 with end pad 1 and kernel 2 -> 2, not 3: ONNX Runtime 1.31's AveragePool
    /// kernel writes 2, as torch does, where onnx 1.23's shape inference declares 3, so a
    /// graph that uses the output's shape fails to load there), and a kernel larger than the
    /// input (one window).
    #[test]
    fn ceil_mode_pooling_counts_windows_as_onnx_runtime_does() {
        assert_eq!(pool_windows(5, 2, 2, (0, 0), true), Some(3));
        assert_eq!(pool_windows(5, 2, 2, (0, 0), false), Some(2));
        assert_eq!(pool_windows(4, 2, 2, (0, 1), true), Some(2));
        assert_eq!(pool_windows(6, 3, 2, (1, 1), true), Some(4));
        assert_eq!(pool_windows(7, 3, 3, (0, 2), true), Some(3));
        assert_eq!(pool_windows(1, 320, 320, (0, 0), true), Some(1));
        assert_eq!(pool_windows(1, 320, 320, (0, 0), false), None);
        assert_eq!(pool_windows(4, 2, 2, (i64::MAX, 1), true), None);
    }
}
