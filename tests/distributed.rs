//! `train --distributed mpi` as a user runs it: `mpirun -n 2` on this machine (loopback),
//! against one process training the same step file (`train` without --distributed, the
//! reference: a different code path, the step's own apply specialisation).
//!
//! Needs Open MPI's `mpirun` and a build with the cargo feature `mpi`
//! (`scripts/test.sh` installs the one and passes the other). Without them the tests skip,
//! except under CI=true, where they fail.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::root;
use onnx_ga::data::Tensor;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .expect("run onnx-ga")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn on_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// `mpirun`, when this machine has it and this build has MPI; under CI=true their absence
/// fails the test.
fn mpirun() -> Option<PathBuf> {
    if !common::ort_available() {
        return None;
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("mpirun"))
            .find(|p| p.is_file())
    });
    let missing = match (&found, onnx_ga::distributed::HAS_MPI) {
        (None, _) => "mpirun is not on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)",
        (_, false) => "this build has no MPI (cargo test --features mpi)",
        (Some(_), true) => return found,
    };
    if on_ci() {
        panic!("the distributed tests must run under CI=true, but {missing}");
    }
    eprintln!("SKIPPED: {missing} (set CI=true to make this a failure)");
    None
}

/// `mpirun -n ranks onnx-ga ARGS`: as root, on loopback, more ranks than cores allowed.
fn mpi_command(mpirun: &Path, ranks: usize, args: &[&str]) -> Command {
    let mut c = Command::new(mpirun);
    // Loopback only: no interface of the machine's network is probed or used.
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args([
        "--mca",
        "btl_tcp_if_include",
        "lo",
        "--mca",
        "oob_tcp_if_include",
        "lo",
    ])
    .args(["-n", &ranks.to_string()])
    .arg(env!("CARGO_BIN_EXE_onnx-ga"))
    .args(args);
    c
}

fn mpi(mpirun: &Path, ranks: usize, args: &[&str]) -> Output {
    mpi_command(mpirun, ranks, args)
        .output()
        .expect("run mpirun")
}

/// `graphs/GRAPH` rewritten with K=4 and `extra` flags.
fn rewritten(dir: &Path, name: &str, graph: &str, extra: &[&str]) -> PathBuf {
    let step = dir.join(format!("{name}.onnx"));
    let mut args = vec!["--accum-steps", "4"];
    args.extend_from_slice(extra);
    common::cli_rewrite(graph, &step, &args);
    step
}

fn train_args<'a>(
    step: &'a Path,
    data: &'a Path,
    steps: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        s(step),
        "--data",
        s(data),
        "--micro-batch",
        "4",
        "--steps",
        steps,
        "--quiet",
    ];
    args.extend_from_slice(extra);
    args
}

fn read_state(path: &Path) -> BTreeMap<String, Tensor> {
    onnx_ga::data::read_npz(path).unwrap_or_else(|e| panic!("{e}"))
}

/// The largest relative difference over the state's float tensors: max |a - b| over
/// max |b| per tensor (a zero tensor must be matched exactly).
fn worst_relative(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> (f64, String) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "state names"
    );
    let mut worst = (0.0f64, String::new());
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.shape(), y.shape(), "{name}: shape");
        let rel = match (x, y) {
            (Tensor::F32(x), Tensor::F32(y)) => {
                let diff = x
                    .iter()
                    .zip(y.iter())
                    .map(|(p, q)| (*p as f64 - *q as f64).abs())
                    .fold(0.0, f64::max);
                let scale = y.iter().map(|q| (*q as f64).abs()).fold(0.0, f64::max);
                match scale > 0.0 {
                    true => diff / scale,
                    false if diff == 0.0 => 0.0,
                    false => f64::INFINITY,
                }
            }
            (Tensor::I64(x), Tensor::I64(y)) => {
                assert_eq!(x, y, "{name}");
                0.0
            }
            _ => 0.0,
        };
        if rel > worst.0 || rel.is_nan() {
            worst = (rel, name.clone());
        }
    }
    worst
}

fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Trains `step` for 8 windows (32 micro-steps of 4) on one process and on 2 ranks (and
/// on 1 rank of `--distributed`), and checks the states and the losses.
fn two_ranks_equal_one(
    mpirun: &Path,
    dir: &Path,
    step: &Path,
    data: &Path,
    tol: f64,
) -> Vec<serde_json::Value> {
    ranks_equal_one_training(mpirun, dir, step, data, tol, &[])
}

/// [`two_ranks_equal_one`] with `extra` flags for every `train`.
fn ranks_equal_one_training(
    mpirun: &Path,
    dir: &Path,
    step: &Path,
    data: &Path,
    tol: f64,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    let tag = step.file_stem().unwrap().to_str().unwrap();
    let one = dir.join(format!("{tag}.one.npz"));
    let one_metrics = dir.join(format!("{tag}.one.jsonl"));
    let mut flags = vec!["--save-state", s(&one), "--metrics", s(&one_metrics)];
    flags.extend_from_slice(extra);
    let out = onnx_ga(&train_args(step, data, "32", &flags));
    assert!(out.status.success(), "{tag}: one process: {}", stderr(&out));
    let mut results = Vec::new();
    for ranks in [1, 2] {
        let state = dir.join(format!("{tag}.r{ranks}.npz"));
        let m = dir.join(format!("{tag}.r{ranks}.jsonl"));
        let out = mpi(
            mpirun,
            ranks,
            &train_args(
                step,
                data,
                "32",
                &[
                    &[
                        "--distributed",
                        "mpi",
                        "--save-state",
                        s(&state),
                        "--metrics",
                        s(&m),
                    ],
                    extra,
                ]
                .concat(),
            ),
        );
        assert!(
            out.status.success(),
            "{tag}: {ranks} ranks: {}",
            stderr(&out)
        );
        let (rel, name) = worst_relative(&read_state(&state), &read_state(&one));
        eprintln!("{tag}: {ranks} rank(s) vs one process after 8 windows: worst relative difference {rel:.3e} ({name})");
        match ranks {
            // One rank sums in the same order as one process: the same bits.
            1 => assert_eq!(
                rel, 0.0,
                "{tag}: 1 rank differs from one process at '{name}'"
            ),
            _ => assert!(
                rel <= tol,
                "{tag}: {ranks} ranks: '{name}' differs by {rel:e} relative"
            ),
        }
        let (a, b) = (metrics(&m), metrics(&one_metrics));
        assert_eq!(a.len(), 32, "{tag}: metrics lines");
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x["step"], y["step"]);
            assert_eq!(
                x["applied"], y["applied"],
                "{tag}: applied at {}",
                x["step"]
            );
            assert_eq!(
                x["skipped"], y["skipped"],
                "{tag}: skipped at {}",
                x["step"]
            );
            // A non-finite loss is written as null, by both.
            let (Some(p), Some(q)) = (x["loss"].as_f64(), y["loss"].as_f64()) else {
                assert_eq!(x["loss"], y["loss"], "{tag}: loss at {}", x["step"]);
                continue;
            };
            assert!(
                (p - q).abs() <= tol * q.abs().max(1e-3),
                "{tag}: loss at {}: {p} vs {q}",
                x["step"]
            );
        }
        results = a;
    }
    results
}

fn data(graph: &str) -> PathBuf {
    root().join("graphs").join(graph).join("data.npz")
}

/// SGD and AdamW, mean and weighted normalisation, AGC, clipping by the global norm: 2 ranks
/// x 2 micro-steps per window equal 1 process x 4 after 8 windows within 1e-6 relative (the
/// order of the sum is the only difference; 1 rank is bit-identical).
#[test]
fn two_ranks_train_like_one_process() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases = [
        ("sgd_mean", "mlp_mse_sgd", vec!["--lr", "0.05"]),
        ("adamw_mean", "mlp_ce_adamw", vec!["--lr", "0.01"]),
        (
            "adamw_weighted",
            "mlp_ce_adamw",
            vec!["--lr", "0.01", "--normalize", "weighted"],
        ),
        (
            "adamw_agc",
            "mlp_ce_adamw",
            vec!["--lr", "0.05", "--agc", "0.01"],
        ),
        ("transformer", "transformer_block", vec!["--lr", "0.01"]),
        (
            "adamw_clip_norm",
            "mlp_ce_adamw",
            vec!["--lr", "0.01", "--clip-norm", "0.05"],
        ),
    ];
    for (name, graph, flags) in cases {
        let step = rewritten(d, name, graph, &flags);
        two_ranks_equal_one(&mpirun, d, &step, &data(graph), 1e-6);
    }
}

/// `--shuffle`: every rank takes the rows of its global micro-steps in the shuffled order,
/// so two ranks still train like one process (32 micro-steps of 4 over 64 rows: 2 epochs,
/// each in its own order).
#[test]
fn shuffled_rows_on_two_ranks_train_like_one_process() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "adamw_shuffled", "mlp_ce_adamw", &["--lr", "0.01"]);
    let data = data("mlp_ce_adamw");
    let shuffled = ranks_equal_one_training(&mpirun, d, &step, &data, 1e-6, &["--shuffle", "5"]);
    // And the order is not the unshuffled one: the losses differ.
    let step = rewritten(d, "adamw_in_order", "mlp_ce_adamw", &["--lr", "0.01"]);
    let in_order = two_ranks_equal_one(&mpirun, d, &step, &data, 1e-6);
    assert_ne!(
        shuffled
            .iter()
            .map(|m| m["loss"].clone())
            .collect::<Vec<_>>(),
        in_order
            .iter()
            .map(|m| m["loss"].clone())
            .collect::<Vec<_>>()
    );
}

/// A learning-rate schedule: every rank sets each window's rate, as one process does.
#[test]
fn a_learning_rate_schedule_on_two_ranks_trains_like_one_process() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "adamw_scheduled", "mlp_ce_adamw", &["--lr", "0.01"]);
    let schedule = [
        "--warmup",
        "2",
        "--decay",
        "linear",
        "--decay-steps",
        "6",
        "--min-lr",
        "0.001",
    ];
    let m = ranks_equal_one_training(&mpirun, d, &step, &data("mlp_ce_adamw"), 1e-6, &schedule);
    let rates: Vec<f64> = m.iter().map(|m| m["lr"].as_f64().unwrap()).collect();
    // Windows of 4: 0.005, 0.01, 0.01, then down by 0.00225 a window to 0.001.
    let want = [0.005, 0.01, 0.01, 0.00775, 0.0055, 0.00325, 0.001, 0.001];
    for (g, rate) in rates.iter().enumerate() {
        let w = want[g / 4];
        assert!(
            (rate - w).abs() < 1e-9,
            "micro-step {}: {rate} vs {w}",
            g + 1
        );
    }
}

/// BatchNorm with window statistics (bn_stats=window): the running statistics move once
/// per window from the statistics pooled over both ranks. (SGD: AdamW would amplify the
/// rounding noise that is the whole gradient of the conv bias in front of the BatchNorm.)
/// Per-micro-step statistics would differ per rank and are refused.
#[test]
fn batchnorm_window_statistics_pool_over_the_ranks() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "bn", "cnn_bn", &["--lr", "0.05", "--optimizer", "sgd"]);
    two_ranks_equal_one(&mpirun, d, &step, &data("cnn_bn"), 1e-6);
    let one = read_state(&d.join("bn.one.npz"));
    let initial = onnx_ga::model::load_model(&step).unwrap();
    let init = initial
        .graph
        .as_ref()
        .unwrap()
        .initializer
        .iter()
        .find(|t| t.name() == "bn.running_mean")
        .map(|t| Tensor::from_tensor_proto(t).unwrap())
        .unwrap();
    assert_ne!(one["bn.running_mean"], init, "the running statistics moved");

    let micro = rewritten(
        d,
        "bn_micro",
        "cnn_bn",
        &["--lr", "0.05", "--bn-stats", "micro"],
    );
    let out = mpi(
        &mpirun,
        2,
        &train_args(&micro, &data("cnn_bn"), "8", &["--distributed", "mpi"]),
    );
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("bn.running_mean") && err.contains("--bn-stats window"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// The shipped data with NaN in the rows of global micro-batch `i` (of 4 rows).
fn poisoned(dir: &Path, graph: &str, i: usize) -> PathBuf {
    poisoned_batches(dir, graph, &[i])
}

/// The shipped data with NaN in the rows of global micro-batches `batches` (of 4 rows).
fn poisoned_batches(dir: &Path, graph: &str, batches: &[usize]) -> PathBuf {
    let mut d = onnx_ga::data::read_npz(&data(graph)).unwrap();
    let Some(Tensor::F32(x)) = d.get_mut("input") else {
        panic!("input")
    };
    for i in batches {
        for row in 4 * i..4 * i + 4 {
            x[[row, 0]] = f32::NAN;
        }
    }
    let tag: Vec<String> = batches.iter().map(|i| i.to_string()).collect();
    let path = dir.join(format!("{graph}.poisoned{}.npz", tag.join("_")));
    onnx_ga::data::write_npz(&path, d.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    path
}

/// The shipped data without the rows of global micro-batch `i` (of 4 rows).
fn without_batch(dir: &Path, graph: &str, i: usize) -> PathBuf {
    let d = onnx_ga::data::read_npz(&data(graph)).unwrap();
    let kept: Vec<usize> = (0..d["input"].shape()[0])
        .filter(|row| row / 4 != i)
        .collect();
    let d: BTreeMap<String, Tensor> = d
        .into_iter()
        .map(|(name, t)| {
            let t = match t {
                Tensor::F32(a) => Tensor::F32(a.select(ndarray::Axis(0), &kept)),
                Tensor::I64(a) => Tensor::I64(a.select(ndarray::Axis(0), &kept)),
                other => panic!("{name}: {other:?}"),
            };
            (name, t)
        })
        .collect();
    let path = dir.join(format!("{graph}.without{i}.npz"));
    onnx_ga::data::write_npz(&path, d.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    path
}

/// `--on-nonfinite skip` with every micro-step of a window poisoned (window 1, both ranks'
/// micro-batches): the window has nothing to apply and ends without an update, and the
/// next window trains as one process's first (which discards the same four micro-steps
/// and fills its window with the next four). The apply used to run on the empty sums
/// with a count of zero, and every parameter became NaN.
#[test]
fn a_window_discarded_on_every_rank_leaves_the_parameters_alone() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "skip_all", "mlp_ce_adamw", &["--lr", "0.01"]);
    let bad = poisoned_batches(d, "mlp_ce_adamw", &[0, 1, 2, 3]);
    let skip = ["--on-nonfinite", "skip"];
    let one = d.join("one.npz");
    let out = onnx_ga(&train_args(
        &step,
        &bad,
        "8",
        &[&skip[..], &["--save-state", s(&one)]].concat(),
    ));
    assert!(out.status.success(), "one process: {}", stderr(&out));
    let (two, m) = (d.join("two.npz"), d.join("two.jsonl"));
    let flags = [
        &skip[..],
        &["--distributed", "mpi", "--save-state", s(&two)],
        &["--metrics", s(&m)],
    ]
    .concat();
    let out = mpi(&mpirun, 2, &train_args(&step, &bad, "8", &flags));
    assert!(out.status.success(), "2 ranks: {}", stderr(&out));
    let lines = metrics(&m);
    let discarded: Vec<bool> = lines.iter().map(|l| l["discarded"] == true).collect();
    let applied: Vec<bool> = lines.iter().map(|l| l["applied"] == true).collect();
    assert_eq!(discarded, [[true; 4], [false; 4]].concat(), "discarded");
    assert_eq!(
        applied,
        [false, false, false, false, false, false, false, true]
    );
    let state = read_state(&two);
    assert_eq!(
        state["ga.opt_step"],
        Tensor::I64(ndarray::arr0(1i64).into_dyn())
    );
    let (rel, name) = worst_relative(&state, &read_state(&one));
    eprintln!("a discarded window on 2 ranks vs one process: worst relative difference {rel:.3e} ({name})");
    assert!(rel <= 1e-6, "'{name}' differs by {rel:e} relative");
}

/// A window that ends short of K kept micro-steps applies as a flushed window, and its
/// metrics say so: one discarded micro-step (`--on-nonfinite skip`) leaves three, whose
/// mean trains as one process's flushed window of those three micro-batches; a run ended
/// by `--flush` mid-window reports its last window applied, as one process does. Both
/// windows used to update the parameters while reporting `applied: false`, which
/// `--save-every`, `--eval-every` and the summary count.
#[test]
fn a_window_short_of_k_applies_as_a_flushed_one_and_says_so() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "short", "mlp_ce_adamw", &["--lr", "0.01"]);
    let bad = poisoned(d, "mlp_ce_adamw", 1);
    let (two, m) = (d.join("two.npz"), d.join("two.jsonl"));
    let flags = [
        "--on-nonfinite",
        "skip",
        "--distributed",
        "mpi",
        "--save-state",
        s(&two),
        "--metrics",
        s(&m),
    ];
    let out = mpi(&mpirun, 2, &train_args(&step, &bad, "4", &flags));
    assert!(out.status.success(), "2 ranks: {}", stderr(&out));
    let lines = metrics(&m);
    let applied: Vec<bool> = lines.iter().map(|l| l["applied"] == true).collect();
    assert_eq!(applied, [false, false, false, true], "applied");
    assert_eq!(lines[1]["discarded"], true);
    // One process on micro-batches 0, 2 and 3 alone, flushed after the third.
    let kept = without_batch(d, "mlp_ce_adamw", 1);
    let one = d.join("one.npz");
    let out = onnx_ga(&train_args(
        &step,
        &kept,
        "3",
        &["--flush", "--save-state", s(&one)],
    ));
    assert!(out.status.success(), "one process: {}", stderr(&out));
    let (rel, name) = worst_relative(&read_state(&two), &read_state(&one));
    eprintln!("a window short of K on 2 ranks vs one process's flushed window: worst relative difference {rel:.3e} ({name})");
    assert!(rel <= 1e-6, "'{name}' differs by {rel:e} relative");

    // --flush: 6 micro-steps, the second window flushed after 2.
    let good = data("mlp_ce_adamw");
    let mut runs = Vec::new();
    for ranks in [0, 2] {
        let (state, m) = (
            d.join(format!("f{ranks}.npz")),
            d.join(format!("f{ranks}.jsonl")),
        );
        let flags = ["--flush", "--save-state", s(&state), "--metrics", s(&m)];
        let out = match ranks {
            0 => onnx_ga(&train_args(&step, &good, "6", &flags)),
            n => mpi(
                &mpirun,
                n,
                &train_args(
                    &step,
                    &good,
                    "6",
                    &[&flags[..], &["--distributed", "mpi"]].concat(),
                ),
            ),
        };
        assert!(out.status.success(), "{ranks} ranks: {}", stderr(&out));
        let applied: Vec<bool> = metrics(&m).iter().map(|l| l["applied"] == true).collect();
        runs.push((read_state(&state), applied));
    }
    assert_eq!(
        runs[0].1,
        [false, false, false, true, false, true],
        "one process"
    );
    assert_eq!(runs[1].1, runs[0].1, "2 ranks report what one process does");
    let (rel, name) = worst_relative(&runs[1].0, &runs[0].0);
    assert!(rel <= 1e-6, "flushed: '{name}' differs by {rel:e} relative");
}

/// Loss scaling: a poisoned micro-batch on rank 1 (global micro-batch 5, window 2) makes
/// every rank skip that window, as one process does; the rest trains alike.
#[test]
fn a_poisoned_micro_batch_on_one_rank_skips_the_window_on_every_rank() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(
        d,
        "scaled",
        "mlp_ce_adamw",
        &["--lr", "0.01", "--loss-scale", "dynamic"],
    );
    let bad = poisoned(d, "mlp_ce_adamw", 5);
    let m = two_ranks_equal_one(&mpirun, d, &step, &bad, 1e-6);
    let skipped: Vec<u64> = m
        .iter()
        .filter(|l| l["skipped"] == true)
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    // 64 rows are 16 micro-batches: micro-batch 5's rows come again as micro-batch 21.
    assert_eq!(
        skipped,
        vec![8, 24],
        "the windows of micro-steps 5-8 and 21-24 are skipped"
    );
    assert_eq!(
        m[7]["scale"].as_f64(),
        Some(32768.0),
        "the scale backed off"
    );
}

/// A run stopped mid-window (14 micro-steps: 3 windows and 2 micro-steps) on 2 ranks and
/// resumed from its state file on 2 ranks equals the straight run, and so does resuming it
/// on one process (the state file is the one-process state).
#[test]
fn resuming_mid_window_on_two_ranks_equals_the_straight_run() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "resume", "mlp_ce_adamw", &["--lr", "0.01"]);
    let data = data("mlp_ce_adamw");
    let straight = d.join("straight.npz");
    let out = mpi(
        &mpirun,
        2,
        &train_args(
            &step,
            &data,
            "32",
            &["--distributed", "mpi", "--save-state", s(&straight)],
        ),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let part = d.join("part.npz");
    let m = d.join("part.jsonl");
    let dist = ["--distributed", "mpi"];
    let mut first: Vec<&str> = dist.to_vec();
    first.extend(["--save-state", s(&part), "--metrics", s(&m)]);
    let out = mpi(&mpirun, 2, &train_args(&step, &data, "14", &first));
    assert!(out.status.success(), "{}", stderr(&out));
    let saved = read_state(&part);
    assert_eq!(
        saved["ga.micro_step"],
        Tensor::I64(ndarray::arr0(2i64).into_dyn())
    );
    // Resume on 2 ranks (the progress record gives the start step) and on one process.
    let one = d.join("part_one.npz");
    std::fs::copy(&part, &one).unwrap();
    std::fs::copy(
        d.join("part.npz.progress.json"),
        d.join("part_one.npz.progress.json"),
    )
    .unwrap();
    let mut again: Vec<&str> = dist.to_vec();
    again.extend([
        "--init-state",
        s(&part),
        "--save-state",
        s(&part),
        "--metrics",
        s(&m),
    ]);
    let out = mpi(&mpirun, 2, &train_args(&step, &data, "18", &again));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resuming at micro-step 14"), "{err}");
    let (rel, name) = worst_relative(&read_state(&part), &read_state(&straight));
    eprintln!(
        "resumed on 2 ranks vs straight on 2 ranks: worst relative difference {rel:.3e} ({name})"
    );
    assert!(rel <= 1e-6, "'{name}' differs by {rel:e}");
    let lines = metrics(&m);
    assert_eq!(
        lines
            .iter()
            .map(|l| l["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        (1..=32).collect::<Vec<_>>(),
        "the metrics file continues"
    );
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "18",
        &["--init-state", s(&one), "--save-state", s(&one)],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let (rel, name) = worst_relative(&read_state(&one), &read_state(&straight));
    eprintln!("resumed on one process vs straight on 2 ranks: {rel:.3e} ({name})");
    assert!(rel <= 1e-6, "'{name}' differs by {rel:e}");
}

/// Bad data on one rank (NaN in a micro-batch of rank 1, no loss scaling): every rank
/// stops in that window with a clear error (rank 1 names the micro-step and the rows),
/// exit code 2, and no state file.
#[test]
fn a_failing_rank_fails_the_job_without_a_state_file() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "plain", "mlp_ce_adamw", &["--lr", "0.01"]);
    let bad = poisoned(d, "mlp_ce_adamw", 5);
    let state = d.join("state.npz");
    let out = mpi(
        &mpirun,
        2,
        &train_args(
            &step,
            &bad,
            "32",
            &["--distributed", "mpi", "--save-state", s(&state)],
        ),
    );
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("rank 1 of 2: micro-step 6 (data rows 20-23"),
        "{err}"
    );
    assert!(
        err.contains("rank 0 of 2: stopped at micro-steps 5-8 because rank(s) 1 failed"),
        "{err}"
    );
    assert!(!state.exists(), "no state file");
    assert!(
        std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().contains("tmp")),
        "no temporary files"
    );
}

/// A rank killed with SIGKILL mid-run: mpirun ends the job with an error, and no state file
/// is left (rank 0 writes it only at the end, atomically).
#[test]
fn a_killed_rank_fails_the_job_without_a_state_file() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "long", "mlp_ce_adamw", &["--lr", "0.001"]);
    let state = d.join("state.npz");
    let m = d.join("m.jsonl");
    let child = mpi_command(
        &mpirun,
        2,
        &train_args(
            &step,
            &data("mlp_ce_adamw"),
            "4000000",
            &[
                "--distributed",
                "mpi",
                "--save-state",
                s(&state),
                "--metrics",
                s(&m),
            ],
        ),
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    // Wait until training runs (rank 0 writes metrics), then kill rank 1.
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&m)
        .map(|t| t.lines().count())
        .unwrap_or(0)
        < 40
    {
        assert!(started.elapsed().as_secs() < 60, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let victim = rank_pid(1, s(&step)).expect("rank 1's process");
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    eprintln!("{err}");
    assert!(!out.status.success(), "the job must fail: {err}");
    assert!(!state.exists(), "no state file");
}

/// The process of MPI rank `rank` whose command line names `marker`.
fn rank_pid(rank: usize, marker: &str) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let environ = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let has = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        if has(&cmdline, marker.as_bytes())
            && has(&cmdline, b"--distributed")
            && !has(&cmdline, b"mpirun")
            && has(
                &environ,
                format!("OMPI_COMM_WORLD_RANK={rank}\0").as_bytes(),
            )
        {
            return Some(pid);
        }
    }
    None
}

/// K = 4 on 3 ranks: refused before anything runs, exit code 2, nothing written.
#[test]
fn k_not_divisible_by_the_ranks_is_refused() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "k4", "mlp_ce_adamw", &["--lr", "0.01"]);
    let state = d.join("state.npz");
    let m = d.join("m.jsonl");
    let out = mpi(
        &mpirun,
        3,
        &train_args(
            &step,
            &data("mlp_ce_adamw"),
            "8",
            &[
                "--distributed",
                "mpi",
                "--save-state",
                s(&state),
                "--metrics",
                s(&m),
            ],
        ),
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("K = 4") && err.contains("3 ranks") && err.contains("K % R"),
        "{err}"
    );
    assert!(!state.exists() && !m.exists(), "nothing written");
    // --accum-steps with a multiple of the ranks makes it run.
    let out = mpi(
        &mpirun,
        3,
        &train_args(
            &step,
            &data("mlp_ce_adamw"),
            "6",
            &["--distributed", "mpi", "--accum-steps", "3"],
        ),
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// A build without MPI refuses `--distributed mpi` clearly (exit code 2).
#[test]
fn without_mpi_the_flag_is_a_clear_error() {
    if onnx_ga::distributed::HAS_MPI {
        return;
    }
    if on_ci() {
        panic!("CI must run the distributed tests: build them with --features mpi");
    }
    let dir = tempfile::tempdir().unwrap();
    let step = rewritten(dir.path(), "k4", "mlp_ce_adamw", &["--lr", "0.01"]);
    let out = onnx_ga(&train_args(
        &step,
        &data("mlp_ce_adamw"),
        "4",
        &["--distributed", "mpi"],
    ));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("built without MPI"),
        "{}",
        stderr(&out)
    );
}

/// Rank 0 shows the job as one-process `train` does (off a terminal: progress lines and the
/// end summary, once) and draws `--plot` from the global metrics; the other ranks are silent.
#[test]
fn rank_zero_reports_the_job_and_draws_the_plot() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "plot", "mlp_ce_adamw", &["--lr", "0.01"]);
    let (m, plot) = (d.join("m.jsonl"), d.join("loss.png"));
    let data = data("mlp_ce_adamw");
    let extra = [
        "--distributed",
        "mpi",
        "--metrics",
        s(&m),
        "--plot",
        s(&plot),
    ];
    let mut args = train_args(&step, &data, "32", &extra);
    args.retain(|a| *a != "--quiet");
    let out = mpi(&mpirun, 2, &args);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        err.matches("trained 32 micro-steps, 8 optimizer steps")
            .count(),
        1,
        "one summary, from rank 0: {err}"
    );
    assert!(err.contains("all-reduces of"), "{err}");
    assert_eq!(metrics(&m).len(), 32);
    let png = std::fs::read(&plot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    assert_eq!(width, onnx_ga::plot::DEFAULT_SIZE.0);
}

/// Validation on a data-parallel job (`--eval-data`): rank 0 alone evaluates, after the
/// same windows as one process and on the same parameters, so the job reports the
/// validation losses one process does; the other ranks wait for it to go well. The job
/// leaves `--eval-model` out: rank 0 validates with the model the step records.
#[test]
fn validation_on_two_ranks_reports_what_one_process_does() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rewrite = [
        "--loss-fn",
        "cross-entropy",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
    ];
    let step = rewritten(d, "mlp_eval", "forward/torch_mlp/dynamo.onnx", &rewrite);
    let data = root().join("graphs/forward/torch_mlp/data.npz");
    let eval_data = root().join("fixtures/forward/torch_mlp/eval_data.npz");
    let forward = root().join("graphs/forward/torch_mlp/dynamo.onnx");
    let validation = |m: &Path| -> Vec<(u64, f64)> {
        metrics(m)
            .iter()
            .filter_map(|v| Some((v["step"].as_u64()?, v.get("eval_loss")?.as_f64()?)))
            .collect()
    };
    let eval = [
        "--eval-data",
        s(&eval_data),
        "--eval-model",
        s(&forward),
        "--eval-every",
        "3",
    ];
    let one_metrics = d.join("one.jsonl");
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "32",
        &[&["--metrics", s(&one_metrics)], &eval[..]].concat(),
    ));
    assert!(out.status.success(), "one process: {}", stderr(&out));
    // The job without --eval-model: rank 0 takes the model the step records.
    let recorded = ["--eval-data", s(&eval_data), "--eval-every", "3"];
    let two_metrics = d.join("two.jsonl");
    let out = mpi(
        &mpirun,
        2,
        &train_args(
            &step,
            &data,
            "32",
            &[
                &["--distributed", "mpi", "--metrics", s(&two_metrics)],
                &recorded[..],
            ]
            .concat(),
        ),
    );
    assert!(out.status.success(), "2 ranks: {}", stderr(&out));
    let (one, two) = (validation(&one_metrics), validation(&two_metrics));
    // After windows 3 and 6 (micro-steps 12, 24), and at the end.
    let steps: Vec<u64> = one.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [12, 24, 32]);
    assert_eq!(two.len(), one.len(), "2 ranks: {two:?}");
    for ((s2, l2), (s1, l1)) in two.iter().zip(&one) {
        assert_eq!(s2, s1);
        assert!(
            (l2 - l1).abs() <= 1e-6 * l1.abs(),
            "after micro-step {s1}: {l2} vs {l1}"
        );
    }
}

/// `--patience` on a data-parallel job: rank 0 decides and every rank stops with it. At
/// `--lr 0` the validation loss never falls below its first value, so patience 2 stops
/// after the third validation (micro-step 12), on one process and on two ranks alike.
#[test]
fn patience_stops_every_rank_where_one_process_stops() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rewrite = ["--loss-fn", "cross-entropy", "--optimizer", "adamw"];
    let step = rewritten(d, "mlp_patience", "forward/torch_mlp/dynamo.onnx", &rewrite);
    let data = root().join("graphs/forward/torch_mlp/data.npz");
    let eval_data = root().join("fixtures/forward/torch_mlp/eval_data.npz");
    let forward = root().join("graphs/forward/torch_mlp/dynamo.onnx");
    let flags = [
        "--lr",
        "0",
        "--eval-data",
        s(&eval_data),
        "--eval-model",
        s(&forward),
        "--eval-every",
        "1",
        "--patience",
        "2",
    ];
    let saved = |state: &Path| -> serde_json::Value {
        let text = std::fs::read_to_string(format!("{}.progress.json", state.display())).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["checkpoints"][0]["micro_steps"]
            .clone()
    };
    let one = d.join("one.npz");
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "32",
        &[&["--save-state", s(&one)], &flags[..]].concat(),
    ));
    assert!(out.status.success(), "one process: {}", stderr(&out));
    assert_eq!(saved(&one), 12);
    let two = d.join("two.npz");
    let out = mpi(
        &mpirun,
        2,
        &train_args(
            &step,
            &data,
            "32",
            &[
                &["--distributed", "mpi", "--save-state", s(&two)],
                &flags[..],
            ]
            .concat(),
        ),
    );
    assert!(out.status.success(), "2 ranks: {}", stderr(&out));
    assert_eq!(saved(&two), 12);
}

/// `--draw-seed` on two ranks: the run repeats bit for bit (each rank seeds its sessions
/// from its own stream: the trainer mixes its rank in), and another seed trains otherwise.
#[test]
fn a_seeded_dropout_run_on_two_ranks_repeats() {
    let Some(mpirun) = mpirun() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = d.join("dropout_mlp.onnx");
    std::fs::write(
        &step,
        prost::Message::encode_to_vec(&crate::draw_seed::dropout_step()),
    )
    .unwrap();
    let data = d.join("data.npz");
    let rows = common::labelled_data(&[16, 8], 5, 4);
    onnx_ga::data::write_npz(&data, rows.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    let trained = |name: &str, seed: &str| {
        let state = d.join(name);
        let flags = [
            "--distributed",
            "mpi",
            "--draw-seed",
            seed,
            "--save-state",
            s(&state),
        ];
        let out = mpi(&mpirun, 2, &train_args(&step, &data, "16", &flags));
        assert!(out.status.success(), "--draw-seed {seed}: {}", stderr(&out));
        std::fs::read(&state).unwrap()
    };
    let first = trained("a.npz", "3");
    assert!(
        first == trained("b.npz", "3"),
        "--draw-seed 3 on two ranks, twice: the states differ"
    );
    assert!(
        first != trained("c.npz", "4"),
        "--draw-seed 3 and 4: the same state"
    );
}
