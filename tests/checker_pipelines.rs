//! Every step `onnx-ga rewrite` writes passes `onnx.checker.check_model(full_check=True)`
//! (onnx 1.23.2 from `.venv-ort`): every shipped graph and every forward model
//! (`--loss-fn cross-entropy`), for each pipeline the CLI builds (default, a window of 4,
//! AGC, dynamic loss scaling, fp16, `--split` and its two files, `--apply where`,
//! `--engine tract`). One Python process checks them all.

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use crate::common::root;

const PIPELINES: &[(&str, &[&str])] = &[
    ("default", &[]),
    ("accum4", &["--accum-steps", "4"]),
    ("agc", &["--accum-steps", "4", "--agc", "0.01"]),
    ("scale", &["--accum-steps", "4", "--loss-scale", "dynamic"]),
    ("fp16", &["--accum-steps", "4", "--precision", "fp16"]),
    ("split", &["--accum-steps", "4", "--split"]),
    ("where", &["--accum-steps", "4", "--apply", "where"]),
    ("tract", &["--accum-steps", "4", "--engine", "tract"]),
];

const CHECK: &str = r#"
import sys, onnx
bad = 0
for path in sys.argv[1:]:
    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:
        bad += 1
        print("FAIL", path, str(e).splitlines()[0][:400])
print("checked", len(sys.argv) - 1, "failed", bad)
sys.exit(1 if bad else 0)
"#;

#[test]
fn every_written_step_passes_the_onnx_checker() {
    let Some(python) = common::python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut sources: Vec<(String, PathBuf, Vec<&str>)> = common::SHIPPED_GRAPHS
        .iter()
        .map(|g| (g.to_string(), root().join("graphs").join(g), vec![]))
        .collect();
    for entry in std::fs::read_dir(root().join("graphs/forward")).unwrap() {
        let path = entry.unwrap().path().join("dynamo.onnx");
        if path.is_file() {
            let name = path.parent().unwrap().file_name().unwrap();
            let loss = if common::computes_own_loss(&path) {
                vec!["--loss", "loss"]
            } else {
                vec!["--loss-fn", "cross-entropy"]
            };
            sources.push((
                name.to_string_lossy().into_owned(),
                path,
                [loss, vec!["--optimizer", "adamw"]].concat(),
            ));
        }
    }
    sources.sort();
    assert!(sources.len() >= 12, "{} sources", sources.len());
    let mut files = Vec::new();
    for (name, path, extra) in &sources {
        for (pipeline, flags) in PIPELINES {
            if name.ends_with("_half") && *pipeline == "fp16" {
                // Already half: `--precision` converts float32 models, and says so.
                continue;
            }
            let out_path = dir.path().join(format!("{name}.{pipeline}.onnx"));
            let out = Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
                .arg("rewrite")
                .arg(path)
                .arg("-o")
                .arg(&out_path)
                .args(["--lr", "0.01"])
                .args(extra)
                .args(*flags)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "rewrite {name} {pipeline}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            files.push(out_path.clone());
            if *pipeline == "split" {
                for branch in ["accumulate", "apply"] {
                    let f = out_path.with_extension(format!("{branch}.onnx"));
                    assert!(f.is_file(), "{}", f.display());
                    files.push(f);
                }
            }
        }
    }
    let out = Command::new(python)
        .arg("-c")
        .arg(CHECK)
        .args(&files)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "onnx.checker rejected written steps:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!("checked {} failed 0", files.len())));
}
