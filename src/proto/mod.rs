//! ONNX protobuf types, generated at build time from `proto/onnx.proto`.

#![allow(clippy::all, missing_docs)]

include!(concat!(env!("OUT_DIR"), "/onnx.rs"));

impl TensorProto {
    /// Whether the tensor's data lives in an external file (`data_location == EXTERNAL`).
    pub fn is_external(&self) -> bool {
        self.data_location == Some(tensor_proto::DataLocation::External as i32)
    }
}

/// One dimension of a declared tensor shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeclaredDim {
    Known(i64),
    /// A named (symbolic) dimension.
    Symbol(String),
    /// Neither: unnamed, or a negative size.
    Unknown,
}

impl TypeProto {
    /// The element type a tensor type declares (`None`: not a tensor, or 0 = undefined).
    pub fn tensor_elem(&self) -> Option<i32> {
        match self.value.as_ref()? {
            type_proto::Value::TensorType(t) => t.elem_type.filter(|e| *e != 0),
            _ => None,
        }
    }

    /// The dims a tensor type declares (`None`: not a tensor, or its rank is unknown).
    pub fn tensor_dims(&self) -> Option<Vec<DeclaredDim>> {
        use tensor_shape_proto::dimension::Value as D;
        match self.value.as_ref()? {
            type_proto::Value::TensorType(t) => t.shape.as_ref().map(|s| {
                s.dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(D::DimValue(x)) if *x >= 0 => DeclaredDim::Known(*x),
                        Some(D::DimParam(p)) if !p.is_empty() => DeclaredDim::Symbol(p.clone()),
                        _ => DeclaredDim::Unknown,
                    })
                    .collect()
            }),
            _ => None,
        }
    }

    /// [`tensor_dims`](Self::tensor_dims) with only the known sizes.
    pub fn tensor_sizes(&self) -> Option<Vec<Option<i64>>> {
        Some(
            self.tensor_dims()?
                .into_iter()
                .map(|d| match d {
                    DeclaredDim::Known(x) => Some(x),
                    _ => None,
                })
                .collect(),
        )
    }
}

/// `TensorProto.DataType` numbers as the `i32` the protos hold: one table for every pass
/// that compares or writes element types.
pub mod elem {
    use super::tensor_proto::DataType;

    pub const FLOAT: i32 = DataType::Float as i32;
    pub const DOUBLE: i32 = DataType::Double as i32;
    pub const FLOAT16: i32 = DataType::Float16 as i32;
    pub const BFLOAT16: i32 = DataType::Bfloat16 as i32;
    pub const INT64: i32 = DataType::Int64 as i32;
    pub const INT32: i32 = DataType::Int32 as i32;
    pub const BOOL: i32 = DataType::Bool as i32;
    pub const STRING: i32 = DataType::String as i32;
}
