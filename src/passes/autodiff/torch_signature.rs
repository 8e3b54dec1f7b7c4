//! torch's own parameter list, as its dynamo exporter records it: the graph's metadata
//! `pkg.torch.export.ExportedProgram.graph_signature` holds one line per lifted input,
//!
//! ```text
//! p_fc1_weight: PARAMETER target='fc1.weight'
//! b_bn1_running_mean: BUFFER target='bn1.running_mean' persistent=True
//! c_lifted_tensor_0: CONSTANT_TENSOR target='lifted_tensor_0'
//! idx: USER_INPUT
//! ```
//!
//! (measured on torch 2.15). A float initializer is a parameter of the torch model exactly
//! when its name is a PARAMETER target: a buffer (rotary `cos`/`sin` caches, a causal mask,
//! BatchNorm statistics) or a constant the exporter lifted is not, however the loss reaches
//! it, and training it would train a different network. Without that metadata (the legacy
//! exporter, tf2onnx, hand-written models) every float initializer the loss reaches is a
//! parameter, as before.

use crate::ir::Model;

pub const METADATA_KEY: &str = "pkg.torch.export.ExportedProgram.graph_signature";

/// The lifted inputs of a torch export, by kind (each a torch name: `fc1.weight`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TorchSignature {
    pub parameters: Vec<String>,
    /// Buffers and constants: lifted inputs that torch does not train.
    pub not_parameters: Vec<String>,
}

impl TorchSignature {
    /// The signature recorded in `model`'s main graph, if the exporter wrote one.
    pub fn of(model: &Model) -> Option<TorchSignature> {
        let text = model
            .main()
            .rest
            .metadata_props
            .iter()
            .find(|p| p.key() == METADATA_KEY)?
            .value()
            .to_string();
        let mut signature = TorchSignature::default();
        for line in text.lines() {
            let Some((_, rest)) = line.split_once(": ") else {
                continue;
            };
            let mut words = rest.split_whitespace();
            let kind = words.next().unwrap_or("");
            let target = words
                .find_map(|w| w.strip_prefix("target='"))
                .and_then(|t| t.strip_suffix('\''));
            match (kind, target) {
                ("PARAMETER", Some(t)) => signature.parameters.push(t.to_string()),
                (_, Some(t)) => signature.not_parameters.push(t.to_string()),
                _ => {}
            }
        }
        Some(signature)
    }

    pub fn is_parameter(&self, name: &str) -> bool {
        self.parameters.iter().any(|p| p == name)
    }

    /// Whether `name` is one of the lifted inputs, of any kind.
    pub fn names(&self, name: &str) -> bool {
        self.is_parameter(name) || self.not_parameters.iter().any(|p| p == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_parameters_buffers_and_constants() {
        let text = "\n# inputs\np_fc_weight: PARAMETER target='fc.weight'\n\
                    b_rope_cos: BUFFER target='rope.cos' persistent=False\n\
                    c_lifted_tensor_0: CONSTANT_TENSOR target='lifted_tensor_0'\n\
                    x: USER_INPUT\n\n# outputs\nlinear: USER_OUTPUT\n";
        let mut model = Model::from_proto(crate::proto::ModelProto {
            ir_version: Some(10),
            graph: Some(crate::proto::GraphProto {
                metadata_props: vec![crate::proto::StringStringEntryProto {
                    key: Some(METADATA_KEY.into()),
                    value: Some(text.into()),
                }],
                ..Default::default()
            }),
            ..Default::default()
        });
        let s = TorchSignature::of(&model).unwrap();
        assert_eq!(s.parameters, ["fc.weight"]);
        assert_eq!(s.not_parameters, ["rope.cos", "lifted_tensor_0"]);
        assert!(s.is_parameter("fc.weight") && !s.is_parameter("rope.cos"));
        model
            .body_mut(crate::ir::BodyId::MAIN)
            .rest
            .metadata_props
            .clear();
        assert_eq!(TorchSignature::of(&model), None);
    }
}
