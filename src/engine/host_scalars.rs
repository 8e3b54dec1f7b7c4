//! Scalar nodes the host computes instead of the session.
//!
//! A step's apply begins with a chain of scalar arithmetic: the window's count from the
//! micro-step counter, whether the window is full, the optimizer's step, AdamW's bias
//! corrections (`Pow`, `Sub`, `Sqrt`, `Div`, `Mul`), the counters' next values. Each is a
//! node, and ONNX Runtime spends a microsecond or two on a node however small it is: at 8K
//! parameters those 14 nodes were a third of what the apply costs over the floor
//! (benches/README.md, "Scaling with model size"). Every input of the chain is a scalar the
//! host already has (controls, counters, the flush flag, constants), so the host runs it.
//!
//! [`split_off`] takes such nodes out of a session's model: a node whose every input is a
//! scalar graph input, a scalar constant or another such node's output, of an operator in
//! [`Op`]. Their results that the session's remaining nodes read become graph inputs of
//! it; the graph outputs they made (the counters' next values, `ga.applied`) are made by
//! the host. Nodes of constants alone stay where they are (ONNX Runtime folds them) and
//! are folded here too when the host needs them. [`HostScalars::evaluate`] computes the
//! chain before each run with float32 arithmetic, as ONNX Runtime's CPU kernels do: the
//! same IEEE operations, and `Pow` through the same C library's `powf`, so that training
//! is bit-identical (`tests/host_scalars.rs` checks every operator against ONNX Runtime).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::data::Tensor;
use crate::proto::{tensor_proto::DataType, ModelProto, NodeProto, ValueInfoProto};

use super::{EngineError, Held};

/// A scalar of one of the element types the host computes with.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Scalar {
    F32(f32),
    I64(i64),
    Bool(bool),
}

/// The element types of [`Scalar`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    F32,
    I64,
    Bool,
}

impl Elem {
    fn of_onnx(data_type: i32) -> Option<Elem> {
        match DataType::try_from(data_type).ok()? {
            DataType::Float => Some(Elem::F32),
            DataType::Int64 => Some(Elem::I64),
            DataType::Bool => Some(Elem::Bool),
            _ => None,
        }
    }

    fn onnx(self) -> i32 {
        match self {
            Elem::F32 => DataType::Float as i32,
            Elem::I64 => DataType::Int64 as i32,
            Elem::Bool => DataType::Bool as i32,
        }
    }
}

impl Scalar {
    fn elem(self) -> Elem {
        match self {
            Scalar::F32(_) => Elem::F32,
            Scalar::I64(_) => Elem::I64,
            Scalar::Bool(_) => Elem::Bool,
        }
    }

    /// The one element of `t`, when it has exactly one of a [`Scalar`] type.
    fn of_tensor(t: &Tensor) -> Option<Scalar> {
        let one = |len: usize| len == 1;
        match t {
            Tensor::F32(a) if one(a.len()) => a.iter().next().map(|&x| Scalar::F32(x)),
            Tensor::I64(a) if one(a.len()) => a.iter().next().map(|&x| Scalar::I64(x)),
            Tensor::Bool(a) if one(a.len()) => a.iter().next().map(|&x| Scalar::Bool(x)),
            _ => None,
        }
    }

    /// A tensor of shape `[1; rank]` holding it.
    fn to_tensor(self, rank: usize) -> Tensor {
        // The shape's ones from a constant, not collected: made for every run's outputs.
        const ONES: [usize; 8] = [1; 8];
        let shape = match ONES.get(..rank) {
            Some(ones) => ndarray::IxDyn(ones),
            None => ndarray::IxDyn(&vec![1; rank]),
        };
        match self {
            Scalar::F32(x) => Tensor::F32(ndarray::ArrayD::from_elem(shape, x)),
            Scalar::I64(x) => Tensor::I64(ndarray::ArrayD::from_elem(shape, x)),
            Scalar::Bool(x) => Tensor::Bool(ndarray::ArrayD::from_elem(shape, x)),
        }
    }
}

/// The operators the host computes, each as ONNX Runtime's CPU kernel does for scalars.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Add,
    Sub,
    Mul,
    /// float32 only: an integer division by zero has no value to give.
    Div,
    /// float32 base and exponent: `powf`, as ONNX Runtime's `std::pow`.
    Pow,
    Sqrt,
    Neg,
    Reciprocal,
    Identity,
    Cast(Elem),
    Equal,
    Less,
    LessOrEqual,
    Greater,
    GreaterOrEqual,
    And,
    Or,
    Xor,
    Not,
}

impl Op {
    /// The operator of `node` and its result's element type for `inputs`; `None` when the
    /// host does not compute it (another operator, domain, attribute or input type).
    fn of(node: &NodeProto, inputs: &[Elem]) -> Option<(Op, Elem)> {
        if !crate::ir::normalize_domain(node.domain()).is_empty() {
            return None;
        }
        let op_type = node.op_type();
        let attributes_allowed = match op_type {
            "Cast" => node
                .attribute
                .iter()
                .all(|a| a.name() == "to" || (a.name() == "saturate" && a.i() == 1)),
            _ => node.attribute.is_empty(),
        };
        if !attributes_allowed {
            return None;
        }
        use Elem::*;
        let same = |want: &[Elem]| match inputs {
            [a, b] if a == b && want.contains(a) => Some(*a),
            _ => None,
        };
        let unary = |want: &[Elem]| match inputs {
            [a] if want.contains(a) => Some(*a),
            _ => None,
        };
        let op = match op_type {
            "Add" => (Op::Add, same(&[F32, I64])?),
            "Sub" => (Op::Sub, same(&[F32, I64])?),
            "Mul" => (Op::Mul, same(&[F32, I64])?),
            "Div" => (Op::Div, same(&[F32])?),
            "Pow" => (Op::Pow, same(&[F32])?),
            "Sqrt" => (Op::Sqrt, unary(&[F32])?),
            "Neg" => (Op::Neg, unary(&[F32, I64])?),
            "Reciprocal" => (Op::Reciprocal, unary(&[F32])?),
            "Identity" => (Op::Identity, unary(&[F32, I64, Bool])?),
            "Cast" => {
                let to = node.attribute.iter().find(|a| a.name() == "to")?.i();
                let to = Elem::of_onnx(i32::try_from(to).ok()?)?;
                // float -> int or bool would need ONNX Runtime's rounding and NaN rules.
                let from: &[Elem] = match to {
                    F32 => &[F32, I64, Bool],
                    I64 | Bool => &[I64, Bool],
                };
                unary(from)?;
                (Op::Cast(to), to)
            }
            "Equal" => (Op::Equal, same(&[F32, I64, Bool]).map(|_| Bool)?),
            "Less" => (Op::Less, same(&[F32, I64]).map(|_| Bool)?),
            "LessOrEqual" => (Op::LessOrEqual, same(&[F32, I64]).map(|_| Bool)?),
            "Greater" => (Op::Greater, same(&[F32, I64]).map(|_| Bool)?),
            "GreaterOrEqual" => (Op::GreaterOrEqual, same(&[F32, I64]).map(|_| Bool)?),
            "And" => (Op::And, same(&[Bool])?),
            "Or" => (Op::Or, same(&[Bool])?),
            "Xor" => (Op::Xor, same(&[Bool])?),
            "Not" => (Op::Not, unary(&[Bool])?),
            // Not `Where`: ONNX Runtime's gives Where(true, -0.0, 0.0) = +0.0 (measured,
            // tests/host_scalars.rs), not the value it selects.
            _ => return None,
        };
        Some(op)
    }

    /// The result for `args` (of the types [`Op::of`] accepted).
    fn apply(self, args: &[Scalar]) -> Option<Scalar> {
        use Scalar::*;
        Some(match (self, args) {
            (Op::Add, [F32(a), F32(b)]) => F32(a + b),
            (Op::Add, [I64(a), I64(b)]) => I64(a.wrapping_add(*b)),
            (Op::Sub, [F32(a), F32(b)]) => F32(a - b),
            (Op::Sub, [I64(a), I64(b)]) => I64(a.wrapping_sub(*b)),
            (Op::Mul, [F32(a), F32(b)]) => F32(a * b),
            (Op::Mul, [I64(a), I64(b)]) => I64(a.wrapping_mul(*b)),
            (Op::Div, [F32(a), F32(b)]) => F32(a / b),
            (Op::Pow, [F32(a), F32(b)]) => F32(a.powf(*b)),
            (Op::Sqrt, [F32(a)]) => F32(a.sqrt()),
            (Op::Neg, [F32(a)]) => F32(-a),
            (Op::Neg, [I64(a)]) => I64(a.wrapping_neg()),
            (Op::Reciprocal, [F32(a)]) => F32(1.0 / a),
            (Op::Identity, [a]) => *a,
            (Op::Cast(Elem::F32), [F32(a)]) => F32(*a),
            (Op::Cast(Elem::F32), [I64(a)]) => F32(*a as f32),
            (Op::Cast(Elem::F32), [Bool(a)]) => F32(if *a { 1.0 } else { 0.0 }),
            (Op::Cast(Elem::I64), [I64(a)]) => I64(*a),
            (Op::Cast(Elem::I64), [Bool(a)]) => I64(*a as i64),
            (Op::Cast(Elem::Bool), [I64(a)]) => Bool(*a != 0),
            (Op::Cast(Elem::Bool), [Bool(a)]) => Bool(*a),
            (Op::Equal, [a, b]) => Bool(a == b),
            (Op::Less, [F32(a), F32(b)]) => Bool(a < b),
            (Op::Less, [I64(a), I64(b)]) => Bool(a < b),
            (Op::LessOrEqual, [F32(a), F32(b)]) => Bool(a <= b),
            (Op::LessOrEqual, [I64(a), I64(b)]) => Bool(a <= b),
            (Op::Greater, [F32(a), F32(b)]) => Bool(a > b),
            (Op::Greater, [I64(a), I64(b)]) => Bool(a > b),
            (Op::GreaterOrEqual, [F32(a), F32(b)]) => Bool(a >= b),
            (Op::GreaterOrEqual, [I64(a), I64(b)]) => Bool(a >= b),
            (Op::And, [Bool(a), Bool(b)]) => Bool(*a && *b),
            (Op::Or, [Bool(a), Bool(b)]) => Bool(*a || *b),
            (Op::Xor, [Bool(a), Bool(b)]) => Bool(a != b),
            (Op::Not, [Bool(a)]) => Bool(!a),
            _ => return None,
        })
    }
}

/// Where a value of the host's chain comes from.
#[derive(Clone, Debug)]
enum Source {
    /// A graph input the run is fed (or its initializer, when not fed).
    Input {
        name: String,
        default: Option<Scalar>,
    },
    /// A constant, folded when split off.
    Constant(Scalar),
    /// The output of one of [`HostScalars::nodes`].
    Node,
}

/// A value of the chain: where it comes from, its type, and its rank (all its dimensions
/// are 1; a rank-0 and a rank-1 scalar differ to the graph).
#[derive(Clone, Debug)]
struct Known {
    source: Source,
    elem: Elem,
    rank: usize,
}

#[derive(Clone, Debug)]
struct HostNode {
    op: Op,
    /// Indices into [`HostScalars::values`].
    inputs: Vec<usize>,
    output: usize,
}

/// The scalar nodes a session leaves to the host ([`split_off`]).
#[derive(Clone, Debug)]
pub struct HostScalars {
    values: Vec<Known>,
    /// In graph order: each node's inputs come before it.
    nodes: Vec<HostNode>,
    /// Values the session reads as graph inputs, by their name.
    feeds: Vec<(String, usize)>,
    /// The graph outputs the host makes, by name.
    outputs: Vec<(String, usize)>,
    /// The graph inputs the host's nodes read (the others it need not look up).
    read_inputs: Vec<usize>,
    /// For each of `read_inputs`, where the last run had it among the host's feeds and
    /// then the held ones: looked at first (the same place run after run), before a search
    /// by name.
    found_at: Vec<FoundAt>,
}

/// What the host computed for one run.
pub struct Computed<'s> {
    /// To feed to the session.
    pub feeds: Vec<(&'s str, Tensor)>,
    /// Graph outputs of the run, made by the host.
    pub outputs: Vec<(&'s str, Tensor)>,
}

/// The rank of a graph input declared as a tensor of `elem` with every dimension 1.
fn scalar_input(info: &ValueInfoProto) -> Option<(Elem, usize)> {
    use crate::proto::type_proto::Value;
    let Some(Value::TensorType(t)) = info.r#type.as_ref()?.value.as_ref() else {
        return None;
    };
    let elem = Elem::of_onnx(t.elem_type())?;
    let dims = &t.shape.as_ref()?.dim;
    let ones = dims.iter().all(|d| {
        matches!(
            d.value,
            Some(crate::proto::tensor_shape_proto::dimension::Value::DimValue(1))
        )
    });
    ones.then_some((elem, dims.len()))
}

/// A constant's value, when it is a scalar of a [`Scalar`] type.
fn constant(t: &crate::proto::TensorProto) -> Option<(Scalar, usize)> {
    Elem::of_onnx(t.data_type())?;
    let value = Tensor::from_tensor_proto(t).ok()?;
    Some((Scalar::of_tensor(&value)?, t.dims.len()))
}

/// What becomes of a node of the graph.
#[derive(Clone, Copy, PartialEq)]
enum Fate {
    Session,
    /// Computed by the host every run.
    Host,
    /// Of constants alone: folded by the host once, and left to the session too while a
    /// node of the session reads it.
    Folded,
}

/// The values the host knows, by name, as [`split_off`] follows the graph.
#[derive(Default)]
struct Chain {
    values: Vec<Known>,
    by_name: HashMap<String, usize>,
    nodes: Vec<HostNode>,
}

impl Chain {
    fn add(&mut self, name: &str, known: Known) {
        self.by_name.insert(name.to_string(), self.values.len());
        self.values.push(known);
    }

    /// Whether the host computes `name` every run (not an input or a constant).
    fn computes(&self, name: &str) -> bool {
        self.by_name
            .get(name)
            .is_some_and(|&i| matches!(self.values[i].source, Source::Node))
    }

    /// The scalar graph inputs (with their initializers as defaults) and the scalar
    /// constants of `graph`.
    fn leaves(graph: &crate::proto::GraphProto) -> Chain {
        let mut chain = Chain::default();
        let initializers: HashMap<&str, &crate::proto::TensorProto> =
            graph.initializer.iter().map(|t| (t.name(), t)).collect();
        for input in &graph.input {
            let Some((elem, rank)) = scalar_input(input) else {
                continue;
            };
            let default = match initializers.get(input.name()) {
                Some(t) => match constant(t) {
                    Some((value, _)) if value.elem() == elem => Some(value),
                    _ => continue,
                },
                None => None,
            };
            let name = input.name().to_string();
            let source = Source::Input { name, default };
            chain.add(input.name(), Known { source, elem, rank });
        }
        let graph_inputs: HashSet<&str> = graph.input.iter().map(|i| i.name()).collect();
        for t in graph
            .initializer
            .iter()
            .filter(|t| !graph_inputs.contains(t.name()))
        {
            if let Some((value, rank)) = constant(t) {
                let (source, elem) = (Source::Constant(value), value.elem());
                chain.add(t.name(), Known { source, elem, rank });
            }
        }
        chain
    }

    /// Follows `graph`'s nodes in order, taking each that reads only known scalars with an
    /// operator the host computes; returns what becomes of every node.
    fn follow(&mut self, graph: &crate::proto::GraphProto) -> Vec<Fate> {
        let mut fates = vec![Fate::Session; graph.node.len()];
        for (index, node) in graph.node.iter().enumerate() {
            let [output] = node.output.as_slice() else {
                continue;
            };
            let inputs: Option<Vec<usize>> = node
                .input
                .iter()
                .map(|i| self.by_name.get(i.as_str()).copied())
                .collect();
            let Some(inputs) = inputs.filter(|i| !i.is_empty()) else {
                continue;
            };
            let elems: Vec<Elem> = inputs.iter().map(|&i| self.values[i].elem).collect();
            let Some((op, elem)) = Op::of(node, &elems) else {
                continue;
            };
            let rank = inputs
                .iter()
                .map(|&i| self.values[i].rank)
                .max()
                .unwrap_or(0);
            let constants: Option<Vec<Scalar>> = inputs
                .iter()
                .map(|&i| match self.values[i].source {
                    Source::Constant(c) => Some(c),
                    _ => None,
                })
                .collect();
            let source = match constants {
                Some(args) => match op.apply(&args) {
                    Some(value) => {
                        fates[index] = Fate::Folded;
                        Source::Constant(value)
                    }
                    None => continue,
                },
                None => {
                    fates[index] = Fate::Host;
                    let output = self.values.len();
                    self.nodes.push(HostNode { op, inputs, output });
                    Source::Node
                }
            };
            self.add(output, Known { source, elem, rank });
        }
        fates
    }
}

/// Which nodes the session keeps: its own, and the folded ones its own read (backwards: a
/// folded node may read another).
fn kept_nodes(graph: &crate::proto::GraphProto, fates: &[Fate]) -> Vec<bool> {
    let mut kept: Vec<bool> = fates.iter().map(|f| *f == Fate::Session).collect();
    let mut read: HashSet<&str> = HashSet::new();
    for (index, node) in graph.node.iter().enumerate().rev() {
        let needed = kept[index]
            || (fates[index] == Fate::Folded
                && node.output.iter().any(|o| read.contains(o.as_str())));
        if needed {
            kept[index] = true;
            read.extend(node.input.iter().map(String::as_str));
        }
    }
    kept
}

/// `model` without the scalar nodes the host can compute, and those nodes; `None` when it
/// has none (or has subgraphs, whose captures this does not follow).
pub fn split_off(model: &ModelProto) -> Option<(ModelProto, HostScalars)> {
    let graph = model.graph.as_ref()?;
    let has_subgraphs = graph.node.iter().any(|n| {
        n.attribute
            .iter()
            .any(|a| a.g.is_some() || !a.graphs.is_empty())
    });
    if has_subgraphs {
        return None;
    }
    let mut chain = Chain::leaves(graph);
    let fates = chain.follow(graph);
    if !fates.contains(&Fate::Host) {
        return None;
    }
    let kept = kept_nodes(graph, &fates);
    let outputs_of = |keep: bool| -> HashSet<&str> {
        graph
            .node
            .iter()
            .zip(&kept)
            .filter(|(_, k)| **k == keep)
            .flat_map(|(n, _)| n.output.iter().map(String::as_str))
            .collect()
    };
    let (session_made, host_made) = (outputs_of(true), outputs_of(false));
    // What the session's own nodes still read of the host's results becomes its inputs.
    let mut feeds: Vec<(String, usize)> = Vec::new();
    for (node, _) in graph
        .node
        .iter()
        .zip(&fates)
        .zip(&kept)
        .filter(|((_, f), k)| **k && **f == Fate::Session)
        .map(|(nf, _)| nf)
    {
        for input in &node.input {
            if chain.computes(input) && !feeds.iter().any(|(n, _)| n == input) {
                feeds.push((input.clone(), chain.by_name[input.as_str()]));
            }
        }
    }
    // Graph outputs of nodes the session no longer runs are the host's, constants or not.
    let returned = |name: &str| host_made.contains(name);
    let outputs: Vec<(String, usize)> = graph
        .output
        .iter()
        .filter(|o| returned(o.name()))
        .map(|o| (o.name().to_string(), chain.by_name[o.name()]))
        .collect();
    let mut rewritten = model.clone();
    let g = rewritten.graph.as_mut()?;
    g.node = graph
        .node
        .iter()
        .zip(&kept)
        .filter(|(_, k)| **k)
        .map(|(n, _)| n.clone())
        .collect();
    g.output.retain(|o| !returned(o.name()));
    // The declarations of what the session no longer makes go; a fed value is declared
    // as an input.
    g.value_info
        .retain(|v| session_made.contains(v.name()) || !host_made.contains(v.name()));
    for (name, value) in &feeds {
        let Known { elem, rank, .. } = chain.values[*value];
        g.input.push(ValueInfoProto {
            name: Some(name.clone()),
            r#type: Some(crate::ir::tensor_type(elem.onnx(), &vec![1; rank])),
            ..Default::default()
        });
    }
    let Chain { values, nodes, .. } = chain;
    let mut read_inputs: Vec<usize> = nodes
        .iter()
        .flat_map(|n| n.inputs.iter().copied())
        .filter(|&i| matches!(values[i].source, Source::Input { .. }))
        .collect();
    read_inputs.sort_unstable();
    read_inputs.dedup();
    Some((
        rewritten,
        HostScalars {
            values,
            nodes,
            feeds,
            outputs,
            found_at: vec![FoundAt::default(); read_inputs.len()],
            read_inputs,
        },
    ))
}

impl HostScalars {
    /// How many nodes the host computes.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Computes the chain from this run's inputs: `host` tensors and `held` values (the
    /// state), or the inputs' initializers where they are not fed.
    pub fn evaluate<'s>(
        &'s self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &Held)],
    ) -> Result<Computed<'s>, EngineError> {
        let mut slots: Vec<Option<Scalar>> = self
            .values
            .iter()
            .map(|known| match known.source {
                Source::Constant(c) => Some(c),
                _ => None,
            })
            .collect();
        for (&slot, found_at) in self.read_inputs.iter().zip(&self.found_at) {
            if let Source::Input { name, default } = &self.values[slot].source {
                let fed = Fed::find(name, host, held, found_at);
                slots[slot] = Some(Self::fed(name, &self.values[slot], default, fed)?);
            }
        }
        for node in &self.nodes {
            // Every op of [`Op::of`] takes one input or two: on the stack, not collected.
            let mut args = [Scalar::Bool(false); 2];
            let n = node.inputs.len();
            let known = n <= args.len()
                && node
                    .inputs
                    .iter()
                    .zip(&mut args)
                    .all(|(&i, arg)| match slots[i] {
                        Some(v) => {
                            *arg = v;
                            true
                        }
                        None => false,
                    });
            slots[node.output] = known.then(|| node.op.apply(&args[..n])).flatten();
        }
        let tensor = |(name, slot): &'s (String, usize)| -> Result<(&'s str, Tensor), EngineError> {
            let value = slots[*slot].ok_or_else(|| EngineError::Output {
                name: name.clone(),
                message: "the host could not compute it".into(),
            })?;
            Ok((name.as_str(), value.to_tensor(self.values[*slot].rank)))
        };
        Ok(Computed {
            feeds: self.feeds.iter().map(tensor).collect::<Result<_, _>>()?,
            outputs: self.outputs.iter().map(tensor).collect::<Result<_, _>>()?,
        })
    }

    /// The value of input `name` this run.
    fn fed(
        name: &str,
        known: &Known,
        default: &Option<Scalar>,
        fed: Option<Fed<'_>>,
    ) -> Result<Scalar, EngineError> {
        let read_back;
        let tensor = match fed {
            Some(Fed::Host(t) | Fed::Held(Held::Host(t))) => Some(t),
            Some(Fed::Held(held @ Held::Ort(_))) => {
                read_back = held.to_host(name)?;
                Some(&read_back)
            }
            None => None,
        };
        let value = match tensor {
            Some(t) => Scalar::of_tensor(t),
            None => *default,
        };
        match value {
            Some(v) if v.elem() == known.elem => Ok(v),
            Some(_) | None if tensor.is_some() => Err(EngineError::Input {
                name: name.to_string(),
                message: format!(
                    "must be one {:?} element (the session reads it as a scalar)",
                    known.elem
                ),
            }),
            _ => Err(EngineError::Input {
                name: name.to_string(),
                message: "was not fed and has no initializer".into(),
            }),
        }
    }
}

/// Where a run has an input the host reads.
#[derive(Clone, Copy)]
enum Fed<'a> {
    Host(&'a Tensor),
    Held(&'a Held),
}

impl<'a> Fed<'a> {
    /// The input `name` among `host` then `held` (the first found; positions counted across
    /// both), looked for at `found_at` first; `found_at` is left where it was found.
    fn find(
        name: &str,
        host: &[(&'a str, &'a Tensor)],
        held: &[(&'a str, &'a Held)],
        found_at: &FoundAt,
    ) -> Option<Fed<'a>> {
        let at = |i: usize| match i.checked_sub(host.len()) {
            None => (host[i].0 == name).then_some(Fed::Host(host[i].1)),
            Some(k) => held
                .get(k)
                .and_then(|&(n, v)| (n == name).then_some(Fed::Held(v))),
        };
        // A held hit stands only when the host feeds no input of that name (the host's
        // feeds come first; they are few).
        let hinted = found_at.0.load(Ordering::Relaxed);
        if let Some(fed) = at(hinted) {
            if hinted < host.len() || !host.iter().any(|(n, _)| *n == name) {
                return Some(fed);
            }
        }
        let (i, fed) = (0..host.len() + held.len()).find_map(|i| Some((i, at(i)?)))?;
        found_at.0.store(i, Ordering::Relaxed);
        Some(fed)
    }
}

/// A position [`Fed::find`] found an input at (a hint: any value is safe). Atomic only so
/// that a session's host scalars may be shared between threads.
#[derive(Debug, Default)]
struct FoundAt(AtomicUsize);

impl Clone for FoundAt {
    fn clone(&self) -> Self {
        FoundAt(AtomicUsize::new(self.0.load(Ordering::Relaxed)))
    }
}
