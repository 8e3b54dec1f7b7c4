//! Never lose data: `rewrite` and `train` as a user runs them (the built binary), with
//! outputs that name their inputs, outputs that cannot be written, NaN and inf in the data,
//! and a run killed with SIGKILL. Every refusal exits with 2, names the file, changes no
//! input byte and creates no output.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::root;
use onnx_ga::data::Tensor;

fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .expect("run onnx-ga")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every file under `dir` (recursively, symlinks not followed) with its bytes, or its link
/// target for a symlink.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_symlink() {
                let target = std::fs::read_link(&p).unwrap();
                files.insert(p, target.to_string_lossy().as_bytes().to_vec());
            } else if meta.is_dir() {
                files.insert(p.clone(), b"<dir>".to_vec());
                todo.push(p);
            } else {
                files.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    files
}

/// Runs `args`, expecting a refusal: exit code 2, no panic, stderr naming each of `names`,
/// and nothing under `dir` created, removed or changed.
fn refused(dir: &Path, args: &[&str], names: &[&str]) -> String {
    let before = snapshot(dir);
    let out = onnx_ga(args);
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: exit code; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for name in names {
        assert!(
            err.contains(name),
            "{args:?}: stderr should name {name:?}: {err}"
        );
    }
    let after = snapshot(dir);
    assert!(
        before == after,
        "{args:?}: files changed: {:?}",
        before
            .keys()
            .chain(after.keys())
            .filter(|k| before.get(*k) != after.get(*k))
            .collect::<Vec<_>>()
    );
    err
}

/// A copy of graphs/mlp_ce_adamw (training, optimizer and eval models, checkpoint) in `dir`.
fn artifacts(dir: &Path) -> PathBuf {
    let art = dir.join("art");
    std::fs::create_dir(&art).unwrap();
    for e in std::fs::read_dir(root().join("graphs/mlp_ce_adamw"))
        .unwrap()
        .flatten()
    {
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), art.join(e.file_name())).unwrap();
        }
    }
    art
}

/// graphs/mlp_ce_adamw rewritten with K=4 (and `extra` flags) to `dir/name`.
fn rewritten(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    crate::common::cli_rewritten(dir, name, extra)
}

fn shipped_data() -> PathBuf {
    root().join("graphs/mlp_ce_adamw/data.npz")
}

/// The shipped data with `value` at row `row`, column 2 of `input`.
fn poisoned_data(dir: &Path, name: &str, row: usize, value: f32) -> PathBuf {
    let mut data = onnx_ga::data::read_npz(&shipped_data()).unwrap();
    let Some(Tensor::F32(x)) = data.get_mut("input") else {
        panic!("input")
    };
    x[[row, 2]] = value;
    let path = dir.join(name);
    onnx_ga::data::write_npz(&path, data.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    path
}

fn train_args<'a>(
    step: &'a Path,
    data: &'a Path,
    steps: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    // Not --quiet: the tests read train's notes (discarded micro-steps, resuming) and summary.
    common::cli_train(step, data, steps, extra)
}

fn metrics_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

fn all_finite(state: &BTreeMap<String, Tensor>) -> bool {
    state.values().all(|t| match t {
        Tensor::F32(a) => a.iter().all(|v| v.is_finite()),
        _ => true,
    })
}

// ---------------------------------------------------------------------------------------
// rewrite: outputs that are inputs
// ---------------------------------------------------------------------------------------

/// `-o` naming any file of the artifacts folder it reads (directly, through `..`, a
/// symlink or a hard link), or a `--split` output that is one: refused, nothing written.
#[test]
fn rewrite_never_overwrites_its_artifacts() {
    let dir = tempfile::tempdir().unwrap();
    let art = artifacts(dir.path());
    let a = s(&art);
    std::os::unix::fs::symlink(
        art.join("optimizer_model.onnx"),
        dir.path().join("link.onnx"),
    )
    .unwrap();
    std::fs::hard_link(art.join("checkpoint"), dir.path().join("hard")).unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let dotdot = dir.path().join("sub/../art/training_model.onnx");
    let link = dir.path().join("link.onnx");
    let hard = dir.path().join("hard");
    let cases: Vec<(PathBuf, &str)> = vec![
        (art.join("training_model.onnx"), "the input model"),
        (art.join("checkpoint"), "the input checkpoint"),
        (
            art.join("optimizer_model.onnx"),
            "the input optimizer model",
        ),
        (art.join("eval_model.onnx"), "the input eval model"),
        (dotdot, "the input model"),
        (link, "the input optimizer model"),
        (hard, "the input checkpoint"),
    ];
    for (out, what) in &cases {
        let err = refused(
            dir.path(),
            &["rewrite", a, "-o", s(out), "--accum-steps", "4"],
            &[s(out), what, "refusing to overwrite"],
        );
        eprintln!("{err}");
    }
    // --split: OUT.accumulate.onnx / OUT.apply.onnx are outputs too.
    for branch in ["accumulate", "apply"] {
        let out = dir.path().join(format!("step-{branch}.onnx"));
        let special = dir.path().join(format!("step-{branch}.{branch}.onnx"));
        std::os::unix::fs::symlink(art.join("training_model.onnx"), &special).unwrap();
        refused(
            dir.path(),
            &["rewrite", a, "-o", s(&out), "--split"],
            &[s(&special), "the input model"],
        );
        std::fs::remove_file(&special).unwrap();
    }
    // A new file in the artifacts folder is fine (and may be replaced by the next rewrite).
    let step = art.join("step.onnx");
    for _ in 0..2 {
        let out = onnx_ga(&[
            "rewrite",
            a,
            "-o",
            s(&step),
            "--accum-steps",
            "4",
            "--lr",
            "0.1",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

/// A model whose initializers live in an external data file: `-o` naming that file is
/// refused like the model itself.
#[test]
fn rewrite_never_overwrites_external_data() {
    let dir = tempfile::tempdir().unwrap();
    let art = artifacts(dir.path());
    let training = art.join("training_model.onnx");
    let mut model = onnx_ga::model::load_model_with_data(&training).unwrap();
    for init in &mut model.graph.as_mut().unwrap().initializer {
        if let Ok(t) = Tensor::from_tensor_proto(init) {
            *init = t.to_tensor_proto(init.name());
        }
    }
    // ONNX Runtime's training model keeps its parameters in the checkpoint: its few
    // initializers (as raw data) go out with a threshold of one byte.
    onnx_ga::model::save_model_with_external_data(&model, &training, "weights.bin", 1).unwrap();
    let data = art.join("weights.bin");
    let saved = onnx_ga::model::load_model(&training).unwrap();
    assert!(onnx_ga::model::has_external_data(&saved));
    // A step keeps its parameters as initializers.
    let step = rewritten(dir.path(), "step.onnx", &[]);
    let step = onnx_ga::model::load_model_with_data(&step).unwrap();
    let file_input = art.join("copy.onnx");
    onnx_ga::model::save_model_with_external_data(&step, &file_input, "copy.bin", 256).unwrap();
    refused(
        dir.path(),
        &["rewrite", s(&art), "-o", s(&data)],
        &[s(&data), "external data"],
    );
    let copy_data = art.join("copy.bin");
    refused(
        dir.path(),
        &[
            "rewrite",
            s(&file_input),
            "-o",
            s(&copy_data),
            "--loss",
            "x",
        ],
        &[s(&copy_data), "external data"],
    );
}

/// `rewrite --external-data` writes the step's initializers to OUT.data: a step equal to
/// the one-file step once its data is read back, which trains bit for bit as it does. A
/// forward model that keeps its weights in external data gives a step that does too,
/// unasked; and OUT.data naming the input's data file is refused like OUT itself.
#[test]
fn rewrite_writes_external_data_when_asked_or_when_its_input_has_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let forward = root().join("graphs/forward/torch_mlp");
    let data = forward.join("data.npz");
    let rewrite = |model: &Path, out: &Path, extra: &[&str]| {
        let mut args = vec![
            "rewrite",
            s(model),
            "-o",
            s(out),
            "--loss-fn",
            "cross-entropy",
            "--optimizer",
            "adamw",
            "--accum-steps",
            "4",
        ];
        args.extend(extra);
        args.iter().map(|a| a.to_string()).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = onnx_ga(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stderr(&out)
    };
    let model = forward.join("dynamo.onnx");
    let (inline, external) = (d.join("inline.onnx"), d.join("ext.onnx"));
    run(rewrite(&model, &inline, &[]));
    let err = run(rewrite(&model, &external, &["--external-data"]));
    assert!(err.contains("its initializers in "), "{err}");
    assert!(d.join("ext.onnx.data").is_file());
    assert!(onnx_ga::model::has_external_data(
        &onnx_ga::model::load_model(&external).unwrap()
    ));
    assert!(
        onnx_ga::model::load_model_with_data(&external).unwrap()
            == onnx_ga::model::load_model(&inline).unwrap(),
        "the step with its data read back differs from the one-file step"
    );
    let mut states = Vec::new();
    for step in [&inline, &external] {
        let state = step.with_extension("npz");
        run(train_args(step, &data, "8", &["--save-state", s(&state)])
            .iter()
            .map(|a| a.to_string())
            .collect());
        states.push(common::read_npz(&state));
    }
    assert!(states[0] == states[1], "the two steps trained apart");

    // The input's weights in external data: so are the step's.
    let with_data = d.join("fwd.onnx");
    let proto = onnx_ga::model::load_model(&model).unwrap();
    onnx_ga::model::save_model_with_external_data(&proto, &with_data, "fwd.bin", 1).unwrap();
    let auto = d.join("auto.onnx");
    run(rewrite(&with_data, &auto, &[]));
    assert!(d.join("auto.onnx.data").is_file());

    // OUT.data is the input's data file.
    let clash = d.join("clash.onnx");
    onnx_ga::model::save_model_with_external_data(&proto, &clash, "step.onnx.data", 1).unwrap();
    let args = rewrite(&clash, &d.join("step.onnx"), &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    refused(d, &args, &["step.onnx.data", "external data"]);
}

// ---------------------------------------------------------------------------------------
// train: outputs that are inputs
// ---------------------------------------------------------------------------------------

/// `--metrics` or `--save-state` naming the model, the data or the initial state (also
/// through a symlink, `..` or a hard link), or each other: refused before training.
/// `--init-state S --save-state S` is a resume and trains.
#[test]
fn train_never_overwrites_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let data = d.join("data.npz");
    std::fs::copy(shipped_data(), &data).unwrap();
    let init = d.join("init.npz");
    let out = onnx_ga(&train_args(&step, &data, "4", &["--save-state", s(&init)]));
    assert!(out.status.success(), "{}", stderr(&out));
    std::os::unix::fs::symlink(&data, d.join("data-link.npz")).unwrap();
    std::fs::hard_link(&step, d.join("step-hard.onnx")).unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    let data_dotdot = d.join("sub/../data.npz");
    let data_link = d.join("data-link.npz");
    let step_hard = d.join("step-hard.onnx");
    let cases: Vec<(&str, &Path, &str)> = vec![
        ("--metrics", &step, "the model"),
        ("--metrics", &data, "the data"),
        ("--metrics", &init, "the initial state"),
        ("--metrics", &data_link, "the data"),
        ("--save-state", &step, "the model"),
        ("--save-state", &step_hard, "the model"),
        ("--save-state", &data, "the data"),
        ("--save-state", &data_dotdot, "the data"),
    ];
    for (flag, path, what) in cases {
        refused(
            d,
            &train_args(
                &step,
                &data,
                "4",
                &["--init-state", s(&init), flag, s(path)],
            ),
            &[s(path), what, flag, "refusing to overwrite"],
        );
    }
    let same = d.join("out.npz");
    refused(
        d,
        &train_args(
            &step,
            &data,
            "4",
            &["--metrics", s(&same), "--save-state", s(&same)],
        ),
        &[s(&same), "--save-state"],
    );
    // The resume: reads S, trains, writes S.
    let before = std::fs::read(&init).unwrap();
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "4",
        &["--init-state", s(&init), "--save-state", s(&init)],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_ne!(
        std::fs::read(&init).unwrap(),
        before,
        "the resumed state was saved"
    );
}

// ---------------------------------------------------------------------------------------
// Outputs checked before the work
// ---------------------------------------------------------------------------------------

/// A missing folder, a folder, or a folder that cannot be written, as `--metrics` or
/// `--save-state`: exit 2 before training, and no other output left behind.
#[test]
fn train_outputs_are_checked_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let data = shipped_data();
    let ok = d.join("m.jsonl");
    let nodir = d.join("nodir/s.npz");
    refused(
        d,
        &train_args(
            &step,
            &data,
            "4",
            &["--metrics", s(&ok), "--save-state", s(&nodir)],
        ),
        &[s(&nodir), "does not exist"],
    );
    assert!(!ok.exists(), "m.jsonl left behind");
    let folder = d.join("folder");
    std::fs::create_dir(&folder).unwrap();
    refused(
        d,
        &train_args(&step, &data, "4", &["--save-state", s(&folder)]),
        &[s(&folder), "is a directory"],
    );
    refused(
        d,
        &train_args(&step, &data, "4", &["--metrics", s(&folder)]),
        &[s(&folder), "is a directory"],
    );
    refused(
        d,
        &train_args(
            &step,
            &data,
            "4",
            &["--save-every", "0", "--save-state", s(&ok)],
        ),
        &["--save-every 0"],
    );
    // --save-every needs somewhere to save.
    let out = onnx_ga(&train_args(&step, &data, "4", &["--save-every", "1"]));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    // A folder without write permission (meaningless as root, who may write anyway).
    use std::os::unix::fs::PermissionsExt;
    let locked = d.join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o555)).unwrap();
    let probe = locked.join("probe");
    if std::fs::write(&probe, b"x").is_ok() {
        std::fs::remove_file(&probe).unwrap();
        eprintln!("SKIPPED the read-only folder case: this user writes anywhere (root)");
    } else {
        let state = locked.join("s.npz");
        refused(
            d,
            &train_args(
                &step,
                &data,
                "4",
                &["--metrics", s(&ok), "--save-state", s(&state)],
            ),
            &[s(&state), "cannot write"],
        );
        assert!(!ok.exists());
    }
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// `rewrite` checks its outputs before the rewrite, and `--split` writes its three files
/// all or none: a folder in place of the second or the third leaves neither of the others.
#[test]
fn rewrite_outputs_are_checked_and_split_writes_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let graph = root().join("graphs/mlp_ce_adamw");
    let g = s(&graph);
    let nodir = d.join("nodir/step.onnx");
    refused(
        d,
        &["rewrite", g, "-o", s(&nodir)],
        &[s(&nodir), "does not exist"],
    );
    for branch in ["accumulate", "apply"] {
        let out = d.join("step.onnx");
        let blocker = d.join(format!("step.{branch}.onnx"));
        std::fs::create_dir(&blocker).unwrap();
        refused(
            d,
            &["rewrite", g, "-o", s(&out), "--split"],
            &[s(&blocker), "is a directory"],
        );
        std::fs::remove_dir(&blocker).unwrap();
    }
    // And with nothing in the way, the three files and only them.
    let out = d.join("step.onnx");
    let o = onnx_ga(&["rewrite", g, "-o", s(&out), "--split", "--lr", "0.1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let names: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(
        names,
        ["step.accumulate.onnx", "step.apply.onnx", "step.onnx"]
    );
}

/// State, progress and metrics files get the permissions of any file this process creates
/// (the umask), not a temporary file's 0600.
#[test]
fn outputs_have_the_umask_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let state = d.join("s.npz");
    let metrics = d.join("m.jsonl");
    let out = onnx_ga(&train_args(
        &step,
        &shipped_data(),
        "8",
        &[
            "--save-state",
            s(&state),
            "--metrics",
            s(&metrics),
            "--save-every",
            "1",
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let plain = d.join("plain");
    std::fs::write(&plain, b"x").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for p in [&state, &metrics, &d.join("s.npz.progress.json"), &step] {
        assert_eq!(mode(p), mode(&plain), "{}", p.display());
    }
    assert_ne!(mode(&state), 0o600);
}

// ---------------------------------------------------------------------------------------
// NaN and inf in the data
// ---------------------------------------------------------------------------------------

/// By default a non-finite loss stops the run (exit 2) naming the micro-step, its data rows
/// and the row holding the value; the state file is not written (an existing one keeps its
/// bytes), the metrics hold the micro-steps before it. For NaN and for inf.
#[test]
fn nonfinite_data_stops_by_default_and_keeps_the_last_good_state() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    for (value, shown) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf")] {
        // Row 13: micro-step 2 takes rows 8-15.
        let data = poisoned_data(d, "poisoned.npz", 13, value);
        let state = d.join("s.npz");
        let metrics = d.join("m.jsonl");
        let _ = std::fs::remove_file(&state);
        let _ = std::fs::remove_file(d.join("s.npz.progress.json"));
        let out = onnx_ga(&train_args(
            &step,
            &data,
            "8",
            &["--save-state", s(&state), "--metrics", s(&metrics)],
        ));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        for part in [
            "micro-step 2",
            "data rows 8-15",
            "poisoned.npz",
            "'input' at data rows 13",
            "s.npz was not written",
            "--on-nonfinite skip",
        ] {
            assert!(err.contains(part), "{shown}: {part:?} missing: {err}");
        }
        assert!(!state.exists(), "{shown}: state written");
        let lines = metrics_lines(&metrics);
        assert_eq!(lines.len(), 1, "{shown}: the micro-step before it");
        assert!(lines[0]["loss"].is_number());

        // An existing state keeps its bytes.
        let clean = onnx_ga(&train_args(
            &step,
            &shipped_data(),
            "4",
            &["--save-state", s(&state)],
        ));
        assert!(clean.status.success(), "{}", stderr(&clean));
        let before = std::fs::read(&state).unwrap();
        let out = onnx_ga(&train_args(&step, &data, "8", &["--save-state", s(&state)]));
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert_eq!(
            std::fs::read(&state).unwrap(),
            before,
            "{shown}: state changed"
        );
    }
    // With checkpoints: the last one stays, and the error says where it is.
    let data = poisoned_data(d, "late.npz", 44, f32::NAN); // micro-step 6: rows 40-47
    let state = d.join("c.npz");
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "8",
        &["--save-state", s(&state), "--save-every", "1"],
    ));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("micro-step 6"), "{err}");
    assert!(err.contains("holds the state after micro-step 4"), "{err}");
    let saved = common::read_npz(&state);
    assert_eq!(
        saved["ga.opt_step"],
        Tensor::I64(ndarray::arr0(1).into_dyn())
    );
    assert!(all_finite(&saved));
}

/// `--on-nonfinite skip` discards the micro-step (reported in stderr, the metrics and the
/// summary) and trains on: exit 0, finite state, the window one micro-step longer, exactly
/// as if the micro-step had not been in the data; whether the step runs split or whole, on
/// ONNX Runtime and on tract.
#[test]
fn nonfinite_data_skip_discards_the_micro_step() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let data = poisoned_data(d, "poisoned.npz", 13, f32::NAN);
    let state = d.join("s.npz");
    let metrics = d.join("m.jsonl");
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "9",
        &[
            "--save-state",
            s(&state),
            "--metrics",
            s(&metrics),
            "--on-nonfinite",
            "skip",
        ],
    ));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("micro-step 2: the loss is NaN; its update was discarded"),
        "{err}"
    );
    assert!(
        err.contains("discarded 1 micro-steps with a non-finite loss (2)"),
        "{err}"
    );
    let lines = metrics_lines(&metrics);
    assert_eq!(lines.len(), 9);
    assert_eq!(lines[1]["discarded"], true);
    assert_eq!(lines[1]["applied"], false);
    // Micro-steps 1, 3, 4, 5 make the first window, 6-9 the second.
    let applied: Vec<u64> = lines
        .iter()
        .filter(|l| l["applied"] == true)
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(applied, [5, 9]);
    let saved = common::read_npz(&state);
    assert!(all_finite(&saved));
    assert_eq!(
        saved["ga.opt_step"],
        Tensor::I64(ndarray::arr0(2).into_dyn())
    );

    // Discarding micro-step 2 (rows 8-15) equals never having run it: the same run on the
    // data of micro-steps 1, 3, ..., 9 (rows 0-7, 16-63, 0-7) in that order, bit for bit.
    let shipped = onnx_ga::data::read_npz(&shipped_data()).unwrap();
    let rows: Vec<usize> = (0..8).chain(16..64).chain(0..8).collect();
    let without: BTreeMap<String, Tensor> = shipped
        .iter()
        .map(|(k, v)| (k.clone(), v.rows(&rows)))
        .collect();
    let without_path = d.join("without.npz");
    onnx_ga::data::write_npz(&without_path, without.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    let mut engines = vec!["tract"];
    if common::ort_available() {
        engines.push("ort");
    }
    for engine in engines {
        for split in [&[][..], &["--no-split"][..]] {
            let what = format!("{engine} {split:?}");
            let run = |data: &Path, steps: &str, tag: &str, skip: bool| {
                let path = d.join(format!("s-{engine}-{}-{tag}.npz", split.len()));
                let mut extra = vec!["--engine", engine];
                if skip {
                    extra.extend_from_slice(&["--on-nonfinite", "skip"]);
                }
                extra.extend_from_slice(split);
                extra.extend_from_slice(&["--save-state", s(&path)]);
                let out = onnx_ga(&train_args(&step, data, steps, &extra));
                assert!(out.status.success(), "{what}: {}", stderr(&out));
                common::read_npz(&path)
            };
            let skipped = run(&data, "9", "skip", true);
            let reference = run(&without_path, "8", "without", false);
            assert!(all_finite(&skipped), "{what}");
            assert!(
                skipped == reference,
                "{what}: the discarded micro-step left a trace"
            );
        }
    }
}

/// `--flush` whose micro-step (the run's last) is discarded: one process cannot apply the
/// window without it, and says so; the window's sums stay in the saved state, finite, and a
/// resumed run continues the window as if the discarded micro-step had never run.
#[test]
fn a_discarded_flush_says_its_window_was_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    // Row 41: micro-step 6 (rows 40-47), the second window's second.
    let data = poisoned_data(d, "poisoned.npz", 41, f32::NAN);
    let state = d.join("s.npz");
    let extra = [
        "--on-nonfinite",
        "skip",
        "--flush",
        "--save-state",
        s(&state),
    ];
    let out = onnx_ga(&train_args(&step, &data, "6", &extra));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("micro-step 6, the run's last, was to apply the window in progress (--flush) and was discarded: that window was not applied"),
        "{err}"
    );
    let saved = common::read_npz(&state);
    assert!(all_finite(&saved));
    assert_eq!(
        saved["ga.opt_step"],
        Tensor::I64(ndarray::arr0(1).into_dyn())
    );
    assert_eq!(
        saved["ga.micro_step"],
        Tensor::I64(ndarray::arr0(1).into_dyn())
    );
    // Without --flush and without micro-step 6, the same state, bit for bit.
    let straight = d.join("straight.npz");
    let out = onnx_ga(&train_args(
        &step,
        &shipped_data(),
        "5",
        &["--save-state", s(&straight)],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        saved == common::read_npz(&straight),
        "the discarded flush left a trace"
    );
}

/// A state file holding NaN or inf in a parameter (made or edited elsewhere: `train` never
/// saves one) is refused by `train --init-state` (it stopped at micro-step 1 blaming the
/// data or the learning rate) and by `export` (it wrote a model computing NaN), with exit
/// code 2, the tensor named, and nothing written.
#[test]
fn a_non_finite_state_file_is_refused_by_train_and_export() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let good = d.join("good.npz");
    let out = onnx_ga(&train_args(
        &step,
        &shipped_data(),
        "4",
        &["--save-state", s(&good)],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let mut state = common::read_npz(&good);
    let Some(Tensor::F32(w)) = state.get_mut("fc2.weight") else {
        panic!("fc2.weight")
    };
    w[[1, 2]] = f32::INFINITY;
    w[[3, 4]] = f32::NAN;
    let bad = d.join("bad.npz");
    onnx_ga::data::write_npz(&bad, state.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    let saved = d.join("s.npz");
    let data = shipped_data();
    let args = train_args(
        &step,
        &data,
        "4",
        &["--init-state", s(&bad), "--save-state", s(&saved)],
    );
    refused(
        d,
        &args,
        &["--init-state", "bad.npz", "'fc2.weight' is not finite"],
    );
    let eval_model = root().join("graphs/mlp_ce_adamw/eval_model.onnx");
    let exported = d.join("trained.onnx");
    let args = [
        "export",
        s(&eval_model),
        "--state",
        s(&bad),
        "-o",
        s(&exported),
    ];
    refused(
        d,
        &args,
        &["'fc2.weight'", "bad.npz holds 2 NaN or infinite values"],
    );
}

/// With loss scaling the graph skips a poisoned window itself, on ONNX Runtime and on
/// tract: no stop, the skipped windows reported (metrics and summary), parameters finite.
#[test]
fn nonfinite_data_with_loss_scaling_is_skipped_on_every_engine() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(
        d,
        "step.onnx",
        &["--loss-scale", "dynamic", "--loss-scale-init", "1024"],
    );
    let mut engines = vec!["tract"];
    if common::ort_available() {
        engines.push("ort");
    }
    for engine in engines {
        for value in [f32::NAN, f32::INFINITY] {
            let what = format!("{engine} {value}");
            let data = poisoned_data(d, "poisoned.npz", 13, value);
            let state = d.join(format!("s-{engine}.npz"));
            let metrics = d.join(format!("m-{engine}.jsonl"));
            let out = onnx_ga(&train_args(
                &step,
                &data,
                "16",
                &[
                    "--engine",
                    engine,
                    "--save-state",
                    s(&state),
                    "--metrics",
                    s(&metrics),
                ],
            ));
            let err = stderr(&out);
            assert!(out.status.success(), "{what}: {err}");
            assert!(
                err.contains("loss scaling skipped 2 windows with non-finite values (ending at micro-steps 4, 12)"),
                "{what}: {err}"
            );
            let lines = metrics_lines(&metrics);
            let skipped: Vec<u64> = lines
                .iter()
                .filter(|l| l["skipped"] == true)
                .map(|l| l["step"].as_u64().unwrap())
                .collect();
            assert_eq!(skipped, [4, 12], "{what}");
            assert_eq!(lines[3]["scale"], 512.0, "{what}: backed off");
            let saved = common::read_npz(&state);
            assert!(all_finite(&saved), "{what}");
            assert_eq!(
                saved["ga.opt_step"],
                Tensor::I64(ndarray::arr0(2).into_dyn()),
                "{what}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Interrupted runs
// ---------------------------------------------------------------------------------------

/// A real process killed with SIGKILL after its first checkpoints: the metrics it wrote are
/// whole lines, at most one interval (one window of 4) beyond the checkpoint, and resuming
/// from the checkpoint (with the recorded --start-step, or reading it from the progress
/// file) gives the uninterrupted run's state and metrics bit for bit.
#[test]
fn killed_run_resumes_bit_for_bit() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let data = shipped_data();
    let state = d.join("s.npz");
    let metrics = d.join("m.jsonl");
    let progress = d.join("s.npz.progress.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(train_args(
            &step,
            &data,
            "1000000000",
            &[
                "--save-state",
                s(&state),
                "--metrics",
                s(&metrics),
                "--save-every",
                "1",
            ],
        ))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    loop {
        let recorded = std::fs::read_to_string(&progress)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["checkpoints"].as_array()?.last()?["micro_steps"].as_u64());
        if recorded.is_some_and(|m| m >= 8) {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before its checkpoints"
        );
        assert!(
            started.elapsed().as_secs() < 300,
            "no checkpoint after 300 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "{status:?}");

    // What was on disk at the kill.
    let lines = metrics_lines(&metrics);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"].as_u64(), Some(i as u64 + 1), "metrics line {i}");
    }
    let saved = common::read_npz(&state);
    let Tensor::I64(opt) = &saved["ga.opt_step"] else {
        panic!()
    };
    let at = 4 * opt.iter().next().copied().unwrap() as u64; // K = 4, every window applied
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&progress).unwrap()).unwrap();
    let recorded: Vec<u64> = record["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["micro_steps"].as_u64().unwrap())
        .collect();
    assert!(
        recorded.contains(&at),
        "state after {at}, records {recorded:?}"
    );
    assert!(
        lines.len() as u64 >= at && lines.len() as u64 - at <= 4,
        "lost more than one interval: {} metrics lines, checkpoint after {at}",
        lines.len()
    );
    eprintln!(
        "killed after {} micro-steps written, checkpoint after {at}, recorded {recorded:?}",
        lines.len()
    );

    // The uninterrupted run, to micro-step at + 10 (two windows and a half beyond).
    let total = at + 10;
    let reference_state = d.join("ref.npz");
    let reference_metrics = d.join("ref.jsonl");
    let out = onnx_ga(&train_args(
        &step,
        &data,
        &total.to_string(),
        &[
            "--save-state",
            s(&reference_state),
            "--metrics",
            s(&reference_metrics),
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    let reference = common::read_npz(&reference_state);

    // Resumed with the recorded start step, into other files.
    let explicit = d.join("explicit.npz");
    let start = at.to_string();
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "10",
        &[
            "--init-state",
            s(&state),
            "--start-step",
            &start,
            "--save-state",
            s(&explicit),
        ],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        common::read_npz(&explicit) == reference,
        "--start-step {at}: state differs"
    );

    // Resumed in place, the start step read from the progress file: state and metrics
    // files equal the uninterrupted run's.
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "10",
        &[
            "--init-state",
            s(&state),
            "--save-state",
            s(&state),
            "--metrics",
            s(&metrics),
        ],
    ));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!("resuming at micro-step {at}")),
        "{err}"
    );
    assert!(
        common::read_npz(&state) == reference,
        "resumed state differs"
    );
    assert_eq!(
        std::fs::read_to_string(&metrics).unwrap(),
        std::fs::read_to_string(&reference_metrics).unwrap(),
        "resumed metrics differ"
    );
}

/// FNV-1a (64 bits) over the state's bytes, in name order: name, element type (i32), dims
/// (u64 each), data, all little-endian; over single bytes (`words` false: the records
/// written before 2026-12-05) or over 64-bit little-endian words, the last one zero-padded.
/// Written here from the definition in `Checkpoint`'s docs, apart from the binary's own.
fn fnv_state_digest(state: &BTreeMap<String, Tensor>, words: bool) -> String {
    let mut bytes = Vec::new();
    for (name, t) in state {
        bytes.extend_from_slice(name.as_bytes());
        bytes.extend_from_slice(&t.elem_type().to_le_bytes());
        for d in t.shape() {
            bytes.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        match t {
            Tensor::F32(a) => a
                .iter()
                .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            Tensor::F64(a) => a
                .iter()
                .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            Tensor::I64(a) => a
                .iter()
                .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            Tensor::I32(a) => a
                .iter()
                .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            Tensor::Bool(a) => a.iter().for_each(|v| bytes.push(*v as u8)),
        }
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        h ^= x;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    if words {
        bytes.resize(bytes.len().next_multiple_of(8), 0);
        bytes
            .chunks_exact(8)
            .for_each(|w| eat(u64::from_le_bytes(w.try_into().unwrap())));
        format!("w:{h:016x}")
    } else {
        bytes.iter().for_each(|b| eat(u64::from(*b)));
        format!("{h:016x}")
    }
}

/// The progress record holds the word-wise digest of the state file it was written with
/// (as the definition gives it, computed here from the file), and a record written before
/// it, holding the byte-wise digest, still resumes: its start step is found.
#[test]
fn progress_records_recognise_their_state_by_its_digest_old_and_new() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let data = shipped_data();
    let state = d.join("s.safetensors");
    let progress = d.join("s.safetensors.progress.json");
    let out = onnx_ga(&train_args(&step, &data, "6", &["--save-state", s(&state)]));
    assert!(out.status.success(), "{}", stderr(&out));
    let saved = onnx_ga::data::read_state(&state).unwrap();
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&progress).unwrap()).unwrap();
    assert_eq!(record["checkpoints"][0]["micro_steps"], 6);
    assert_eq!(
        record["checkpoints"][0]["state_digest"],
        fnv_state_digest(&saved, true).as_str()
    );

    // The same record as an older onnx-ga wrote it.
    let old = serde_json::json!({
        "state": "s.safetensors",
        "checkpoints": [{"micro_steps": 6, "state_digest": fnv_state_digest(&saved, false)}],
    });
    std::fs::write(&progress, old.to_string()).unwrap();
    let resumed = d.join("resumed.safetensors");
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "2",
        &["--init-state", s(&state), "--save-state", s(&resumed)],
    ));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resuming at micro-step 6"), "{err}");
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.join("resumed.safetensors.progress.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(record["checkpoints"][0]["micro_steps"], 8);

    // One bit of the state changed: neither digest matches any more.
    let mut changed = saved.clone();
    let Some(Tensor::F32(p)) = changed.values_mut().find(|t| matches!(t, Tensor::F32(_))) else {
        panic!("no float state")
    };
    let first = p.iter_mut().next().unwrap();
    *first = f32::from_bits(first.to_bits() ^ 1);
    onnx_ga::data::write_state(&state, changed.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    refused(
        d,
        &train_args(&step, &data, "2", &["--init-state", s(&state)]),
        &["records no save of the state", "--start-step"],
    );
}

/// A progress record that belongs to another state is an error, not a wrong start step.
#[test]
fn progress_record_of_another_state_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let data = shipped_data();
    let a = d.join("a.npz");
    let b = d.join("b.npz");
    for (path, steps) in [(&a, "4"), (&b, "8")] {
        let out = onnx_ga(&train_args(&step, &data, steps, &["--save-state", s(path)]));
        assert!(out.status.success(), "{}", stderr(&out));
    }
    std::fs::copy(d.join("b.npz.progress.json"), d.join("a.npz.progress.json")).unwrap();
    refused(
        d,
        &train_args(&step, &data, "4", &["--init-state", s(&a)]),
        &[
            "a.npz.progress.json",
            "records no save of the state",
            "--start-step",
        ],
    );
    // --start-step given: the record is not consulted.
    let out = onnx_ga(&train_args(
        &step,
        &data,
        "4",
        &["--init-state", s(&a), "--start-step", "4"],
    ));
    assert!(out.status.success(), "{}", stderr(&out));
}

/// A data file with one damaged byte (an array's CRC-32 no longer matches, which `np.load`
/// refuses too): `train` stops before training with exit code 2, naming the file and the
/// array, and writes nothing.
#[test]
fn train_refuses_damaged_data() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let step = rewritten(d, "step.onnx", &[]);
    let mut bytes = std::fs::read(shipped_data()).unwrap();
    let entry = bytes
        .windows(9)
        .position(|w| w == b"input.npy")
        .expect("the input array");
    let magic = entry
        + bytes[entry..]
            .windows(6)
            .position(|w| w == b"\x93NUMPY")
            .unwrap();
    let header_len = u16::from_le_bytes([bytes[magic + 8], bytes[magic + 9]]) as usize;
    bytes[magic + 10 + header_len + 1] ^= 0x01;
    let data = d.join("data.npz");
    std::fs::write(&data, bytes).unwrap();
    let metrics = d.join("m.jsonl");
    refused(
        d,
        &train_args(&step, &data, "4", &["--metrics", s(&metrics)]),
        &[s(&data), "array 'input'", "CRC-32"],
    );
}
