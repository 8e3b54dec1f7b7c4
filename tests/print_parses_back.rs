//! Every graph the repository holds in `ir::print`'s form parses back with `ir::text` and
//! prints identically: the printer's dialect is a language the parser reads.
//!
//! The printed graphs are read at test time from every insta snapshot under tests/snapshots/
//! (so the check follows the snapshots as passes change): a printed model is the block that
//! `print::print_model` writes, from a line `<` followed by `  ir_version: N,` (two spaces:
//! the printer's indent; onnx.printer's three-space header in a file case's input is not
//! ours) down to the first line `}` (the main graph's closing brace; a branch's closes
//! indented). The file tests' outputs (tests/cases/**/*.onnxtxt) are in their snapshots,
//! `suite__file_cases__<dir>__<name>.snap`, after the case text; a test below checks that every
//! case that does not expect an error has one.
//!
//! Each block is parsed with `text::parse_printed`, imported (`Model::from_proto`) and
//! printed again; the two texts must be equal. Equality is of text, not of protos: what the
//! printer does not show cannot come back and is not compared (node names, value infos, doc
//! strings, the header beyond ir_version and opset_import, which field held a tensor's values,
//! a missing shape versus a scalar's empty one). An initializer the printer elided (more than
//! 8 elements, or a type whose values it does not show) is read as zeros of its declared type
//! and shape, which print elided again: the text round-trips, the values do not.

use std::path::{Path, PathBuf};

use onnx_ga::ir::{print::print_model, text, Model};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The printed models in `text`, in order.
fn printed_models(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut models = Vec::new();
    let mut i = 0;
    while i + 1 < lines.len() {
        let opens = lines[i] == "<"
            && lines[i + 1].starts_with("  ir_version: ")
            && !lines[i + 1].starts_with("   ");
        if !opens {
            i += 1;
            continue;
        }
        let end = (i..lines.len())
            .find(|j| lines[*j] == "}")
            .unwrap_or_else(|| panic!("a printed model from line {} never closes", i + 1));
        let mut model = lines[i..=end].join("\n");
        model.push('\n');
        models.push(model);
        i = end + 1;
    }
    models
}

/// Every snapshot file, sorted.
fn snapshots() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("tests/snapshots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("snap"))
        .collect();
    files.sort();
    files
}

/// Parses, imports and prints `printed` again; `Err` says where it differs or why it failed.
fn round_trip(printed: &str) -> Result<(), String> {
    let proto = text::parse_printed(printed).map_err(|e| {
        let line = printed.lines().nth(e.line.saturating_sub(1)).unwrap_or("");
        format!("parse error {e}\n    at: {line}")
    })?;
    let again = print_model(&Model::from_proto(proto));
    if again == printed {
        return Ok(());
    }
    let (line, (a, b)) = printed
        .lines()
        .zip(again.lines())
        .enumerate()
        .find(|(_, (a, b))| a != b)
        .map(|(i, pair)| (i + 1, pair))
        .unwrap_or((
            printed.lines().count().min(again.lines().count()) + 1,
            ("(end)", "(end)"),
        ));
    Err(format!(
        "printed again differs at line {line}\n    was: {a}\n    now: {b}"
    ))
}

#[test]
fn every_printed_graph_parses_back_and_prints_identically() {
    let mut total = 0;
    let mut failures = Vec::new();
    for path in snapshots() {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for (k, printed) in printed_models(&text).iter().enumerate() {
            total += 1;
            if let Err(e) = round_trip(printed) {
                failures.push(format!("{name} (graph {}): {e}", k + 1));
            }
        }
    }
    eprintln!(
        "{} of {total} printed graphs parse back and print identically",
        total - failures.len()
    );
    // The snapshots hold well over a hundred printed graphs; far fewer means the extraction
    // above no longer recognises the printer's output.
    assert!(total >= 150, "only {total} printed graphs found");
    assert!(
        failures.is_empty(),
        "{} of {total} printed graphs do not round-trip:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Each file case that runs to a result has its printed output in its snapshot.
#[test]
fn every_file_case_output_is_checked() {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().and_then(|e| e.to_str()) == Some("onnxtxt") {
                out.push(path);
            }
        }
    }
    let cases_dir = root().join("tests/cases");
    let mut cases = Vec::new();
    walk(&cases_dir, &mut cases);
    assert!(!cases.is_empty());
    for case in cases {
        let relative = case.strip_prefix(&cases_dir).unwrap().with_extension("");
        let snap_name = format!(
            "suite__file_cases__{}.snap",
            relative.to_string_lossy().replace('/', "__")
        );
        let snap = root().join("tests/snapshots").join(&snap_name);
        let text =
            std::fs::read_to_string(&snap).unwrap_or_else(|e| panic!("{}: {e}", snap.display()));
        let source = std::fs::read_to_string(&case).unwrap();
        let expects_error = source
            .lines()
            .take_while(|l| l.starts_with('#'))
            .any(|l| l.replace(' ', "") == "#expect:error");
        let outputs = printed_models(&text);
        if expects_error {
            assert!(
                outputs.is_empty(),
                "{snap_name}: an error case with a graph"
            );
        } else {
            assert_eq!(outputs.len(), 1, "{snap_name}: one printed output expected");
        }
    }
}

/// What the printer can write that no snapshot holds yet (loops, lists of graphs and tensors,
/// strings that need escapes, 16-bit floats, bools both ways, elided values of every kind,
/// values without a type, odd names): one model that has it all round-trips too.
#[test]
fn the_printers_rarer_forms_round_trip() {
    use onnx_ga::proto::attribute_proto::AttributeType;
    use onnx_ga::proto::tensor_proto::DataType;
    use onnx_ga::proto::{AttributeProto, TensorProto};

    let source = r#"<ir_version: 9, opset_import: ["" : 17, "com.example" : 1]>
rare (float[N,?,3] x, int64 trip, bool cond, seq(float[2]) s, optional(int64[3]) o,
      map(int64, float) m, float[] any_rank, float16[2] h, bool[2] flags) => (float[N,?,3] y, float[2] z, float ::odd/name:1) {
  y, scan_out = Loop (trip, cond, x) <
    body = loop_body (int64 i, bool c, float[N,?,3] acc) => (bool c_out, float[N,?,3] acc_out, float[N,?,3] scanned) {
      c_out = Identity (c)
      acc_out = Add (acc, acc)
      scanned = Identity (acc)
    }
  >
  z = com.example.Strings <s = "quote \" backslash \\ tab	newline
end é", strings = ["a", "\\", "\""], empty: ints = [], nan = nan, pos = inf, neg = -inf, max = 3.4028235e38, tiny = 1e-45, whole: float = 2, ref: int = @outer> (x, "", trip)
  ::odd/name:1 = Identity (x)
}"#;
    let mut proto = text::parse_model(source).unwrap_or_else(|e| panic!("{e}"));
    let graph = proto.graph.as_mut().unwrap();
    let t = |name: &str, data_type: DataType, dims: &[i64]| TensorProto {
        name: Some(name.into()),
        data_type: Some(data_type as i32),
        dims: dims.to_vec(),
        ..Default::default()
    };
    let f16 = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|f| half::f16::from_f32(*f).to_le_bytes())
            .collect()
    };
    let bf16 = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|f| half::bf16::from_f32(*f).to_le_bytes())
            .collect()
    };
    graph.initializer = vec![
        // Shown: raw 16-bit floats, raw bools, typed bools, raw doubles and int32s.
        TensorProto {
            raw_data: Some(f16(&[1.5, -0.0])),
            ..t("h", DataType::Float16, &[2])
        },
        TensorProto {
            raw_data: Some(bf16(&[3.0, f32::INFINITY, 0.1])),
            ..t("b16", DataType::Bfloat16, &[3])
        },
        TensorProto {
            raw_data: Some(vec![1, 0]),
            ..t("flags", DataType::Bool, &[2])
        },
        TensorProto {
            int32_data: vec![0, 1],
            ..t("flags_typed", DataType::Bool, &[2])
        },
        TensorProto {
            raw_data: Some(0.1f64.to_le_bytes().to_vec()),
            ..t("d", DataType::Double, &[])
        },
        TensorProto {
            raw_data: Some([-7i32, 9].iter().flat_map(|i| i.to_le_bytes()).collect()),
            ..t("i32", DataType::Int32, &[2])
        },
        TensorProto {
            float_data: vec![f32::NAN, f32::NEG_INFINITY, f32::MAX, -0.0],
            ..t("specials", DataType::Float, &[4])
        },
        TensorProto {
            float_data: vec![],
            ..t("empty", DataType::Float, &[0, 3])
        },
        // Elided: more than 8 elements, or a type whose values the printer does not show.
        TensorProto {
            float_data: vec![0.5; 12],
            ..t("big", DataType::Float, &[3, 4])
        },
        TensorProto {
            int32_data: vec![1, 2],
            ..t("u8", DataType::Uint8, &[2])
        },
        TensorProto {
            int32_data: vec![15360],
            ..t("h_typed", DataType::Float16, &[1])
        },
        TensorProto {
            string_data: vec![b"x".to_vec()],
            ..t("strs", DataType::String, &[1])
        },
        TensorProto {
            raw_data: Some(vec![0; 8]),
            ..t("c64", DataType::Complex64, &[1])
        },
    ];
    // A value without a type.
    graph.input.push(onnx_ga::proto::ValueInfoProto {
        name: Some("untyped".into()),
        ..Default::default()
    });
    // A list of graphs and a list of tensors, which ONNX text cannot state.
    let body = graph.node[0].attribute[0].g.clone().unwrap();
    let strings = &mut graph.node[1];
    strings.attribute.push(AttributeProto {
        name: Some("bodies".into()),
        r#type: Some(AttributeType::Graphs as i32),
        graphs: vec![body.clone(), body],
        ..Default::default()
    });
    strings.attribute.push(AttributeProto {
        name: Some("tensors".into()),
        r#type: Some(AttributeType::Tensors as i32),
        tensors: vec![
            TensorProto {
                float_data: vec![1.0, 2.0],
                ..t("", DataType::Float, &[2])
            },
            TensorProto {
                int64_data: vec![0; 9],
                ..t("", DataType::Int64, &[9])
            },
        ],
        ..Default::default()
    });
    strings.attribute.push(AttributeProto {
        name: Some("big_tensor".into()),
        r#type: Some(AttributeType::Tensor as i32),
        t: Some(TensorProto {
            float_data: vec![1.0; 10],
            ..t("", DataType::Float, &[10])
        }),
        ..Default::default()
    });
    // An unnamed subgraph.
    graph.node[0].attribute[0].g.as_mut().unwrap().name = Some(String::new());

    let printed = print_model(&Model::from_proto(proto));
    for form in [
        "<body = ",
        "bodies[1] = ",
        "tensors = [float[2] = {1.0, 2.0}, int64[9]]",
        "big_tensor = float[10]",
        r#"s = "quote \" backslash \\ tab\tnewline\nend é""#,
        "float16[2] h = {1.5, -0.0}",
        "bfloat16[3] b16 = {3.0, inf, 0.100097656}",
        "bool[2] flags = {true, false}",
        "bool[2] flags_typed = {0, 1}",
        "float[4] specials = {NaN, -inf, 3.4028235e38, -0.0}",
        "float[3,4] big,",
        "uint8[2] u8,",
        "? untyped",
        "empty = []",
        "ref = @outer",
        "(x, \"\", trip)",
    ] {
        if form == "<body = " {
            assert!(!printed.contains(form), "branches print after the node");
        } else {
            assert!(printed.contains(form), "{form} not in\n{printed}");
        }
    }
    round_trip(&printed).unwrap_or_else(|e| panic!("{e}\n{printed}"));
}
