//! The learning-rate schedule of `train --warmup W --decay linear|cosine --decay-steps T
//! --min-lr M` (`onnx_ga::lr_schedule`): its rates against PyTorch's own schedulers
//! (fixtures/lr_schedule/torch.json, from fixtures/lr_schedule/generate.py), and `train`
//! applying them window by window, across a resume, like a host setting each window's rate.

use std::collections::BTreeMap;
use std::path::Path;

use onnx_ga::data::Tensor;
use onnx_ga::lr_schedule::{Decay, LrSchedule};
use onnx_ga::train::{micro_batch, Trainer};
use tempfile::TempDir;

use crate::common::{cli_rewritten, cli_train, ort_available, read_npz, root};

#[derive(serde::Deserialize)]
struct TorchCase {
    lr: f64,
    warmup: u64,
    decay: String,
    decay_steps: Option<u64>,
    min_lr: f64,
    rates: Vec<f64>,
}

fn decay(name: &str) -> Decay {
    match name {
        "none" => Decay::None,
        "linear" => Decay::Linear,
        "cosine" => Decay::Cosine,
        other => panic!("decay {other}"),
    }
}

/// Warm-up, then linear or cosine decay, as torch's LinearLR, CosineAnnealingLR and
/// SequentialLR give them, to float32 rounding. Past T, torch's cosine rises again
/// (CosineAnnealingLR is periodic); `train` holds the minimum.
#[test]
fn the_rates_are_pytorchs_schedulers() {
    let path = root().join("fixtures/lr_schedule/torch.json");
    let cases: Vec<TorchCase> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let schedule = LrSchedule::new(
            case.lr,
            case.warmup,
            decay(&case.decay),
            case.decay_steps,
            case.min_lr,
        )
        .unwrap();
        for (w, want) in case.rates.iter().enumerate() {
            let got = schedule.at(w as u64) as f64;
            let past_end = case.decay == "cosine" && w as u64 > case.decay_steps.unwrap();
            let want = if past_end { case.min_lr } else { *want };
            assert!(
                (got - want).abs() <= 1e-7 * want.abs() + 1e-12,
                "{} warm-up {}: step {w}: {got} vs torch {want}",
                case.decay,
                case.warmup
            );
        }
    }
}

#[test]
fn schedules_that_cannot_be_are_refused() {
    let refused =
        |warmup, decay, steps, min| LrSchedule::new(0.01, warmup, decay, steps, min).unwrap_err();
    assert!(refused(0, Decay::Cosine, None, 0.0).contains("needs --decay-steps"));
    assert!(refused(0, Decay::None, Some(5), 0.0).contains("without --decay"));
    assert!(refused(5, Decay::Linear, Some(5), 0.0).contains("after the warm-up"));
    assert!(refused(0, Decay::Linear, Some(5), 0.02).contains("--min-lr 0.02 must not exceed"));
    assert!(refused(0, Decay::Linear, Some(5), -1.0).contains("--min-lr -1"));
    // And from the command line: exit code 2, the flag named, nothing trained.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(cli_train(
            &root().join("graphs/mlp_ce_adamw/training_model.onnx"),
            &root().join("graphs/mlp_ce_adamw/data.npz"),
            "8",
            &["--decay", "cosine"],
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--decay linear|cosine needs --decay-steps T"),
        "{err}"
    );
}

/// The closed form, written out here: warm-up 2, cosine to 0.001 at optimizer step 5, from
/// the step's 0.01 (a float32).
fn rate(window: u64) -> f32 {
    // The step holds its rate as float32: the schedule starts from that value.
    let (base, min, warmup, end) = (0.01f32 as f64, 0.001f64, 2u64, 5u64);
    if window < warmup {
        return (base * (window + 1) as f64 / warmup as f64) as f32;
    }
    let p = ((window - warmup) as f64 / (end - warmup) as f64).min(1.0);
    let f = (1.0 + (std::f64::consts::PI * p).cos()) / 2.0;
    (min + (base - min) * f) as f32
}

const SCHEDULE: [&str; 8] = [
    "--warmup",
    "2",
    "--decay",
    "cosine",
    "--decay-steps",
    "5",
    "--min-lr",
    "0.001",
];

fn run(args: &[&str]) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "onnx-ga {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// 7 windows of K = 4 (cosine to the minimum and past it): `train` equals a host setting
/// each window's rate on the library's trainer, reports the rate of every micro-step, and a
/// run resumed after 3 windows continues the schedule to the same state.
#[test]
fn train_sets_each_windows_rate_and_a_resume_continues_the_schedule() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let step = cli_rewritten(d, "step.onnx", &[]);
    let data_file = root().join("graphs/mlp_ce_adamw/data.npz");
    let path = |name: &str| d.join(name).to_str().unwrap().to_string();

    let (state, metrics) = (path("scheduled.npz"), path("scheduled.jsonl"));
    run(&[
        cli_train(&step, &data_file, "28", &["--quiet"]),
        SCHEDULE.to_vec(),
        vec!["--save-state", &state, "--metrics", &metrics],
    ]
    .concat());
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 28);
    for (g, line) in lines.iter().enumerate() {
        let want = rate(g as u64 / 4);
        let got = line["lr"].as_f64().map(|v| v as f32);
        assert_eq!(got, Some(want), "micro-step {}", g + 1);
    }

    // The host's way: the library's trainer, each window's rate set before its micro-steps.
    let model = onnx_ga::model::load_model(&step).unwrap();
    let mut trainer = Trainer::new(&model, &Default::default()).unwrap();
    let data = read_npz(&data_file);
    let samples = trainer.check_data(&data, Path::new("data.npz")).unwrap();
    for g in 0..28 {
        trainer.set_learning_rate(rate(g / 4)).unwrap();
        trainer
            .step(&micro_batch(&data, samples, 8, g), false)
            .unwrap();
    }
    let by_host = d.join("by_host.npz");
    trainer.save_state(&by_host).unwrap();
    let (cli, host): (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>) =
        (read_npz(Path::new(&state)), read_npz(&by_host));
    assert_eq!(cli, host, "train and the host's schedule differ");

    // Without the schedule the run ends elsewhere (the test can tell).
    let constant = path("constant.npz");
    run(&[
        cli_train(&step, &data_file, "28", &["--quiet"]),
        vec!["--save-state", &constant],
    ]
    .concat());
    assert_ne!(read_npz(Path::new(&constant)), cli);

    // Resumed after 3 windows: the schedule goes on from optimizer step 3.
    let resumed = path("resumed.npz");
    let first = [
        cli_train(&step, &data_file, "12", &["--quiet"]),
        SCHEDULE.to_vec(),
    ]
    .concat();
    run(&[first, vec!["--save-state", &resumed]].concat());
    let rest = [
        cli_train(&step, &data_file, "16", &["--quiet"]),
        SCHEDULE.to_vec(),
    ]
    .concat();
    run(&[
        rest,
        vec!["--init-state", &resumed, "--save-state", &resumed],
    ]
    .concat());
    assert_eq!(
        read_npz(Path::new(&resumed)),
        cli,
        "the resumed run differs"
    );
}
