//! Bad inputs to `onnx-ga inspect`, one test each. Every case runs the built binary on files
//! made in a temporary folder and asserts:
//!
//! - exit code 2 (bad input), nothing on stdout;
//! - stderr names the offending file and says what is wrong (specific substrings);
//! - no panic ("panicked" never appears on stderr);
//! - nothing written: the folder's listing and every file's bytes are unchanged.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use onnx_ga::proto::tensor_proto::DataLocation;
use onnx_ga::proto::{ModelProto, StringStringEntryProto, TensorProto};
use prost::Message;
use tempfile::TempDir;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn graphs(rel: &str) -> PathBuf {
    root().join("graphs").join(rel)
}

/// Every path under `dir` with its bytes (folders as `None`).
fn tree(dir: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, Option<Vec<u8>>>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                out.insert(path.clone(), None);
                walk(&path, out);
            } else {
                out.insert(path.clone(), Some(fs::read(&path).unwrap()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, &mut out);
    out
}

/// Runs `onnx-ga ARGS` in `dir` and checks the common contract of a bad input; returns stderr.
fn fails(dir: &Path, args: &[&str]) -> String {
    let before = tree(dir);
    let out = Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run onnx-ga");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    assert_eq!(
        out.status.code(),
        Some(2),
        "onnx-ga {args:?}: want exit code 2, got {}; stderr: {stderr}",
        out.status
    );
    assert!(
        stdout.is_empty(),
        "onnx-ga {args:?}: stdout on error: {stdout}"
    );
    assert_eq!(
        tree(dir),
        before,
        "onnx-ga {args:?} changed the files in {}",
        dir.display()
    );
    stderr
}

fn assert_has(stderr: &str, parts: &[&str]) {
    for part in parts {
        assert!(stderr.contains(part), "stderr lacks {part:?}:\n{stderr}");
    }
    // The cause is said once: no line repeated, and no line of the form `A: B` where `A`
    // already ends with `B` (an error that prints its source and also reports it as its
    // `source()`, which a `{:#}` chain then prints again).
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut seen = std::collections::HashSet::new();
    for line in &lines {
        assert!(seen.insert(*line), "repeated line in stderr:\n{stderr}");
        for (at, _) in line.match_indices(": ") {
            let (head, tail) = (&line[..at], &line[at + 2..]);
            assert!(
                tail.len() < 8 || !head.ends_with(tail),
                "the cause {tail:?} is repeated in stderr:\n{stderr}"
            );
        }
    }
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Deterministic pseudo-random bytes (xorshift64).
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect()
}

/// A temporary folder holding a copy of artifacts folder `model` as `<tmp>/<model>`.
fn artifacts_copy(model: &str) -> (TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(model);
    fs::create_dir(&dir).unwrap();
    for entry in fs::read_dir(graphs(model)).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    (tmp, dir)
}

fn file_with(bytes: &[u8], name: &str) -> (TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(name);
    fs::write(&path, bytes).unwrap();
    (tmp, path)
}

// ----------------------------------------------------------------- model files

#[test]
fn empty_file() {
    let (tmp, path) = file_with(b"", "empty.onnx");
    let err = fails(tmp.path(), &["inspect", &s(&path)]);
    assert_has(
        &err,
        &[&s(&path), "file is empty (0 bytes)", "not an ONNX model"],
    );
}

#[test]
fn random_bytes() {
    let (tmp, path) = file_with(&noise(4096, 0x9E37_79B9_7F4A_7C15), "random.onnx");
    let err = fails(tmp.path(), &["inspect", &s(&path)]);
    assert_has(
        &err,
        &[&s(&path), "not an ONNX model: protobuf decoding failed"],
    );
}

#[test]
fn truncated_model() {
    let bytes = fs::read(graphs("mlp_ce_adamw/training_model.onnx")).unwrap();
    let (tmp, path) = file_with(&bytes[..bytes.len() / 2], "training_model.onnx");
    let err = fails(tmp.path(), &["inspect", &s(&path)]);
    assert_has(
        &err,
        &[&s(&path), "truncated ONNX model", "field graph", "remain"],
    );
}

#[test]
fn truncated_model_in_artifacts_folder() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let model = dir.join("training_model.onnx");
    let bytes = fs::read(&model).unwrap();
    fs::write(&model, &bytes[..bytes.len() - 100]).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&model), "truncated ONNX model"]);
}

#[test]
fn wrong_protobuf_message() {
    // A TensorProto is valid protobuf, but not a ModelProto.
    let tensor = TensorProto {
        name: Some("w".into()),
        dims: vec![2, 2],
        data_type: Some(1),
        raw_data: Some(vec![0; 16]),
        ..Default::default()
    };
    let (tmp, path) = file_with(&tensor.encode_to_vec(), "tensor.onnx");
    let err = fails(tmp.path(), &["inspect", &s(&path)]);
    assert_has(&err, &[&s(&path), "not an ONNX model"]);
}

#[test]
fn model_without_graph() {
    // Decodes as a ModelProto but carries no graph.
    let model = ModelProto {
        ir_version: Some(8),
        opset_import: vec![onnx_ga::proto::OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        ..Default::default()
    };
    let (tmp, path) = file_with(&model.encode_to_vec(), "nograph.onnx");
    let err = fails(tmp.path(), &["inspect", &s(&path)]);
    assert_has(&err, &[&s(&path), "not an ONNX model", "no graph"]);
}

#[test]
fn path_does_not_exist() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("no_such_model");
    let err = fails(tmp.path(), &["inspect", &s(&path)]);
    assert_has(&err, &[&s(&path), "not found"]);
}

// ----------------------------------------------------------------- artifacts folders

#[test]
fn folder_without_training_model() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    fs::remove_file(dir.join("training_model.onnx")).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&dir),
            "not an ONNX Runtime training artifacts folder",
            "training_model.onnx is missing",
        ],
    );
}

#[test]
fn empty_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("artifacts");
    fs::create_dir(&dir).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&dir), "training_model.onnx is missing"]);
}

#[test]
fn training_model_is_a_folder() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let model = dir.join("training_model.onnx");
    fs::remove_file(&model).unwrap();
    fs::create_dir(&model).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&model), "is a folder, not a file"]);
}

#[test]
fn missing_checkpoint() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    fs::remove_file(dir.join("checkpoint")).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&dir), "has no 'checkpoint' file"]);
}

#[test]
fn checkpoint_is_a_folder() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    fs::remove_file(&ckpt).unwrap();
    fs::create_dir(&ckpt).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&ckpt), "is a folder, not a file"]);
}

#[test]
fn checkpoint_of_random_bytes() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    fs::write(&ckpt, noise(3000, 7)).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&ckpt),
            "expected \"ODTC\"",
            "not an ONNX Runtime on-device-training checkpoint",
        ],
    );
}

#[test]
fn checkpoint_corrupted_after_identifier() {
    // The identifier survives, the tables do not.
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    let mut bytes = fs::read(&ckpt).unwrap();
    let garbage = noise(bytes.len(), 11);
    for (b, g) in bytes.iter_mut().zip(garbage).skip(8).take(200) {
        *b ^= g | 0x80;
    }
    fs::write(&ckpt, &bytes).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&ckpt),
            "FlatBuffer verification failed (corrupt or truncated file)",
        ],
    );
}

#[test]
fn checkpoint_with_wrong_identifier() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    let mut bytes = fs::read(&ckpt).unwrap();
    assert_eq!(&bytes[4..8], b"ODTC");
    bytes[4..8].copy_from_slice(b"XXXX");
    fs::write(&ckpt, &bytes).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&ckpt),
            "file identifier (bytes 4..8) is \"XXXX\", expected \"ODTC\"",
        ],
    );
}

#[test]
fn truncated_checkpoint() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    let bytes = fs::read(&ckpt).unwrap();
    fs::write(&ckpt, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&ckpt),
            "FlatBuffer verification failed (corrupt or truncated file)",
        ],
    );
}

#[test]
fn checkpoint_too_short() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    fs::write(&ckpt, b"ODT").unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&ckpt), "3 bytes long, too short"]);
}

#[test]
fn checkpoint_shapes_disagree_with_graph() {
    // mlp_mse_sgd has the same parameter names with other shapes.
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    fs::copy(graphs("mlp_mse_sgd/checkpoint"), &ckpt).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&ckpt),
            "parameter 'fc1.weight' is float[16,24] in the checkpoint but float[32,16] in",
            &s(&dir.join("training_model.onnx")),
        ],
    );
}

#[test]
fn checkpoint_of_another_model() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let ckpt = dir.join("checkpoint");
    fs::copy(graphs("cnn_bn/checkpoint"), &ckpt).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[&s(&ckpt), "parameter 'conv.weight' is not an input of"],
    );
}

#[test]
fn inference_graph_as_training_model() {
    // eval_model.onnx has the parameters as inputs but no gradient accumulators.
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    fs::copy(
        graphs("mlp_ce_adamw/eval_model.onnx"),
        dir.join("training_model.onnx"),
    )
    .unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&dir.join("training_model.onnx")),
            "trainable parameter 'fc1.weight' has no InPlaceAccumulatorV2",
        ],
    );
}

#[test]
fn optimizer_model_of_garbage() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let opt = dir.join("optimizer_model.onnx");
    fs::write(&opt, noise(500, 3)).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&opt), "not an ONNX model"]);
}

#[test]
fn optimizer_model_without_optimizer() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let opt = dir.join("optimizer_model.onnx");
    fs::copy(graphs("mlp_ce_adamw/eval_model.onnx"), &opt).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&opt),
            "no AdamWOptimizer or SGDOptimizerV2 node (found: ai.onnx::Gemm, ai.onnx::Relu, ai.onnx::SoftmaxCrossEntropyLoss)",
        ],
    );
}

#[test]
fn optimizer_model_is_a_folder() {
    let (tmp, dir) = artifacts_copy("mlp_mse_sgd");
    let opt = dir.join("optimizer_model.onnx");
    fs::remove_file(&opt).unwrap();
    fs::create_dir(&opt).unwrap();
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(&err, &[&s(&opt), "is a folder, not a file"]);
}

// ----------------------------------------------------------------- external data

/// Makes the seed initializer of `<dir>/training_model.onnx` external, stored at `location`.
fn externalize_seed(dir: &Path, location: &str, extra: &[(&str, &str)]) -> String {
    let path = dir.join("training_model.onnx");
    let mut model = ModelProto::decode(fs::read(&path).unwrap().as_slice()).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let seed = graph
        .initializer
        .iter_mut()
        .find(|t| t.name().ends_with("_grad"))
        .expect("seed initializer");
    let name = seed.name().to_string();
    seed.raw_data = None;
    seed.data_location = Some(DataLocation::External as i32);
    let entry = |k: &str, v: &str| StringStringEntryProto {
        key: Some(k.into()),
        value: Some(v.into()),
    };
    seed.external_data = vec![entry("location", location)];
    seed.external_data
        .extend(extra.iter().map(|(k, v)| entry(k, v)));
    fs::write(&path, onnx_ga::model::encode_model(&model)).unwrap();
    name
}

#[test]
fn external_data_file_missing() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let tensor = externalize_seed(&dir, "weights.bin", &[]);
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&dir.join("training_model.onnx")),
            &format!("tensor '{tensor}'"),
            "external data file \"weights.bin\" not found",
        ],
    );
}

#[test]
fn external_data_escaping_the_folder() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    // The target exists, so only the location check can stop it.
    fs::write(tmp.path().join("secret.bin"), 1.0f32.to_le_bytes()).unwrap();
    externalize_seed(&dir, "../secret.bin", &[]);
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&dir.join("training_model.onnx")),
            "external data location \"../secret.bin\" is not allowed",
        ],
    );
}

#[test]
fn external_data_absolute_location() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    let secret = tmp.path().join("secret.bin");
    fs::write(&secret, 1.0f32.to_le_bytes()).unwrap();
    externalize_seed(&dir, &s(&secret), &[]);
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&dir.join("training_model.onnx")),
            &format!("external data location {:?} is not allowed", s(&secret)),
        ],
    );
}

#[test]
fn external_data_range_beyond_file() {
    let (tmp, dir) = artifacts_copy("mlp_ce_adamw");
    fs::write(dir.join("weights.bin"), 1.0f32.to_le_bytes()).unwrap();
    externalize_seed(&dir, "weights.bin", &[("offset", "4096"), ("length", "4")]);
    let err = fails(tmp.path(), &["inspect", &s(&dir)]);
    assert_has(
        &err,
        &[
            &s(&dir.join("training_model.onnx")),
            "external data range (offset 4096, length 4) lies beyond the end of \"weights.bin\" (4 bytes)",
        ],
    );
}

// ----------------------------------------------------------------- plain graphs and arguments

/// A copy of `mlp_ce_adamw/eval_model.onnx` (a graph without ORT accumulators).
fn eval_copy() -> (TempDir, PathBuf) {
    let bytes = fs::read(graphs("mlp_ce_adamw/eval_model.onnx")).unwrap();
    file_with(&bytes, "eval_model.onnx")
}

/// (`inspect` shows such a model instead: `cli_inspect::a_forward_model_without_a_loss...`.)
#[test]
fn plain_graph_without_loss() {
    let (tmp, path) = eval_copy();
    let out = tmp.path().join("step.onnx");
    let err = fails(tmp.path(), &["rewrite", &s(&path), "-o", &s(&out)]);
    assert_has(
        &err,
        &[
            &s(&path),
            "no loss given",
            "needs --loss-fn cross-entropy|nll|mse|l1|bce-logits",
            "default the first ('onnx::loss::2')",
            "a plain gradient graph needs --loss NAME",
        ],
    );
}

#[test]
fn plain_graph_without_grads() {
    // A forward model with `--loss` alone goes to autodiff, which names what is wrong.
    let (tmp, path) = eval_copy();
    let err = fails(tmp.path(), &["inspect", &s(&path), "--loss", "logits"]);
    assert_has(
        &err,
        &[&s(&path), "'logits' has shape", "a loss must be a scalar"],
    );
    let loss = "onnx::loss::2";
    let err = fails(tmp.path(), &["inspect", &s(&path), "--loss", loss]);
    assert_has(&err, &[&s(&path), "parameters fed as inputs", "fc1.weight"]);
}

#[test]
fn grad_naming_a_missing_tensor() {
    let (tmp, path) = eval_copy();
    let err = fails(
        tmp.path(),
        &[
            "inspect",
            &s(&path),
            "--loss",
            "logits",
            "--grad",
            "fc1.weight=nope",
        ],
    );
    assert_has(
        &err,
        &[&s(&path), "--grad fc1.weight=nope: no tensor named 'nope'"],
    );
}

#[test]
fn grad_naming_a_missing_parameter() {
    let (tmp, path) = eval_copy();
    let err = fails(
        tmp.path(),
        &[
            "inspect",
            &s(&path),
            "--loss",
            "logits",
            "--grad",
            "fc9.weight=relu1",
        ],
    );
    assert_has(
        &err,
        &[
            &s(&path),
            "--grad fc9.weight=relu1: no tensor named 'fc9.weight'",
        ],
    );
}

#[test]
fn loss_naming_a_missing_tensor() {
    let (tmp, path) = eval_copy();
    let err = fails(
        tmp.path(),
        &[
            "inspect",
            &s(&path),
            "--loss",
            "nope",
            "--grad",
            "fc1.weight=relu1",
        ],
    );
    assert_has(
        &err,
        &[&s(&path), "--loss 'nope' names no tensor of the graph"],
    );
}

#[test]
fn seed_that_is_not_an_initializer() {
    let (tmp, path) = eval_copy();
    let err = fails(
        tmp.path(),
        &[
            "inspect",
            &s(&path),
            "--loss",
            "logits",
            "--grad",
            "fc1.weight=relu1",
            "--seed",
            "relu1",
        ],
    );
    assert_has(
        &err,
        &[
            &s(&path),
            "--seed 'relu1' is not an initializer of the graph",
        ],
    );
}

#[test]
fn malformed_grad_argument() {
    let (tmp, path) = eval_copy();
    let err = fails(
        tmp.path(),
        &[
            "inspect",
            &s(&path),
            "--loss",
            "logits",
            "--grad",
            "fc1.weight",
        ],
    );
    assert_has(&err, &["--grad", "expected PARAM=TENSOR, got 'fc1.weight'"]);
}

#[test]
fn missing_path_argument() {
    let tmp = tempfile::tempdir().unwrap();
    let err = fails(tmp.path(), &["inspect"]);
    assert_has(&err, &["<PATH>", "required"]);
}
