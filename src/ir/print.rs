//! Prints a model in ONNX textual syntax, for `inspect --graph` and for snapshot tests.
//!
//! Stable by construction: nodes in the export's topological order, attributes sorted by
//! name, floats in their shortest round-trip form, initializers shown by type (and value
//! when they hold at most 8 elements), no ids. A node inserted by a pass ends with
//! `# <pass>`, so a snapshot reads as a review of the rewrite.

use std::fmt::Write;

use super::{BodyId, Model, NodeId, PASS_KEY};
use crate::proto::{
    attribute_proto::AttributeType, tensor_shape_proto::dimension::Value as Dim, type_proto,
    AttributeProto, TensorProto, TypeProto,
};

/// The whole model: header, main graph, subgraphs inline.
pub fn print_model(model: &Model) -> String {
    let mut out = String::new();
    let opsets: Vec<String> = model
        .header
        .opset_import
        .iter()
        .map(|o| format!("\"{}\" : {}", o.domain(), o.version()))
        .collect();
    let _ = writeln!(
        out,
        "<\n  ir_version: {},\n  opset_import: [{}]\n>",
        model.header.ir_version(),
        opsets.join(", ")
    );
    print_body(model, BodyId::MAIN, 0, &mut out);
    out
}

fn print_body(model: &Model, body: BodyId, indent: usize, out: &mut String) {
    let pad = "  ".repeat(indent);
    let b = model.body(body);
    let name = b.rest.name();
    let inputs: Vec<String> = b
        .inputs
        .iter()
        .map(|(v, info)| typed(info.r#type.as_ref(), model.name(*v)))
        .collect();
    let outputs: Vec<String> = b
        .outputs
        .iter()
        .map(|(v, info)| typed(info.r#type.as_ref(), model.name(*v)))
        .collect();
    let _ = writeln!(
        out,
        "{name} ({}) => ({})",
        inputs.join(", "),
        outputs.join(", ")
    );
    if !b.initializers.is_empty() {
        let inits: Vec<String> = b
            .initializers
            .iter()
            .map(|(v, t)| initializer(t, model.name(*v)))
            .collect();
        let _ = writeln!(out, "{pad}<{}>", inits.join(", "));
    }
    let _ = writeln!(out, "{pad}{{");
    for n in super::export::topological_order(model, body) {
        print_node(model, n, indent + 1, out);
    }
    let _ = writeln!(out, "{pad}}}");
}

fn print_node(model: &Model, n: NodeId, indent: usize, out: &mut String) {
    let pad = "  ".repeat(indent);
    let node = model.node(n);
    // An omitted optional input or output is the empty name, written `""` as ONNX's own
    // printer does (a bare gap would read as a stray comma).
    let name_of = |v: &Option<super::ValueId>| match v {
        Some(v) if !model.name(*v).is_empty() => model.name(*v).to_string(),
        _ => "\"\"".to_string(),
    };
    let outputs: Vec<String> = node.outputs.iter().map(name_of).collect();
    let inputs: Vec<String> = node.inputs.iter().map(name_of).collect();
    let op = match node.proto.domain() {
        "" | "ai.onnx" => node.proto.op_type().to_string(),
        domain => format!("{domain}.{}", node.proto.op_type()),
    };
    let mut attrs: Vec<(usize, &AttributeProto)> =
        node.proto.attribute.iter().enumerate().collect();
    attrs.sort_by(|a, b| a.1.name().cmp(b.1.name()));
    let plain: Vec<String> = attrs
        .iter()
        .filter(|(i, _)| !node.subgraphs.iter().any(|s| s.attribute == *i))
        .map(|(_, a)| format!("{} = {}", a.name(), attribute_value(a)))
        .collect();
    let attr_text = if plain.is_empty() {
        String::new()
    } else {
        format!(" <{}>", plain.join(", "))
    };
    let pass = node
        .proto
        .metadata_props
        .iter()
        .find(|p| p.key() == PASS_KEY)
        .map(|p| format!("  # {}", p.value()))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "{pad}{} = {op}{attr_text} ({}){pass}",
        outputs.join(", "),
        inputs.join(", ")
    );
    for (i, a) in attrs {
        for sub in node.subgraphs.iter().filter(|s| s.attribute == i) {
            let label = match sub.element {
                Some(e) => format!("{}[{e}]", a.name()),
                None => a.name().to_string(),
            };
            let _ = write!(out, "{pad}  {label} = ");
            print_body(model, sub.body, indent + 1, out);
        }
    }
}

fn attribute_value(a: &AttributeProto) -> String {
    if let Some(r) = &a.ref_attr_name {
        return format!("@{r}");
    }
    let list = |items: Vec<String>| format!("[{}]", items.join(", "));
    match a.r#type() {
        AttributeType::Float => float(a.f()),
        AttributeType::Int => a.i().to_string(),
        AttributeType::String => format!("{:?}", String::from_utf8_lossy(a.s())),
        AttributeType::Tensor => a.t.as_ref().map(|t| initializer(t, "")).unwrap_or_default(),
        AttributeType::Floats => list(a.floats.iter().map(|f| float(*f)).collect()),
        AttributeType::Ints => list(a.ints.iter().map(|i| i.to_string()).collect()),
        AttributeType::Strings => list(
            a.strings
                .iter()
                .map(|s| format!("{:?}", String::from_utf8_lossy(s)))
                .collect(),
        ),
        AttributeType::Tensors => list(a.tensors.iter().map(|t| initializer(t, "")).collect()),
        AttributeType::TypeProto => {
            a.tp.as_ref()
                .map(|t| type_text(Some(t)))
                .unwrap_or_default()
        }
        other => format!("<{}>", other.as_str_name()),
    }
}

/// Shortest round-trip form, always with a decimal point or exponent.
fn float(f: f32) -> String {
    format!("{f:?}")
}

fn typed(ty: Option<&TypeProto>, name: &str) -> String {
    format!("{} {name}", type_text(ty))
}

/// ONNX text syntax for a type: `float[N,16]`, `int64`, `seq(float[3])`.
pub fn type_text(ty: Option<&TypeProto>) -> String {
    let Some(value) = ty.and_then(|t| t.value.as_ref()) else {
        return "?".into();
    };
    match value {
        type_proto::Value::TensorType(t) => {
            let elem = elem_type_name(t.elem_type());
            match &t.shape {
                None => elem.to_string(),
                Some(shape) if shape.dim.is_empty() => elem.to_string(),
                Some(shape) => {
                    let dims: Vec<String> = shape
                        .dim
                        .iter()
                        .map(|d| match &d.value {
                            Some(Dim::DimValue(v)) => v.to_string(),
                            Some(Dim::DimParam(p)) => p.clone(),
                            None => "?".into(),
                        })
                        .collect();
                    format!("{elem}[{}]", dims.join(","))
                }
            }
        }
        type_proto::Value::SequenceType(s) => format!("seq({})", type_text(s.elem_type.as_deref())),
        type_proto::Value::OptionalType(o) => {
            format!("optional({})", type_text(o.elem_type.as_deref()))
        }
        type_proto::Value::MapType(m) => format!(
            "map({}, {})",
            elem_type_name(m.key_type()),
            type_text(m.value_type.as_deref())
        ),
        type_proto::Value::SparseTensorType(t) => {
            format!("sparse_tensor({})", elem_type_name(t.elem_type()))
        }
        type_proto::Value::OpaqueType(o) => format!("opaque({}.{})", o.domain(), o.name()),
    }
}

/// ONNX text syntax name of a `TensorProto.DataType`.
pub fn elem_type_name(t: i32) -> &'static str {
    use crate::proto::tensor_proto::DataType as D;
    match D::try_from(t) {
        Ok(D::Float) => "float",
        Ok(D::Uint8) => "uint8",
        Ok(D::Int8) => "int8",
        Ok(D::Uint16) => "uint16",
        Ok(D::Int16) => "int16",
        Ok(D::Int32) => "int32",
        Ok(D::Int64) => "int64",
        Ok(D::String) => "string",
        Ok(D::Bool) => "bool",
        Ok(D::Float16) => "float16",
        Ok(D::Double) => "double",
        Ok(D::Uint32) => "uint32",
        Ok(D::Uint64) => "uint64",
        Ok(D::Complex64) => "complex64",
        Ok(D::Complex128) => "complex128",
        Ok(D::Bfloat16) => "bfloat16",
        Ok(D::Float8e4m3fn) => "float8e4m3fn",
        Ok(D::Float8e4m3fnuz) => "float8e4m3fnuz",
        Ok(D::Float8e5m2) => "float8e5m2",
        Ok(D::Float8e5m2fnuz) => "float8e5m2fnuz",
        Ok(D::Uint4) => "uint4",
        Ok(D::Int4) => "int4",
        Ok(D::Float4e2m1) => "float4e2m1",
        Ok(D::Float8e8m0) => "float8e8m0",
        Ok(D::Uint2) => "uint2",
        Ok(D::Int2) => "int2",
        Ok(D::Undefined) | Err(_) => "?",
    }
}

/// `float[2,3] name`, plus ` = {v, ...}` for tensors of at most 8 plainly stored elements.
fn initializer(t: &TensorProto, name: &str) -> String {
    let elem = elem_type_name(t.data_type());
    let shape = if t.dims.is_empty() {
        String::new()
    } else {
        format!(
            "[{}]",
            t.dims
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    };
    let head = if name.is_empty() {
        format!("{elem}{shape}")
    } else {
        format!("{elem}{shape} {name}")
    };
    match small_values(t) {
        Some(values) => format!("{head} = {{{}}}", values.join(", ")),
        None => head,
    }
}

fn small_values(t: &TensorProto) -> Option<Vec<String>> {
    use crate::proto::tensor_proto::DataType as D;
    // Checked: a hostile file's dims must not overflow (a panic in debug builds).
    let count = t.dims.iter().try_fold(1i64, |acc, d| acc.checked_mul(*d))?;
    if !(0..=8).contains(&count) || !t.external_data.is_empty() {
        return None;
    }
    let raw = t.raw_data();
    let chunks = |size: usize| raw.chunks_exact(size).take(count as usize);
    let values: Vec<String> = match D::try_from(t.data_type()).ok()? {
        D::Float if !raw.is_empty() => chunks(4)
            .map(|c| float(f32::from_le_bytes(bytes(c))))
            .collect(),
        D::Float => t.float_data.iter().map(|f| float(*f)).collect(),
        D::Double if !raw.is_empty() => chunks(8)
            .map(|c| format!("{:?}", f64::from_le_bytes(bytes(c))))
            .collect(),
        D::Double => t.double_data.iter().map(|f| format!("{f:?}")).collect(),
        D::Int64 if !raw.is_empty() => chunks(8)
            .map(|c| i64::from_le_bytes(bytes(c)).to_string())
            .collect(),
        D::Int64 => t.int64_data.iter().map(|i| i.to_string()).collect(),
        D::Int32 if !raw.is_empty() => chunks(4)
            .map(|c| i32::from_le_bytes(bytes(c)).to_string())
            .collect(),
        D::Bool if !raw.is_empty() => raw
            .iter()
            .take(count as usize)
            .map(|b| (*b != 0).to_string())
            .collect(),
        D::Int32 | D::Bool => t.int32_data.iter().map(|i| i.to_string()).collect(),
        D::Float16 if !raw.is_empty() => chunks(2)
            .map(|c| float(half::f16::from_le_bytes(bytes(c)).to_f32()))
            .collect(),
        D::Bfloat16 if !raw.is_empty() => chunks(2)
            .map(|c| float(half::bf16::from_le_bytes(bytes(c)).to_f32()))
            .collect(),
        _ => return None,
    };
    (values.len() == count as usize).then_some(values)
}

/// A `chunks_exact` chunk as a fixed-size array (the length is guaranteed by the caller).
fn bytes<const N: usize>(chunk: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(chunk);
    out
}
