//! Every checked-in generated file is what its generator writes today: the generator runs
//! (with `.venv-ort`'s onnx, the version the file's header names) and its output must equal
//! the file byte for byte. A stale table fails here instead of validating against
//! schemas nobody has.

use crate::common;

use std::process::Command;

use crate::common::root;

/// (generator under scripts/, the file it writes).
const GENERATED: &[(&str, &str)] = &[
    ("op-schema.py", "src/validate/op_schema.rs"),
    ("precision-schema.py", "src/passes/precision/schema.rs"),
];

#[test]
fn generated_files_are_fresh() {
    let Some(python) = common::python() else {
        return;
    };
    let mut stale = Vec::new();
    for (script, file) in GENERATED {
        let out = Command::new(&python)
            .arg(root().join("scripts").join(script))
            .current_dir(root())
            .output()
            .unwrap_or_else(|e| panic!("running {script}: {e}"));
        assert!(
            out.status.success(),
            "{script} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let checked_in = std::fs::read(root().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        if out.stdout != checked_in {
            stale.push(format!(
                "{file} is stale: regenerate with `.venv-ort/bin/python scripts/{script} > {file}`"
            ));
        }
    }
    assert!(stale.is_empty(), "{}", stale.join("\n"));
}
