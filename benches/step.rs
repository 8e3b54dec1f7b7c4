//! Per-micro-step cost of a rewritten gradient-accumulation step against its floor, a host
//! loop and (from `benches/ort_training_api.py`) ONNX Runtime's own training API.
//! See benches/README.md for what every column measures and how to run it.
//!
//! Modes (cargo passes `--bench` to a `harness = false` bench; it is ignored):
//! - no mode flag (`cargo bench --bench step`): a few rounds of the Rust columns in this one
//!   process, then the table (no ORT-API column) and the host-loop check;
//! - `--round N --out FILE`: one round of every Rust column for every configuration, appended
//!   to FILE as JSON lines (benches/run.sh alternates these with Python rounds);
//! - `--check`: the host loop, the step (split), step If and step Where train to the same
//!   parameters (the split bit-identically to step If);
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
use onnx_ga::engine::{Engine, EngineKind, Held};
use onnx_ga::proto::ModelProto;
use onnx_ga::signature::{self, ExplicitRoles};
use onnx_ga::state::Manifest;
use onnx_ga::state::Role;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

const LR: f32 = 0.01;
/// `step`: the Trainer as shipped (an `If` step runs as its two specialisations, see
/// src/split.rs). `step_if`: the same exported graph run whole, its `If` included.
/// `step_tract`: `step` on tract (pure Rust; one thread whatever T says).
const COLUMNS: [&str; 6] = [
    "floor",
    "step",
    "step_if",
    "step_where",
    "host",
    "step_tract",
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
    adamw: onnx_ga::adamw::AdamW,
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
    let adamw = match opt.spec.adamw() {
        Some(a) if a.adam_mode == 1 => a,
        _ => bail!(
            "{model}: the host loop implements AdamW adam_mode=1 only, not {:?}",
            opt.spec
        ),
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
    session: Engine,
    /// The state kept as ONNX Runtime values, as the Trainer keeps it.
    state: BTreeMap<String, Held>,
    /// output name -> input name it feeds back.
    back: Vec<(String, String)>,
    data_inputs: Vec<String>,
    lazy_reset: String,
    k: u64,
}

impl FloorLoop {
    fn new(p: &Prepared, threads: usize, k: u64) -> Result<FloorLoop> {
        Ok(FloorLoop {
            session: Engine::new(EngineKind::Ort, &p.floor, &options(threads))?,
            state: p
                .floor_state(true)?
                .into_iter()
                .map(|(k, v)| (k, Held::Host(v)))
                .collect(),
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
        let reset = Tensor::Bool(ndarray::arr1(&[i.is_multiple_of(self.k)]).into_dyn());
        let mut host: Vec<(&str, &Tensor)> = Vec::with_capacity(self.data_inputs.len() + 1);
        for name in &self.data_inputs {
            host.push((name, &batch[name]));
        }
        host.push((&self.lazy_reset, &reset));
        let held: Vec<(&str, &Held)> = self
            .state
            .iter()
            .filter(|(name, _)| **name != self.lazy_reset)
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        let outputs = self.session.run_held(&host, &held)?;
        let mut by_name: BTreeMap<String, Held> = outputs.into_iter().collect();
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
    adamw: onnx_ga::adamw::AdamW,
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
            adamw: p.adamw.clone(),
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
        let onnx_ga::adamw::AdamW {
            beta1: b1,
            beta2: b2,
            epsilon: eps,
            weight_decay: wd,
            correct_bias: correct,
            ..
        } = self.adamw;
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
        "step" | "step_if" | "step_where" => {
            let model = if column == "step_where" {
                &p.step_where
            } else {
                &p.step_if
            };
            let options = TrainOptions {
                session: options(threads),
                split: column == "step",
                ..TrainOptions::default()
            };
            let mut t = Trainer::with_options(model, &options)?;
            measure(o.k, o.warm, o.cell, |i| {
                Ok(t.step(&batches[(i % nb) as usize], false)?.applied)
            })
        }
        "step_tract" => {
            let options = TrainOptions {
                engine: onnx_ga::engine::EngineKind::Tract,
                session: options(threads),
                ..TrainOptions::default()
            };
            let mut t = Trainer::with_options(&p.step_if, &options)?;
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
                let columns: Vec<&str> = COLUMNS.to_vec();
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
        let whole = TrainOptions {
            split: false,
            ..TrainOptions::default()
        };
        let mut t_if = Trainer::with_options(&p.step_if, &whole)?;
        let mut t_where = Trainer::new(&p.step_where, &options(1))?;
        let mut split = Trainer::new(&p.step_if, &options(1))?;
        if !split.is_split() || t_if.is_split() {
            bail!("{}: the step does not split", p.name);
        }
        for i in 0..steps {
            let b = &batches[(i as usize) % batches.len()];
            let h = host.step(b)?;
            let a = t_if.step(b, false)?.applied;
            let w = t_where.step(b, false)?.applied;
            let sp = split.step(b, false)?.applied;
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
            let sp = split.state().unwrap()[name].as_f32().unwrap();
            let init = p.initializer(name).unwrap();
            let init = init.as_f32().unwrap();
            Zip::from(h)
                .and(a)
                .and(w)
                .and(init)
                .and(sp)
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
    let _ = writeln!(s, "| model | B | T | floor | step | step If | step Where | host loop | ORT API | step/floor | If/floor | Where/floor | host/floor | step/ORT API | tract (T=1) | tract/step |");
    let _ = writeln!(
        s,
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    for k in &keys {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k.0,
            k.1,
            k.2,
            fmt(t.med(k, "floor", per)),
            fmt(t.med(k, "step", per)),
            fmt(t.med(k, "step_if", per)),
            fmt(t.med(k, "step_where", per)),
            fmt(t.med(k, "host", per)),
            fmt(t.med(k, "ort_api", per)),
            fmt_ratio(t.ratio(k, ("step", per), ("floor", per))),
            fmt_ratio(t.ratio(k, ("step_if", per), ("floor", per))),
            fmt_ratio(t.ratio(k, ("step_where", per), ("floor", per))),
            fmt_ratio(t.ratio(k, ("host", per), ("floor", per))),
            fmt_ratio(t.ratio(k, ("step", per), ("ort_api", per))),
            fmt(t.med(k, "step_tract", per)),
            fmt_ratio(t.ratio(k, ("step_tract", per), ("step", per))),
        );
    }
    let _ = writeln!(s, "\nSingle micro-steps (us, medians as above): non-applying and applying (the K-th). ORT API: train_step, and train_step + optimizer.step + lazy_reset_grad. Last column: the mean over windows instead of the median (the tail: preemption, thread-pool wake-ups).\n");
    let _ = writeln!(s, "| model | B | T | floor | step non-applying | step applying | step non-applying / floor | If non-applying | If applying | host non-applying | host applying | ORT API train_step | ORT API applying | mean per step: floor / step / ORT API |");
    let _ = writeln!(
        s,
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    for k in &keys {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} |",
            k.0,
            k.1,
            k.2,
            fmt(t.med(k, "floor", na)),
            fmt(t.med(k, "step", na)),
            fmt(t.med(k, "step", ap)),
            fmt_ratio(t.ratio(k, ("step", na), ("floor", na))),
            fmt(t.med(k, "step_if", na)),
            fmt(t.med(k, "step_if", ap)),
            fmt(t.med(k, "host", na)),
            fmt(t.med(k, "host", ap)),
            fmt(t.med(k, "ort_api", na)),
            fmt(t.med(k, "ort_api", ap)),
            fmt(t.med(k, "floor", mean)),
            fmt(t.med(k, "step", mean)),
            fmt(t.med(k, "ort_api", mean)),
        );
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
