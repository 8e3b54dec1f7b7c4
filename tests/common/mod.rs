//! Helpers shared by integration tests: ONNX Runtime availability, running models, comparing
//! tensors with stated tolerances.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Whether the forward model at `path` computes its own loss (its first output is named
/// `loss`, as graphs/forward/torch_mlp_nll's): it trains with `--loss loss`, not `--loss-fn`.
pub fn computes_own_loss(path: &Path) -> bool {
    let proto = onnx_ga::model::load_model_with_data(path).unwrap_or_else(|e| panic!("{e}"));
    proto
        .graph
        .as_ref()
        .and_then(|g| g.output.first())
        .is_some_and(|o| o.name() == "loss")
}

/// True when ONNX Runtime is available; under CI=true a missing library fails the test.
pub fn ort_available() -> bool {
    onnx_ga::runtime::require_onnxruntime_for_tests().is_some()
}

/// Runs `model` once on ONNX Runtime (one thread) and returns its outputs by name.
pub fn run_ort(model: &ModelProto, inputs: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    let mut session = OrtSession::new(model, &SessionOptions::default())
        .unwrap_or_else(|e| panic!("session: {e}"));
    session
        .run(&feeds(&session.input_names, inputs))
        .unwrap_or_else(|e| panic!("run: {e}"))
        .into_iter()
        .collect()
}

/// The entries of `inputs` a session with inputs `names` takes.
fn feeds<'a>(names: &[String], inputs: &'a BTreeMap<String, Tensor>) -> Vec<(&'a str, &'a Tensor)> {
    names
        .iter()
        .filter_map(|n| inputs.get_key_value(n))
        .map(|(n, t)| (n.as_str(), t))
        .collect()
}

/// Runs `model` once on tract (lowered for it first, as `train --engine tract` does) and
/// returns its outputs by name.
pub fn run_tract(
    model: &ModelProto,
    inputs: &BTreeMap<String, Tensor>,
) -> BTreeMap<String, Tensor> {
    let model = onnx_ga::passes::lower_for_tract::prepare(model).unwrap_or_else(|e| panic!("{e}"));
    let mut session = onnx_ga::engine::tract::TractSession::new(&model, &SessionOptions::default())
        .unwrap_or_else(|e| panic!("tract session: {e}"));
    session
        .run(&feeds(&session.input_names, inputs))
        .unwrap_or_else(|e| panic!("tract run: {e}"))
        .into_iter()
        .collect()
}

pub fn read_npz(path: &Path) -> BTreeMap<String, Tensor> {
    onnx_ga::data::read_npz(path).unwrap_or_else(|e| panic!("{e}"))
}

/// Asserts |a - b| <= atol + rtol * |b| elementwise, with a message naming the tensor and
/// the worst element.
pub fn assert_close(name: &str, actual: &Tensor, expected: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(actual.shape(), expected.shape(), "{name}: shape");
    let (a, b): (Vec<f64>, Vec<f64>) = match (actual, expected) {
        (Tensor::F32(a), Tensor::F32(b)) => (
            a.iter().map(|v| *v as f64).collect(),
            b.iter().map(|v| *v as f64).collect(),
        ),
        (Tensor::F64(a), Tensor::F64(b)) => {
            (a.iter().copied().collect(), b.iter().copied().collect())
        }
        (Tensor::I64(a), Tensor::I64(b)) => (
            a.iter().map(|v| *v as f64).collect(),
            b.iter().map(|v| *v as f64).collect(),
        ),
        (Tensor::Bool(a), Tensor::Bool(b)) => (
            a.iter().map(|v| *v as u8 as f64).collect(),
            b.iter().map(|v| *v as u8 as f64).collect(),
        ),
        _ => panic!("{name}: element types differ: {actual:?} vs {expected:?}"),
    };
    let mut worst: Option<(usize, f64, f64, f64)> = None;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if (excess.is_nan() || excess > 0.0)
            && worst.is_none_or(|w| excess > w.3 || excess.is_nan())
        {
            worst = Some((i, *x, *y, excess));
        }
    }
    if let Some((i, x, y, _)) = worst {
        panic!("{name}: element {i}: got {x:e}, expected {y:e} (|diff| {:e}, rtol {rtol:e}, atol {atol:e})", (x - y).abs());
    }
}

/// W's initial value in [`linear_regression`].
pub const LINEAR_REGRESSION_W0: [f32; 2] = [0.5, -0.25];

/// A tiny hand-written gradient graph: y = x W, d = y - t, loss = mean(d²), and its backward
/// pass seeded by the scalar initializer `loss_grad`: dL/dy = seed · 2 d / N,
/// W_grad = xᵀ dL/dy. With `sample_weight`, an input `sample_weight: float[N]` that the loss
/// ignores (for `normalize=weighted:sample_weight`); `extra_outputs` names values to expose.
pub fn linear_regression(sample_weight: bool, extra_outputs: &[&str]) -> ModelProto {
    use onnx_ga::ir::builder::{attr_int, tensor_f32, Builder};
    use onnx_ga::ir::{tensor_type, BodyId, Model};
    use onnx_ga::proto::tensor_shape_proto::dimension::Value as Dim;
    use onnx_ga::proto::{type_proto, OperatorSetIdProto};

    let header = ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        producer_name: Some("onnx-ga tests".into()),
        ..Default::default()
    };
    let mut model = Model::from_proto(ModelProto {
        graph: Some(Default::default()),
        ..header
    });
    model.body_mut(BodyId::MAIN).rest.name = Some("linear_regression".into());
    let main = BodyId::MAIN;
    let float = 1; // TensorProto.FLOAT
    let sym = |dims: &[&str]| {
        let mut ty = tensor_type(float, &vec![0; dims.len()]);
        if let Some(type_proto::Value::TensorType(t)) = &mut ty.value {
            for (d, name) in t.shape.as_mut().unwrap().dim.iter_mut().zip(dims) {
                d.value = Some(match name.parse::<i64>() {
                    Ok(v) => Dim::DimValue(v),
                    Err(_) => Dim::DimParam(name.to_string()),
                });
            }
        }
        ty
    };
    let x = model.add_input(main, "x", sym(&["N", "2"]), None);
    let t = model.add_input(main, "t", sym(&["N", "1"]), None);
    if sample_weight {
        model.add_input(main, "sample_weight", sym(&["N"]), None);
    }
    let w = model.add_input(
        main,
        "W",
        tensor_type(float, &[2, 1]),
        Some(tensor_f32(&[2, 1], &LINEAR_REGRESSION_W0)),
    );
    let mut b = Builder::new(&mut model, main, "test");
    let seed = b.scalar_f32("loss_grad", 1.0);
    let y = b.op("MatMul", &[x, w], vec![], "y");
    let d = b.op("Sub", &[y, t], vec![], "d");
    let sq = b.op("Mul", &[d, d], vec![], "d2");
    let loss = b.op("ReduceMean", &[sq], vec![attr_int("keepdims", 0)], "loss");
    let two = b.scalar_f32("two", 2.0);
    let size = b.op("Size", &[d], vec![], "n");
    let n = b.op("Cast", &[size], vec![attr_int("to", 1)], "n_f");
    let scale = b.op("Div", &[two, n], vec![], "two_over_n");
    let seeded = b.op("Mul", &[seed, scale], vec![], "dloss_scale");
    let dy = b.op("Mul", &[d, seeded], vec![], "y_grad");
    let xt = b.op("Transpose", &[x], vec![], "x_t");
    let _w_grad = b.op("MatMul", &[xt, dy], vec![], "W_grad");
    model.add_output(main, loss, Some(tensor_type(float, &[])));
    for name in extra_outputs {
        let v = model
            .lookup(main, name)
            .expect("extra output names a value");
        model.add_output(main, v, None);
    }
    // Provenance stamps of the hand-built graph would clutter the snapshots.
    for n in model.all_nodes().collect::<Vec<_>>() {
        model.node_mut(n).proto.metadata_props.clear();
    }
    model.to_proto()
}

/// The roles of [`linear_regression`].
pub fn linear_regression_roles() -> onnx_ga::signature::ExplicitRoles {
    onnx_ga::signature::ExplicitRoles {
        loss: Some("loss".into()),
        seed: Some("loss_grad".into()),
        grads: vec![("W".into(), "W_grad".into())],
    }
}

/// A rewritten step as a snapshot document: pipeline, pass reports, state pairs, graph.
pub fn step_document(step: &onnx_ga::step::Step) -> String {
    let mut doc = format!("## Pipeline\n{}\n\n## Report\n", step.manifest.pipeline);
    for (pass, report) in &step.reports {
        doc.push_str(&format!("{pass}: {report}\n"));
    }
    doc.push_str("\n## State\n");
    for s in &step.manifest.state {
        let param = s
            .param
            .as_ref()
            .map(|p| format!(" (of {p})"))
            .unwrap_or_default();
        doc.push_str(&format!(
            "{:?} {} -> {}{param}\n",
            s.role, s.input, s.output
        ));
    }
    doc.push_str("\n## Graph\n");
    doc.push_str(&onnx_ga::ir::print::print_model(&step.model));
    doc
}

/// The six ONNX Runtime artifacts folders shipped under graphs/.
pub const SHIPPED_GRAPHS: [&str; 6] = [
    "mlp_ce_adamw",
    "mlp_mse_sgd",
    "cnn_bn",
    "transformer_block",
    "bce_logits",
    "l1_loss",
];

/// Rewrites the shipped artifacts folder graphs/`model` with `spec`, verifying after every
/// pass; panics naming both on failure.
pub fn rewrite_shipped(model: &str, spec: &str) -> ModelProto {
    let graph = onnx_ga::signature::open(
        &root().join("graphs").join(model),
        &onnx_ga::signature::ExplicitRoles::default(),
    )
    .unwrap_or_else(|e| panic!("{model}: {e}"));
    onnx_ga::step::build_step(graph, spec, true)
        .unwrap_or_else(|e| panic!("{model}: {spec}: {e}"))
        .model
        .to_proto()
}

/// A trainer on ONNX Runtime with the default options (one thread, the split runner);
/// panics with the error.
pub fn trainer(step: &ModelProto) -> onnx_ga::train::Trainer {
    onnx_ga::train::Trainer::new(step, &SessionOptions::default()).unwrap_or_else(|e| panic!("{e}"))
}

/// The Python of `.venv-ort` (onnx and onnxruntime, from scripts/install-ort.sh), or `None`
/// when it is missing: a skip, which says so, or a failure under `CI=true`.
pub fn python() -> Option<PathBuf> {
    let python = root().join(onnx_ga::runtime::VENV_DIR).join("bin/python");
    if python.exists() {
        return Some(python);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{} is missing under CI: run scripts/install-ort.sh",
        python.display()
    );
    eprintln!(
        "SKIPPED: {} not found (run scripts/install-ort.sh)",
        python.display()
    );
    None
}

/// An empty IR model importing the default opset `opset` (for tests that build a graph).
#[allow(dead_code)]
pub fn empty_model(opset: i64) -> onnx_ga::ir::Model {
    onnx_ga::ir::Model::from_proto(ModelProto {
        ir_version: Some(8),
        opset_import: vec![onnx_ga::proto::OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(opset),
        }],
        graph: Some(Default::default()),
        ..Default::default()
    })
}

/// The largest difference between two trainers' states, each tensor's over its largest
/// magnitude in `b`, and the tensor's name; states that are not float32 must be equal.
pub fn worst_state_gap(
    what: &str,
    a: &BTreeMap<String, Tensor>,
    b: &BTreeMap<String, Tensor>,
) -> (f64, String) {
    let mut worst = (0f64, String::new());
    for (name, value) in b {
        let (Tensor::F32(a), Tensor::F32(b)) = (&a[name], value) else {
            assert_eq!(&a[name], value, "{what}: state '{name}'");
            continue;
        };
        let largest = b
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        let r = a
            .iter()
            .zip(b)
            .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()))
            / largest as f64;
        if r > worst.0 {
            worst = (r, name.clone());
        }
    }
    worst
}

/// `n` deterministic values spread over [-0.5, 0.5], different for each `seed`.
pub fn pattern(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0) * 0.5)
        .collect()
}

/// `dims` as a shape in the ONNX text format: "3,5,7".
pub fn dims_text(dims: &[usize]) -> String {
    dims.iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// A float32 tensor of `dims` filled with [`pattern`].
pub fn pattern_tensor(dims: &[usize], seed: usize) -> Tensor {
    let n = dims.iter().product();
    Tensor::F32(ndarray::ArrayD::from_shape_vec(dims.to_vec(), pattern(n, seed)).unwrap())
}

/// What a fast path is checked to train within, around each optimizer (issue 14's checks):
/// K = 4 alone, behind AGC, with loss scaling, with weighted normalisation.
pub const AROUNDS: [&str; 4] = [
    "grad-accum(steps=4)",
    "grad-accum(steps=4),agc(clip=0.01,include_final=true)",
    "grad-accum(steps=4),loss-scale(init=1024,interval=2)",
    "grad-accum(steps=4,normalize=weighted)",
];

/// Adds a float32 initializer `name` of `dims` holding `values` to `graph`.
pub fn push_initializer(
    graph: &mut onnx_ga::proto::GraphProto,
    name: &str,
    dims: &[i64],
    values: &[f32],
) {
    let mut t = onnx_ga::ir::builder::tensor_f32(dims, values);
    t.name = Some(name.into());
    graph.initializer.push(t);
}

/// Adds each `(name, dims, seed, scale)` to `graph` as a float32 initializer holding
/// [`pattern`]`(seed)` times `scale`: a test model's parameters.
pub fn push_parameters(
    graph: &mut onnx_ga::proto::GraphProto,
    params: &[(&str, &[i64], usize, f32)],
) {
    for &(name, dims, seed, scale) in params {
        let n: i64 = dims.iter().product();
        let values: Vec<f32> = pattern(n as usize, seed)
            .iter()
            .map(|v| v * scale)
            .collect();
        push_initializer(graph, name, dims, &values);
    }
}

/// The optimizers issue 14's checks name: SGD, momentum, Adam, AdamW.
pub const OPTIMIZERS: [&str; 4] = [
    "optimizer(kind=sgd,lr=0.05)",
    "optimizer(kind=momentum,lr=0.05,momentum=0.9)",
    "optimizer(kind=adam,lr=0.01)",
    "optimizer(kind=adamw,lr=0.01)",
];

/// A fast path checked against the standard ops: for each of `optimizers` in each of
/// [`AROUNDS`], `step_for(middle)` trained on `fast` and `standard` ([`train_pair`]), the
/// losses and every state within 1e-6 relative after the 8 windows; `rewritten` counts what
/// the fast path took over on a trainer, `per_trainer` on the fast side's, none on the
/// other's (so that no case passes by running the standard ops twice).
pub fn trains_within_rounding(
    optimizers: &[&str],
    step_for: impl Fn(&str) -> ModelProto,
    data: (&BTreeMap<String, Tensor>, usize),
    sides: [&Side; 2],
    rewritten: impl Fn(&onnx_ga::train::Trainer) -> usize,
    per_trainer: usize,
) {
    let within = |middle: &str, loss: f64, state: f64| {
        assert!(loss < 1e-6, "{middle}: losses {loss:e} apart");
        assert!(state < 1e-6, "{middle}: states {state:e} apart");
    };
    let fast_path = (rewritten, per_trainer);
    each_case(optimizers, step_for, data, sides, fast_path, within);
}

/// A fast path that keeps the order of operations: as [`trains_within_rounding`] for each
/// of [`OPTIMIZERS`], the losses and every state bit for bit the same.
pub fn trains_bit_identically(
    step_for: impl Fn(&str) -> ModelProto,
    data: (&BTreeMap<String, Tensor>, usize),
    sides: [&Side; 2],
    rewritten: impl Fn(&onnx_ga::train::Trainer) -> usize,
    per_trainer: usize,
) {
    let same = |middle: &str, loss: f64, state: f64| {
        assert_eq!((loss, state), (0.0, 0.0), "{middle}: not bit-identical");
    };
    let fast_path = (rewritten, per_trainer);
    each_case(&OPTIMIZERS, step_for, data, sides, fast_path, same);
}

/// The cases of [`trains_within_rounding`] and [`trains_bit_identically`]: each optimizer
/// in each of [`AROUNDS`], the rewrites counted, `check(middle, losses' gap, states' gap)`.
fn each_case(
    optimizers: &[&str],
    step_for: impl Fn(&str) -> ModelProto,
    data: (&BTreeMap<String, Tensor>, usize),
    [fast, standard]: [&Side; 2],
    (rewritten, per_trainer): (impl Fn(&onnx_ga::train::Trainer) -> usize, usize),
    check: impl Fn(&str, f64, f64),
) {
    for optimizer in optimizers {
        for around in AROUNDS {
            let middle = format!("{around},{optimizer}");
            let step = step_for(&middle);
            let (loss, state) = train_pair(&step, &middle, data, [fast, standard], |t, side| {
                let expected = if side == 0 { per_trainer } else { 0 };
                assert_eq!(rewritten(t), expected, "{middle}: rewritten");
            });
            check(&middle, loss, state);
        }
    }
}

/// `n` samples of `x` (`[n, x_dims...]`, [`pattern_tensor`] of `seed`) and int64 `labels`
/// `(5 i) mod classes`: the data of the classifiers the fast-path tests train.
pub fn labelled_data(x_dims: &[usize], seed: usize, classes: i64) -> BTreeMap<String, Tensor> {
    let n = x_dims[0];
    let labels = (0..n as i64).map(|i| (i * 5) % classes).collect();
    BTreeMap::from([
        ("x".to_string(), pattern_tensor(x_dims, seed)),
        (
            "labels".to_string(),
            Tensor::I64(ndarray::ArrayD::from_shape_vec(vec![n], labels).unwrap()),
        ),
    ])
}

/// One side of [`train_pair`]: its session options, and whether every 97th element of
/// each micro-batch's `x` is multiplied by 1 + 1.2e-7 (a rounding-sized perturbation: what
/// chaos alone does to a trajectory, the yardstick for a fast path on a chaotic one).
#[derive(Clone)]
pub struct Side {
    pub session: SessionOptions,
    pub perturbed: bool,
}

/// Trains `step` on `a` and `b`, 32 micro-steps of 4 samples from `data` (`n` samples),
/// `check(trainer, side)` on each trainer made (side 0 or 1: what it rewrote); returns the
/// losses' largest relative difference, and the states' after the 8 windows (largest
/// difference over the tensor's largest magnitude, [`worst_state_gap`]).
pub fn train_pair(
    step: &ModelProto,
    what: &str,
    (data, n): (&BTreeMap<String, Tensor>, usize),
    [a, b]: [&Side; 2],
    check: impl Fn(&onnx_ga::train::Trainer, usize),
) -> (f64, f64) {
    use onnx_ga::train::{micro_batch, TrainOptions, Trainer};
    let trainer = |side: &Side, k: usize| {
        let options = TrainOptions {
            session: side.session.clone(),
            ..TrainOptions::default()
        };
        let trainer =
            Trainer::with_options(step, &options).unwrap_or_else(|e| panic!("{what}: {e}"));
        check(&trainer, k);
        trainer
    };
    let batch_for = |side: &Side, i: u64| {
        let mut batch = micro_batch(data, n, 4, i);
        if let (true, Some(Tensor::F32(x))) = (side.perturbed, batch.get_mut("x")) {
            x.iter_mut().step_by(97).for_each(|v| *v *= 1.0 + 1.2e-7);
        }
        batch
    };
    let (mut left, mut right) = (trainer(a, 0), trainer(b, 1));
    let mut loss = 0f64;
    for i in 0..32 {
        let (x, y) = (
            left.step(&batch_for(a, i), false).unwrap(),
            right.step(&batch_for(b, i), false).unwrap(),
        );
        assert_eq!(x.applied, y.applied, "{what}: micro-step {i}");
        loss = loss.max(((x.loss as f64 - y.loss as f64) / y.loss as f64).abs());
    }
    let (sa, sb) = (left.state().unwrap(), right.state().unwrap());
    let worst = worst_state_gap(what, sa, sb);
    eprintln!(
        "{what}: losses {loss:e} apart at most; states {:e} after 8 windows ({})",
        worst.0, worst.1
    );
    (loss, worst.0)
}

/// The training step of the forward model `model` (its output `loss`) for ONNX Runtime:
/// `autodiff(loss=loss,grads=internal),{middle},legalize-ort,dce`.
pub fn ort_step(model: ModelProto, file: &str, middle: &str) -> ModelProto {
    let mut forward = onnx_ga::signature::forward(model, Path::new(file));
    forward.signature.loss = "loss".into();
    let spec = format!("autodiff(loss=loss,grads=internal),{middle},legalize-ort,dce");
    onnx_ga::step::build_step(forward, &spec, true)
        .unwrap_or_else(|e| panic!("{file}: {e}"))
        .model
        .to_proto()
}

/// Runs the `onnx-ga` binary with `args`.
pub fn onnx_ga_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .expect("run onnx-ga")
}

/// `onnx-ga train STEP --data DATA --micro-batch 8 --steps STEPS` and `extra`: the
/// arguments every CLI training test starts from.
pub fn cli_train<'a>(
    step: &'a Path,
    data: &'a Path,
    steps: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        step.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--micro-batch",
        "8",
        "--steps",
        steps,
    ];
    args.extend_from_slice(extra);
    args
}

/// `graphs/GRAPH` rewritten by `onnx-ga rewrite` with `extra` flags to `step`; panics
/// with its stderr when it fails.
pub fn cli_rewrite(graph: &str, step: &Path, extra: &[&str]) {
    let graph = root().join("graphs").join(graph);
    let mut args = vec![
        "rewrite",
        graph.to_str().unwrap(),
        "-o",
        step.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let out = onnx_ga_cli(&args);
    assert!(
        out.status.success(),
        "rewrite {}: {}",
        graph.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// graphs/mlp_ce_adamw rewritten by `onnx-ga rewrite` with K=4, lr 0.01 (and `extra`
/// flags) to `dir/name`; panics with its stderr when it fails.
pub fn cli_rewritten(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let step = dir.join(name);
    let mut args = vec!["--accum-steps", "4", "--lr", "0.01"];
    args.extend_from_slice(extra);
    cli_rewrite("mlp_ce_adamw", &step, &args);
    step
}

/// The state file `onnx-ga train STEP --data DATA ... --steps 30 --quiet --save-state`
/// writes with `extra` flags (into `dir/NAME`), as bytes; with `dump`, the sessions ONNX
/// Runtime got go there too (`ONNX_GA_DUMP_SESSIONS`). Panics with stderr when it fails.
pub fn cli_trained_state(
    step: &Path,
    data: &Path,
    dir: &Path,
    name: &str,
    extra: &[&str],
    dump: Option<&Path>,
) -> Vec<u8> {
    let state = dir.join(name);
    let mut args = cli_train(step, data, "30", &["--quiet", "--save-state"]);
    args.push(state.to_str().unwrap());
    args.extend_from_slice(extra);
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"));
    command.args(&args);
    if let Some(dump) = dump {
        std::fs::create_dir_all(dump).unwrap();
        command.env("ONNX_GA_DUMP_SESSIONS", dump);
    }
    let out = command.output().expect("run onnx-ga");
    assert!(
        out.status.success(),
        "onnx-ga {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&state).unwrap()
}
