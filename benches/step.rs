//! Per-micro-step cost of a rewritten gradient-accumulation step against its floor, a host
//! loop and (from `benches/ort_training_api.py`) ONNX Runtime's own training API.
//! See benches/README.md for what every column measures and how to run it.
//!
//! Modes (cargo passes `--bench` to a `harness = false` bench; it is ignored):
//! - no mode flag (`cargo bench --bench step`): a few rounds of the Rust columns in this one
//!   process, then the table (no ORT-API column) and the host-loop check;
//! - `--round N --out FILE`: one round of every Rust column for every configuration, appended
//!   to FILE as JSON lines (benches/run.sh alternates these with Python rounds);
//! - `--check`: the host loop, step If, step Where and the two-graph split train to the
//!   same parameters (the split bit-identically to step If);
//! - `--report DIR`: the markdown tables from DIR/*.jsonl.
//!
//! Options: `--models a,b` `--batches 8,32` `--threads 1,2` `--k 4` `--cell-ms 120`
//! `--warm-ms 15` `--rounds 3` `--no-diag` (skip the ORT-value columns v_*).

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
/// `step_tract`: step If on tract (pure Rust; one thread whatever T says).
const COLUMNS: [&str; 5] = ["floor", "step_if", "step_where", "host", "step_tract"];
/// State kept as ORT values (no host copies), one thread: the floor, step If, and the two
/// variants of step If that answer whether the non-applying `If` costs.
const DIAG_COLUMNS: [&str; 5] = [
    "v_floor",
    "v_step_if",
    "v_if_inlined",
    "v_acc_only",
    "v_split",
];

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
    /// Run the ORT-value diagnostic columns (v_*) at one thread.
    diag: bool,
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
        diag: true,
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
            "--no-diag" => o.diag = false,
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
    /// Mean over windows of (window time / K): shows the tail a median hides.
    #[serde(default)]
    us_mean: Option<f64>,
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
) -> Result<Measured> {
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
    let windows = per_step.len();
    let mean = per_step.iter().sum::<f64>() / windows as f64;
    Ok(Measured {
        per_step: median(&mut per_step).unwrap(),
        nonapply: median(&mut nonapply),
        apply: median(&mut apply),
        mean,
        windows,
    })
}

struct Measured {
    per_step: f64,
    nonapply: Option<f64>,
    apply: Option<f64>,
    mean: f64,
    windows: usize,
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
        ..Default::default()
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
            Tensor::Bool(ndarray::arr1(&[i.is_multiple_of(self.k)]).into_dyn()),
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

/// (gradient output, parameter input, accumulator, m, v)
type HostParam = (String, String, ArrayD<f32>, ArrayD<f32>, ArrayD<f32>);

/// (d) What a user writes without onnx-ga: the legalized gradient graph with
/// `lazy_reset_grad` = true (its buffer outputs are then this micro-batch's gradients),
/// gradients summed on the host, and on the K-th micro-step the mean gradient goes through
/// ORT's AdamW (adam_mode 1) on the host; BN statistics fed back.
struct HostLoop {
    session: OrtSession,
    feeds: BTreeMap<String, Tensor>,
    bn_back: Vec<(String, String)>,
    /// (gradient output, parameter input, accumulator, m, v)
    params: Vec<HostParam>,
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
) -> Result<Measured> {
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
        "step_tract" => {
            let engine = onnx_ga::engine::EngineKind::Tract;
            let mut t = Trainer::with_engine(&p.step_if, engine, &options(threads))?;
            measure(o.k, o.warm, o.cell, |i| {
                Ok(t.step(&batches[(i % nb) as usize], false)?.applied)
            })
        }
        "v_split" => {
            let mut l = SplitLoop::new(p, batch, threads)?;
            measure(o.k, o.warm, o.cell, |i| l.step(i))
        }
        v if v.starts_with("v_") => {
            let mut l = value_loop(p, v, batch, threads, o.k)?;
            measure(o.k, o.warm, o.cell, |i| l.step(i))
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
                let mut columns: Vec<&str> = COLUMNS.to_vec();
                if o.diag && threads == 1 {
                    columns.extend(DIAG_COLUMNS);
                }
                for j in 0..columns.len() {
                    let column = columns[(j + r + c) % columns.len()];
                    let m = run_cell(p, column, batch, threads, o)
                        .with_context(|| format!("{} B={batch} T={threads} {column}", p.name))?;
                    out.push(Record {
                        round: r,
                        model: p.name.clone(),
                        batch,
                        threads,
                        column: column.into(),
                        us_per_step: m.per_step,
                        us_nonapply: m.nonapply,
                        us_apply: m.apply,
                        us_mean: Some(m.mean),
                        windows: m.windows,
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
        let mut split = SplitLoop::new(p, 8, 1)?;
        for i in 0..steps {
            let b = &batches[(i as usize) % batches.len()];
            let h = host.step(b)?;
            let a = t_if.step(b, false)?.applied;
            let w = t_where.step(b, false)?.applied;
            let sp = split.step(i)?;
            if h != a || a != w || a != sp || a != (i % o.k == o.k - 1) {
                bail!(
                    "{}: micro-step {i}: applied host={h} If={a} Where={w} split={sp}",
                    p.name
                );
            }
        }
        let (mut d_if, mut d_where, mut d_split, mut moved) = (0f32, 0f32, 0f32, 0f32);
        let mut worst = "";
        for (_, name, ..) in &host.params {
            let h = host.param(name).and_then(Tensor::as_f32).unwrap();
            let a = t_if.state().unwrap()[name].as_f32().unwrap();
            let w = t_where.state().unwrap()[name].as_f32().unwrap();
            let sp = split.value(name)?;
            let init = p.initializer(name).unwrap();
            let init = init.as_f32().unwrap();
            Zip::from(h)
                .and(a)
                .and(w)
                .and(init)
                .and(&sp)
                .for_each(|h, a, w, i, sp| {
                    if (h - a).abs() > d_if {
                        worst = name.as_str();
                    }
                    d_if = d_if.max((h - a).abs());
                    d_split = d_split.max((a - sp).abs());
                    d_where = d_where.max((h - w).abs());
                    moved = moved.max((h - i).abs());
                });
        }
        // 1e-4, not 1e-6: the host sums in a different order, and cnn_bn's conv.bias gradient
        // is rounding noise (BatchNorm follows the conv) that Adam scales up to lr-sized steps.
        let ok = d_if <= 1e-4 && d_where <= 1e-4 && d_split == 0.0 && moved > 1e-3;
        lines.push(format!(
            "check {}: after {} windows of K={} x B=8, max |host - step If| = {d_if:.2e} ({worst}), max |host - step Where| = {d_where:.2e}, max |step If - split| = {d_split:.1e} (parameters moved up to {moved:.2e}) {}",
            p.name, 3, o.k, if ok { "ok" } else { "MISMATCH" }
        ));
        if !ok {
            bail!("{}", lines.last().unwrap());
        }
    }
    Ok(lines)
}

// ----------------------------------------------------------------------------- state kept as ORT values

/// Diagnostic variants of step If, for the question whether the non-applying `If` costs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    /// The apply `If` replaced by its else branch (Identity nodes) in the main graph: same
    /// inputs and outputs, never applies. Against step If: the cost of the `If` itself.
    Inlined,
    /// The apply `If` removed, and with it every output that only passes state through
    /// unchanged (parameters, moments, optimizer step): accumulate-only. This is the
    /// per-micro-step graph of a two-graph split (accumulate every micro-step, apply once).
    AccumulateOnly,
}

/// Names a node reads, including those its subgraphs read from outer scopes.
fn node_uses(n: &onnx_ga::proto::NodeProto, out: &mut std::collections::HashSet<String>) {
    for i in n.input.iter().filter(|i| !i.is_empty()) {
        out.insert(i.clone());
    }
    for a in &n.attribute {
        for g in a.g.iter().chain(a.graphs.iter()) {
            for sn in &g.node {
                node_uses(sn, out);
            }
            for o in &g.output {
                out.insert(o.name().to_string());
            }
        }
    }
}

/// The variant, and for every output the `If` produced from an outer value without
/// change in its else branch: (outer value, output).
fn variant(
    step: &ModelProto,
    manifest: &Manifest,
    v: Variant,
) -> Result<(ModelProto, Vec<(String, String)>)> {
    let mut m = step.clone();
    let g = m.graph.as_mut().ok_or_else(|| anyhow!("no graph"))?;
    let pos = g
        .node
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op_type() == "If")
        .max_by_key(|(_, n)| n.output.len())
        .map(|(i, _)| i)
        .ok_or_else(|| anyhow!("step If has no If node"))?;
    let node = g.node.remove(pos);
    let else_g = node
        .attribute
        .iter()
        .find(|a| a.name() == "else_branch")
        .and_then(|a| a.g.clone())
        .ok_or_else(|| anyhow!("If without else branch"))?;
    let mut inlined = Vec::new();
    let mut aliases = Vec::new();
    let mut dropped = std::collections::HashSet::new();
    for (j, out) in node.output.iter().enumerate() {
        let else_out = else_g
            .output
            .get(j)
            .map(|o| o.name().to_string())
            .unwrap_or_default();
        let src = else_g
            .node
            .iter()
            .find(|n| n.output.first() == Some(&else_out) && n.op_type() == "Identity")
            .map(|n| n.input[0].clone())
            .ok_or_else(|| {
                anyhow!("else output '{else_out}' is not an Identity of an outer value")
            })?;
        let unchanged = manifest
            .state
            .iter()
            .any(|e| &e.output == out && e.input == src);
        aliases.push((src.clone(), out.clone()));
        if v == Variant::AccumulateOnly && unchanged {
            dropped.insert(out.clone());
            continue;
        }
        inlined.push(onnx_ga::proto::NodeProto {
            op_type: Some("Identity".into()),
            name: Some(format!("bench_inlined_else_{j}")),
            input: vec![src],
            output: vec![out.clone()],
            ..Default::default()
        });
    }
    g.node.splice(pos..pos, inlined);
    g.output.retain(|o| !dropped.contains(o.name()));
    // Dead code: nodes are in topological order, so one backward sweep.
    let mut needed: std::collections::HashSet<String> =
        g.output.iter().map(|o| o.name().to_string()).collect();
    let mut keep = vec![false; g.node.len()];
    for (i, n) in g.node.iter().enumerate().rev() {
        if n.output.iter().any(|o| needed.contains(o)) {
            keep[i] = true;
            node_uses(n, &mut needed);
        }
    }
    let mut it = keep.into_iter();
    g.node.retain(|_| it.next().unwrap());
    g.input.retain(|i| needed.contains(i.name()));
    g.initializer.retain(|t| needed.contains(t.name()));
    Ok((m, aliases))
}

/// The apply half of a two-graph split: the apply `If`'s then branch as a graph of its own.
/// Its inputs are the outer values the branch reads: state and initializer-backed inputs
/// of the step under their names, and values the accumulate graph computes (the new
/// accumulator sums, the micro-step count) under their step-graph names; its outputs are
/// the `If`'s outputs.
fn apply_graph(step: &ModelProto, aliases: &[(String, String)]) -> Result<ModelProto> {
    use onnx_ga::proto::{GraphProto, ValueInfoProto};
    let g = step.graph.as_ref().ok_or_else(|| anyhow!("no graph"))?;
    let node = g
        .node
        .iter()
        .filter(|n| n.op_type() == "If")
        .max_by_key(|n| n.output.len())
        .ok_or_else(|| anyhow!("step If has no If node"))?;
    let then_g = node
        .attribute
        .iter()
        .find(|a| a.name() == "then_branch")
        .and_then(|a| a.g.clone())
        .ok_or_else(|| anyhow!("If without then branch"))?;
    // Then-branch outputs take the If's output names: renamed where a node makes them, an
    // Identity where the branch passes an initializer or outer value out directly.
    let made: std::collections::HashSet<String> = then_g
        .node
        .iter()
        .flat_map(|n| n.output.iter().cloned())
        .collect();
    let mut rename: BTreeMap<String, String> = BTreeMap::new();
    let mut nodes = then_g.node.clone();
    for (o, target) in then_g
        .output
        .iter()
        .map(|o| o.name().to_string())
        .zip(node.output.iter().cloned())
    {
        if made.contains(&o) {
            rename.insert(o, target);
        } else {
            nodes.push(onnx_ga::proto::NodeProto {
                op_type: Some("Identity".into()),
                name: Some(format!("bench_apply_out_{target}")),
                input: vec![o],
                output: vec![target],
                ..Default::default()
            });
        }
    }
    for n in &mut nodes {
        for x in n.output.iter_mut().chain(n.input.iter_mut()) {
            if let Some(r) = rename.get(x) {
                *x = r.clone();
            }
        }
    }
    let mut produced: std::collections::HashSet<String> = nodes
        .iter()
        .flat_map(|n| n.output.iter().cloned())
        .collect();
    produced.extend(then_g.initializer.iter().map(|t| t.name().to_string()));
    let mut used = std::collections::HashSet::new();
    for n in &nodes {
        node_uses(n, &mut used);
    }
    let mut outer: Vec<String> = used.into_iter().filter(|u| !produced.contains(u)).collect();
    outer.sort();
    let mut inputs: Vec<ValueInfoProto> = Vec::new();
    let mut initializer = then_g.initializer.clone();
    for name in &outer {
        let init = g.initializer.iter().find(|t| t.name() == name);
        if let Some(i) = g.input.iter().find(|i| i.name() == name) {
            inputs.push(i.clone());
            initializer.extend(init.cloned());
        } else if let Some(init) = init {
            initializer.push(init.clone());
        } else if let Some((_, out)) = aliases.iter().find(|(src, _)| src == name) {
            let mut vi = g
                .output
                .iter()
                .find(|o| o.name() == out)
                .cloned()
                .ok_or_else(|| anyhow!("no output '{out}'"))?;
            vi.name = Some(name.clone());
            inputs.push(vi);
        } else {
            bail!("the apply branch reads '{name}', which the accumulate graph does not output");
        }
    }
    let outputs: Vec<ValueInfoProto> = node
        .output
        .iter()
        .map(|o| {
            g.output
                .iter()
                .find(|x| x.name() == o)
                .cloned()
                .ok_or_else(|| anyhow!("If output '{o}' is not a graph output"))
        })
        .collect::<Result<_>>()?;
    let mut m = step.clone();
    m.metadata_props.clear();
    m.graph = Some(GraphProto {
        name: Some("apply".into()),
        node: nodes,
        input: inputs,
        output: outputs,
        initializer,
        ..Default::default()
    });
    Ok(m)
}

/// The Trainer's loop with the state kept as ONNX Runtime values: each output value is fed
/// as the next run's input as is (no host copy in or out), data converted once up front.
/// What IoBinding ping-pong buffers give on CUDA, here on CPU.
struct ValueLoop {
    session: ort::session::Session,
    batches: Vec<Vec<(String, ort::value::DynValue)>>,
    /// (input, output, current value)
    state: Vec<(String, String, ort::value::DynValue)>,
    consts: Vec<(String, ort::value::DynValue)>,
    /// The floor's `lazy_reset_grad`: (input, true, false).
    reset: Option<(String, ort::value::DynValue, ort::value::DynValue)>,
    k: u64,
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

impl ValueLoop {
    /// `pairs`: state (input, output) pairs; `initial`: every input's starting value.
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: &ModelProto,
        threads: usize,
        k: u64,
        data: &[BTreeMap<String, Tensor>],
        data_inputs: &[String],
        pairs: &[(String, String)],
        initial: &BTreeMap<String, Tensor>,
        reset: Option<&str>,
    ) -> Result<ValueLoop> {
        let g = model.graph.as_ref().unwrap();
        let inputs: Vec<&str> = g.input.iter().map(|i| i.name()).collect();
        let outputs: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
        let mut state = Vec::new();
        let mut consts = Vec::new();
        for name in inputs
            .iter()
            .filter(|n| !data_inputs.iter().any(|d| d == *n) && Some(**n) != reset)
        {
            let Some(value) = initial.get(*name) else {
                continue;
            }; // initializer default
            match pairs
                .iter()
                .find(|(i, o)| i == name && outputs.contains(&o.as_str()))
            {
                Some((i, o)) => state.push((i.clone(), o.clone(), to_ort(value)?)),
                None => consts.push((name.to_string(), to_ort(value)?)),
            }
        }
        let reset = match reset {
            Some(r) => Some((
                r.to_string(),
                to_ort(&Tensor::Bool(ndarray::arr1(&[true]).into_dyn()))?,
                to_ort(&Tensor::Bool(ndarray::arr1(&[false]).into_dyn()))?,
            )),
            None => None,
        };
        let batches = data
            .iter()
            .map(|b| {
                data_inputs
                    .iter()
                    .map(|n| Ok((n.clone(), to_ort(&b[n])?)))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let mut builder = onnx_ga::runtime::session_builder()?;
        builder = builder
            .with_intra_threads(threads)
            .map_err(|e| anyhow!("{e}"))?;
        builder = builder
            .with_optimization_level(ort::session::builder::GraphOptimizationLevel::All)
            .map_err(|e| anyhow!("{e}"))?;
        let session = builder.commit_from_memory(&onnx_ga::model::encode_model(model))?;
        Ok(ValueLoop {
            session,
            batches,
            state,
            consts,
            reset,
            k,
        })
    }

    fn step(&mut self, i: u64) -> Result<bool> {
        use ort::session::SessionInputValue;
        use std::borrow::Cow;
        let b = &self.batches[(i % self.batches.len() as u64) as usize];
        let mut feeds: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(b.len() + self.state.len() + self.consts.len() + 1);
        for (n, v) in b.iter().chain(self.consts.iter()) {
            feeds.push((Cow::Borrowed(n.as_str()), v.into()));
        }
        for (n, _, v) in &self.state {
            feeds.push((Cow::Borrowed(n.as_str()), v.into()));
        }
        if let Some((n, t, f)) = &self.reset {
            feeds.push((
                Cow::Borrowed(n.as_str()),
                if i.is_multiple_of(self.k) { t } else { f }.into(),
            ));
        }
        let mut out = self.session.run(feeds)?;
        let mut next = Vec::with_capacity(self.state.len());
        for (_, o, _) in &self.state {
            next.push(
                out.remove(o.as_str())
                    .ok_or_else(|| anyhow!("no output '{o}'"))?,
            );
        }
        drop(out);
        for (slot, v) in self.state.iter_mut().zip(next) {
            slot.2 = v;
        }
        Ok(self.reset.is_none() && i % self.k == self.k - 1)
    }
}

/// Fix candidate, a two-graph split: every micro-step runs the accumulate-only graph
/// (`Variant::AccumulateOnly`); when it reports `ga.applied`, the apply graph
/// ([`apply_graph`]) runs once on the new sums. State kept as ORT values, by index.
struct SplitLoop {
    acc: ort::session::Session,
    apply: ort::session::Session,
    batches: Vec<Vec<(String, ort::value::DynValue)>>,
    names: Vec<String>,
    values: Vec<ort::value::DynValue>,
    acc_in: Vec<(String, usize)>,
    acc_out: Vec<(String, usize)>,
    apply_in: Vec<(String, usize)>,
    apply_out: Vec<(String, usize)>,
}

fn session(model: &ModelProto, threads: usize) -> Result<ort::session::Session> {
    let mut builder = onnx_ga::runtime::session_builder()?;
    builder = builder
        .with_intra_threads(threads)
        .map_err(|e| anyhow!("{e}"))?;
    builder = builder
        .with_optimization_level(ort::session::builder::GraphOptimizationLevel::All)
        .map_err(|e| anyhow!("{e}"))?;
    Ok(builder.commit_from_memory(&onnx_ga::model::encode_model(model))?)
}

impl SplitLoop {
    fn new(p: &Prepared, batch: usize, threads: usize) -> Result<SplitLoop> {
        let manifest = Manifest::from_model(&p.step_if)?;
        let (acc, aliases) = variant(&p.step_if, &manifest, Variant::AccumulateOnly)?;
        let apply = apply_graph(&p.step_if, &aliases)?;
        let g = p.step_if.graph.as_ref().unwrap();
        let idx = |input: &str| manifest.state.iter().position(|e| e.input == input);
        let idx_of_output = |output: &str| manifest.state.iter().position(|e| e.output == output);
        let mut values = Vec::new();
        for e in &manifest.state {
            let init = g
                .initializer
                .iter()
                .find(|t| t.name() == e.input)
                .ok_or_else(|| anyhow!("no initializer for '{}'", e.input))?;
            values.push(to_ort(
                &Tensor::from_tensor_proto(init).map_err(|m| anyhow!(m))?,
            )?);
        }
        let ins = |m: &ModelProto| -> Vec<String> {
            m.graph
                .as_ref()
                .unwrap()
                .input
                .iter()
                .map(|i| i.name().to_string())
                .collect()
        };
        let outs = |m: &ModelProto| -> Vec<String> {
            m.graph
                .as_ref()
                .unwrap()
                .output
                .iter()
                .map(|i| i.name().to_string())
                .collect()
        };
        let acc_in = ins(&acc)
            .into_iter()
            .filter_map(|n| idx(&n).map(|i| (n, i)))
            .collect();
        let acc_out = outs(&acc)
            .into_iter()
            .filter_map(|n| idx_of_output(&n).map(|i| (n, i)))
            .collect();
        let mut apply_in = Vec::new();
        for n in ins(&apply) {
            if let Some(i) = idx(&n) {
                apply_in.push((n, i));
            } else if let Some(i) = aliases
                .iter()
                .find(|(src, _)| *src == n)
                .and_then(|(_, out)| idx_of_output(out))
            {
                apply_in.push((n, i));
            }
        }
        let apply_out = outs(&apply)
            .into_iter()
            .filter_map(|n| idx_of_output(&n).map(|i| (n, i)))
            .collect();
        let batches = p
            .batches(batch)
            .iter()
            .map(|b| {
                manifest
                    .data_inputs
                    .iter()
                    .map(|n| Ok((n.clone(), to_ort(&b[n])?)))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        Ok(SplitLoop {
            acc: session(&acc, threads)?,
            apply: session(&apply, threads)?,
            batches,
            names: manifest.state.iter().map(|e| e.input.clone()).collect(),
            values,
            acc_in,
            acc_out,
            apply_in,
            apply_out,
        })
    }

    fn run(
        session: &mut ort::session::Session,
        values: &mut [ort::value::DynValue],
        data: &[(String, ort::value::DynValue)],
        ins: &[(String, usize)],
        outs: &[(String, usize)],
    ) -> Result<bool> {
        use ort::session::SessionInputValue;
        use std::borrow::Cow;
        let mut feeds: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(data.len() + ins.len());
        for (n, v) in data {
            feeds.push((Cow::Borrowed(n.as_str()), v.into()));
        }
        for (n, i) in ins {
            feeds.push((Cow::Borrowed(n.as_str()), (&values[*i]).into()));
        }
        let mut out = session.run(feeds)?;
        let applied = match out.get("ga.applied") {
            Some(v) => v
                .try_extract_array::<bool>()?
                .iter()
                .next()
                .copied()
                .unwrap_or(false),
            None => false,
        };
        let mut next = Vec::with_capacity(outs.len());
        for (o, i) in outs {
            next.push((
                *i,
                out.remove(o.as_str())
                    .ok_or_else(|| anyhow!("no output '{o}'"))?,
            ));
        }
        drop(out);
        for (i, v) in next {
            values[i] = v;
        }
        Ok(applied)
    }

    /// A float state value, by state input name.
    fn value(&self, name: &str) -> Result<ArrayD<f32>> {
        let i = self
            .names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| anyhow!("no state '{name}'"))?;
        Ok(self.values[i].try_extract_array::<f32>()?.to_owned())
    }

    fn step(&mut self, i: u64) -> Result<bool> {
        let b = &self.batches[(i % self.batches.len() as u64) as usize];
        let applied = Self::run(
            &mut self.acc,
            &mut self.values,
            b,
            &self.acc_in,
            &self.acc_out,
        )?;
        if applied {
            Self::run(
                &mut self.apply,
                &mut self.values,
                &[],
                &self.apply_in,
                &self.apply_out,
            )?;
        }
        Ok(applied)
    }
}

/// The ORT-value loops: the floor, step If, and the two variants.
fn value_loop(
    p: &Prepared,
    column: &str,
    batch: usize,
    threads: usize,
    k: u64,
) -> Result<ValueLoop> {
    let data = p.batches(batch);
    let data_inputs = &p.floor_manifest.data_inputs;
    if column == "v_floor" {
        let pairs: Vec<(String, String)> = p
            .floor_manifest
            .state
            .iter()
            .map(|e| (e.input.clone(), e.output.clone()))
            .collect();
        return ValueLoop::new(
            &p.floor,
            threads,
            k,
            &data,
            data_inputs,
            &pairs,
            &p.floor_state(true)?,
            Some(&p.lazy_reset),
        );
    }
    let manifest = Manifest::from_model(&p.step_if)?;
    let model = match column {
        "v_step_if" => p.step_if.clone(),
        "v_split" => bail!("v_split is a SplitLoop"),
        "v_if_inlined" => variant(&p.step_if, &manifest, Variant::Inlined)?.0,
        "v_acc_only" => variant(&p.step_if, &manifest, Variant::AccumulateOnly)?.0,
        other => bail!("unknown column {other}"),
    };
    let g = p.step_if.graph.as_ref().unwrap();
    let mut initial = BTreeMap::new();
    for e in &manifest.state {
        let init = g
            .initializer
            .iter()
            .find(|t| t.name() == e.input)
            .ok_or_else(|| anyhow!("no initializer for '{}'", e.input))?;
        initial.insert(
            e.input.clone(),
            Tensor::from_tensor_proto(init).map_err(|m| anyhow!(m))?,
        );
    }
    let pairs: Vec<(String, String)> = manifest
        .state
        .iter()
        .map(|e| (e.input.clone(), e.output.clone()))
        .collect();
    ValueLoop::new(
        &model,
        threads,
        k,
        &data,
        data_inputs,
        &pairs,
        &initial,
        None,
    )
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

type Key = (String, usize, usize);

struct Table<'a> {
    records: &'a [Record],
    rounds: std::collections::BTreeSet<usize>,
}

impl Table<'_> {
    fn cell(&self, k: &Key, col: &str, r: usize) -> Option<&Record> {
        self.records.iter().find(|x| {
            x.model == k.0 && x.batch == k.1 && x.threads == k.2 && x.column == col && x.round == r
        })
    }

    /// Median over rounds of a field of one column.
    fn med(&self, k: &Key, col: &str, f: fn(&Record) -> Option<f64>) -> Option<f64> {
        let mut v: Vec<f64> = self
            .rounds
            .iter()
            .filter_map(|&r| f(self.cell(k, col, r)?))
            .collect();
        median(&mut v)
    }

    /// Median over rounds of the per-round ratio (both cells of a ratio come from the same
    /// round, so drift between rounds cancels).
    fn ratio(
        &self,
        k: &Key,
        a: (&str, fn(&Record) -> Option<f64>),
        b: (&str, fn(&Record) -> Option<f64>),
    ) -> Option<f64> {
        let mut v: Vec<f64> = self
            .rounds
            .iter()
            .filter_map(|&r| Some(a.1(self.cell(k, a.0, r)?)? / b.1(self.cell(k, b.0, r)?)?))
            .collect();
        median(&mut v)
    }

    /// Median over rounds of the per-round difference a - b.
    fn diff(
        &self,
        k: &Key,
        a: (&str, fn(&Record) -> Option<f64>),
        b: (&str, fn(&Record) -> Option<f64>),
    ) -> Option<f64> {
        let mut v: Vec<f64> = self
            .rounds
            .iter()
            .filter_map(|&r| Some(a.1(self.cell(k, a.0, r)?)? - b.1(self.cell(k, b.0, r)?)?))
            .collect();
        median(&mut v)
    }
}

fn per(x: &Record) -> Option<f64> {
    Some(x.us_per_step)
}
fn na(x: &Record) -> Option<f64> {
    x.us_nonapply
}
fn ap(x: &Record) -> Option<f64> {
    x.us_apply
}
fn mean(x: &Record) -> Option<f64> {
    x.us_mean
}

fn report(records: &[Record]) -> String {
    use std::fmt::Write as _;
    let mut keys: Vec<Key> = Vec::new();
    for r in records {
        let k = (r.model.clone(), r.batch, r.threads);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    let t = Table {
        records,
        rounds: records.iter().map(|r| r.round).collect(),
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Machine: {}. {} rounds. K = 4. Microseconds per micro-step: each cell is the median over rounds of that round's median over windows of (window time / K). Ratios are medians over rounds of the per-round ratio.\n",
        machine(),
        t.rounds.len()
    );
    let _ = writeln!(s, "| model | B | T | floor | step If | step Where | host loop | ORT API | If/floor | Where/floor | host/floor | If/ORT API | tract (T=1) | tract/If |");
    let _ = writeln!(
        s,
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    for k in &keys {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k.0,
            k.1,
            k.2,
            fmt(t.med(k, "floor", per)),
            fmt(t.med(k, "step_if", per)),
            fmt(t.med(k, "step_where", per)),
            fmt(t.med(k, "host", per)),
            fmt(t.med(k, "ort_api", per)),
            fmt_ratio(t.ratio(k, ("step_if", per), ("floor", per))),
            fmt_ratio(t.ratio(k, ("step_where", per), ("floor", per))),
            fmt_ratio(t.ratio(k, ("host", per), ("floor", per))),
            fmt_ratio(t.ratio(k, ("step_if", per), ("ort_api", per))),
            fmt(t.med(k, "step_tract", per)),
            fmt_ratio(t.ratio(k, ("step_tract", per), ("step_if", per))),
        );
    }
    let _ = writeln!(s, "\nSingle micro-steps (us, medians as above): non-applying and applying (the K-th). ORT API: train_step, and train_step + optimizer.step + lazy_reset_grad. Last column: the mean over windows instead of the median (the tail: preemption, thread-pool wake-ups).\n");
    let _ = writeln!(s, "| model | B | T | floor | If non-applying | If applying | If non-applying / floor | Where non-applying | host non-applying | host applying | ORT API train_step | ORT API applying | mean per step: floor / If / ORT API |");
    let _ = writeln!(s, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for k in &keys {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} |",
            k.0,
            k.1,
            k.2,
            fmt(t.med(k, "floor", na)),
            fmt(t.med(k, "step_if", na)),
            fmt(t.med(k, "step_if", ap)),
            fmt_ratio(t.ratio(k, ("step_if", na), ("floor", na))),
            fmt(t.med(k, "step_where", na)),
            fmt(t.med(k, "host", na)),
            fmt(t.med(k, "host", ap)),
            fmt(t.med(k, "ort_api", na)),
            fmt(t.med(k, "ort_api", ap)),
            fmt(t.med(k, "floor", mean)),
            fmt(t.med(k, "step_if", mean)),
            fmt(t.med(k, "ort_api", mean)),
        );
    }
    let diag: Vec<&Key> = keys
        .iter()
        .filter(|k| t.med(k, "v_step_if", na).is_some())
        .collect();
    if !diag.is_empty() {
        let _ = writeln!(s, "\nState kept as ORT values (each output value fed back as the next input, no host copy), one thread, us per micro-step. `If inlined`: step If with the apply `If` replaced by its else-branch Identities in the main graph (never applies). `acc-only`: the `If` and every pass-through output (parameters, moments, optimizer step) removed. `split`: acc-only every micro-step plus the apply branch as a graph of its own on the K-th (trains bit-identically to step If).\n");
        let _ = writeln!(s, "| model | B | floor | step If | If non-applying | If applying | If inlined | acc-only | split | If/floor | split/floor | `If` node: If non-applying − inlined | pass-through outputs: inlined − acc-only | host copies: Trainer − ORT values (If non-applying) |");
        let _ = writeln!(
            s,
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
        );
        for k in diag {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                k.0,
                k.1,
                fmt(t.med(k, "v_floor", per)),
                fmt(t.med(k, "v_step_if", per)),
                fmt(t.med(k, "v_step_if", na)),
                fmt(t.med(k, "v_step_if", ap)),
                fmt(t.med(k, "v_if_inlined", per)),
                fmt(t.med(k, "v_acc_only", per)),
                fmt(t.med(k, "v_split", per)),
                fmt_ratio(t.ratio(k, ("v_step_if", per), ("v_floor", per))),
                fmt_ratio(t.ratio(k, ("v_split", per), ("v_floor", per))),
                fmt(t.diff(k, ("v_step_if", na), ("v_if_inlined", per))),
                fmt(t.diff(k, ("v_if_inlined", per), ("v_acc_only", per))),
                fmt(t.diff(k, ("step_if", na), ("v_step_if", na))),
            );
        }
    }
    s
}

fn read_dir_records(dir: &Path) -> Result<Vec<Record>> {
    let mut records = Vec::new();
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
            let r: Record = serde_json::from_str(line)
                .with_context(|| format!("{}: cannot read line: {line}", f.display()))?;
            records.push(r);
        }
    }
    Ok(records)
}

// ----------------------------------------------------------------------------- main

fn main() -> Result<()> {
    let o = parse_opts()?;
    if let Some(dir) = &o.report {
        print!("{}", report(&read_dir_records(dir)?));
        return Ok(());
    }
    onnx_ga::runtime::init_onnxruntime()?;
    let prepared: Vec<Prepared> = o
        .models
        .iter()
        .map(|m| prepare(m, o.k))
        .collect::<Result<_>>()?;
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

    // Plain `cargo bench --bench step`: the Rust columns, rounds in this one process.
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
    println!("\n(No ORT API column here: `bash benches/run.sh` interleaves benches/ort_training_api.py rounds with these.)\n");
    print!("{}", report(&records));
    Ok(())
}
