//! Model file I/O: byte-exact round trips (ONNX backend-test corpus, graphs/, checked-in
//! files written by the official protobuf runtime), bad inputs, external data, saving.

use std::fs;
use std::path::{Path, PathBuf};

use onnx_ga::model::{
    decode_model, encode_model, has_external_data, load_external_data, load_model,
    load_model_with_data, same_file, save_model, save_model_with_external_data, ModelError,
    EXTERNAL_DATA_ALIGNMENT,
};
use onnx_ga::proto::tensor_proto::{DataLocation, DataType};
use onnx_ga::proto::{
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    SparseTensorProto, StringStringEntryProto, TensorProto, TypeProto, ValueInfoProto,
};
use prost::Message;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn data_dir() -> PathBuf {
    Path::new(ROOT).join("tests/data/model_io")
}

fn onnx_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            onnx_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "onnx") {
            out.push(path);
        }
    }
}

/// Decodes and re-encodes every `.onnx` under `dir`; returns (tested, failures).
fn roundtrip_dir(dir: &Path) -> (usize, Vec<String>) {
    let mut files = Vec::new();
    onnx_files(dir, &mut files);
    files.sort();
    let mut failures = Vec::new();
    for path in &files {
        let bytes = fs::read(path).unwrap();
        match decode_model(&bytes, path) {
            Err(e) => failures.push(format!("{e}")),
            Ok(model) => {
                let again = encode_model(&model);
                if again != bytes {
                    let first = again.iter().zip(&bytes).position(|(a, b)| a != b);
                    failures.push(format!(
                        "{}: re-encoded {} bytes vs {} on disk, first difference at {:?}",
                        path.display(),
                        again.len(),
                        bytes.len(),
                        first
                    ));
                }
            }
        }
    }
    (files.len(), failures)
}

#[test]
fn corpus_roundtrip_is_byte_identical() {
    let corpus = Path::new(ROOT).join("corpus");
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    if !corpus.is_dir() {
        assert!(
            !ci,
            "corpus/ is missing under CI=true: run scripts/fetch-corpus.sh first"
        );
        eprintln!(
            "corpus_roundtrip_is_byte_identical: SKIPPED, no corpus/ (run scripts/fetch-corpus.sh)"
        );
        return;
    }
    let (n, failures) = roundtrip_dir(&corpus);
    eprintln!(
        "corpus: {n} models decoded and re-encoded, {} failures",
        failures.len()
    );
    assert!(n > 0 || !ci, "corpus/ holds no .onnx files");
    assert!(
        failures.is_empty(),
        "{} of {n} corpus models are not byte-identical:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn graphs_roundtrip_is_byte_identical() {
    let (n, failures) = roundtrip_dir(&Path::new(ROOT).join("graphs"));
    eprintln!(
        "graphs/: {n} models decoded and re-encoded, {} failures",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {n} graphs/ models are not byte-identical:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Files written by the official protobuf runtime with every schema field set
/// (tests/data/model_io/generate.py).
#[test]
fn all_fields_roundtrip_is_byte_identical() {
    let (n, failures) = roundtrip_dir(&data_dir());
    assert!(n >= 8, "expected the checked-in models, found {n}");
    assert!(
        failures.is_empty(),
        "not byte-identical:\n{}",
        failures.join("\n")
    );
}

/// prost writes a oneof at the position of its lowest tag; encode_model restores protobuf's
/// field-number order for TypeProto { denotation = 6, optional_type = 9 } and friends.
#[test]
fn typeproto_denotation_order_is_canonical() {
    for k in 3..=5 {
        let path = data_dir().join(format!("all_fields_{k}.onnx"));
        let bytes = fs::read(&path).unwrap();
        let model = decode_model(&bytes, &path).unwrap();
        assert_ne!(
            model.encode_to_vec(),
            bytes,
            "{}: prost alone is expected to reorder",
            path.display()
        );
        assert_eq!(encode_model(&model), bytes, "{}", path.display());
    }
    // And on a model built in memory: denotation precedes optional_type after encoding.
    let mut model = tiny_model();
    model
        .graph
        .as_mut()
        .unwrap()
        .value_info
        .push(ValueInfoProto {
            name: Some("opt".into()),
            r#type: Some(TypeProto {
                denotation: Some("D".into()),
                value: Some(type_proto::Value::OptionalType(Box::new(
                    type_proto::Optional {
                        elem_type: Some(Box::new(float_type(&[2]))),
                    },
                ))),
            }),
            ..Default::default()
        });
    let bytes = encode_model(&model);
    assert_eq!(decode_model(&bytes, Path::new("mem")).unwrap(), model);
    let d = bytes
        .windows(3)
        .position(|w| w == [0x32, 1, b'D'])
        .expect("denotation");
    assert_eq!(
        bytes[d + 3],
        0x4a,
        "optional_type (field 9) must follow denotation (field 6)"
    );
}

// ---------------------------------------------------------------------------------------
// Small models built with the prost types.
// ---------------------------------------------------------------------------------------

fn float_type(shape: &[i64]) -> TypeProto {
    use onnx_ga::proto::tensor_shape_proto::{dimension, Dimension};
    use onnx_ga::proto::TensorShapeProto;
    TypeProto {
        value: Some(type_proto::Value::TensorType(type_proto::Tensor {
            elem_type: Some(DataType::Float as i32),
            shape: Some(TensorShapeProto {
                dim: shape
                    .iter()
                    .map(|&d| Dimension {
                        value: Some(dimension::Value::DimValue(d)),
                        denotation: None,
                    })
                    .collect(),
            }),
        })),
        denotation: None,
    }
}

fn vi(name: &str, shape: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(float_type(shape)),
        ..Default::default()
    }
}

fn float_tensor(name: &str, dims: &[i64], seed: f32) -> TensorProto {
    let n: i64 = dims.iter().product();
    let raw: Vec<u8> = (0..n)
        .flat_map(|i| (seed + i as f32 * 0.5).to_le_bytes())
        .collect();
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::Float as i32),
        raw_data: Some(raw),
        ..Default::default()
    }
}

fn node(op: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// Y = (X + W) + B, plus an `If` whose then-branch has its own 2 KiB initializer and a
/// Constant with a 1 KiB tensor attribute.
fn tiny_model() -> ModelProto {
    let mut if_node = node("If", "branch", &["cond"], &["Z"]);
    let mut const_node = node("Constant", "c", &[], &["K"]);
    const_node.attribute.push(AttributeProto {
        name: Some("value".into()),
        r#type: Some(onnx_ga::proto::attribute_proto::AttributeType::Tensor as i32),
        t: Some(float_tensor("", &[256], 7.0)),
        ..Default::default()
    });
    let then_branch = GraphProto {
        name: Some("then".into()),
        node: vec![const_node, node("Add", "then_add", &["K", "S"], &["Z"])],
        initializer: vec![float_tensor("S", &[512], 3.0)],
        output: vec![vi("Z", &[512])],
        ..Default::default()
    };
    let else_branch = GraphProto {
        name: Some("else".into()),
        node: vec![node("Identity", "else_id", &["W"], &["Z"])],
        output: vec![vi("Z", &[512])],
        ..Default::default()
    };
    if_node.attribute = vec![
        AttributeProto {
            name: Some("then_branch".into()),
            r#type: Some(onnx_ga::proto::attribute_proto::AttributeType::Graph as i32),
            g: Some(then_branch),
            ..Default::default()
        },
        AttributeProto {
            name: Some("else_branch".into()),
            r#type: Some(onnx_ga::proto::attribute_proto::AttributeType::Graph as i32),
            g: Some(else_branch),
            ..Default::default()
        },
    ];
    ModelProto {
        ir_version: Some(10),
        producer_name: Some("onnx-ga tests".into()),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(21),
        }],
        graph: Some(GraphProto {
            name: Some("main".into()),
            node: vec![
                node("Add", "add0", &["X", "W"], &["T"]),
                node("Add", "add1", &["T", "B"], &["Y"]),
                if_node,
            ],
            initializer: vec![
                float_tensor("W", &[512], 1.0), // 2048 bytes
                float_tensor("B", &[4], 2.0),   // 16 bytes
                float_tensor("W2", &[1100], -1.0),
            ],
            input: vec![
                vi("X", &[512]),
                // A bool scalar (a graph input needs a type to load).
                ValueInfoProto {
                    name: Some("cond".into()),
                    r#type: Some({
                        let mut t = float_type(&[]);
                        if let Some(onnx_ga::proto::type_proto::Value::TensorType(tt)) =
                            &mut t.value
                        {
                            tt.elem_type = Some(9);
                        }
                        t
                    }),
                    ..Default::default()
                },
            ],
            output: vec![vi("Y", &[512]), vi("Z", &[512])],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, bytes).unwrap();
    p
}

fn assert_names_file(err: &ModelError, path: &Path) {
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name {}: {msg}",
        path.display()
    );
    assert_eq!(err.path(), path);
}

// ---------------------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------------------

#[test]
fn empty_file_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "empty.onnx", b"");
    let err = load_model(&p).unwrap_err();
    assert!(matches!(err, ModelError::Empty { .. }), "{err:?}");
    assert_names_file(&err, &p);
}

#[test]
fn missing_file_is_rejected() {
    let p = Path::new("/nonexistent-dir-for-onnx-ga/model.onnx");
    let err = load_model(p).unwrap_err();
    assert!(matches!(err, ModelError::NotFound { .. }), "{err:?}");
    assert_names_file(&err, p);
    let err = load_model_with_data(p).unwrap_err();
    assert!(matches!(err, ModelError::NotFound { .. }), "{err:?}");
}

#[test]
fn random_bytes_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..50 {
        let len = 1 + (round * 37) % 4000;
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        let p = write(dir.path(), &format!("random{round}.onnx"), &bytes);
        let err = load_model(&p).expect_err("random bytes must not load as a model");
        assert!(
            matches!(
                err,
                ModelError::Decode { .. }
                    | ModelError::NotAModel { .. }
                    | ModelError::Truncated { .. }
            ),
            "{err:?}"
        );
        assert_names_file(&err, &p);
    }
    // Bytes that prost decodes without complaint (an unknown field) still are no model.
    let p = write(dir.path(), "unknown_field.onnx", &[0x98, 0x06, 0x01]);
    let err = load_model(&p).unwrap_err();
    assert!(matches!(err, ModelError::NotAModel { .. }), "{err:?}");
    assert_names_file(&err, &p);
    assert!(err.to_string().contains("ir_version"), "{err}");
}

#[test]
fn truncated_model_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = encode_model(&tiny_model());
    let p = write(dir.path(), "half.onnx", &bytes[..bytes.len() / 2]);
    let err = load_model(&p).unwrap_err();
    assert!(matches!(err, ModelError::Truncated { .. }), "{err:?}");
    assert_names_file(&err, &p);
    assert!(err.to_string().contains("graph"), "{err}");
    // Cut anywhere: always an error, never a model.
    for cut in (1..bytes.len()).step_by(97) {
        assert!(
            decode_model(&bytes[..cut], &p).is_err(),
            "cut at {cut} decoded"
        );
    }
}

#[test]
fn other_protobuf_message_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let tensor = TensorProto {
        dims: vec![2, 3],
        data_type: Some(DataType::Float as i32),
        float_data: vec![1.0; 6],
        name: Some("t".into()),
        ..Default::default()
    };
    let p = write(dir.path(), "tensor.onnx", &tensor.encode_to_vec());
    let err = load_model(&p).unwrap_err();
    assert!(matches!(err, ModelError::Decode { .. }), "{err:?}");
    assert_names_file(&err, &p);

    // A GraphProto decodes "successfully" in some shapes; the sanity checks catch it.
    let graph = GraphProto {
        name: Some("g".into()),
        ..Default::default()
    };
    let p = write(dir.path(), "graph.onnx", &graph.encode_to_vec());
    let err = load_model(&p).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Decode { .. } | ModelError::NotAModel { .. }
        ),
        "{err:?}"
    );
    assert_names_file(&err, &p);

    // A model without graph / opset / with ir_version 0.
    for (what, m) in [
        (
            "graph",
            ModelProto {
                graph: None,
                ..tiny_model()
            },
        ),
        (
            "opset_import",
            ModelProto {
                opset_import: vec![],
                ..tiny_model()
            },
        ),
        (
            "ir_version",
            ModelProto {
                ir_version: Some(0),
                ..tiny_model()
            },
        ),
    ] {
        let p = write(dir.path(), &format!("no_{what}.onnx"), &m.encode_to_vec());
        let err = load_model(&p).unwrap_err();
        assert!(matches!(err, ModelError::NotAModel { .. }), "{err:?}");
        assert!(err.to_string().contains(what), "{err}");
        assert_names_file(&err, &p);
    }
}

// ---------------------------------------------------------------------------------------
// External data
// ---------------------------------------------------------------------------------------

fn external(name: &str, location: &str, offset: Option<u64>, length: Option<u64>) -> TensorProto {
    let mut entries = vec![StringStringEntryProto {
        key: Some("location".into()),
        value: Some(location.into()),
    }];
    if let Some(o) = offset {
        entries.push(StringStringEntryProto {
            key: Some("offset".into()),
            value: Some(o.to_string()),
        });
    }
    if let Some(l) = length {
        entries.push(StringStringEntryProto {
            key: Some("length".into()),
            value: Some(l.to_string()),
        });
    }
    TensorProto {
        name: Some(name.into()),
        dims: vec![4],
        data_type: Some(DataType::Float as i32),
        external_data: entries,
        data_location: Some(DataLocation::External as i32),
        ..Default::default()
    }
}

/// Writes a model whose initializer `W` refers to `location`; returns the model path.
fn model_with_ref(dir: &Path, location: &str, offset: Option<u64>, length: Option<u64>) -> PathBuf {
    let mut m = tiny_model();
    m.graph.as_mut().unwrap().initializer[0] = external("W", location, offset, length);
    let p = dir.join("model.onnx");
    save_model(&m, &p).unwrap();
    p
}

fn load_err(p: &Path) -> ModelError {
    let err = load_model_with_data(p).unwrap_err();
    assert_names_file(&err, p);
    err
}

#[test]
fn external_data_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = model_with_ref(dir.path(), "weights.bin", None, None);
    // The lossless load does not need the data.
    let lossless = load_model(&p).unwrap();
    assert!(has_external_data(&lossless));
    let err = load_err(&p);
    assert!(
        matches!(err, ModelError::ExternalFileMissing { .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("weights.bin") && msg.contains("'W'"), "{msg}");
}

#[test]
fn external_location_escaping_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("x.bin"), [0u8; 16]).unwrap();
    let model_dir = dir.path().join("m");
    fs::create_dir(&model_dir).unwrap();
    for location in ["../x.bin", "sub/../../x.bin", "/etc/passwd"] {
        let p = model_with_ref(&model_dir, location, None, None);
        let err = load_err(&p);
        assert!(
            matches!(err, ModelError::UnsafeLocation { .. }),
            "{location}: {err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(location) && msg.contains("'W'"), "{msg}");
    }
}

#[cfg(unix)]
#[test]
fn external_symlink_escaping_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("secret.bin"), [1u8; 16]).unwrap();
    let model_dir = dir.path().join("m");
    fs::create_dir(&model_dir).unwrap();
    std::os::unix::fs::symlink(outside.join("secret.bin"), model_dir.join("link.bin")).unwrap();
    std::os::unix::fs::symlink(&outside, model_dir.join("linkdir")).unwrap();
    for location in ["link.bin", "linkdir/secret.bin"] {
        let p = model_with_ref(&model_dir, location, None, None);
        let err = load_err(&p);
        assert!(
            matches!(err, ModelError::UnsafeLocation { .. }),
            "{location}: {err:?}"
        );
        assert!(err.to_string().contains(location), "{err}");
    }
    // A symlink that stays inside the folder is fine.
    fs::write(model_dir.join("real.bin"), [2u8; 16]).unwrap();
    std::os::unix::fs::symlink("real.bin", model_dir.join("inside.bin")).unwrap();
    let p = model_with_ref(&model_dir, "inside.bin", None, None);
    let m = load_model_with_data(&p).unwrap();
    assert_eq!(
        m.graph.unwrap().initializer[0].raw_data.as_deref(),
        Some(&[2u8; 16][..])
    );
}

#[test]
fn external_range_beyond_file() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("w.bin"), [0u8; 100]).unwrap();
    for (offset, length) in [
        (Some(90), Some(16)),
        (Some(101), None),
        (Some(0), Some(101)),
        (Some(u64::MAX), Some(2)),
    ] {
        let p = model_with_ref(dir.path(), "w.bin", offset, length);
        let err = load_err(&p);
        assert!(
            matches!(err, ModelError::ExternalRange { .. }),
            "{offset:?}+{length:?}: {err:?}"
        );
        assert!(err.to_string().contains("100 bytes"), "{err}");
    }
    // Exactly at the end is fine; no length means "to the end", but never more than the
    // tensor holds (W: 4 floats, 16 bytes; the 64 bytes to the end are not read).
    let p = model_with_ref(dir.path(), "w.bin", Some(84), Some(16));
    assert_eq!(
        load_model_with_data(&p).unwrap().graph.unwrap().initializer[0]
            .raw_data
            .as_ref()
            .unwrap()
            .len(),
        16
    );
    let p = model_with_ref(dir.path(), "w.bin", Some(36), None);
    assert_eq!(
        load_model_with_data(&p).unwrap().graph.unwrap().initializer[0]
            .raw_data
            .as_ref()
            .unwrap()
            .len(),
        16
    );
    // A length beyond what the tensor holds is an error naming both.
    let p = model_with_ref(dir.path(), "w.bin", Some(0), Some(64));
    let err = load_err(&p);
    assert!(
        err.to_string()
            .contains("length is 64 bytes, but a tensor of dims [4] holds 16"),
        "{err}"
    );
    // A malformed offset.
    let mut m = load_model(&p).unwrap();
    m.graph.as_mut().unwrap().initializer[0].external_data[1].value = Some("-3".into());
    save_model(&m, &p).unwrap();
    let err = load_err(&p);
    assert!(
        matches!(err, ModelError::InvalidExternalData { .. }),
        "{err:?}"
    );
}

/// External tensors everywhere: subgraph initializer, node attribute inside a subgraph,
/// sparse initializer values and indices.
#[test]
fn external_data_is_resolved_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let blob: Vec<u8> = (0..64u8).collect();
    fs::create_dir(dir.path().join("data")).unwrap();
    fs::write(dir.path().join("data/blob.bin"), &blob).unwrap();
    let mut m = tiny_model();
    let g = m.graph.as_mut().unwrap();
    let then = g.node[2].attribute[0].g.as_mut().unwrap();
    then.initializer[0] = external("S", "data/blob.bin", Some(0), Some(16));
    then.node[0].attribute[0].t = Some(external("", "./data/blob.bin", Some(16), Some(16)));
    g.sparse_initializer.push(SparseTensorProto {
        values: Some(external("sv", "data/blob.bin", Some(32), Some(16))),
        indices: Some(external("si", "data/blob.bin", Some(48), Some(16))),
        dims: vec![8],
    });
    let p = dir.path().join("model.onnx");
    save_model(&m, &p).unwrap();
    let loaded = load_model_with_data(&p).unwrap();
    assert!(!has_external_data(&loaded));
    let g = loaded.graph.as_ref().unwrap();
    let then = g.node[2].attribute[0].g.as_ref().unwrap();
    let check = |t: &TensorProto, range: std::ops::Range<usize>| {
        assert_eq!(t.raw_data.as_deref(), Some(&blob[range]));
        assert!(t.external_data.is_empty());
        assert_eq!(t.data_location, None);
    };
    check(&then.initializer[0], 0..16);
    check(then.node[0].attribute[0].t.as_ref().unwrap(), 16..32);
    check(g.sparse_initializer[0].values.as_ref().unwrap(), 32..48);
    check(g.sparse_initializer[0].indices.as_ref().unwrap(), 48..64);

    // load_external_data on an in-memory model, relative to a folder.
    let mut again = load_model(&p).unwrap();
    assert!(has_external_data(&again));
    load_external_data(&mut again, dir.path()).unwrap();
    assert_eq!(again, loaded);
    let mut again = load_model(&p).unwrap();
    let err = load_external_data(&mut again, &dir.path().join("data")).unwrap_err();
    assert!(
        matches!(err, ModelError::ExternalFileMissing { .. }),
        "{err:?}"
    );
    assert_names_file(&err, &dir.path().join("data"));
}

/// A model saved by `onnx.save_model(save_as_external_data=True)`.
#[test]
fn reads_external_data_written_by_onnx() {
    let ext = data_dir().join("ext/model.onnx");
    let lossless = load_model(&ext).unwrap();
    assert!(has_external_data(&lossless));
    assert_eq!(encode_model(&lossless), fs::read(&ext).unwrap());
    let with_data = load_model_with_data(&ext).unwrap();
    let inline = load_model(&data_dir().join("inline.onnx")).unwrap();
    assert_eq!(with_data, inline);
}

// ---------------------------------------------------------------------------------------
// Saving
// ---------------------------------------------------------------------------------------

#[test]
fn save_with_external_data_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let original = tiny_model();
    let p = dir.path().join("model.onnx");
    save_model_with_external_data(&original, &p, "model.onnx.data", 1024).unwrap();

    let lossless = load_model(&p).unwrap();
    assert_eq!(encode_model(&lossless), fs::read(&p).unwrap());
    let g = lossless.graph.as_ref().unwrap();
    let by_name = |n: &str| {
        g.initializer
            .iter()
            .find(|t| t.name.as_deref() == Some(n))
            .unwrap()
    };
    // W (2048 B) and W2 (4400 B) and the then-branch S (2048 B) move out; B (16 B) and the
    // Constant's tensor attribute (1 KiB, not an initializer) stay inline.
    for name in ["W", "W2"] {
        let t = by_name(name);
        assert_eq!(
            t.data_location,
            Some(DataLocation::External as i32),
            "{name}"
        );
        assert!(t.raw_data.is_none(), "{name}");
        let offset: u64 = t
            .external_data
            .iter()
            .find(|e| e.key.as_deref() == Some("offset"))
            .unwrap()
            .value
            .as_ref()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(offset % EXTERNAL_DATA_ALIGNMENT, 0, "{name}");
    }
    assert!(by_name("B").raw_data.is_some());
    let then = g.node[2].attribute[0].g.as_ref().unwrap();
    assert_eq!(
        then.initializer[0].data_location,
        Some(DataLocation::External as i32)
    );
    assert!(then.node[0].attribute[0]
        .t
        .as_ref()
        .unwrap()
        .raw_data
        .is_some());
    let data_len = fs::metadata(dir.path().join("model.onnx.data"))
        .unwrap()
        .len();
    // W at 0, W2 at 4096 (ends at 8496), S at 12288.
    assert_eq!(data_len, 3 * EXTERNAL_DATA_ALIGNMENT + 2048);

    assert_eq!(load_model_with_data(&p).unwrap(), original);

    // Saving the inlined model again, to a fresh name, gives identical bytes.
    let p2 = dir.path().join("inline.onnx");
    save_model(&load_model_with_data(&p).unwrap(), &p2).unwrap();
    assert_eq!(fs::read(&p2).unwrap(), encode_model(&original));

    // Only the two outputs: no temporary files left behind.
    let mut names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["inline.onnx", "model.onnx", "model.onnx.data"]);
}

#[test]
fn save_with_external_data_rejects_bad_requests() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.onnx");
    save_model(&tiny_model(), &p).unwrap();
    let before = fs::read(&p).unwrap();
    for bad in [
        "",
        "../w.bin",
        "sub/w.bin",
        "/tmp/w.bin",
        "model.onnx",
        ".",
        "..",
    ] {
        let err = save_model_with_external_data(&tiny_model(), &p, bad, 0).unwrap_err();
        assert!(
            matches!(err, ModelError::InvalidSave { .. }),
            "{bad:?}: {err:?}"
        );
        assert_names_file(&err, &p);
    }
    // A model that still refers to external data must be inlined first.
    let mut m = tiny_model();
    m.graph.as_mut().unwrap().initializer[0] = external("W", "w.bin", None, None);
    let err = save_model_with_external_data(&m, &p, "w2.bin", 0).unwrap_err();
    assert!(matches!(err, ModelError::InvalidSave { .. }), "{err:?}");
    assert_eq!(
        fs::read(&p).unwrap(),
        before,
        "a failed save touched the file"
    );
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn save_is_atomic_and_errors_leave_things_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.onnx");
    let m = tiny_model();
    save_model(&m, &p).unwrap();
    assert_eq!(fs::read(&p).unwrap(), encode_model(&m));
    // Overwriting replaces the file wholesale.
    let mut m2 = m.clone();
    m2.producer_name = Some("second".into());
    save_model(&m2, &p).unwrap();
    assert_eq!(load_model(&p).unwrap(), m2);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o644
        );
    }
    // Errors: missing folder, a folder as target.
    let missing = dir.path().join("no/such/dir/model.onnx");
    let err = save_model(&m, &missing).unwrap_err();
    assert!(matches!(err, ModelError::Write { .. }), "{err:?}");
    assert_names_file(&err, &missing);
    let sub = dir.path().join("sub");
    fs::create_dir(&sub).unwrap();
    let err = save_model(&m, &sub).unwrap_err();
    assert!(matches!(err, ModelError::Write { .. }), "{err:?}");
    assert!(sub.is_dir());
    assert_eq!(load_model(&p).unwrap(), m2);
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "temporary files left: {names:?}");
}

#[test]
fn same_file_detects_aliases() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.onnx", b"x");
    let b = write(dir.path(), "b.onnx", b"x");
    assert!(same_file(&a, &a));
    assert!(same_file(&a, &dir.path().join(".").join("a.onnx")));
    assert!(!same_file(&a, &b));
    assert!(!same_file(&a, &dir.path().join("missing.onnx")));
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&a, dir.path().join("link.onnx")).unwrap();
        assert!(same_file(&a, &dir.path().join("link.onnx")));
        fs::hard_link(&a, dir.path().join("hard.onnx")).unwrap();
        assert!(same_file(&a, &dir.path().join("hard.onnx")));
    }
}

/// Protobuf's 2 GiB limit on one message: a model at it parses, one byte more is refused
/// with the reason and what avoids it, before an engine is handed bytes it cannot parse.
#[test]
fn a_model_over_protobufs_limit_is_refused_with_the_reason() {
    use onnx_ga::model::{too_large_to_parse, MAX_MODEL_FILE_BYTES};
    assert_eq!(MAX_MODEL_FILE_BYTES, (1usize << 31) - 1);
    assert_eq!(too_large_to_parse(MAX_MODEL_FILE_BYTES), None);
    let message = too_large_to_parse(MAX_MODEL_FILE_BYTES + 1).unwrap();
    assert!(message.contains("2147483648 bytes"), "{message}");
    assert!(message.contains("--no-split"), "{message}");
    let small = onnx_ga::model::load_model(
        &crate::common::root().join("graphs/mlp_ce_adamw/training_model.onnx"),
    )
    .unwrap();
    assert!(!onnx_ga::model::over_file_limit(&small));
}
