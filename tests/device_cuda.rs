//! `train --device cuda`: on a GPU with an ONNX Runtime built with CUDA, training must end
//! where the CPU's does. On any other machine (CI's) every case must fail before training,
//! clearly (exit 2, naming the CUDA execution provider and onnxruntime-gpu), with nothing
//! written. `ONNX_GA_EXPECT_CUDA=1` (the GPU check, scripts/gpu-check.sh) makes that
//! failure a failure: there the cases must train.
//!
//! Each case rewrites one step, trains it on the CPU and on CUDA from the same initial
//! state and data, and compares every state tensor (parameters, accumulators, moments,
//! counters, loss scale). The tolerances are CUDA's reduction order against MLAS's, over a
//! few windows; they print the largest difference so the GPU check's log has the numbers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{self, ort_available, root};
use onnx_ga::data::Tensor;

fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .expect("run onnx-ga")
}

fn expect_cuda() -> bool {
    std::env::var("ONNX_GA_EXPECT_CUDA").is_ok_and(|v| v == "1")
}

/// One training run: the step, its data, the micro-batch, micro-steps and extra flags.
struct Run<'a> {
    step: &'a Path,
    data: &'a Path,
    micro_batch: &'a str,
    steps: &'a str,
    extra: &'a [&'a str],
}

impl Run<'_> {
    /// Trains on `device`, saving the state to `dir/state-TAG.npz`; the state, or the failed
    /// command's output.
    fn train(
        &self,
        dir: &Path,
        tag: &str,
        device: &str,
    ) -> Result<BTreeMap<String, Tensor>, Output> {
        let state = dir.join(format!("state-{tag}.npz"));
        let mut args = vec![
            "train",
            self.step.to_str().unwrap(),
            "--data",
            self.data.to_str().unwrap(),
            "--micro-batch",
            self.micro_batch,
            "--steps",
            self.steps,
            "--quiet",
            "--device",
            device,
            "--save-state",
            state.to_str().unwrap(),
        ];
        args.extend_from_slice(self.extra);
        let out = onnx_ga(&args);
        if out.status.success() {
            Ok(common::read_npz(&state))
        } else {
            assert!(!state.exists(), "a failed run wrote {}", state.display());
            Err(out)
        }
    }
}

/// The largest |a - b| / (atol + rtol |b|) over every element of every state tensor (<= 1
/// passes), with the tensor it is in; prints each tensor's largest absolute difference.
fn worst(
    case: &str,
    cuda: &BTreeMap<String, Tensor>,
    cpu: &BTreeMap<String, Tensor>,
    rtol: f64,
    atol: f64,
) -> (f64, String) {
    assert_eq!(
        cuda.keys().collect::<Vec<_>>(),
        cpu.keys().collect::<Vec<_>>(),
        "{case}: state names"
    );
    let mut worst = (0.0f64, String::new());
    let mut largest_abs = 0.0f64;
    for (name, expected) in cpu {
        let (a, b) = (values(&cuda[name]), values(expected));
        assert_eq!(
            cuda[name].shape(),
            expected.shape(),
            "{case}: {name}: shape"
        );
        for (x, y) in a.iter().zip(&b) {
            assert!(
                x.is_finite() == y.is_finite(),
                "{case}: {name}: {x} against {y}"
            );
            if !x.is_finite() {
                continue;
            }
            largest_abs = largest_abs.max((x - y).abs());
            let allowed = atol + rtol * y.abs();
            let ratio = match (x - y).abs() {
                0.0 => 0.0,
                d if allowed == 0.0 => f64::INFINITY * d,
                d => d / allowed,
            };
            if ratio > worst.0 {
                worst = (ratio, format!("{name}: {x} against the CPU's {y}"));
            }
        }
    }
    eprintln!(
        "{case}: CUDA against the CPU: largest |difference| {largest_abs:.3e}, \
         {:.3} of the tolerance (rtol {rtol:e}, atol {atol:e}) at {}",
        worst.0, worst.1
    );
    worst
}

fn values(t: &Tensor) -> Vec<f64> {
    match t {
        Tensor::F32(a) => a.iter().map(|v| *v as f64).collect(),
        Tensor::F64(a) => a.iter().copied().collect(),
        Tensor::I64(a) => a.iter().map(|v| *v as f64).collect(),
        Tensor::Bool(a) => a.iter().map(|v| *v as u8 as f64).collect(),
        other => panic!("state of an unexpected type: {other:?}"),
    }
}

/// CUDA's run failed: where CUDA is expected that is the test's failure; elsewhere it must
/// be the clear refusal of a machine without it.
fn refused_clearly(case: &str, out: &Output) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !expect_cuda(),
        "{case}: --device cuda failed where CUDA is expected (ONNX_GA_EXPECT_CUDA=1): {err}"
    );
    assert!(!err.contains("panicked"), "{case}: {err}");
    assert_eq!(out.status.code(), Some(2), "{case}: {err}");
    assert!(err.contains("CUDA execution provider"), "{case}: {err}");
    assert!(err.contains("onnxruntime-gpu"), "{case}: {err}");
}

/// Rewrites `source` (a graphs/ folder or a forward model) with `flags` into `dir/step.onnx`.
fn rewrite(dir: &Path, source: &Path, flags: &[&str]) -> PathBuf {
    let step = dir.join("step.onnx");
    let mut args = vec![
        "rewrite",
        source.to_str().unwrap(),
        "-o",
        step.to_str().unwrap(),
    ];
    args.extend_from_slice(flags);
    let out = onnx_ga(&args);
    assert!(
        out.status.success(),
        "rewrite {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    step
}

/// One comparison: `source` rewritten with `flags`, trained `steps` micro-steps of
/// `micro_batch` (with `extra` flags) on the CPU and then on CUDA; CUDA's state must be
/// within `tolerance` (rtol, atol) of the CPU's.
struct Case<'a> {
    name: &'a str,
    source: PathBuf,
    data: PathBuf,
    flags: &'a [&'a str],
    micro_batch: &'a str,
    steps: &'a str,
    extra: &'a [&'a str],
    tolerance: (f64, f64),
}

impl Case<'_> {
    fn trains_like_the_cpu(&self) {
        if !ort_available() {
            return;
        }
        let (case, (rtol, atol)) = (self.name, self.tolerance);
        let dir = tempfile::tempdir().unwrap();
        let step = rewrite(dir.path(), &self.source, self.flags);
        let run = Run {
            step: &step,
            data: &self.data,
            micro_batch: self.micro_batch,
            steps: self.steps,
            extra: self.extra,
        };
        let cpu = run.train(dir.path(), "cpu", "cpu").unwrap_or_else(|out| {
            panic!(
                "{case}: the CPU run failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        match run.train(dir.path(), "cuda", "cuda") {
            Ok(cuda) => {
                let (ratio, at) = worst(case, &cuda, &cpu, rtol, atol);
                assert!(ratio <= 1.0, "{case}: {at}");
            }
            Err(out) => refused_clearly(case, &out),
        }
    }
}

fn graph(name: &str) -> PathBuf {
    root().join("graphs").join(name)
}

fn forward(name: &str) -> (PathBuf, PathBuf) {
    let dir = root().join("graphs/forward").join(name);
    (dir.join("dynamo.onnx"), dir.join("data.npz"))
}

/// The shipped artifacts MLP, AdamW, K 4: ten micro-steps (two windows and a half), run
/// split (the default: two sessions, state bound on the device between them).
#[test]
fn mlp_adamw_split() {
    Case {
        name: "mlp adamw split",
        source: graph("mlp_ce_adamw"),
        data: graph("mlp_ce_adamw/data.npz"),
        flags: &["--accum-steps", "4", "--lr", "0.01"],
        micro_batch: "8",
        steps: "10",
        extra: &[],
        tolerance: (1e-5, 1e-6),
    }
    .trains_like_the_cpu();
}

/// The same step run whole: the exported graph with its `If`, on CUDA.
#[test]
fn mlp_adamw_whole_graph() {
    Case {
        name: "mlp adamw whole",
        source: graph("mlp_ce_adamw"),
        data: graph("mlp_ce_adamw/data.npz"),
        flags: &["--accum-steps", "4", "--lr", "0.01"],
        micro_batch: "8",
        steps: "10",
        extra: &["--no-split"],
        tolerance: (1e-5, 1e-6),
    }
    .trains_like_the_cpu();
}

/// SGD with momentum, AGC and dynamic loss scaling in fp16: half-precision kernels on CUDA
/// against the CPU (whose fp16 runs are float32 in effect), so the tolerance is fp16's.
/// The loss-scale state (scale, growth tracker) must agree exactly.
#[test]
fn mlp_fp16_loss_scaling_agc() {
    Case {
        name: "mlp fp16 loss scaling agc",
        source: graph("mlp_mse_sgd"),
        data: graph("mlp_mse_sgd/data.npz"),
        flags: &[
            "--accum-steps",
            "4",
            "--optimizer",
            "momentum",
            "--lr",
            "0.05",
            "--agc",
            "0.01",
            "--precision",
            "fp16",
            "--loss-scale",
            "dynamic",
            "--loss-scale-init",
            "1024",
        ],
        micro_batch: "8",
        steps: "12",
        extra: &[],
        tolerance: (2e-3, 2e-4),
    }
    .trains_like_the_cpu();
}

/// A PyTorch CNN (Conv, BatchNorm, pooling) differentiated by onnx-ga's autodiff: cuDNN's
/// convolutions and their gradients against MLAS's, AdamW, BatchNorm statistics as state.
#[test]
fn torch_cnn_autodiff() {
    let (source, data) = forward("torch_cnn");
    Case {
        name: "torch cnn",
        source,
        data,
        flags: &[
            "--loss-fn",
            "cross-entropy",
            "--accum-steps",
            "4",
            "--optimizer",
            "adamw",
            "--lr",
            "1e-3",
        ],
        micro_batch: "4",
        steps: "12",
        extra: &[],
        tolerance: (1e-4, 1e-5),
    }
    .trains_like_the_cpu();
}

/// A PyTorch GPT decoder (embeddings, causal attention, LayerNorm, GELU) differentiated by
/// onnx-ga's autodiff, with padded tokens ignored and the weighted normalisation. SGD with
/// momentum, not Adam: the attention's key bias has a gradient that is exactly zero in exact
/// arithmetic (a constant added to every score of a row cancels in the softmax), so each
/// engine's gradient there is its own rounding noise, which Adam divides by its own root
/// mean square and turns into full-size updates of either sign (measured on the H200:
/// 6e-5 apart after 3 windows of AdamW at lr 1e-3, everything else within 1e-7).
#[test]
fn torch_gpt_autodiff() {
    let (source, data) = forward("torch_gpt");
    Case {
        name: "torch gpt",
        source,
        data,
        flags: &[
            "--loss-fn",
            "cross-entropy",
            "--ignore-index",
            "-100",
            "--normalize",
            "weighted",
            "--accum-steps",
            "4",
            "--optimizer",
            "momentum",
            "--lr",
            "0.05",
        ],
        micro_batch: "4",
        steps: "12",
        extra: &[],
        tolerance: (1e-4, 1e-5),
    }
    .trains_like_the_cpu();
}

/// The parameters' values in `step` before training: its initializers of those names.
fn initial_values(step: &Path, names: &[&String]) -> BTreeMap<String, Tensor> {
    let model = onnx_ga::model::load_model(step).unwrap_or_else(|e| panic!("{e}"));
    let graph = model.graph.expect("a graph");
    names
        .iter()
        .map(|&name| {
            let init = graph
                .initializer
                .iter()
                .find(|i| i.name.as_deref() == Some(name.as_str()));
            let init = init.unwrap_or_else(|| panic!("no initial value for '{name}'"));
            (name.clone(), Tensor::from_tensor_proto(init).unwrap())
        })
        .collect()
}

fn l2(v: impl Iterator<Item = f64>) -> f64 {
    v.map(|x| x * x).sum::<f64>().sqrt()
}

/// bf16 runs on CUDA only (the CPU provider has no bf16 kernels for the step, tract no
/// bfloat16 type), so its reference is the float32 step on the CPU. Two windows of SGD with
/// momentum must move every parameter as float32 does, within bf16's rounding: the
/// difference of the two movements at most `BF16_MOVEMENT` of float32's movement (L2, per
/// parameter), the bound tests/precision.rs holds bf16 to on ONNX's reference evaluator.
/// Before the kernel table (`precision/cuda_bf16.rs`) four of these five did not load:
/// Greater (ReLU's gradient), SpaceToDepth (PixelShuffle's gradient) and Pad had no bf16
/// kernel. Returns the worst ratio and where it is.
fn bf16_movement_gap(
    case: &str,
    source: &Path,
    data: &Path,
    forward: bool,
) -> Option<(f64, String)> {
    let dir = tempfile::tempdir().unwrap();
    let fp32_dir = dir.path().join("fp32");
    std::fs::create_dir(&fp32_dir).unwrap();
    let mut flags = vec![
        "--accum-steps",
        "4",
        "--optimizer",
        "momentum",
        "--lr",
        "0.05",
    ];
    if forward {
        flags.extend(["--loss-fn", "cross-entropy", "--ignore-index", "-100"]);
    }
    let fp32 = rewrite(&fp32_dir, source, &flags);
    flags.extend(["--precision", "bf16"]);
    let bf16 = rewrite(dir.path(), source, &flags);
    let run = |step: &Path, tag: &str, device: &str| {
        Run {
            step,
            data,
            micro_batch: "4",
            steps: "8",
            extra: &[],
        }
        .train(dir.path(), tag, device)
    };
    let reference = run(&fp32, "fp32", "cpu").unwrap_or_else(|out| {
        panic!(
            "{case}: fp32 on the CPU: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let cuda = match run(&bf16, "bf16", "cuda") {
        Ok(state) => state,
        Err(out) => {
            refused_clearly(case, &out);
            return None;
        }
    };
    let params: Vec<&String> = reference
        .keys()
        .filter(|n| !n.starts_with("ga.") && matches!(reference[*n], Tensor::F32(_)))
        .collect();
    assert!(!params.is_empty(), "{case}: no parameters in the state");
    let start = initial_values(&fp32, &params);
    let mut worst = (0.0f64, String::new());
    for name in params {
        let (p0, a, b) = (
            values(&start[name]),
            values(&cuda[name]),
            values(&reference[name]),
        );
        let moved = l2(p0.iter().zip(&b).map(|(p, b)| b - p));
        let apart = l2(a.iter().zip(&b).map(|(a, b)| a - b));
        let ratio = apart / moved.max(1e-4);
        if ratio > worst.0 {
            worst = (
                ratio,
                format!("{case}: {name}: moved {moved:.3e} in float32, bf16 {apart:.3e} apart"),
            );
        }
    }
    eprintln!(
        "bf16 on CUDA against float32 on the CPU: worst {:.4} of the movement at {}",
        worst.0, worst.1
    );
    Some(worst)
}

/// See [`bf16_movement_gap`].
const BF16_MOVEMENT: f64 = 0.15;

#[test]
fn bf16_moves_parameters_like_float32() {
    if !ort_available() {
        return;
    }
    let mut gaps = vec![bf16_movement_gap(
        "bf16 mlp (artifacts)",
        &graph("mlp_ce_adamw"),
        &graph("mlp_ce_adamw/data.npz"),
        false,
    )];
    for model in ["torch_mlp", "torch_unet", "torch_rnn", "torch_gpt"] {
        let (source, data) = forward(model);
        gaps.push(bf16_movement_gap(
            &format!("bf16 {model}"),
            &source,
            &data,
            true,
        ));
    }
    for (gap, at) in gaps.into_iter().flatten() {
        assert!(gap <= BF16_MOVEMENT, "{at}: {gap:.4} of float32's movement");
    }
}

/// Resume on CUDA: 6 micro-steps (mid-window), saved, then 4 more from the saved state,
/// ends where 10 straight do, bit for bit.
#[test]
fn resume_mid_window_is_bit_identical() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = rewrite(
        dir.path(),
        &graph("mlp_ce_adamw"),
        &["--accum-steps", "4", "--lr", "0.01"],
    );
    let data = graph("mlp_ce_adamw/data.npz");
    let straight = match (Run {
        step: &step,
        data: &data,
        micro_batch: "8",
        steps: "10",
        extra: &[],
    })
    .train(dir.path(), "straight", "cuda")
    {
        Ok(state) => state,
        Err(out) => return refused_clearly("resume", &out),
    };
    let first = dir.path().join("state-first.npz");
    (Run {
        step: &step,
        data: &data,
        micro_batch: "8",
        steps: "6",
        extra: &[],
    })
    .train(dir.path(), "first", "cuda")
    .unwrap_or_else(|out| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    let resumed = (Run {
        step: &step,
        data: &data,
        micro_batch: "8",
        steps: "4",
        extra: &["--init-state", first.to_str().unwrap()],
    })
    .train(dir.path(), "resumed", "cuda")
    .unwrap_or_else(|out| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    let (ratio, at) = worst("resume on cuda", &resumed, &straight, 0.0, 0.0);
    assert!(ratio == 0.0, "resume on cuda: not bit-identical: {at}");
}

/// What `--device cuda` changes in the step before ONNX Runtime sees it
/// (`passes::lower_for_cuda`: the losses and MaxUnpool, which the CUDA provider has no
/// kernel for, lowered to ops it has) must compute what the step computed: both trained on
/// the CPU, where ONNX Runtime runs the original ops with its own kernels, for two windows.
#[test]
fn the_cuda_lowering_trains_like_the_original_ops() {
    use onnx_ga::train::{micro_batch, Trainer};
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (cnn, cnn_data) = forward("torch_cnn");
    let (gpt, gpt_data) = forward("torch_gpt");
    let mlp_data = graph("mlp_ce_adamw/data.npz");
    let cases: [(&str, PathBuf, &Path, &[&str]); 3] = [
        (
            "mlp (artifacts)",
            graph("mlp_ce_adamw"),
            &mlp_data,
            &["--lr", "0.01"],
        ),
        (
            "torch cnn (MaxUnpool)",
            cnn,
            &cnn_data,
            &["--loss-fn", "cross-entropy"],
        ),
        (
            "torch gpt (ignored labels)",
            gpt,
            &gpt_data,
            &["--loss-fn", "cross-entropy", "--ignore-index", "-100"],
        ),
    ];
    for (case, source, data, flags) in cases {
        let case_dir = dir.path().join(case.split(' ').nth(1).unwrap());
        std::fs::create_dir(&case_dir).unwrap();
        let mut all = vec!["--accum-steps", "4", "--optimizer", "adamw"];
        if !flags.contains(&"--lr") {
            all.extend(["--lr", "1e-3"]);
        }
        all.extend_from_slice(flags);
        let step = onnx_ga::model::load_model(&rewrite(&case_dir, &source, &all)).unwrap();
        let lowered = onnx_ga::passes::lower_for_cuda::prepare(&step).unwrap();
        assert!(
            matches!(lowered, std::borrow::Cow::Owned(_)),
            "{case}: nothing was lowered"
        );
        let data = common::read_npz(data);
        let n = data.values().next().unwrap().shape()[0];
        let mut trainers = [&step, lowered.as_ref()].map(common::trainer);
        let mut loss_gap = 0f64;
        for i in 0..8 {
            let batch = micro_batch(&data, n, 4, i);
            let [a, b]: [f64; 2] = [0, 1].map(|k| {
                let t: &mut Trainer = &mut trainers[k];
                t.step(&batch, false).unwrap().loss as f64
            });
            loss_gap = loss_gap.max((a - b).abs() / b.abs().max(1e-30));
        }
        let [a, b] = &trainers;
        let (gap, at) = common::worst_state_gap(case, a.state().unwrap(), b.state().unwrap());
        eprintln!("{case}: lowered for CUDA: losses {loss_gap:.2e} apart, state {gap:.2e} ({at})");
        assert!(loss_gap <= 1e-6, "{case}: losses {loss_gap:e} apart");
        assert!(gap <= 1e-6, "{case}: state {gap:e} apart at {at}");
    }
}
