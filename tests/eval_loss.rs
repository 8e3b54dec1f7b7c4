//! The validation loss of `train --eval-data V.npz --eval-model M.onnx` (`onnx_ga::evaluate`),
//! end to end through the CLI, against torch's `model.eval()` loss on held-out rows before
//! training and after every optimizer step (fixtures/forward/<model>/eval.json and
//! eval_data.npz, from graphs/forward/eval_reference.py):
//!
//! - the MLP, AdamW: 20 rows in batches of 8 (a last batch of 4);
//! - the GPT, AdamW, padded labels: the mean over the set's 70 counted labels, which
//!   batches of 4 and 3 sequences holding different numbers of them must add up to;
//! - the CNN with BatchNorm, SGD, `--bn-stats micro`: the eval model normalises with the
//!   running statistics the step moved, torch's micro-batch loop the reference.
//!
//! And what a user can get wrong is refused before training, with exit code 2.

use std::path::{Path, PathBuf};

use onnx_ga::data::Tensor;
use tempfile::TempDir;

use crate::common::{cli_rewrite, cli_train, onnx_ga_cli, ort_available, root};

#[derive(serde::Deserialize)]
struct Reference {
    losses: Vec<f64>,
    accuracies: Vec<f64>,
    rows: usize,
    steps: usize,
}

fn reference(model: &str) -> Reference {
    let path = root()
        .join("fixtures/forward")
        .join(model)
        .join("eval.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn forward(model: &str) -> PathBuf {
    root()
        .join("graphs/forward")
        .join(model)
        .join("dynamo.onnx")
}

/// (step, eval_loss, eval_rows) of every validation line of a metrics file.
fn validation_lines(metrics: &Path) -> Vec<(u64, f64, usize)> {
    validation_values(metrics)
        .into_iter()
        .map(|v| {
            let loss = v["eval_loss"].as_f64().unwrap_or(f64::NAN);
            (
                v["step"].as_u64().unwrap(),
                loss,
                v["eval_rows"].as_u64().unwrap() as usize,
            )
        })
        .collect()
}

/// Every validation line of a metrics file, as JSON.
fn validation_values(metrics: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("eval_loss").is_some())
        .collect()
}

/// `train STEP --data <MODEL's data> --micro-batch B --steps N --eval-data <MODEL's
/// validation rows> --eval-model <MODEL's forward export>`: what every validated run here
/// starts from.
fn validated_train(step: &Path, model: &str, micro_batch: &str, steps: &str) -> Vec<String> {
    let data = root().join("graphs/forward").join(model).join("data.npz");
    let eval_data = root()
        .join("fixtures/forward")
        .join(model)
        .join("eval_data.npz");
    let text = |p: &Path| p.to_str().unwrap().to_string();
    vec![
        "train".into(),
        text(step),
        "--data".into(),
        text(&data),
        "--micro-batch".into(),
        micro_batch.into(),
        "--steps".into(),
        steps.into(),
        "--eval-data".into(),
        text(&eval_data),
        "--eval-model".into(),
        text(&forward(model)),
    ]
}

/// The torch MLP's forward export rewritten into `dir`/step.onnx: cross-entropy, K = 4,
/// SGD, and `extra`.
fn mlp_sgd_step(dir: &Path, extra: &[&str]) -> PathBuf {
    let step = dir.join("step.onnx");
    let mut args = vec![
        "--loss-fn",
        "cross-entropy",
        "--accum-steps",
        "4",
        "--optimizer",
        "sgd",
    ];
    args.extend_from_slice(extra);
    cli_rewrite("forward/torch_mlp/dynamo.onnx", &step, &args);
    step
}

/// `onnx-ga ARGS`, which must succeed; its stderr.
fn succeeds(args: &[String]) -> String {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = onnx_ga_cli(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {stderr}");
    stderr
}

/// `rewrite` of the model's forward export with `rewrite`, then `train` over its data for
/// 8 windows of K = 4 micro-batches of `micro_batch`, evaluating after every window;
/// returns the validation lines.
fn train_with_validation(
    dir: &Path,
    model: &str,
    rewrite: &[&str],
    micro_batch: &str,
    extra: &[&str],
) -> Vec<(u64, f64, usize)> {
    let step = dir.join("step.onnx");
    let mut args = vec![
        "--loss-fn",
        "cross-entropy",
        "--ignore-index",
        "-100",
        "--accum-steps",
        "4",
    ];
    args.extend_from_slice(rewrite);
    cli_rewrite(&format!("forward/{model}/dynamo.onnx"), &step, &args);
    let metrics = dir.join("m.jsonl");
    let mut train = validated_train(&step, model, micro_batch, "32");
    let more = [
        "--eval-every",
        "1",
        "--metrics",
        metrics.to_str().unwrap(),
        "--quiet",
    ];
    train.extend(more.iter().chain(extra).map(|a| a.to_string()));
    succeeds(&train);
    // The accuracy, a share of counted labels, is torch's exactly.
    let want = reference(model);
    for (i, line) in validation_values(&metrics).iter().enumerate() {
        let got = line["eval_accuracy"]
            .as_f64()
            .expect("a classification's accuracy");
        assert_eq!(
            got,
            want.accuracies[i + 1],
            "{model}: accuracy after window {}",
            i + 1
        );
    }
    validation_lines(&metrics)
}

/// Every validation line against torch's loss after the same optimizer step.
fn assert_like_torch(model: &str, lines: &[(u64, f64, usize)], tolerance: f64) {
    let want = reference(model);
    assert_eq!(
        lines.len(),
        want.steps,
        "{model}: one validation per window"
    );
    let mut worst = 0f64;
    for (i, (step, got, rows)) in lines.iter().enumerate() {
        assert_eq!(
            *step,
            4 * (i as u64 + 1),
            "{model}: after each window's last micro-step"
        );
        assert_eq!(*rows, want.rows, "{model}: every row evaluated");
        let torch = want.losses[i + 1];
        let err = (got - torch).abs() / torch.abs();
        assert!(
            err <= tolerance,
            "{model}: validation after window {}: {got} vs torch {torch} ({err:e} relative)",
            i + 1
        );
        worst = worst.max(err);
    }
    // Training moved the validation loss: a report of the initial parameters would fail.
    let first = want.losses[0];
    let moved = want
        .losses
        .iter()
        .map(|l| (l - first).abs())
        .fold(0.0, f64::max);
    assert!(
        moved > 100.0 * tolerance * first,
        "{model}: moved {moved} from {first}"
    );
    eprintln!(
        "MEASURED {model}: validation loss {worst:e} relative from torch, worst of {}",
        lines.len()
    );
}

#[test]
fn mlp_validation_loss_is_torchs_eval_loss() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let lines = train_with_validation(
        dir.path(),
        "torch_mlp",
        &["--optimizer", "adamw", "--lr", "0.01"],
        "8",
        &[],
    );
    assert_like_torch("torch_mlp", &lines, 2e-6);
}

/// A model stored in half precision (torch_mlp after `.half()`): the eval model is the half
/// file, fed the step's float32 masters through Casts to half and float32 data, as the step
/// reads them; after every window its validation loss is what torch's half model computes
/// with the masters rounded to half (mixed precision by hand, `half_reference.py`), within
/// float16's rounding of the forward (ONNX Runtime's CPU provider computes its half Gemms in
/// float32), and the accuracy exactly.
#[test]
fn a_half_models_validation_loss_is_torchs() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let lines = train_with_validation(
        dir.path(),
        "torch_mlp_half",
        &["--optimizer", "sgd", "--lr", "0.1", "--loss-scale", "none"],
        "8",
        &[],
    );
    assert_like_torch("torch_mlp_half", &lines, 5e-5);
}

/// Padded labels: the mean over every counted label of the set, whatever batches hold
/// them (4 sequences at a time in training; 3 at a time here).
#[test]
fn gpt_validation_loss_counts_the_sets_labels_not_its_batches() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let rewrite = [
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--normalize",
        "weighted",
    ];
    let lines = train_with_validation(dir.path(), "torch_gpt", &rewrite, "4", &[]);
    assert_like_torch("torch_gpt", &lines, 2e-6);
    let dir = TempDir::new().unwrap();
    let threes = train_with_validation(
        dir.path(),
        "torch_gpt",
        &rewrite,
        "4",
        &["--eval-batch", "3"],
    );
    assert_like_torch("torch_gpt", &threes, 2e-6);
}

/// BatchNorm: the eval model normalises with the running statistics training moved
/// (at every micro-batch with `--bn-stats micro`, as torch's loop moves them).
#[test]
fn batch_norm_validation_uses_the_trained_running_statistics() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let rewrite = ["--optimizer", "sgd", "--lr", "0.1", "--bn-stats", "micro"];
    let lines = train_with_validation(dir.path(), "torch_cnn", &rewrite, "8", &[]);
    assert_like_torch("torch_cnn", &lines, 2e-6);
}

/// tract runs the eval model too (SoftmaxCrossEntropyLoss lowered for it).
#[test]
fn tract_reports_the_same_validation_loss() {
    let dir = TempDir::new().unwrap();
    let lines = train_with_validation(
        dir.path(),
        "torch_mlp",
        &["--optimizer", "adamw", "--lr", "0.01"],
        "8",
        &["--engine", "tract"],
    );
    assert_like_torch("torch_mlp", &lines, 2e-6);
}

/// A user's mistakes, refused before the first micro-step: exit 2, the file named,
/// nothing written.
#[test]
fn a_model_or_data_that_does_not_fit_is_refused_before_training() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let step = dir.path().join("step.onnx");
    cli_rewrite(
        "forward/torch_mlp/dynamo.onnx",
        &step,
        &[
            "--loss-fn",
            "cross-entropy",
            "--optimizer",
            "adamw",
            "--accum-steps",
            "4",
        ],
    );
    let data = root().join("graphs/forward/torch_mlp/data.npz");
    let metrics = dir.path().join("m.jsonl");
    let run = |eval_data: &Path, eval_model: &Path, extra: &[&str]| {
        let mut args = cli_train(
            &step,
            &data,
            "8",
            &[
                "--metrics",
                metrics.to_str().unwrap(),
                "--eval-data",
                eval_data.to_str().unwrap(),
                "--eval-model",
                eval_model.to_str().unwrap(),
            ],
        );
        args.extend_from_slice(extra);
        let out = onnx_ga_cli(&args);
        assert!(!metrics.exists(), "{args:?}: wrote the metrics");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let mlp_data = root().join("fixtures/forward/torch_mlp/eval_data.npz");
    // Another model: its parameters are not the step's.
    let (code, err) = run(&mlp_data, &forward("torch_gpt"), &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("dynamo.onnx") && err.contains("is it the model that was trained?"),
        "{err}"
    );
    // Another model's data: its labels are [rows, 8] token ids.
    let gpt_data = root().join("fixtures/forward/torch_gpt/eval_data.npz");
    let (code, err) = run(&gpt_data, &forward("torch_mlp"), &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("torch_gpt/eval_data.npz") && err.contains("'labels'"),
        "{err}"
    );
    // A step file is not a forward model.
    let (code, err) = run(&mlp_data, &step, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("step.onnx"), "{err}");
    for (flag, value) in [("--eval-every", "0"), ("--eval-batch", "0")] {
        let (code, err) = run(&mlp_data, &forward("torch_mlp"), &[flag, value]);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains(flag), "{err}");
    }
    // An eval model without validation data (--eval-data alone takes the model the step
    // records: the_step_records_its_eval_model_until_the_file_changes).
    let out = onnx_ga_cli(&[
        "train",
        step.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--micro-batch",
        "8",
        "--steps",
        "8",
        "--eval-model",
        forward("torch_mlp").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--eval-data"));
}

/// A step made from ONNX Runtime's artifacts: their eval_model.onnx (the loss inside, the
/// parameters as graph inputs) is the eval model. With nothing trained (`--steps 0`: the
/// validation of the initial state) its loss on the fixture's batch is the loss ONNX
/// Runtime's training build computed on it (fixtures/mlp_ce_adamw/grads.npz), in batches
/// of 3 rows weighted back to the batch's mean.
#[test]
fn an_artifacts_eval_model_reports_the_training_builds_loss() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let step = dir.path().join("step.onnx");
    cli_rewrite(
        "mlp_ce_adamw",
        &step,
        &["--accum-steps", "4", "--lr", "0.01"],
    );
    let fixture = crate::common::read_npz(&root().join("fixtures/mlp_ce_adamw/grads.npz"));
    let batch: Vec<(&str, &onnx_ga::data::Tensor)> = fixture
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("input/").map(|n| (n, v)))
        .collect();
    let data = dir.path().join("batch.npz");
    onnx_ga::data::write_npz(&data, batch.iter().copied()).unwrap();
    let eval_model = root().join("graphs/mlp_ce_adamw/eval_model.onnx");
    let metrics = dir.path().join("m.jsonl");
    let out = onnx_ga_cli(&[
        "train",
        step.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--micro-batch",
        "4",
        "--steps",
        "0",
        "--eval-data",
        data.to_str().unwrap(),
        "--eval-model",
        eval_model.to_str().unwrap(),
        "--eval-batch",
        "3",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("the model's own loss"), "{stderr}");
    let lines = validation_lines(&metrics);
    let want = match &fixture["loss"] {
        onnx_ga::data::Tensor::F32(a) => f64::from(*a.iter().next().unwrap()),
        other => panic!("loss {other:?}"),
    };
    let rows = fixture["input/labels"].shape()[0];
    assert_eq!(lines.len(), 1);
    let (step_no, got, evaluated) = lines[0];
    assert_eq!((step_no, evaluated), (0, rows));
    assert!(
        (got - want).abs() <= 1e-6 * want.abs(),
        "validation {got} vs ONNX Runtime's training build {want}"
    );
    eprintln!(
        "MEASURED artifacts eval model: {:e} relative from the training build",
        (got - want).abs() / want
    );
}

/// The CNN's validation losses after its 8 windows (eval.json; its rows' labels are
/// random, so training does not generalise to them) fall to window 2 and rise after it.
/// `--save-best` writes the state at each new lowest, its progress record holding the
/// loss; `--patience 1` stops at the first rise (micro-step 12), writing what the end
/// writes; a resume keeps the lowest its record holds, so a worse validation does not
/// replace the best state; a run from the start does.
#[test]
fn save_best_keeps_the_lowest_and_patience_stops_at_the_first_rise() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let step = d.join("step.onnx");
    cli_rewrite(
        "forward/torch_cnn/dynamo.onnx",
        &step,
        &[
            "--loss-fn",
            "cross-entropy",
            "--accum-steps",
            "4",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
            "--bn-stats",
            "micro",
        ],
    );
    let train = |steps: &str, extra: &[&str]| {
        let mut args = validated_train(&step, "torch_cnn", "8", steps);
        args.extend(
            ["--eval-every", "1"]
                .iter()
                .chain(extra)
                .map(|a| a.to_string()),
        );
        succeeds(&args)
    };
    let p = |name: &str| d.join(name);
    let s = |name: &str| p(name).to_str().unwrap().to_string();
    let record = |name: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(p(&format!("{name}.progress.json"))).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let last = |name: &str| {
        record(name)["checkpoints"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone()
    };
    let torch = reference("torch_cnn").losses;

    // The whole run: the lowest is after window 2 (micro-step 8); its state is the one a
    // run of 8 micro-steps ends with, bit for bit.
    train("32", &["--save-best", &s("best.npz")]);
    assert_eq!(last("best.npz")["micro_steps"], 8);
    let loss = last("best.npz")["eval_loss"].as_f64().unwrap();
    assert!(
        (loss - torch[2]).abs() <= 2e-6 * torch[2],
        "{loss} vs torch {}",
        torch[2]
    );
    train("8", &["--save-state", &s("s8.npz")]);
    assert_eq!(
        std::fs::read(p("best.npz")).unwrap(),
        std::fs::read(p("s8.npz")).unwrap()
    );

    // Patience 1: the rise at window 3 stops the run there, and the end's writes happen.
    let metrics = p("m.jsonl");
    let said = train(
        "32",
        &[
            "--patience",
            "1",
            "--save-state",
            &s("stopped.npz"),
            "--metrics",
            &s("m.jsonl"),
        ],
    );
    assert!(said.contains("early stop after micro-step 12"), "{said}");
    assert_eq!(last("stopped.npz")["micro_steps"], 12);
    let lines = validation_lines(&metrics);
    let steps: Vec<u64> = lines.iter().map(|l| l.0).collect();
    assert_eq!(steps, [4, 8, 12]);
    train("12", &["--save-state", &s("s12.npz")]);
    assert_eq!(
        std::fs::read(p("stopped.npz")).unwrap(),
        std::fs::read(p("s12.npz")).unwrap()
    );

    // A resume after window 2 (the lowest so far) through window 3 (a rise): the best
    // state stays the one after micro-step 8.
    train(
        "8",
        &["--save-state", &s("r.npz"), "--save-best", &s("rbest.npz")],
    );
    let before = std::fs::read(p("rbest.npz")).unwrap();
    let said = train(
        "4",
        &[
            "--init-state",
            &s("r.npz"),
            "--save-state",
            &s("r.npz"),
            "--save-best",
            &s("rbest.npz"),
        ],
    );
    assert!(said.contains("the lowest so far is 1.3493"), "{said}");
    assert_eq!(last("rbest.npz")["micro_steps"], 8);
    assert_eq!(std::fs::read(p("rbest.npz")).unwrap(), before);
    // A run from the start is new training: its first validation is its lowest.
    train("4", &["--save-best", &s("rbest.npz")]);
    assert_eq!(last("rbest.npz")["micro_steps"], 4);
}

/// `--save-best` is an output like the others: not an input, not another output.
#[test]
fn save_best_refuses_to_overwrite_an_input_or_another_output() {
    let dir = TempDir::new().unwrap();
    let step = mlp_sgd_step(dir.path(), &[]);
    let eval_data = root().join("fixtures/forward/torch_mlp/eval_data.npz");
    let state = dir.path().join("s.npz");
    for (best, what) in [
        (eval_data.clone(), "validation data"),
        (state.clone(), "--save-state"),
        (dir.path().join("b.txt"), ".npz or .safetensors"),
    ] {
        let mut args = validated_train(&step, "torch_mlp", "8", "4");
        for a in [
            "--save-state",
            state.to_str().unwrap(),
            "--save-best",
            best.to_str().unwrap(),
        ] {
            args.push(a.to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = onnx_ga_cli(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("--save-best") && err.contains(what), "{err}");
        assert!(!state.exists());
    }
}

/// Validation data holding NaN (rows 5 and 12-13 of 20): the validation loss is NaN, and
/// train says once why (the file, the array, the rows), that `--save-best` writes only
/// after a finite loss, and at the end that it was not written. It used to end without
/// the file and without a word.
#[test]
fn a_non_finite_validation_loss_names_its_rows_and_the_unwritten_best() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let step = mlp_sgd_step(d, &[]);
    let clean = root().join("fixtures/forward/torch_mlp/eval_data.npz");
    let mut data = onnx_ga::data::read_npz(&clean).unwrap();
    let input = data.keys().find(|k| *k != "labels").unwrap().clone();
    let Some(Tensor::F32(x)) = data.get_mut(&input) else {
        panic!("{input}: float32")
    };
    assert_eq!(x.shape()[0], 20);
    for (row, value) in [(5, f32::NAN), (12, f32::INFINITY), (13, f32::NAN)] {
        x[[row, 1]] = value;
    }
    let bad = d.join("bad_eval.npz");
    onnx_ga::data::write_npz(&bad, data.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    let best = d.join("best.npz");
    let mut args = validated_train(&step, "torch_mlp", "8", "8");
    let at = args.iter().position(|a| a == "--eval-data").unwrap() + 1;
    args[at] = bad.to_str().unwrap().to_string();
    args.extend(["--eval-every", "1", "--save-best", best.to_str().unwrap()].map(String::from));
    let err = succeeds(&args);
    let why = format!(
        "validation: the loss is NaN: {} holds NaN or inf: '{input}' at rows 5, 12-13; --save-best writes {} only after a finite validation loss",
        bad.display(),
        best.display()
    );
    assert_eq!(err.matches(&why).count(), 1, "said once: {err}");
    assert!(
        err.contains(&format!(
            "--save-best {}: not written: no validation loss was finite",
            best.display()
        )),
        "{err}"
    );
    assert!(!best.exists());
}

/// `--ignore-index` naming a class: those labels count neither in the loss nor in the
/// accuracy, even where the model predicts that class. The class is one the untrained
/// model predicts right on some row, so counting ignored labels would change the accuracy.
/// Checked on the untrained step (`--steps 0`) against the forward model's logits from
/// ONNX Runtime, the loss and the accuracy computed here in float64.
#[test]
fn an_ignored_class_counts_in_neither_loss_nor_accuracy() {
    if !ort_available() {
        return;
    }
    let eval_data = root().join("fixtures/forward/torch_mlp/eval_data.npz");
    let data = crate::common::read_npz(&eval_data);
    let inputs = data
        .iter()
        .filter(|(k, _)| *k == "x")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let model = onnx_ga::model::load_model(&forward("torch_mlp")).unwrap();
    let logits = &crate::common::run_ort(&model, &inputs)["logits"];
    let (Tensor::F32(logits), Tensor::I64(labels)) = (logits, &data["labels"]) else {
        panic!("types")
    };
    let rows: Vec<Vec<f64>> = logits
        .outer_iter()
        .map(|r| r.iter().map(|v| f64::from(*v)).collect())
        .collect();
    let argmax =
        |row: &[f64]| (0..row.len()).fold(0, |b, c| if row[c] > row[b] { c } else { b }) as i64;
    let ignored = rows
        .iter()
        .zip(labels.iter())
        .find(|(row, label)| argmax(row) == **label)
        .map(|(_, label)| *label)
        .expect("a row the untrained model gets right");
    let (mut loss, mut hits, mut counted) = (0f64, 0usize, 0usize);
    for (row, &label) in rows.iter().zip(labels.iter()) {
        if label == ignored {
            continue;
        }
        let max = row.iter().cloned().fold(f64::MIN, f64::max);
        let log_sum = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss += log_sum - row[label as usize];
        hits += usize::from(argmax(row) == label);
        counted += 1;
    }

    let dir = TempDir::new().unwrap();
    let ignore = ignored.to_string();
    let step = mlp_sgd_step(dir.path(), &["--ignore-index", &ignore]);
    let metrics = dir.path().join("m.jsonl");
    let mut args = validated_train(&step, "torch_mlp", "8", "0");
    for a in ["--eval-batch", "3", "--metrics", metrics.to_str().unwrap()] {
        args.push(a.into());
    }
    succeeds(&args);
    let line = &validation_values(&metrics)[0];
    let got = line["eval_loss"].as_f64().unwrap();
    let want = loss / counted as f64;
    assert!((got - want).abs() <= 1e-6 * want, "loss {got} vs {want}");
    let accuracy = line["eval_accuracy"].as_f64().unwrap();
    assert_eq!(
        accuracy,
        hits as f64 / counted as f64,
        "class {ignored} ignored"
    );
    eprintln!(
        "MEASURED ignored class {ignored}: loss {:e} relative; {hits} of {counted} right",
        (got - want).abs() / want
    );
}

/// An eval model whose batch axis is fixed (8 rows, as some exporters write it): batches of
/// that size, the rows past the last whole batch left out with a note (20 rows: 16 used),
/// the loss that of those 16 rows through the model with a free batch axis; another
/// `--eval-batch` is refused.
#[test]
fn a_fixed_batch_eval_model_takes_whole_batches() {
    if !ort_available() {
        return;
    }
    use onnx_ga::proto::tensor_shape_proto::dimension::Value as Dim;
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let step = mlp_sgd_step(d, &[]);
    let mut fixed = onnx_ga::model::load_model(&forward("torch_mlp")).unwrap();
    let graph = fixed.graph.as_mut().unwrap();
    for value in graph.input.iter_mut().chain(graph.output.iter_mut()) {
        let Some(onnx_ga::proto::type_proto::Value::TensorType(t)) =
            value.r#type.as_mut().and_then(|t| t.value.as_mut())
        else {
            continue;
        };
        if let Some(first) = t.shape.as_mut().and_then(|s| s.dim.first_mut()) {
            first.value = Some(Dim::DimValue(8));
        }
    }
    let fixed_path = d.join("fixed.onnx");
    onnx_ga::model::save_model(&fixed, &fixed_path).unwrap();
    let all = crate::common::read_npz(&root().join("fixtures/forward/torch_mlp/eval_data.npz"));
    let first16: Vec<(String, Tensor)> = all
        .iter()
        .map(|(k, v)| (k.clone(), v.rows(&(0..16).collect::<Vec<_>>())))
        .collect();
    let first16_path = d.join("first16.npz");
    onnx_ga::data::write_npz(&first16_path, first16.iter().map(|(k, v)| (k.as_str(), v))).unwrap();

    let run = |eval_model: &Path, eval_data: &Path, name: &str, extra: &[&str]| {
        let metrics = d.join(name);
        let mut args = validated_train(&step, "torch_mlp", "8", "8");
        let (model_at, data_at) = (
            args.iter().position(|a| a == "--eval-model").unwrap() + 1,
            args.iter().position(|a| a == "--eval-data").unwrap() + 1,
        );
        args[model_at] = eval_model.to_str().unwrap().into();
        args[data_at] = eval_data.to_str().unwrap().into();
        args.extend(["--metrics", metrics.to_str().unwrap()].map(String::from));
        args.extend(extra.iter().map(|a| a.to_string()));
        let args_ref: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = onnx_ga_cli(&args_ref);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr, metrics)
    };
    let eval_data = root().join("fixtures/forward/torch_mlp/eval_data.npz");
    let (code, said, metrics) = run(&fixed_path, &eval_data, "fixed.jsonl", &[]);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("the last 4 of 20 rows are left out"),
        "{said}"
    );
    let fixed_line = validation_lines(&metrics)[0];
    assert_eq!(fixed_line.2, 16);
    let (code, said, metrics) = run(
        &forward("torch_mlp"),
        &first16_path,
        "free.jsonl",
        &["--eval-batch", "5"],
    );
    assert_eq!(code, Some(0), "{said}");
    let free_line = validation_lines(&metrics)[0];
    assert!(
        (fixed_line.1 - free_line.1).abs() <= 1e-6 * free_line.1,
        "{fixed_line:?} vs {free_line:?}"
    );
    let (code, said, _) = run(
        &fixed_path,
        &eval_data,
        "refused.jsonl",
        &["--eval-batch", "4"],
    );
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("--eval-batch 4") && said.contains("batch of 8"),
        "{said}"
    );
}

/// An eval model saved with external data (every initializer in `w.npz` beside it, a name
/// an output flag could take): it evaluates as the one-file model does, and no output may
/// overwrite its data file. Each flag naming it is refused before training, the file
/// unchanged.
#[test]
fn an_eval_model_with_external_data_evaluates_alike_and_its_data_is_never_overwritten() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let step = mlp_sgd_step(d, &[]);
    let proto = onnx_ga::model::load_model_with_data(&forward("torch_mlp")).unwrap();
    let eval_model = d.join("eval.onnx");
    onnx_ga::model::save_model_with_external_data(&proto, &eval_model, "w.npz", 0).unwrap();
    let weights = d.join("w.npz");
    let before = std::fs::read(&weights).unwrap();

    let metrics = |name: &str, model: &Path| {
        let m = d.join(name);
        let mut args = validated_train(&step, "torch_mlp", "8", "8");
        args.extend(["--eval-every", "1", "--metrics"].map(String::from));
        args.push(m.to_str().unwrap().into());
        let last = args.iter().position(|a| a == "--eval-model").unwrap() + 1;
        args[last] = model.to_str().unwrap().into();
        succeeds(&args);
        validation_values(&m)
    };
    let one_file = metrics("one.jsonl", &forward("torch_mlp"));
    let external = metrics("ext.jsonl", &eval_model);
    assert_eq!(one_file.len(), 2, "after each window: {one_file:?}");
    assert_eq!(external, one_file, "the same validations, bit for bit");

    for flag in ["--metrics", "--save-state", "--save-best"] {
        let mut args = validated_train(&step, "torch_mlp", "8", "4");
        let last = args.iter().position(|a| a == "--eval-model").unwrap() + 1;
        args[last] = eval_model.to_str().unwrap().into();
        args.push(flag.into());
        args.push(weights.to_str().unwrap().into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = onnx_ga_cli(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(
            err.contains("refusing to overwrite the eval model's external data")
                && err.contains(flag),
            "{flag}: {err}"
        );
        assert_eq!(std::fs::read(&weights).unwrap(), before, "{flag}");
    }
}

/// `--eval-data` alone: the step records the model `rewrite` read (a forward model, or the
/// artifacts' eval_model.onnx) by path and SHA-256, and `train` validates with it, as with
/// `--eval-model` naming it, while the file is the one that was read. Changed or gone, it
/// is refused (exit code 2, naming it and --eval-model); a step without a record likewise.
#[test]
fn the_step_records_its_eval_model_until_the_file_changes() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let model = d.join("model.onnx");
    std::fs::copy(forward("torch_mlp"), &model).unwrap();
    let step = d.join("step.onnx");
    let out = onnx_ga_cli(&[
        "rewrite",
        model.to_str().unwrap(),
        "-o",
        step.to_str().unwrap(),
        "--loss-fn",
        "cross-entropy",
        "--accum-steps",
        "4",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = |name: &str, eval_model: Option<&Path>| {
        let metrics = d.join(name);
        let mut args = validated_train(&step, "torch_mlp", "8", "8");
        let at = args.iter().position(|a| a == "--eval-model").unwrap();
        match eval_model {
            Some(m) => args[at + 1] = m.to_str().unwrap().into(),
            None => {
                args.drain(at..at + 2);
            }
        }
        args.extend(["--eval-every", "1", "--metrics"].map(String::from));
        args.push(metrics.to_str().unwrap().into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = onnx_ga_cli(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr, metrics)
    };
    let (code, _, given) = run("given.jsonl", Some(&model));
    assert_eq!(code, Some(0));
    let (code, stderr, recorded) = run("recorded.jsonl", None);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("the model `rewrite` read"), "{stderr}");
    assert_eq!(validation_values(&recorded), validation_values(&given));
    assert_eq!(validation_values(&recorded).len(), 2);

    // Another model in its place: not the one that was read.
    std::fs::copy(forward("torch_cnn_nobn"), &model).unwrap();
    let (code, stderr, _) = run("changed.jsonl", None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("changed since") && stderr.contains("--eval-model"),
        "{stderr}"
    );
    std::fs::remove_file(&model).unwrap();
    let (code, stderr, _) = run("gone.jsonl", None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("cannot be read") && stderr.contains("model.onnx"),
        "{stderr}"
    );

    // Artifacts: their eval_model.onnx, where the training build's loss is the reference
    // (an_artifacts_eval_model_reports_the_training_builds_loss).
    let art = d.join("art");
    std::fs::create_dir(&art).unwrap();
    for f in std::fs::read_dir(root().join("graphs/mlp_ce_adamw"))
        .unwrap()
        .flatten()
    {
        if f.file_type().unwrap().is_file() {
            std::fs::copy(f.path(), art.join(f.file_name())).unwrap();
        }
    }
    let art_step = d.join("art_step.onnx");
    let out = onnx_ga_cli(&[
        "rewrite",
        art.to_str().unwrap(),
        "-o",
        art_step.to_str().unwrap(),
        "--accum-steps",
        "4",
        "--lr",
        "0.01",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let data = art.join("data.npz");
    // `--eval-data` alone, on the artifacts' data.
    let validate = |step: &Path| {
        onnx_ga_cli(&cli_train(
            step,
            &data,
            "4",
            &["--eval-data", data.to_str().unwrap()],
        ))
    };
    let out = validate(&art_step);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("eval_model.onnx, the model `rewrite` read"),
        "{stderr}"
    );

    // A step with no record (a plain gradient graph's).
    let bare = d.join("bare.onnx");
    let mut proto = onnx_ga::model::load_model(&art_step).unwrap();
    proto
        .metadata_props
        .retain(|p| p.key() != onnx_ga::eval_model::EVAL_MODEL_KEY);
    onnx_ga::model::save_model(&proto, &bare).unwrap();
    let out = validate(&bare);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("records no eval model"), "{stderr}");
}
