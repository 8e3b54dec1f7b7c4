//! Tests of `onnx_ga::checkpoint` against ONNX Runtime 1.19.2 checkpoints.
//!
//! References, all independent of the reader under test:
//! - `tests/data/checkpoint/expected_*.json`, written by `make_expected.py` from ONNX
//!   Runtime's own `CheckpointState` (names, trainable flags, shapes, leading values, sums);
//! - each model's `training_model.onnx` (decoded with prost here), whose graph inputs must be
//!   exactly the data inputs, the checkpoint's parameters, one accumulation buffer per
//!   trainable parameter, and `lazy_reset_grad`;
//! - synthetic checkpoints built in this file with the `flatbuffers` builder, for each error.

use crate::common;

use crate::common::root;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use flatbuffers::{FlatBufferBuilder, WIPOffset};
use onnx_ga::checkpoint::{
    external_data_path, parse_checkpoint, read_checkpoint, Checkpoint, CheckpointError,
    CheckpointTensor, PropertyValue,
};
use onnx_ga::proto::{tensor_shape_proto, type_proto, ModelProto};
use prost::Message;
use serde_json::Value;

const MODELS: [&str; 6] = common::SHIPPED_GRAPHS;

fn data_dir() -> PathBuf {
    root().join("tests/data/checkpoint")
}

fn load_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn i64s(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()) + 1e-12
}

/// Checks a tensor against a `summary()` record of make_expected.py. `rel` = 0 demands the
/// leading values bit-exact (sums are compared with 1e-9: numpy sums pairwise).
fn check_summary(t: &CheckpointTensor, expected: &Value, rel: f64, what: &str) {
    assert_eq!(t.dims, i64s(&expected["shape"]), "{what}: dims");
    assert_eq!(expected["dtype"], "float32", "{what}: reference dtype");
    assert_eq!(t.data_type, 1, "{what}: data type");
    let values = t.as_f32().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        Some(values.len()),
        t.element_count(),
        "{what}: element count"
    );
    let head = f64s(&expected["head"]);
    for (i, (&got, &want)) in values.iter().zip(&head).enumerate() {
        if rel == 0.0 {
            // JSON holds the float32 value printed as a float64; serde_json's default parser
            // may miss the last float64 bit, which rounding to float32 absorbs.
            assert_eq!(got, want as f32, "{what}: value {i}");
        } else {
            assert!(
                close(got as f64, want, rel),
                "{what}: value {i}: {got} vs {want}"
            );
        }
    }
    let sum: f64 = values.iter().map(|&v| v as f64).sum();
    let abs_sum: f64 = values.iter().map(|&v| (v as f64).abs()).sum();
    let tol = rel.max(1e-9);
    let (want_sum, want_abs) = (
        expected["sum"].as_f64().unwrap(),
        expected["abs_sum"].as_f64().unwrap(),
    );
    // A sum can cancel to ~0: bound its error by the absolute sum instead.
    assert!(
        (sum - want_sum).abs() <= tol * want_abs + 1e-12,
        "{what}: sum {sum} vs {want_sum}"
    );
    assert!(
        close(abs_sum, want_abs, tol),
        "{what}: abs sum {abs_sum} vs {want_abs}"
    );
}

/// Name -> (elem_type, dims) of a model's graph inputs, decoded with prost.
fn graph_inputs(model: &Path) -> Vec<(String, i32, Vec<i64>)> {
    let bytes = std::fs::read(model).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    let model = ModelProto::decode(&bytes[..]).expect("training_model.onnx decodes");
    let graph = model.graph.expect("model has a graph");
    graph
        .input
        .iter()
        .map(|vi| {
            let name = vi.name.clone().unwrap_or_default();
            let Some(type_proto::Value::TensorType(t)) =
                vi.r#type.as_ref().and_then(|t| t.value.as_ref())
            else {
                panic!("input {name} is not a tensor");
            };
            let dims = t
                .shape
                .as_ref()
                .map(|s| {
                    s.dim
                        .iter()
                        .map(|d| match d.value {
                            Some(tensor_shape_proto::dimension::Value::DimValue(v)) => v,
                            _ => -1,
                        })
                        .collect()
                })
                .unwrap_or_default();
            (name, t.elem_type.unwrap_or(0), dims)
        })
        .collect()
}

// ----------------------------------------------------------------------------- real checkpoints

#[test]
fn graph_checkpoints_match_ort_and_training_model() {
    for model in MODELS {
        let dir = root().join("graphs").join(model);
        let ckpt =
            read_checkpoint(&dir.join("checkpoint")).unwrap_or_else(|e| panic!("{model}: {e}"));
        assert_eq!(ckpt.version, 2, "{model}");
        assert!(!ckpt.nominal && !ckpt.has_external_data, "{model}");
        assert!(
            ckpt.optimizer_groups.is_empty(),
            "{model}: fresh checkpoint has no optimizer state"
        );
        assert!(ckpt.properties.is_empty(), "{model}");

        // Against ORT's CheckpointState.
        let expected = load_json(&data_dir().join(format!("expected_{model}.json")));
        let params = expected["parameters"].as_object().unwrap();
        let names: BTreeSet<&str> = ckpt.parameters().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names.len(),
            ckpt.trainable.len() + ckpt.frozen.len(),
            "{model}: unique names"
        );
        assert_eq!(
            names,
            params.keys().map(String::as_str).collect(),
            "{model}: parameter names"
        );
        for (name, want) in params {
            let t = ckpt.parameter(name).unwrap();
            assert_eq!(
                ckpt.is_trainable(name),
                want["trainable"].as_bool(),
                "{model}/{name}"
            );
            check_summary(t, want, 0.0, &format!("{model}/{name}"));
            // to_tensor_proto round-trips the data.
            let proto = t.to_tensor_proto();
            assert_eq!(proto.name.as_deref(), Some(name.as_str()));
            assert_eq!(proto.dims, t.dims);
            assert_eq!(proto.data_type, Some(1));
            assert_eq!(proto.raw_data.as_deref(), Some(&t.raw_data[..]));
            let arr = t.to_array_f32().unwrap();
            assert_eq!(
                arr.shape().iter().map(|&d| d as i64).collect::<Vec<_>>(),
                t.dims
            );
        }

        // Against the training graph's inputs (DESIGN.md section 6).
        let inputs = graph_inputs(&dir.join("training_model.onnx"));
        let by_name: BTreeMap<&str, (i32, &Vec<i64>)> = inputs
            .iter()
            .map(|(n, ty, dims)| (n.as_str(), (*ty, dims)))
            .collect();
        let mut accounted: BTreeSet<String> = BTreeSet::new();
        for t in ckpt.parameters() {
            let (ty, dims) = by_name
                .get(t.name.as_str())
                .unwrap_or_else(|| panic!("{model}: parameter {} is not a graph input", t.name));
            assert_eq!(*ty, t.data_type, "{model}/{}: elem type", t.name);
            assert_eq!(*dims, &t.dims, "{model}/{}: shape", t.name);
            accounted.insert(t.name.clone());
            let buffer = format!("{}_grad.accumulation.buffer", t.name);
            if ckpt.is_trainable(&t.name) == Some(true) {
                let (bty, bdims) = by_name
                    .get(buffer.as_str())
                    .unwrap_or_else(|| panic!("{model}: no {buffer}"));
                assert_eq!((*bty, *bdims), (t.data_type, &t.dims), "{model}: {buffer}");
                accounted.insert(buffer);
            } else {
                assert!(
                    !by_name.contains_key(buffer.as_str()),
                    "{model}: frozen {} has a buffer",
                    t.name
                );
            }
        }
        accounted.insert("lazy_reset_grad".into());
        for d in expected["data_inputs"].as_array().unwrap() {
            accounted.insert(d.as_str().unwrap().to_owned());
        }
        let all: BTreeSet<String> = inputs.iter().map(|(n, _, _)| n.clone()).collect();
        assert_eq!(
            all, accounted,
            "{model}: graph inputs = data + parameters + buffers + lazy_reset_grad"
        );
    }
}

#[test]
fn cnn_bn_has_frozen_running_stats() {
    let ckpt = read_checkpoint(&root().join("graphs/cnn_bn/checkpoint")).unwrap();
    let frozen: BTreeSet<&str> = ckpt.frozen.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        frozen,
        BTreeSet::from(["bn.running_mean", "bn.running_var"])
    );
    assert_eq!(
        ckpt.parameter("bn.running_var").unwrap().as_f32().unwrap(),
        vec![1.0; 4]
    );
}

#[test]
fn optimizer_state_after_one_adamw_step() {
    let path = data_dir().join("adamw_step1.ckpt");
    let ckpt = read_checkpoint(&path).unwrap();
    let expected = load_json(&data_dir().join("expected_adamw_step1.json"));

    for (name, want) in expected["parameters"].as_object().unwrap() {
        let t = ckpt
            .parameter(name)
            .unwrap_or_else(|| panic!("no parameter {name}"));
        assert_eq!(ckpt.is_trainable(name), want["trainable"].as_bool());
        check_summary(t, want, 0.0, name);
    }
    assert_eq!(
        ckpt.trainable.len() + ckpt.frozen.len(),
        expected["parameters"].as_object().unwrap().len()
    );

    let opt = &expected["optimizer"];
    assert_eq!(ckpt.optimizer_groups.len(), 1);
    let group = ckpt
        .optimizer_group(opt["group"].as_str().unwrap())
        .expect("group0");
    assert_eq!(group.step, opt["step"].as_i64().unwrap());
    assert_eq!(
        group.initial_learning_rate,
        opt["initial_learning_rate"].as_f64().unwrap() as f32
    );
    let states = opt["states"].as_object().unwrap();
    assert_eq!(group.states.len(), states.len());
    for (param, want) in states {
        let state = group
            .state(param)
            .unwrap_or_else(|| panic!("no optimizer state for {param}"));
        let names: BTreeSet<&str> = state.momentums.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, BTreeSet::from(["momentum0", "momentum1"]), "{param}");
        let shape = &ckpt.parameter(param).unwrap().dims;
        for m in ["momentum0", "momentum1"] {
            let t = state.momentum(m).unwrap();
            assert_eq!(&t.dims, shape, "{param}/{m}");
            // Expected values are (1-b1) g and (1-b2) g^2 computed in numpy from ORT's
            // gradient; ORT's kernel rounds differently in the last bits.
            check_summary(t, &want[m], 1e-6, &format!("{param}/{m}"));
        }
    }

    let props = expected["properties"].as_object().unwrap();
    assert_eq!(ckpt.properties.len(), props.len());
    assert_eq!(
        ckpt.property("epoch"),
        Some(&PropertyValue::Int(props["epoch"].as_i64().unwrap()))
    );
    assert_eq!(
        ckpt.property("best_loss"),
        Some(&PropertyValue::Float(
            props["best_loss"].as_f64().unwrap() as f32
        ))
    );
    assert_eq!(
        ckpt.property("tag"),
        Some(&PropertyValue::String(
            props["tag"].as_str().unwrap().to_owned()
        ))
    );
}

#[test]
fn nominal_checkpoint_has_names_only() {
    let ckpt = read_checkpoint(&data_dir().join("nominal.ckpt")).unwrap();
    assert!(ckpt.nominal);
    let names = |ts: &[CheckpointTensor]| ts.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&ckpt.trainable), ["w"]);
    assert_eq!(names(&ckpt.frozen), ["b"]);
    for t in ckpt.parameters() {
        assert_eq!(t.data_type, 1);
        assert!(t.dims.is_empty() && t.raw_data.is_empty(), "{}", t.name);
    }
}

#[test]
fn external_data_is_read_from_dot_data_file() {
    let path = data_dir().join("external.ckpt");
    assert_eq!(
        external_data_path(&path),
        data_dir().join("external.ckpt.data")
    );
    let ckpt = read_checkpoint(&path).unwrap();
    assert!(ckpt.has_external_data);
    let a = ckpt.parameter("a").unwrap();
    assert_eq!(a.dims, [2, 3]);
    assert_eq!(a.as_f32().unwrap(), [-2.0, -0.5, 1.0, 2.5, 4.0, 5.5]);
    let c = ckpt.parameter("c").unwrap();
    assert_eq!((c.data_type, c.dims.as_slice()), (7, &[2i64][..]));
    let c_values: Vec<i64> = c
        .raw_data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(c_values, [7, -8]);
    assert!(c.as_f32().is_err(), "INT64 tensor is not f32");
    let s = ckpt.parameter("s").unwrap();
    assert!(s.dims.is_empty());
    assert_eq!(s.as_f32().unwrap(), [0.25]);
    assert_eq!(ckpt.is_trainable("a"), Some(true));
    assert_eq!(ckpt.is_trainable("c"), Some(false));
}

#[test]
fn external_data_file_missing_or_short() {
    let bytes = std::fs::read(data_dir().join("external.ckpt")).unwrap();
    let data = std::fs::read(data_dir().join("external.ckpt.data")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("moved.ckpt");
    std::fs::write(&path, &bytes).unwrap();

    let err = read_checkpoint(&path).unwrap_err();
    assert!(matches!(err, CheckpointError::ExternalData { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("moved.ckpt.data"), "{msg}");

    // `c` needs bytes 64..80.
    std::fs::write(external_data_path(&path), &data[..70]).unwrap();
    let err = read_checkpoint(&path).unwrap_err();
    assert!(
        matches!(err, CheckpointError::ExternalData { ref tensor, .. } if tensor == "c"),
        "{err}"
    );
    assert!(err.to_string().contains("64..80"), "{err}");
}

// ----------------------------------------------------------------------------- bad files

fn assert_names_file(err: &CheckpointError, path: &Path) {
    assert_eq!(err.path(), path);
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name the file: {msg}"
    );
}

fn write_tmp(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn real_checkpoint() -> Vec<u8> {
    std::fs::read(root().join("graphs/mlp_ce_adamw/checkpoint")).unwrap()
}

#[test]
fn missing_file_is_io_error() {
    let path = root().join("tests/data/checkpoint/does-not-exist.ckpt");
    let err = read_checkpoint(&path).unwrap_err();
    match &err {
        CheckpointError::Io { source, .. } => {
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound)
        }
        other => panic!("expected Io, got {other:?}"),
    }
    assert_names_file(&err, &path);
}

#[test]
fn empty_and_tiny_files_are_too_short() {
    let tmp = tempfile::tempdir().unwrap();
    for len in [0usize, 1, 7] {
        let path = write_tmp(
            tmp.path(),
            &format!("short{len}"),
            &real_checkpoint()[..len],
        );
        let err = read_checkpoint(&path).unwrap_err();
        assert!(
            matches!(err, CheckpointError::TooShort { len: l, .. } if l == len),
            "{err}"
        );
        assert_names_file(&err, &path);
    }
}

#[test]
fn wrong_identifier_names_what_was_found() {
    let tmp = tempfile::tempdir().unwrap();
    let mut bytes = real_checkpoint();
    bytes[4..8].copy_from_slice(b"ORTM");
    let path = write_tmp(tmp.path(), "ortm", &bytes);
    let err = read_checkpoint(&path).unwrap_err();
    assert!(
        matches!(err, CheckpointError::WrongIdentifier { found, .. } if &found == b"ORTM"),
        "{err}"
    );
    assert_names_file(&err, &path);
    let msg = err.to_string();
    assert!(
        msg.contains("\"ORTM\"") && msg.contains("\"ODTC\""),
        "{msg}"
    );

    // An ONNX model is not a checkpoint either.
    let onnx = std::fs::read(root().join("graphs/l1_loss/training_model.onnx")).unwrap();
    let path = write_tmp(tmp.path(), "model.onnx", &onnx);
    let err = read_checkpoint(&path).unwrap_err();
    assert!(
        matches!(err, CheckpointError::WrongIdentifier { .. }),
        "{err}"
    );
}

/// Deterministic pseudo-random bytes (xorshift64*).
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect()
}

#[test]
fn random_bytes_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_tmp(tmp.path(), "random", &random_bytes(1, 4096));
    let err = read_checkpoint(&path).unwrap_err();
    assert!(
        matches!(err, CheckpointError::WrongIdentifier { .. }),
        "{err}"
    );
    assert_names_file(&err, &path);

    // With the right identifier the verifier must catch them (and nothing may panic).
    let origin = Path::new("random.ckpt");
    for seed in 0..2000u64 {
        let mut bytes = random_bytes(seed, 8 + (seed as usize * 7) % 600);
        bytes[4..8].copy_from_slice(b"ODTC");
        if seed % 4 == 0 {
            bytes[0..4].copy_from_slice(&12u32.to_le_bytes()); // a plausible root offset
        }
        let err = parse_checkpoint(&bytes, origin).unwrap_err();
        assert_eq!(err.path(), origin);
    }
}

#[test]
fn truncated_files_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = real_checkpoint();
    let path = write_tmp(tmp.path(), "truncated", &bytes[..bytes.len() / 2]);
    let err = read_checkpoint(&path).unwrap_err();
    assert!(matches!(err, CheckpointError::Verification { .. }), "{err}");
    assert_names_file(&err, &path);

    // Every prefix is rejected, unless all it drops is trailing padding: then it must read
    // exactly like the whole file.
    let origin = Path::new("prefix.ckpt");
    for bytes in [
        real_checkpoint(),
        std::fs::read(data_dir().join("adamw_step1.ckpt")).unwrap(),
    ] {
        let full = parse_checkpoint(&bytes, origin).unwrap();
        let mut accepted = 0;
        for len in 0..bytes.len() {
            if let Ok(c) = parse_checkpoint(&bytes[..len], origin) {
                assert_eq!(c, full, "prefix of {len} bytes reads differently");
                accepted += 1;
            }
        }
        assert!(accepted <= 8, "{accepted} prefixes accepted");
    }
}

#[test]
fn corrupted_bytes_never_panic() {
    let origin = Path::new("corrupt.ckpt");
    for bytes in [
        real_checkpoint(),
        std::fs::read(data_dir().join("adamw_step1.ckpt")).unwrap(),
    ] {
        for i in 0..bytes.len() {
            for flip in [0xFFu8, 0x80, 0x01] {
                let mut b = bytes.clone();
                b[i] ^= flip;
                if let Err(e) = parse_checkpoint(&b, origin) {
                    assert_eq!(e.path(), origin);
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------- synthetic files

/// A tensor for [`build`]: name, dims, data type, raw_data, external offset.
struct T<'a> {
    name: &'a str,
    dims: &'a [i64],
    data_type: i32,
    raw: Option<&'a [u8]>,
    external: Option<i64>,
}

fn t<'a>(name: &'a str, dims: &'a [i64], data_type: i32, raw: &'a [u8]) -> T<'a> {
    T {
        name,
        dims,
        data_type,
        raw: Some(raw),
        external: None,
    }
}

/// Writes `ts` as a vector of `Tensor` tables (ort.fbs slots).
fn tensor_vector<'b>(
    b: &mut FlatBufferBuilder<'b>,
    ts: &[T],
) -> WIPOffset<
    flatbuffers::Vector<'b, flatbuffers::ForwardsUOffset<flatbuffers::TableFinishedWIPOffset>>,
> {
    let offs: Vec<WIPOffset<flatbuffers::TableFinishedWIPOffset>> = ts
        .iter()
        .map(|t| {
            let name = b.create_string(t.name);
            let dims = b.create_vector(t.dims);
            let raw = t.raw.map(|r| b.create_vector(r));
            let start = b.start_table();
            b.push_slot_always(4, name);
            b.push_slot_always(8, dims);
            b.push_slot::<i32>(10, t.data_type, 0);
            if let Some(raw) = raw {
                b.push_slot_always(12, raw);
            }
            if let Some(off) = t.external {
                b.push_slot::<i64>(16, off, -1);
            }
            b.end_table(start)
        })
        .collect();
    b.create_vector(&offs)
}

/// Builds a checkpoint with the `flatbuffers` builder (independent of the reader's accessors):
/// vtable slots follow ort_training_checkpoint.fbs / ort.fbs.
fn build(
    version: i32,
    trainable: &[T],
    frozen: &[T],
    has_external: bool,
    with_module: bool,
) -> Vec<u8> {
    let mut b = FlatBufferBuilder::new();
    let tv = tensor_vector(&mut b, trainable);
    let fv = tensor_vector(&mut b, frozen);
    let ms = b.start_table();
    b.push_slot_always(4, tv);
    b.push_slot_always(6, fv);
    b.push_slot::<bool>(10, has_external, false);
    let ms = b.end_table(ms);
    let root = b.start_table();
    b.push_slot::<i32>(4, version, 0);
    if with_module {
        b.push_slot_always(6, ms);
    }
    let root = b.end_table(root);
    b.finish(root, Some("ODTC"));
    b.finished_data().to_vec()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn parse(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    parse_checkpoint(bytes, Path::new("/nowhere/synthetic.ckpt"))
}

#[test]
fn synthetic_valid_checkpoint() {
    let w = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let h = [0x00u8, 0x3c]; // float16 1.0
    let i4 = [0x21u8, 0x03]; // three int4 values, packed
    let bytes = build(
        2,
        &[t("w", &[2, 3], 1, &w), t("h", &[], 10, &h)],
        &[t("q", &[3], 22, &i4), t("empty", &[0, 5], 1, &[])],
        false,
        true,
    );
    let ckpt = parse(&bytes).unwrap();
    assert_eq!(ckpt.version, 2);
    assert_eq!(
        ckpt.parameter("w").unwrap().as_f32().unwrap(),
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );
    assert_eq!(ckpt.parameter("h").unwrap().raw_data, h);
    assert_eq!(ckpt.parameter("q").unwrap().expected_byte_len(), Some(2));
    assert_eq!(ckpt.parameter("empty").unwrap().element_count(), Some(0));
    assert_eq!(
        ckpt.parameter("empty").unwrap().as_f32().unwrap(),
        Vec::<f32>::new()
    );
    // Version 1 (no external data) has the same layout.
    assert_eq!(
        parse(&build(1, &[t("w", &[2, 3], 1, &w)], &[], false, true))
            .unwrap()
            .version,
        1
    );
}

#[test]
fn synthetic_errors_name_the_problem() {
    let w = f32_bytes(&[1.0, 2.0, 3.0]);
    let origin = Path::new("/nowhere/synthetic.ckpt");
    let check = |bytes: Vec<u8>, pred: &dyn Fn(&CheckpointError) -> bool, needle: &str| {
        let err = parse(&bytes).unwrap_err();
        assert!(pred(&err), "unexpected variant: {err:?}");
        assert_names_file(&err, origin);
        assert!(err.to_string().contains(needle), "{err} lacks {needle:?}");
    };

    check(
        build(3, &[t("w", &[3], 1, &w)], &[], false, true),
        &|e| matches!(e, CheckpointError::UnsupportedVersion { version: 3, .. }),
        "version 3",
    );
    check(
        build(0, &[t("w", &[3], 1, &w)], &[], false, true),
        &|e| matches!(e, CheckpointError::UnsupportedVersion { version: 0, .. }),
        "version 0",
    );
    check(
        build(2, &[t("w", &[2, 3], 1, &w)], &[], false, true),
        &|e| matches!(e, CheckpointError::RawDataSize { tensor, expected: 24, actual: 12, .. } if tensor == "w"),
        "12 bytes",
    );
    check(
        build(
            2,
            &[t("w", &[3], 1, &w)],
            &[t("w", &[3], 1, &w)],
            false,
            true,
        ),
        &|e| matches!(e, CheckpointError::Malformed { .. }),
        "`w` appears more than once",
    );
    check(
        build(2, &[t("names", &[1], 8, &[])], &[], false, true),
        &|e| matches!(e, CheckpointError::StringTensor { tensor, .. } if tensor == "names"),
        "string tensor",
    );
    check(
        build(2, &[t("odd", &[1], 99, &[0])], &[], false, true),
        &|e| {
            matches!(
                e,
                CheckpointError::UnsupportedDataType { data_type: 99, .. }
            )
        },
        "data type 99",
    );
    check(
        build(2, &[t("undef", &[1], 0, &[0])], &[], false, true),
        &|e| matches!(e, CheckpointError::UnsupportedDataType { data_type: 0, .. }),
        "UNDEFINED",
    );
    check(
        build(2, &[t("neg", &[2, -1], 1, &w)], &[], false, true),
        &|e| matches!(e, CheckpointError::InvalidDims { .. }),
        "-1 is negative",
    );
    check(
        build(
            2,
            &[t("huge", &[i64::MAX, i64::MAX], 1, &w)],
            &[],
            false,
            true,
        ),
        &|e| matches!(e, CheckpointError::InvalidDims { .. }),
        "overflows",
    );
    check(
        build(2, &[t("w", &[3], 1, &w)], &[], false, false),
        &|e| matches!(e, CheckpointError::Malformed { .. }),
        "no module_state",
    );
    let ext = T {
        name: "x",
        dims: &[3],
        data_type: 1,
        raw: None,
        external: Some(0),
    };
    check(
        build(2, &[ext], &[], false, true),
        &|e| matches!(e, CheckpointError::Malformed { .. }),
        "has_external_data is false",
    );
    let ext = T {
        name: "x",
        dims: &[3],
        data_type: 1,
        raw: None,
        external: Some(0),
    };
    check(
        build(2, &[ext], &[], true, true),
        &|e| matches!(e, CheckpointError::ExternalData { .. }),
        "/nowhere/synthetic.ckpt.data",
    );
    let both = T {
        name: "x",
        dims: &[3],
        data_type: 1,
        raw: Some(&w),
        external: Some(0),
    };
    check(
        build(2, &[both], &[], true, true),
        &|e| matches!(e, CheckpointError::Malformed { .. }),
        "both raw_data and external_data_offset",
    );
}
