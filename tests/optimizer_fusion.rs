//! The Adam family updates small parameters as one flat tensor (`optimizer(fuse_small=N)`,
//! src/passes/optimizer.rs). The update is elementwise, so fused and per-tensor training must
//! agree bit for bit, for Adam and both AdamW modes, with and without loss scaling.

use crate::common;

use std::path::Path;

use crate::common::{ort_available, read_npz, root};
use onnx_ga::proto::ModelProto;
use onnx_ga::train::{micro_batch, Trainer};

fn rewrite(model: &str, spec: &str) -> ModelProto {
    common::rewrite_shipped(model, spec)
}

/// Ops of `type` anywhere in the model (the apply branch is a subgraph).
fn count_ops(model: &ModelProto, op: &str) -> usize {
    fn walk(g: &onnx_ga::proto::GraphProto, op: &str) -> usize {
        g.node
            .iter()
            .map(|n| {
                usize::from(n.op_type() == op)
                    + n.attribute
                        .iter()
                        .flat_map(|a| a.g.iter().chain(&a.graphs))
                        .map(|g| walk(g, op))
                        .sum::<usize>()
            })
            .sum()
    }
    walk(model.graph.as_ref().unwrap(), op)
}

#[test]
fn fused_small_parameters_train_bit_identically() {
    if !ort_available() {
        return;
    }
    for model in ["mlp_ce_adamw", "transformer_block", "cnn_bn"] {
        let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
        for optimizer in [
            "optimizer(lr=0.01",
            "optimizer(kind=adamw,lr=0.01,weight_decay=0.1,adam_mode=0",
            "optimizer(kind=adam,lr=0.01,weight_decay=0.01",
        ] {
            for scaling in ["", "loss-scale(init=1024,interval=2),"] {
                let spec = |fuse: &str| {
                    format!("grad-accum(steps=4),{scaling}{optimizer}{fuse}),legalize-ort,dce")
                };
                let fused = rewrite(model, &spec(""));
                let per_tensor = rewrite(model, &spec(",fuse_small=0"));
                let what = spec("");
                assert_eq!(count_ops(&per_tensor, "Split"), 0, "{what}");
                assert_eq!(
                    count_ops(&fused, "Split"),
                    3,
                    "{what}: parameters, m and v come out of one flat update"
                );
                let mut a = Trainer::new(&fused, &Default::default()).unwrap();
                let mut b = Trainer::new(&per_tensor, &Default::default()).unwrap();
                let samples = a.check_data(&data, Path::new("data.npz")).unwrap();
                for i in 0..10 {
                    let batch = micro_batch(&data, samples, 8, i);
                    let flush = i == 9;
                    assert_eq!(
                        a.step(&batch, flush).unwrap(),
                        b.step(&batch, flush).unwrap(),
                        "{what}: micro-step {i}"
                    );
                }
                assert_eq!(a.state().unwrap(), b.state().unwrap(), "{what}");
            }
        }
    }
}
