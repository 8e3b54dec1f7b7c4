//! The scalar nodes the host computes instead of ONNX Runtime (src/engine/host_scalars.rs)
//! against ONNX Runtime computing them: every operator the host takes, over values that
//! include zeros of both signs, subnormals, infinities, NaN and integers beyond float32's
//! 2^24, must give the same bits; and training with the host computing a step's counters
//! and bias corrections must be bit-identical to the sessions computing them, for SGD,
//! momentum, Adam and AdamW, with AGC, loss scaling, weighted normalisation and flushed
//! (short) windows.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common;
use crate::common::{ort_available, read_npz, root};
use onnx_ga::data::Tensor;
use onnx_ga::engine::host_scalars::split_off;
use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::engine::{Engine, EngineKind};
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

const FLOATS: [f32; 18] = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    2.0,
    3.0,
    0.5,
    0.9,
    0.999,
    1e-8,
    1e-40,
    3.4e38,
    -1.5,
    7.25,
    11.0,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::NAN,
];

const INTS: [i64; 9] = [
    0,
    1,
    -1,
    7,
    (1 << 24) + 1,
    (1 << 53) + 1,
    i64::MAX,
    i64::MIN,
    -123_456_789_123,
];

fn float(x: f32) -> Tensor {
    Tensor::F32(ndarray::arr0(x).into_dyn())
}

fn int(x: i64) -> Tensor {
    Tensor::I64(ndarray::arr0(x).into_dyn())
}

fn boolean(x: bool) -> Tensor {
    Tensor::Bool(ndarray::arr0(x).into_dyn())
}

/// The same bits (any NaN equal to any NaN: its payload is the C library's business).
fn same(a: &Tensor, b: &Tensor) -> bool {
    match (a, b) {
        (Tensor::F32(a), Tensor::F32(b)) => {
            a.shape() == b.shape()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
        }
        _ => a == b,
    }
}

/// `y = <node>(a, b, ...)`, with `z = x * Cast<float>(y)` so that the session reads the
/// host's result too: the model as ONNX Runtime runs it whole, and split (the host computes
/// y and the cast). Every combination of `values` for the inputs gives the same y and z.
fn check_op(what: &str, inputs: &[&str], node: &str, result: &str, values: &[Vec<Tensor>]) {
    let names: Vec<String> = (0..inputs.len()).map(|k| format!("i{k}")).collect();
    let declared: Vec<String> = inputs
        .iter()
        .zip(&names)
        .map(|(ty, n)| format!("{ty} {n}"))
        .collect();
    let text = format!(
        "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g ({}, float[2] x) => ({result} y, float[2] z) {{\n\
           y = {node} ({})\n\
           yf = Cast <to = 1> (y)\n\
           z = Mul (x, yf)\n\
         }}",
        declared.join(", "),
        names.join(", ")
    );
    let model = onnx_ga::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{what}: {e}"));
    let (split, scalars) =
        split_off(&model).unwrap_or_else(|| panic!("{what}: the host computes none of it"));
    assert_eq!(scalars.node_count(), 2, "{what}: y and its cast");
    let session = split.graph.as_ref().unwrap();
    assert_eq!(session.node.len(), 1, "{what}: only the Mul is left");
    let options = SessionOptions::default();
    let mut whole = Engine::new(EngineKind::Ort, &model, &options).unwrap();
    let mut host = Engine::new(EngineKind::Ort, &split, &options).unwrap();
    host.set_host_scalars(scalars);
    let x = Tensor::F32(ndarray::arr1(&[1.0f32, -3.0]).into_dyn());
    // Every combination of the inputs' values (their product).
    let mut combination = vec![0usize; values.len()];
    loop {
        let args: Vec<&Tensor> = combination
            .iter()
            .zip(values)
            .map(|(&k, v)| &v[k])
            .collect();
        let mut feeds: Vec<(&str, &Tensor)> =
            names.iter().map(String::as_str).zip(args.clone()).collect();
        feeds.push(("x", &x));
        let by_name = |outputs: Vec<(String, Tensor)>| -> BTreeMap<String, Tensor> {
            outputs.into_iter().collect()
        };
        let want = by_name(whole.run(&feeds).unwrap());
        let got = by_name(host.run(&feeds).unwrap());
        for output in ["y", "z"] {
            assert!(
                same(&want[output], &got[output]),
                "{what} of {args:?}: {output} is {:?} by ONNX Runtime, {:?} by the host",
                want[output],
                got[output]
            );
        }
        // The next combination, the first input fastest.
        let mut k = 0;
        loop {
            if k == values.len() {
                return;
            }
            combination[k] += 1;
            if combination[k] < values[k].len() {
                break;
            }
            combination[k] = 0;
            k += 1;
        }
    }
}

#[test]
fn every_operator_the_host_computes_gives_onnx_runtimes_bits() {
    if !ort_available() {
        return;
    }
    let floats: Vec<Tensor> = FLOATS.iter().map(|&x| float(x)).collect();
    let ints: Vec<Tensor> = INTS.iter().map(|&x| int(x)).collect();
    let bools: Vec<Tensor> = [false, true].iter().map(|&x| boolean(x)).collect();
    // Exponents a step's bias corrections meet (the optimizer's step, 1, 2, 3, ...) and
    // the ones ONNX Runtime might treat apart (2, 3, 0.5).
    let exponents: Vec<Tensor> = (1..=12)
        .map(|t| t as f32)
        .chain([0.0, 0.5, -1.0, 1000.0, 1e7, f32::NAN])
        .map(float)
        .collect();
    let pair = |v: &Vec<Tensor>| vec![v.clone(), v.clone()];
    for op in ["Add", "Sub", "Mul", "Div"] {
        check_op(op, &["float", "float"], op, "float", &pair(&floats));
    }
    check_op(
        "Pow",
        &["float", "float"],
        "Pow",
        "float",
        &[floats.clone(), exponents],
    );
    for op in ["Add", "Sub", "Mul"] {
        check_op(
            &format!("{op} int64"),
            &["int64", "int64"],
            op,
            "int64",
            &pair(&ints),
        );
    }
    for op in ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"] {
        check_op(op, &["float", "float"], op, "bool", &pair(&floats));
        check_op(
            &format!("{op} int64"),
            &["int64", "int64"],
            op,
            "bool",
            &pair(&ints),
        );
    }
    for op in ["And", "Or", "Xor", "Equal"] {
        check_op(
            &format!("{op} bool"),
            &["bool", "bool"],
            op,
            "bool",
            &pair(&bools),
        );
    }
    check_op(
        "Not",
        &["bool"],
        "Not",
        "bool",
        std::slice::from_ref(&bools),
    );
    for op in ["Sqrt", "Neg", "Reciprocal", "Identity"] {
        check_op(op, &["float"], op, "float", std::slice::from_ref(&floats));
    }
    check_op(
        "Neg int64",
        &["int64"],
        "Neg",
        "int64",
        std::slice::from_ref(&ints),
    );
    let cast = |to: i32| format!("Cast <to = {to}>");
    check_op(
        "Cast int64 -> float",
        &["int64"],
        &cast(1),
        "float",
        std::slice::from_ref(&ints),
    );
    check_op(
        "Cast bool -> float",
        &["bool"],
        &cast(1),
        "float",
        std::slice::from_ref(&bools),
    );
    check_op("Cast bool -> int64", &["bool"], &cast(7), "int64", &[bools]);
    check_op(
        "Cast int64 -> bool",
        &["int64"],
        &cast(9),
        "bool",
        std::slice::from_ref(&ints),
    );
    // A rank-1 scalar broadcast with a rank-0 one is rank 1, for the host too.
    check_op(
        "Mul of float[1] and float",
        &["float[1]", "float"],
        "Mul",
        "float[1]",
        &[
            vec![Tensor::F32(ndarray::arr1(&[0.9f32]).into_dyn())],
            vec![float(3.0)],
        ],
    );
}

/// A node the host cannot compute stays, and so does everything after it; a graph without
/// such nodes is not split at all.
#[test]
fn what_the_host_cannot_compute_stays_in_the_session() {
    let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
        g (float a, bool c, float[3] x) => (float y, float q, float w, float[3] z) {\n\
          f = Cast <to = 7> (a)\n\
          w = Where (c, a, a)\n\
          q = Div (a, a)\n\
          m = Mod <fmod = 1> (a, a)\n\
          y = Add (m, a)\n\
          s = ReduceSum (x)\n\
          z = Mul (x, q)\n\
        }";
    let model = onnx_ga::ir::text::parse_model(text).unwrap();
    let (split, scalars) = split_off(&model).unwrap();
    // Only q: a float -> int cast, Where (ONNX Runtime's gives Where(true, -0.0, 0.0) =
    // +0.0), Mod, what reads Mod's result and a tensor op stay.
    assert_eq!(scalars.node_count(), 1);
    let g = split.graph.as_ref().unwrap();
    let ops: Vec<&str> = g.node.iter().map(|n| n.op_type()).collect();
    assert_eq!(ops, ["Cast", "Where", "Mod", "Add", "ReduceSum", "Mul"]);
    let outputs: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
    assert_eq!(outputs, ["y", "w", "z"], "q is the host's");
    assert!(
        g.input.iter().any(|i| i.name() == "q"),
        "the Mul reads q, fed"
    );
    let none = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
        g (float[3] x) => (float[3] z) { z = Relu (x) }";
    assert!(split_off(&onnx_ga::ir::text::parse_model(none).unwrap()).is_none());
}

fn options(host_scalars: bool) -> TrainOptions {
    TrainOptions {
        session: SessionOptions {
            host_scalars,
            ..SessionOptions::default()
        },
        ..TrainOptions::default()
    }
}

/// The step's counters, flags and bias corrections computed by the host train exactly as
/// the sessions computing them do, flushed windows included.
#[test]
fn training_with_the_host_computing_scalars_is_bit_identical() {
    if !ort_available() {
        return;
    }
    let optimizers = [
        "optimizer(kind=sgd,lr=0.05,weight_decay=0.01)",
        "optimizer(kind=momentum,lr=0.05,momentum=0.9)",
        "optimizer(kind=nesterov,lr=0.05,momentum=0.9)",
        "optimizer(lr=0.01)",
        "optimizer(kind=adamw,lr=0.01,weight_decay=0.1,adam_mode=0)",
        "optimizer(kind=adam,lr=0.01,formula=keras)",
    ];
    for model in ["mlp_ce_adamw", "transformer_block"] {
        let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
        for optimizer in optimizers {
            for around in [
                "grad-accum(steps=4)",
                "grad-accum(steps=4),agc(clip=0.01,include_final=true)",
                "grad-accum(steps=4),loss-scale(init=1024,interval=2)",
                "grad-accum(steps=3,normalize=weighted)",
            ] {
                let spec = format!("{around},{optimizer},legalize-ort,dce");
                let step = crate::common::rewrite_shipped(model, &spec);
                let what = format!("{model}: {spec}");
                let mut host = Trainer::with_options(&step, &options(true)).unwrap();
                let mut session = Trainer::with_options(&step, &options(false)).unwrap();
                assert!(
                    host.host_scalar_nodes() >= 3,
                    "{what}: the host computes {} nodes",
                    host.host_scalar_nodes()
                );
                assert_eq!(session.host_scalar_nodes(), 0, "{what}");
                let samples = host.check_data(&data, Path::new("data.npz")).unwrap();
                for i in 0..26 {
                    let batch = micro_batch(&data, samples, 8, i);
                    // Windows cut short now and then: the count the mean divides by.
                    let flush = i % 7 == 5;
                    let (a, b) = (
                        host.step(&batch, flush).unwrap(),
                        session.step(&batch, flush).unwrap(),
                    );
                    assert_eq!(a, b, "{what}: micro-step {i}");
                }
                let (a, b) = (host.state().unwrap(), session.state().unwrap());
                assert!(a.keys().eq(b.keys()), "{what}: the same states");
                for (name, value) in b {
                    assert!(same(&a[name], value), "{what}: state '{name}'");
                }
            }
        }
    }
}

/// `train --no-host-scalars` runs every node in the sessions and saves the same state, byte
/// for byte, as the default run where the host computes the scalars.
#[test]
fn train_saves_the_same_state_with_and_without_host_scalars() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = crate::common::cli_rewritten(dir.path(), "step.onnx", &[]);
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let mut states = Vec::new();
    let mut nodes = Vec::new();
    for (name, extra) in [
        ("host.npz", &[][..]),
        ("session.npz", &["--no-host-scalars"][..]),
    ] {
        // The sessions as ONNX Runtime gets them, to count nodes.
        let dump = dir.path().join(format!("{name}.sessions"));
        let state = common::cli_trained_state(&step, &data, dir.path(), name, extra, Some(&dump));
        states.push(state);
        // Window start, accumulate, apply: the apply's nodes.
        let apply = std::fs::read(dump.join("session2.onnx")).unwrap();
        let apply = <onnx_ga::proto::ModelProto as prost::Message>::decode(&*apply).unwrap();
        nodes.push(apply.graph.unwrap().node.len());
    }
    assert!(states[0] == states[1], "the saved states differ");
    assert!(
        nodes[0] + 10 <= nodes[1],
        "the host computes the apply's scalars: {} against {} nodes",
        nodes[0],
        nodes[1]
    );
}
