//! Every graph the repository holds in `ir::print`'s form parses back with `ir::text` and
//! prints identically: the printer's dialect is a language the parser reads.
//!
//! The printed graphs are read at test time from every insta snapshot under tests/snapshots/
//! (so the check follows the snapshots as passes change): a printed model is the block that
//! `print::print_model` writes, from a line `<` followed by `  ir_version: N,` (two spaces:
//! the printer's indent; onnx.printer's three-space header in a file case's input is not
//! ours) down to the first line `}` (the main graph's closing brace; a branch's closes
//! indented). The file tests' outputs (tests/cases/**/*.onnxtxt) are in their snapshots,
//! `file_cases__<dir>__<name>.snap`, after the case text; a test below checks that every
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
    let strip = |t: &str| {
        t.lines()
            .map(|l| l.split("  # ").next().unwrap().to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    if strip(&again) == strip(printed) {
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
            "file_cases__{}.snap",
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
