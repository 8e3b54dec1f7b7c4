//! The trained model out: `onnx-ga export MODEL --state S -o TRAINED.onnx` after training a
//! shipped step, checked against the saved state (bit for bit) and against the eval model
//! run with the trained parameters fed as inputs, on ONNX Runtime from Rust and from Python;
//! `.safetensors` state files (round trip, Python's `safetensors` package); bad input.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{ort_available, root};
use onnx_ga::data::Tensor;
use onnx_ga::proto::ModelProto;
use onnx_ga::train::micro_batch;

const MODEL: &str = "mlp_ce_adamw";
const PARAMS: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];
const SPEC: &str = "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce";

fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .expect("run onnx-ga")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn eval_model() -> PathBuf {
    root().join("graphs").join(MODEL).join("eval_model.onnx")
}

fn data() -> BTreeMap<String, Tensor> {
    common::read_npz(&root().join("graphs").join(MODEL).join("data.npz"))
}

/// Rewrites the shipped step (K = 4), writes it to `dir`, trains it 4 windows and saves the
/// state to `dir/state.npz` and `dir/state.safetensors`. Returns the step's path.
fn train(dir: &Path) -> PathBuf {
    let step = common::rewrite_shipped(MODEL, SPEC);
    let step_path = dir.join("step.onnx");
    onnx_ga::model::save_model(&step, &step_path).unwrap();
    let mut trainer = common::trainer(&step);
    let data = data();
    let samples = trainer.check_data(&data, Path::new("data.npz")).unwrap();
    for i in 0..16 {
        let m = trainer
            .step(&micro_batch(&data, samples, 8, i), false)
            .unwrap();
        assert_eq!(m.applied, (i + 1) % 4 == 0, "micro-step {i}");
    }
    trainer.save_state(&dir.join("state.npz")).unwrap();
    trainer.save_state(&dir.join("state.safetensors")).unwrap();
    step_path
}

fn export(model: &Path, state: &Path, out: &Path, step: Option<&Path>) -> Output {
    let mut args = vec![
        "export",
        model.to_str().unwrap(),
        "--state",
        state.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ];
    if let Some(step) = step {
        args.extend(["--step", step.to_str().unwrap()]);
    }
    onnx_ga(&args)
}

fn initializers(model: &ModelProto) -> BTreeMap<String, Tensor> {
    model
        .graph
        .as_ref()
        .unwrap()
        .initializer
        .iter()
        .map(|t| {
            let value = Tensor::from_tensor_proto(t).unwrap_or_else(|e| panic!("{e}"));
            (t.name().to_string(), value)
        })
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.as_f32()
        .expect("a float tensor")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn export_after_training_sets_the_trained_parameters() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = train(dir.path());
    let state_npz = dir.path().join("state.npz");
    let state = common::read_npz(&state_npz);

    for (state_file, step) in [
        (state_npz.clone(), Some(step.as_path())),
        (dir.path().join("state.safetensors"), None),
    ] {
        let out_path = dir.path().join("trained.onnx");
        let out = export(&eval_model(), &state_file, &out_path, step);
        let err = stderr(&out);
        assert!(out.status.success(), "export failed: {err}");
        assert!(err.contains("set 4 tensors"), "{err}");
        assert!(err.contains("4 graph inputs made initializers"), "{err}");
        assert!(err.contains("inputs: input, labels"), "{err}");

        // The exported model: its parameters are initializers holding the saved state bit for
        // bit, and no longer graph inputs.
        let trained = onnx_ga::model::load_model(&out_path).unwrap();
        let graph = trained.graph.as_ref().unwrap();
        let inputs: Vec<&str> = graph.input.iter().map(|i| i.name()).collect();
        assert_eq!(inputs, ["input", "labels"]);
        let values = initializers(&trained);
        assert_eq!(values.keys().collect::<Vec<_>>().len(), PARAMS.len());
        for name in PARAMS {
            assert_eq!(values[name].shape(), state[name].shape(), "{name}");
            assert_eq!(
                bits(&values[name]),
                bits(&state[name]),
                "{name} bit for bit"
            );
        }

        // It runs in standard ONNX Runtime and computes what the eval model computes with
        // those parameters fed as inputs.
        let data = data();
        let batch = micro_batch(&data, 64, 8, 0);
        let exported = common::run_ort(&trained, &batch);
        let mut feeds = batch.clone();
        for name in PARAMS {
            feeds.insert(name.to_string(), state[name].clone());
        }
        let eval = onnx_ga::model::load_model(&eval_model()).unwrap();
        let reference = common::run_ort(&eval, &feeds);
        assert_eq!(
            exported.keys().collect::<Vec<_>>(),
            reference.keys().collect::<Vec<_>>()
        );
        for (name, value) in &reference {
            common::assert_close(name, &exported[name], value, 1e-6, 0.0);
        }
        // The trained parameters are not the initial ones.
        let initial = common::run_ort(&eval, &{
            let mut f = batch.clone();
            let step_model = common::rewrite_shipped(MODEL, SPEC);
            for (name, value) in initializers(&step_model) {
                if PARAMS.contains(&name.as_str()) {
                    f.insert(name, value);
                }
            }
            f
        });
        assert_ne!(initial, reference, "training changed nothing");
    }
}

/// Only the state entries that can be model tensors are read: the others (accumulators,
/// moments: three times the parameters under AdamW) are named in the report, not loaded.
/// Shown with an entry our reader could not even hold (float16), which export passes over.
#[test]
fn export_reads_only_the_state_entries_the_model_can_take() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = train(dir.path());
    let state = onnx_ga::data::read_state(&dir.path().join("state.safetensors")).unwrap();
    // The state re-written by the safetensors crate, plus a float16 moment.
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
    let le: Vec<(String, Vec<u8>, Vec<usize>)> = state
        .iter()
        .map(|(name, t)| {
            let mut bytes = Vec::new();
            onnx_ga::data::write_le(&mut bytes, t).unwrap();
            (name.clone(), bytes, t.shape().to_vec())
        })
        .collect();
    let half = [0u8; 8];
    for ((name, bytes, shape), t) in le.iter().zip(state.values()) {
        let dtype = match t {
            Tensor::F32(_) => safetensors::Dtype::F32,
            Tensor::I64(_) => safetensors::Dtype::I64,
            other => panic!("{name}: {other:?}"),
        };
        views.push((
            name.clone(),
            safetensors::tensor::TensorView::new(dtype, shape.clone(), bytes).unwrap(),
        ));
    }
    views.push((
        "ga.m.half".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![4], &half).unwrap(),
    ));
    let with_half = dir.path().join("half.safetensors");
    safetensors::serialize_to_file(views, None, &with_half).unwrap();
    assert!(
        onnx_ga::data::read_state(&with_half).is_err(),
        "the float16 entry must be unreadable, or this shows nothing"
    );

    let out_path = dir.path().join("trained.onnx");
    let out = export(&eval_model(), &with_half, &out_path, Some(&step));
    let err = stderr(&out);
    assert!(out.status.success(), "export failed: {err}");
    assert!(err.contains("set 4 tensors"), "{err}");
    let left_out = state.len() - PARAMS.len() + 1;
    assert!(
        err.contains(&format!("left out {left_out} state entries")),
        "{err}"
    );
    let values = initializers(&onnx_ga::model::load_model(&out_path).unwrap());
    for name in PARAMS {
        assert_eq!(bits(&values[name]), bits(&state[name]), "{name}");
    }
}

#[test]
fn export_replaces_initializers_of_a_forward_model() {
    // A forward model with its parameters as initializers (typed float_data, one with a doc
    // string): the export replaces the data and keeps name, dims, type and doc string.
    let mut model = onnx_ga::model::load_model(&eval_model()).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let mut state = BTreeMap::new();
    for (i, name) in PARAMS.iter().enumerate() {
        let input = graph.input.iter().position(|v| v.name() == *name).unwrap();
        graph.input.remove(input);
        let shape: &[usize] = match *name {
            "fc1.weight" => &[32, 16],
            "fc1.bias" => &[32],
            "fc2.weight" => &[10, 32],
            _ => &[10],
        };
        let n: usize = shape.iter().product();
        let zeros = Tensor::F32(ndarray::ArrayD::zeros(shape));
        let mut init = zeros.to_tensor_proto(name);
        init.raw_data = None;
        init.float_data = vec![0.0; n];
        init.doc_string = Some(format!("doc of {name}"));
        graph.initializer.push(init);
        let values: Vec<f32> = (0..n).map(|j| (i * 1000 + j) as f32 * 0.001).collect();
        state.insert(
            name.to_string(),
            Tensor::F32(ndarray::ArrayD::from_shape_vec(shape, values).unwrap()),
        );
    }
    graph
        .initializer
        .push(Tensor::F32(ndarray::arr1(&[1.5f32]).into_dyn()).to_tensor_proto("a.constant"));
    state.insert(
        "fc1.weight.ga_accum".into(),
        Tensor::F32(ndarray::ArrayD::zeros(&[32, 16][..])),
    );
    let (out, report) =
        onnx_ga::trained::export_trained(model, &state, Path::new("forward.onnx")).unwrap();
    assert_eq!(report.set(), 4);
    assert_eq!(report.replaced.len(), 4);
    assert!(report.converted.is_empty());
    assert_eq!(report.constants, ["a.constant"]);
    assert_eq!(report.not_in_model, ["fc1.weight.ga_accum"]);
    let graph = out.graph.as_ref().unwrap();
    for init in &graph.initializer {
        if init.name() == "a.constant" {
            continue;
        }
        assert!(
            init.float_data.is_empty(),
            "{}: typed data cleared",
            init.name()
        );
        assert!(init.raw_data.is_some());
        assert_eq!(init.doc_string(), format!("doc of {}", init.name()));
        let value = Tensor::from_tensor_proto(init).unwrap();
        assert_eq!(bits(&value), bits(&state[init.name()]), "{}", init.name());
        assert_eq!(
            init.dims,
            state[init.name()]
                .shape()
                .iter()
                .map(|d| *d as i64)
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_model_with_external_data_is_written_with_external_data() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A forward model whose parameters live in an external data file.
    let good = state_file(d, "good.npz", |_| {});
    let (forward, _) = onnx_ga::trained::export_trained(
        onnx_ga::model::load_model(&eval_model()).unwrap(),
        &common::read_npz(&good),
        Path::new("eval_model.onnx"),
    )
    .unwrap();
    let model = d.join("forward.onnx");
    onnx_ga::model::save_model_with_external_data(&forward, &model, "weights.bin", 0).unwrap();
    let state = state_file(d, "state.safetensors", |st| {
        for (i, t) in st.values_mut().enumerate() {
            if let Tensor::F32(a) = t {
                a.iter_mut()
                    .enumerate()
                    .for_each(|(j, v)| *v = (i * 100 + j) as f32);
            }
        }
    });
    let out = d.join("trained.onnx");
    let run = export(&model, &state, &out, None);
    let err = stderr(&run);
    assert!(run.status.success(), "{err}");
    assert!(err.contains("4 initializers replaced"), "{err}");
    assert!(d.join("trained.onnx.data").exists(), "{err}");
    let lossless = onnx_ga::model::load_model(&out).unwrap();
    assert!(onnx_ga::model::has_external_data(&lossless));
    let trained = onnx_ga::model::load_model_with_data(&out).unwrap();
    assert_eq!(
        initializers(&trained),
        onnx_ga::data::read_state(&state).unwrap()
    );

    // An output whose data file would be the input's own is refused.
    std::fs::rename(d.join("weights.bin"), d.join("x.onnx.data")).unwrap();
    let mut relocated = onnx_ga::model::load_model(&model).unwrap();
    onnx_ga::model::for_each_tensor_mut(&mut relocated, true, &mut |t, _| {
        for e in &mut t.external_data {
            if e.key() == "location" {
                e.value = Some("x.onnx.data".into());
            }
        }
        Ok::<(), ()>(())
    })
    .unwrap();
    onnx_ga::model::save_model(&relocated, &model).unwrap();
    bad_export(
        &[
            "export",
            model.to_str().unwrap(),
            "--state",
            state.to_str().unwrap(),
            "-o",
            d.join("x.onnx").to_str().unwrap(),
        ],
        d,
        &[
            "x.onnx.data",
            "refusing to overwrite the model's external data",
        ],
    );
}

/// The Python check: onnx.checker and Python onnxruntime accept the exported model, and its
/// output equals the eval model's with the parameters of the saved state fed.
const PYTHON_CHECK: &str = r#"
import sys, numpy as np, onnx, onnxruntime as ort
trained, eval_model, state, data = sys.argv[1:5]
onnx.checker.check_model(trained, full_check=True)
state = np.load(state)
data = np.load(data)
feeds = {"input": data["input"][:8], "labels": data["labels"][:8]}
opts = ort.SessionOptions()
opts.intra_op_num_threads = 1
s = ort.InferenceSession(trained, opts, providers=["CPUExecutionProvider"])
got = s.run(None, feeds)
e = ort.InferenceSession(eval_model, opts, providers=["CPUExecutionProvider"])
params = {i.name: state[i.name] for i in e.get_inputs() if i.name not in feeds}
assert sorted(params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], sorted(params)
want = e.run(None, {**feeds, **params})
for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)
print("ok", [float(g) for g in got])
"#;

/// `safetensors` from Python reads our file as the same arrays as the `.npz`; and a file it
/// writes, we read.
const SAFETENSORS_CHECK: &str = r#"
import sys, numpy as np
from safetensors.numpy import load_file, save_file
st, npz, out = sys.argv[1:4]
a = load_file(st)
b = dict(np.load(npz))
assert sorted(a) == sorted(b), (sorted(a), sorted(b))
for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (k, a[k].dtype, b[k].dtype)
    assert a[k].tobytes() == b[k].tobytes(), k
save_file(b, out)
print("ok", len(a))
"#;

fn python_has(python: &Path, module: &str) -> bool {
    let ok = Command::new(python)
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || std::env::var("CI").as_deref() != Ok("true"),
        "Python module {module} is missing under CI: run scripts/install-ort.sh"
    );
    if !ok {
        eprintln!("SKIPPED: {module} is not installed in {}", python.display());
    }
    ok
}

fn run_python(python: &Path, script: &str, args: &[&Path]) {
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "Python check failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn exported_model_runs_in_python_onnxruntime_and_safetensors_reads_the_state() {
    if !ort_available() {
        return;
    }
    let Some(python) = common::python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let step = train(dir.path());
    let state = dir.path().join("state.npz");
    let trained = dir.path().join("trained.onnx");
    let out = export(&eval_model(), &state, &trained, Some(&step));
    assert!(out.status.success(), "export failed: {}", stderr(&out));
    let data = root().join("graphs").join(MODEL).join("data.npz");
    run_python(
        &python,
        PYTHON_CHECK,
        &[&trained, &eval_model(), &state, &data],
    );

    if python_has(&python, "safetensors") {
        let from_python = dir.path().join("from_python.safetensors");
        run_python(
            &python,
            SAFETENSORS_CHECK,
            &[&dir.path().join("state.safetensors"), &state, &from_python],
        );
        assert_eq!(
            onnx_ga::data::read_state(&from_python).unwrap(),
            common::read_npz(&state)
        );
    }
}

#[test]
fn safetensors_state_round_trips_through_the_trainer() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    train(dir.path());
    let npz = onnx_ga::data::read_state(&dir.path().join("state.npz")).unwrap();
    let st = onnx_ga::data::read_state(&dir.path().join("state.safetensors")).unwrap();
    assert_eq!(st, npz, "the two formats hold the same state");
    assert!(
        st.values().any(|t| matches!(t, Tensor::I64(_)))
            && st.values().any(|t| matches!(t, Tensor::F32(_))),
        "the state has int64 counters and float tensors"
    );

    // load_state of the .safetensors gives the trainer that state, and training on from it
    // equals training on from the .npz.
    let step = common::rewrite_shipped(MODEL, SPEC);
    let data = data();
    let mut a = common::trainer(&step);
    let mut b = common::trainer(&step);
    a.load_state(&dir.path().join("state.safetensors")).unwrap();
    b.load_state(&dir.path().join("state.npz")).unwrap();
    assert_eq!(a.state().unwrap(), &st);
    for i in 16..20 {
        let batch = micro_batch(&data, 64, 8, i);
        assert_eq!(
            a.step(&batch, false).unwrap(),
            b.step(&batch, false).unwrap()
        );
    }
    assert_eq!(a.state().unwrap(), b.state().unwrap());
}

// --- Bad input: exit code 2, a message naming what is wrong, nothing written. ---

fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap_or_default(),
            )
        })
        .collect();
    files.sort();
    files
}

/// The four parameters with their right shapes (values of no importance), plus the
/// changes `edit` makes.
fn state_file(dir: &Path, name: &str, edit: impl FnOnce(&mut BTreeMap<String, Tensor>)) -> PathBuf {
    let mut state = BTreeMap::new();
    for (name, shape) in [
        ("fc1.weight", &[32usize, 16][..]),
        ("fc1.bias", &[32]),
        ("fc2.weight", &[10, 32]),
        ("fc2.bias", &[10]),
    ] {
        state.insert(name.to_string(), Tensor::F32(ndarray::ArrayD::zeros(shape)));
    }
    edit(&mut state);
    let path = dir.join(name);
    onnx_ga::data::write_state(&path, state.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    path
}

fn bad_export(args: &[&str], dir: &Path, expect: &[&str]) {
    let before = listing(dir);
    let out = onnx_ga(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "exit code; stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for e in expect {
        assert!(err.contains(e), "stderr should mention {e:?}: {err}");
    }
    assert!(
        listing(dir) == before,
        "nothing may be written or changed in {}",
        dir.display()
    );
}

#[test]
fn bad_input_is_refused_with_exit_2_and_nothing_written() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("eval_model.onnx");
    std::fs::copy(eval_model(), &model).unwrap();
    let out = d.join("trained.onnx");
    let s = |p: &Path| p.to_str().unwrap().to_string();

    let shape = state_file(d, "shape.npz", |st| {
        st.insert(
            "fc1.weight".into(),
            Tensor::F32(ndarray::ArrayD::zeros(&[16, 32][..])),
        );
    });
    bad_export(
        &["export", &s(&model), "--state", &s(&shape), "-o", &s(&out)],
        d,
        &[
            "fc1.weight",
            "float [32, 16]",
            "float [16, 32]",
            &s(&model),
            &s(&shape),
        ],
    );
    let dtype = state_file(d, "dtype.safetensors", |st| {
        st.insert(
            "fc2.bias".into(),
            Tensor::F64(ndarray::ArrayD::zeros(&[10][..])),
        );
    });
    bad_export(
        &["export", &s(&model), "--state", &s(&dtype), "-o", &s(&out)],
        d,
        &["fc2.bias", "float [10]", "double [10]", &s(&dtype)],
    );
    let unknown = d.join("state.bin");
    std::fs::write(&unknown, b"whatever").unwrap();
    bad_export(
        &[
            "export",
            &s(&model),
            "--state",
            &s(&unknown),
            "-o",
            &s(&out),
        ],
        d,
        &[&s(&unknown), ".npz or .safetensors"],
    );
    let good = state_file(d, "good.npz", |_| {});
    bad_export(
        &["export", &s(&model), "--state", &s(&good), "-o", &s(&model)],
        d,
        &[&s(&model), "refusing to overwrite the model"],
    );
    // The same file by another name.
    let other_name = d.join(".").join("good.npz");
    bad_export(
        &[
            "export",
            &s(&model),
            "--state",
            &s(&good),
            "-o",
            &s(&other_name),
        ],
        d,
        &["refusing to overwrite the state file"],
    );
    let foreign = state_file(d, "foreign.npz", |st| {
        *st = BTreeMap::from([(
            "conv.weight".to_string(),
            Tensor::F32(ndarray::ArrayD::zeros(&[4][..])),
        )]);
    });
    bad_export(
        &[
            "export",
            &s(&model),
            "--state",
            &s(&foreign),
            "-o",
            &s(&out),
        ],
        d,
        &["none of the 1 tensors", &s(&foreign)],
    );
    let missing = d.join("missing.npz");
    bad_export(
        &[
            "export",
            &s(&model),
            "--state",
            &s(&missing),
            "-o",
            &s(&out),
        ],
        d,
        &[&s(&missing)],
    );
    // train refuses a --save-state it could not write before it trains.
    let data = root().join("graphs").join(MODEL).join("data.npz");
    let step = d.join("step.onnx");
    onnx_ga::model::save_model(&common::rewrite_shipped(MODEL, SPEC), &step).unwrap();
    bad_export(
        &[
            "train",
            &s(&step),
            "--data",
            &s(&data),
            "--micro-batch",
            "8",
            "--steps",
            "4",
            "--save-state",
            &s(&d.join("state.pt")),
        ],
        d,
        &["state.pt", ".npz or .safetensors"],
    );

    // The good state does export.
    let ok = onnx_ga(&["export", &s(&model), "--state", &s(&good), "-o", &s(&out)]);
    assert!(ok.status.success(), "{}", stderr(&ok));
}

#[test]
fn a_step_parameter_the_model_lacks_is_an_error() {
    // With the step's manifest, every parameter of the state must be in the model.
    let step = common::rewrite_shipped(MODEL, SPEC);
    let manifest = onnx_ga::state::Manifest::from_model(&step).unwrap();
    let mut state: BTreeMap<String, Tensor> = initializers(&step)
        .into_iter()
        .filter(|(k, _)| manifest.state.iter().any(|e| &e.input == k))
        .collect();
    // The states that start at zeros are stored nowhere in the step.
    for name in manifest.init.keys() {
        let zeros = onnx_ga::train::zeros_of_input(step.graph.as_ref().unwrap(), name).unwrap();
        state.insert(name.clone(), zeros);
    }
    let mut model = onnx_ga::model::load_model(&eval_model()).unwrap();
    model
        .graph
        .as_mut()
        .unwrap()
        .input
        .retain(|i| i.name() != "fc2.bias");
    let sources = onnx_ga::trained::ExportSources {
        model_file: Path::new("eval_model.onnx"),
        state_file: Some(Path::new("state.npz")),
        manifest: Some(&manifest),
        unread_state: &[],
    };
    let e = onnx_ga::trained::export_trained_with(model.clone(), &state, &sources)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("parameter 'fc2.bias'") && e.contains("eval_model.onnx"),
        "{e}"
    );
    // Without the manifest the roles are unknown: the other three are set, and the
    // accumulators, moments and counters are reported as not model tensors.
    let (_, report) =
        onnx_ga::trained::export_trained(model, &state, Path::new("eval_model.onnx")).unwrap();
    assert_eq!(report.set(), 3);
    assert!(report.not_in_model.contains(&"fc2.bias".to_string()));
    assert!(report.not_in_model.len() > 4, "{:?}", report.not_in_model);
}

/// A model stored in half precision trains float32 masters (`autodiff`'s `half_model`); its
/// export rounds each to the initializer's type, to nearest even (float16 and bfloat16), and
/// keeps the type, so the trained file is the user's half model. A float32 value for an
/// integer initializer is still a mismatch.
#[test]
fn export_rounds_float32_masters_into_a_half_model() {
    use onnx_ga::proto::elem::{BFLOAT16, FLOAT16};
    let masters = [0.1f32, -2.7182817, 65504.0, 1.0e-8, 3.0e38];
    let mut state = BTreeMap::new();
    let mut model =
        onnx_ga::model::load_model(&root().join("graphs/forward/torch_mlp_half/legacy.onnx"))
            .unwrap();
    let graph = model.graph.as_mut().unwrap();
    for (name, elem) in [("w16", FLOAT16), ("wbf16", BFLOAT16)] {
        graph.initializer.push(onnx_ga::proto::TensorProto {
            name: Some(name.into()),
            dims: vec![masters.len() as i64],
            data_type: Some(elem),
            raw_data: Some(vec![0; 2 * masters.len()]),
            ..Default::default()
        });
        state.insert(
            name.to_string(),
            Tensor::F32(ndarray::arr1(&masters).into_dyn()),
        );
    }
    let (out, report) =
        onnx_ga::trained::export_trained(model, &state, Path::new("half.onnx")).unwrap();
    assert_eq!(report.replaced, ["w16", "wbf16"]);
    let graph = out.graph.as_ref().unwrap();
    for init in graph
        .initializer
        .iter()
        .filter(|t| t.name().starts_with('w'))
    {
        let stored: Vec<u16> = init
            .raw_data()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let expected: Vec<u16> = masters
            .iter()
            .map(|x| match init.data_type() {
                FLOAT16 => half::f16::from_f32(*x).to_bits(),
                _ => half::bf16::from_f32(*x).to_bits(),
            })
            .collect();
        assert_eq!(stored, expected, "{}", init.name());
    }
}

/// The whole path on a half model: rewrite (the report says how it trains), train, export:
/// the exported file holds float16 parameters equal to the trained float32 masters rounded
/// to half.
#[test]
fn a_half_model_trains_and_exports_as_half() {
    let dir = tempfile::tempdir().unwrap();
    let model = root().join("graphs/forward/torch_mlp_half/dynamo.onnx");
    let data_path = root().join("graphs/forward/torch_mlp_half/data.npz");
    let step = dir.path().join("step.onnx");
    let out = onnx_ga(&[
        "rewrite",
        model.to_str().unwrap(),
        "--loss-fn",
        "cross-entropy",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--accum-steps",
        "4",
        "-o",
        step.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("4 parameters train as float32 masters")
            || String::from_utf8_lossy(&out.stdout)
                .contains("4 parameters train as float32 masters"),
        "the report says how a half model trains"
    );
    if !common::ort_available() {
        return;
    }
    let state = dir.path().join("state.safetensors");
    let args = common::cli_train(
        &step,
        &data_path,
        "16",
        &["--save-state", state.to_str().unwrap()],
    );
    let out = onnx_ga(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let trained = dir.path().join("trained.onnx");
    let out = export(&model, &state, &trained, Some(&step));
    assert!(out.status.success(), "{}", stderr(&out));
    let masters = onnx_ga::data::read_state(&state).unwrap();
    let exported = onnx_ga::model::load_model(&trained).unwrap();
    let mut checked = 0;
    for init in &exported.graph.as_ref().unwrap().initializer {
        let Some(master) = masters.get(init.name()) else {
            continue;
        };
        assert_eq!(
            init.data_type(),
            onnx_ga::proto::elem::FLOAT16,
            "{}",
            init.name()
        );
        let stored: Vec<u16> = init
            .raw_data()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let rounded: Vec<u16> = master
            .as_f32()
            .unwrap()
            .iter()
            .map(|x| half::f16::from_f32(*x).to_bits())
            .collect();
        assert_eq!(stored, rounded, "{}", init.name());
        checked += 1;
    }
    assert_eq!(checked, 4);
}

/// `export STEP.onnx`: a step is not the model a user wants out, but it records the one it
/// was made from (path and SHA-256): that model is exported, with the step's manifest, the
/// same bytes as naming it. A step whose record is gone, or whose model changed since
/// `rewrite` read it, is refused (exit 2, nothing written), naming what to pass instead.
#[test]
fn export_of_a_step_exports_the_model_it_was_made_from() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let forward = d("mlp.onnx");
    std::fs::copy(
        root().join("graphs/forward/torch_mlp/dynamo.onnx"),
        &forward,
    )
    .unwrap();
    let data = root().join("graphs/forward/torch_mlp/data.npz");
    let ok = |args: &[&str]| {
        let out = onnx_ga(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stderr(&out)
    };
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let (step, state) = (d("step.onnx"), d("s.npz"));
    ok(&[
        "rewrite",
        &path(&forward),
        "-o",
        &path(&step),
        "--accum-steps",
        "4",
        "--loss-fn",
        "cross-entropy",
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
    ]);
    ok(&[
        "train",
        &path(&step),
        "--data",
        &path(&data),
        "--micro-batch",
        "4",
        "--steps",
        "8",
        "--save-state",
        &path(&state),
        "--quiet",
    ]);

    let from_step = export(&step, &state, &d("from_step.onnx"), None);
    let err = stderr(&from_step);
    assert!(from_step.status.success(), "{err}");
    assert!(
        err.contains("is a training step: exporting the model it was made from")
            && err.contains("mlp.onnx"),
        "{err}"
    );
    export(&forward, &state, &d("named.onnx"), Some(&step));
    let read = |name: &str| std::fs::read(d(name)).unwrap();
    assert!(
        read("from_step.onnx") == read("named.onnx"),
        "the same model as naming it"
    );
    // And it holds the trained parameters, not the forward model's initial ones.
    let trained = initializers(&onnx_ga::model::load_model(&d("from_step.onnx")).unwrap());
    let saved = onnx_ga::data::read_state(&state).unwrap();
    let initial = initializers(&onnx_ga::model::load_model(&forward).unwrap());
    let some_weight = saved
        .keys()
        .find(|k| initial.contains_key(*k))
        .expect("a parameter in the state");
    assert_eq!(bits(&trained[some_weight]), bits(&saved[some_weight]));
    assert_ne!(bits(&trained[some_weight]), bits(&initial[some_weight]));

    // The record removed: refused, naming the command that works.
    let mut unrecorded = onnx_ga::model::load_model(&step).unwrap();
    unrecorded
        .metadata_props
        .retain(|p| p.key() != onnx_ga::eval_model::EVAL_MODEL_KEY);
    let unrecorded_path = d("unrecorded.onnx");
    onnx_ga::model::save_model(&unrecorded, &unrecorded_path).unwrap();
    // The model changed since `rewrite` read it (the same graph, saved again with a note).
    let mut edited = onnx_ga::model::load_model(&forward).unwrap();
    edited.doc_string = Some("edited".into());
    onnx_ga::model::save_model(&edited, &forward).unwrap();
    for (step, why) in [
        (&unrecorded_path, "it records no model it was made from"),
        (&step, "changed since `rewrite` read it"),
    ] {
        let before = listing(dir.path());
        let out = export(step, &state, &d("refused.onnx"), None);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(why) && err.contains("--step"), "{err}");
        assert!(listing(dir.path()) == before, "nothing written");
    }
}
