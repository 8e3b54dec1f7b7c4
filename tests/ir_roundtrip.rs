//! Import into the IR and export back must reproduce the model exactly, for every model
//! in graphs/ and, when fetched (scripts/fetch-corpus.sh), the onnx backend-test corpus.

use std::path::{Path, PathBuf};

use onnx_ga::ir::Model;
use onnx_ga::proto::ModelProto;

fn onnx_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            onnx_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "onnx") {
            out.push(p);
        }
    }
}

fn check_ir_roundtrip(files: &[PathBuf]) -> Vec<String> {
    let mut failures = Vec::new();
    for path in files {
        let bytes = std::fs::read(path).unwrap();
        let Ok(proto) = <ModelProto as prost::Message>::decode(&bytes[..]) else {
            failures.push(format!("{}: does not decode", path.display()));
            continue;
        };
        let model = Model::from_proto(proto.clone());
        let back = model.to_proto();
        // Bytes, not structural equality: NaN attribute values never compare equal.
        if onnx_ga::model::encode_model(&back) != bytes {
            failures.push(format!(
                "{}: bytes differ after IR round trip",
                path.display()
            ));
        }
    }
    failures
}

#[test]
fn generated_graphs_roundtrip_through_the_ir() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    onnx_files(&root.join("graphs"), &mut files);
    assert!(
        files.len() >= 18,
        "expected the generated artifacts in graphs/, found {}",
        files.len()
    );
    let failures = check_ir_roundtrip(&files);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn corpus_roundtrips_through_the_ir() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    if !root.exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "corpus/ is missing under CI: run scripts/fetch-corpus.sh"
        );
        eprintln!("corpus/ not present: skipped (run scripts/fetch-corpus.sh)");
        return;
    }
    let mut files = Vec::new();
    onnx_files(&root, &mut files);
    assert!(
        files.len() > 100,
        "corpus/ holds only {} models",
        files.len()
    );
    let failures = check_ir_roundtrip(&files);
    eprintln!(
        "IR round trip over {} corpus models, {} failures",
        files.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
