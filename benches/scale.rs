//! How the step's cost over its gradient graph scales with model size, where the shipped
//! graphs (a few hundred parameters) cannot tell: a two-layer MLP of width W, from 64 to
//! 2048 (8 K to 8.4 M parameters), written as a plain gradient graph, rewritten with
//! `grad-accum(steps=4),optimizer(kind=adamw),dce` and run on ONNX Runtime, one thread.
//! See benches/README.md ("Scaling with model size") for what it showed.
//!
//! Columns, interleaved in rounds (the order rotates per round):
//! - `floor`: the gradient graph alone, parameters held in ONNX Runtime, gradients dropped;
//! - `step`: the Trainer as shipped (the two specialisations of the `If`, src/split.rs);
//! - `step If`: the exported graph run whole (`--no-split`): its else-branch copies every
//!   parameter and both AdamW moments into the `If`'s outputs on every micro-step.
//!
//! `cargo bench --bench scale` measures; run without `--bench` (as `cargo test
//! --all-targets` does) it only checks, at the smallest width, that step and step If train
//! to bit-identical parameters. Options: `--widths 64,256,1024,2048` `--batch 32`
//! `--rounds 3` `--cell-ms 400`; `--only step` runs one column alone (to profile).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use ndarray::ArrayD;

use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::engine::{Engine, EngineKind, Held};
use onnx_ga::ir::builder::{attr_int, tensor_f32, tensor_i64, Builder};
use onnx_ga::ir::{tensor_type, BodyId, Model, ValueId};
use onnx_ga::proto::ModelProto;
use onnx_ga::train::{TrainOptions, Trainer};

const K: u64 = 4;
const FLOAT: i32 = 1;

struct Opts {
    widths: Vec<i64>,
    batch: usize,
    rounds: usize,
    cell: Duration,
    bench: bool,
    threads: Vec<usize>,
    /// `--least`: the least a step can add to the floor with standard sessions ([`least`]).
    least: bool,
    /// `--columns floor,step,step_if` (the default; also `floor_kept`, `floor_shared`,
    /// `floor_no_pattern`, `floor_arena`, `floor_pool`, `floor_bound`, `step_in_place`,
    /// `step_at_once`, `step_no_host`, `step_kernels`, `step_gemm_at_apply`).
    columns: Vec<String>,
    /// `--only COLUMN`: run that column alone, `--rounds` cells at the first width and the
    /// first thread count, and print its times: a run to profile (perf record), not a
    /// comparison.
    only: Option<String>,
}

fn parse_opts() -> Result<Opts> {
    let mut o = Opts {
        widths: vec![64, 256, 1024, 2048],
        batch: 32,
        rounds: 3,
        cell: Duration::from_millis(400),
        bench: false,
        threads: vec![1],
        least: false,
        only: None,
        columns: ["floor", "step", "step_if"].map(String::from).to_vec(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().ok_or_else(|| anyhow!("{what} needs a value"));
        match a.as_str() {
            "--bench" => o.bench = true,
            "--widths" => {
                o.widths = value("--widths")?
                    .split(',')
                    .map(|w| w.trim().parse().map_err(|_| anyhow!("--widths: bad '{w}'")))
                    .collect::<Result<_>>()?
            }
            "--batch" => o.batch = value("--batch")?.parse()?,
            "--rounds" => o.rounds = value("--rounds")?.parse()?,
            "--threads" => {
                o.threads = value("--threads")?
                    .split(',')
                    .map(|t| {
                        t.trim()
                            .parse()
                            .map_err(|_| anyhow!("--threads: bad '{t}'"))
                    })
                    .collect::<Result<_>>()?
            }
            "--cell-ms" => o.cell = Duration::from_millis(value("--cell-ms")?.parse()?),
            "--least" => o.least = true,
            "--only" => o.only = Some(value("--only")?),
            "--columns" => {
                o.columns = value("--columns")?
                    .split(',')
                    .map(|c| c.trim().to_string())
                    .collect()
            }
            other if other.starts_with('-') => eprintln!("scale bench: ignoring {other}"),
            _ => {}
        }
    }
    Ok(o)
}

/// Deterministic values in [-scale, scale) (xorshift): the bench needs no RNG crate.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// How [`mlp_gradient_graph`] writes the gradients.
#[derive(Clone, Copy, PartialEq)]
enum Gradients {
    /// As a plain gradient graph: `MatMul` for the weights, `ReduceSum` for the biases.
    Plain,
    /// Added into fed accumulators by the nodes that make them, no node more (`--least`):
    /// `Gemm(A, B, acc, beta = 1)` for the weights, `Gemm(ones[1, batch], dY, acc)` for the
    /// biases (their accumulators `[1, w]`); `extra_node` adds one `Neg` more.
    Folded { batch: usize, extra_node: bool },
}

/// The gradient graph of `loss = mean((relu(x W1 + b1) W2 + b2 - t)^2)` for x, t of width
/// `w` and a hidden layer of width `w`, its backward pass written out and seeded by the
/// scalar initializer `loss_grad`. Returns the model and the (parameter, gradient) pairs.
fn mlp_gradient_graph(w: i64, gradients: Gradients) -> (ModelProto, Vec<(String, String)>) {
    let mut model = Model::from_proto(ModelProto {
        ir_version: Some(8),
        opset_import: vec![onnx_ga::proto::OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        producer_name: Some("onnx-ga scale bench".into()),
        graph: Some(Default::default()),
        ..Default::default()
    });
    let main = BodyId::MAIN;
    let batch_type = |cols: i64| {
        let mut ty = tensor_type(FLOAT, &[0, cols]);
        if let Some(onnx_ga::proto::type_proto::Value::TensorType(t)) = &mut ty.value {
            t.shape.as_mut().unwrap().dim[0].value =
                Some(onnx_ga::proto::tensor_shape_proto::dimension::Value::DimParam("N".into()));
        }
        ty
    };
    let x = model.add_input(main, "x", batch_type(w), None);
    let t = model.add_input(main, "t", batch_type(w), None);
    let scale = 1.0 / (w as f32).sqrt();
    let mut param = |name: &str, dims: &[i64], seed: u64| {
        let n = dims.iter().product::<i64>() as usize;
        let init = tensor_f32(dims, &values(seed, n, scale));
        model.add_input(main, name, tensor_type(FLOAT, dims), Some(init))
    };
    let w1 = param("W1", &[w, w], 1);
    let b1 = param("b1", &[w], 2);
    let w2 = param("W2", &[w, w], 3);
    let b2 = param("b2", &[w], 4);
    let accumulators = match gradients {
        Gradients::Plain => None,
        Gradients::Folded { batch, .. } => {
            let mut acc = |p: &str, dims: &[i64]| {
                model.add_input(main, &format!("acc_{p}"), tensor_type(FLOAT, dims), None)
            };
            let accs = [
                acc("W1", &[w, w]),
                acc("b1", &[1, w]),
                acc("W2", &[w, w]),
                acc("b2", &[1, w]),
            ];
            let ones = vec![1.0; batch];
            let ones = model.add_initializer(main, "ones", tensor_f32(&[1, batch as i64], &ones));
            Some((accs, ones))
        }
    };
    let mut b = Builder::new(&mut model, main, "scale-bench");
    // A weight's gradient `A B` and a bias's `sum over rows of dY`, plain or added into its
    // accumulator by the same node.
    let beta = || vec![onnx_ga::ir::builder::attr_float("beta", 1.0)];
    let weight_grad =
        |b: &mut Builder<'_>, a: ValueId, dy: ValueId, k: usize, name: &str| match accumulators {
            None => b.op("MatMul", &[a, dy], vec![], name),
            Some((accs, _)) => b.op("Gemm", &[a, dy, accs[k]], beta(), name),
        };
    let bias_grad =
        |b: &mut Builder<'_>, dy: ValueId, axis0: ValueId, k: usize, name: &str| match accumulators
        {
            None => b.op(
                "ReduceSum",
                &[dy, axis0],
                vec![attr_int("keepdims", 0)],
                name,
            ),
            Some((accs, ones)) => b.op("Gemm", &[ones, dy, accs[k]], beta(), name),
        };
    // Forward.
    let xw = b.op("MatMul", &[x, w1], vec![], "xW1");
    let z = b.op("Add", &[xw, b1], vec![], "z");
    let h = b.op("Relu", &[z], vec![], "h");
    let hw = b.op("MatMul", &[h, w2], vec![], "hW2");
    let y = b.op("Add", &[hw, b2], vec![], "y");
    let d = b.op("Sub", &[y, t], vec![], "d");
    let d2 = b.op("Mul", &[d, d], vec![], "d2");
    let loss = b.op("ReduceMean", &[d2], vec![attr_int("keepdims", 0)], "loss");
    // Backward: dL/dy = seed * 2 d / numel.
    let seed = b.scalar_f32("loss_grad", 1.0);
    let two = b.scalar_f32("two", 2.0);
    let numel = b.op("Size", &[d], vec![], "numel");
    let numel = b.op(
        "Cast",
        &[numel],
        vec![attr_int("to", FLOAT as i64)],
        "numel_f",
    );
    let factor = b.op("Div", &[two, numel], vec![], "two_over_numel");
    let factor = b.op("Mul", &[seed, factor], vec![], "dy_factor");
    let dy = b.op("Mul", &[d, factor], vec![], "dy");
    let axis0 = b
        .model
        .add_initializer(main, "axis0", tensor_i64(&[1], &[0]));
    let ht = b.op("Transpose", &[h], vec![], "h_t");
    weight_grad(&mut b, ht, dy, 2, "W2_grad");
    let b2_grad = bias_grad(&mut b, dy, axis0, 3, "b2_grad");
    let w2t = b.op("Transpose", &[w2], vec![], "W2_t");
    let dh = b.op("MatMul", &[dy, w2t], vec![], "dh");
    let zero = b.scalar_f32("zero", 0.0);
    let active = b.op("Greater", &[z, zero], vec![], "active");
    let dz = b.op("Where", &[active, dh, zero], vec![], "dz");
    let xt = b.op("Transpose", &[x], vec![], "x_t");
    weight_grad(&mut b, xt, dz, 0, "W1_grad");
    bias_grad(&mut b, dz, axis0, 1, "b1_grad");
    let extra = match gradients {
        Gradients::Folded {
            extra_node: true, ..
        } => Some(b.op("Neg", &[b2_grad], vec![], "extra")),
        _ => None,
    };
    model.add_output(main, loss, Some(tensor_type(FLOAT, &[])));
    if let Some(extra) = extra {
        model.add_output(main, extra, None);
    }
    let grads: Vec<(String, String)> = ["W1", "b1", "W2", "b2"]
        .iter()
        .map(|p| (p.to_string(), format!("{p}_grad")))
        .collect();
    (model.to_proto(), grads)
}

/// The gradient graph with every gradient as an output (the floor), and the step.
struct Sized {
    width: i64,
    params: usize,
    floor: ModelProto,
    step: ModelProto,
    /// Distinct micro-batches (x, t).
    batches: Vec<BTreeMap<String, Tensor>>,
}

/// `graph` with its gradients as outputs too: what a floor returns.
fn with_gradient_outputs(graph: &ModelProto, grads: &[(String, String)]) -> ModelProto {
    let mut floor = graph.clone();
    let g = floor.graph.as_mut().unwrap();
    for (_, grad) in grads {
        g.output.push(onnx_ga::proto::ValueInfoProto {
            name: Some(grad.clone()),
            ..Default::default()
        });
    }
    floor
}

fn build(width: i64, batch: usize) -> Result<Sized> {
    let (graph, grads) = mlp_gradient_graph(width, Gradients::Plain);
    let floor = with_gradient_outputs(&graph, &grads);
    let roles = onnx_ga::signature::ExplicitRoles {
        loss: Some("loss".into()),
        seed: Some("loss_grad".into()),
        grads: grads.clone(),
    };
    let training = onnx_ga::signature::from_model(graph, &roles, Path::new("mlp.onnx"))
        .map_err(|e| anyhow!("width {width}: {e}"))?;
    let step = onnx_ga::step::build_step(
        training,
        "grad-accum(steps=4),optimizer(kind=adamw,lr=0.001,weight_decay=0.01),dce",
        false,
    )
    .map_err(|e| anyhow!("width {width}: {e}"))?;
    let w = width as usize;
    let batches = (0..2u64)
        .map(|i| {
            let x = ArrayD::from_shape_vec(vec![batch, w], values(100 + i, batch * w, 1.0));
            let t = ArrayD::from_shape_vec(vec![batch, w], values(200 + i, batch * w, 1.0));
            Ok(BTreeMap::from([
                ("x".to_string(), Tensor::F32(x?)),
                ("t".to_string(), Tensor::F32(t?)),
            ]))
        })
        .collect::<Result<_>>()?;
    Ok(Sized {
        width,
        params: 2 * w * w + 2 * w,
        floor,
        step: step.model.to_proto(),
        batches,
    })
}

/// Intra-op threads of the cell being measured (`--threads`).
static THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

fn session_options() -> SessionOptions {
    SessionOptions {
        threads: THREADS.load(std::sync::atomic::Ordering::Relaxed),
        ..Default::default()
    }
}

fn trainer(step: &ModelProto, split: bool) -> Result<Trainer> {
    let options = TrainOptions {
        session: session_options(),
        split,
        ..TrainOptions::default()
    };
    Ok(Trainer::with_options(step, &options)?)
}

/// Times in ms: the median over windows of (window time / K), and the medians of the
/// non-applying and applying single micro-steps; after two warm-up windows.
struct Measured {
    per_step: f64,
    nonapply: f64,
    /// The first micro-step of a window (accumulators zero).
    first: f64,
    apply: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `step(i)` runs micro-step i and says whether it applied the window.
fn measure(cell: Duration, mut step: impl FnMut(u64) -> Result<bool>) -> Result<Measured> {
    let mut i = 0;
    for _ in 0..2 * K {
        step(i)?;
        i += 1;
    }
    let (mut per_step, mut nonapply, mut apply) = (Vec::new(), Vec::new(), Vec::new());
    let mut first = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < cell || per_step.len() < 3 {
        let mut window = 0.0;
        for _ in 0..K {
            let s = Instant::now();
            let applied = step(i)?;
            let ms = s.elapsed().as_secs_f64() * 1e3;
            window += ms;
            if i % K == 0 {
                first.push(ms);
            }
            if applied {
                apply.push(ms)
            } else {
                nonapply.push(ms)
            }
            i += 1;
        }
        per_step.push(window / K as f64);
    }
    Ok(Measured {
        per_step: median(per_step),
        nonapply: median(nonapply),
        first: median(first),
        apply: (!apply.is_empty()).then(|| median(apply)),
    })
}

/// The least memory traffic any implementation of this step adds to its gradient graph,
/// timed as plain streams over buffers of the parameters' size on `threads` threads: the
/// apply reads the parameters, the window's gradient and both moments and writes the
/// parameters and the moments (7 passes, AdamW's float32 state). A micro-step adds its
/// gradient into the accumulator as the product makes it (`AccumulateProduct`), reading and
/// writing the accumulator where the floor writes (and so first reads) the gradient: no
/// traffic over the floor. Returns the apply's ms: the median of `reps` streams, the
/// arithmetic being one add per element (bandwidth, not AdamW's divisions). The threads are
/// started once and meet at a barrier around each stream: starting them costs more than a
/// small stream.
fn stream_bound(params: usize, threads: usize, reps: usize) -> f64 {
    let threads = threads.max(1);
    let chunk = params.div_ceil(threads);
    let mut bufs: Vec<Vec<f32>> = (0..4).map(|i| vec![i as f32 * 0.5; params]).collect();
    let [p, g, m, v] = bufs.as_mut_slice() else {
        unreachable!()
    };
    let barrier = std::sync::Barrier::new(threads);
    let mut parts: Vec<Part<'_>> = p
        .chunks_mut(chunk)
        .zip(g.chunks(chunk))
        .zip(m.chunks_mut(chunk))
        .zip(v.chunks_mut(chunk))
        .map(|(((p, g), m), v)| (p, g, m, v))
        .collect();
    let first = parts.remove(0);
    let times = std::thread::scope(|scope| {
        for part in parts {
            let barrier = &barrier;
            scope.spawn(move || stream(part, reps, barrier));
        }
        // This thread streams the first part and keeps the times.
        stream(first, reps, &barrier)
    });
    std::hint::black_box(&bufs);
    times
}

/// One thread's share of the parameters, gradient and moments.
type Part<'a> = (&'a mut [f32], &'a [f32], &'a mut [f32], &'a mut [f32]);

/// [`stream_bound`]'s stream over one part, `reps` times, in step with the other threads;
/// its median time in ms.
fn stream((p, g, m, v): Part<'_>, reps: usize, barrier: &std::sync::Barrier) -> f64 {
    let mut apply = Vec::new();
    for _ in 0..reps {
        barrier.wait();
        let t = Instant::now();
        for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *m += *g;
            *v += *g;
            *p += *m + *v;
        }
        barrier.wait();
        apply.push(t.elapsed().as_secs_f64() * 1e3);
    }
    median(apply)
}

/// The least arithmetic AdamW's apply needs, in ms: one correctly rounded square root and
/// one division per parameter (`m / (sqrt(v) + eps)`; the moments' multiplies and adds are
/// left out), timed hot in L1 over a block of 4096 elements on one core, each form this CPU
/// has (scalar, AVX2, AVX-512) and the fastest kept, scaled to `params` over `threads`
/// cores (each core has its own divider). Exact AdamW cannot take less; at 131K
/// parameters this is more than the apply's memory traffic (benches/README.md, "Run Y").
fn arithmetic_bound(params: usize, threads: usize) -> f64 {
    const BLOCK: usize = 4096;
    let m: Vec<f32> = (0..BLOCK).map(|i| 1e-3 * (i % 17) as f32 - 8e-3).collect();
    let v: Vec<f32> = (0..BLOCK).map(|i| 1e-6 * (1 + i % 13) as f32).collect();
    let mut out = vec![0f32; BLOCK];
    let mut forms: Vec<QuotientForm> = vec![quotients];
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            forms.push(|m, v, out| unsafe { quotients_avx2(m, v, out) });
        }
        if std::is_x86_feature_detected!("avx512f") {
            forms.push(|m, v, out| unsafe { quotients_avx512(m, v, out) });
        }
    }
    let per_element = forms
        .iter()
        .map(|form| {
            let reps = 100;
            let times = (0..15)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..reps {
                        form(&m, &v, &mut out);
                        std::hint::black_box(&mut out);
                    }
                    t.elapsed().as_secs_f64() * 1e3 / (reps * BLOCK) as f64
                })
                .collect();
            median(times)
        })
        .fold(f64::INFINITY, f64::min);
    per_element * params as f64 / threads.max(1) as f64
}

/// One form of [`quotients`] (scalar, AVX2, AVX-512).
type QuotientForm = fn(&[f32], &[f32], &mut [f32]);

/// `out = m / (sqrt(v) + eps)`, each element: what [`arithmetic_bound`] times.
#[inline(always)]
fn quotients(m: &[f32], v: &[f32], out: &mut [f32]) {
    for ((o, m), v) in out.iter_mut().zip(m).zip(v) {
        *o = *m / (v.sqrt() + 1e-8);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quotients_avx2(m: &[f32], v: &[f32], out: &mut [f32]) {
    quotients(m, v, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quotients_avx512(m: &[f32], v: &[f32], out: &mut [f32]) {
    quotients(m, v, out)
}

fn run_cell(s: &Sized, column: &str, cell: Duration) -> Result<Measured> {
    let nb = s.batches.len() as u64;
    match column {
        // `floor_kept`: each run's outputs held until the next run has made its own, as a
        // trainer holds its state; `floor_shared`: the options the trainer gives its
        // sessions (one arena, no memory pattern, the shared pool, no spinning);
        // `floor_no_pattern`, `floor_arena`, `floor_pool`: one of those alone.
        "floor" | "floor_kept" | "floor_shared" | "floor_no_pattern" | "floor_arena"
        | "floor_pool" => {
            let options = match column {
                "floor_arena" => SessionOptions {
                    shared_arena: true,
                    ..session_options()
                },
                "floor_pool" => SessionOptions {
                    shared_pool: true,
                    spin: false,
                    ..session_options()
                },
                "floor_no_pattern" => SessionOptions {
                    memory_pattern: false,
                    ..session_options()
                },
                "floor_shared" => SessionOptions {
                    memory_pattern: false,
                    shared_arena: true,
                    spin: false,
                    shared_pool: true,
                    ..session_options()
                },
                _ => session_options(),
            };
            let keep = column == "floor_kept";
            let mut kept = Vec::new();
            let mut engine = Engine::new(EngineKind::Ort, &s.floor, &options)?;
            let params = held_params(s)?;
            measure(cell, |i| {
                let batch = &s.batches[(i % nb) as usize];
                let host: Vec<(&str, &Tensor)> =
                    batch.iter().map(|(k, v)| (k.as_str(), v)).collect();
                let held: Vec<(&str, &Held)> =
                    params.iter().map(|(k, v)| (k.as_str(), v)).collect();
                let outputs = engine.run_held(&host, &held)?;
                if keep {
                    kept = outputs;
                }
                Ok(false)
            })
        }
        "floor_bound" => floor_bound(s, cell),
        "step" | "step_if" | "step_in_place" | "step_at_once" | "step_no_host" | "step_kernels"
        | "step_gemm_at_apply" => {
            let defaults = session_options();
            let session = match column {
                // Each micro-step's weight gradients added as they are made, none kept for
                // the window's sum (`SessionOptions::defer_weight_grads` off).
                "step_at_once" => Some(SessionOptions {
                    defer_weight_grads: false,
                    ..defaults
                }),
                // Every state the fused kernels update, updated in place.
                "step_in_place" => Some(SessionOptions {
                    in_place_min_total: 0,
                    ..defaults
                }),
                // The apply's own weight gradients written by ONNX Runtime's `Gemm` for its
                // updates to read (`SessionOptions::apply_products` off).
                "step_gemm_at_apply" => Some(SessionOptions {
                    apply_products: false,
                    ..defaults
                }),
                // Every session on the kernels in place whatever its size: neither the
                // host's updates nor states apart (so weight gradients are kept).
                "step_kernels" => Some(SessionOptions {
                    host_updates: false,
                    in_place_min_total: 0,
                    ..defaults
                }),
                // Small sessions' updates left in ONNX Runtime's kernels, not run by the host
                // (`SessionOptions::host_updates` off).
                "step_no_host" => Some(SessionOptions {
                    host_updates: false,
                    ..defaults
                }),
                _ => None,
            };
            let mut t = match session {
                Some(session) => Trainer::with_options(
                    &s.step,
                    &TrainOptions {
                        session,
                        ..TrainOptions::default()
                    },
                )?,
                None => trainer(&s.step, column == "step")?,
            };
            measure(cell, |i| {
                Ok(t.step(&s.batches[(i % nb) as usize], false)?.applied)
            })
        }
        other => bail!("unknown column {other}"),
    }
}

/// The floor's parameters as values ONNX Runtime holds (as a trainer holds its state).
fn held_params(s: &Sized) -> Result<Vec<(String, Held)>> {
    let g = s.floor.graph.as_ref().unwrap();
    ["W1", "b1", "W2", "b2"]
        .iter()
        .map(|p| {
            let init = g.initializer.iter().find(|t| t.name() == *p).unwrap();
            let value = Tensor::from_tensor_proto(init).map_err(|m| anyhow!(m))?;
            let held = onnx_ga::engine::ort::to_owned_ort(p, &value)?;
            Ok((p.to_string(), Held::Ort(held)))
        })
        .collect()
}

/// `floor_bound`: the floor through one `IoBinding` made once: the parameters bound, each
/// batch copied into bound input buffers, every output written into a buffer bound once,
/// `RunWithBinding` called raw. What a run costs with nothing allocated, wrapped or
/// released around it; checked first against plain runs of two batches, bit for bit.
fn floor_bound(s: &Sized, cell: Duration) -> Result<Measured> {
    use ort::AsPointer;
    let nb = s.batches.len() as u64;
    let mut engine = Engine::new(EngineKind::Ort, &s.floor, &session_options())?;
    let params = held_params(s)?;
    // Reference outputs of a plain run, for the check and the output shapes.
    let reference = |engine: &mut Engine, i: usize| -> Result<Vec<(String, Tensor)>> {
        let host: Vec<(&str, &Tensor)> =
            s.batches[i].iter().map(|(k, v)| (k.as_str(), v)).collect();
        let held: Vec<(&str, &Held)> = params.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let out = engine.run_held(&host, &held)?;
        out.into_iter()
            .map(|(n, h)| Ok((n.clone(), h.to_host(&n)?)))
            .collect()
    };
    let want0 = reference(&mut engine, 0)?;
    let want1 = reference(&mut engine, 1)?;
    let Engine::Ort(ort_session) = &mut engine else {
        bail!("ort")
    };
    let session = ort_session.raw_session();
    let mut binding = session.create_binding()?;
    for (name, held) in &params {
        let Held::Ort(v) = held else { bail!("held") };
        binding.bind_input(name.as_str(), v)?;
    }
    let mut inputs = Vec::new();
    for (name, t) in &s.batches[0] {
        let v = onnx_ga::engine::ort::to_owned_ort(name, t)?;
        binding.bind_input(name.as_str(), &v)?;
        inputs.push((name.clone(), v));
    }
    let allocator = session.allocator();
    let mut outputs = Vec::new();
    for (name, t) in &want0 {
        let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        let mut v = ort::value::Tensor::<f32>::new(allocator, shape)?;
        binding.bind_output(name.as_str(), &mut v)?;
        outputs.push((name.clone(), v));
    }
    let api = ort::api();
    let run = |i: usize,
               inputs: &mut Vec<(String, ort::value::DynValue)>,
               session: &mut ort::session::Session|
     -> Result<()> {
        for (name, v) in inputs.iter_mut() {
            let Tensor::F32(src) = &s.batches[i][name] else {
                bail!("f32")
            };
            let (_, dst) = v.try_extract_tensor_mut::<f32>()?;
            dst.copy_from_slice(src.as_slice().unwrap());
        }
        let status = unsafe {
            (api.RunWithBinding)(
                session.ptr() as *mut _,
                std::ptr::null(),
                binding.ptr() as *const _,
            )
        };
        if !status.0.is_null() {
            bail!("RunWithBinding failed");
        }
        Ok(())
    };
    for (i, want) in [(1usize, &want1), (0, &want0)] {
        run(i, &mut inputs, session)?;
        for ((name, got), (_, w)) in outputs.iter().zip(want.iter()) {
            let (_, got) = got.try_extract_tensor::<f32>()?;
            let Tensor::F32(w) = w else { bail!("f32") };
            if got != w.as_slice().unwrap() {
                bail!("floor_bound: '{name}' differs from a plain run's");
            }
        }
    }
    measure(cell, |i| {
        run((i % nb) as usize, &mut inputs, session)?;
        Ok(false)
    })
}

/// Step and step If train to the same parameters, bit for bit (3 windows).
fn check(s: &Sized) -> Result<()> {
    let mut split = trainer(&s.step, true)?;
    let mut whole = trainer(&s.step, false)?;
    if !split.is_split() {
        bail!("width {}: the step did not split", s.width);
    }
    for i in 0..3 * K as usize {
        let batch = &s.batches[i % s.batches.len()];
        let (a, b) = (split.step(batch, false)?, whole.step(batch, false)?);
        if a != b {
            bail!("width {}: micro-step {i}: {a:?} vs {b:?}", s.width);
        }
    }
    if split.state()? != whole.state()? {
        bail!("width {}: the states differ after 3 windows", s.width);
    }
    println!(
        "check width {}: step (split) and step If bit-identical after 3 windows: ok",
        s.width
    );
    Ok(())
}

fn main() -> Result<()> {
    let o = parse_opts()?;
    onnx_ga::runtime::init_onnxruntime()?;
    if o.least {
        return least(&o);
    }
    if !o.bench {
        return check(&build(o.widths[0], 8)?);
    }
    if let Some(column) = &o.only {
        let s = build(o.widths[0], o.batch)?;
        THREADS.store(o.threads[0], std::sync::atomic::Ordering::Relaxed);
        for _ in 0..o.rounds {
            let m = run_cell(&s, column, o.cell)?;
            println!("{column}: {:.1} µs per micro-step", m.per_step * 1e3);
        }
        return Ok(());
    }
    let sized: Vec<Sized> = o
        .widths
        .iter()
        .map(|&w| build(w, o.batch))
        .collect::<Result<_>>()?;
    check(&sized[0])?;
    let columns: Vec<&str> = o.columns.iter().map(String::as_str).collect();
    // (width, column, threads) -> per-round measurements
    let mut cells: BTreeMap<(i64, &str, usize), Vec<Measured>> = BTreeMap::new();
    let nt = o.threads.len();
    for r in 0..o.rounds {
        let t = Instant::now();
        for (j, s) in sized.iter().enumerate() {
            for c in 0..columns.len() * nt {
                let k = (c + r + j) % (columns.len() * nt);
                let (column, threads) = (columns[k % columns.len()], o.threads[k / columns.len()]);
                THREADS.store(threads, std::sync::atomic::Ordering::Relaxed);
                let m = run_cell(s, column, o.cell)?;
                cells.entry((s.width, column, threads)).or_default().push(m);
            }
        }
        eprintln!(
            "scale bench: round {r} in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    let med = |w: i64, c: &str, t: usize, f: fn(&Measured) -> Option<f64>| {
        median(cells[&(w, c, t)].iter().filter_map(f).collect())
    };
    // Ratios per round, then the median: both sides of a ratio come from one round.
    let ratio = |a: (i64, &str, usize), b: (i64, &str, usize), f: fn(&Measured) -> f64| {
        let (a, b) = (&cells[&a], &cells[&b]);
        median(a.iter().zip(b).map(|(a, b)| f(a) / f(b)).collect())
    };
    let per = |m: &Measured| m.per_step;
    if columns != ["floor", "step", "step_if"] {
        // Chosen columns: each against the first, per round.
        let base = columns[0];
        println!("\nms per micro-step (medians over {} rounds); ratios to '{base}', medians of per-round ratios.\n", o.rounds);
        println!("| W | T | column | ms | / {base} | non-applying / {base} | first / {base} | applying / {base} |");
        println!("|--:|--:|---|--:|--:|--:|--:|--:|");
        for s in &sized {
            for &t in &o.threads {
                let w = s.width;
                for &c in &columns {
                    let applying = cells[&(w, c, t)]
                        .iter()
                        .zip(&cells[&(w, base, t)])
                        .filter_map(|(a, b)| Some(a.apply? / b.per_step))
                        .collect::<Vec<f64>>();
                    let applying = match applying.is_empty() {
                        true => "".to_string(),
                        false => format!("{:.2}", median(applying)),
                    };
                    println!(
                        "| {w} | {t} | {c} | {:.4} | {:.3} | {:.3} | {:.3} | {applying} |",
                        med(w, c, t, |m| Some(m.per_step)),
                        ratio((w, c, t), (w, base, t), per),
                        ratio((w, c, t), (w, base, t), |m| m.nonapply),
                        ratio((w, c, t), (w, base, t), |m| m.first),
                    );
                }
            }
        }
        return Ok(());
    }
    println!(
        "\nTwo-layer MLP of width W (x, hidden and output W wide), B = {}, K = {K}, AdamW, \
         T intra-op threads, {} rounds. ms per micro-step (median over windows of window time / K; \
         medians over rounds); ratios are medians of per-round ratios.\n",
        o.batch, o.rounds
    );
    println!("| W | parameters | state MiB | T | floor | step | step If | step/floor | If/floor | step non-applying | step applying | If non-applying | non-applying/floor | first/floor |");
    println!("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for s in &sized {
        let w = s.width;
        // Parameters, accumulators and two moments, float32.
        let state_mib = 4.0 * s.params as f64 * 4.0 / (1 << 20) as f64;
        for &t in &o.threads {
            println!(
                "| {w} | {} | {state_mib:.1} | {t} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
                s.params,
                med(w, "floor", t, |m| Some(m.per_step)),
                med(w, "step", t, |m| Some(m.per_step)),
                med(w, "step_if", t, |m| Some(m.per_step)),
                ratio((w, "step", t), (w, "floor", t), per),
                ratio((w, "step_if", t), (w, "floor", t), per),
                med(w, "step", t, |m| Some(m.nonapply)),
                med(w, "step", t, |m| m.apply),
                med(w, "step_if", t, |m| Some(m.nonapply)),
                ratio((w, "step", t), (w, "floor", t), |m| m.nonapply),
                ratio((w, "step", t), (w, "floor", t), |m| m.first),
            );
        }
    }
    // What no implementation of the step can avoid, against what it costs.
    println!(
        "\nThe bound: floor + apply / K, the apply the longer of its traffic (a stream timed \
         over buffers of the parameters' size: stream_bound; the accumulations add none, each \
         made in its product) and its arithmetic (a square root and a division per parameter: \
         arithmetic_bound). step/bound: how much of the step is more than the floor and that.\n"
    );
    println!(
        "| W | T | floor | apply stream | apply arithmetic | bound | bound/floor | step/bound |"
    );
    println!("|--:|--:|--:|--:|--:|--:|--:|--:|");
    for s in &sized {
        let w = s.width;
        for &t in &o.threads {
            let stream = stream_bound(s.params, t, 15);
            let arithmetic = arithmetic_bound(s.params, t);
            let floor = med(w, "floor", t, |m| Some(m.per_step));
            let bound = floor + stream.max(arithmetic) / K as f64;
            println!(
                "| {w} | {t} | {floor:.3} | {stream:.3} | {arithmetic:.3} | {bound:.3} | {:.2} | {:.2} |",
                bound / floor,
                med(w, "step", t, |m| Some(m.per_step)) / bound,
            );
        }
    }
    if let [t1, t2, ..] = o.threads[..] {
        println!("\nSpeed-up from T = {t1} to T = {t2} (time at {t1} / time at {t2}, per round, median):\n");
        println!("| W | floor | step | step If | step non-applying |");
        println!("|--:|--:|--:|--:|--:|");
        for s in &sized {
            let w = s.width;
            println!(
                "| {w} | {:.2} | {:.2} | {:.2} | {:.2} |",
                ratio((w, "floor", t1), (w, "floor", t2), per),
                ratio((w, "step", t1), (w, "step", t2), per),
                ratio((w, "step_if", t1), (w, "step_if", t2), per),
                ratio((w, "step", t1), (w, "step", t2), |m| m.nonapply),
            );
        }
    }
    Ok(())
}

/// `--least`: what no step built of standard ONNX Runtime sessions can leave out, at the
/// first width, one thread. A micro-step that adds to the window's sums must feed them to
/// the session and get them back: at the least, with no node more than the floor, its
/// gradients' own nodes add into them (`Gradients::Folded`: a `Gemm`'s C, which cannot be
/// undone for a discarded micro-step, so this is a bound, not a design). The applying
/// micro-step runs at least one node more for the update (`extra_node`). The window's first
/// micro-step writes its gradients as the sums: the floor. So over a window of K the step
/// costs at least floor + ((K - 1) fed + 1 node) / K. The three sessions run in turn, a
/// window of K runs each, for `--cell-ms` x 10; medians of the single runs.
fn least(o: &Opts) -> Result<()> {
    let (w, batch) = (o.widths[0], o.batch);
    let plain = build(w, batch)?;
    let folded = |extra_node| {
        let (graph, grads) = mlp_gradient_graph(w, Gradients::Folded { batch, extra_node });
        with_gradient_outputs(&graph, &grads)
    };
    let graphs = [
        ("floor", plain.floor.clone()),
        ("sums fed", folded(false)),
        ("sums fed, one node more", folded(true)),
    ];
    let options = session_options();
    let mut runs = Vec::new();
    for (name, graph) in &graphs {
        let engine = Engine::new(EngineKind::Ort, graph, &options)?;
        let g = graph.graph.as_ref().unwrap();
        let mut held = Vec::new();
        for input in &g.input {
            let input = input.name();
            if input == "x" || input == "t" {
                continue;
            }
            let value = match g.initializer.iter().find(|t| t.name() == input) {
                Some(init) => Tensor::from_tensor_proto(init).map_err(|m| anyhow!(m))?,
                None => onnx_ga::train::zeros_of_input(g, input)?,
            };
            let ort = onnx_ga::engine::ort::to_owned_ort(input, &value)?;
            held.push((input.to_string(), Held::Ort(ort)));
        }
        runs.push((*name, engine, held, Vec::new()));
    }
    // With zero sums the folded graphs return the floor's gradients (a bias's as [1, w]),
    // within float32 rounding: the graph timed is the right one.
    let batch0: Vec<(&str, &Tensor)> = plain.batches[0]
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let mut outputs = Vec::new();
    for (_, engine, held, _) in runs.iter_mut() {
        let held: Vec<(&str, &Held)> = held.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let out = engine.run_held(&batch0, &held)?;
        let mut flat = BTreeMap::new();
        for (name, value) in out {
            if let Tensor::F32(a) = value.to_host(&name)? {
                flat.insert(name, a.iter().copied().collect::<Vec<f32>>());
            }
        }
        outputs.push(flat);
    }
    for (name, want) in &outputs[0] {
        let largest = want
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        for (k, got) in outputs.iter().enumerate().skip(1) {
            let got = &got[name];
            let worst = want
                .iter()
                .zip(got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if got.len() != want.len() || worst / largest > 1e-5 {
                bail!(
                    "--least: '{name}' of {} differs from the floor's by {worst:e}",
                    graphs[k].0
                );
            }
        }
    }
    let nb = plain.batches.len();
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < o.cell * 10 {
        for (_, engine, held, times) in runs.iter_mut() {
            for _ in 0..K {
                let batch = &plain.batches[i % nb];
                i += 1;
                let host: Vec<(&str, &Tensor)> =
                    batch.iter().map(|(k, v)| (k.as_str(), v)).collect();
                let held: Vec<(&str, &Held)> = held.iter().map(|(k, v)| (k.as_str(), v)).collect();
                let s = Instant::now();
                engine.run_held(&host, &held)?;
                times.push(s.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let us: Vec<f64> = runs
        .into_iter()
        .map(|(_, _, _, times)| median(times))
        .collect();
    let (floor, fed, node) = (us[0], us[1] - us[0], us[2] - us[1]);
    let bound = floor + ((K - 1) as f64 * fed + node) / K as f64;
    println!(
        "W = {w} ({} parameters), B = {batch}, one thread, K = {K}: µs per run, medians of single runs",
        plain.params
    );
    println!("| floor | sums fed | sums fed, one node more | fed - floor | the node | least step | least step / floor |");
    println!("|--:|--:|--:|--:|--:|--:|--:|");
    println!(
        "| {floor:.1} | {:.1} | {:.1} | {fed:.1} | {node:.1} | {bound:.1} | {:.3} |",
        us[1],
        us[2],
        bound / floor
    );
    Ok(())
}
