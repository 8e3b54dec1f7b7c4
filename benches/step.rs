//! Per-micro-step cost of a rewritten gradient-accumulation step against its floor, a host
//! loop and (from `benches/ort_training_api.py`) ONNX Runtime's own training API.
//! See benches/README.md for what every column measures and how to run it.
//!
//! Modes (cargo passes `--bench` to a `harness = false` bench; it is ignored):
//! - no mode flag (`cargo bench --bench step`): a few rounds of the Rust columns in this one
//!   process, then the table (no ORT-API column) and the host-loop check;
//! - `--round N --out FILE`: one round of every Rust column for every configuration, appended
//!   to FILE as JSON lines (benches/run.sh alternates these with Python rounds);
//! - `--check`: the host loop, step If and step Where train to the same parameters;
//! - `--profile-if --out FILE`: ONNX Runtime's node profile of step If, the `If` node's
//!   time on applying and on non-applying micro-steps;
//! - `--report DIR`: the markdown tables from DIR/*.jsonl.
//!
//! Options: `--models a,b` `--batches 8,32` `--threads 1,2` `--k 4` `--cell-ms 120`
//! `--warm-ms 15` `--rounds 3`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use ndarray::{ArrayD, Zip};
use serde::{Deserialize, Serialize};

use onnx_ga::data::{read_npz, Tensor};
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;
use onnx_ga::signature::{self, ExplicitRoles, OptimizerSpec};
use onnx_ga::state::Role;
use onnx_ga::step::Manifest;
use onnx_ga::train::{micro_batch, Trainer};

const LR: f32 = 0.01;
const COLUMNS: [&str; 4] = ["floor", "step_if", "step_where", "host"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

// ----------------------------------------------------------------------------- options

#[derive(Clone, Debug)]
struct Opts {
    models: Vec<String>,
    batches: Vec<usize>,
    threads: Vec<usize>,
    k: u64,
    cell: Duration,
    warm: Duration,
    rounds: usize,
    round: Option<usize>,
    out: Option<PathBuf>,
    report: Option<PathBuf>,
    check: bool,
    profile_if: bool,
}

fn parse_opts() -> Result<Opts> {
    let mut o = Opts {
        models: vec![
            "mlp_ce_adamw".into(),
            "cnn_bn".into(),
            "transformer_block".into(),
        ],
        batches: vec![8, 32],
        threads: vec![1, 2],
        k: 4,
        cell: Duration::from_millis(120),
        warm: Duration::from_millis(15),
        rounds: 3,
        round: None,
        out: None,
        report: None,
        check: false,
        profile_if: false,
    };
    let mut args = std::env::args().skip(1);
    fn list<T: std::str::FromStr>(v: Option<String>, what: &str) -> Result<Vec<T>> {
        let v = v.ok_or_else(|| anyhow!("{what} needs a value"))?;
        v.split(',')
            .map(|s| {
                s.trim()
                    .parse::<T>()
                    .map_err(|_| anyhow!("{what}: bad value '{s}'"))
            })
            .collect()
    }
    fn one<T: std::str::FromStr>(v: Option<String>, what: &str) -> Result<T> {
        let v = v.ok_or_else(|| anyhow!("{what} needs a value"))?;
        v.parse().map_err(|_| anyhow!("{what}: bad value '{v}'"))
    }
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--models" => o.models = list(args.next(), "--models")?,
            "--batches" => o.batches = list(args.next(), "--batches")?,
            "--threads" => o.threads = list(args.next(), "--threads")?,
            "--k" => o.k = one(args.next(), "--k")?,
            "--cell-ms" => o.cell = Duration::from_millis(one(args.next(), "--cell-ms")?),
            "--warm-ms" => o.warm = Duration::from_millis(one(args.next(), "--warm-ms")?),
            "--rounds" => o.rounds = one(args.next(), "--rounds")?,
            "--round" => o.round = Some(one(args.next(), "--round")?),
            "--out" => o.out = Some(PathBuf::from(one::<String>(args.next(), "--out")?)),
            "--report" => o.report = Some(PathBuf::from(one::<String>(args.next(), "--report")?)),
            "--check" => o.check = true,
            "--profile-if" => o.profile_if = true,
            // libtest-style filters and flags that `cargo bench` may forward: ignore.
            other if other.starts_with('-') => eprintln!("step bench: ignoring option {other}"),
            _ => {}
        }
    }
    Ok(o)
}

// ----------------------------------------------------------------------------- records

/// One cell of one round: a column on one configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    round: usize,
    model: String,
    batch: usize,
    threads: usize,
    column: String,
    /// Median over windows of (window time / K), microseconds.
    us_per_step: f64,
    /// Median time of a micro-step that does not apply the optimizer.
    us_nonapply: Option<f64>,
    /// Median time of a micro-step that applies it (the K-th).
    us_apply: Option<f64>,
    windows: usize,
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

/// Runs `step(i) -> applied` in whole windows of K: warm-up for `warm`, then measured windows
/// until `cell` has passed (at least 5). Every micro-step is timed on its own.
fn measure(
    k: u64,
    warm: Duration,
    cell: Duration,
    mut step: impl FnMut(u64) -> Result<bool>,
) -> Result<(f64, Option<f64>, Option<f64>, usize)> {
    let mut i = 0u64;
    let t0 = Instant::now();
    while t0.elapsed() < warm || i < 2 * k {
        for _ in 0..k {
            step(i)?;
            i += 1;
        }
    }
    let (mut per_step, mut nonapply, mut apply) = (Vec::new(), Vec::new(), Vec::new());
    let t0 = Instant::now();
    while t0.elapsed() < cell || per_step.len() < 5 {
        let mut window = 0.0;
        for _ in 0..k {
            let s = Instant::now();
            let applied = step(i)?;
            let us = s.elapsed().as_secs_f64() * 1e6;
            window += us;
            if applied {
                apply.push(us)
            } else {
                nonapply.push(us)
            }
            i += 1;
        }
        per_step.push(window / k as f64);
    }
    let n = per_step.len();
    Ok((
        median(&mut per_step).unwrap(),
        median(&mut nonapply),
        median(&mut apply),
        n,
    ))
}

// ----------------------------------------------------------------------------- models

/// Everything one model needs, built once per process.
struct Prepared {
    name: String,
    floor: ModelProto,
    floor_manifest: Manifest,
    step_if: ModelProto,
    step_where: ModelProto,
    adamw: (f32, f32, f32, f32, bool),
    lazy_reset: String,
    data: BTreeMap<String, Tensor>,
    samples: usize,
}

fn open(model: &str) -> Result<signature::TrainingGraph> {
    signature::open(
        &root().join("graphs").join(model),
        &ExplicitRoles::default(),
    )
    .map_err(|e| anyhow!("{model}: {e}"))
}

fn build(model: &str, spec: &str) -> Result<(ModelProto, Manifest)> {
    let step = onnx_ga::step::build_step(open(model)?, spec, false)
        .map_err(|e| anyhow!("{model}: {spec}: {e}"))?;
    Ok((step.model.to_proto(), step.manifest))
}

fn prepare(model: &str, k: u64) -> Result<Prepared> {
    let graph = open(model)?;
    let opt = graph
        .signature
        .optimizer
        .as_ref()
        .ok_or_else(|| anyhow!("{model}: no optimizer"))?;
    let adamw = match opt.spec {
        OptimizerSpec::Adamw {
            beta1,
            beta2,
            epsilon,
            weight_decay,
            correct_bias,
            adam_mode: 1,
        } => (beta1, beta2, epsilon, weight_decay, correct_bias),
        ref other => {
            bail!("{model}: the host loop implements AdamW adam_mode=1 only, not {other:?}")
        }
    };
    let lazy_reset = graph
        .signature
        .lazy_reset_grad
        .clone()
        .ok_or_else(|| anyhow!("{model}: no lazy_reset_grad input"))?;
    let (floor, floor_manifest) = build(model, "legalize-ort,dce")?;
    let (step_if, _) = build(
        model,
        &format!("grad-accum(steps={k}),optimizer(lr={LR}),legalize-ort,dce"),
    )?;
    let (step_where, _) = build(
        model,
        &format!("grad-accum(steps={k},apply=where),optimizer(lr={LR}),legalize-ort,dce"),
    )?;
    let data = read_npz(&root().join("graphs").join(model).join("data.npz"))?;
    let samples = data.values().next().map(|t| t.shape()[0]).unwrap_or(0);
    Ok(Prepared {
        name: model.into(),
        floor,
        floor_manifest,
        step_if,
        step_where,
        adamw,
        lazy_reset,
        data,
        samples,
    })
}

impl Prepared {
    /// The distinct micro-batches of `batch` samples (micro-step i uses `i % len`).
    fn batches(&self, batch: usize) -> Vec<BTreeMap<String, Tensor>> {
        let n = self.samples / gcd(self.samples, batch);
        (0..n as u64)
            .map(|i| micro_batch(&self.data, self.samples, batch, i))
            .collect()
    }

    fn initializer(&self, name: &str) -> Option<Tensor> {
        let g = self.floor.graph.as_ref()?;
        g.initializer
            .iter()
            .find(|t| t.name() == name)
            .and_then(|t| Tensor::from_tensor_proto(t).ok())
    }

    /// Initial feeds of the floor graph apart from the data: parameters and BN statistics
    /// from their initializers, zero accumulation buffers, `lazy_reset_grad`.
    fn floor_state(&self, reset: bool) -> Result<BTreeMap<String, Tensor>> {
        let g = self.floor.graph.as_ref().unwrap();
        let mut state = BTreeMap::new();
        for input in &g.input {
            let name = input.name();
            if self.floor_manifest.data_inputs.iter().any(|d| d == name) {
                continue;
            }
            if name == self.lazy_reset {
                state.insert(
                    name.to_string(),
                    Tensor::Bool(ndarray::arr1(&[reset]).into_dyn()),
                );
                continue;
            }
            let value = match self.initializer(name) {
                Some(v) => v,
                None => {
                    let entry = self
                        .floor_manifest
                        .state
                        .iter()
                        .find(|e| e.input == name && e.role == Role::Accumulator);
                    let param = entry
                        .and_then(|e| e.param.as_deref())
                        .ok_or_else(|| anyhow!("{}: input '{name}' has no value", self.name))?;
                    let p = self
                        .initializer(param)
                        .ok_or_else(|| anyhow!("{}: no initial value for '{param}'", self.name))?;
                    Tensor::F32(ArrayD::zeros(p.shape()))
                }
            };
            state.insert(name.to_string(), value);
        }
        Ok(state)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn options(threads: usize) -> SessionOptions {
    SessionOptions {
        threads,
        optimize: true,
    }
}

// ----------------------------------------------------------------------------- loops

/// (a) The legalized gradient graph, once per micro-step: data, parameters, ORT's
/// accumulation buffers (fed back) and BN statistics (fed back); `lazy_reset_grad` true on
/// the first micro-step of each window, as ORT's own loop does.
struct FloorLoop {
    session: OrtSession,
    state: BTreeMap<String, Tensor>,
    /// output name -> input name it feeds back.
    back: Vec<(String, String)>,
    data_inputs: Vec<String>,
    lazy_reset: String,
    k: u64,
}

impl FloorLoop {
    fn new(p: &Prepared, threads: usize, k: u64) -> Result<FloorLoop> {
        Ok(FloorLoop {
            session: OrtSession::new(&p.floor, &options(threads))?,
            state: p.floor_state(true)?,
            back: p
                .floor_manifest
                .state
                .iter()
                .map(|e| (e.output.clone(), e.input.clone()))
                .collect(),
            data_inputs: p.floor_manifest.data_inputs.clone(),
            lazy_reset: p.lazy_reset.clone(),
            k,
        })
    }

    fn step(&mut self, batch: &BTreeMap<String, Tensor>, i: u64) -> Result<bool> {
        self.state.insert(
            self.lazy_reset.clone(),
            Tensor::Bool(ndarray::arr1(&[i % self.k == 0]).into_dyn()),
        );
        let mut feeds: Vec<(&str, &Tensor)> = Vec::with_capacity(self.state.len() + 2);
        for name in &self.data_inputs {
            feeds.push((name, &batch[name]));
        }
        for (name, value) in &self.state {
            feeds.push((name, value));
        }
        let outputs = self.session.run(&feeds)?;
        let mut by_name: BTreeMap<String, Tensor> = outputs.into_iter().collect();
        for (out, input) in &self.back {
            let v = by_name
                .remove(out)
                .ok_or_else(|| anyhow!("no output '{out}'"))?;
            self.state.insert(input.clone(), v);
        }
        Ok(false)
    }
}

/// (d) What a user writes without onnx-ga: the legalized gradient graph with
/// `lazy_reset_grad` = true (its buffer outputs are then this micro-batch's gradients),
/// gradients summed on the host, and on the K-th micro-step the mean gradient goes through
/// ORT's AdamW (adam_mode 1) on the host; BN statistics fed back.
struct HostLoop {
    session: OrtSession,
    feeds: BTreeMap<String, Tensor>,
    bn_back: Vec<(String, String)>,
    /// (gradient output, parameter input, accumulator, m, v)
    params: Vec<(String, String, ArrayD<f32>, ArrayD<f32>, ArrayD<f32>)>,
    data_inputs: Vec<String>,
    adamw: (f32, f32, f32, f32, bool),
    k: u64,
    micro: u64,
    t: i32,
}

impl HostLoop {
    fn new(p: &Prepared, threads: usize, k: u64) -> Result<HostLoop> {
        let feeds = p.floor_state(true)?;
        let mut bn_back = Vec::new();
        let mut params = Vec::new();
        for e in &p.floor_manifest.state {
            match e.role {
                Role::Accumulator => {
                    let param = e
                        .param
                        .clone()
                        .ok_or_else(|| anyhow!("accumulator '{}' without a parameter", e.input))?;
                    let shape = feeds[&param].shape().to_vec();
                    params.push((
                        e.output.clone(),
                        param,
                        ArrayD::zeros(shape.clone()),
                        ArrayD::zeros(shape.clone()),
                        ArrayD::zeros(shape),
                    ));
                }
                _ => bn_back.push((e.output.clone(), e.input.clone())),
            }
        }
        Ok(HostLoop {
            session: OrtSession::new(&p.floor, &options(threads))?,
            feeds,
            bn_back,
            params,
            data_inputs: p.floor_manifest.data_inputs.clone(),
            adamw: p.adamw,
            k,
            micro: 0,
            t: 0,
        })
    }

    fn step(&mut self, batch: &BTreeMap<String, Tensor>) -> Result<bool> {
        let mut feeds: Vec<(&str, &Tensor)> = Vec::with_capacity(self.feeds.len() + 2);
        for name in &self.data_inputs {
            feeds.push((name, &batch[name]));
        }
        for (name, value) in &self.feeds {
            feeds.push((name, value));
        }
        let outputs = self.session.run(&feeds)?;
        let mut by_name: BTreeMap<String, Tensor> = outputs.into_iter().collect();
        for (out, input) in &self.bn_back {
            let v = by_name
                .remove(out)
                .ok_or_else(|| anyhow!("no output '{out}'"))?;
            self.feeds.insert(input.clone(), v);
        }
        for (out, _, acc, _, _) in &mut self.params {
            match by_name.get(out.as_str()) {
                Some(Tensor::F32(g)) => *acc += g,
                _ => bail!("no float output '{out}'"),
            }
        }
        self.micro += 1;
        if self.micro < self.k {
            return Ok(false);
        }
        // AdamW, ORT's formula (adam_mode 1): bias-corrected step, then decoupled decay.
        self.t += 1;
        let (b1, b2, eps, wd, correct) = self.adamw;
        let step_size = if correct {
            LR * (1.0 - b2.powi(self.t)).sqrt() / (1.0 - b1.powi(self.t))
        } else {
            LR
        };
        let inv_k = 1.0 / self.micro as f32;
        for (_, name, acc, m, v) in &mut self.params {
            let Some(Tensor::F32(p)) = self.feeds.get_mut(name.as_str()) else {
                bail!("parameter '{name}' is not float")
            };
            Zip::from(p).and(acc).and(m).and(v).for_each(|p, a, m, v| {
                let g = *a * inv_k;
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                *p -= step_size * *m / (v.sqrt() + eps);
                if wd > 0.0 {
                    *p -= LR * wd * *p;
                }
                *a = 0.0;
            });
        }
        self.micro = 0;
        Ok(true)
    }

    fn param(&self, name: &str) -> Option<&Tensor> {
        self.feeds.get(name)
    }
}

// ----------------------------------------------------------------------------- a round

fn run_cell(
    p: &Prepared,
    column: &str,
    batch: usize,
    threads: usize,
    o: &Opts,
) -> Result<(f64, Option<f64>, Option<f64>, usize)> {
    let batches = p.batches(batch);
    let nb = batches.len() as u64;
    match column {
        "floor" => {
            let mut l = FloorLoop::new(p, threads, o.k)?;
            measure(o.k, o.warm, o.cell, |i| {
                l.step(&batches[(i % nb) as usize], i)
            })
        }
        "host" => {
            let mut l = HostLoop::new(p, threads, o.k)?;
            measure(o.k, o.warm, o.cell, |i| l.step(&batches[(i % nb) as usize]))
        }
        "step_if" | "step_where" => {
            let model = if column == "step_if" {
                &p.step_if
            } else {
                &p.step_where
            };
            let mut t = Trainer::new(model, &options(threads))?;
            measure(o.k, o.warm, o.cell, |i| {
                Ok(t.step(&batches[(i % nb) as usize], false)?.applied)
            })
        }
        other => bail!("unknown column {other}"),
    }
}

/// One round: every configuration, every Rust column; the column order rotates with the
/// round and the configuration so no column always runs first.
fn round(prepared: &[Prepared], r: usize, o: &Opts) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    let mut c = 0;
    for p in prepared {
        for &batch in &o.batches {
            for &threads in &o.threads {
                for j in 0..COLUMNS.len() {
                    let column = COLUMNS[(j + r + c) % COLUMNS.len()];
                    let (us, na, ap, windows) = run_cell(p, column, batch, threads, o)
                        .with_context(|| format!("{} B={batch} T={threads} {column}", p.name))?;
                    out.push(Record {
                        round: r,
                        model: p.name.clone(),
                        batch,
                        threads,
                        column: column.into(),
                        us_per_step: us,
                        us_nonapply: na,
                        us_apply: ap,
                        windows,
                    });
                }
                c += 1;
            }
        }
    }
    Ok(out)
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

// ----------------------------------------------------------------------------- check

/// The host loop trains to the same parameters as step If and step Where (B=8, 3 windows).
fn check(prepared: &[Prepared], o: &Opts) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for p in prepared {
        let batches = p.batches(8);
        let steps = 3 * o.k;
        let mut host = HostLoop::new(p, 1, o.k)?;
        let mut t_if = Trainer::new(&p.step_if, &options(1))?;
        let mut t_where = Trainer::new(&p.step_where, &options(1))?;
        for i in 0..steps {
            let b = &batches[(i as usize) % batches.len()];
            host.step(b)?;
            t_if.step(b, false)?;
            t_where.step(b, false)?;
        }
        let (mut d_if, mut d_where, mut moved) = (0f32, 0f32, 0f32);
        for (_, name, ..) in &host.params {
            let h = host.param(name).and_then(Tensor::as_f32).unwrap();
            let a = t_if.state()[name].as_f32().unwrap();
            let w = t_where.state()[name].as_f32().unwrap();
            let init = p.initializer(name).unwrap();
            let init = init.as_f32().unwrap();
            Zip::from(h).and(a).and(w).and(init).for_each(|h, a, w, i| {
                d_if = d_if.max((h - a).abs());
                d_where = d_where.max((h - w).abs());
                moved = moved.max((h - i).abs());
            });
        }
        let ok = d_if <= 1e-5 && d_where <= 1e-5 && moved > 1e-4;
        lines.push(format!(
            "check {}: after {} windows of K={} x B=8, max |host - step If| = {d_if:.2e}, max |host - step Where| = {d_where:.2e} (parameters moved up to {moved:.2e}) {}",
            p.name, 3, o.k, if ok { "ok" } else { "MISMATCH" }
        ));
        if !ok {
            bail!("{}", lines.last().unwrap());
        }
    }
    Ok(lines)
}

// ----------------------------------------------------------------------------- If profile

#[derive(Debug, Serialize, Deserialize)]
struct IfProfile {
    model: String,
    batch: usize,
    threads: usize,
    /// Median whole-run time (ORT's `model_run` event), non-applying / applying micro-steps.
    run_us_nonapply: f64,
    run_us_apply: f64,
    /// Median time of the `If` node (its kernel, including the branch it runs).
    if_us_nonapply: f64,
    if_us_apply: f64,
    /// Identity nodes in the else branch, and the bytes they pass through.
    else_identities: usize,
    else_bytes: usize,
}

fn to_ort(t: &Tensor) -> Result<ort::value::DynValue> {
    Ok(match t {
        Tensor::F32(a) => ort::value::Tensor::from_array(a.clone())?.into_dyn(),
        Tensor::F64(a) => ort::value::Tensor::from_array(a.clone())?.into_dyn(),
        Tensor::I64(a) => ort::value::Tensor::from_array(a.clone())?.into_dyn(),
        Tensor::I32(a) => ort::value::Tensor::from_array(a.clone())?.into_dyn(),
        Tensor::Bool(a) => ort::value::Tensor::from_array(a.clone())?.into_dyn(),
    })
}

/// Runs step If under ONNX Runtime's profiler with its state fed back (the Trainer's loop,
/// written out because the Trainer has no profiling switch) and reads the `If` node's time.
fn profile_if(
    p: &Prepared,
    batch: usize,
    threads: usize,
    o: &Opts,
    windows: u64,
) -> Result<IfProfile> {
    let manifest = Manifest::from_model(&p.step_if)?;
    let g = p.step_if.graph.as_ref().unwrap();
    let mut state: BTreeMap<String, Tensor> = BTreeMap::new();
    for e in &manifest.state {
        let init = g
            .initializer
            .iter()
            .find(|t| t.name() == e.input)
            .ok_or_else(|| anyhow!("no initializer for '{}'", e.input))?;
        state.insert(
            e.input.clone(),
            Tensor::from_tensor_proto(init).map_err(|m| anyhow!(m))?,
        );
    }
    // The else branch of the apply If.
    let if_node = g
        .node
        .iter()
        .find(|n| n.op_type() == "If")
        .ok_or_else(|| anyhow!("no If node"))?;
    let else_g = if_node
        .attribute
        .iter()
        .find(|a| a.name() == "else_branch")
        .and_then(|a| a.g.as_ref())
        .ok_or_else(|| anyhow!("no else branch"))?;
    let else_identities = else_g
        .node
        .iter()
        .filter(|n| n.op_type() == "Identity")
        .count();
    let mut else_bytes = 0;
    for n in else_g.node.iter().filter(|n| n.op_type() == "Identity") {
        if let Some(v) = state.get(&n.input[0]) {
            else_bytes += v.shape().iter().product::<usize>()
                * if matches!(v, Tensor::F64(_) | Tensor::I64(_)) {
                    8
                } else {
                    4
                };
        } else if let Some(t) = g.initializer.iter().find(|t| t.name() == n.input[0]) {
            else_bytes += t.raw_data().len();
        } else if let Some(e) = manifest
            .state
            .iter()
            .find(|e| e.role == Role::Accumulator && n.input[0].starts_with(&e.input))
        {
            // An accumulator's freshly added value (same size as its state).
            else_bytes += state[&e.input].shape().iter().product::<usize>() * 4;
        }
    }

    let dir = tempfile::tempdir()?;
    let prefix = dir.path().join("if_profile");
    let mut builder = onnx_ga::runtime::session_builder()?;
    builder = builder
        .with_intra_threads(threads)
        .map_err(|e| anyhow!("{e}"))?;
    builder = builder
        .with_optimization_level(ort::session::builder::GraphOptimizationLevel::All)
        .map_err(|e| anyhow!("{e}"))?;
    builder = builder
        .with_profiling(&prefix)
        .map_err(|e| anyhow!("{e}"))?;
    let mut session = builder.commit_from_memory(&onnx_ga::model::encode_model(&p.step_if))?;
    let batches = p.batches(batch);
    let total = (windows + 2) * o.k;
    for i in 0..total {
        let b = &batches[(i as usize) % batches.len()];
        let mut feeds: Vec<(String, ort::session::SessionInputValue<'_>)> = Vec::new();
        for name in &manifest.data_inputs {
            feeds.push((name.clone(), to_ort(&b[name])?.into()));
        }
        for (name, v) in &state {
            feeds.push((name.clone(), to_ort(v)?.into()));
        }
        let outputs = session.run(feeds)?;
        let mut next = Vec::new();
        for e in &manifest.state {
            let v = &outputs[e.output.as_str()];
            let t = match state[&e.input] {
                Tensor::F32(_) => Tensor::F32(v.try_extract_array::<f32>()?.to_owned()),
                Tensor::I64(_) => Tensor::I64(v.try_extract_array::<i64>()?.to_owned()),
                Tensor::F64(_) => Tensor::F64(v.try_extract_array::<f64>()?.to_owned()),
                Tensor::I32(_) => Tensor::I32(v.try_extract_array::<i32>()?.to_owned()),
                Tensor::Bool(_) => Tensor::Bool(v.try_extract_array::<bool>()?.to_owned()),
            };
            next.push((e.input.clone(), t));
        }
        drop(outputs);
        state.extend(next);
    }
    let file = session.end_profiling()?;
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading {file}"))?;
    let _ = std::fs::remove_file(&file);
    let events: Vec<serde_json::Value> = serde_json::from_str(&text)?;
    // model_run spans in order; the If node's kernel events inside each.
    let mut runs: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e["cat"] == "Session" && e["name"] == "model_run")
        .map(|e| {
            (
                e["ts"].as_f64().unwrap_or(0.0),
                e["dur"].as_f64().unwrap_or(0.0),
            )
        })
        .collect();
    runs.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    if runs.len() as u64 != total {
        bail!("profile holds {} runs, expected {total}", runs.len());
    }
    let ifs: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| {
            e["cat"] == "Node"
                && e["args"]["op_name"] == "If"
                && e["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("_kernel_time"))
                && e["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with(if_node.name()))
        })
        .map(|e| {
            (
                e["ts"].as_f64().unwrap_or(0.0),
                e["dur"].as_f64().unwrap_or(0.0),
            )
        })
        .collect();
    let (mut rn, mut ra, mut inn, mut ia) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (idx, (ts, dur)) in runs.iter().enumerate().skip(2 * o.k as usize) {
        let applying = (idx as u64 + 1) % o.k == 0;
        let if_dur: f64 = ifs
            .iter()
            .filter(|(t, _)| *t >= *ts && *t <= ts + dur)
            .map(|(_, d)| *d)
            .sum();
        if applying {
            ra.push(*dur);
            ia.push(if_dur);
        } else {
            rn.push(*dur);
            inn.push(if_dur);
        }
    }
    Ok(IfProfile {
        model: p.name.clone(),
        batch,
        threads,
        run_us_nonapply: median(&mut rn).unwrap_or(f64::NAN),
        run_us_apply: median(&mut ra).unwrap_or(f64::NAN),
        if_us_nonapply: median(&mut inn).unwrap_or(f64::NAN),
        if_us_apply: median(&mut ia).unwrap_or(f64::NAN),
        else_identities,
        else_bytes,
    })
}

// ----------------------------------------------------------------------------- report

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    format!("{n} CPUs (available_parallelism), {cpu}")
}

fn fmt(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.1}"),
        _ => "–".into(),
    }
}

fn fmt_ratio(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.2}"),
        _ => "–".into(),
    }
}

fn report(records: &[Record], profiles: &[IfProfile]) -> String {
    use std::fmt::Write as _;
    let mut keys: Vec<(String, usize, usize)> = Vec::new();
    for r in records {
        let k = (r.model.clone(), r.batch, r.threads);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let rounds: std::collections::BTreeSet<usize> = records.iter().map(|r| r.round).collect();
    let cell = |k: &(String, usize, usize), col: &str, r: Option<usize>| -> Option<&Record> {
        records.iter().find(|x| {
            x.model == k.0
                && x.batch == k.1
                && x.threads == k.2
                && x.column == col
                && r.is_none_or(|r| x.round == r)
        })
    };
    let med = |k: &(String, usize, usize),
               col: &str,
               f: &dyn Fn(&Record) -> Option<f64>|
     -> Option<f64> {
        let mut v: Vec<f64> = records
            .iter()
            .filter(|x| x.model == k.0 && x.batch == k.1 && x.threads == k.2 && x.column == col)
            .filter_map(f)
            .collect();
        median(&mut v)
    };
    // Median over rounds of the per-round ratio (both cells of a ratio come from the same round).
    let ratio = |k: &(String, usize, usize), a: &str, b: &str| -> Option<f64> {
        let mut v: Vec<f64> = rounds
            .iter()
            .filter_map(|&r| {
                Some(cell(k, a, Some(r))?.us_per_step / cell(k, b, Some(r))?.us_per_step)
            })
            .collect();
        median(&mut v)
    };
    let mut s = String::new();
    let _ = writeln!(s, "Machine: {}. Rounds: {}. K = 4. Microseconds per micro-step, median over rounds of each round's median over windows (window time / K); ratios are medians of per-round ratios.\n", machine(), rounds.len());
    let _ = writeln!(s, "| model | B | T | floor | step If | step Where | host loop | ORT API | If/floor | Where/floor | host/floor | If/ORT API |");
    let _ = writeln!(s, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    let per = |x: &Record| Some(x.us_per_step);
    for k in &keys {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k.0,
            k.1,
            k.2,
            fmt(med(k, "floor", &per)),
            fmt(med(k, "step_if", &per)),
            fmt(med(k, "step_where", &per)),
            fmt(med(k, "host", &per)),
            fmt(med(k, "ort_api", &per)),
            fmt_ratio(ratio(k, "step_if", "floor")),
            fmt_ratio(ratio(k, "step_where", "floor")),
            fmt_ratio(ratio(k, "host", "floor")),
            fmt_ratio(ratio(k, "step_if", "ort_api")),
        );
    }
    let _ = writeln!(s, "\nApplying vs non-applying micro-steps (medians over rounds of per-round medians of single micro-steps, us). ORT API: non-applying = one train_step, applying = train_step + optimizer.step + lazy_reset_grad.\n");
    let _ = writeln!(s, "| model | B | T | floor step | If non-applying | If applying | If non-applying / floor | Where non-applying | host non-applying | host applying | ORT API train_step | ORT API applying |");
    let _ = writeln!(s, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for k in &keys {
        let na = |x: &Record| x.us_nonapply;
        let ap = |x: &Record| x.us_apply;
        let paired = {
            let mut v: Vec<f64> = rounds
                .iter()
                .filter_map(|&r| {
                    Some(
                        cell(k, "step_if", Some(r))?.us_nonapply?
                            / cell(k, "floor", Some(r))?.us_nonapply?,
                    )
                })
                .collect();
            median(&mut v)
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k.0,
            k.1,
            k.2,
            fmt(med(k, "floor", &na)),
            fmt(med(k, "step_if", &na)),
            fmt(med(k, "step_if", &ap)),
            fmt_ratio(paired),
            fmt(med(k, "step_where", &na)),
            fmt(med(k, "host", &na)),
            fmt(med(k, "host", &ap)),
            fmt(med(k, "ort_api", &na)),
            fmt(med(k, "ort_api", &ap)),
        );
    }
    if !profiles.is_empty() {
        let _ = writeln!(s, "\nONNX Runtime's profiler on step If (one run, us; medians over micro-steps): the whole run and the apply `If` node, on non-applying and applying micro-steps.\n");
        let _ = writeln!(s, "| model | B | T | run, non-applying | If node, non-applying | If share | run, applying | If node, applying | else-branch Identities | bytes passed through |");
        let _ = writeln!(s, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
        for p in profiles {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} | {:.1} | {:.0}% | {:.1} | {:.1} | {} | {} |",
                p.model,
                p.batch,
                p.threads,
                p.run_us_nonapply,
                p.if_us_nonapply,
                100.0 * p.if_us_nonapply / p.run_us_nonapply,
                p.run_us_apply,
                p.if_us_apply,
                p.else_identities,
                p.else_bytes
            );
        }
    }
    s
}

fn read_dir_records(dir: &Path) -> Result<(Vec<Record>, Vec<IfProfile>)> {
    let mut records = Vec::new();
    let mut profiles = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    for f in files {
        for line in std::fs::read_to_string(&f)?
            .lines()
            .filter(|l| !l.trim().is_empty())
        {
            if let Ok(p) = serde_json::from_str::<IfProfile>(line) {
                profiles.push(p);
            } else if let Ok(r) = serde_json::from_str::<Record>(line) {
                records.push(r);
            } else {
                bail!("{}: cannot read line: {line}", f.display());
            }
        }
    }
    Ok((records, profiles))
}

// ----------------------------------------------------------------------------- main

fn main() -> Result<()> {
    let o = parse_opts()?;
    if let Some(dir) = &o.report {
        let (records, profiles) = read_dir_records(dir)?;
        print!("{}", report(&records, &profiles));
        return Ok(());
    }
    onnx_ga::runtime::init_onnxruntime()?;
    let prepared: Vec<Prepared> = o
        .models
        .iter()
        .map(|m| prepare(m, o.k))
        .collect::<Result<_>>()?;

    if o.profile_if {
        let out = o
            .out
            .clone()
            .ok_or_else(|| anyhow!("--profile-if needs --out FILE"))?;
        let mut lines = Vec::new();
        for p in &prepared {
            for &batch in &o.batches {
                let prof = profile_if(p, batch, 1, &o, 100)?;
                lines.push(serde_json::to_string(&prof)?);
            }
        }
        append(&out, lines)?;
        return Ok(());
    }
    if o.check {
        for l in check(&prepared, &o)? {
            println!("{l}");
        }
        return Ok(());
    }
    if let Some(r) = o.round {
        let out = o
            .out
            .clone()
            .ok_or_else(|| anyhow!("--round needs --out FILE"))?;
        let t = Instant::now();
        let records = round(&prepared, r, &o)?;
        append(
            &out,
            records.iter().map(|r| serde_json::to_string(r).unwrap()),
        )?;
        eprintln!(
            "step bench: rust round {r}: {} cells in {:.1} s",
            records.len(),
            t.elapsed().as_secs_f64()
        );
        return Ok(());
    }

    // Plain `cargo bench --bench step`: everything Rust-side in this process.
    for l in check(&prepared, &o)? {
        println!("{l}");
    }
    let mut records = Vec::new();
    for r in 0..o.rounds {
        let t = Instant::now();
        records.extend(round(&prepared, r, &o)?);
        eprintln!(
            "step bench: round {r} in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    let mut profiles = Vec::new();
    for p in &prepared {
        profiles.push(profile_if(p, 8, 1, &o, 50)?);
    }
    println!("\n(ORT API column: run `bash benches/run.sh`, which interleaves benches/ort_training_api.py rounds.)\n");
    print!("{}", report(&records, &profiles));
    Ok(())
}
