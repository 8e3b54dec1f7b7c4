//! Models newer than ONNX Runtime loads (`passes::fit_opset`): what onnx 1.23's
//! `helper.make_model` writes (IR version 14, ai.onnx opset 28) is refused by ONNX Runtime
//! 1.31 as it is. `rewrite` moves such a step down to opset 26 and IR version 13 where no
//! node's meaning changes, the ONNX Runtime engine does the same in memory for a step file
//! that was written at the newer versions, and a step that cannot move is written with a
//! warning and refused by `train` naming the node.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

use crate::common::root;

/// `model` as onnx 1.23's helpers stamp it: IR version 14, ai.onnx opset 28.
fn as_onnx_1_23(mut model: ModelProto) -> ModelProto {
    model.ir_version = Some(14);
    for import in &mut model.opset_import {
        if onnx_ga::ir::normalize_domain(import.domain()).is_empty() {
            import.version = Some(28);
        }
    }
    model
}

fn versions(model: &ModelProto) -> (i64, i64) {
    let opset = model
        .opset_import
        .iter()
        .find(|o| onnx_ga::ir::normalize_domain(o.domain()).is_empty())
        .map(|o| o.version())
        .unwrap();
    (opset, model.ir_version())
}

/// The limits `fit-opset` moves down to are the loaded library's: a Relu at (opset 26, IR
/// 13) loads, one step newer in either is refused with ONNX Runtime's own words.
#[test]
fn ort_loads_opset_26_and_ir_13_and_refuses_newer() {
    if !common::ort_available() {
        return;
    }
    let load = |opset: i64, ir: i64| {
        let text = format!(
            "<ir_version: {ir}, opset_import: [\"\" : {opset}]>\n\
             g (float[2] x) => (float[2] y) {{\n  y = Relu(x)\n}}\n"
        );
        let model = onnx_ga::ir::text::parse_model(&text).unwrap();
        let bytes = onnx_ga::model::encode_model(&model);
        OrtSession::from_bytes(&bytes, &SessionOptions::default()).map(|_| ())
    };
    use onnx_ga::runtime::{ORT_MAX_IR_VERSION as IR, ORT_MAX_OPSET as OPSET};
    assert!(load(OPSET, IR).is_ok(), "{:?}", load(OPSET, IR).err());
    let e = load(OPSET + 1, IR).unwrap_err().to_string();
    assert!(e.contains(&format!("till opset {OPSET}")), "{e}");
    let e = load(OPSET, IR + 1).unwrap_err().to_string();
    assert!(
        e.contains(&format!("max supported IR version: {IR}")),
        "{e}"
    );
}

fn forward(model: &str) -> (ModelProto, std::path::PathBuf) {
    let path = root()
        .join("graphs/forward")
        .join(model)
        .join("dynamo.onnx");
    let proto = onnx_ga::model::load_model_with_data(&path).unwrap_or_else(|e| panic!("{e}"));
    (proto, path)
}

fn step(proto: ModelProto, path: &Path, spec: &str) -> ModelProto {
    let graph = onnx_ga::signature::forward(proto, path);
    onnx_ga::step::build_step(graph, spec, true)
        .unwrap_or_else(|e| panic!("{}: {spec}: {e}", path.display()))
        .model
        .to_proto()
}

/// 8 micro-steps of B 4 on the model's data; the state after them.
fn trained(step: &ModelProto, model: &str) -> BTreeMap<String, Tensor> {
    let data = common::read_npz(&root().join("graphs/forward").join(model).join("data.npz"));
    let mut trainer = common::trainer(step);
    let samples = trainer
        .check_data(&data, Path::new("data.npz"))
        .unwrap_or_else(|e| panic!("{e}"));
    for i in 0..8 {
        let batch = onnx_ga::train::micro_batch(&data, samples, 4, i);
        trainer
            .step(&batch, false)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    trainer.state().unwrap().clone()
}

const SPEC: &str = "autodiff(loss_fn=cross-entropy,ignore_index=-100,grads=internal),\
                    grad-accum(steps=2),optimizer(kind=adamw,lr=0.01),legalize-ort,dce";

/// The GPT (Range, whose opset 27 added `stash_type`) and the U-Net (whose upsampling's
/// gradient is a SpaceToDepth, which opset 28 gave a `mode`), stamped as onnx 1.23 writes:
/// their steps move down to (26, 13) and train bit for bit as the same models at their own
/// opset; their steps stamped at (28, 14), as a step written before `fit-opset` was, train
/// the same through the engine's fit in memory.
#[test]
fn models_of_onnx_1_23_train_as_at_their_own_opset() {
    if !common::ort_available() {
        return;
    }
    for model in ["torch_gpt", "torch_unet"] {
        let (proto, path) = forward(model);
        let own = step(proto.clone(), &path, SPEC);
        assert!(versions(&own).0 < 26, "{model}: {:?}", versions(&own));
        let moved = step(as_onnx_1_23(proto), &path, &format!("{SPEC},fit-opset"));
        assert_eq!(versions(&moved), (26, 13), "{model}");
        let expected = trained(&own, model);
        let stamped = as_onnx_1_23(own);
        for (what, step) in [("moved by rewrite", &moved), ("moved in memory", &stamped)] {
            let got = trained(step, model);
            let (gap, name) = common::worst_state_gap(model, &got, &expected);
            assert_eq!(gap, 0.0, "{model} {what}: '{name}' differs");
        }
    }
}

/// Through the command line: `rewrite` of a model at (28, 14) adds `fit-opset` itself and
/// writes (26, 13); a model with a node that cannot move (Mod, whose opset 28 text gives
/// `fmod = 0` a meaning for floats) is written with a warning naming it, and `train`
/// refuses it with exit 2, naming it again.
#[test]
fn rewrite_moves_a_new_model_down_and_names_what_keeps_one_up() {
    if !common::ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, body: &str| {
        let text = format!(
            "<ir_version: 14, opset_import: [\"\" : 28]>\n\
             g (float[N,4] x, float[4,3] w = {{{w}}}) => (float[N,3] logits) {{\n{body}}}\n",
            w = (0..12)
                .map(|i| format!("{}", 0.1 * i as f32 - 0.5))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let model = onnx_ga::ir::text::parse_model(&text).unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, onnx_ga::model::encode_model(&model)).unwrap();
        path
    };
    let data = dir.path().join("data.npz");
    let x = common::pattern_tensor(&[16, 4], 3);
    let labels = Tensor::I64(
        ndarray::ArrayD::from_shape_vec(vec![16], (0..16).map(|i| i % 3).collect()).unwrap(),
    );
    onnx_ga::data::write_npz(&data, [("x", &x), ("labels", &labels)]).unwrap();
    let rewrite = |model: &Path, step: &Path| {
        common::onnx_ga_cli(&[
            "rewrite",
            model.to_str().unwrap(),
            "-o",
            step.to_str().unwrap(),
            "--loss-fn",
            "cross-entropy",
            "--optimizer",
            "sgd",
        ])
    };
    let stderr = |out: &std::process::Output| String::from_utf8_lossy(&out.stderr).into_owned();

    let plain = write("plain.onnx", "  logits = MatMul(x, w)\n");
    let step = dir.path().join("plain.step.onnx");
    let out = rewrite(&plain, &step);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "fit-opset: changed, +0 nodes, -0 nodes; ai.onnx opset 28 -> 26, IR version 14 -> 13"
        ),
        "{}",
        stderr(&out)
    );
    let written = onnx_ga::model::load_model(&step).unwrap();
    assert_eq!(versions(&written), (26, 13));
    let out = common::onnx_ga_cli(&common::cli_train(&step, &data, "4", &["--engine", "ort"]));
    assert!(out.status.success(), "{}", stderr(&out));

    // Mod on the data, before the parameter: it needs no gradient, but it stays in the step.
    let blocked = write(
        "mod.onnx",
        "  m = Mod<fmod = 1>(x, x)\n  logits = MatMul(m, w)\n",
    );
    let step = dir.path().join("mod.step.onnx");
    let out = rewrite(&blocked, &step);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("warning: ort cannot load this step")
            && stderr(&out).contains("(Mod): its definition changed in opset 28"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        versions(&onnx_ga::model::load_model(&step).unwrap()),
        (28, 14)
    );
    let out = common::onnx_ga_cli(&common::cli_train(&step, &data, "4", &["--engine", "ort"]));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("mod.step.onnx")
            && stderr(&out).contains("(Mod): its definition changed in opset 28"),
        "{}",
        stderr(&out)
    );
}
