//! `onnx-ga inspect` end to end: the built binary on every generated artifacts folder.
//!
//! - insta snapshots of the text report and of the printed graph (`--graph`) per folder;
//! - the JSON report (`--json`) checked against the checkpoint, read independently with
//!   `onnx_ga::checkpoint::read_checkpoint`: every parameter with the checkpoint's shape,
//!   dtype and trainable flag, and the element counts summing to the checkpoint's;
//! - a single `training_model.onnx` (no checkpoint) and a plain gradient graph with
//!   `--loss/--seed/--grad`.

use crate::common;

use crate::common::root;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use onnx_ga::checkpoint::{read_checkpoint, Checkpoint};
use onnx_ga::ir::builder::{attr_int, tensor_f32, tensor_i64};
use onnx_ga::proto::tensor_proto::DataType;
use onnx_ga::proto::{
    type_proto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TypeProto, ValueInfoProto,
};
use prost::Message;
use serde_json::Value;

const MODELS: [&str; 6] = common::SHIPPED_GRAPHS;

/// Runs `onnx-ga ARGS` in the crate root.
fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run onnx-ga")
}

/// Runs `onnx-ga ARGS`, asserts success, and returns stdout.
fn ok(args: &[&str]) -> String {
    let out = onnx_ga(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "onnx-ga {args:?} failed ({}): {stderr}",
        out.status
    );
    assert!(
        stderr.is_empty(),
        "onnx-ga {args:?} wrote to stderr: {stderr}"
    );
    String::from_utf8(out.stdout).expect("stdout is UTF-8")
}

/// Snapshots without machine-specific paths: the crate root and temporary folders.
fn snapshot(name: &str, text: &str, extra_filters: &[(&str, &str)]) {
    let root = regex_escape(&root().display().to_string());
    let mut filters: Vec<(String, String)> = vec![(root, "[ROOT]".into())];
    for (from, to) in extra_filters {
        filters.push((regex_escape(from), to.to_string()));
    }
    let filters: Vec<(&str, &str)> = filters
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    insta::with_settings!({ filters => filters }, {
        insta::assert_snapshot!(name, text);
    });
}

fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn folder(model: &str) -> String {
    format!("graphs/{model}")
}

fn checkpoint(model: &str) -> Checkpoint {
    let path = root().join("graphs").join(model).join("checkpoint");
    read_checkpoint(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn json(args: &[&str]) -> Value {
    let text = ok(args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("onnx-ga {args:?}: bad JSON: {e}"))
}

fn element_count(dims: &[i64]) -> u64 {
    dims.iter().map(|d| u64::try_from(*d).unwrap()).product()
}

fn i64s(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

// ------------------------------------------------------------------------- snapshots

macro_rules! snapshot_tests {
    ($($model:ident),* $(,)?) => {
        $(
            #[test]
            fn $model() {
                let model = stringify!($model);
                let report = ok(&["inspect", &folder(model)]);
                snapshot(&format!("{model}_report"), &report, &[]);
                let with_graph = ok(&["inspect", &folder(model), "--graph"]);
                let graph = with_graph
                    .strip_prefix(&report)
                    .expect("--graph output starts with the report")
                    .strip_prefix('\n')
                    .expect("a blank line separates report and graph");
                snapshot(&format!("{model}_graph"), graph, &[]);
            }
        )*
    };
}

snapshot_tests!(
    mlp_ce_adamw,
    mlp_mse_sgd,
    cnn_bn,
    transformer_block,
    bce_logits,
    l1_loss
);

// ----------------------------------------------------------------- JSON vs checkpoint

#[test]
fn every_parameter_has_the_checkpoint_shape() {
    for model in MODELS {
        let ckpt = checkpoint(model);
        let report = json(&["inspect", &folder(model), "--json"]);
        let sig = &report["signature"];
        let params = sig["params"].as_array().expect("params");
        assert_eq!(
            params.len(),
            ckpt.trainable.len() + ckpt.frozen.len(),
            "{model}: parameter count"
        );
        for t in ckpt.parameters() {
            let matching: Vec<&Value> = params.iter().filter(|p| p["name"] == t.name).collect();
            assert_eq!(matching.len(), 1, "{model}: '{}' listed once", t.name);
            let p = matching[0];
            assert_eq!(i64s(&p["dims"]), t.dims, "{model}: '{}' dims", t.name);
            assert_eq!(
                p["elem_type"].as_i64(),
                Some(t.data_type as i64),
                "{model}: '{}' elem_type",
                t.name
            );
            let trainable = ckpt.is_trainable(&t.name).unwrap();
            assert_eq!(
                p["trainable"].as_bool(),
                Some(trainable),
                "{model}: '{}' trainable",
                t.name
            );
            if trainable {
                assert_eq!(
                    p["grad"].as_str(),
                    Some(format!("{}_grad", t.name).as_str()),
                    "{model}: '{}' gradient (ORT names it <param>_grad)",
                    t.name
                );
            } else {
                assert!(
                    p["grad"].is_null(),
                    "{model}: frozen '{}' has no grad",
                    t.name
                );
            }
        }
    }
}

#[test]
fn parameter_count_matches_the_checkpoint() {
    for model in MODELS {
        let ckpt = checkpoint(model);
        let trainable: u64 = ckpt.trainable.iter().map(|t| element_count(&t.dims)).sum();
        let frozen: u64 = ckpt.frozen.iter().map(|t| element_count(&t.dims)).sum();
        // Independent of dims: the raw bytes of float32 parameters.
        let bytes: usize = ckpt.parameters().map(|t| t.raw_data.len()).sum();
        assert_eq!(
            bytes as u64,
            4 * (trainable + frozen),
            "{model}: float32 bytes"
        );

        let report = json(&["inspect", &folder(model), "--json"]);
        let count = &report["parameter_count"];
        assert_eq!(count["trainable"].as_u64(), Some(trainable), "{model}");
        assert_eq!(count["frozen"].as_u64(), Some(frozen), "{model}");
        assert_eq!(count["total"].as_u64(), Some(trainable + frozen), "{model}");

        // The text report says the same.
        let text = ok(&["inspect", &folder(model)]);
        let line = format!(
            "elements: {} ({trainable} trainable, {frozen} frozen)",
            trainable + frozen
        );
        assert!(
            text.contains(&line),
            "{model}: text lacks '{line}':\n{text}"
        );
    }
}

#[test]
fn json_report_names_roles_and_optimizer() {
    for model in MODELS {
        let report = json(&["inspect", &folder(model), "--json"]);
        let sig = &report["signature"];
        assert_eq!(sig["source"]["kind"], "ort_artifacts", "{model}");
        let loss = sig["loss"].as_str().expect("loss");
        assert_eq!(sig["seed"].as_str(), Some(format!("{loss}_grad").as_str()));
        assert_eq!(sig["lazy_reset_grad"], "lazy_reset_grad", "{model}");
        let data: Vec<&str> = sig["data_inputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect();
        assert_eq!(data.len(), 2, "{model}: data inputs {data:?}");
        assert_eq!(data[0], "input", "{model}");
        let optimizer = sig["optimizer"]["type"].as_str();
        let expected = if model.ends_with("sgd") || model == "l1_loss" {
            "sgd"
        } else {
            "adamw"
        };
        assert_eq!(optimizer, Some(expected), "{model}");
        assert!(
            report["training_only_ops"]
                .as_array()
                .unwrap()
                .contains(&Value::from("com.microsoft::InPlaceAccumulatorV2")),
            "{model}"
        );
    }
}

#[test]
fn json_with_graph_carries_the_printed_graph() {
    let report = json(&["inspect", "graphs/mlp_ce_adamw", "--json", "--graph"]);
    let graph = report["graph"].as_str().expect("graph text");
    let text = ok(&["inspect", "graphs/mlp_ce_adamw", "--graph"]);
    assert!(
        text.ends_with(graph),
        "the same printed graph in text and JSON"
    );
}

// ---------------------------------------------------------------- single files

#[test]
fn training_model_file_without_checkpoint() {
    for model in MODELS {
        let file = format!("graphs/{model}/training_model.onnx");
        let report = json(&["inspect", &file, "--json"]);
        let sig = &report["signature"];
        assert_eq!(sig["source"]["kind"], "ort_training_graph", "{model}");
        assert!(
            sig["optimizer"].is_null(),
            "{model}: no optimizer model read"
        );
        // The accumulators name exactly the checkpoint's trainable parameters.
        let ckpt = checkpoint(model);
        let params = sig["params"].as_array().unwrap();
        assert_eq!(params.len(), ckpt.trainable.len(), "{model}");
        for (p, t) in params.iter().zip(&ckpt.trainable) {
            assert_eq!(p["name"], t.name, "{model}: graph-input order");
            assert_eq!(i64s(&p["dims"]), t.dims, "{model}: '{}'", t.name);
            assert_eq!(p["trainable"], true);
        }
        // Frozen parameters cannot be told from data without the checkpoint.
        let data: Vec<&str> = sig["data_inputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["name"].as_str().unwrap())
            .collect();
        for t in &ckpt.frozen {
            assert!(
                data.contains(&t.name.as_str()),
                "{model}: '{}' as data",
                t.name
            );
        }
    }
    let text = ok(&["inspect", "graphs/cnn_bn/training_model.onnx"]);
    snapshot("cnn_bn_training_model_file_report", &text, &[]);
}

// ---------------------------------------------------------------- plain graphs

/// A tiny hand-written gradient graph: loss = ReduceSum(x @ W + b), with its gradients
/// dW = x^T @ dy and db = ReduceSum(dy, axes 0), dy = Expand(seed, Shape(y)).
fn plain_gradient_graph() -> ModelProto {
    let tensor = |name: &str, elem: DataType, dims: &[i64]| ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(onnx_ga::ir::tensor_type(elem as i32, dims)),
        ..Default::default()
    };
    let node = |name: &str, op: &str, inputs: &[&str], outputs: &[&str]| NodeProto {
        name: Some(name.into()),
        op_type: Some(op.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    let mut w = tensor_f32(&[3, 2], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]);
    w.name = Some("W".into());
    let mut seed = tensor_f32(&[], &[1.0]);
    seed.name = Some("loss_grad".into());
    let mut axes = tensor_i64(&[1], &[0]);
    axes.name = Some("axes0".into());
    let mut reduce_b = node("db", "ReduceSum", &["dy", "axes0"], &["b_grad"]);
    reduce_b.attribute.push(attr_int("keepdims", 0));
    let mut loss = node("loss", "ReduceSum", &["y"], &["loss"]);
    loss.attribute.push(attr_int("keepdims", 0));
    let mut transpose = node("xT", "Transpose", &["x"], &["xT"]);
    transpose
        .attribute
        .push(onnx_ga::ir::builder::attr_ints("perm", &[1, 0]));
    let graph = GraphProto {
        name: Some("plain_linear".into()),
        node: vec![
            node("mm", "MatMul", &["x", "W"], &["xW"]),
            node("add", "Add", &["xW", "b"], &["y"]),
            loss,
            node("shape", "Shape", &["y"], &["y_shape"]),
            node("dy", "Expand", &["loss_grad", "y_shape"], &["dy"]),
            transpose,
            node("dW", "MatMul", &["xT", "dy"], &["W_grad"]),
            reduce_b,
        ],
        input: vec![
            tensor("x", DataType::Float, &[4, 3]),
            tensor("b", DataType::Float, &[2]),
        ],
        output: vec![
            ValueInfoProto {
                name: Some("loss".into()),
                r#type: Some(TypeProto {
                    value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                        elem_type: Some(DataType::Float as i32),
                        shape: None,
                    })),
                    denotation: None,
                }),
                ..Default::default()
            },
            tensor("W_grad", DataType::Float, &[3, 2]),
            tensor("b_grad", DataType::Float, &[2]),
        ],
        initializer: vec![w, seed, axes],
        ..Default::default()
    };
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        producer_name: Some("cli_inspect test".into()),
        graph: Some(graph),
        ..Default::default()
    }
}

fn write_plain_graph(dir: &Path) -> PathBuf {
    let path = dir.join("plain.onnx");
    std::fs::write(&path, plain_gradient_graph().encode_to_vec()).unwrap();
    path
}

#[test]
fn plain_graph_with_explicit_roles() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_plain_graph(dir.path());
    let file = file.to_str().unwrap();
    let roles = [
        "--loss",
        "loss",
        "--seed",
        "loss_grad",
        "--grad",
        "W=W_grad",
        "--grad",
        "b=b_grad",
    ];
    let mut args = vec!["inspect", file];
    args.extend(roles);
    let text = ok(&args);
    let tmp = dir.path().display().to_string();
    snapshot("plain_graph_report", &text, &[(&tmp, "[TMP]")]);

    args.push("--json");
    let report = json(&args);
    let sig = &report["signature"];
    assert_eq!(sig["source"]["kind"], "plain");
    assert_eq!(sig["loss"], "loss");
    assert_eq!(sig["seed"], "loss_grad");
    let params = sig["params"].as_array().unwrap();
    assert_eq!(params.len(), 2);
    // An initializer parameter and an input parameter.
    assert_eq!(params[0]["name"], "W");
    assert_eq!(i64s(&params[0]["dims"]), vec![3, 2]);
    assert_eq!(params[0]["grad"], "W_grad");
    assert_eq!(params[1]["name"], "b");
    assert_eq!(i64s(&params[1]["dims"]), vec![2]);
    assert_eq!(params[1]["grad"], "b_grad");
    assert_eq!(report["parameter_count"]["total"], 8);
    let data: Vec<&str> = sig["data_inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(data, ["x"]);
    assert_eq!(report["training_only_ops"].as_array().unwrap().len(), 0);

    args.pop();
    args.push("--graph");
    let with_graph = ok(&args);
    let graph = with_graph
        .strip_prefix(&text)
        .unwrap()
        .strip_prefix('\n')
        .unwrap();
    snapshot("plain_graph_graph", graph, &[(&tmp, "[TMP]")]);
}

#[test]
fn plain_graph_accepts_ort_training_graph_with_roles() {
    // Explicit roles override the ORT convention, also on an ORT training graph.
    let report = json(&[
        "inspect",
        "graphs/mlp_ce_adamw/training_model.onnx",
        "--json",
        "--loss",
        "onnx::loss::2",
        "--seed",
        "onnx::loss::2_grad",
        "--grad",
        "fc1.weight=fc1.weight_grad",
    ]);
    let sig = &report["signature"];
    assert_eq!(sig["source"]["kind"], "plain");
    assert_eq!(sig["params"].as_array().unwrap().len(), 1);
    assert_eq!(i64s(&sig["params"][0]["dims"]), vec![32, 16]);
    assert_eq!(report["parameter_count"]["total"], 512);
}

#[test]
fn absurd_dims_do_not_panic() {
    // Dims whose products overflow 64 bits in a parameter's type: counts saturate. In an
    // initializer (whose data cannot match them) they are refused at load, naming it.
    let huge = 1i64 << 40;
    let mut model = plain_gradient_graph();
    let graph = model.graph.as_mut().unwrap();
    graph.input[1].r#type = Some(onnx_ga::ir::tensor_type(
        DataType::Float as i32,
        &[huge, huge, huge],
    ));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("huge.onnx");
    std::fs::write(&file, model.encode_to_vec()).unwrap();
    let file = file.to_str().unwrap();
    let args = [
        "inspect", file, "--graph", "--loss", "loss", "--grad", "b=b_grad",
    ];
    let text = ok(&args);
    assert!(text.contains(&format!("elements: {}", u64::MAX)), "{text}");

    let mut big = tensor_f32(&[], &[]);
    big.dims = vec![huge, huge];
    big.name = Some("big".into());
    model.graph.as_mut().unwrap().initializer.push(big);
    std::fs::write(file, model.encode_to_vec()).unwrap();
    let out = onnx_ga(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("initializer 'big'") && stderr.contains("overflows"),
        "{stderr}"
    );
}

/// A step's BatchNorm line says which variance its running variances move with, when the
/// autodiff trained BatchNorm layers: unbiased for a model torch exported (its convention),
/// biased when `--bn-var biased` says so; an artifacts step (ONNX Runtime's own) says
/// nothing of it.
#[test]
fn inspect_says_which_variance_batch_norm_running_statistics_move_with() {
    let dir = tempfile::tempdir().unwrap();
    let line = |step: &Path| -> String {
        ok(&["inspect", step.to_str().unwrap()])
            .lines()
            .find(|l| l.contains("BatchNorm statistics"))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let forward = [
        "--loss-fn",
        "cross-entropy",
        "--optimizer",
        "sgd",
        "--accum-steps",
        "4",
    ];
    let torch = dir.path().join("torch.onnx");
    common::cli_rewrite("forward/torch_cnn/dynamo.onnx", &torch, &forward);
    assert_eq!(
        line(&torch),
        "BatchNorm statistics: window, running variance unbiased"
    );
    let biased = dir.path().join("biased.onnx");
    let flags = [&forward[..], &["--bn-var", "biased"]].concat();
    common::cli_rewrite("forward/torch_cnn/dynamo.onnx", &biased, &flags);
    assert_eq!(
        line(&biased),
        "BatchNorm statistics: window, running variance biased"
    );
    let artifacts = dir.path().join("artifacts.onnx");
    common::cli_rewrite("cnn_bn", &artifacts, &["--accum-steps", "4", "--lr", "0.1"]);
    assert_eq!(line(&artifacts), "BatchNorm statistics: window");
}

/// `inspect FORWARD.onnx` given no loss shows the model rather than refusing it: its inputs
/// and outputs, the parameters autodiff would train (torch's own list where its exporter
/// recorded one, buffers apart), and the commands to go on with, which run as printed.
/// The parameter count is checked against the differentiated report (`--loss-fn`), which
/// finds the trainable set by autodiff's own route.
#[test]
fn a_forward_model_without_a_loss_is_shown_with_the_commands_to_go_on() {
    for (model, input, output, buffers) in [
        (
            "graphs/forward/torch_gpt/dynamo.onnx",
            "idx  int64[batch,8]",
            "logits  float[batch,8,32]",
            2,
        ),
        (
            "graphs/forward/keras_cnn/keras.onnx",
            "x  float[unk__19,8,8,3]",
            "logits  float[unk__20,4]",
            0,
        ),
    ] {
        let text = ok(&["inspect", model]);
        assert!(text.contains(&format!("inputs:\n  {input}\n")), "{text}");
        assert!(text.contains(&format!("outputs:\n  {output}\n")), "{text}");
        assert_eq!(
            text.contains("buffers and constants: 2"),
            buffers == 2,
            "{text}"
        );

        let json: Value = serde_json::from_str(&ok(&["inspect", model, "--json"])).unwrap();
        let forward = &json["forward"];
        let differentiated: Value = serde_json::from_str(&ok(&[
            "inspect",
            model,
            "--loss-fn",
            "cross-entropy",
            "--json",
        ]))
        .unwrap();
        assert_eq!(
            forward["parameter_elements"], differentiated["parameter_count"]["trainable"],
            "{model}: the elements autodiff trains"
        );
        assert_eq!(
            forward["parameters"].as_u64().unwrap() as usize,
            differentiated["signature"]["params"]
                .as_array()
                .unwrap()
                .len(),
            "{model}: the parameters autodiff trains"
        );
        assert_eq!(forward["buffers"], buffers);

        // The suggested inspect runs as printed (in the crate root, where `model` is).
        let suggested = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("onnx-ga inspect "))
            .expect("a suggested inspect");
        let args: Vec<&str> = std::iter::once("inspect")
            .chain(suggested.split('#').next().unwrap().split_whitespace())
            .collect();
        assert!(ok(&args).contains("parameters:"), "{args:?}");
    }
    // ONNX Runtime's eval model takes its parameters as inputs: nothing autodiff would
    // train, and no command suggested that would fail.
    let text = ok(&["inspect", "graphs/mlp_ce_adamw/eval_model.onnx"]);
    assert!(text.contains("parameters: 0 (0 elements"), "{text}");
    assert!(
        text.contains("to train it: nothing to train") && !text.contains("onnx-ga rewrite"),
        "{text}"
    );
}
