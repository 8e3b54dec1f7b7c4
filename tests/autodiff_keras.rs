//! The autodiff on real Keras models, against Keras itself (TensorFlow 2.15, Keras 2.15,
//! tf2onnx 1.17; graphs/forward/generate_keras.py, references in fixtures/forward/keras_*):
//!
//! - `keras.onnx`: tf2onnx's export with the zero biases kept (grappler's constant folding
//!   off, tf2onnx's `merge_duplication` off); the gradients of the mean sparse categorical
//!   cross-entropy equal `tf.GradientTape`'s, and K = 4 micro-batches of 8 trained 8 windows
//!   equal Keras's 8 full-batch steps of 32 for SGD and Keras Adam (`formula=keras`);
//! - `default.onnx`: the plain export, which has no biases at all (the trap, measured).
//!
//! Keras variables map to ONNX initializers by layer (`<model>/<layer>/MatMul|Conv2D/...` is
//! the kernel, `.../BiasAdd/...` the bias); Conv2D kernels are OIHW in the file, HWIO in Keras,
//! and the fixtures hold them in the ONNX layout.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::{ort_available, read_npz, root, run_ort};
use onnx_ga::data::Tensor;
use onnx_ga::proto::ModelProto;

fn graph_path(model: &str, file: &str) -> PathBuf {
    root().join("graphs/forward").join(model).join(file)
}

fn fixture(model: &str, file: &str) -> BTreeMap<String, Tensor> {
    read_npz(&root().join("fixtures/forward").join(model).join(file))
}

fn load(path: &Path) -> ModelProto {
    onnx_ga::model::load_model_with_data(path).unwrap_or_else(|e| panic!("{e}"))
}

/// The step (or gradient graph) `spec` builds from a forward model.
fn build(path: &Path, spec: &str) -> ModelProto {
    let graph = onnx_ga::signature::forward(load(path), path);
    onnx_ga::step::build_step(graph, spec, true)
        .unwrap_or_else(|e| panic!("{}: {spec}: {e}", path.display()))
        .model
        .to_proto()
}

fn values(t: &Tensor) -> Vec<f64> {
    match t {
        Tensor::F32(a) => a.iter().map(|x| *x as f64).collect(),
        Tensor::F64(a) => a.iter().copied().collect(),
        other => panic!("not a float tensor: {other:?}"),
    }
}

/// ||a - b|| / ||b||.
fn relative_l2(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let (va, vb) = (values(a), values(b));
    let d: f64 = va.iter().zip(&vb).map(|(x, y)| (x - y) * (x - y)).sum();
    let n: f64 = vb.iter().map(|y| y * y).sum();
    d.sqrt() / n.sqrt().max(1e-30)
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    values(a)
        .iter()
        .zip(&values(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn first_rows(data: &BTreeMap<String, Tensor>, n: usize) -> BTreeMap<String, Tensor> {
    let rows: Vec<usize> = (0..n).collect();
    data.iter()
        .map(|(k, v)| (k.clone(), v.rows(&rows)))
        .collect()
}

fn grad_outputs(graph: &ModelProto) -> Vec<String> {
    graph
        .graph
        .as_ref()
        .unwrap()
        .output
        .iter()
        .filter_map(|o| o.name().strip_suffix("_grad").map(str::to_string))
        .collect()
}

const CE: &str = "autodiff(loss_fn=cross-entropy),legalize-ort";

/// Both exports run on ONNX Runtime and give Keras's logits (at init the missing zero
/// biases change nothing: the trap is invisible here).
fn keras_forward(model: &str) {
    if !ort_available() {
        return;
    }
    let reference = fixture(model, "forward.npz");
    for file in ["keras.onnx", "default.onnx"] {
        let out = run_ort(&load(&graph_path(model, file)), &reference);
        let err = max_abs(&out["logits"], &reference["logits"]);
        assert!(err <= 1e-5, "{model}/{file}: logits {err:e} from Keras");
    }
}

#[test]
fn keras_mlp_forward_equals_keras() {
    keras_forward("keras_mlp");
}
#[test]
fn keras_cnn_forward_equals_keras() {
    keras_forward("keras_cnn");
}
/// The plain export folds each BatchNorm into the Conv before it: inference arithmetic,
/// equal to Keras's logits (and not a network to train: keras.onnx keeps the BatchNorms).
#[test]
fn keras_bn_forward_equals_keras() {
    keras_forward("keras_bn");
}

/// Every Keras variable is a trainable initializer of `keras.onnx`, and its gradient is
/// within 1e-5 relative (norm-wise) of tf.GradientTape's, float32, samples [0, 8).
fn keras_gradients(model: &str, variables: usize) {
    keras_gradients_with(model, CE, "grads.npz", variables);
}

/// The same, the gradient graph built by `spec`, against the `reference` gradients (on the
/// samples' first as many tokens as the reference says).
fn keras_gradients_with(model: &str, spec: &str, reference: &str, variables: usize) {
    if !ort_available() {
        return;
    }
    let graph = build(&graph_path(model, "keras.onnx"), spec);
    let mut data = read_npz(&graph_path(model, "data.npz"));
    let reference = fixture(model, reference);
    if let Some(x) = reference.get("x") {
        data.insert("x".into(), x.clone());
    }
    let reference: BTreeMap<String, Tensor> =
        reference.into_iter().filter(|(k, _)| k != "x").collect();
    let out = run_ort(&graph, &first_rows(&data, 8));
    let loss_err = max_abs(&out["loss"], &reference["loss"]);
    assert!(loss_err < 1e-6, "{model}: loss {loss_err:e} from Keras");
    let params = grad_outputs(&graph);
    assert_eq!(
        params.len(),
        variables,
        "{model}: one trainable parameter per Keras variable: {params:?}"
    );
    let mut worst = 0.0f64;
    for name in &params {
        let expected = reference
            .get(name)
            .unwrap_or_else(|| panic!("{model}: no Keras gradient for '{name}'"));
        let err = relative_l2(&out[&format!("{name}_grad")], expected);
        assert!(
            err <= 1e-5,
            "{model}: '{name}' gradient {err:e} relative from Keras"
        );
        worst = worst.max(err);
    }
    eprintln!("{model}: loss {loss_err:e} from Keras, worst gradient {worst:e} relative");
    assert_eq!(reference.len(), variables + 1, "{model}: grads.npz keys");
}

#[test]
fn keras_mlp_gradients_equal_gradient_tape() {
    keras_gradients("keras_mlp", 4);
}
#[test]
fn keras_cnn_gradients_equal_gradient_tape() {
    keras_gradients("keras_cnn", 6);
}
/// Exactly Keras's 7 trainable variables train (BatchNorm in its training form, the
/// depthwise kernel under the name tf2onnx's folding gave it), not the constants tf2onnx
/// wrote as initializers: Rescaling's scale and offset, the ReLU6 bounds, the unit scale of
/// the BatchNorm built with scale=False (14 would train by the general rule).
#[test]
fn keras_bn_gradients_equal_gradient_tape() {
    keras_gradients("keras_bn", 7);
}

/// The trap, as measured: tf2onnx's default export (grappler constant folding) has dropped
/// every zero-initialised bias, so only the kernels are trainable; their gradients still
/// equal Keras's at init (the forward is the same there), which is why nothing looks wrong.
fn default_export_has_no_biases(model: &str, kernels: usize) {
    if !ort_available() {
        return;
    }
    let graph = build(&graph_path(model, "default.onnx"), CE);
    let params = grad_outputs(&graph);
    assert_eq!(params.len(), kernels, "{model}: {params:?}");
    assert!(
        params.iter().all(|p| !p.contains("BiasAdd")),
        "{model}: {params:?}"
    );
    let data = read_npz(&graph_path(model, "data.npz"));
    let reference = fixture(model, "grads.npz");
    let out = run_ort(&graph, &first_rows(&data, 8));
    for name in &params {
        // default: `.../MatMul/ReadVariableOp:0`; kept: `.../MatMul/ReadVariableOp/resource:0`.
        let kept = name.replace("ReadVariableOp:0", "ReadVariableOp/resource:0");
        let err = relative_l2(&out[&format!("{name}_grad")], &reference[&kept]);
        assert!(err <= 1e-5, "{model}: '{name}' gradient {err:e} from Keras");
    }
}

#[test]
fn keras_mlp_default_export_drops_the_biases() {
    default_export_has_no_biases("keras_mlp", 2);
}
#[test]
fn keras_cnn_default_export_drops_the_biases() {
    default_export_has_no_biases("keras_cnn", 3);
}

/// K = 4 micro-batches of 8 (mean normalisation), 8 windows, against Keras's 8 full-batch
/// steps of 32 on the same rows, within 2e-6 max abs on every parameter.
fn keras_training(model: &str, optimizer: &str, reference: &str) {
    keras_training_in(model, optimizer, reference, 4);
}

/// The same in `k` micro-batches of 32 / k per window.
fn keras_training_in(model: &str, optimizer: &str, reference: &str, k: usize) {
    keras_training_of(model, "keras.onnx", optimizer, reference, k);
}

/// The same for one of the model's exports.
fn keras_training_of(model: &str, file: &str, optimizer: &str, reference: &str, k: usize) {
    keras_training_with(model, file, "", optimizer, reference, k);
}

/// The same with more autodiff options (`,loops=keep`).
fn keras_training_with(
    model: &str,
    file: &str,
    autodiff: &str,
    optimizer: &str,
    reference: &str,
    k: usize,
) {
    if !ort_available() {
        return;
    }
    let spec = format!(
        "autodiff(loss_fn=cross-entropy,grads=internal{autodiff}),grad-accum(steps={k},normalize=mean),{optimizer},legalize-ort,dce"
    );
    let step = build(&graph_path(model, file), &spec);
    let data = read_npz(&graph_path(model, "data.npz"));
    let mut trainer = common::trainer(&step);
    let samples = trainer
        .check_data(&data, Path::new("data.npz"))
        .unwrap_or_else(|e| panic!("{e}"));
    for i in 0..8 * k as u64 {
        let batch = onnx_ga::train::micro_batch(&data, samples, 32 / k, i);
        trainer
            .step(&batch, false)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let state = trainer.state().unwrap_or_else(|e| panic!("{e}")).clone();
    let expected = fixture(model, reference);
    let initial = load(&graph_path(model, file));
    let initial: BTreeMap<String, Tensor> = initial
        .graph
        .as_ref()
        .unwrap()
        .initializer
        .iter()
        .map(|t| (t.name().to_string(), Tensor::from_tensor_proto(t).unwrap()))
        .collect();
    let mut worst = 0.0f64;
    for (name, want) in &expected {
        let got = state
            .get(name)
            .unwrap_or_else(|| panic!("{model}: no trained '{name}'"));
        let err = max_abs(got, want);
        assert!(
            err <= 2e-6,
            "{model} {optimizer}: '{name}' max abs {err:e} from Keras"
        );
        // The run moved every parameter (a test that cannot pass by doing nothing).
        assert!(
            max_abs(want, &initial[name]) > 1e-4,
            "{model}: '{name}' did not move"
        );
        worst = worst.max(err);
    }
    eprintln!(
        "{model}/{file} {optimizer}: worst parameter {worst:e} max abs from Keras ({reference})"
    );
}

const SGD: &str = "optimizer(kind=sgd,lr=0.1)";
const KERAS_ADAM: &str = "optimizer(kind=adam,lr=0.01,formula=keras)";

#[test]
fn keras_mlp_accumulated_sgd_equals_full_batch() {
    keras_training("keras_mlp", SGD, "run_sgd.npz");
}
/// Keras Adam against Keras's run on a float64 copy of the model (run_adam64.npz): the
/// float32 run (run_adam.npz) carries its own rounding, which Adam's m / sqrt(v) amplifies
/// where a gradient element is near its noise (measured: one `fc1` kernel element 2.8e-6
/// between Keras's float32 and float64 runs; everything else <= 3.3e-7).
///
/// Keras 2.15 is not exactly ORT's adam_mode 1: it computes the bias corrections 1 - b^t
/// from betas cast through float32 (0.999 -> 0.99900001287) but its moments with the
/// decimal 1 - b, so each update is 6.7e-6 relatively smaller than `formula=keras`
/// computes (fixtures' meta.json, `keras_adam_first_update_over_textbook`). After 8 steps
/// of lr 1e-2 that is 5.5e-7 (mlp) and 1.34e-6 (cnn) of the 2e-6 budget (measured against a
/// float64 replay of the formula with the decimal betas).
#[test]
fn keras_mlp_accumulated_keras_adam_equals_full_batch() {
    keras_training("keras_mlp", KERAS_ADAM, "run_adam64.npz");
}
#[test]
fn keras_cnn_accumulated_sgd_equals_full_batch() {
    keras_training("keras_cnn", SGD, "run_sgd.npz");
}
#[test]
fn keras_cnn_accumulated_keras_adam_equals_full_batch() {
    keras_training("keras_cnn", KERAS_ADAM, "run_adam64.npz");
}

/// A network with BatchNorm trains on whole batches of 32 (K = 1: batch statistics over
/// micro-batches of 8 would be another network's, as in Keras's own accumulation) like
/// Keras's 8 full-batch SGD steps.
#[test]
fn keras_bn_sgd_equals_keras() {
    keras_training_in("keras_bn", SGD, "run_sgd.npz", 1);
}

/// The plain export of the BatchNorm network (`default.onnx`: tf2onnx folded both
/// BatchNorms into the convolutions before them) is refused by name, exit code 2, no output
/// written; `--trainable` chooses the set and the rewrite goes ahead.
#[test]
fn keras_bn_default_export_with_folded_batch_norms_is_refused() {
    let file = graph_path("keras_bn", "default.onnx");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("step.onnx");
    let rewrite = |extra: &[&str]| {
        let mut args = vec![
            "rewrite",
            file.to_str().unwrap(),
            "--loss-fn",
            "cross-entropy",
            "--optimizer",
            "sgd",
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        common::onnx_ga_cli(&args)
    };
    let refused = rewrite(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    for expect in [
        "keras_bn/default.onnx",
        "tf2onnx folded BatchNormalization layers into the convolutions before them (4 tensors: keras_bn/dw/depthwise_weights_fused_bn",
        "keras_bn/conv1/Conv2D_weights_fused_bn",
        "--trainable GLOB",
    ] {
        assert!(stderr.contains(expect), "expected '{expect}' in: {stderr}");
    }
    assert!(!out.exists(), "wrote an output");
    let chosen = rewrite(&["--trainable", "*"]);
    assert!(
        chosen.status.success(),
        "{}",
        String::from_utf8_lossy(&chosen.stderr)
    );
}

/// An LSTM as tf2onnx writes it (ONNX's LSTM, gates reordered, Keras's one bias as the
/// first half of B with the recurrent half zeros): 6 parameters, gradients equal to
/// GradientTape's with the recurrent bias half getting none (training both halves would
/// move Keras's bias twice per step), and 4 micro-batches x 8 windows equal to Keras's 8
/// full-batch SGD and Adam steps.
#[test]
fn keras_lstm_forward_equals_keras() {
    keras_forward("keras_lstm");
}
#[test]
fn keras_lstm_gradients_equal_gradient_tape() {
    keras_gradients("keras_lstm", 6);
}
#[test]
fn keras_lstm_accumulated_sgd_equals_full_batch() {
    keras_training("keras_lstm", SGD, "run_sgd.npz");
}
#[test]
fn keras_lstm_accumulated_keras_adam_equals_full_batch() {
    keras_training("keras_lstm", KERAS_ADAM, "run_adam64.npz");
}

/// Keras's GRU and SimpleRNN as tf2onnx writes them: TensorFlow while loops, each a `Loop`
/// with no trip count whose condition compares a counter with the sequence length, which
/// the autodiff unrolls (`unroll_loop`); the Bidirectional layer's backward GRU reads its
/// sequence through ReverseSequence; each GRU's one bias [2, 3H] is two initializers
/// [1, 3H] (its input and recurrent rows), so 14 parameters for Keras's 11 variables.
/// Gradients equal GradientTape's, and 4 micro-batches x 8 windows equal Keras's 8
/// full-batch SGD and Adam steps. (`default.onnx`, with grappler's constant folding, has
/// the GRU as ONNX's GRU instead; its forward is compared too.)
#[test]
fn keras_gru_forward_equals_keras() {
    keras_forward("keras_gru");
}
#[test]
fn keras_gru_gradients_equal_gradient_tape() {
    keras_gradients("keras_gru", 14);
}
#[test]
fn keras_gru_accumulated_sgd_equals_full_batch() {
    keras_training("keras_gru", SGD, "run_sgd.npz");
}
#[test]
fn keras_gru_accumulated_keras_adam_equals_full_batch() {
    keras_training("keras_gru", KERAS_ADAM, "run_adam64.npz");
}
/// The same model with its Loops kept (`--loops keep`): each recurrent layer stays a Loop
/// and its gradient is a Loop over the 12 steps backwards (`loop_grad`): the same gradients
/// and the same training.
#[test]
fn keras_gru_loops_kept_gradients_equal_gradient_tape() {
    keras_gradients_with(
        "keras_gru",
        "autodiff(loss_fn=cross-entropy,loops=keep),legalize-ort",
        "grads.npz",
        14,
    );
}
#[test]
fn keras_gru_loops_kept_accumulated_sgd_equals_full_batch() {
    keras_training_with(
        "keras_gru",
        "keras.onnx",
        ",loops=keep",
        SGD,
        "run_sgd.npz",
        4,
    );
}
#[test]
fn keras_gru_loops_kept_accumulated_keras_adam_equals_full_batch() {
    keras_training_with(
        "keras_gru",
        "keras.onnx",
        ",loops=keep",
        KERAS_ADAM,
        "run_adam64.npz",
        4,
    );
}
/// keras_gru on sequences of any length (`Input((None,))`): tf2onnx's Loops run as many
/// iterations as the input has steps, known only at run time, so none is unrolled: each
/// stays a Loop, differentiated by a Loop over its iterations backwards (`loop_grad`). The
/// one gradient graph gives Keras's gradients at 12 steps and at 7, and trains like Keras
/// at 12 (4 micro-batches x 8 windows against 8 full batches).
#[test]
fn keras_gru_any_length_forward_equals_keras() {
    keras_forward("keras_gru_any_length");
}
#[test]
fn keras_gru_any_length_gradients_equal_gradient_tape() {
    keras_gradients("keras_gru_any_length", 14);
}
#[test]
fn keras_gru_any_length_gradients_at_7_steps_equal_gradient_tape() {
    keras_gradients_with("keras_gru_any_length", CE, "grads_t7.npz", 14);
}
#[test]
fn keras_gru_any_length_accumulated_sgd_equals_full_batch() {
    keras_training("keras_gru_any_length", SGD, "run_sgd.npz");
}
#[test]
fn keras_gru_any_length_accumulated_keras_adam_equals_full_batch() {
    keras_training("keras_gru_any_length", KERAS_ADAM, "run_adam64.npz");
}
/// `rewrite --loops keep` on the fixed-length model keeps its three Loops and says so (and
/// why); the default unrolls them.
#[test]
fn rewrite_loops_keep_keeps_the_loops_and_says_so() {
    let file = graph_path("keras_gru", "keras.onnx");
    let dir = tempfile::tempdir().unwrap();
    let rewrite = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec![
            "rewrite",
            file.to_str().unwrap(),
            "--loss-fn",
            "cross-entropy",
            "--optimizer",
            "sgd",
            "--accum-steps",
            "4",
            "-o",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let output = common::onnx_ga_cli(&args);
        let text = String::from_utf8_lossy(&output.stdout).to_string()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{text}");
        let loops = load(&out)
            .graph
            .unwrap()
            .node
            .iter()
            .filter(|n| n.op_type() == "Loop")
            .count();
        (text, loops)
    };
    let (kept, loops) = rewrite("kept.onnx", &["--loops", "keep"]);
    assert!(
        kept.contains(
            "3 Loops not unrolled, differentiated by a Loop over the iterations backwards"
        ),
        "{kept}"
    );
    assert!(
        kept.contains("keras_gru/rnn/while_loop (--loops keep)"),
        "{kept}"
    );
    // Three forward Loops and their three backward ones.
    assert_eq!(loops, 6, "{kept}");
    let (unrolled, loops) = rewrite("unrolled.onnx", &[]);
    assert!(
        unrolled.contains("3 Loops unrolled into their iterations"),
        "{unrolled}"
    );
    assert_eq!(loops, 0, "{unrolled}");
}
/// Its plain export (grappler's constant folding on) has the Bidirectional GRU as ONNX's
/// GRU over the run-time length, which `unroll_rnn` makes one Loop per direction (the
/// SimpleRNN stays tf2onnx's Loop): it trains like Keras too (`default_run_sgd.npz`: Keras's
/// SGD run in that layout).
#[test]
fn keras_gru_any_length_default_export_sgd_equals_full_batch() {
    keras_training_of(
        "keras_gru_any_length",
        "default.onnx",
        SGD,
        "default_run_sgd.npz",
        4,
    );
}
/// The plain export of the same model (grappler's constant folding on) has the
/// Bidirectional GRU as ONNX's GRU (linear_before_reset, each direction's bias the input row
/// then the recurrent row of Keras's), which `unroll_rnn` unrolls, and the SimpleRNN as a
/// Loop: it trains like Keras too (default_run_sgd.npz: Keras's SGD run in that layout,
/// checked against the file's initial values by the generator).
#[test]
fn keras_gru_default_export_sgd_equals_full_batch() {
    keras_training_of("keras_gru", "default.onnx", SGD, "default_run_sgd.npz", 4);
}
