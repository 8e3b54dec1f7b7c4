//! `onnx-ga rewrite` and `onnx-ga train` as a user runs them: the main job end to end, the
//! partial-window flush, and bad inputs (each a clear error, exit code 2, nothing written).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{ort_available, root};
use onnx_ga::data::Tensor;

fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .expect("run onnx-ga")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Rewrites graphs/mlp_ce_adamw with K=4 into `dir`.
fn rewritten(dir: &Path) -> PathBuf {
    common::cli_rewritten(dir, "step.onnx", &[])
}

fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap_or_default(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn rewrite_then_train_writes_metrics_and_state() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = rewritten(dir.path());
    let metrics = dir.path().join("metrics.jsonl");
    let state = dir.path().join("state.npz");
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let out = onnx_ga(&common::cli_train(
        &step,
        &data,
        "32",
        &[
            "--metrics",
            metrics.to_str().unwrap(),
            "--save-state",
            state.to_str().unwrap(),
            "--quiet",
        ],
    ));
    assert!(out.status.success(), "train failed: {}", stderr(&out));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 32);
    let applied: Vec<u64> = lines
        .iter()
        .filter(|l| l["applied"] == true)
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        applied,
        vec![4, 8, 12, 16, 20, 24, 28, 32],
        "the update applies at every 4th micro-step"
    );
    let loss = |i: usize| lines[i]["loss"].as_f64().unwrap();
    let first: f64 = (0..8).map(loss).sum::<f64>() / 8.0;
    let last: f64 = (24..32).map(loss).sum::<f64>() / 8.0;
    assert!(
        last < first,
        "loss should decrease over 8 windows: first 2 windows {first}, last 2 {last}"
    );

    // The saved state equals what the library's trainer computes.
    let saved = onnx_ga::data::read_npz(&state).unwrap();
    let reference = common::read_npz(&root().join("fixtures/mlp_ce_adamw/run_full.npz"));
    for name in ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"] {
        common::assert_close(
            name,
            &saved[name],
            &reference[&format!("param/{name}")],
            0.0,
            2e-6,
        );
    }
}

#[test]
fn legalize_only_pipeline_writes_a_standard_graph() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("legal.onnx");
    let graphs = root().join("graphs/cnn_bn");
    let out = onnx_ga(&[
        "rewrite",
        graphs.to_str().unwrap(),
        "-o",
        out_path.to_str().unwrap(),
        "--pipeline",
        "legalize-ort",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let inspect = onnx_ga(&["inspect", out_path.to_str().unwrap(), "--json"]);
    let text = String::from_utf8_lossy(&inspect.stdout);
    // The legalized graph has no accumulators left, so it inspects as a plain graph; check
    // the ops directly instead.
    let model = onnx_ga::model::load_model(&out_path).unwrap();
    for node in &model.graph.as_ref().unwrap().node {
        assert!(
            !onnx_ga::ops::is_training_only(node.domain(), node.op_type()),
            "{} left in the graph",
            node.op_type()
        );
    }
    assert!(
        model
            .opset_import
            .iter()
            .all(|o| o.domain() != "com.microsoft"),
        "unused com.microsoft opset still declared"
    );
    let _ = text;
}

fn bad_train(args_for: impl Fn(&Path, &Path) -> Vec<String>, expect: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let step = if ort_available() {
        rewritten(dir.path())
    } else {
        return;
    };
    let args = args_for(dir.path(), &step);
    let before = listing(dir.path());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = onnx_ga(&args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for e in expect {
        assert!(err.contains(e), "stderr should mention {e:?}: {err}");
    }
    assert!(
        listing(dir.path()) == before,
        "nothing may be written or changed in {}",
        dir.path().display()
    );
}

fn write_data(dir: &Path, name: &str, arrays: &[(&str, Tensor)]) -> PathBuf {
    let path = dir.join(name);
    onnx_ga::data::write_npz(&path, arrays.iter().map(|(n, t)| (*n, t))).unwrap();
    path
}

fn train_args(step: &Path, data: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = common::cli_train(step, data, "4", &["--quiet"]);
    args.extend_from_slice(extra);
    args.into_iter().map(String::from).collect()
}

fn input(n: usize) -> Tensor {
    Tensor::F32(ndarray::ArrayD::zeros(vec![n, 16]))
}

fn labels(n: usize) -> Tensor {
    Tensor::I64(ndarray::ArrayD::zeros(vec![n]))
}

#[test]
fn data_missing_an_input() {
    bad_train(
        |dir, step| {
            let data = write_data(dir, "data.npz", &[("input", input(16))]);
            let out = dir.join("state.npz");
            train_args(step, &data, &["--save-state", out.to_str().unwrap()])
        },
        &["data.npz", "no array named 'labels'"],
    );
}

#[test]
fn data_with_a_wrong_dtype() {
    bad_train(
        |dir, step| {
            let data = write_data(
                dir,
                "data.npz",
                &[
                    ("input", input(16)),
                    ("labels", Tensor::F32(ndarray::ArrayD::zeros(vec![16]))),
                ],
            );
            train_args(step, &data, &[])
        },
        &[
            "data.npz",
            "'labels' is float but the model's input is int64",
        ],
    );
}

#[test]
fn data_with_a_wrong_shape() {
    bad_train(
        |dir, step| {
            let data = write_data(
                dir,
                "data.npz",
                &[
                    ("input", Tensor::F32(ndarray::ArrayD::zeros(vec![16, 15]))),
                    ("labels", labels(16)),
                ],
            );
            train_args(step, &data, &[])
        },
        &["data.npz", "axis 1 must be 16"],
    );
}

#[test]
fn data_with_unequal_sample_counts() {
    bad_train(
        |dir, step| {
            let data = write_data(
                dir,
                "data.npz",
                &[("input", input(16)), ("labels", labels(12))],
            );
            train_args(step, &data, &[])
        },
        &["data.npz", "samples"],
    );
}

#[test]
fn data_file_that_is_not_npz() {
    bad_train(
        |dir, step| {
            let data = dir.join("data.npz");
            std::fs::write(&data, b"not a zip archive").unwrap();
            train_args(step, &data, &[])
        },
        &["data.npz", "not a readable .npz"],
    );
}

#[test]
fn model_that_is_not_a_rewritten_step() {
    bad_train(
        |dir, _step| {
            let data = write_data(
                dir,
                "data.npz",
                &[("input", input(16)), ("labels", labels(16))],
            );
            let raw = root().join("graphs/mlp_ce_adamw/training_model.onnx");
            train_args(&raw, &data, &[])
        },
        &[
            "training_model.onnx",
            "not a training step",
            "`onnx-ga rewrite",
        ],
    );
}

#[test]
fn state_file_that_does_not_match() {
    bad_train(
        |dir, step| {
            let data = write_data(
                dir,
                "data.npz",
                &[("input", input(16)), ("labels", labels(16))],
            );
            let state = write_data(
                dir,
                "state.npz",
                &[(
                    "fc1.weight",
                    Tensor::F32(ndarray::ArrayD::zeros(vec![3, 3])),
                )],
            );
            train_args(step, &data, &["--init-state", state.to_str().unwrap()])
        },
        &["state.npz", "is missing"],
    );
}

#[test]
fn rewrite_refuses_to_overwrite_its_input() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.onnx");
    std::fs::copy(
        root().join("graphs/mlp_ce_adamw/training_model.onnx"),
        &model,
    )
    .unwrap();
    let before = std::fs::read(&model).unwrap();
    let out = onnx_ga(&[
        "rewrite",
        model.to_str().unwrap(),
        "-o",
        model.to_str().unwrap(),
        "--lr",
        "0.1",
        "--optimizer",
        "sgd",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("refusing to overwrite the input"));
    assert_eq!(std::fs::read(&model).unwrap(), before);
}

#[test]
fn inspect_reads_a_rewritten_step_from_its_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let step = rewritten(dir.path());
    let out = onnx_ga(&["inspect", step.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["signature"]["source"]["kind"], "step");
    assert_eq!(report["signature"]["loss"], "onnx::loss::2");
    assert_eq!(
        report["parameter_count"]["trainable"], 874,
        "the MLP's 874 parameters"
    );
    let data: Vec<&str> = report["signature"]["data_inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(data, ["input", "labels"]);
}

/// Trains 10 micro-steps (two windows and a half) with `extra` flags; returns the exit
/// status, stderr and the saved state, if any.
fn train_saving(
    dir: &Path,
    step: &Path,
    tag: &str,
    extra: &[&str],
) -> (Output, Option<std::collections::BTreeMap<String, Tensor>>) {
    let state = dir.join(format!("state-{tag}.npz"));
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let mut args = train_args(step, &data, &["--save-state", state.to_str().unwrap()]);
    if let Some(n) = args.iter_mut().skip_while(|a| *a != "--steps").nth(1) {
        *n = "10".into();
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = onnx_ga(&args);
    let saved = state
        .exists()
        .then(|| onnx_ga::data::read_npz(&state).unwrap());
    (out, saved)
}

#[test]
fn no_split_trains_bit_identically_to_the_split_default() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = rewritten(dir.path());
    let (out, split) = train_saving(dir.path(), &step, "split", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (out, whole) = train_saving(dir.path(), &step, "whole", &["--no-split"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (split, whole) = (split.unwrap(), whole.unwrap());
    assert_eq!(split.len(), whole.len());
    for (name, value) in &whole {
        assert_eq!(&split[name], value, "state '{name}'");
    }
    assert_eq!(
        split["ga.micro_step"],
        Tensor::I64(ndarray::arr0(2).into_dyn()),
        "10 micro-steps with K=4 end 2 into the third window"
    );
}

// `--device cuda` against the CPU: tests/device_cuda.rs.

#[test]
fn unknown_or_impossible_devices() {
    bad_train(
        |dir, step| {
            let data = root().join("graphs/mlp_ce_adamw/data.npz");
            let _ = dir;
            train_args(step, &data, &["--device", "tpu"])
        },
        &["unknown device 'tpu'", "cpu, cuda, cuda:N"],
    );
    bad_train(
        |dir, step| {
            let data = root().join("graphs/mlp_ce_adamw/data.npz");
            let _ = dir;
            train_args(step, &data, &["--device", "cuda:1", "--engine", "tract"])
        },
        &["--device cuda:1", "tract runs on the CPU only"],
    );
}

#[test]
fn train_overrides_k_and_the_learning_rate() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = rewritten(dir.path());
    let metrics = dir.path().join("m.jsonl");
    let (out, state) = train_saving(
        dir.path(),
        &step,
        "k2-lr0",
        &[
            "--accum-steps",
            "2",
            "--lr",
            "0",
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let applied: Vec<bool> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["applied"] == true)
        .collect();
    assert_eq!(
        applied,
        [false, true].repeat(5),
        "K = 2 from the command line"
    );
    let state = state.unwrap();
    assert_eq!(
        state["ga.opt_step"],
        Tensor::I64(ndarray::arr0(5).into_dyn())
    );
    // lr 0: every parameter still holds its initial value.
    let model = onnx_ga::model::load_model(&step).unwrap();
    for init in &model.graph.as_ref().unwrap().initializer {
        if ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"].contains(&init.name()) {
            let initial = Tensor::from_tensor_proto(init).unwrap();
            assert_eq!(state[init.name()], initial, "{}", init.name());
        }
    }
}

#[test]
fn bad_overrides() {
    bad_train(
        |_, step| {
            let data = root().join("graphs/mlp_ce_adamw/data.npz");
            train_args(step, &data, &["--accum-steps", "0"])
        },
        &["--accum-steps 0", "at least 1"],
    );
    bad_train(
        |_, step| {
            let data = root().join("graphs/mlp_ce_adamw/data.npz");
            train_args(step, &data, &["--lr=-1"])
        },
        &["--lr -1", "not negative"],
    );
}

#[test]
fn rewrite_split_writes_the_specialisations_that_train_refuses() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = dir.path().join("step.onnx");
    let graphs = root().join("graphs/mlp_ce_adamw");
    let out = onnx_ga(&[
        "rewrite",
        graphs.to_str().unwrap(),
        "-o",
        step.to_str().unwrap(),
        "--lr",
        "0.01",
        "--split",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let names: Vec<String> = listing(dir.path()).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["step.accumulate.onnx", "step.apply.onnx", "step.onnx"]
    );
    // A specialisation is not a step to train: a clear error, nothing written.
    bad_train(
        |dir, _| {
            let specialisation = dir.join("s.accumulate.onnx");
            std::fs::copy(step.with_extension("accumulate.onnx"), &specialisation).unwrap();
            let data = root().join("graphs/mlp_ce_adamw/data.npz");
            train_args(&specialisation, &data, &["--save-state", "x.npz"])
        },
        &[
            "'accumulate' specialisation",
            "train or inspect the step itself",
        ],
    );
}

#[test]
fn rewrite_split_of_a_where_step_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let step = dir.path().join("step.onnx");
    let graphs = root().join("graphs/mlp_ce_adamw");
    let out = onnx_ga(&[
        "rewrite",
        graphs.to_str().unwrap(),
        "-o",
        step.to_str().unwrap(),
        "--lr",
        "0.01",
        "--apply",
        "where",
        "--split",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--split: the step has no apply If"),
        "{}",
        stderr(&out)
    );
    assert!(listing(dir.path()).is_empty(), "no partial output");
}
