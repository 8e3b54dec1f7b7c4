//! The step at real model sizes (issue 14 item 6): PyTorch models of 78 K to 3.7 M parameters
//! (benches/realistic/models.py, exported by benches/realistic/generate.py), trained from the
//! forward model with our own autodiff, as `rewrite forward.onnx --loss-fn cross-entropy
//! --optimizer adamw --accum-steps 4` and `train` do. The Python peers (ONNX Runtime's
//! training API, PyTorch eager) are benches/realistic/peers.py; benches/realistic/run.sh
//! interleaves the two and writes the table (benches/realistic/report.py). See
//! benches/README.md, "Real model sizes".
//!
//! Columns (ms per micro-step, K = 4, window averaged):
//! - `floor`: the bare gradient graph (`autodiff(loss_fn=cross-entropy),legalize-ort,dce`):
//!   forward, loss, backward, gradients as outputs (dropped); parameters held as ONNX Runtime
//!   values, fed as graph inputs (not constants the session could fold); BatchNorm statistics
//!   fed back. No accumulation, no optimizer.
//! - `step`: the step driven by `onnx_ga::train::Trainer` as `train` runs it (split into its
//!   accumulate / window-start / apply specialisations).
//! - `step_whole`: the same step run whole (`train --no-split`), its `If` included.
//! - `step_copy`: `step` with value semantics (`SessionOptions::in_place_updates` off):
//!   every run writes its states into fresh buffers, as before in-place updates.
//! - `step_in_place` (only with `--pair`): `step` with every session in place, however
//!   small its state.
//! - `step_session_updates` (only with `--pair`): `step` with the optimizer updates kept in
//!   the sessions (`SessionOptions::host_updates` off), as before host updates.
//! - `step_at_once` (only with `--pair`): `step` adding each micro-step's weight gradients
//!   as they are made (`SessionOptions::defer_weight_grads` off), as before run AL.
//! - `step_gemm_at_apply` (only with `--pair`): `step` with the apply's own weight
//!   gradients written by ONNX Runtime's `Gemm` for its updates to read
//!   (`SessionOptions::apply_products` off), as before run AO.
//!
//! Modes (`cargo bench` passes `--bench`; without it and without a mode, as under `cargo test
//! --all-targets`, the executable does nothing: the models need torch):
//! - `--prepare` (the default under `cargo bench`): build the floor and the step of every model into `--work DIR`
//!   (`<model>/floor.onnx`, `step.onnx`, `prepare.json`) and check them: the floor's loss and
//!   gradients on the first micro-batch against torch's (`grads.npz` from generate.py), and
//!   the split step against the whole one over two windows (bit-identical parameters);
//! - `--round N --out FILE`: one round of every column and configuration, JSON lines;
//! - `--pair MODEL B T A B`: two columns in one process, windows alternating, for
//!   `2 x --cell-ms`: the median ratio of adjacent windows (an A/B on a drifting machine),
//!   and per position in the window the median ratio of the two micro-steps there
//!   (`a_over_b_at`: the first, the accumulating ones, the applying one);
//!   a column `floor:FILE` is another floor file in the model's work folder (a graph change's
//!   A/B: the floor a build before it wrote against this build's);
//! - `--rss --out FILE`: peak RSS (VmHWM) of each (model, B, T, column) in a fresh child
//!   process (`--rss-child MODEL B T COLUMN`), JSON lines;
//! - `--c2c`: the machine's core-to-core round trip now ([`core_to_core_ns`]), one JSON line.
//!   Rounds and pairs record it beside each cell (`c2c_ns`).
//!
//! Options: `--models dir` (default target/bench-realistic/models), `--work DIR` (default
//! target/bench-realistic/work), `--only mlp,gpt`, `--threads 1,2`, `--k 4`, `--cell-ms 600`,
//! `--rss-windows 4`, `--no-nchwc` (convolutions on the im2col kernels, for an A/B),
//! `--no-fused-batch-norm` (BatchNorm in standard ops, for an A/B), `--no-fused-im2col`
//! (the weight gradients' unfoldings as grouped convolutions, for an A/B),
//! `--no-fused-relu-grad` (the ReLU gradients in standard ops, for an A/B),
//! `--no-fused-gelu-grad` (the GELU gradients in standard ops, for an A/B), `--no-fused-gelu`
//! (the GELU forwards in standard ops), `--no-fused-layer-norm-grad` (the layer-norm
//! gradients in standard ops), `--no-bias-in-gemm` (the linear layers' bias adds apart), `--no-fused-leading-sum` (the
//! sums over leading axes on ONNX Runtime's `ReduceSum`),
//! `--no-fused-weight-grads` (the weight gradients written, then accumulated, for an A/B),
//! `--no-fused-col2im` (the transposed convolutions on ONNX Runtime's `ConvTranspose`),
//! `--no-fused-conv-weight-grad` (the convolutions' weight gradients as three nodes),
//! `--no-fused-transpose` (the transposes that keep the last axis on ONNX Runtime's own).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use onnx_ga::data::{read_npz, Tensor};
use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::engine::{Engine, EngineKind, Held};
use onnx_ga::proto::ModelProto;
use onnx_ga::state::Manifest;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

const COLUMNS: [&str; 4] = ["floor", "step", "step_whole", "step_copy"];
/// The AdamW of the PyTorch column and of the ORT artifacts (torch.optim.AdamW's defaults but
/// the learning rate; the artifacts' AdamW is lr-scheduled from the host the same way).
const OPTIMIZER: &str = "optimizer(kind=adamw,lr=0.001,weight_decay=0.01)";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The micro-batch sizes of a model (the GPT's are sequences of 64 tokens).
fn batches_of(model: &str) -> Vec<usize> {
    if model == "gpt" {
        vec![4, 8]
    } else {
        vec![8, 32]
    }
}

#[derive(Clone, Debug)]
struct Opts {
    models_dir: PathBuf,
    work: PathBuf,
    only: Vec<String>,
    threads: Vec<usize>,
    k: u64,
    cell: Duration,
    rss_windows: usize,
    mode: Mode,
    out: Option<PathBuf>,
}

#[derive(Clone, Debug)]
enum Mode {
    Nothing,
    Prepare,
    Round(usize),
    Rss,
    RssChild(String, usize, usize, String),
    Pair(String, usize, usize, String, String),
    CoreToCore,
}

fn parse_opts() -> Result<Opts> {
    let mut o = Opts {
        models_dir: root().join("target/bench-realistic/models"),
        work: root().join("target/bench-realistic/work"),
        only: ["mlp", "resnet_bn", "resnet", "gpt"]
            .map(String::from)
            .to_vec(),
        threads: vec![1, 2],
        k: 4,
        cell: Duration::from_millis(600),
        rss_windows: 4,
        mode: Mode::Prepare,
        out: None,
    };
    let mut args = std::env::args().skip(1);
    let mut mode = None;
    let mut bench = false;
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().ok_or_else(|| anyhow!("{what} needs a value"));
        match a.as_str() {
            "--bench" => bench = true,
            "--no-nchwc" => NO_NCHWC.store(true, std::sync::atomic::Ordering::Relaxed),
            "--no-fused-batch-norm" => {
                NO_FUSED_BN.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-im2col" => NO_IM2COL.store(true, std::sync::atomic::Ordering::Relaxed),
            "--no-fused-relu-grad" => {
                NO_RELU_GRAD.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-gelu-grad" => {
                NO_GELU_GRAD.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-gelu" => NO_GELU.store(true, std::sync::atomic::Ordering::Relaxed),
            "--no-bias-in-gemm" => {
                NO_BIAS_IN_GEMM.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-leading-sum" => {
                NO_LEADING_SUM.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-col2im" => NO_COL2IM.store(true, std::sync::atomic::Ordering::Relaxed),
            "--no-fused-transpose" => {
                NO_TRANSPOSE.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-conv-weight-grad" => {
                NO_CONV_WEIGHT_GRAD.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-layer-norm-grad" => {
                NO_LN_GRAD.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--no-fused-weight-grads" => {
                NO_WEIGHT_GRADS.store(true, std::sync::atomic::Ordering::Relaxed)
            }
            "--models" => o.models_dir = PathBuf::from(value("--models")?),
            "--work" => o.work = PathBuf::from(value("--work")?),
            "--only" => o.only = value("--only")?.split(',').map(String::from).collect(),
            "--threads" => {
                o.threads = value("--threads")?
                    .split(',')
                    .map(|t| t.parse().map_err(|_| anyhow!("--threads: bad '{t}'")))
                    .collect::<Result<_>>()?
            }
            "--k" => o.k = value("--k")?.parse()?,
            "--cell-ms" => o.cell = Duration::from_millis(value("--cell-ms")?.parse()?),
            "--rss-windows" => o.rss_windows = value("--rss-windows")?.parse()?,
            "--out" => o.out = Some(PathBuf::from(value("--out")?)),
            "--prepare" => mode = Some(Mode::Prepare),
            "--round" => mode = Some(Mode::Round(value("--round")?.parse()?)),
            "--rss" => mode = Some(Mode::Rss),
            "--c2c" => mode = Some(Mode::CoreToCore),
            "--rss-child" => {
                let m = value("model")?;
                let b = value("batch")?.parse()?;
                let t = value("threads")?.parse()?;
                let c = value("column")?;
                mode = Some(Mode::RssChild(m, b, t, c));
            }
            "--pair" => {
                let m = value("model")?;
                let b = value("batch")?.parse()?;
                let t = value("threads")?.parse()?;
                let (a, c) = (value("column A")?, value("column B")?);
                mode = Some(Mode::Pair(m, b, t, a, c));
            }
            other if other.starts_with('-') => eprintln!("realistic bench: ignoring {other}"),
            _ => {}
        }
    }
    o.mode = match (mode, bench) {
        (Some(m), _) => m,
        (None, true) => Mode::Prepare,
        // `cargo test --all-targets` runs this executable without `--bench`: the models are
        // made by benches/realistic/run.sh (torch), which the tests never need.
        (None, false) => Mode::Nothing,
    };
    Ok(o)
}

// ----------------------------------------------------------------------------- building

fn autodiff_spec() -> &'static str {
    "autodiff(loss_fn=cross-entropy)"
}

fn forward_graph(o: &Opts, model: &str) -> Result<onnx_ga::signature::TrainingGraph> {
    let path = o.models_dir.join(model).join("forward.onnx");
    let proto = onnx_ga::model::load_model_with_data(&path)
        .with_context(|| format!("{} (run benches/realistic/generate.py)", path.display()))?;
    Ok(onnx_ga::signature::forward(proto, &path))
}

/// The floor: the gradient graph alone, every trainable parameter made a graph input (its
/// initializer kept as the default), so that ONNX Runtime cannot fold it as a constant.
fn build_floor(o: &Opts, model: &str) -> Result<(ModelProto, Manifest, Vec<String>)> {
    // autodiff without an optimizer after it keeps the gradients as graph outputs.
    let spec = format!("{},legalize-ort,dce", autodiff_spec());
    let step = onnx_ga::step::build_step(forward_graph(o, model)?, &spec, false)
        .map_err(|e| anyhow!("{model}: floor {spec}: {e}"))?;
    let mut proto = step.model.to_proto();
    let g = proto.graph.as_mut().context("no graph")?;
    let grads: Vec<String> = g
        .output
        .iter()
        .map(|v| v.name().to_string())
        .filter(|n| n.ends_with("_grad"))
        .collect();
    let params: Vec<String> = grads
        .iter()
        .map(|n| n.trim_end_matches("_grad").to_string())
        .collect();
    let inputs: Vec<String> = g.input.iter().map(|v| v.name().to_string()).collect();
    for p in &params {
        if inputs.contains(p) {
            continue;
        }
        let init = g
            .initializer
            .iter()
            .find(|t| t.name() == p.as_str())
            .ok_or_else(|| anyhow!("{model}: floor: no initializer '{p}'"))?;
        let dims: Vec<i64> = init.dims.clone();
        g.input.push(onnx_ga::proto::ValueInfoProto {
            name: Some(p.clone()),
            r#type: Some(onnx_ga::ir::tensor_type(init.data_type(), &dims)),
            ..Default::default()
        });
    }
    Ok((proto, step.manifest, params))
}

fn build_stepfile(o: &Opts, model: &str, k: u64) -> Result<ModelProto> {
    let spec = format!("grad-accum(steps={k}),{OPTIMIZER},legalize-ort,dce");
    let spec = onnx_ga::passes::autodiff::with_autodiff(&spec, autodiff_spec())?;
    let step = onnx_ga::step::build_step(forward_graph(o, model)?, &spec, false)
        .map_err(|e| anyhow!("{model}: step {spec}: {e}"))?;
    Ok(step.model.to_proto())
}

fn node_count(m: &ModelProto) -> usize {
    fn count(g: &onnx_ga::proto::GraphProto) -> usize {
        g.node
            .iter()
            .map(|n| {
                1 + n
                    .attribute
                    .iter()
                    .filter_map(|a| a.g.as_ref())
                    .map(count)
                    .sum::<usize>()
            })
            .sum()
    }
    m.graph.as_ref().map(count).unwrap_or(0)
}

fn save(model: &ModelProto, path: &Path) -> Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    onnx_ga::model::save_model(model, path).map_err(|e| anyhow!("{}: {e}", path.display()))
}

fn load(path: &Path) -> Result<ModelProto> {
    onnx_ga::model::load_model(path).map_err(|e| anyhow!("{}: {e}", path.display()))
}

// ----------------------------------------------------------------------------- data

struct Data {
    data: BTreeMap<String, Tensor>,
    samples: usize,
}

impl Data {
    fn open(o: &Opts, model: &str) -> Result<Data> {
        let data = read_npz(&o.models_dir.join(model).join("data.npz"))?;
        let samples = data.values().next().map(|t| t.shape()[0]).unwrap_or(0);
        Ok(Data { data, samples })
    }

    /// The distinct micro-batches of `batch` samples (micro-step i uses `i % len`), made
    /// before timing.
    fn batches(&self, batch: usize) -> Vec<BTreeMap<String, Tensor>> {
        let n = self.samples / gcd(self.samples, batch);
        (0..n as u64)
            .map(|i| micro_batch(&self.data, self.samples, batch, i))
            .collect()
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `--no-nchwc`: every column's convolutions on the im2col kernels, for an A/B of
/// `SessionOptions::nchwc_convs` in one build.
static NO_NCHWC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-batch-norm`: BatchNorm as the lowerings write it in every column, for an A/B
/// of `SessionOptions::fused_batch_norm`.
static NO_FUSED_BN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-im2col`: the weight gradients' unfoldings as grouped convolutions, for an A/B
/// of `SessionOptions::fused_im2col`.
static NO_IM2COL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-relu-grad`: the ReLU gradients in standard ops, for an A/B of
/// `SessionOptions::fused_relu_grad`.
static NO_RELU_GRAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-gelu-grad`: the GELU gradients in standard ops, for an A/B of
/// `SessionOptions::fused_gelu_grad`.
static NO_GELU_GRAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-gelu`: the GELU forwards in standard ops, for an A/B of
/// `SessionOptions::fused_gelu`.
static NO_GELU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-layer-norm-grad`: the layer-norm gradients in standard ops, for an A/B of
/// `SessionOptions::fused_layer_norm_grad`.
static NO_LN_GRAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-bias-in-gemm`: the linear layers' bias adds apart from their products, for an A/B
/// of `SessionOptions::bias_in_gemm`.
static NO_BIAS_IN_GEMM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-leading-sum`: the sums over leading axes on ONNX Runtime's `ReduceSum`, for
/// an A/B of `SessionOptions::fused_leading_sum`.
static NO_LEADING_SUM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-col2im`: the transposed convolutions on ONNX Runtime's `ConvTranspose`, for
/// an A/B of `SessionOptions::fused_col2im`.
static NO_COL2IM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-conv-weight-grad`: the convolutions' weight gradients as the lowering's three
/// nodes, for an A/B of `SessionOptions::fused_conv_weight_grad`.
static NO_CONV_WEIGHT_GRAD: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-transpose`: the transposes that keep the last axis on ONNX Runtime's own
/// `Transpose`, for an A/B of `SessionOptions::fused_transpose`.
static NO_TRANSPOSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--no-fused-weight-grads`: the weight gradients written, then accumulated, for an A/B of
/// `SessionOptions::fused_weight_grads`.
static NO_WEIGHT_GRADS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn session(threads: usize) -> SessionOptions {
    SessionOptions {
        threads,
        optimize: true,
        nchwc_convs: !NO_NCHWC.load(std::sync::atomic::Ordering::Relaxed),
        fused_batch_norm: !NO_FUSED_BN.load(std::sync::atomic::Ordering::Relaxed),
        fused_im2col: !NO_IM2COL.load(std::sync::atomic::Ordering::Relaxed),
        fused_relu_grad: !NO_RELU_GRAD.load(std::sync::atomic::Ordering::Relaxed),
        fused_gelu_grad: !NO_GELU_GRAD.load(std::sync::atomic::Ordering::Relaxed),
        fused_gelu: !NO_GELU.load(std::sync::atomic::Ordering::Relaxed),
        fused_layer_norm_grad: !NO_LN_GRAD.load(std::sync::atomic::Ordering::Relaxed),
        bias_in_gemm: !NO_BIAS_IN_GEMM.load(std::sync::atomic::Ordering::Relaxed),
        fused_leading_sum: !NO_LEADING_SUM.load(std::sync::atomic::Ordering::Relaxed),
        fused_col2im: !NO_COL2IM.load(std::sync::atomic::Ordering::Relaxed),
        fused_conv_weight_grad: !NO_CONV_WEIGHT_GRAD.load(std::sync::atomic::Ordering::Relaxed),
        fused_transpose: !NO_TRANSPOSE.load(std::sync::atomic::Ordering::Relaxed),
        fused_weight_grads: !NO_WEIGHT_GRADS.load(std::sync::atomic::Ordering::Relaxed),
        ..Default::default()
    }
}

// ----------------------------------------------------------------------------- the floor

/// The gradient graph once per micro-step: data from the batch, parameters held as ONNX
/// Runtime values (constant), BatchNorm statistics fed back.
struct Floor {
    engine: Engine,
    held: BTreeMap<String, Held>,
    back: Vec<(String, String)>,
    data_inputs: Vec<String>,
}

impl Floor {
    fn new(floor: &ModelProto, meta: &FloorMeta, session: &SessionOptions) -> Result<Floor> {
        let g = floor.graph.as_ref().context("no graph")?;
        let mut held = BTreeMap::new();
        for input in &g.input {
            let name = input.name();
            if meta.data_inputs.iter().any(|d| d == name) {
                continue;
            }
            let init = g
                .initializer
                .iter()
                .find(|t| t.name() == name)
                .ok_or_else(|| anyhow!("floor input '{name}' has no value"))?;
            let value = Tensor::from_tensor_proto(init).map_err(|e| anyhow!("{name}: {e}"))?;
            let value = onnx_ga::engine::ort::to_owned_ort(name, &value)?;
            held.insert(name.to_string(), Held::Ort(value));
        }
        Ok(Floor {
            engine: Engine::new(EngineKind::Ort, floor, session)?,
            held,
            back: meta
                .state
                .iter()
                .map(|(input, output)| (output.clone(), input.clone()))
                .collect(),
            data_inputs: meta.data_inputs.clone(),
        })
    }

    fn run(&mut self, batch: &BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Held>> {
        let host: Vec<(&str, &Tensor)> = self
            .data_inputs
            .iter()
            .map(|n| (n.as_str(), &batch[n]))
            .collect();
        let held: Vec<(&str, &Held)> = self.held.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut outs: BTreeMap<String, Held> =
            self.engine.run_held(&host, &held)?.into_iter().collect();
        for (out, input) in &self.back {
            let v = outs
                .remove(out)
                .ok_or_else(|| anyhow!("floor: no output '{out}'"))?;
            self.held.insert(input.clone(), v);
        }
        Ok(outs)
    }
}

// ----------------------------------------------------------------------------- prepare

fn prepare(o: &Opts) -> Result<()> {
    onnx_ga::runtime::init_onnxruntime()?;
    for model in &o.only {
        let t = Instant::now();
        let (floor, manifest, params) = build_floor(o, model)?;
        let floor_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let step = build_stepfile(o, model, o.k)?;
        let step_s = t.elapsed().as_secs_f64();
        let dir = o.work.join(model);
        save(&floor, &dir.join("floor.onnx"))?;
        save(&step, &dir.join("step.onnx"))?;
        let meta = FloorMeta {
            data_inputs: manifest.data_inputs.clone(),
            state: manifest
                .state
                .iter()
                .map(|e| (e.input.clone(), e.output.clone()))
                .collect(),
            loss: manifest.loss.clone(),
        };
        std::fs::write(
            dir.join("floor.manifest.json"),
            serde_json::to_string(&meta)?,
        )?;
        let checks = check(o, model, &floor, &meta, &params, &step)?;
        let step_manifest = Manifest::from_model(&step).map_err(|e| anyhow!("{e}"))?;
        let elements: usize = {
            let g = floor.graph.as_ref().unwrap();
            params
                .iter()
                .filter_map(|p| g.initializer.iter().find(|t| t.name() == p.as_str()))
                .map(|t| t.dims.iter().product::<i64>() as usize)
                .sum()
        };
        let info = serde_json::json!({
            "model": model,
            "trainable_tensors": params.len(),
            "trainable_elements": elements,
            "floor_nodes": node_count(&floor),
            "step_nodes": node_count(&step),
            "step_state_entries": step_manifest.state.len(),
            "step_file_mib": std::fs::metadata(dir.join("step.onnx"))?.len() as f64 / 1048576.0,
            "build_floor_s": floor_s,
            "build_step_s": step_s,
            "checks": checks,
        });
        std::fs::write(
            dir.join("prepare.json"),
            serde_json::to_string_pretty(&info)?,
        )?;
        println!("{}", serde_json::to_string(&info)?);
    }
    Ok(())
}

#[derive(Serialize, Deserialize)]
struct FloorMeta {
    data_inputs: Vec<String>,
    /// (input, output) pairs fed back: BatchNorm's running statistics.
    state: Vec<(String, String)>,
    loss: String,
}

fn floor_meta(o: &Opts, model: &str) -> Result<FloorMeta> {
    let path = o.work.join(model).join("floor.manifest.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(&path)?)?)
}

/// The floor's loss and gradients against torch's on one micro-batch (`grads.npz`: the one
/// whose ReLU inputs keep farthest from 0, its `micro_step`), and the split step against
/// the whole one over two windows.
fn check(
    o: &Opts,
    model: &str,
    floor: &ModelProto,
    meta: &FloorMeta,
    params: &[String],
    step: &ModelProto,
) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let data = Data::open(o, model)?;
    let mut reference = read_npz(&o.models_dir.join(model).join("grads.npz"))?;
    // Micro-batch 0 in models generated before generate.py chose one.
    let check_step = match reference.remove("micro_step") {
        Some(Tensor::I64(i)) => i.iter().next().map_or(0, |&i| i.max(0) as u64),
        _ => 0,
    };
    if params.is_empty() || params.len() + 1 != reference.len() {
        bail!(
            "{model}: the floor has {} gradients, torch {}",
            params.len(),
            reference.len() - 1
        );
    }
    let b = batches_of(model)[0];
    let batch = micro_batch(&data.data, data.samples, b, check_step);
    // Against torch on the im2col kernels: the blocked ones (`nchwc_convs`) sum in another
    // order, and a ReLU whose input is within rounding of 0 may then take the other side of
    // its kink, which moves a gradient by far more than rounding (ResNet-8 BN, micro-batch 0:
    // one pre-activation at -7.2e-7 vs +7.6e-7, layer3.conv1.weight's gradient 9% of its
    // largest element; on an AVX2 CPU the im2col kernels took the other side too, hence the
    // micro-batch generate.py chooses). The blocked kernels are checked against the
    // definition in tests/nchwc_conv.rs, and against the im2col ones below.
    let plain = SessionOptions {
        nchwc_convs: false,
        ..session(1)
    };
    // The loss and gradients of one run, and how many convolutions it ran blocked.
    let gradients = |options: &SessionOptions| -> Result<(BTreeMap<String, Vec<f32>>, usize)> {
        let mut f = Floor::new(floor, meta, options)?;
        let outs = f.run(&batch)?;
        let mut host = BTreeMap::new();
        for name in params
            .iter()
            .map(|p| format!("{p}_grad"))
            .chain([meta.loss.clone()])
        {
            let t = outs
                .get(&name)
                .ok_or_else(|| anyhow!("{model}: floor has no output '{name}'"))?
                .to_host(&name)?;
            let values = t
                .as_f32()
                .ok_or_else(|| anyhow!("{name}: not float"))?
                .iter()
                .copied()
                .collect();
            host.insert(name, values);
        }
        Ok((host, f.engine.nchwc_convs()))
    };
    let (ours, _) = gradients(&plain)?;
    let loss = ours[&meta.loss][0];
    let torch_loss = reference["loss"]
        .as_f32()
        .unwrap()
        .iter()
        .next()
        .copied()
        .unwrap();
    let (mut worst, mut worst_rel, mut scale, mut worst_name) = (0f64, 0f64, 0f64, String::new());
    for p in params {
        let ours = &ours[&format!("{p}_grad")];
        let theirs = reference
            .get(p)
            .ok_or_else(|| anyhow!("{model}: grads.npz has no '{p}'"))?;
        let theirs: Vec<f32> = theirs.as_f32().unwrap().iter().copied().collect();
        if ours.len() != theirs.len() {
            bail!(
                "{model}: {p}: {} gradient elements, torch {}",
                ours.len(),
                theirs.len()
            );
        }
        let s = theirs.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        for (a, b) in ours.iter().zip(&theirs) {
            let d = (*a as f64 - *b as f64).abs();
            if d > worst {
                worst = d;
                worst_name = p.clone();
            }
            worst_rel = worst_rel.max(d / s.max(1e-30));
        }
        scale = scale.max(s);
    }
    let ok = (loss - torch_loss).abs() <= 1e-4 * torch_loss.abs().max(1.0) && worst_rel <= 1e-3;
    lines.push(format!(
        "{model}: floor (im2col convolutions) vs torch on micro-batch {check_step} (B={b}): loss {loss:.6} vs {torch_loss:.6}; gradients: max abs diff {worst:.2e} ({worst_name}), max diff / that tensor's max |grad| {worst_rel:.2e} (largest |grad| {scale:.3}) {}",
        if ok { "ok" } else { "MISMATCH" }
    ));
    if !ok {
        bail!(
            "{model}: check failed: {}",
            lines.last().map_or("", String::as_str)
        );
    }
    let (blocked, rewritten) = gradients(&session(1))?;
    if rewritten > 0 {
        let blocked_loss = blocked[&meta.loss][0];
        let (mut worst_rel, mut worst_name) = (0f64, String::new());
        for p in params {
            let name = format!("{p}_grad");
            let (a, b) = (&blocked[&name], &ours[&name]);
            let s = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
            let d = a
                .iter()
                .zip(b)
                .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()))
                / s;
            if d > worst_rel {
                (worst_rel, worst_name) = (d, p.clone());
            }
        }
        // The forward does not sit on a kink: its loss must agree to rounding.
        let ok = (blocked_loss - loss).abs() <= 1e-5 * loss.abs().max(1.0);
        lines.push(format!(
            "{model}: floor with {rewritten} convolutions on the blocked kernels vs im2col: loss {blocked_loss:.7} vs {loss:.7} {}; gradients: max diff / that tensor's max |grad| {worst_rel:.2e} ({worst_name}; not checked: a ReLU at its kink)",
            if ok { "ok" } else { "MISMATCH" }
        ));
        if !ok {
            bail!(
                "{model}: check failed: {}",
                lines.last().map_or("", String::as_str)
            );
        }
    }
    // Split vs whole: the same parameters after two windows.
    let batches = data.batches(b);
    let mut split = Trainer::with_options(
        step,
        &TrainOptions {
            session: session(1),
            ..Default::default()
        },
    )?;
    let mut whole = Trainer::with_options(
        step,
        &TrainOptions {
            session: session(1),
            split: false,
            ..Default::default()
        },
    )?;
    // And the split step on the standard ops: the fused optimizer kernels (in place, on
    // this CPU's widest vectors, in a release build) must give the same bits; the fused
    // BatchNorm kernels sum in another order and the GELU gradient's has its own
    // exponential, so with them the losses agree to rounding.
    let trainer_with = |session: SessionOptions| {
        Trainer::with_options(
            step,
            &TrainOptions {
                session,
                ..Default::default()
            },
        )
    };
    let mut standard = trainer_with(SessionOptions {
        fused_kernels: false,
        ..session(1)
    })?;
    // On two threads: the transposed convolutions' folding takes only sessions of two or
    // more (`passes::fused_col2im`), and the threads must not change the bits either.
    let mut optimizer_fused = trainer_with(SessionOptions {
        fused_batch_norm: false,
        fused_gelu_grad: false,
        fused_layer_norm_grad: false,
        bias_in_gemm: false,
        ..session(2)
    })?;
    // The same on one thread: the convolutions' weight-gradient kernel takes only
    // one-thread sessions (`passes::fused_conv_weight_grad`).
    let mut optimizer_fused_one = trainer_with(SessionOptions {
        fused_batch_norm: false,
        fused_gelu_grad: false,
        fused_layer_norm_grad: false,
        bias_in_gemm: false,
        ..session(1)
    })?;
    // The GELU forwards apart (their kernel runs the standard ops' operations and ONNX
    // Runtime's Erf): the same bits as the step with every kernel.
    let mut gelu_apart = trainer_with(SessionOptions {
        fused_gelu: false,
        ..session(1)
    })?;
    let mut gelu_same = true;
    let mut losses = Vec::new();
    let mut rounding_gap = 0f64;
    for i in 0..2 * o.k as usize {
        let bt = &batches[i % batches.len()];
        let (a, w) = (split.step(bt, false)?, whole.step(bt, false)?);
        let (s, f) = (standard.step(bt, false)?, optimizer_fused.step(bt, false)?);
        let f1 = optimizer_fused_one.step(bt, false)?;
        gelu_same &= gelu_apart.step(bt, false)?.loss.to_bits() == a.loss.to_bits();
        if a.applied != w.applied || a.loss.to_bits() != w.loss.to_bits() {
            bail!("{model}: micro-step {i}: split {a:?} vs whole {w:?}");
        }
        if f.loss.to_bits() != s.loss.to_bits() || f1.loss.to_bits() != s.loss.to_bits() {
            bail!("{model}: micro-step {i}: fused {f:?} (one thread {f1:?}) vs standard ops {s:?}");
        }
        rounding_gap = rounding_gap.max(((a.loss - s.loss) as f64 / s.loss as f64).abs());
        losses.push(a.loss);
    }
    let standard_same = optimizer_fused.state()? == standard.state()?;
    lines.push(format!(
        "{model}: step with fused optimizer kernels ({} in place, {} weight gradients made in their accumulators and {} in the apply's updates, {} sums over leading axes on their kernel, {} transposed convolutions folded by Col2Im, {} transposes on RowTranspose) vs standard ops after 2 windows: {}",
        optimizer_fused.in_place_updates(),
        optimizer_fused.accumulated_products(),
        optimizer_fused.apply_products(),
        optimizer_fused.fused_leading_sums(),
        optimizer_fused.fused_foldings(),
        optimizer_fused.fused_transposes(),
        if standard_same {
            "bit-identical, ok"
        } else {
            "DIFFER"
        }
    ));
    let one_same = optimizer_fused_one.state()? == standard.state()?;
    lines.push(format!(
        "{model}: the same on one thread ({} convolution weight gradients on their kernel) vs standard ops after 2 windows: {}",
        optimizer_fused_one.fused_conv_weight_grads(),
        if one_same { "bit-identical, ok" } else { "DIFFER" }
    ));
    let rounding_ok = rounding_gap < 1e-5;
    let rounded = split.fused_batch_norms()
        + split.fused_gelu_grads()
        + split.fused_layer_norm_grads()
        + split.biases_in_gemm();
    if rounded > 0 {
        lines.push(format!(
            "{model}: step with {} BatchNorm layers, {} GELU gradients and {} layer-norm gradients on the fused kernels, {} biases inside their products vs standard ops: losses within {rounding_gap:.1e} (bound 1e-5) {}",
            split.fused_batch_norms(),
            split.fused_gelu_grads(),
            split.fused_layer_norm_grads(),
            split.biases_in_gemm(),
            if rounding_ok { "ok" } else { "MISMATCH" }
        ));
    }
    if split.fused_gelus() > 0 {
        gelu_same &= gelu_apart.state()? == split.state()?;
        lines.push(format!(
            "{model}: step with {} GELU forwards on their kernel vs their standard ops after 2 windows: {}",
            split.fused_gelus(),
            if gelu_same { "bit-identical, ok" } else { "DIFFER" }
        ));
    }
    let same =
        standard_same && one_same && gelu_same && rounding_ok && split.state()? == whole.state()?;
    lines.push(format!(
        "{model}: step split vs whole after 2 windows of K={}: {} (losses {:?})",
        o.k,
        if same { "bit-identical, ok" } else { "DIFFER" },
        losses
    ));
    if !same || !ok {
        for l in &lines {
            eprintln!("{l}");
        }
        bail!("{model}: check failed");
    }
    for l in &lines {
        eprintln!("{l}");
    }
    Ok(lines)
}

// ----------------------------------------------------------------------------- timing

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    round: usize,
    model: String,
    batch: usize,
    threads: usize,
    column: String,
    /// Median over windows of (window time / K), ms.
    ms_per_step: f64,
    /// Medians of single micro-steps: not applying (all but the K-th), the first of a
    /// window, the applying one (the K-th).
    ms_nonapply: Option<f64>,
    ms_first: Option<f64>,
    ms_apply: Option<f64>,
    /// Mean over windows of (window time / K).
    ms_mean: f64,
    windows: usize,
    /// Seconds to make the sessions.
    setup_s: f64,
    /// The core-to-core round trip just before the cell, ns ([`core_to_core_ns`]).
    c2c_ns: f64,
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

struct Measured {
    per_step: f64,
    nonapply: Option<f64>,
    first: Option<f64>,
    apply: Option<f64>,
    mean: f64,
    windows: usize,
}

/// Whole windows of K: one warm-up window, then windows until `cell` has passed (at least 3).
fn measure(k: u64, cell: Duration, mut step: impl FnMut(u64) -> Result<bool>) -> Result<Measured> {
    let mut i = 0u64;
    for _ in 0..k {
        step(i)?;
        i += 1;
    }
    let (mut per, mut nonapply, mut first, mut apply) = (vec![], vec![], vec![], vec![]);
    let t0 = Instant::now();
    while t0.elapsed() < cell || per.len() < 3 {
        let mut window = 0.0;
        for j in 0..k {
            let s = Instant::now();
            let applied = step(i)?;
            let ms = s.elapsed().as_secs_f64() * 1e3;
            window += ms;
            if j == 0 {
                first.push(ms);
            }
            if applied {
                apply.push(ms)
            } else {
                nonapply.push(ms)
            }
            i += 1;
        }
        per.push(window / k as f64);
    }
    let windows = per.len();
    let mean = per.iter().sum::<f64>() / windows as f64;
    Ok(Measured {
        per_step: median(&mut per).unwrap(),
        nonapply: median(&mut nonapply),
        first: median(&mut first),
        apply: median(&mut apply),
        mean,
        windows,
    })
}

/// The runner of one column: `step(i)` runs micro-step i and says whether it applied.
enum Runner {
    Floor(Box<Floor>),
    Trainer(Box<Trainer>),
}

/// `beside_a_step`: the floor shares the environment's pool with a trainer in the same
/// process (`--pair`); two spinning pools in one process take each other's cores (measured:
/// ResNet-8 B 32 T 2, step / floor 1.28 beside a floor with its own pool, 1.05 on the shared one).
fn runner(
    o: &Opts,
    model: &str,
    column: &str,
    threads: usize,
    beside_a_step: bool,
) -> Result<Runner> {
    let dir = o.work.join(model);
    // `floor:FILE`: another floor file in the model's work folder (one a build before a
    // change wrote), for `--pair floor:floor.before.onnx floor`.
    let (column, floor_file) = match column.split_once(':') {
        Some(("floor", file)) => ("floor", file),
        _ => (column, "floor.onnx"),
    };
    Ok(match column {
        "floor" => Runner::Floor(Box::new(Floor::new(
            &load(&dir.join(floor_file))?,
            &floor_meta(o, model)?,
            &SessionOptions {
                shared_pool: beside_a_step,
                ..session(threads)
            },
        )?)),
        "step"
        | "step_whole"
        | "step_copy"
        | "step_in_place"
        | "step_session_updates"
        | "step_at_once"
        | "step_gemm_at_apply" => {
            let step = load(&dir.join("step.onnx"))?;
            let split = column != "step_whole";
            let options = TrainOptions {
                session: SessionOptions {
                    in_place_updates: column != "step_copy",
                    // `step_in_place` (for `--pair`): in place in every session, however
                    // small its state (`passes/fuse/in_place.rs` `MIN_SESSION_ELEMENTS`).
                    in_place_min_total: match column {
                        "step_in_place" => 0,
                        _ => session(threads).in_place_min_total,
                    },
                    host_updates: column != "step_session_updates",
                    // `step_at_once` (for `--pair`): each micro-step's weight gradients added
                    // as they are made, none kept for the window's sum.
                    defer_weight_grads: column != "step_at_once",
                    apply_products: column != "step_gemm_at_apply",
                    ..session(threads)
                },
                split,
                ..Default::default()
            };
            let t = Trainer::with_options(&step, &options)?;
            if t.is_split() != split {
                bail!("{model}: {column}: the trainer's split is {}", t.is_split());
            }
            Runner::Trainer(Box::new(t))
        }
        other => bail!("unknown column {other}"),
    })
}

impl Runner {
    fn step(&mut self, batch: &BTreeMap<String, Tensor>) -> Result<bool> {
        match self {
            Runner::Floor(f) => f.run(batch).map(|_| false),
            Runner::Trainer(t) => Ok(t.step(batch, false)?.applied),
        }
    }
}

fn round(o: &Opts, r: usize) -> Result<Vec<Record>> {
    onnx_ga::runtime::init_onnxruntime()?;
    let mut records = Vec::new();
    let mut config = 0usize;
    for model in &o.only {
        let data = Data::open(o, model)?;
        for b in batches_of(model) {
            let batches = data.batches(b);
            for &threads in &o.threads {
                // The column order rotates per configuration and per round.
                for c in 0..COLUMNS.len() {
                    let column = COLUMNS[(c + r + config) % COLUMNS.len()];
                    let t = Instant::now();
                    let mut run = runner(o, model, column, threads, false)?;
                    let setup_s = t.elapsed().as_secs_f64();
                    let c2c_ns = core_to_core_ns();
                    let n = batches.len() as u64;
                    let m = measure(o.k, o.cell, |i| run.step(&batches[(i % n) as usize]))?;
                    drop(run);
                    records.push(Record {
                        round: r,
                        model: model.clone(),
                        batch: b,
                        threads,
                        column: column.into(),
                        ms_per_step: m.per_step,
                        ms_nonapply: m.nonapply,
                        ms_first: m.first,
                        ms_apply: m.apply,
                        ms_mean: m.mean,
                        windows: m.windows,
                        setup_s,
                        c2c_ns,
                    });
                    eprintln!(
                        "  {model} B={b} T={threads} {column}: {:.3} ms/step ({} windows; core-to-core {c2c_ns:.0} ns)",
                        m.per_step, m.windows
                    );
                }
                config += 1;
            }
        }
    }
    Ok(records)
}

fn append(path: &Path, lines: impl IntoIterator<Item = String>) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    for l in lines {
        writeln!(f, "{l}")?;
    }
    Ok(())
}

// ----------------------------------------------------------------------------- pairs

/// Two columns of one configuration in this process, a window of one then a window of the
/// other, for twice `--cell-ms` in all: on a machine whose speed drifts by more than the
/// effect (this project's 2-core VMs: ±20% between cells seconds apart), adjacent windows
/// see the same machine, and the median of their ratios is the A/B. Prints one JSON line:
/// each column's median window (ms per micro-step) and the median and range of A / B.
fn pair(o: &Opts, model: &str, b: usize, threads: usize, columns: [&str; 2]) -> Result<()> {
    onnx_ga::runtime::init_onnxruntime()?;
    let data = Data::open(o, model)?;
    let batches = data.batches(b);
    let mut runs = [
        runner(o, model, columns[0], threads, true)?,
        runner(o, model, columns[1], threads, true)?,
    ];
    let n = batches.len();
    let k = o.k as usize;
    // A window's mean ms per micro-step, and each micro-step's ms.
    let window = |run: &mut Runner, w: usize| -> Result<(f64, Vec<f64>)> {
        let t = Instant::now();
        let mut each = Vec::with_capacity(k);
        for i in 0..k {
            let s = Instant::now();
            run.step(&batches[(w * k + i) % n])?;
            each.push(s.elapsed().as_secs_f64() * 1e3);
        }
        Ok((t.elapsed().as_secs_f64() * 1e3 / k as f64, each))
    };
    let c2c_before = core_to_core_ns();
    // One warm-up window each, then pairs, the order alternating per pair.
    window(&mut runs[0], 0)?;
    window(&mut runs[1], 0)?;
    let (mut ms, mut ratios) = ([Vec::new(), Vec::new()], Vec::new());
    // Per position j in the window, the ratios of A's micro-step j to B's.
    let mut at = vec![Vec::new(); k];
    let start = Instant::now();
    let mut w = 1;
    while start.elapsed() < o.cell * 2 || ratios.len() < 5 {
        let order = if w % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut pair = [(0.0, Vec::new()), (0.0, Vec::new())];
        for c in order {
            pair[c] = window(&mut runs[c], w)?;
        }
        ms[0].push(pair[0].0);
        ms[1].push(pair[1].0);
        ratios.push(pair[0].0 / pair[1].0);
        for (j, ratios_at) in at.iter_mut().enumerate() {
            ratios_at.push(pair[0].1[j] / pair[1].1[j]);
        }
        w += 1;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (a, bb) = (median(&mut ms[0]), median(&mut ms[1]));
    let r = median(&mut ratios);
    let per_position: Vec<f64> = at.iter_mut().map(median).collect();
    println!(
        "{}",
        serde_json::json!({
            "model": model, "batch": b, "threads": threads,
            "a": columns[0], "b": columns[1], "ms_a": a, "ms_b": bb,
            "a_over_b": r, "min": ratios[0], "max": ratios[ratios.len() - 1],
            "pairs": ratios.len(), "c2c_ns": [c2c_before, core_to_core_ns()],
            "a_over_b_at": per_position,
        })
    );
    Ok(())
}

// ----------------------------------------------------------------------------- the machine

/// The round trip of a cache line between this thread and a second one, spinning, ns: the
/// median of 5 batches of 20,000. On this project's 2-vCPU Zen 4 machines it is bimodal,
/// 60-70 ns while the two vCPUs share an L3 and 310-420 ns while they sit on different
/// dies; it moves between the two every few seconds, and with it every two-thread cell:
/// memory-bound kernels ran 2.6-3.7x slower in the slow state, compute-bound ones 1.2x
/// (benches/README.md, "Run AC"). Recorded beside each cell, so that a cell can be read
/// against the state it ran in. Two threads that both spin sit on both vCPUs.
fn core_to_core_ns() -> f64 {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    const TRIPS: u32 = 20_000;
    const BATCHES: u32 = 5;
    let line = Arc::new(AtomicU32::new(0));
    let echo = {
        let line = Arc::clone(&line);
        std::thread::spawn(move || {
            // Each odd value sent comes back as the next even one.
            for i in 0..TRIPS * BATCHES {
                while line.load(Ordering::Acquire) != 2 * i + 1 {
                    std::hint::spin_loop();
                }
                line.store(2 * i + 2, Ordering::Release);
            }
        })
    };
    let mut batches = Vec::with_capacity(BATCHES as usize);
    for b in 0..BATCHES {
        let t = Instant::now();
        for i in b * TRIPS..(b + 1) * TRIPS {
            line.store(2 * i + 1, Ordering::Release);
            while line.load(Ordering::Acquire) != 2 * i + 2 {
                std::hint::spin_loop();
            }
        }
        batches.push(t.elapsed().as_secs_f64() * 1e9 / TRIPS as f64);
    }
    let _ = echo.join();
    median(&mut batches).unwrap_or(f64::NAN)
}

// ----------------------------------------------------------------------------- memory

/// `VmRSS`, `VmHWM` of this process in KiB (Linux).
fn vm() -> Result<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status")?;
    let field = |key: &str| -> Result<u64> {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("no {key} in /proc/self/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// One configuration in this (fresh) process: ONNX Runtime loaded and the micro-batches
/// made (baseline), then the step file read and the trainer made, as `train` does, and
/// `rss_windows` windows run. Prints one JSON line (MiB).
fn rss_child(o: &Opts, model: &str, b: usize, threads: usize, column: &str) -> Result<()> {
    onnx_ga::runtime::init_onnxruntime()?;
    let data = Data::open(o, model)?;
    let batches = data.batches(b);
    drop(data);
    let (base, _) = vm()?;
    let t = Instant::now();
    let mut run = runner(o, model, column, threads, false)?;
    let (made, _) = vm()?;
    let setup_s = t.elapsed().as_secs_f64();
    let n = batches.len();
    for i in 0..o.rss_windows * o.k as usize {
        run.step(&batches[i % n])?;
    }
    let (end, peak) = vm()?;
    let mib = |k: u64| k as f64 / 1024.0;
    println!(
        "{}",
        serde_json::json!({
            "model": model, "batch": b, "threads": threads, "column": column,
            "peak_mib": mib(peak), "baseline_mib": mib(base), "after_setup_mib": mib(made),
            "end_mib": mib(end), "setup_s": setup_s, "windows": o.rss_windows,
        })
    );
    Ok(())
}

fn rss(o: &Opts) -> Result<()> {
    let out = o.out.clone().context("--rss needs --out FILE")?;
    let exe = std::env::current_exe()?;
    for model in &o.only {
        for b in batches_of(model) {
            for &threads in &o.threads {
                for column in COLUMNS {
                    let res = Command::new(&exe)
                        .arg("--rss-child")
                        .args([model.as_str(), &b.to_string(), &threads.to_string(), column])
                        .arg("--models")
                        .arg(&o.models_dir)
                        .arg("--work")
                        .arg(&o.work)
                        .args(["--k", &o.k.to_string()])
                        .args(["--rss-windows", &o.rss_windows.to_string()])
                        .output()?;
                    if !res.status.success() {
                        bail!(
                            "{model} B={b} T={threads} {column}: child failed: {}",
                            String::from_utf8_lossy(&res.stderr)
                        );
                    }
                    let line = String::from_utf8_lossy(&res.stdout)
                        .lines()
                        .last()
                        .unwrap_or("")
                        .to_string();
                    eprintln!("  rss {line}");
                    append(&out, [line])?;
                }
            }
        }
    }
    Ok(())
}

// ----------------------------------------------------------------------------- main

fn main() -> Result<()> {
    let o = parse_opts()?;
    match o.mode.clone() {
        Mode::Nothing => {
            eprintln!("realistic bench: nothing to do without --bench (bash benches/realistic/run.sh runs it)");
            Ok(())
        }
        Mode::Prepare => prepare(&o),
        Mode::Round(r) => {
            let out = o.out.clone().context("--round needs --out FILE")?;
            let t = Instant::now();
            let records = round(&o, r)?;
            append(
                &out,
                records.iter().map(|r| serde_json::to_string(r).unwrap()),
            )?;
            eprintln!(
                "realistic bench: rust round {r}: {} cells in {:.1} s",
                records.len(),
                t.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Mode::Rss => rss(&o),
        Mode::RssChild(m, b, t, c) => rss_child(&o, &m, b, t, &c),
        Mode::Pair(m, b, t, x, y) => pair(&o, &m, b, t, [&x, &y]),
        Mode::CoreToCore => {
            println!("{}", serde_json::json!({ "c2c_ns": core_to_core_ns() }));
            Ok(())
        }
    }
}
