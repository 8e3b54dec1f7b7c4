//! Convolutions on ONNX Runtime's blocked-layout kernels (src/passes/nchwc_conv.rs, applied
//! by every CPU session with `SessionOptions::nchwc_convs`): each admitted geometry against
//! the definition summed in float64, the geometries the rule leaves alone, and a small
//! ResNet-like network trained for 8 windows on the blocked kernels against the same step on
//! the im2col kernels. Every case checks how many convolutions went onto the blocked kernels,
//! so that none can pass by running the plain kernel twice.

use std::collections::BTreeMap;

use crate::common::ort_available;
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{nchwc_block, OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

fn options(nchwc: bool) -> SessionOptions {
    SessionOptions {
        nchwc_convs: nchwc,
        ..SessionOptions::default()
    }
}

/// The blocked kernels' channel block on this CPU; `None` (and a note) where there are none,
/// and then every case checks that nothing was rewritten instead.
fn block() -> Option<i64> {
    let block = nchwc_block(&options(true)).unwrap();
    if block.is_none() {
        eprintln!("this CPU has no 8- or 16-wide NCHWc kernels: nothing is rewritten");
    }
    block
}

use crate::common::{pattern as values, pattern_tensor as tensor};

/// One convolution's geometry, as the ONNX attributes say it.
struct Case {
    what: &'static str,
    op: &'static str,
    x: [usize; 4],
    w: [usize; 4],
    bias: bool,
    relu: bool,
    pads: [i64; 4],
    strides: [i64; 2],
    dilations: [i64; 2],
    group: i64,
}

const CONV: Case = Case {
    what: "",
    op: "Conv",
    x: [2, 16, 16, 16],
    w: [16, 16, 3, 3],
    bias: true,
    relu: false,
    pads: [1, 1, 1, 1],
    strides: [1, 1],
    dilations: [1, 1],
    group: 1,
};

/// A stride-1 data gradient with uneven pads and a bias, 32 -> 16 on a 16x17 image.
const CONV_TRANSPOSE_UNEVEN: Case = Case {
    what: "ConvTranspose 32 -> 16, stride 1, uneven pads, bias",
    op: "ConvTranspose",
    x: [2, 32, 16, 17],
    w: [32, 16, 3, 3],
    pads: [1, 0, 1, 2],
    ..CONV
};

impl Case {
    /// The output's channels: W's first axis for a Conv, its second for a ConvTranspose.
    fn out_channels(&self) -> usize {
        match self.op {
            "Conv" => self.w[0],
            _ => self.w[1],
        }
    }

    fn model(&self) -> ModelProto {
        let dims = |d: &[usize]| {
            d.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let list = |v: &[i64]| {
            v.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let channels = self.out_channels();
        let (bias_input, bias_arg) = match self.bias {
            true => (format!(", float[{channels}] b"), ", b"),
            false => (String::new(), ""),
        };
        let conv = format!(
            "c = {} <pads = [{}], strides = [{}], dilations = [{}], group = {}> (x, w{bias_arg})",
            self.op,
            list(&self.pads),
            list(&self.strides),
            list(&self.dilations),
            self.group,
        );
        let tail = match self.relu {
            true => "y = Relu (c)",
            false => "y = Identity (c)",
        };
        let text = format!(
            "<ir_version: 8, opset_import: [\"\" : 17]>\n\
             conv (float[{}] x, float[{}] w{bias_input}) => (float y) {{ {conv}\n {tail} }}",
            dims(&self.x),
            dims(&self.w),
        );
        onnx_ga::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{}: {e}", self.what))
    }

    fn inputs(&self) -> BTreeMap<String, Tensor> {
        let mut inputs = BTreeMap::from([
            ("x".to_string(), tensor(&self.x, 1)),
            ("w".to_string(), tensor(&self.w, 2)),
        ]);
        if self.bias {
            inputs.insert("b".into(), tensor(&[self.out_channels()], 3));
        }
        inputs
    }

    /// The definition in float64: `Conv` gathers, `ConvTranspose` (stride 1) scatters.
    fn reference(&self, inputs: &BTreeMap<String, Tensor>) -> (Vec<usize>, Vec<f64>) {
        let f = |name: &str| match &inputs[name] {
            Tensor::F32(a) => a.iter().map(|v| *v as f64).collect::<Vec<f64>>(),
            _ => unreachable!(),
        };
        let (x, w) = (f("x"), f("w"));
        let bias = self.bias.then(|| f("b"));
        let [n, c, h, wd] = self.x;
        let [kh, kw] = [self.w[2], self.w[3]];
        let [pt, pl, pb, pr] = self.pads.map(|p| p as isize);
        let [sh, sw] = self.strides.map(|s| s as isize);
        let [dh, dw] = self.dilations.map(|d| d as isize);
        let (m, oh, ow) = if self.op == "Conv" {
            let span = |size: usize, k: usize, d: isize, b: isize, e: isize, s: isize| {
                ((size as isize + b + e - (k as isize - 1) * d - 1) / s + 1) as usize
            };
            (
                self.w[0],
                span(h, kh, dh, pt, pb, sh),
                span(wd, kw, dw, pl, pr, sw),
            )
        } else {
            let span = |size: usize, k: usize, s: isize, b: isize, e: isize| {
                (s * (size as isize - 1) + k as isize - b - e) as usize
            };
            (self.w[1], span(h, kh, sh, pt, pb), span(wd, kw, sw, pl, pr))
        };
        let mut y = vec![0f64; n * m * oh * ow];
        for img in 0..n {
            for o in 0..m {
                for yi in 0..oh {
                    for yj in 0..ow {
                        let mut sum = bias.as_ref().map_or(0.0, |b| b[o]);
                        for i in 0..kh {
                            for j in 0..kw {
                                if self.op == "Conv" {
                                    let xi = yi as isize * sh - pt + i as isize * dh;
                                    let xj = yj as isize * sw - pl + j as isize * dw;
                                    if xi < 0 || xj < 0 || xi >= h as isize || xj >= wd as isize {
                                        continue;
                                    }
                                    let per_group = c / self.group as usize;
                                    let first = o / (m / self.group as usize) * per_group;
                                    for ch in 0..per_group {
                                        let xv = x[((img * c + first + ch) * h + xi as usize) * wd
                                            + xj as usize];
                                        sum += xv * w[((o * per_group + ch) * kh + i) * kw + j];
                                    }
                                } else {
                                    // y[o, yi, yj] += x[ch, xi, xj] w[ch, o, i, j] where
                                    // yi = s xi + i - pt.
                                    let (ti, tj) = (
                                        yi as isize + pt - i as isize,
                                        yj as isize + pl - j as isize,
                                    );
                                    if ti % sh != 0 || tj % sw != 0 {
                                        continue;
                                    }
                                    let (xi, xj) = (ti / sh, tj / sw);
                                    if xi < 0 || xj < 0 || xi >= h as isize || xj >= wd as isize {
                                        continue;
                                    }
                                    for ch in 0..c {
                                        let xv = x
                                            [((img * c + ch) * h + xi as usize) * wd + xj as usize];
                                        sum += xv * w[((ch * m + o) * kh + i) * kw + j];
                                    }
                                }
                            }
                        }
                        if self.relu {
                            sum = sum.max(0.0);
                        }
                        y[((img * m + o) * oh + yi) * ow + yj] = sum;
                    }
                }
            }
        }
        (vec![n, m, oh, ow], y)
    }

    /// Runs the case on the blocked kernels; returns how many convolutions went there and
    /// the output's largest difference from the float64 definition, relative to its largest
    /// magnitude.
    fn run(&self) -> (usize, f64) {
        let model = self.model();
        let inputs = self.inputs();
        let mut session = OrtSession::new(&model, &options(true))
            .unwrap_or_else(|e| panic!("{}: {e}", self.what));
        let feeds: Vec<(&str, &Tensor)> = inputs.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let outputs = session
            .run(&feeds)
            .unwrap_or_else(|e| panic!("{}: {e}", self.what));
        let Tensor::F32(y) = &outputs[0].1 else {
            panic!("{}: not float32", self.what)
        };
        let (shape, reference) = self.reference(&inputs);
        assert_eq!(y.shape(), shape.as_slice(), "{}: shape", self.what);
        let largest = reference.iter().fold(0f64, |a, v| a.max(v.abs()));
        let worst = y
            .iter()
            .zip(&reference)
            .fold(0f64, |a, (y, r)| a.max((*y as f64 - r).abs()));
        (session.nchwc_convs(), worst / largest)
    }
}

/// Every geometry the rule admits runs on the blocked kernels and agrees with the
/// definition to float32 rounding: strides, uneven pads, dilation, a non-square kernel,
/// with and without bias, a folded Relu, and the stride-1 data gradient (ConvTranspose).
#[test]
fn admitted_convolutions_agree_with_the_definition() {
    if !ort_available() {
        return;
    }
    let expected = usize::from(block().is_some());
    let cases = [
        Case {
            what: "3x3, pads 1, bias",
            ..CONV
        },
        Case {
            what: "3x3, no bias, Relu folded",
            bias: false,
            relu: true,
            ..CONV
        },
        Case {
            what: "16 -> 32, stride 2, uneven pads",
            x: [2, 16, 32, 32],
            w: [32, 16, 3, 3],
            pads: [0, 1, 1, 0],
            strides: [2, 2],
            ..CONV
        },
        Case {
            what: "3x2 kernel, dilation (2, 1)",
            w: [16, 16, 3, 2],
            pads: [2, 0, 2, 1],
            dilations: [2, 1],
            ..CONV
        },
        CONV_TRANSPOSE_UNEVEN,
        Case {
            what: "64 -> 64 at 8x8 (the ResNet-8's last block)",
            x: [2, 64, 8, 8],
            w: [64, 64, 3, 3],
            ..CONV
        },
        Case {
            what: "ConvTranspose 64 -> 64 at 8x8",
            op: "ConvTranspose",
            x: [2, 64, 8, 8],
            w: [64, 64, 3, 3],
            ..CONV
        },
        Case {
            what: "ConvTranspose 16 -> 16, stride 1, Relu",
            op: "ConvTranspose",
            bias: false,
            relu: true,
            ..CONV
        },
    ];
    for case in cases {
        let (rewritten, error) = case.run();
        assert_eq!(rewritten, expected, "{}: convolutions rewritten", case.what);
        // float32 sums of up to 288 products against float64: a few ulps of the largest.
        assert!(error < 2e-6, "{}: relative error {error:e}", case.what);
    }
}

/// The weight's blocked layout on onnx-ga's `BlockedWeight` kernel (with the fused kernels)
/// and by the standard ops' six-axis `Transpose` (without): the same outputs, bit for bit,
/// forward and for the data gradient's swapped, flipped weight.
#[test]
fn the_blocked_weight_kernel_lays_the_weight_out_as_the_standard_ops_do() {
    if !ort_available() || block().is_none() {
        return;
    }
    let cases = [
        Case {
            what: "3x3, pads 1, bias",
            ..CONV
        },
        Case {
            what: "3x2 kernel, 16 -> 32",
            x: [2, 16, 16, 16],
            w: [32, 16, 3, 2],
            pads: [1, 0, 1, 1],
            ..CONV
        },
        CONV_TRANSPOSE_UNEVEN,
    ];
    for case in cases {
        let model = case.model();
        let inputs = case.inputs();
        let feeds: Vec<(&str, &Tensor)> = inputs.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let run = |fused_kernels: bool| {
            let options = SessionOptions {
                fused_kernels,
                ..options(true)
            };
            let mut session = OrtSession::new(&model, &options).unwrap();
            let Tensor::F32(y) = session.run(&feeds).unwrap().remove(0).1 else {
                panic!("{}: not float32", case.what)
            };
            let bits: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
            (
                session.nchwc_convs(),
                session.nchwc_weights_on_kernel(),
                bits,
            )
        };
        let (kernel, standard) = (run(true), run(false));
        assert_eq!((kernel.0, kernel.1), (1, 1), "{}: on the kernel", case.what);
        assert_eq!(
            (standard.0, standard.1),
            (1, 0),
            "{}: standard ops",
            case.what
        );
        assert!(kernel.2 == standard.2, "{}: outputs differ", case.what);
    }
}

/// What the rule leaves to the im2col kernel (each measured slower or not supported on the
/// blocked one): 1x1 kernels, outputs narrower than 8, channels off the block, groups,
/// strided data gradients, constant weights (ONNX Runtime's own transformer takes those).
#[test]
fn convolutions_the_rule_leaves_alone() {
    if !ort_available() {
        return;
    }
    let cases = [
        Case {
            what: "1x1",
            w: [16, 16, 1, 1],
            pads: [0; 4],
            ..CONV
        },
        Case {
            what: "4 wide",
            x: [2, 16, 4, 4],
            ..CONV
        },
        Case {
            what: "3 input channels",
            x: [2, 3, 16, 16],
            w: [16, 3, 3, 3],
            ..CONV
        },
        Case {
            what: "two groups",
            w: [16, 8, 3, 3],
            group: 2,
            ..CONV
        },
        Case {
            what: "ConvTranspose stride 2",
            op: "ConvTranspose",
            w: [16, 16, 3, 3],
            strides: [2, 2],
            ..CONV
        },
    ];
    for case in cases {
        let (rewritten, error) = case.run();
        assert_eq!(rewritten, 0, "{}: rewritten", case.what);
        assert!(error < 2e-6, "{}: relative error {error:e}", case.what);
    }
    // A constant weight.
    let mut model = CONV.model();
    let graph = model.graph.as_mut().unwrap();
    let w = match tensor(&CONV.w, 2) {
        Tensor::F32(a) => a.iter().copied().collect::<Vec<f32>>(),
        _ => unreachable!(),
    };
    graph.initializer.push(onnx_ga::ir::builder::tensor_f32(
        &CONV.w.map(|d| d as i64),
        &w,
    ));
    graph.initializer.last_mut().unwrap().name = Some("w".into());
    graph.input.retain(|i| i.name() != "w");
    let session = OrtSession::new(&model, &options(true)).unwrap();
    assert_eq!(session.nchwc_convs(), 0, "a constant weight");
}

/// A small residual network (16 channels at 32x32: two 3x3 convolutions with Relu, a skip
/// connection, a strided 3x3 to 32 channels, average pool, a linear classifier) through our
/// autodiff, K = 4, trained 8 windows split on the blocked kernels and on the im2col kernels,
/// with the forward and the stride-1 data-gradient convolutions on the blocked kernels.
///
/// SGD and momentum: the losses and every state within 1e-6 relative (states: largest
/// difference over the tensor's largest magnitude). Adam and AdamW: the losses within 1e-5
/// relative at every micro-step, the states within 1e-4 (measured 1.1e-7 and 3.6e-5). Adam
/// divides each gradient element by its own running RMS, so an element whose gradient is
/// mostly rounding noise moves by a sizeable part of lr either way (the strided
/// convolution's weight here; tests/tract_engine.rs meets the same between two engines,
/// 3.3e-5). Each alone and with AGC, dynamic loss scaling and weighted normalisation around
/// it.
///
/// Adam behind AGC is chaotic here: multiplying every 97th input element by 1 + 1.2e-7
/// (rounding-sized) moves the states by 4.2e-2 on the im2col kernels alone (AdamW behind AGC:
/// 3.6e-6). Behind AGC the bounds are therefore at least twice what that perturbation does
/// (Adam's blocked kernels measured 6.7e-2 apart, its losses 2.7e-5).
#[test]
fn a_residual_network_trains_on_the_blocked_kernels_within_rounding() {
    if !ort_available() {
        return;
    }
    let optimizers: [(&str, f64, f64); 4] = [
        // (optimizer, losses' bound, states' bound)
        ("optimizer(kind=sgd,lr=0.05)", 1e-6, 1e-6),
        ("optimizer(kind=momentum,lr=0.05,momentum=0.9)", 1e-6, 1e-6),
        ("optimizer(kind=adam,lr=0.01)", 1e-5, 1e-4),
        ("optimizer(kind=adamw,lr=0.01)", 1e-5, 1e-4),
    ];
    let arounds = crate::common::AROUNDS;
    let (blocked, plain) = (Run::BLOCKED, Run::PLAIN);
    for (optimizer, losses, states) in optimizers {
        for around in arounds {
            let middle = format!("{around},{optimizer}");
            let step = residual_step(&middle);
            let (loss, state) = train_two(&step, &middle, blocked, plain);
            let chaotic = optimizer.contains("adam") && around.contains("agc");
            let (losses, states) = match chaotic {
                false => (losses, states),
                true => {
                    let perturbed = Run {
                        perturbed: true,
                        ..plain
                    };
                    let (l, s) = train_two(&step, &middle, perturbed, plain);
                    (losses.max(2.0 * l), states.max(2.0 * s))
                }
            };
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

/// How [`train_two`] runs one side.
#[derive(Clone, Copy)]
struct Run {
    nchwc: bool,
    /// Every 97th element of each micro-batch's x multiplied by 1 + 1.2e-7.
    perturbed: bool,
}

impl Run {
    const BLOCKED: Run = Run {
        nchwc: true,
        perturbed: false,
    };
    const PLAIN: Run = Run {
        nchwc: false,
        perturbed: false,
    };
}

/// Trains `step` twice, as `a` and `b` say, 32 micro-steps, and checks that a blocked side
/// rewrote what it should ([`crate::common::train_pair`]).
fn train_two(step: &ModelProto, what: &str, a: Run, b: Run) -> (f64, f64) {
    let side = |run: Run| crate::common::Side {
        session: options(run.nchwc),
        perturbed: run.perturbed,
    };
    let runs = [a, b];
    let data = residual_data(16);
    crate::common::train_pair(
        step,
        what,
        (&data, 16),
        [&side(a), &side(b)],
        |trainer, k| {
            let expected = match (runs[k].nchwc, block()) {
                // Forward: the three convolutions; data gradient: the second's (the first's
                // input needs none, the strided one's stays a ConvTranspose); in each of the
                // three sessions (accumulate, window start, apply), which all run the backward.
                (true, Some(_)) => 3 * (3 + 1),
                _ => 0,
            };
            assert_eq!(trainer.nchwc_convs(), expected, "{what}: rewritten");
        },
    )
}

/// `train` says how many convolutions run on the blocked kernels, and `--no-nchwc` keeps
/// them all on the im2col kernels; both train.
#[test]
fn train_reports_the_blocked_convolutions_and_no_nchwc_keeps_none() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = dir.path().join("step.onnx");
    std::fs::write(
        &step,
        onnx_ga::model::encode_model(&residual_step(
            "grad-accum(steps=4),optimizer(kind=sgd,lr=0.05)",
        )),
    )
    .unwrap();
    let data = dir.path().join("data.npz");
    let (x, labels) = (
        tensor(&[8, 16, 32, 32], 5),
        Tensor::I64(ndarray::ArrayD::from_shape_vec(vec![8], (0..8).collect()).unwrap()),
    );
    onnx_ga::data::write_npz(&data, [("x", &x), ("labels", &labels)]).unwrap();
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
    let line = "on ONNX Runtime's blocked (NCHWc) CPU kernels";
    let blocked = train(&[]);
    match block() {
        Some(_) => assert!(
            blocked.contains(&format!("convolutions: 12 {line}")),
            "{blocked}"
        ),
        None => assert!(!blocked.contains(line), "{blocked}"),
    }
    let plain = train(&["--no-nchwc"]);
    assert!(!plain.contains(line), "{plain}");
}

/// `--threads 2` trains the blocked kernels as `--threads 1` does, bit for bit: each output
/// block is summed by one thread in one order, however the pool splits the work.
#[test]
fn two_threads_train_the_blocked_kernels_bit_identically() {
    if !ort_available() {
        return;
    }
    let step = residual_step("grad-accum(steps=4),optimizer(kind=adamw,lr=0.01)");
    let (n, data) = (16, residual_data(16));
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
    assert_eq!(one.nchwc_convs(), two.nchwc_convs());
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

/// `n` samples for [`residual_step`]: x (n x 16 x 32 x 32) and labels cycling through 10.
pub(crate) fn residual_data(n: usize) -> BTreeMap<String, Tensor> {
    BTreeMap::from([
        ("x".to_string(), tensor(&[n, 16, 32, 32], 5)),
        (
            "labels".to_string(),
            Tensor::I64(
                ndarray::ArrayD::from_shape_vec(vec![n], (0..n as i64).map(|i| i % 10).collect())
                    .unwrap(),
            ),
        ),
    ])
}

/// [`residual_step`]'s forward model through our autodiff and `middle` (grad-accum and the
/// optimizer, with what surrounds them).
pub(crate) fn residual_step(middle: &str) -> ModelProto {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
resnet (float[N,16,32,32] x, int64[N] labels) => (float loss)
{
  c1 = Conv <pads = [1,1,1,1]> (x, w1, b1)
  r1 = Relu (c1)
  c2 = Conv <pads = [1,1,1,1]> (r1, w2, b2)
  s = Add (c2, x)
  r2 = Relu (s)
  c3 = Conv <pads = [1,1,1,1], strides = [2,2]> (r2, w3, b3)
  r3 = Relu (c3)
  p = GlobalAveragePool (r3)
  f = Flatten (p)
  logits = Gemm <transB = 1> (f, wf, bf)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}
"#;
    let mut model = onnx_ga::ir::text::parse_model(text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let mut add = |name: &str, dims: &[i64], seed: usize, scale: f32| {
        let n: i64 = dims.iter().product();
        let v: Vec<f32> = values(n as usize, seed).iter().map(|v| v * scale).collect();
        let mut t = onnx_ga::ir::builder::tensor_f32(dims, &v);
        t.name = Some(name.into());
        graph.initializer.push(t);
    };
    add("w1", &[16, 16, 3, 3], 11, 0.2);
    add("b1", &[16], 12, 0.1);
    add("w2", &[16, 16, 3, 3], 13, 0.2);
    add("b2", &[16], 14, 0.1);
    add("w3", &[32, 16, 3, 3], 15, 0.2);
    add("b3", &[32], 16, 0.1);
    add("wf", &[10, 32], 17, 0.5);
    add("bf", &[10], 18, 0.1);
    crate::common::ort_step(model, "resnet.onnx", middle)
}
