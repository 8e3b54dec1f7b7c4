//! What the CLI says to a user's mistakes, as documents: each case is one command, and its
//! snapshot holds the command, the exit code and stderr (temporary paths shown as [TMP],
//! the repository as [ROOT]). A reworded message shows up here for review; the promises
//! (exit 2, the file, node, tensor or option named, nothing written) are asserted too.

use std::path::Path;
use std::process::Command;

use crate::common::root;

/// Runs onnx-ga in the repository root and renders the case as a document.
fn case(tmp: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .current_dir(root())
        .env("NO_COLOR", "1")
        .output()
        .expect("run onnx-ga");
    let stderr = String::from_utf8_lossy(&out.stderr)
        .replace(&tmp.display().to_string(), "[TMP]")
        .replace(&root().display().to_string(), "[ROOT]");
    let command = args
        .iter()
        .map(|a| a.replace(&tmp.display().to_string(), "[TMP]"))
        .collect::<Vec<_>>()
        .join(" ");
    let code = out.status.code();
    let doc = format!(
        "$ onnx-ga {command}\nexit: {}\n{stderr}",
        code.map_or("signal".to_string(), |c| c.to_string())
    );
    (code, doc)
}

/// Asserts exit 2, that stderr names `culprit`, that nothing appeared at `output`, and
/// snapshots the document.
fn refused(name: &str, tmp: &Path, args: &[&str], culprit: &str, output: Option<&Path>) {
    let (code, doc) = case(tmp, args);
    assert_eq!(code, Some(2), "{doc}");
    assert!(
        doc.contains(culprit),
        "the message names no '{culprit}':\n{doc}"
    );
    assert!(!doc.contains("panicked"), "{doc}");
    if let Some(out) = output {
        assert!(!out.exists(), "{} written on an error", out.display());
    }
    insta::assert_snapshot!(name, doc);
}

/// A step rewritten from the shipped MLP, in `tmp`.
fn rewritten_step(tmp: &Path) -> std::path::PathBuf {
    let step = tmp.join("step.onnx");
    let (code, doc) = case(
        tmp,
        &[
            "rewrite",
            "graphs/mlp_ce_adamw",
            "-o",
            step.to_str().unwrap(),
            "--lr",
            "0.01",
        ],
    );
    assert_eq!(code, Some(0), "{doc}");
    step
}

/// `train STEP --data DATA` for one window of 8-sample micro-batches on tract, saving the
/// state to `state` (which an error must leave unwritten).
fn train_on_tract<'a>(step: &'a Path, data: &'a str, state: &'a Path) -> [&'a str; 12] {
    [
        "train",
        step.to_str().unwrap(),
        "--data",
        data,
        "--micro-batch",
        "8",
        "--steps",
        "4",
        "--engine",
        "tract",
        "--save-state",
        state.to_str().unwrap(),
    ]
}

#[test]
fn a_model_that_does_not_exist() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("step.onnx");
    refused(
        "missing_model",
        tmp.path(),
        &[
            "rewrite",
            "no/such/model.onnx",
            "-o",
            out.to_str().unwrap(),
            "--lr",
            "0.01",
        ],
        "no/such/model.onnx",
        Some(&out),
    );
}

#[test]
fn a_file_that_is_not_onnx() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("notes.onnx");
    std::fs::write(&bad, b"these are my notes, not a model\n").unwrap();
    let out = tmp.path().join("step.onnx");
    refused(
        "not_onnx",
        tmp.path(),
        &[
            "rewrite",
            bad.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--lr",
            "0.01",
        ],
        "notes.onnx",
        Some(&out),
    );
}

#[test]
fn an_output_that_is_the_input() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model.onnx");
    std::fs::copy(root().join("graphs/forward/torch_mlp/legacy.onnx"), &model).unwrap();
    let before = std::fs::read(&model).unwrap();
    let m = model.to_str().unwrap();
    refused(
        "output_is_input",
        tmp.path(),
        &[
            "rewrite",
            m,
            "-o",
            m,
            "--loss-fn",
            "cross-entropy",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
        ],
        "model.onnx",
        None,
    );
    assert_eq!(std::fs::read(&model).unwrap(), before, "the input changed");
}

#[test]
fn a_loss_output_that_does_not_exist() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("step.onnx");
    refused(
        "missing_loss_output",
        tmp.path(),
        &[
            "rewrite",
            "graphs/forward/torch_mlp/legacy.onnx",
            "-o",
            out.to_str().unwrap(),
            "--loss-fn",
            "cross-entropy",
            "--model-output",
            "probabilities",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
        ],
        "probabilities",
        Some(&out),
    );
}

#[test]
fn an_accumulation_of_zero_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("step.onnx");
    refused(
        "zero_accum_steps",
        tmp.path(),
        &[
            "rewrite",
            "graphs/mlp_ce_adamw",
            "-o",
            out.to_str().unwrap(),
            "--lr",
            "0.01",
            "--accum-steps",
            "0",
        ],
        "--accum-steps",
        Some(&out),
    );
}

#[test]
fn a_learning_rate_that_is_not_a_number() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("step.onnx");
    refused(
        "nan_learning_rate",
        tmp.path(),
        &[
            "rewrite",
            "graphs/mlp_ce_adamw",
            "-o",
            out.to_str().unwrap(),
            "--lr",
            "nan",
        ],
        "lr",
        Some(&out),
    );
}

#[test]
fn passes_out_of_order() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("step.onnx");
    refused(
        "pipeline_out_of_order",
        tmp.path(),
        &[
            "rewrite",
            "graphs/mlp_ce_adamw",
            "-o",
            out.to_str().unwrap(),
            "--pipeline",
            "grad-accum(steps=4),optimizer(lr=0.01),agc(clip=0.01),legalize-ort,dce",
        ],
        "run agc before optimizer",
        Some(&out),
    );
}

#[test]
fn data_without_the_steps_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let step = rewritten_step(tmp.path());
    let state = tmp.path().join("state.npz");
    refused(
        "data_of_another_model",
        tmp.path(),
        &train_on_tract(&step, "graphs/mlp_mse_sgd/data.npz", &state),
        "data.npz",
        Some(&state),
    );
}

/// A step whose learning-rate control lost its default (the initializer of `ga.lr`): the
/// engine first meets it when it runs (tract at the first micro-step), and the error names
/// the step file and the micro-step, not the input alone (the mutation campaign's case 467).
#[test]
fn a_control_input_without_its_default() {
    use prost::Message;
    let tmp = tempfile::tempdir().unwrap();
    let step = rewritten_step(tmp.path());
    let mut model =
        onnx_ga::proto::ModelProto::decode(std::fs::read(&step).unwrap().as_slice()).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let before = graph.initializer.len();
    graph.initializer.retain(|t| t.name() != "ga.lr");
    assert_eq!(
        graph.initializer.len(),
        before - 1,
        "the step has a ga.lr default"
    );
    std::fs::write(&step, model.encode_to_vec()).unwrap();
    let state = tmp.path().join("state.npz");
    refused(
        "a_control_input_without_its_default",
        tmp.path(),
        &train_on_tract(&step, "graphs/mlp_ce_adamw/data.npz", &state),
        "step.onnx: input 'ga.lr'",
        Some(&state),
    );
}

#[test]
fn rewriting_a_step_again() {
    let tmp = tempfile::tempdir().unwrap();
    let step = rewritten_step(tmp.path());
    let again = tmp.path().join("again.onnx");
    refused(
        "rewrite_a_step",
        tmp.path(),
        &[
            "rewrite",
            step.to_str().unwrap(),
            "-o",
            again.to_str().unwrap(),
            "--lr",
            "0.01",
        ],
        "step.onnx",
        Some(&again),
    );
}
