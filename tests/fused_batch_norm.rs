//! Training-mode BatchNorm on onnx-ga's fused kernels (src/passes/fused_batch_norm.rs,
//! applied by every CPU session with `SessionOptions::fused_batch_norm`): the gradient graph
//! of one layer, at several geometries, against the definition in float64; the layers the
//! patterns leave alone; and a small network with BatchNorm trained for 8 windows on the
//! fused kernels against the same step in standard ops. Every case checks how many layers
//! went onto the fused kernels, so that none can pass by running the standard ops twice.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{ort_available, run_ort};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

fn options(fused: bool) -> SessionOptions {
    SessionOptions {
        fused_batch_norm: fused,
        // The convolutions of the network below stay on one kernel on both sides.
        nchwc_convs: false,
        ..SessionOptions::default()
    }
}

/// Deterministic values around `offset`, spread about ±0.5.
fn values(n: usize, seed: usize, offset: f32) -> Vec<f32> {
    let spread = crate::common::pattern(n, seed);
    spread.into_iter().map(|v| offset + v).collect()
}

fn tensor(dims: &[usize], seed: usize, offset: f32) -> Tensor {
    let n = dims.iter().product();
    Tensor::F32(ndarray::ArrayD::from_shape_vec(dims.to_vec(), values(n, seed, offset)).unwrap())
}

fn initializer(graph: &mut onnx_ga::proto::GraphProto, name: &str, dims: &[i64], v: &[f32]) {
    let mut t = onnx_ga::ir::builder::tensor_f32(dims, v);
    t.name = Some(name.into());
    graph.initializer.push(t);
}

/// One BatchNorm layer: `loss = Σ BatchNormalization(x + p) · r`, so that the gradient of
/// the parameter p is dX and dY is r.
struct Layer {
    what: &'static str,
    dims: &'static [usize],
    /// The batch axis declared symbolic (`N`): the count is computed at run time.
    symbolic_batch: bool,
    /// Added to every element of x: the variance must not lose it.
    offset: f32,
}

impl Layer {
    fn gradient_graph(&self) -> ModelProto {
        let shape: Vec<String> = self
            .dims
            .iter()
            .enumerate()
            .map(|(i, d)| match (i, self.symbolic_batch) {
                (0, true) => "N".to_string(),
                _ => d.to_string(),
            })
            .collect();
        let shape = shape.join(",");
        let text = format!(
            r#"<ir_version: 8, opset_import: ["" : 17]>
bn (float[{shape}] x, float[{shape}] r) => (float loss)
{{
  xp = Add (x, p)
  y = BatchNormalization <epsilon = 1e-5, momentum = 0.9, training_mode = 1> (xp, s, b, mean, var)
  yr = Mul (y, r)
  loss = ReduceSum <keepdims = 0> (yr)
}}
"#
        );
        let mut model = onnx_ga::ir::text::parse_model(&text).unwrap();
        let graph = model.graph.as_mut().unwrap();
        let c = self.dims[1];
        let all: Vec<i64> = self.dims.iter().map(|&d| d as i64).collect();
        let n: usize = self.dims.iter().product();
        initializer(
            graph,
            "p",
            &all,
            &values(n, 3, 0.0)
                .iter()
                .map(|v| v * 0.1)
                .collect::<Vec<_>>(),
        );
        let per_channel = |seed: usize, offset: f32| values(c, seed, offset);
        initializer(graph, "s", &[c as i64], &per_channel(4, 1.0));
        initializer(graph, "b", &[c as i64], &per_channel(5, 0.0));
        initializer(graph, "mean", &[c as i64], &per_channel(6, 0.0));
        initializer(graph, "var", &[c as i64], &per_channel(7, 1.5));
        let mut forward = onnx_ga::signature::forward(model, Path::new("bn.onnx"));
        forward.signature.loss = "loss".into();
        onnx_ga::step::build_step(forward, "autodiff(loss=loss),legalize-ort,dce", true)
            .unwrap_or_else(|e| panic!("{}: {e}", self.what))
            .model
            .to_proto()
    }

    fn inputs(&self) -> BTreeMap<String, Tensor> {
        BTreeMap::from([
            ("x".to_string(), tensor(self.dims, 1, self.offset)),
            ("r".to_string(), tensor(self.dims, 2, 0.0)),
        ])
    }
}

/// The layer's outputs in float64 from the definition:
/// (loss, dX, dScale, dBias, running mean, running variance).
fn definition(layer: &Layer) -> BTreeMap<&'static str, Vec<f64>> {
    let dims = layer.dims;
    let (images, channels) = (dims[0], dims[1]);
    let plane: usize = dims[2..].iter().product();
    let f = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<f64>>();
    let total = images * channels * plane;
    let x: Vec<f64> = f(values(total, 1, layer.offset))
        .iter()
        .zip(f(values(total, 3, 0.0)))
        .map(|(x, p)| x + (p as f32 * 0.1) as f64)
        .collect();
    let r = f(values(total, 2, 0.0));
    let (s, b) = (f(values(channels, 4, 1.0)), f(values(channels, 5, 0.0)));
    let (mean0, var0) = (f(values(channels, 6, 0.0)), f(values(channels, 7, 1.5)));
    let at = |i: usize, c: usize, k: usize| (i * channels + c) * plane + k;
    let n = (images * plane) as f64;
    let mut out: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let (mut loss, mut dx) = (0f64, vec![0f64; total]);
    for c in 0..channels {
        let idx: Vec<usize> = (0..images)
            .flat_map(|i| (0..plane).map(move |k| at(i, c, k)))
            .collect();
        let mean = idx.iter().map(|&j| x[j]).sum::<f64>() / n;
        let var = idx.iter().map(|&j| (x[j] - mean).powi(2)).sum::<f64>() / n;
        let inv_std = 1.0 / (var + 1e-5f32 as f64).sqrt();
        let x_hat = |j: usize| (x[j] - mean) * inv_std;
        loss += idx
            .iter()
            .map(|&j| (x_hat(j) * s[c] + b[c]) * r[j])
            .sum::<f64>();
        let dbias: f64 = idx.iter().map(|&j| r[j]).sum();
        let dscale: f64 = idx.iter().map(|&j| r[j] * x_hat(j)).sum();
        for &j in &idx {
            dx[j] = s[c] * inv_std * (r[j] - dbias / n - x_hat(j) * dscale / n);
        }
        out.entry("s_grad").or_default().push(dscale);
        out.entry("b_grad").or_default().push(dbias);
        out.entry("mean.next")
            .or_default()
            .push(mean0[c] * 0.9 + mean * (1.0 - 0.9f32 as f64));
        out.entry("var.next")
            .or_default()
            .push(var0[c] * 0.9 + var * (1.0 - 0.9f32 as f64));
    }
    out.insert("loss", vec![loss]);
    out.insert("p_grad", dx);
    out
}

/// The largest difference over the largest magnitude of the definition's value.
fn relative_gap(got: &Tensor, want: &[f64]) -> f64 {
    let Tensor::F32(got) = got else {
        panic!("not float32: {got:?}")
    };
    assert_eq!(got.len(), want.len());
    let largest = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()))
        / largest
}

const LAYERS: &[Layer] = &[
    Layer {
        what: "4-D, static",
        dims: &[4, 16, 8, 8],
        symbolic_batch: false,
        offset: 0.0,
    },
    Layer {
        what: "4-D, symbolic batch",
        dims: &[3, 5, 7, 9],
        symbolic_batch: true,
        offset: 0.0,
    },
    Layer {
        what: "4-D, an offset of 100",
        dims: &[2, 3, 6, 6],
        symbolic_batch: false,
        offset: 100.0,
    },
    Layer {
        what: "3-D",
        dims: &[5, 4, 37],
        symbolic_batch: true,
        offset: -2.0,
    },
    Layer {
        what: "5-D",
        dims: &[2, 3, 2, 3, 4],
        symbolic_batch: false,
        offset: 0.5,
    },
    Layer {
        what: "1x1 planes",
        dims: &[4, 6, 1, 1],
        symbolic_batch: false,
        offset: 0.0,
    },
    Layer {
        what: "one image",
        dims: &[1, 6, 3, 5],
        symbolic_batch: true,
        offset: 0.0,
    },
];

#[test]
fn fused_layers_agree_with_the_definition() {
    if !ort_available() {
        return;
    }
    for layer in LAYERS {
        let graph = layer.gradient_graph();
        let fused = OrtSession::new(&graph, &options(true)).unwrap();
        // One forward and one backward.
        assert_eq!(fused.fused_batch_norms(), 2, "{}", layer.what);
        let plain = OrtSession::new(&graph, &options(false)).unwrap();
        assert_eq!(plain.fused_batch_norms(), 0, "{}", layer.what);
        drop((fused, plain));
        // What the fused nodes replace is gone: no forward statistics or affine pass left
        // behind for some reader of a value they replaced.
        let rewritten = onnx_ga::passes::fused_batch_norm::rewrite(&graph)
            .unwrap()
            .expect("rewritten");
        let ops: Vec<&str> = rewritten
            .model
            .graph
            .as_ref()
            .unwrap()
            .node
            .iter()
            .map(|n| n.op_type())
            .collect();
        for gone in [
            "BatchNormalization",
            "ReduceSumSquare",
            "ReduceMean",
            "Reciprocal",
            "Sqrt",
        ] {
            assert!(
                !ops.contains(&gone),
                "{}: {gone} left in {ops:?}",
                layer.what
            );
        }
        let want = definition(layer);
        let inputs = layer.inputs();
        let run = |o: &SessionOptions| {
            let mut s = OrtSession::new(&graph, o).unwrap();
            let feeds: Vec<(&str, &Tensor)> = inputs.iter().map(|(k, v)| (k.as_str(), v)).collect();
            s.run(&feeds)
                .unwrap()
                .into_iter()
                .collect::<BTreeMap<_, _>>()
        };
        let (fused, plain) = (run(&options(true)), run(&options(false)));
        for (name, want) in &want {
            let (f, p) = (
                relative_gap(&fused[*name], want),
                relative_gap(&plain[*name], want),
            );
            eprintln!(
                "{}: {name}: fused {f:.1e}, standard ops {p:.1e}",
                layer.what
            );
            // The offset's rounding in x itself (100 + 0.5 in float32) bounds what any
            // float32 implementation can do there; the standard ops measure the same.
            let bound = match layer.offset.abs() > 10.0 {
                true => 2e-5,
                false => 2e-6,
            };
            assert!(
                f < bound,
                "{}: {name}: fused kernels {f:e} from the definition",
                layer.what
            );
            assert!(
                p < bound,
                "{}: {name}: standard ops {p:e} from the definition",
                layer.what
            );
        }
    }
}

/// What the patterns leave alone keeps running as written: BatchNorm over `[N, C]` (no
/// spatial axes: the lowering's other form), and any layer without the fused kernels.
#[test]
fn layers_the_patterns_leave_alone() {
    if !ort_available() {
        return;
    }
    let flat = Layer {
        what: "2-D",
        dims: &[8, 4],
        symbolic_batch: false,
        offset: 0.0,
    };
    let graph = flat.gradient_graph();
    let session = OrtSession::new(&graph, &options(true)).unwrap();
    assert_eq!(session.fused_batch_norms(), 0);
    let want = definition(&flat);
    let out = run_ort(&graph, &flat.inputs());
    for (name, want) in &want {
        let gap = relative_gap(&out[*name], want);
        assert!(gap < 2e-6, "2-D: {name}: {gap:e} from the definition");
    }
    // Without the fused kernels' domain nothing is rewritten either.
    let off = SessionOptions {
        fused_kernels: false,
        ..options(true)
    };
    let layer = &LAYERS[0];
    let session = OrtSession::new(&layer.gradient_graph(), &off).unwrap();
    assert_eq!(session.fused_batch_norms(), 0);
}

/// A small residual network with two BatchNorm layers, trained 8 windows on the fused
/// kernels and in standard ops, for each optimizer with what surrounds it.
#[test]
fn a_network_with_batch_norm_trains_on_the_fused_kernels_within_rounding() {
    if !ort_available() {
        return;
    }
    let optimizers: [(&str, f64, f64); 4] = [
        // (optimizer, losses' bound, states' bound); measured at most 1.2e-7 for the
        // losses, 7.9e-7 for the states of SGD and momentum, 3.9e-6 for Adam's (its
        // update divides by the root of a small second moment).
        ("optimizer(kind=sgd,lr=0.05)", 1e-6, 1e-6),
        ("optimizer(kind=momentum,lr=0.05,momentum=0.9)", 1e-6, 1e-6),
        ("optimizer(kind=adam,lr=0.01)", 1e-6, 1e-5),
        ("optimizer(kind=adamw,lr=0.01)", 1e-6, 1e-5),
    ];
    let arounds = crate::common::AROUNDS;
    for (optimizer, losses, states) in optimizers {
        for around in arounds {
            let middle = format!("{around},{optimizer}");
            let step = network_step(&middle);
            let (loss, state) = train_two(&step, &middle, 1);
            assert!(
                loss < losses,
                "{middle}: losses {loss:e} apart (bound {losses:e})"
            );
            assert!(
                state < states,
                "{middle}: states {state:e} apart (bound {states:e})"
            );
        }
    }
}

/// Each channel is one task, summed in one order however the pool splits the channels:
/// two threads train bit for bit as one.
#[test]
fn two_threads_train_the_fused_kernels_bit_identically() {
    if !ort_available() {
        return;
    }
    let step = network_step("grad-accum(steps=4),optimizer(kind=adamw,lr=0.01)");
    let (n, data) = (16, network_data(16));
    let trainer = |threads: usize| {
        let options = TrainOptions {
            session: SessionOptions {
                threads,
                ..options(true)
            },
            ..TrainOptions::default()
        };
        Trainer::with_options(&step, &options).unwrap()
    };
    let (mut one, mut two) = (trainer(1), trainer(2));
    assert_eq!((one.fused_batch_norms(), two.fused_batch_norms()), (12, 12));
    for i in 0..32 {
        let batch = micro_batch(&data, n, 4, i);
        let (a, b) = (
            one.step(&batch, false).unwrap(),
            two.step(&batch, false).unwrap(),
        );
        assert_eq!(a, b, "micro-step {i}");
    }
    assert_eq!(one.state().unwrap(), two.state().unwrap());
}

/// `train` says how many layers run on the fused kernels; `--no-fused-batch-norm` keeps
/// them as written. Both train.
#[test]
fn train_reports_the_fused_layers_and_the_flag_keeps_none() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = dir.path().join("step.onnx");
    let model = network_step("grad-accum(steps=4),optimizer(kind=sgd,lr=0.05)");
    std::fs::write(&step, onnx_ga::model::encode_model(&model)).unwrap();
    let data = dir.path().join("data.npz");
    let d = network_data(8);
    onnx_ga::data::write_npz(&data, [("x", &d["x"]), ("labels", &d["labels"])]).unwrap();
    let train = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
            .arg("train")
            .arg(&step)
            .arg("--data")
            .arg(&data)
            .args(["--micro-batch", "4", "--steps", "2"])
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "train {extra:?}: {stderr}");
        stderr
    };
    let line = "on onnx-ga's fused CPU kernels, summed over the sessions";
    let fused = train(&[]);
    assert!(
        fused.contains(&format!(
            "batch norm: 12 forward and backward layer(s) {line}"
        )),
        "{fused}"
    );
    let plain = train(&["--no-fused-batch-norm"]);
    assert!(!plain.contains("batch norm:"), "{plain}");
}

/// Trains `step` with the fused kernels and without, 32 micro-steps at `threads`, and
/// checks that the fused side rewrote every layer of every session
/// ([`crate::common::train_pair`]).
fn train_two(step: &ModelProto, what: &str, threads: usize) -> (f64, f64) {
    let side = |fused: bool| crate::common::Side {
        session: SessionOptions {
            threads,
            ..options(fused)
        },
        perturbed: false,
    };
    let data = network_data(16);
    crate::common::train_pair(
        step,
        what,
        (&data, 16),
        [&side(true), &side(false)],
        |t, k| {
            // Two layers, forward and backward, in each of the three sessions (accumulate,
            // window start, apply).
            let expected = if k == 0 { 3 * 2 * 2 } else { 0 };
            assert_eq!(t.fused_batch_norms(), expected, "{what}: rewritten");
        },
    )
}

/// `n` samples for [`network_step`]: x (n x 8 x 12 x 12) and labels cycling through 10.
fn network_data(n: usize) -> BTreeMap<String, Tensor> {
    BTreeMap::from([
        ("x".to_string(), tensor(&[n, 8, 12, 12], 5, 0.0)),
        (
            "labels".to_string(),
            Tensor::I64(
                ndarray::ArrayD::from_shape_vec(vec![n], (0..n as i64).map(|i| i % 10).collect())
                    .unwrap(),
            ),
        ),
    ])
}

/// A convolution, BatchNorm and ReLU twice around a skip connection, then a classifier,
/// through our autodiff and `middle` (grad-accum and the optimizer, with what surrounds
/// them).
fn network_step(middle: &str) -> ModelProto {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
net (float[N,8,12,12] x, int64[N] labels) => (float loss)
{
  c1 = Conv <pads = [1,1,1,1]> (x, w1)
  n1 = BatchNormalization <epsilon = 1e-5, momentum = 0.9, training_mode = 1> (c1, g1, b1, m1, v1)
  r1 = Relu (n1)
  c2 = Conv <pads = [1,1,1,1]> (r1, w2)
  n2 = BatchNormalization <epsilon = 1e-5, momentum = 0.9, training_mode = 1> (c2, g2, b2, m2, v2)
  s = Add (n2, x)
  r2 = Relu (s)
  p = GlobalAveragePool (r2)
  f = Flatten (p)
  logits = Gemm <transB = 1> (f, wf, bf)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}
"#;
    let mut model = onnx_ga::ir::text::parse_model(text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let mut add = |name: &str, dims: &[i64], seed: usize, scale: f32, offset: f32| {
        let n: i64 = dims.iter().product();
        let v: Vec<f32> = values(n as usize, seed, 0.0)
            .iter()
            .map(|v| offset + v * scale)
            .collect();
        initializer(graph, name, dims, &v);
    };
    add("w1", &[8, 8, 3, 3], 11, 0.3, 0.0);
    add("w2", &[8, 8, 3, 3], 13, 0.3, 0.0);
    for (k, layer) in ["1", "2"].iter().enumerate() {
        add(&format!("g{layer}"), &[8], 20 + k, 0.2, 1.0);
        add(&format!("b{layer}"), &[8], 22 + k, 0.2, 0.0);
        add(&format!("m{layer}"), &[8], 24 + k, 0.1, 0.0);
        add(&format!("v{layer}"), &[8], 26 + k, 0.1, 1.0);
    }
    add("wf", &[10, 8], 17, 0.5, 0.0);
    add("bf", &[10], 18, 0.1, 0.0);
    crate::common::ort_step(model, "net.onnx", middle)
}

/// The fused kernels read each layer's scale, which the fused optimizer may update in place:
/// with every state in place (however small) the step trains bit for bit as with none.
#[test]
fn in_place_updates_wait_for_the_fused_layers() {
    if !ort_available() {
        return;
    }
    let step = network_step("grad-accum(steps=4),optimizer(kind=adamw,lr=0.01)");
    let (n, data) = (16, network_data(16));
    let trainer = |in_place: bool| {
        let session = SessionOptions {
            in_place_updates: in_place,
            in_place_min_total: 0,
            ..options(true)
        };
        let options = TrainOptions {
            session,
            ..TrainOptions::default()
        };
        Trainer::with_options(&step, &options).unwrap()
    };
    let (mut in_place, mut apart) = (trainer(true), trainer(false));
    assert!(in_place.in_place_updates() > 0);
    assert_eq!(in_place.fused_batch_norms(), 12);
    for i in 0..32 {
        let batch = micro_batch(&data, n, 4, i);
        let (a, b) = (
            in_place.step(&batch, false).unwrap(),
            apart.step(&batch, false).unwrap(),
        );
        assert_eq!(a, b, "micro-step {i}");
    }
    assert_eq!(in_place.state().unwrap(), apart.state().unwrap());
}
