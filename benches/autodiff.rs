//! The autodiff front door against ONNX Runtime's gradient builder, on the same models.
//!
//! For every shipped artifacts folder, two gradient graphs of one model:
//!
//! - **ort**: `training_model.onnx` (ORT's training build wrote its backward) legalized to
//!   standard ops (`legalize-ort,dce`), run with `lazy_reset_grad` = true so that its
//!   accumulation buffers come out as this micro-batch's gradients;
//! - **autodiff**: `eval_model.onnx` with the checkpoint's values, differentiated by our own
//!   autodiff (`autodiff(loss=...),legalize-ort,dce`), the gradients as outputs;
//!
//! and the two training steps built from them with the same optimizer (the artifacts' own),
//! K = 4, driven by the Trainer as shipped (split specialisations). Reported: node counts,
//! the largest gradient difference between the two graphs on the first micro-batch, and the
//! median time per run (gradient graphs) or per micro-step (steps), alternating the two in
//! every round so that both see the same machine.
//!
//! `cargo bench --bench autodiff [-- --models a,b --batches 8,32 --threads 1,2 --rounds 5
//! --cell-ms 150]`

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use onnx_ga::data::{read_npz, Tensor};
use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::engine::{Engine, EngineKind, Held};
use onnx_ga::proto::ModelProto;
use onnx_ga::signature::{self, ExplicitRoles};
use onnx_ga::state::Manifest;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

const K: u64 = 4;
const STEP: &str = "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce";

struct Opts {
    models: Vec<String>,
    batches: Vec<usize>,
    threads: Vec<usize>,
    rounds: usize,
    cell: Duration,
}

fn parse_opts() -> Result<Opts> {
    let mut o = Opts {
        models: [
            "mlp_ce_adamw",
            "mlp_mse_sgd",
            "cnn_bn",
            "transformer_block",
            "bce_logits",
            "l1_loss",
        ]
        .map(String::from)
        .to_vec(),
        batches: vec![8, 32],
        threads: vec![1, 2],
        rounds: 5,
        cell: Duration::from_millis(150),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let list = |v: &str| -> Vec<String> { v.split(',').map(str::to_string).collect() };
    let mut i = 0;
    while i < args.len() {
        let value = || {
            args.get(i + 1)
                .cloned()
                .ok_or_else(|| anyhow!("{} needs a value", args[i]))
        };
        match args[i].as_str() {
            "--models" => o.models = list(&value()?),
            "--batches" => {
                o.batches = list(&value()?)
                    .iter()
                    .map(|s| s.parse())
                    .collect::<Result<_, _>>()?
            }
            "--threads" => {
                o.threads = list(&value()?)
                    .iter()
                    .map(|s| s.parse())
                    .collect::<Result<_, _>>()?
            }
            "--rounds" => o.rounds = value()?.parse()?,
            "--cell-ms" => o.cell = Duration::from_millis(value()?.parse()?),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    Ok(o)
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One model's four graphs.
struct Prepared {
    name: String,
    ort_grad: (ModelProto, Manifest),
    ad_grad: (ModelProto, Manifest),
    /// Per parameter: (ORT's gradient output, autodiff's gradient output).
    grad_pairs: Vec<(String, String)>,
    ort_step: ModelProto,
    ad_step: ModelProto,
    lazy_reset: String,
    data: BTreeMap<String, Tensor>,
    samples: usize,
}

fn build(graph: signature::TrainingGraph, spec: &str) -> Result<(ModelProto, Manifest)> {
    let step = onnx_ga::step::build_step(graph, spec, false).map_err(|e| anyhow!("{spec}: {e}"))?;
    Ok((step.model.to_proto(), step.manifest))
}

fn prepare(model: &str) -> Result<Prepared> {
    let dir = root().join("graphs").join(model);
    let open = || signature::open(&dir, &ExplicitRoles::default()).map_err(|e| anyhow!("{e}"));
    let artifacts = open()?;
    let optimizer = artifacts.signature.optimizer.clone();
    let lazy_reset = artifacts
        .signature
        .lazy_reset_grad
        .clone()
        .ok_or_else(|| anyhow!("{model}: no lazy_reset_grad"))?;
    // ORT's gradient output per parameter: the accumulation buffer each one feeds.
    let ort_grad = build(open()?, "legalize-ort,dce")?;
    let ort_step = build(open()?, STEP)?.0;

    let forward = || -> Result<(signature::TrainingGraph, String)> {
        let ev = signature::eval_model_as_forward(&dir).map_err(|e| anyhow!("{e}"))?;
        let freeze: Vec<&str> = ev
            .frozen
            .iter()
            .chain(&ev.constants)
            .map(String::as_str)
            .collect();
        let freeze = match freeze.is_empty() {
            true => String::new(),
            false => format!(",freeze={}", freeze.join("|")),
        };
        let mut graph = ev.graph;
        graph.signature.optimizer = optimizer.clone();
        Ok((graph, format!("autodiff(loss={}{freeze}", ev.loss)))
    };
    let (graph, ad) = forward()?;
    let ad_grad = build(graph, &format!("{ad}),legalize-ort,dce"))?;
    let (graph, ad) = forward()?;
    let ad_step = build(graph, &format!("{ad},grads=internal),{STEP}"))?.0;

    let grad_pairs = ort_grad
        .1
        .state
        .iter()
        .filter(|e| e.role == onnx_ga::state::Role::Accumulator)
        .filter_map(|e| {
            let p = e.param.clone()?;
            Some((e.output.clone(), format!("{p}_grad")))
        })
        .collect();
    let data = read_npz(&dir.join("data.npz"))?;
    let samples = data.values().next().map(|t| t.shape()[0]).unwrap_or(0);
    Ok(Prepared {
        name: model.into(),
        ort_grad,
        ad_grad,
        grad_pairs,
        ort_step,
        ad_step,
        lazy_reset,
        data,
        samples,
    })
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

fn options(threads: usize) -> SessionOptions {
    SessionOptions {
        threads,
        optimize: true,
        ..Default::default()
    }
}

/// A gradient graph run once per micro-batch: data from the batch, every other input from
/// its initializer (parameters, zero buffers), `lazy_reset` true.
struct GradLoop {
    engine: Engine,
    state: Vec<(String, Held)>,
    data_inputs: Vec<String>,
}

impl GradLoop {
    fn new(
        model: &ModelProto,
        manifest: &Manifest,
        lazy_reset: &str,
        threads: usize,
    ) -> Result<Self> {
        let g = model.graph.as_ref().context("no graph")?;
        let mut state = Vec::new();
        for input in &g.input {
            let name = input.name();
            if manifest.data_inputs.iter().any(|d| d == name) {
                continue;
            }
            let value = if name == lazy_reset {
                Tensor::Bool(ndarray::arr1(&[true]).into_dyn())
            } else {
                let init = |n: &str| {
                    g.initializer
                        .iter()
                        .find(|t| t.name() == n)
                        .map(|t| Tensor::from_tensor_proto(t).map_err(|e| anyhow!("{n}: {e}")))
                };
                match init(name) {
                    Some(t) => t?,
                    // ORT's accumulation buffers: zeros shaped like their parameter (reset
                    // anyway by lazy_reset_grad).
                    None => {
                        let param = manifest
                            .state
                            .iter()
                            .find(|e| e.input == name)
                            .and_then(|e| e.param.as_deref())
                            .ok_or_else(|| anyhow!("input '{name}' has no value"))?;
                        let p = init(param).ok_or_else(|| anyhow!("no value for '{param}'"))??;
                        Tensor::F32(ndarray::ArrayD::zeros(p.shape()))
                    }
                }
            };
            state.push((name.to_string(), Held::Host(value)));
        }
        Ok(GradLoop {
            engine: Engine::new(EngineKind::Ort, model, &options(threads))?,
            state,
            data_inputs: manifest.data_inputs.clone(),
        })
    }

    fn run(&mut self, batch: &BTreeMap<String, Tensor>) -> Result<Vec<(String, Held)>> {
        let host: Vec<(&str, &Tensor)> = self
            .data_inputs
            .iter()
            .map(|n| (n.as_str(), &batch[n]))
            .collect();
        let held: Vec<(&str, &Held)> = self.state.iter().map(|(k, v)| (k.as_str(), v)).collect();
        Ok(self.engine.run_held(&host, &held)?)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median microseconds of `f` over whole windows of K calls, for at least `cell`.
fn time(cell: Duration, mut f: impl FnMut(u64) -> Result<()>) -> Result<f64> {
    for i in 0..2 * K {
        f(i)?;
    }
    let mut per = Vec::new();
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < cell || per.len() < 5 {
        let s = Instant::now();
        for _ in 0..K {
            f(i)?;
            i += 1;
        }
        per.push(s.elapsed().as_secs_f64() * 1e6 / K as f64);
    }
    Ok(median(per))
}

fn max_grad_difference(p: &Prepared) -> Result<(f64, f64)> {
    let batch = micro_batch(&p.data, p.samples, 8, 0);
    let mut ort = GradLoop::new(&p.ort_grad.0, &p.ort_grad.1, &p.lazy_reset, 1)?;
    let mut ad = GradLoop::new(&p.ad_grad.0, &p.ad_grad.1, &p.lazy_reset, 1)?;
    let host = |outs: Vec<(String, Held)>| -> Result<BTreeMap<String, Tensor>> {
        outs.into_iter()
            .map(|(n, h)| Ok((n.clone(), h.to_host(&n)?)))
            .collect()
    };
    let (o, a) = (host(ort.run(&batch)?)?, host(ad.run(&batch)?)?);
    let (mut worst, mut scale) = (0f64, 0f64);
    for (og, ag) in &p.grad_pairs {
        let (Some(Tensor::F32(x)), Some(Tensor::F32(y))) = (o.get(og), a.get(ag)) else {
            return Err(anyhow!("{}: gradient pair {og} / {ag} missing", p.name));
        };
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((*u as f64 - *v as f64).abs());
            scale = scale.max((*u as f64).abs());
        }
    }
    Ok((worst, scale))
}

fn main() -> Result<()> {
    let o = parse_opts()?;
    onnx_ga::runtime::init_onnxruntime()?;
    let prepared: Vec<Prepared> = o.models.iter().map(|m| prepare(m)).collect::<Result<_>>()?;

    println!("| model | nodes ort / autodiff (gradient graph) | nodes ort / autodiff (step) | max abs grad diff (max abs grad) |");
    println!("|---|---|---|---|");
    for p in &prepared {
        let (worst, scale) = max_grad_difference(p)?;
        println!(
            "| {} | {} / {} | {} / {} | {worst:.1e} ({scale:.2}) |",
            p.name,
            node_count(&p.ort_grad.0),
            node_count(&p.ad_grad.0),
            node_count(&p.ort_step),
            node_count(&p.ad_step)
        );
    }

    // (model, B, T, column) -> per-round medians.
    let mut cells: BTreeMap<(String, usize, usize, &str), Vec<f64>> = BTreeMap::new();
    for round in 0..o.rounds {
        let t = Instant::now();
        for p in &prepared {
            for &b in &o.batches {
                let n = (p.samples / gcd(p.samples, b)) as u64;
                let batches: Vec<_> = (0..n)
                    .map(|i| micro_batch(&p.data, p.samples, b, i))
                    .collect();
                for &threads in &o.threads {
                    let mut ort =
                        GradLoop::new(&p.ort_grad.0, &p.ort_grad.1, &p.lazy_reset, threads)?;
                    let mut ad = GradLoop::new(&p.ad_grad.0, &p.ad_grad.1, &p.lazy_reset, threads)?;
                    let topts = TrainOptions {
                        session: options(threads),
                        ..Default::default()
                    };
                    let mut ort_step = Trainer::with_options(&p.ort_step, &topts)?;
                    let mut ad_step = Trainer::with_options(&p.ad_step, &topts)?;
                    // Alternate which goes first from round to round.
                    let order: [&str; 4] = if round % 2 == 0 {
                        ["grad_ort", "grad_autodiff", "step_ort", "step_autodiff"]
                    } else {
                        ["grad_autodiff", "grad_ort", "step_autodiff", "step_ort"]
                    };
                    for column in order {
                        let batch = |i: u64| &batches[(i % n) as usize];
                        let us = match column {
                            "grad_ort" => time(o.cell, |i| ort.run(batch(i)).map(drop))?,
                            "grad_autodiff" => time(o.cell, |i| ad.run(batch(i)).map(drop))?,
                            "step_ort" => time(o.cell, |i| {
                                ort_step.step(batch(i), false).map(drop).map_err(Into::into)
                            })?,
                            _ => time(o.cell, |i| {
                                ad_step.step(batch(i), false).map(drop).map_err(Into::into)
                            })?,
                        };
                        cells
                            .entry((p.name.clone(), b, threads, column))
                            .or_default()
                            .push(us);
                    }
                }
            }
        }
        eprintln!(
            "autodiff bench: round {round} in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }

    println!();
    println!("Median over {} rounds of the median µs per run (gradient graph) or per micro-step (step, K = {K}); ratio = autodiff / ort.", o.rounds);
    println!();
    println!("| model | B | T | gradient ort | gradient autodiff | ratio | step ort | step autodiff | ratio |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for p in &prepared {
        for &b in &o.batches {
            for &t in &o.threads {
                let get = |c: &str| median(cells[&(p.name.clone(), b, t, c)].clone());
                let (go, ga, so, sa) = (
                    get("grad_ort"),
                    get("grad_autodiff"),
                    get("step_ort"),
                    get("step_autodiff"),
                );
                println!(
                    "| {} | {b} | {t} | {go:.0} | {ga:.0} | {:.2} | {so:.0} | {sa:.0} | {:.2} |",
                    p.name,
                    ga / go,
                    sa / so
                );
            }
        }
    }
    Ok(())
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
