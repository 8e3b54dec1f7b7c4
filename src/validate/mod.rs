//! Load-time validation of a `ModelProto`, in the spirit of `onnx.checker`'s full check:
//! every violation is collected with its location, so one run names them all.
//!
//! Checked:
//! * opset imports: each domain at most once (`""` and `ai.onnx` are the same domain), a
//!   positive version;
//! * nodes: a non-empty op type, an imported domain (or a model-local function's), for
//!   the domains the schema tables know ([`op_schema`]: ai.onnx, ai.onnx.ml,
//!   ai.onnx.preview(.training), com.microsoft) a known op defined at the imported opset
//!   version, input and output counts in the schema's range, attributes of the schema's
//!   types, no unknown attribute (onnx domains), no missing required attribute, no
//!   duplicate attribute;
//! * names: unique initializers, single assignment (a node output is not a graph input,
//!   an initializer or another node's output), node inputs defined before use (own graph
//!   or an enclosing one);
//! * types: graph inputs and outputs carry a type, tensor element types are valid;
//! * tensors (initializers, attribute tensors, in subgraphs too): a valid data type,
//!   non-negative dims whose product does not overflow, and data that matches them
//!   (`raw_data` length, or the count of the typed field). Tensors still referring to
//!   external data are not sized (their data is not loaded).

// Generated (scripts/op-schema.py); rustfmt would reflow its one-line rows.
#[rustfmt::skip]
mod op_schema;

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::ir::normalize_domain;
use crate::proto::tensor_proto::DataType;
use crate::proto::{
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, TypeProto,
    ValueInfoProto,
};

/// One operator schema row (see `scripts/op-schema.py`).
pub struct OpSchema {
    pub domain: &'static str,
    pub op: &'static str,
    pub since: i64,
    /// (min, max) counts; `i32::MAX` is unbounded.
    pub inputs: (u32, u32),
    pub outputs: (u32, u32),
    pub attrs: &'static [A],
}

/// An attribute of a schema: name, `AttributeProto.AttributeType` number, required.
pub struct A(pub &'static str, pub i32, pub bool);

/// An ai.onnx op version that differs from the one before it only by taking more tensor
/// types (see `scripts/op-schema.py`): a node using none of `adds` means the same at both.
pub struct Widening {
    pub op: &'static str,
    pub since: i64,
    pub previous: i64,
    /// The tensor element types (`TensorProto.DataType` numbers) the version added.
    pub adds: &'static [i32],
}

/// The version of ai.onnx op `op`'s schema in force at opset `opset` (the newest `since`
/// not above it), `None` when the op is not defined there.
pub fn since_version(op: &str, opset: i64) -> Option<i64> {
    schemas("", op)
        .iter()
        .rev()
        .find(|s| s.since <= opset)
        .map(|s| s.since)
}

/// Whether ai.onnx op `op`'s version `since` only widened the version before it.
pub fn widening(op: &str, since: i64) -> Option<&'static Widening> {
    let table = op_schema::WIDENINGS;
    table
        .binary_search_by(|w| (w.op, w.since).cmp(&(op, since)))
        .ok()
        .map(|i| &table[i])
}

/// One violation, with where it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationError {
    /// E.g. `graph 'main': node 'Add_1' (Add)` or `opset_import`.
    pub location: String,
    pub message: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.message)
    }
}

/// All violations of one model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationErrors(pub Vec<ValidationError>);

impl fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "invalid ONNX model ({n} error{}):",
            if n == 1 { "" } else { "s" }
        )?;
        // A mutated model can hold thousands: the first ones say enough.
        for e in self.0.iter().take(20) {
            write!(f, "\n  {e}")?;
        }
        if n > 20 {
            write!(f, "\n  ... and {} more", n - 20)?;
        }
        Ok(())
    }
}

/// Domains whose every op the schema tables list: an op not there is unknown.
fn known_domain(domain: &str) -> bool {
    matches!(
        domain,
        "" | "ai.onnx.ml" | "ai.onnx.preview" | "ai.onnx.preview.training" | "com.microsoft"
    )
}

fn schemas(domain: &str, op: &str) -> &'static [OpSchema] {
    let table = op_schema::SCHEMAS;
    let start = table.partition_point(|s| (s.domain, s.op) < (domain, op));
    let end = start + table[start..].partition_point(|s| (s.domain, s.op) == (domain, op));
    &table[start..end]
}

/// Validates `model`; `Ok` when nothing is wrong.
pub fn validate(model: &ModelProto) -> Result<(), ValidationErrors> {
    let mut v = Validator {
        errors: Vec::new(),
        opsets: HashMap::new(),
        functions: HashSet::new(),
    };
    v.opsets(model);
    for f in &model.functions {
        v.functions.insert((
            normalize_domain(f.domain()).to_string(),
            f.name().to_string(),
        ));
    }
    if let Some(g) = &model.graph {
        v.graph(g, "graph", &[]);
    }
    for (i, t) in model.training_info.iter().enumerate() {
        if let Some(g) = &t.initialization {
            v.graph(g, &format!("training_info[{i}].initialization"), &[]);
        }
        if let Some(g) = &t.algorithm {
            v.graph(g, &format!("training_info[{i}].algorithm"), &[]);
        }
    }
    if v.errors.is_empty() {
        Ok(())
    } else {
        Err(ValidationErrors(v.errors))
    }
}

struct Validator {
    errors: Vec<ValidationError>,
    opsets: HashMap<String, i64>,
    functions: HashSet<(String, String)>,
}

impl Validator {
    fn err(&mut self, location: impl Into<String>, message: impl Into<String>) {
        self.errors.push(ValidationError {
            location: location.into(),
            message: message.into(),
        });
    }

    fn opsets(&mut self, model: &ModelProto) {
        for o in &model.opset_import {
            let domain = normalize_domain(o.domain()).to_string();
            let shown = if domain.is_empty() {
                "ai.onnx".to_string()
            } else {
                domain.clone()
            };
            match o.version {
                None => self.err("opset_import", format!("domain '{shown}' has no version")),
                Some(v) if v <= 0 => self.err(
                    "opset_import",
                    format!("domain '{shown}' has version {v}, must be positive"),
                ),
                Some(_) => {}
            }
            if self.opsets.insert(domain, o.version()).is_some() {
                self.err(
                    "opset_import",
                    format!("domain '{shown}' is imported more than once"),
                );
            }
        }
    }

    /// `outer`: the names visible from enclosing graphs.
    fn graph(&mut self, g: &GraphProto, where_: &str, outer: &[&HashSet<String>]) {
        let loc = match g.name() {
            "" => where_.to_string(),
            n => format!("{where_} '{n}'"),
        };
        let mut defined: HashSet<String> = HashSet::new();
        let visible = |name: &str, defined: &HashSet<String>| {
            defined.contains(name) || outer.iter().any(|s| s.contains(name))
        };
        for (kind, list) in [("input", &g.input), ("output", &g.output)] {
            for (i, vi) in list.iter().enumerate() {
                self.value_info(vi, &format!("{loc}: {kind} {i} '{}'", vi.name()));
            }
        }
        for vi in &g.input {
            if vi.name().is_empty() {
                self.err(&loc, "a graph input has an empty name");
            } else if !defined.insert(vi.name().to_string()) {
                self.err(
                    &loc,
                    format!("graph input '{}' is declared twice", vi.name()),
                );
            }
        }
        let inputs: HashSet<&str> = g.input.iter().map(|v| v.name()).collect();
        let mut inits: HashSet<&str> = HashSet::new();
        for t in &g.initializer {
            let name = t.name();
            let tloc = format!("{loc}: initializer '{name}'");
            if name.is_empty() {
                self.err(&loc, "an initializer has an empty name");
            } else if !inits.insert(name) {
                self.err(&tloc, "duplicate initializer (the name is used twice)");
            }
            self.tensor(t, &tloc);
            defined.insert(name.to_string());
        }
        for s in &g.sparse_initializer {
            if let Some(t) = &s.values {
                defined.insert(t.name().to_string());
            }
        }
        let _ = inputs;
        for (i, node) in g.node.iter().enumerate() {
            let nloc = match node.name() {
                "" => format!("{loc}: node {i} ({})", node.op_type()),
                n => format!("{loc}: node '{n}' ({})", node.op_type()),
            };
            for input in &node.input {
                if !input.is_empty() && !visible(input, &defined) {
                    self.err(
                        &nloc,
                        format!(
                            "input '{input}' is not defined before the node (not a graph \
                             input, initializer or earlier node output)"
                        ),
                    );
                }
            }
            // Subgraphs see everything defined so far.
            {
                let mut scopes: Vec<&HashSet<String>> = outer.to_vec();
                scopes.push(&defined);
                for a in &node.attribute {
                    let aloc = format!("{nloc}: attribute '{}'", a.name());
                    if let Some(sub) = &a.g {
                        self.graph(sub, &aloc, &scopes);
                    }
                    for (k, sub) in a.graphs.iter().enumerate() {
                        self.graph(sub, &format!("{aloc}[{k}]"), &scopes);
                    }
                }
            }
            self.node(node, &nloc);
            for out in &node.output {
                if out.is_empty() {
                    continue;
                }
                if visible(out, &defined) {
                    self.err(
                        &nloc,
                        format!(
                            "output '{out}' is already defined (graph input, initializer or \
                             another node's output): the graph is not in single static \
                             assignment form"
                        ),
                    );
                }
                defined.insert(out.clone());
            }
        }
        for (i, vi) in g.output.iter().enumerate() {
            if !vi.name().is_empty() && !visible(vi.name(), &defined) {
                self.err(
                    format!("{loc}: output {i} '{}'", vi.name()),
                    "is not defined by any node, input or initializer",
                );
            }
        }
    }

    fn value_info(&mut self, vi: &ValueInfoProto, loc: &str) {
        match &vi.r#type {
            None => self.err(loc, "has no type"),
            Some(t) => self.type_proto(t, loc),
        }
    }

    fn type_proto(&mut self, t: &TypeProto, loc: &str) {
        match &t.value {
            Some(type_proto::Value::TensorType(tt)) => {
                let e = tt.elem_type();
                if e == 0 || DataType::try_from(e).is_err() {
                    self.err(
                        loc,
                        format!("tensor element type {e} is not a valid data type"),
                    );
                }
            }
            Some(type_proto::Value::SequenceType(s)) => {
                if let Some(e) = &s.elem_type {
                    self.type_proto(e, loc);
                }
            }
            Some(type_proto::Value::OptionalType(s)) => {
                if let Some(e) = &s.elem_type {
                    self.type_proto(e, loc);
                }
            }
            Some(type_proto::Value::MapType(m)) => {
                if let Some(e) = &m.value_type {
                    self.type_proto(e, loc);
                }
            }
            Some(_) => {}
            None => self.err(loc, "has an empty type"),
        }
    }

    fn node(&mut self, node: &NodeProto, loc: &str) {
        let op = node.op_type();
        if op.is_empty() {
            self.err(loc, "empty op type");
            return;
        }
        let domain = normalize_domain(node.domain()).to_string();
        if self.functions.contains(&(domain.clone(), op.to_string())) {
            return;
        }
        let Some(&version) = self.opsets.get(&domain) else {
            self.err(
                loc,
                format!(
                    "domain '{}' is not in the model's opset imports",
                    if domain.is_empty() {
                        "ai.onnx"
                    } else {
                        &domain
                    }
                ),
            );
            return;
        };
        let mut names = HashSet::new();
        for a in &node.attribute {
            if !names.insert(a.name()) {
                self.err(
                    loc,
                    format!("attribute '{}' is given more than once", a.name()),
                );
            }
            if let Some(t) = &a.t {
                self.tensor(t, &format!("{loc}: attribute '{}'", a.name()));
            }
            for (k, t) in a.tensors.iter().enumerate() {
                self.tensor(t, &format!("{loc}: attribute '{}'[{k}]", a.name()));
            }
        }
        if !known_domain(&domain) {
            return;
        }
        let rows = schemas(&domain, op);
        if rows.is_empty() {
            if crate::ops::is_training_only(&domain, op) {
                return; // ONNX Runtime training ops: known, schema not at hand.
            }
            let shown = if domain.is_empty() {
                "ai.onnx"
            } else {
                &domain
            };
            let mut ops: Vec<&str> = op_schema::SCHEMAS
                .iter()
                .filter(|s| s.domain == domain)
                .map(|s| s.op)
                .collect();
            ops.dedup();
            let hint = if ops.len() <= 12 {
                format!(" (it has: {})", ops.join(", "))
            } else {
                String::new()
            };
            self.err(loc, format!("unknown op '{op}' in domain '{shown}'{hint}"));
            return;
        }
        // com.microsoft schemas are the latest version only: not versioned here.
        let schema = if domain == "com.microsoft" {
            rows.last()
        } else {
            rows.iter().rev().find(|s| s.since <= version)
        };
        let Some(schema) = schema else {
            self.err(
                loc,
                format!(
                    "op '{op}' is not defined at opset {version} (it exists since opset {})",
                    rows[0].since
                ),
            );
            return;
        };
        let count = |n: usize, (lo, hi): (u32, u32)| (lo as usize) <= n && n <= hi as usize;
        if !count(node.input.len(), schema.inputs) {
            self.err(
                loc,
                format!(
                    "{} inputs, the schema allows {}",
                    node.input.len(),
                    range(schema.inputs)
                ),
            );
        }
        if !count(node.output.len(), schema.outputs) {
            self.err(
                loc,
                format!(
                    "{} outputs, the schema allows {}",
                    node.output.len(),
                    range(schema.outputs)
                ),
            );
        }
        for a in &node.attribute {
            let Some(spec) = schema.attrs.iter().find(|s| s.0 == a.name()) else {
                if domain != "com.microsoft" && a.ref_attr_name().is_empty() {
                    self.err(loc, format!("unknown attribute '{}' for {op}", a.name()));
                }
                continue;
            };
            if !a.ref_attr_name().is_empty() {
                continue;
            }
            let actual = attribute_type(a);
            if actual != spec.1 {
                self.err(
                    loc,
                    format!(
                        "attribute '{}' is {}, {op} expects {}",
                        a.name(),
                        type_name(actual),
                        type_name(spec.1)
                    ),
                );
            }
        }
        for spec in schema.attrs.iter().filter(|s| s.2) {
            if !node.attribute.iter().any(|a| a.name() == spec.0) {
                self.err(
                    loc,
                    format!("required attribute '{}' of {op} is missing", spec.0),
                );
            }
        }
    }

    fn tensor(&mut self, t: &TensorProto, loc: &str) {
        let dt = t.data_type();
        let Ok(ty) = DataType::try_from(dt) else {
            self.err(loc, format!("data type {dt} is not a valid ONNX data type"));
            return;
        };
        if ty == DataType::Undefined {
            self.err(loc, "data type is UNDEFINED");
            return;
        }
        let mut n: u64 = 1;
        for &d in &t.dims {
            if d < 0 {
                self.err(loc, format!("negative dimension {d} in dims {:?}", t.dims));
                return;
            }
            match n.checked_mul(d as u64) {
                Some(m) => n = m,
                None => {
                    self.err(
                        loc,
                        format!("dims {:?}: the element count overflows", t.dims),
                    );
                    return;
                }
            }
        }
        if t.segment.is_some() || t.is_external() {
            return;
        }
        if let Some(raw) = &t.raw_data {
            if ty == DataType::String {
                self.err(loc, "a STRING tensor cannot hold raw_data");
                return;
            }
            let expected = match bits(ty) {
                b if b >= 8 => n.checked_mul(b / 8),
                b => n.checked_mul(b).map(|x| x.div_ceil(8)),
            };
            if expected != Some(raw.len() as u64) {
                self.err(
                    loc,
                    format!(
                        "raw_data holds {} bytes, dims {:?} of {} need {}",
                        raw.len(),
                        t.dims,
                        ty.as_str_name(),
                        expected.map_or_else(|| "more than fit".to_string(), |e| e.to_string())
                    ),
                );
            }
            return;
        }
        use DataType as D;
        let (field, have, per) = match ty {
            D::Float => ("float_data", t.float_data.len(), 1),
            D::Complex64 => ("float_data", t.float_data.len(), 2),
            D::Double => ("double_data", t.double_data.len(), 1),
            D::Complex128 => ("double_data", t.double_data.len(), 2),
            D::Int64 => ("int64_data", t.int64_data.len(), 1),
            D::Uint32 | D::Uint64 => ("uint64_data", t.uint64_data.len(), 1),
            D::String => ("string_data", t.string_data.len(), 1),
            _ => ("int32_data", t.int32_data.len(), 1),
        };
        // Sub-byte types pack two (or four) elements per int32_data entry.
        let expected = match bits(ty) {
            4 => n.div_ceil(2),
            2 => n.div_ceil(4),
            _ => n.saturating_mul(per),
        };
        if have as u64 != expected {
            self.err(
                loc,
                format!(
                    "{field} holds {have} values, dims {:?} of {} need {expected}",
                    t.dims,
                    ty.as_str_name()
                ),
            );
        }
    }
}

fn range((lo, hi): (u32, u32)) -> String {
    if hi >= i32::MAX as u32 {
        format!("at least {lo}")
    } else if lo == hi {
        format!("{lo}")
    } else {
        format!("{lo} to {hi}")
    }
}

/// Bits per element of a fixed-size type (STRING: 0).
fn bits(ty: DataType) -> u64 {
    use DataType as D;
    match ty {
        D::Undefined | D::String => 0,
        D::Bool
        | D::Uint8
        | D::Int8
        | D::Float8e4m3fn
        | D::Float8e4m3fnuz
        | D::Float8e5m2
        | D::Float8e5m2fnuz
        | D::Float8e8m0 => 8,
        D::Uint16 | D::Int16 | D::Float16 | D::Bfloat16 => 16,
        D::Float | D::Int32 | D::Uint32 => 32,
        D::Double | D::Int64 | D::Uint64 | D::Complex64 => 64,
        D::Complex128 => 128,
        D::Uint4 | D::Int4 | D::Float4e2m1 => 4,
        D::Uint2 | D::Int2 => 2,
    }
}

/// The attribute's declared type, or (when undeclared, as old models do) the type its
/// populated field implies.
fn attribute_type(a: &AttributeProto) -> i32 {
    if let Some(t) = a.r#type {
        if t != 0 {
            return t;
        }
    }
    if a.f.is_some() {
        1
    } else if a.i.is_some() {
        2
    } else if a.s.is_some() {
        3
    } else if a.t.is_some() {
        4
    } else if a.g.is_some() {
        5
    } else if a.sparse_tensor.is_some() {
        11
    } else if a.tp.is_some() {
        13
    } else if !a.floats.is_empty() {
        6
    } else if !a.ints.is_empty() {
        7
    } else if !a.strings.is_empty() {
        8
    } else if !a.tensors.is_empty() {
        9
    } else if !a.graphs.is_empty() {
        10
    } else if !a.sparse_tensors.is_empty() {
        12
    } else if !a.type_protos.is_empty() {
        14
    } else {
        0
    }
}

fn type_name(t: i32) -> &'static str {
    match t {
        1 => "FLOAT",
        2 => "INT",
        3 => "STRING",
        4 => "TENSOR",
        5 => "GRAPH",
        6 => "FLOATS",
        7 => "INTS",
        8 => "STRINGS",
        9 => "TENSORS",
        10 => "GRAPHS",
        11 => "SPARSE_TENSOR",
        12 => "SPARSE_TENSORS",
        13 => "TYPE_PROTO",
        14 => "TYPE_PROTOS",
        _ => "of no type",
    }
}
