//! Zero-initialised state (issue 14, item 5): a rewritten step stores no data for the state
//! that starts at zeros (accumulators, optimizer moments, counters, the window's sums). Its
//! input keeps its declared type and static shape, has no initializer, and its manifest entry
//! says `"init": "zeros"`; the trainer makes the zeros. Training from such a step is bit for
//! bit training from the same step with the zeros stored as initializers and no `init` field
//! (the form every step had before), on ONNX Runtime and tract, split and whole, AdamW and
//! SGD with momentum, over 8 windows.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{ort_available, read_npz, root};
use onnx_ga::data::Tensor;
use onnx_ga::engine::EngineKind;
use onnx_ga::proto::{ModelProto, TensorProto};
use onnx_ga::state::{Manifest, Role, StateInit, STATE_KEY};
use onnx_ga::train::{micro_batch, StepMetrics, TrainOptions, Trainer};

const ADAMW: &str = "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce";
const MOMENTUM: &str =
    "grad-accum(steps=4),optimizer(kind=momentum,lr=0.05,momentum=0.9),legalize-ort,dce";

fn state_json(model: &ModelProto) -> Vec<serde_json::Value> {
    let text = model
        .metadata_props
        .iter()
        .find(|p| p.key() == STATE_KEY)
        .expect("a manifest")
        .value();
    serde_json::from_str(text).unwrap()
}

fn initializer<'a>(model: &'a ModelProto, name: &str) -> Option<&'a TensorProto> {
    let g = model.graph.as_ref().unwrap();
    g.initializer.iter().find(|t| t.name() == name)
}

/// The step as every step was written before `init` existed: each zero state's zeros stored
/// as its input's initializer (built here from the input's declared type), no `init` field.
fn old_style(step: &ModelProto) -> ModelProto {
    use onnx_ga::proto::tensor_proto::DataType as D;
    let manifest = Manifest::from_model(step).unwrap();
    let mut old = step.clone();
    let g = old.graph.as_mut().unwrap();
    for (name, init) in &manifest.init {
        assert_eq!(*init, StateInit::Zeros);
        let input = g.input.iter().find(|i| i.name() == name).unwrap();
        let (elem, dims) =
            onnx_ga::state::static_tensor_type(input.r#type.as_ref().unwrap()).unwrap();
        let size = match D::try_from(elem).unwrap() {
            D::Float | D::Int32 => 4,
            D::Double | D::Int64 => 8,
            D::Bool => 1,
            other => panic!("{name}: {other:?}"),
        };
        let count: i64 = dims.iter().product();
        g.initializer.push(TensorProto {
            name: Some(name.clone()),
            dims,
            data_type: Some(elem),
            raw_data: Some(vec![0; count as usize * size]),
            ..Default::default()
        });
    }
    let mut entries = state_json(step);
    for e in &mut entries {
        e.as_object_mut().unwrap().remove("init");
    }
    let entry = old
        .metadata_props
        .iter_mut()
        .find(|p| p.key() == STATE_KEY)
        .unwrap();
    entry.value = Some(serde_json::to_string(&entries).unwrap());
    old
}

fn trainer(step: &ModelProto, engine: EngineKind, split: bool) -> Trainer {
    Trainer::with_options(
        step,
        &TrainOptions {
            engine,
            split,
            ..TrainOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// `steps` micro-steps of 8 samples from micro-step `from` on.
fn run(
    t: &mut Trainer,
    data: &BTreeMap<String, Tensor>,
    from: u64,
    steps: u64,
) -> Vec<StepMetrics> {
    let samples = t.check_data(data, Path::new("data.npz")).unwrap();
    (from..from + steps)
        .map(|i| t.step(&micro_batch(data, samples, 8, i), false).unwrap())
        .collect()
}

fn engines() -> Vec<EngineKind> {
    let mut engines = Vec::new();
    if ort_available() {
        engines.push(EngineKind::Ort);
    }
    if cfg!(feature = "tract") {
        engines.push(EngineKind::Tract);
    }
    engines
}

/// The rewritten step stores no data for its zero state, and its manifest says how each
/// starts; parameters (and other model tensors) keep their stored values.
#[test]
fn a_rewritten_step_stores_nothing_for_zero_state() {
    for (model, spec) in [
        ("mlp_ce_adamw", ADAMW),
        ("mlp_ce_adamw", MOMENTUM),
        ("cnn_bn", ADAMW),
    ] {
        let what = format!("{model} [{spec}]");
        let step = common::rewrite_shipped(model, spec);
        let manifest = Manifest::from_model(&step).unwrap();
        let entries = state_json(&step);
        let mut zero_bytes = 0;
        for (e, json) in manifest.state.iter().zip(&entries) {
            let stored = initializer(&step, &e.input);
            let model_tensor = matches!(e.role, Role::Param | Role::Frozen)
                || (e.role == Role::BnStat && e.param.as_deref().is_none_or(|p| p == e.input));
            if model_tensor {
                assert!(stored.is_some(), "{what}: {} lost its value", e.input);
                assert_eq!(manifest.init_of(&e.input), None, "{what}: {}", e.input);
                assert!(json.get("init").is_none(), "{what}: {}", e.input);
                continue;
            }
            if matches!(e.role, Role::Accumulator | Role::Moment | Role::MicroStep) {
                assert_eq!(
                    manifest.init_of(&e.input),
                    Some(StateInit::Zeros),
                    "{what}: {} ({:?}) starts at zeros",
                    e.input,
                    e.role
                );
            }
            if manifest.init_of(&e.input).is_some() {
                assert!(stored.is_none(), "{what}: {} is stored", e.input);
                assert_eq!(json["init"], "zeros", "{what}: {}", e.input);
                let g = step.graph.as_ref().unwrap();
                let input = g.input.iter().find(|i| i.name() == e.input).unwrap();
                let (_, dims) = onnx_ga::state::static_tensor_type(input.r#type.as_ref().unwrap())
                    .expect("a static shape");
                zero_bytes += 4 * dims.iter().product::<i64>() as usize;
            } else {
                assert!(json.get("init").is_none(), "{what}: {}", e.input);
            }
        }
        let moments = manifest
            .state
            .iter()
            .filter(|e| e.role == Role::Moment)
            .count();
        assert_eq!(moments > 0, spec == ADAMW || spec == MOMENTUM, "{what}");
        // The file is smaller by (at least) the bytes of the zeros, and nothing else moved.
        let new = onnx_ga::model::encode_model(&step).len();
        let old = onnx_ga::model::encode_model(&old_style(&step)).len();
        assert!(
            old >= new + zero_bytes,
            "{what}: {old} vs {new} + {zero_bytes}"
        );
        onnx_ga::state::verify_step(&onnx_ga::ir::Model::from_proto(step.clone()))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// A step written before `init` existed (zeros stored, no field) reads as such: its manifest
/// records no init, and writing that manifest back adds none.
#[test]
fn an_old_style_step_reads_without_init() {
    let step = common::rewrite_shipped("mlp_ce_adamw", ADAMW);
    let old = old_style(&step);
    let manifest = Manifest::from_model(&old).unwrap();
    assert!(manifest.init.is_empty());
    let new = Manifest::from_model(&step).unwrap();
    assert_eq!(manifest.state, new.state);
    let written = manifest.metadata();
    let state = written.iter().find(|p| p.key() == STATE_KEY).unwrap();
    assert!(!state.value().contains("init"), "{}", state.value());
    onnx_ga::state::verify_step(&onnx_ga::ir::Model::from_proto(old)).unwrap();
}

/// Training from the step equals training from it with the zeros stored, old style: every
/// metric and every state tensor, bit for bit, over 8 windows of 4, on every engine, split
/// and whole; and a resume from a state saved mid-window continues identically.
#[test]
fn zero_state_trains_bit_identically_to_stored_zeros() {
    for (model, spec) in [
        ("mlp_ce_adamw", ADAMW),
        ("mlp_ce_adamw", MOMENTUM),
        ("cnn_bn", ADAMW),
    ] {
        let step = common::rewrite_shipped(model, spec);
        let old = old_style(&step);
        let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
        for engine in engines() {
            for split in [true, false] {
                let what = format!("{model} [{spec}] on {engine:?}, split {split}");
                let mut a = trainer(&step, engine, split);
                let mut b = trainer(&old, engine, split);
                assert_eq!(
                    a.state().unwrap(),
                    b.state().unwrap(),
                    "{what}: initial state"
                );
                let (ma, mb) = (run(&mut a, &data, 0, 32), run(&mut b, &data, 0, 32));
                assert_eq!(ma, mb, "{what}: metrics");
                assert_eq!(
                    ma.iter().filter(|m| m.applied).count(),
                    8,
                    "{what}: windows"
                );
                let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
                assert_eq!(sa.len(), sb.len());
                for (name, value) in sa {
                    assert_eq!(value, &sb[name], "{what}: state '{name}' differs");
                }
            }
        }
    }
}

/// `--save-state` mid-window and `--init-state` on a fresh trainer of the zero-state step
/// continue exactly as the uninterrupted run (and as the old-style step resumed).
#[test]
fn a_resume_of_a_zero_state_step_is_exact() {
    let step = common::rewrite_shipped("mlp_ce_adamw", ADAMW);
    let old = old_style(&step);
    let data = read_npz(&root().join("graphs/mlp_ce_adamw/data.npz"));
    let dir = tempfile::tempdir().unwrap();
    for engine in engines() {
        let mut whole = trainer(&step, engine, true);
        run(&mut whole, &data, 0, 32);
        let mut first = trainer(&step, engine, true);
        run(&mut first, &data, 0, 14);
        for (format, model) in [("npz", &step), ("safetensors", &old)] {
            let path = dir.path().join(format!("s.{format}"));
            first.save_state(&path).unwrap();
            let mut resumed = trainer(model, engine, true);
            resumed.load_state(&path).unwrap();
            run(&mut resumed, &data, 14, 18);
            assert_eq!(
                whole.state().unwrap(),
                resumed.state().unwrap(),
                "{engine:?}: resumed from {format}"
            );
        }
    }
}

/// A zero state must have a static shape and no initializer: the verifier says which, and
/// the trainer refuses a dynamic one with a message naming the state.
#[test]
fn a_zero_state_needs_a_static_type_and_no_initializer() {
    use onnx_ga::proto::tensor_shape_proto::dimension::Value as Dim;
    use onnx_ga::proto::type_proto::Value;
    let step = common::rewrite_shipped("mlp_ce_adamw", ADAMW);
    let manifest = Manifest::from_model(&step).unwrap();
    let acc = manifest
        .state
        .iter()
        .find(|e| e.role == Role::Accumulator)
        .unwrap()
        .input
        .clone();

    let with_value = {
        let mut m = step.clone();
        let stored = old_style(&step);
        let t = initializer(&stored, &acc).unwrap().clone();
        m.graph.as_mut().unwrap().initializer.push(t);
        m
    };
    let e = onnx_ga::state::verify_step(&onnx_ga::ir::Model::from_proto(with_value)).unwrap_err();
    assert!(e.to_string().contains("has an initializer"), "{e}");

    let dynamic = {
        let mut m = step.clone();
        let g = m.graph.as_mut().unwrap();
        let input = g.input.iter_mut().find(|i| i.name() == acc).unwrap();
        let Some(Value::TensorType(t)) = input.r#type.as_mut().unwrap().value.as_mut() else {
            panic!("a tensor type");
        };
        t.shape.as_mut().unwrap().dim[0].value = Some(Dim::DimParam("n".into()));
        m
    };
    let e =
        onnx_ga::state::verify_step(&onnx_ga::ir::Model::from_proto(dynamic.clone())).unwrap_err();
    assert!(e.to_string().contains("static shape"), "{e}");
    let e = Trainer::with_options(
        &dynamic,
        &TrainOptions {
            engine: EngineKind::Tract,
            ..TrainOptions::default()
        },
    )
    .err()
    .expect("refused");
    let e = e.to_string();
    assert!(e.contains(&acc) && e.contains("static shape"), "{e}");
}
