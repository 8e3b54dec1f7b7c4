//! ONNX protobuf types, generated at build time from `proto/onnx.proto`.

#![allow(clippy::all, missing_docs)]

include!(concat!(env!("OUT_DIR"), "/onnx.rs"));

impl TensorProto {
    /// Whether the tensor's data lives in an external file (`data_location == EXTERNAL`).
    pub fn is_external(&self) -> bool {
        self.data_location == Some(tensor_proto::DataLocation::External as i32)
    }
}
