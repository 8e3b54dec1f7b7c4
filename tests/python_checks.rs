//! Our outputs in other tools' hands: every rewritten step and every legalized graph passes
//! `onnx.checker.check_model(full_check=True)` (onnx 1.23.2) and loads in Python
//! onnxruntime 1.31.1, from `.venv-ort` (scripts/install-ort.sh).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::root;
use onnx_ga::signature::{self, ExplicitRoles};

const MODELS: [&str; 6] = common::SHIPPED_GRAPHS;

const CHECK: &str = r#"
import sys, onnx, onnxruntime as ort
for path in sys.argv[1:]:
    onnx.checker.check_model(path, full_check=True)
    ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    print("ok", path)
"#;

fn check_with_python(files: &[PathBuf]) {
    let Some(python) = common::python() else {
        return;
    };
    let out = Command::new(python)
        .arg("-c")
        .arg(CHECK)
        .args(files)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "onnx.checker / onnxruntime rejected a model:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn write(dir: &Path, name: &str, spec: &str, model: &str) -> PathBuf {
    let graph = signature::open(
        &root().join("graphs").join(model),
        &ExplicitRoles::default(),
    )
    .unwrap();
    let step = onnx_ga::step::build_step(graph, spec, true)
        .unwrap_or_else(|e| panic!("{model} {spec}: {e}"));
    let path = dir.join(format!("{model}.{name}.onnx"));
    onnx_ga::model::save_model(&step.model.to_proto(), &path).unwrap();
    path
}

#[test]
fn rewritten_steps_pass_onnx_checker_and_load_in_onnxruntime() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for model in MODELS {
        files.push(write(
            dir.path(),
            "step_if",
            "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce",
            model,
        ));
        files.push(write(
            dir.path(),
            "step_where",
            "grad-accum(steps=4,apply=where),optimizer(lr=0.01),legalize-ort,dce",
            model,
        ));
    }
    check_with_python(&files);
}

#[test]
fn legalized_graphs_pass_onnx_checker_and_load_in_onnxruntime() {
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<PathBuf> = MODELS
        .iter()
        .map(|m| write(dir.path(), "legalized", "legalize-ort", m))
        .collect();
    check_with_python(&files);
}

/// `examples/train_step.py` drives a rewritten step from Python onnxruntime with nothing but
/// its manifest, whole or as the two specialisations `rewrite --split` writes (which pass
/// onnx.checker too); after 4 windows its state equals the Rust trainer's bit for bit, for a
/// plain step and one with AGC and dynamic loss scaling.
#[test]
fn python_host_trains_a_step_like_the_rust_trainer() {
    let Some(python) = common::python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = "transformer_block";
    let data = root().join("graphs").join(model).join("data.npz");
    for (name, spec) in [
        ("plain", "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce"),
        (
            "scaled",
            "grad-accum(steps=4),loss-scale(init=1024,interval=2),agc(clip=0.05),optimizer(lr=0.01),legalize-ort,dce",
        ),
    ] {
        // The step and its two specialisations, as `rewrite --split` writes them.
        let step = dir.path().join(format!("{name}.onnx"));
        let out = Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
            .args(["rewrite", root().join("graphs").join(model).to_str().unwrap()])
            .args(["-o", step.to_str().unwrap(), "--split", "--pipeline", spec])
            .output()
            .expect("run onnx-ga");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let specialisations = ["accumulate", "apply"].map(|b| step.with_extension(format!("{b}.onnx")));
        check_with_python(&specialisations);
        let run_python = |split: bool| {
            let saved = dir.path().join(format!("{name}.python-{split}.npz"));
            let out = Command::new(&python)
                .arg(root().join("examples/train_step.py"))
                .args([step.to_str().unwrap(), data.to_str().unwrap()])
                .args(["--micro-batch", "8", "--steps", "16", "--save-state"])
                .arg(&saved)
                .args(split.then_some("--split"))
                .output()
                .expect("run python");
            assert!(
                out.status.success(),
                "examples/train_step.py failed:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(stdout.matches("window applied").count(), 4, "{stdout}");
            onnx_ga::data::read_npz(&saved).unwrap()
        };
        let (python_whole, python_split) = (run_python(false), run_python(true));

        let model_proto = onnx_ga::model::load_model(&step).unwrap();
        // The layer norm's gradient as written: its fused kernel sums in another order.
        let options = onnx_ga::train::TrainOptions {
            session: onnx_ga::engine::ort::SessionOptions {
                fused_layer_norm_grad: false,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut trainer = onnx_ga::train::Trainer::with_options(&model_proto, &options).unwrap();
        assert!(trainer.is_split());
        let batches = onnx_ga::data::read_npz(&data).unwrap();
        let samples = trainer.check_data(&batches, &data).unwrap();
        for i in 0..16 {
            trainer
                .step(&onnx_ga::train::micro_batch(&batches, samples, 8, i), false)
                .unwrap();
        }
        let rust_state = trainer.state().unwrap();
        for (host, python_state) in [("whole", &python_whole), ("split", &python_split)] {
            assert_eq!(python_state.len(), rust_state.len(), "{name}: state count");
            for (key, value) in rust_state {
                // Same runtime version, the same arithmetic: bit for bit (measured),
                // whichever graphs each host runs.
                common::assert_close(
                    &format!("{name} python {host} {key}"),
                    &python_state[key],
                    value,
                    0.0,
                    0.0,
                );
            }
        }
    }
}
