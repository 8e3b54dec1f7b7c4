//! The rewrite pipeline on arbitrary (mostly near-valid: seed it with the shipped graphs)
//! models: decode, validate, signature, then grad-accum + optimizer + legalize + dce for a
//! gradient graph, autodiff first for a forward model; the step is exported, encoded and
//! split. Errors are fine; panics and hangs are findings.
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
    // Bounded work per input: big graphs are the benches' business.
    let nodes = proto.graph.as_ref().map_or(0, |g| g.node.len());
    if nodes > 400 {
        return;
    }
    let (graph, spec) = if onnx_ga::signature::is_forward_model(&proto) {
        (
            onnx_ga::signature::forward(proto, origin),
            "autodiff(loss_fn=mse),grad-accum(steps=2),optimizer(kind=sgd,lr=0.1),legalize-ort,dce",
        )
    } else {
        match onnx_ga::signature::from_model(proto, &Default::default(), origin) {
            Ok(g) => (
                g,
                "grad-accum(steps=2),optimizer(kind=adamw,lr=0.01),legalize-ort,dce",
            ),
            Err(_) => return,
        }
    };
    let Ok(step) = onnx_ga::step::build_step(graph, spec, true) else {
        return;
    };
    let out = step.model.to_proto();
    let _ = onnx_ga::model::encode_model(&out);
    let _ = onnx_ga::split::split_step(&out, &step.manifest);
});
