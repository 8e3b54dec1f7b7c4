//! Peak memory of K micro-batches of B against one batch of K*B: the gradient-accumulation
//! step (`onnx_ga::train::Trainer` on ONNX Runtime, one thread) trained on the same N = K*B
//! samples per window, side by side. See benches/memory.md for what is measured and the
//! results.
//!
//! Peak RSS is per process, so every configuration runs in a fresh child process: this
//! executable re-run with `--child MODEL N K`, which prints one JSON line. The parent runs
//! every configuration `--reps` times (the order rotates per repetition) and prints the
//! medians as a markdown table.
//!
//! Modes (cargo passes `--bench` to a `harness = false` bench; it is ignored):
//! - no mode flag (`cargo bench --bench memory`): the parameter check, then the children,
//!   then the table; raw lines and the table go to `--out DIR` (default
//!   `target/bench-memory`);
//! - `--check`: K micro-batches of B and one batch of K*B end a few windows with parameters
//!   within 1e-5 (cnn_bn is reported but not checked: BatchNorm normalises each micro-batch
//!   with its own statistics, so its gradients legitimately differ);
//! - `--child MODEL N K`: one configuration, one JSON line on stdout.
//!
//! Variants (`--variants a,b`; every child runs one): `trainer`, the `Trainer` as shipped
//! (sessions from `SessionOptions`: ONNX Runtime's CPU arena and memory pattern on, as
//! ONNX Runtime defaults them); `hand`, `hand-noarena`, `hand-nopattern`,
//! `hand-noarena-nopattern`: [`HandLoop`], the Trainer's split runner mirrored with
//! sessions from `onnx_ga::runtime::session_builder()`, because `SessionOptions` has no
//! allocator setting. `hand` (ONNX Runtime's defaults) checks that the mirror measures what
//! the Trainer does.
//!
//! Options: `--models a,b` `--n 1024,4096` `--k 1,4,16,64` `--reps 5` `--windows 8`
//! `--variants ...` `--out DIR`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};

use onnx_ga::data::{read_npz, Tensor};
use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::proto::ModelProto;
use onnx_ga::signature::{self, ExplicitRoles};
use onnx_ga::state::Role;
use onnx_ga::train::{micro_batch, Trainer};

const LR: f32 = 0.01;
/// The models with real activations (conv + BatchNorm, attention, MLP + cross-entropy).
const MODELS: [&str; 3] = ["cnn_bn", "transformer_block", "mlp_ce_adamw"];
/// Parameter agreement the check asks for (K micro-batches against one batch of K*B).
const TOLERANCE: f32 = 1e-5;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

// ----------------------------------------------------------------------------- options

#[derive(Clone, Debug)]
struct Opts {
    models: Vec<String>,
    n: Vec<usize>,
    k: Vec<usize>,
    reps: usize,
    /// Windows per child run: the first warms up, the rest are timed.
    windows: usize,
    out: PathBuf,
    check: bool,
    /// `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without
    /// it, and then only the check runs (a test, not a measurement).
    bench: bool,
    child: Option<(String, usize, usize)>,
    variants: Vec<String>,
}

fn parse_opts() -> Result<Opts> {
    let mut o = Opts {
        models: MODELS.iter().map(|m| m.to_string()).collect(),
        n: vec![1024, 4096],
        k: vec![1, 4, 16, 64],
        reps: 5,
        windows: 8,
        out: root().join("target").join("bench-memory"),
        check: false,
        bench: false,
        child: None,
        variants: [
            "trainer",
            "hand",
            "hand-noarena",
            "hand-nopattern",
            "hand-noarena-nopattern",
        ]
        .iter()
        .map(|v| v.to_string())
        .collect(),
    };
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
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => o.bench = true,
            "--models" => o.models = list(args.next(), "--models")?,
            "--n" => o.n = list(args.next(), "--n")?,
            "--k" => o.k = list(args.next(), "--k")?,
            "--reps" => o.reps = one(args.next(), "--reps")?,
            "--windows" => o.windows = one(args.next(), "--windows")?,
            "--out" => o.out = PathBuf::from(one::<String>(args.next(), "--out")?),
            "--check" => o.check = true,
            "--variants" => o.variants = list(args.next(), "--variants")?,
            "--child" => {
                let model: String = one(args.next(), "--child MODEL")?;
                let n = one(args.next(), "--child N")?;
                let k = one(args.next(), "--child K")?;
                o.child = Some((model, n, k));
            }
            other if other.starts_with('-') => eprintln!("memory bench: ignoring option {other}"),
            _ => {}
        }
    }
    if o.windows < 2 {
        bail!("--windows must be at least 2 (one warm-up, one timed)");
    }
    Ok(o)
}

// ----------------------------------------------------------------------------- memory

/// `VmRSS`, `VmHWM` of this process in KiB, from /proc/self/status (Linux).
fn vm_kib() -> Result<(u64, u64)> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let field = |key: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(key))
            .ok_or_else(|| anyhow!("/proc/self/status has no {key}"))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .map_err(|_| anyhow!("cannot read '{line}'"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Resets `VmHWM` to the current RSS (Linux >= 4.0: `echo 5 > /proc/self/clear_refs`), so
/// the peak read at the end belongs to the training alone. Returns whether it worked.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Returns freed heap to the system before the baseline is read, so that the baseline is
/// what the process holds, not what glibc kept from the rewrite.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: glibc's malloc_trim only releases free heap pages; no Rust invariant
        // depends on them.
        unsafe {
            malloc_trim(0);
        }
    }
}

// ----------------------------------------------------------------------------- child

/// What one child run reports (memory in KiB).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Run {
    /// `trainer`, or the hand loop with its allocator settings (see [`alloc`]).
    variant: String,
    model: String,
    n: usize,
    k: usize,
    b: usize,
    /// VmRSS just before the Trainer is created (ONNX Runtime loaded, step built, data and
    /// micro-batches made).
    rss_base: u64,
    /// VmHWM at that point, before the reset (the rewrite's own peak).
    hwm_before: u64,
    /// Whether VmHWM could be reset at the baseline.
    hwm_reset: bool,
    /// VmRSS right after `Trainer::new` (sessions made, nothing run).
    rss_trainer: u64,
    /// VmHWM at the end of the run: the peak RSS.
    hwm: u64,
    /// VmRSS at the end.
    rss_end: u64,
    /// Milliseconds per window, first (warm-up) window included.
    ms_windows: Vec<f64>,
    loss: f32,
}

fn build(model: &str, k: usize) -> Result<ModelProto> {
    let graph = signature::open(
        &root().join("graphs").join(model),
        &ExplicitRoles::default(),
    )
    .map_err(|e| anyhow!("{model}: {e}"))?;
    let spec = format!("grad-accum(steps={k}),optimizer(lr={LR}),legalize-ort,dce");
    let step = onnx_ga::step::build_step(graph, &spec, false)
        .map_err(|e| anyhow!("{model}: {spec}: {e}"))?;
    Ok(step.model.to_proto())
}

fn options() -> SessionOptions {
    SessionOptions {
        threads: 1,
        optimize: true,
        ..Default::default()
    }
}

/// The distinct micro-batches of B samples (micro-step i uses `i % len`), as
/// `onnx_ga::train::micro_batch` makes them: samples `[i*B, (i+1)*B)` mod 64.
fn batches(data: &BTreeMap<String, Tensor>, b: usize) -> Vec<BTreeMap<String, Tensor>> {
    let samples = data.values().next().map(|t| t.shape()[0]).unwrap_or(1);
    let distinct = samples / gcd(samples, b % samples);
    (0..distinct as u64)
        .map(|i| micro_batch(data, samples, b, i))
        .collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn data(model: &str) -> Result<BTreeMap<String, Tensor>> {
    Ok(read_npz(
        &root().join("graphs").join(model).join("data.npz"),
    )?)
}

/// What trains in a child: the `Trainer` as shipped, or the hand loop with chosen
/// allocator settings.
enum Runner {
    Trainer(Box<Trainer>),
    Hand(Box<HandLoop>),
}

/// The variants: `trainer` (split, as shipped), `trainer-whole` (one session over the
/// exported graph, `--no-split`), and `hand` (ONNX Runtime's defaults), `hand-noarena`,
/// `hand-nopattern`, `hand-noarena-nopattern`.
fn alloc(variant: &str) -> Result<Option<Alloc>> {
    Ok(match variant {
        "trainer" | "trainer-whole" => None,
        "hand" => Some(Alloc {
            arena: true,
            pattern: true,
        }),
        "hand-noarena" => Some(Alloc {
            arena: false,
            pattern: true,
        }),
        "hand-nopattern" => Some(Alloc {
            arena: true,
            pattern: false,
        }),
        "hand-noarena-nopattern" => Some(Alloc {
            arena: false,
            pattern: false,
        }),
        other => bail!("unknown variant '{other}'"),
    })
}

impl Runner {
    fn new(step: &ModelProto, k: usize, variant: &str) -> Result<Runner> {
        Ok(match alloc(variant)? {
            None => {
                let options = onnx_ga::train::TrainOptions {
                    session: options(),
                    split: variant != "trainer-whole",
                    ..Default::default()
                };
                Runner::Trainer(Box::new(Trainer::with_options(step, &options)?))
            }
            Some(a) => Runner::Hand(Box::new(HandLoop::new(step, k, a)?)),
        })
    }

    /// One micro-step: (loss, applied).
    fn step(&mut self, batch: &BTreeMap<String, Tensor>) -> Result<(f32, bool)> {
        match self {
            Runner::Trainer(t) => {
                let m = t.step(batch, false)?;
                Ok((m.loss, m.applied))
            }
            Runner::Hand(h) => h.step(batch),
        }
    }
}

fn child(model: &str, n: usize, k: usize, variant: &str, windows: usize) -> Result<Run> {
    if k == 0 || !n.is_multiple_of(k) {
        bail!("N = {n} is not a multiple of K = {k}");
    }
    let b = n / k;
    onnx_ga::runtime::init_onnxruntime()?;
    let step = build(model, k)?;
    let batches = batches(&data(model)?, b);
    trim_heap();
    let (rss_base, hwm_before) = vm_kib()?;
    let hwm_reset = reset_peak();
    let mut trainer = Runner::new(&step, k, variant)?;
    let (rss_trainer, _) = vm_kib()?;
    let mut ms_windows = Vec::with_capacity(windows);
    let mut loss = f32::NAN;
    let mut i = 0usize;
    for w in 0..windows {
        let t = Instant::now();
        for j in 0..k {
            let (l, applied) = trainer.step(&batches[i % batches.len()])?;
            if applied != (j == k - 1) {
                bail!("{model} N={n} K={k}: window {w}, micro-step {j}: applied={applied}");
            }
            loss = l;
            i += 1;
        }
        ms_windows.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (rss_end, hwm) = vm_kib()?;
    drop(trainer);
    Ok(Run {
        variant: variant.into(),
        model: model.into(),
        n,
        k,
        b,
        rss_base,
        hwm_before,
        hwm_reset,
        rss_trainer,
        hwm,
        rss_end,
        ms_windows,
        loss,
    })
}

// ----------------------------------------------------------------------------- hand loop

/// Allocator settings of the hand loop's sessions.
#[derive(Clone, Copy, Debug)]
struct Alloc {
    /// ONNX Runtime's CPU memory arena (`enable_cpu_mem_arena`; on by default).
    arena: bool,
    /// Memory pattern planning (`enable_mem_pattern`; on by default).
    pattern: bool,
}

/// The Trainer's split runner, mirrored so that the allocator settings can be chosen:
/// `Trainer` builds its sessions from `SessionOptions`, which has no allocator setting, so
/// this loop builds them with `onnx_ga::runtime::session_builder()` (public) and the same
/// threads and optimization level. Same specialisations (`onnx_ga::split::split_step`), same
/// state feedback with values kept in ONNX Runtime, data lent without a copy.
struct HandLoop {
    accumulate: ort::session::Session,
    apply: ort::session::Session,
    /// Every state input's current value, kept in ONNX Runtime.
    state: BTreeMap<String, ort::value::DynValue>,
    /// (state output, state input it feeds back); a specialisation without an output for a
    /// state leaves it unchanged.
    back: Vec<(String, String)>,
    data_inputs: Vec<String>,
    loss: String,
    k: usize,
    i: usize,
}

impl HandLoop {
    fn new(step: &ModelProto, k: usize, alloc: Alloc) -> Result<HandLoop> {
        let manifest = onnx_ga::state::Manifest::from_model(step)?;
        let split = onnx_ga::split::split_step(step, &manifest)?
            .ok_or_else(|| anyhow!("the step does not split"))?;
        let session = |m: &ModelProto| -> Result<ort::session::Session> {
            let ep = ort::ep::CPU::default()
                .with_arena_allocator(alloc.arena)
                .build();
            let s = onnx_ga::runtime::session_builder()?
                .with_intra_threads(1)
                .map_err(|e| anyhow!("{e}"))?
                .with_optimization_level(ort::session::builder::GraphOptimizationLevel::All)
                .map_err(|e| anyhow!("{e}"))?
                .with_memory_pattern(alloc.pattern)
                .map_err(|e| anyhow!("{e}"))?
                .with_execution_providers([ep])
                .map_err(|e| anyhow!("{e}"))?
                .commit_from_memory(&onnx_ga::model::encode_model(m))?;
            Ok(s)
        };
        let graph = step.graph.as_ref().ok_or_else(|| anyhow!("no graph"))?;
        let mut state = BTreeMap::new();
        for e in &manifest.state {
            // A state that starts at zeros ("init": "zeros") is stored nowhere in the step.
            let t = match manifest.init_of(&e.input) {
                Some(_) => onnx_ga::train::zeros_of_input(graph, &e.input)?,
                None => {
                    let init = graph
                        .initializer
                        .iter()
                        .find(|t| t.name() == e.input)
                        .ok_or_else(|| anyhow!("no initial value for '{}'", e.input))?;
                    Tensor::from_tensor_proto(init).map_err(|m| anyhow!("{m}"))?
                }
            };
            state.insert(
                e.input.clone(),
                onnx_ga::engine::ort::to_owned_ort(&e.input, &t)?,
            );
        }
        Ok(HandLoop {
            accumulate: session(&split.accumulate.model)?,
            apply: session(&split.apply.model)?,
            state,
            back: manifest
                .state
                .iter()
                .map(|e| (e.output.clone(), e.input.clone()))
                .collect(),
            data_inputs: manifest.data_inputs.clone(),
            loss: manifest.loss.clone(),
            k,
            i: 0,
        })
    }

    /// One micro-step; returns (loss, applied).
    fn step(&mut self, batch: &BTreeMap<String, Tensor>) -> Result<(f32, bool)> {
        use ort::session::SessionInputValue;
        use ort::value::TensorRef;
        use std::borrow::Cow;
        let applies = self.i % self.k == self.k - 1;
        let session = if applies {
            &mut self.apply
        } else {
            &mut self.accumulate
        };
        let mut feeds: Vec<(Cow<'_, str>, SessionInputValue<'_>)> = Vec::new();
        for name in &self.data_inputs {
            let v: SessionInputValue<'_> = match &batch[name] {
                Tensor::F32(a) => TensorRef::from_array_view(a)?.into_dyn().into(),
                Tensor::I64(a) => TensorRef::from_array_view(a)?.into_dyn().into(),
                _ => bail!("data input '{name}': not float32 or int64"),
            };
            feeds.push((Cow::Borrowed(name.as_str()), v));
        }
        let wanted: Vec<String> = session
            .inputs()
            .iter()
            .map(|i| i.name().to_string())
            .collect();
        for (name, value) in &self.state {
            if wanted.contains(name) {
                feeds.push((Cow::Borrowed(name.as_str()), SessionInputValue::from(value)));
            }
        }
        let mut outputs = session.run(feeds)?;
        let loss = outputs
            .remove(&self.loss)
            .ok_or_else(|| anyhow!("no loss output"))?;
        let loss = match onnx_ga::engine::ort::held_to_host(&self.loss, &loss)? {
            Tensor::F32(a) => a.iter().next().copied().unwrap_or(f32::NAN),
            _ => bail!("the loss is not float32"),
        };
        let mut next = Vec::new();
        for (out, input) in &self.back {
            if let Some(v) = outputs.remove(out) {
                next.push((input.clone(), v));
            }
        }
        drop(outputs);
        self.state.extend(next);
        self.i += 1;
        Ok((loss, applies))
    }
}

// ----------------------------------------------------------------------------- check

/// The trained parameters of `model` after `windows` windows of K micro-batches of N/K.
fn train_params(
    model: &str,
    data: &BTreeMap<String, Tensor>,
    n: usize,
    k: usize,
    windows: usize,
) -> Result<BTreeMap<String, Tensor>> {
    let step = build(model, k)?;
    let batches = batches(data, n / k);
    let mut t = Trainer::new(&step, &options())?;
    for i in 0..windows * k {
        t.step(&batches[i % batches.len()], false)?;
    }
    let params: Vec<String> = t
        .manifest
        .state
        .iter()
        .filter(|e| e.role == Role::Param)
        .map(|e| e.input.clone())
        .collect();
    let state = t.state()?;
    Ok(params
        .into_iter()
        .map(|p| {
            let v = state[&p].clone();
            (p, v)
        })
        .collect())
}

/// Largest absolute difference between two parameter sets, and the parameter it is in.
fn max_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> Result<(f32, String)> {
    let mut worst = (0f32, String::new());
    for (name, x) in a {
        let x = x.as_f32().ok_or_else(|| anyhow!("{name} is not float32"))?;
        let y = b[name]
            .as_f32()
            .ok_or_else(|| anyhow!("{name} is not float32"))?;
        if x.shape() != y.shape() {
            bail!("{name}: shapes {:?} and {:?}", x.shape(), y.shape());
        }
        for (p, q) in x.iter().zip(y.iter()) {
            let d = (p - q).abs();
            if d > worst.0 || d.is_nan() {
                worst = (d, name.clone());
            }
        }
    }
    Ok(worst)
}

/// K micro-batches of B and one batch of K*B see the same samples per window (N is a
/// multiple of the 64 samples, and B divides 64 or is a multiple of it), and the loss is a
/// mean, so after the same windows the parameters agree to rounding. cnn_bn is reported
/// only: BatchNorm's batch statistics make a micro-batch's gradient depend on B.
fn check(o: &Opts) -> Result<Vec<String>> {
    const WINDOWS: usize = 3;
    onnx_ga::runtime::init_onnxruntime()?;
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for model in &o.models {
        let data = data(model)?;
        let checked = model != "cnn_bn";
        for &n in &o.n {
            let one = train_params(model, &data, n, 1, WINDOWS)?;
            let init = {
                let step = build(model, 1)?;
                let t = Trainer::new(&step, &options())?;
                let state = t.state()?.clone();
                one.keys()
                    .map(|k| (k.clone(), state[k].clone()))
                    .collect::<BTreeMap<_, _>>()
            };
            let (moved, _) = max_diff(&one, &init)?;
            for &k in o.k.iter().filter(|&&k| k > 1) {
                if !n.is_multiple_of(k) {
                    continue;
                }
                let many = train_params(model, &data, n, k, WINDOWS)?;
                let (d, worst) = max_diff(&one, &many)?;
                let ok = d <= TOLERANCE && moved > 1e-3;
                let verdict = match (checked, ok) {
                    (false, _) => "not checked (BatchNorm: per-micro-batch statistics)",
                    (true, true) => "ok",
                    (true, false) => "FAILED",
                };
                if checked && !ok {
                    failed.push(format!("{model} N={n} K={k}"));
                }
                lines.push(format!(
                    "check {model} N={n}: K={k} x B={} vs K=1 x B={n}, {WINDOWS} windows: max |dparam| {d:.2e} (in {worst}; parameters moved up to {moved:.2e}): {verdict}",
                    n / k
                ));
            }
        }
    }
    if !failed.is_empty() {
        for l in &lines {
            eprintln!("{l}");
        }
        bail!(
            "K micro-batches and one batch of K*B differ by more than {TOLERANCE:e}: {}",
            failed.join(", ")
        );
    }
    Ok(lines)
}

// ----------------------------------------------------------------------------- parent

fn spawn(variant: &str, model: &str, n: usize, k: usize, windows: usize) -> Result<Run> {
    let exe = std::env::current_exe()?;
    let out = Command::new(exe)
        .args(["--child", model, &n.to_string(), &k.to_string()])
        .args(["--windows", &windows.to_string(), "--variants", variant])
        .output()
        .context("starting a child")?;
    if !out.status.success() {
        bail!(
            "child {model} N={n} K={k} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow!("child {model} N={n} K={k} printed no JSON line: {stdout}"))?;
    serde_json::from_str(line).with_context(|| format!("child line: {line}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Median over a run's timed windows (the first is warm-up).
fn ms_per_window(r: &Run) -> f64 {
    median(r.ms_windows[1..].to_vec())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|k| format!("{:.0} GiB", k as f64 / 1048576.0))
        .unwrap_or_else(|| "? GiB".into());
    let ort = onnx_ga::runtime::ORT_VERSION;
    format!("{n} CPUs (available_parallelism), {cpu}, {mem} RAM; ONNX Runtime {ort} (the version scripts/install-ort.sh installs)")
}

/// Label of a variant in the tables.
fn label(variant: &str) -> &str {
    match variant {
        "trainer" => "Trainer",
        "trainer-whole" => "Trainer, whole graph (--no-split)",
        "hand" => "hand loop, ORT defaults",
        "hand-noarena" => "arena off",
        "hand-nopattern" => "mem pattern off",
        "hand-noarena-nopattern" => "arena + pattern off",
        other => other,
    }
}

fn report(runs: &[Run], o: &Opts) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let reps = o.reps;
    let rows = |variant: &str, model: &str, n: usize, k: usize| -> Vec<&Run> {
        runs.iter()
            .filter(|r| r.variant == variant && r.model == model && r.n == n && r.k == k)
            .collect()
    };
    let stat = |variant: &str, model: &str, n: usize, k: usize, f: &dyn Fn(&Run) -> f64| {
        median(rows(variant, model, n, k).iter().map(|r| f(r)).collect())
    };
    let growth = |r: &Run| mib(r.hwm.saturating_sub(r.rss_base));
    let running = |r: &Run| mib(r.hwm.saturating_sub(r.rss_trainer));
    let _ = writeln!(
        s,
        "Machine: {}. One intra-op thread. Medians over {reps} fresh processes per row; {} windows per process, the first one warm-up (ms per window is the median of the others). Memory in MiB: peak = VmHWM at the end; baseline = VmRSS just before the trainer is made (ONNX Runtime loaded, step built, micro-batches made); sessions = VmRSS right after it is made - baseline; growth = peak - baseline; running = peak - VmRSS right after the trainer is made (what running the windows adds); each ratio divides by the K=1 row of the same model and N.\n",
        machine(),
        o.windows
    );
    let main = o
        .variants
        .iter()
        .find(|v| *v == "trainer")
        .unwrap_or(&o.variants[0])
        .clone();
    let _ = writeln!(s, "{} (sessions as `Trainer::new` makes them: ONNX Runtime's CPU arena and memory pattern on):\n", label(&main));
    let _ = writeln!(
        s,
        "| model | N | K | B | peak RSS MiB | baseline MiB | sessions MiB | growth MiB | growth / K=1 | running MiB | running / K=1 | ms per window | time / K=1 |"
    );
    let _ = writeln!(s, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for model in &o.models {
        for &n in &o.n {
            let g1 = stat(&main, model, n, 1, &growth);
            let t1 = stat(&main, model, n, 1, &ms_per_window);
            let r1 = stat(&main, model, n, 1, &running);
            for &k in &o.k {
                if rows(&main, model, n, k).is_empty() {
                    continue;
                }
                let g = stat(&main, model, n, k, &growth);
                let t = stat(&main, model, n, k, &ms_per_window);
                let r = stat(&main, model, n, k, &running);
                let _ = writeln!(
                    s,
                    "| {model} | {n} | {k} | {} | {:.1} | {:.1} | {:.1} | {g:.1} | {:.2} | {r:.1} | {:.2} | {t:.2} | {:.2} |",
                    n / k,
                    stat(&main, model, n, k, &|r| mib(r.hwm)),
                    stat(&main, model, n, k, &|r| mib(r.rss_base)),
                    stat(&main, model, n, k, &|r| {
                        mib(r.rss_trainer.saturating_sub(r.rss_base))
                    }),
                    g / g1,
                    r / r1,
                    t / t1,
                );
            }
        }
    }
    if o.variants.len() > 1 {
        let _ = writeln!(
            s,
            "\nAllocator settings (the hand loop: the Trainer's split runner with sessions from `onnx_ga::runtime::session_builder()`; see benches/memory.md). Each cell: growth MiB (growth / K=1 of the same variant) ms per window.\n"
        );
        let mut head = "| model | N | K | B |".to_string();
        let mut rule = "|---|--:|--:|--:|".to_string();
        for v in &o.variants {
            let _ = write!(head, " {} |", label(v));
            rule.push_str("--:|");
        }
        let _ = writeln!(s, "{head}\n{rule}");
        for model in &o.models {
            for &n in &o.n {
                for &k in &o.k {
                    if !n.is_multiple_of(k) {
                        continue;
                    }
                    let _ = write!(s, "| {model} | {n} | {k} | {} |", n / k);
                    for v in &o.variants {
                        let g = stat(v, model, n, k, &growth);
                        let g1 = stat(v, model, n, 1, &growth);
                        let t = stat(v, model, n, k, &ms_per_window);
                        let _ = write!(s, " {g:.1} ({:.2}) {t:.1} ms |", g / g1);
                    }
                    let _ = writeln!(s);
                }
            }
        }
    }
    let keys: std::collections::BTreeSet<(&str, &str, usize, usize)> = runs
        .iter()
        .map(|r| (r.variant.as_str(), r.model.as_str(), r.n, r.k))
        .collect();
    let spread: Vec<String> = keys
        .into_iter()
        .filter_map(|(v, m, n, k)| {
            let g: Vec<f64> = rows(v, m, n, k).into_iter().map(growth).collect();
            let lo = g.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = g.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            (hi - lo > 1.0).then(|| format!("{} {m} N={n} K={k}: {lo:.1}-{hi:.1}", label(v)))
        })
        .collect();
    let _ = writeln!(
        s,
        "\nGrowth spread over the processes of a row, where above 1 MiB: {}",
        if spread.is_empty() {
            "none".to_string()
        } else {
            spread.join("; ")
        }
    );
    if runs.iter().any(|r| !r.hwm_reset) {
        let _ = writeln!(s, "\nWARNING: VmHWM could not be reset (/proc/self/clear_refs) in some runs; their peak includes the rewrite before the trainer.");
    }
    s
}

// ----------------------------------------------------------------------------- main

fn main() -> Result<()> {
    let o = parse_opts()?;
    if let Some((model, n, k)) = &o.child {
        let variant = o.variants.first().map_or("trainer", |v| v.as_str());
        let run = child(model, *n, *k, variant, o.windows)?;
        println!("{}", serde_json::to_string(&run)?);
        return Ok(());
    }
    if !cfg!(target_os = "linux") {
        bail!("the memory bench reads /proc/self/status (Linux only)");
    }
    for v in &o.variants {
        alloc(v)?;
    }
    let t0 = Instant::now();
    for l in check(&o)? {
        println!("{l}");
    }
    eprintln!(
        "memory bench: check done in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    if o.check || !o.bench {
        return Ok(());
    }
    let mut configs = Vec::new();
    for model in &o.models {
        for &n in &o.n {
            for &k in &o.k {
                if !n.is_multiple_of(k) {
                    eprintln!("memory bench: skipping {model} N={n} K={k} (K does not divide N)");
                    continue;
                }
                for v in &o.variants {
                    configs.push((v.clone(), model.clone(), n, k));
                }
            }
        }
    }
    std::fs::create_dir_all(&o.out)?;
    let raw = o.out.join("runs.jsonl");
    let mut lines = String::new();
    let mut runs = Vec::new();
    for rep in 0..o.reps {
        let t = Instant::now();
        // Rotate the order per repetition, so no configuration always follows the same one.
        for j in 0..configs.len() {
            let (variant, model, n, k) = &configs[(j + rep * 7) % configs.len()];
            let run = spawn(variant, model, *n, *k, o.windows)?;
            lines.push_str(&serde_json::to_string(&run)?);
            lines.push('\n');
            runs.push(run);
        }
        eprintln!(
            "memory bench: repetition {rep}: {} processes in {:.1} s",
            configs.len(),
            t.elapsed().as_secs_f64()
        );
    }
    std::fs::write(&raw, &lines)?;
    let table = report(&runs, &o);
    std::fs::write(o.out.join("table.md"), &table)?;
    println!();
    print!("{table}");
    eprintln!(
        "memory bench: {} processes in {:.1} s; raw runs in {}, table in {}",
        runs.len(),
        t0.elapsed().as_secs_f64(),
        raw.display(),
        o.out.join("table.md").display()
    );
    Ok(())
}
