//! Model decoding, load-time validation, the IR import/verify and the training signature
//! (ORT training graph, plain gradient graph, written step, forward model) on arbitrary
//! bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let origin = Path::new("fuzz.onnx");
    let Ok(proto) = onnx_ga::model::decode_model(data, origin) else {
        return;
    };
    let Ok(proto) = onnx_ga::model::checked(proto, origin) else {
        return;
    };
    let _ = onnx_ga::state::Manifest::from_model(&proto);
    let ir = onnx_ga::ir::Model::from_proto(proto.clone());
    let _ = onnx_ga::ir::verify::verify(&ir);
    let _ = onnx_ga::model::encode_model(&ir.to_proto());
    if onnx_ga::signature::is_forward_model(&proto) {
        let _ = onnx_ga::signature::forward(proto, origin);
    } else {
        let _ = onnx_ga::signature::from_model(proto, &Default::default(), origin);
    }
});
