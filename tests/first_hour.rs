//! What a new user meets first (issue 15): `train`'s progress off a terminal and its summary,
//! `--quiet`, `plot` (PNG and SVG, non-finite losses, bad files), `train --plot`, the recipe
//! `rewrite` prints and records, and `inspect` of a rewritten step (snapshots for every
//! shipped graph with AGC and loss scaling, and its JSON checked against the artifacts).

use crate::common;

use std::path::Path;
use std::process::{Command, Output};

use crate::common::root;
use serde_json::Value;

fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run onnx-ga")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn ok(args: &[&str]) -> Output {
    let out = onnx_ga(args);
    assert!(
        out.status.success(),
        "onnx-ga {args:?} failed ({}): {}",
        out.status,
        stderr(&out)
    );
    out
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// Rewrites graphs/`model` into `dir` with K=4 and `extra` options; returns the step path.
fn rewrite(dir: &Path, model: &str, extra: &[&str]) -> (std::path::PathBuf, String) {
    let step = dir.join(format!("{model}.step.onnx"));
    let graphs = format!("graphs/{model}");
    let mut args = vec!["rewrite", &graphs, "-o", s(&step), "--accum-steps", "4"];
    args.extend(extra);
    let out = ok(&args);
    (step, stderr(&out))
}

/// Width and height from a PNG's IHDR chunk, checking the signature and chunk type.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(
        bytes.len() > 33,
        "too short for a PNG: {} bytes",
        bytes.len()
    );
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR", "first chunk is IHDR");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

/// The `width` and `height` attributes of an SVG document's root element.
fn svg_size(text: &str) -> (u32, u32) {
    let start = text.find("<svg").expect("an <svg element");
    let end = start + text[start..].find('>').expect("the root tag ends");
    let tag = &text[start..end];
    let attr = |name: &str| -> u32 {
        let key = format!(" {name}=\"");
        let at = tag
            .find(&key)
            .unwrap_or_else(|| panic!("no {name} in {tag}"))
            + key.len();
        let len = tag[at..].find('"').expect("attribute ends");
        tag[at..at + len].parse().expect("a number")
    };
    assert!(
        text.trim_end().ends_with("</svg>"),
        "the document is complete"
    );
    (attr("width"), attr("height"))
}

// ------------------------------------------------------------------ train's progress

/// Off a terminal (the test's pipe) train writes progress lines with every field and the
/// summary; `--quiet` writes nothing at all on success.
#[test]
fn train_reports_progress_off_a_terminal_and_quiet_silences_it() {
    let dir = tempfile::tempdir().unwrap();
    let (step, _) = rewrite(
        dir.path(),
        "mlp_ce_adamw",
        &["--lr", "0.01", "--loss-scale", "dynamic"],
    );
    let data = "graphs/mlp_ce_adamw/data.npz";
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            s(&step),
            "--data",
            data,
            "--micro-batch",
            "8",
            "--steps",
            "12",
            "--engine",
            "tract",
        ];
        args.extend(extra);
        ok(&args)
    };
    let out = train(&[]);
    let err = stderr(&out);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("micro-step "))
        .collect();
    // The first micro-step, and the last (the run is far shorter than the interval).
    assert!(lines.len() >= 2, "progress lines:\n{err}");
    assert!(
        lines[0].starts_with("micro-step 1 (1/12, 8%) window 1 loss "),
        "{err}"
    );
    let last = lines.last().unwrap();
    assert!(
        last.starts_with("micro-step 12 (12/12, 100%) window 3 loss "),
        "{err}"
    );
    for field in [
        "(smoothed)",
        " scale 65536",
        " micro-steps/s ",
        " samples/s",
        " ETA ",
    ] {
        assert!(last.contains(field), "{field:?} missing in {last:?}");
    }
    assert!(
        err.contains("trained 12 micro-steps, 3 optimizer steps, 0 skipped windows"),
        "{err}"
    );
    assert!(err.contains("\nloss: first "), "{err}");
    assert!(err.contains(" best "), "{err}");
    assert!(
        err.contains(" wall, ") && err.contains(" samples/s (micro-batch 8)"),
        "{err}"
    );
    assert!(err.contains("engine: tract"), "{err}");

    let quiet = train(&["--quiet"]);
    assert_eq!(stderr(&quiet), "", "--quiet prints nothing but errors");
    assert!(quiet.stdout.is_empty());
    // Errors still show under --quiet.
    let bad = onnx_ga(&[
        "train",
        s(&step),
        "--data",
        "graphs/no-such.npz",
        "--micro-batch",
        "8",
        "--steps",
        "1",
        "--quiet",
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("no-such.npz"), "{}", stderr(&bad));
}

// --------------------------------------------------------------------------- plot

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

/// A metrics file like train writes: K=4, loss scaling, a skipped window, a NaN (null)
/// loss, a discarded micro-step and a loss written as the string "NaN".
fn metrics_text() -> String {
    let mut lines = Vec::new();
    for step in 1..=24u64 {
        let loss = match step {
            6 => "null".to_string(),
            9 => "\"NaN\"".to_string(),
            s => format!("{}", 1.0 / s as f64 + 0.1),
        };
        let end = step % 4 == 0;
        let skipped = step == 8;
        let scale = if step <= 8 { 65536 } else { 32768 };
        let mut line = format!(
            "{{\"step\":{step},\"loss\":{loss},\"applied\":{},\"scale\":{scale}.0",
            end && !skipped
        );
        if skipped {
            line.push_str(",\"skipped\":true");
        }
        if step == 9 {
            line.push_str(",\"discarded\":true");
        }
        line.push('}');
        lines.push(line);
    }
    lines.join("\n") + "\n"
}

#[test]
fn plot_writes_png_and_svg_of_the_asked_size_with_non_finite_losses() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    write(&metrics, &metrics_text());
    let png = dir.path().join("loss.png");
    let out = ok(&["plot", s(&metrics), "-o", s(&png)]);
    assert!(
        stderr(&out).contains("(24 micro-steps, 6 windows, 1 skipped, 2 non-finite losses"),
        "{}",
        stderr(&out)
    );
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(png_size(&bytes), (960, 540));
    // The decoded image is not blank: the plot drew lines in colours other than white.
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let pixels = &buf[..info.buffer_size()];
    let coloured = pixels
        .chunks(3)
        .filter(|p| p[0] != p[1] || p[1] != p[2])
        .count();
    assert!(coloured > 500, "{coloured} coloured pixels");

    let svg = dir.path().join("loss.svg");
    ok(&[
        "plot",
        s(&metrics),
        "-o",
        s(&svg),
        "--width",
        "640",
        "--height",
        "400",
    ]);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(svg_size(&text), (640, 400));
    for label in ["micro-step", "loss scale", "window skipped (loss scaling)"] {
        // plotters writes each text on its own line inside <text>.
        assert!(
            text.contains(&format!(">\n{label}\n</text>")),
            "no {label:?} in the SVG"
        );
    }

    // Only NaN losses: still a plot.
    let all_nan = dir.path().join("nan.jsonl");
    write(
        &all_nan,
        "{\"step\":1,\"loss\":null,\"applied\":false}\n{\"step\":2,\"loss\":null,\"applied\":true}\n",
    );
    let nan_png = dir.path().join("nan.png");
    ok(&["plot", s(&all_nan), "-o", s(&nan_png)]);
    assert_eq!(png_size(&std::fs::read(&nan_png).unwrap()), (960, 540));
}

#[test]
fn plot_refuses_bad_metrics_and_outputs_with_exit_2_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out_png = dir.path().join("out.png");
    let cases: [(&str, &str, &[&str]); 5] = [
        (
            "garbage.jsonl",
            "{\"step\":1,\"loss\":0.5}\nnot json\n",
            &["garbage.jsonl:2", "not a metrics line"],
        ),
        (
            "noloss.jsonl",
            "{\"step\":1}\n",
            &["noloss.jsonl:1", "no \\\"loss\\\""],
        ),
        ("empty.jsonl", "\n", &["empty.jsonl", "no micro-steps"]),
        (
            "badstep.jsonl",
            "{\"step\":-1,\"loss\":1}\n",
            &["badstep.jsonl:1", "step"],
        ),
        (
            "strloss.jsonl",
            "{\"step\":1,\"loss\":\"low\"}\n",
            &["strloss.jsonl:1", "\"low\""],
        ),
    ];
    for (name, text, expected) in cases {
        let path = dir.path().join(name);
        write(&path, text);
        let out = onnx_ga(&["plot", s(&path), "-o", s(&out_png)]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(!err.contains("panicked"), "{name}: {err}");
        for e in expected {
            let e = e.replace("\\\"", "\"");
            assert!(err.contains(&e), "{name}: {e:?} not in {err}");
        }
        assert!(!out_png.exists(), "{name}: nothing written");
    }
    let good = dir.path().join("good.jsonl");
    write(&good, "{\"step\":1,\"loss\":0.5,\"applied\":true}\n");
    let missing = onnx_ga(&["plot", "no-such.jsonl", "-o", s(&out_png)]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr(&missing).contains("no-such.jsonl"));
    let gif = dir.path().join("loss.gif");
    let wrong = onnx_ga(&["plot", s(&good), "-o", s(&gif)]);
    assert_eq!(wrong.status.code(), Some(2));
    assert!(
        stderr(&wrong).contains(".png or .svg"),
        "{}",
        stderr(&wrong)
    );
    let onto_input = onnx_ga(&["plot", s(&good), "-o", s(&good)]);
    assert_eq!(onto_input.status.code(), Some(2));
    assert_eq!(
        std::fs::read_to_string(&good).unwrap(),
        "{\"step\":1,\"loss\":0.5,\"applied\":true}\n"
    );
    let tiny = onnx_ga(&["plot", s(&good), "-o", s(&out_png), "--width", "3"]);
    assert_eq!(tiny.status.code(), Some(2));
    assert!(!out_png.exists());
    let no_dir = dir.path().join("no/such/dir/x.png");
    let unwritable = onnx_ga(&["plot", s(&good), "-o", s(&no_dir)]);
    assert_eq!(unwritable.status.code(), Some(2), "{}", stderr(&unwritable));
}

/// `train --plot` draws the metrics at the end and at each checkpoint; it needs --metrics
/// and a .png/.svg name, checked before training.
#[test]
fn train_plot_writes_the_loss_picture() {
    let dir = tempfile::tempdir().unwrap();
    let (step, _) = rewrite(dir.path(), "mlp_mse_sgd", &["--lr", "0.01"]);
    let data = "graphs/mlp_mse_sgd/data.npz";
    let metrics = dir.path().join("m.jsonl");
    let plot = dir.path().join("loss.svg");
    let state = dir.path().join("s.npz");
    let out = ok(&[
        "train",
        s(&step),
        "--data",
        data,
        "--micro-batch",
        "8",
        "--steps",
        "16",
        "--engine",
        "tract",
        "--metrics",
        s(&metrics),
        "--save-state",
        s(&state),
        "--save-every",
        "2",
        "--plot",
        s(&plot),
    ]);
    let err = stderr(&out);
    // Two checkpoints (after windows 2 and 4) and the end: three plots.
    assert_eq!(err.matches("plot: ").count(), 3, "{err}");
    let text = std::fs::read_to_string(&plot).unwrap();
    assert_eq!(svg_size(&text), (960, 540));
    assert!(text.contains("16 micro-steps, 4 windows"), "the final plot");

    let no_metrics = onnx_ga(&[
        "train",
        s(&step),
        "--data",
        data,
        "--micro-batch",
        "8",
        "--steps",
        "4",
        "--plot",
        s(&plot),
    ]);
    assert_eq!(no_metrics.status.code(), Some(2));
    assert!(
        stderr(&no_metrics).contains("--metrics"),
        "{}",
        stderr(&no_metrics)
    );
    let txt = dir.path().join("loss.txt");
    let bad_ext = onnx_ga(&[
        "train",
        s(&step),
        "--data",
        data,
        "--micro-batch",
        "8",
        "--steps",
        "4",
        "--metrics",
        s(&metrics),
        "--plot",
        s(&txt),
    ]);
    assert_eq!(bad_ext.status.code(), Some(2));
    assert!(stderr(&bad_ext).contains(".png or .svg"));
    // A metrics file named like a picture: --plot may not name it.
    let png_metrics = dir.path().join("m.png");
    let onto_metrics = onnx_ga(&[
        "train",
        s(&step),
        "--data",
        data,
        "--micro-batch",
        "8",
        "--steps",
        "4",
        "--metrics",
        s(&png_metrics),
        "--plot",
        s(&png_metrics),
    ]);
    assert_eq!(onto_metrics.status.code(), Some(2));
    assert!(
        stderr(&onto_metrics).contains("refusing to overwrite the --metrics file"),
        "{}",
        stderr(&onto_metrics)
    );
    assert!(!png_metrics.exists(), "nothing written");
    assert_eq!(
        std::fs::read_to_string(&metrics).unwrap().lines().count(),
        16
    );
}

// ------------------------------------------------------------------------- recipe

/// `--optimizer adamw` on SGD artifacts: rewrite says which values are defaults and that the
/// artifacts' optimizer is another one; `--optimizer adam` on AdamW artifacts says their eps
/// is not used. The step records the same recipe.
#[test]
fn rewrite_prints_the_resolved_recipe_with_origins() {
    let dir = tempfile::tempdir().unwrap();
    let (step, err) = rewrite(
        dir.path(),
        "mlp_mse_sgd",
        &["--lr", "0.01", "--optimizer", "adamw"],
    );
    let line = |name: &str| -> String {
        err.lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} line in:\n{err}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(err.starts_with("recipe:\n  grad-accum:\n"), "{err}");
    assert_eq!(line("steps"), "steps 4 (given)");
    assert_eq!(
        line("normalize"),
        "normalize mean (default; the window's gradient sum over its micro-steps)"
    );
    assert_eq!(
        line("kind"),
        "kind adamw (given; the artifacts configure sgd: their hyperparameters are not used for adamw)"
    );
    assert_eq!(
        line("lr"),
        "lr 0.01 (given; train --lr overrides it for a run)"
    );
    assert_eq!(
        line("weight_decay"),
        "weight_decay 0.01 (default; ONNX Runtime AdamWOptimizer's default)"
    );
    assert_eq!(
        line("eps"),
        "eps 1e-6 (default; ONNX Runtime AdamWOptimizer's default)"
    );
    // Printed before the file is written.
    let recipe_at = err.find("recipe:").unwrap();
    let wrote_at = err.find("wrote ").unwrap();
    assert!(recipe_at < wrote_at);

    let report = json(&["inspect", s(&step), "--json"]);
    let optimizer = report["step"]["recipe"]["passes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pass"] == "optimizer")
        .expect("an optimizer section")
        .clone();
    let setting = |name: &str| {
        optimizer["settings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .clone()
    };
    assert_eq!(setting("weight_decay")["value"], 0.01);
    assert_eq!(setting("weight_decay")["from"], "default");
    assert_eq!(setting("lr")["from"], "given");
    assert_eq!(setting("adam_mode")["value"], 1);

    // AdamW artifacts, their own optimizer: every value from the artifacts.
    let (_, err) = rewrite(dir.path(), "mlp_ce_adamw", &["--lr", "0.01"]);
    for name in [
        "kind adamw",
        "beta1 0.9",
        "beta2 0.999",
        "eps 1e-6",
        "weight_decay 0 ",
    ] {
        let found = err.lines().any(|l| {
            let l = l.split_whitespace().collect::<Vec<_>>().join(" ");
            l.starts_with(name) && l.contains("(from the artifacts")
        });
        assert!(found, "{name} from the artifacts:\n{err}");
    }
    // Adam on AdamW artifacts: not their eps, and it says so.
    let (_, err) = rewrite(
        dir.path(),
        "mlp_ce_adamw",
        &["--lr", "0.01", "--optimizer", "adam"],
    );
    assert!(
        err.contains("the artifacts configure adamw: their hyperparameters are not used for adam"),
        "{err}"
    );
    assert!(
        err.lines().any(|l| l.trim_start().starts_with("eps")
            && l.contains(" 1e-8 ")
            && l.contains("(default")),
        "{err}"
    );
}

fn json(args: &[&str]) -> Value {
    let out = ok(args);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: bad JSON: {e}"))
}

// ------------------------------------------------------------------------ inspect

/// `inspect STEP.onnx` of each shipped graph rewritten with AGC and dynamic loss scaling:
/// the recipe, the state by role with sizes, the controls and the engines (snapshots), and
/// the JSON's sizes checked against the artifacts' own parameter count.
#[test]
fn inspect_explains_a_rewritten_step() {
    let dir = tempfile::tempdir().unwrap();
    for model in common::SHIPPED_GRAPHS {
        let (step, _) = rewrite(
            dir.path(),
            model,
            &["--lr", "0.01", "--agc", "0.01", "--loss-scale", "dynamic"],
        );
        let out = ok(&["inspect", s(&step)]);
        let text = String::from_utf8(out.stdout).unwrap();
        let tmp = regex_escape(&dir.path().display().to_string());
        // The eval model the step records: the artifacts' file, by its absolute path.
        let repo = regex_escape(&std::fs::canonicalize(root()).unwrap().display().to_string());
        insta::with_settings!({ filters => vec![(tmp.as_str(), "[TMP]"), (repo.as_str(), "[REPO]")] }, {
            insta::assert_snapshot!(format!("step_{model}"), text);
        });

        let report = json(&["inspect", s(&step), "--json"]);
        let view = &report["step"];
        assert_eq!(view["headline"]["accum_steps"], "4", "{model}");
        assert_eq!(view["headline"]["learning_rate"], "0.01", "{model}");
        assert_eq!(view["headline"]["precision"], "fp32", "{model}");
        assert!(
            view["headline"]["loss_scale"]
                .as_str()
                .unwrap()
                .starts_with("dynamic (init 65536, growth 2, backoff 0.5, interval 2000"),
            "{model}"
        );
        assert_eq!(view["headline"]["agc"], "clip 0.01, eps 0.001", "{model}");
        // The parameters' elements and bytes are the artifacts' trainable parameters.
        let artifacts = json(&["inspect", &format!("graphs/{model}"), "--json"]);
        let trainable = artifacts["parameter_count"]["trainable"].as_u64().unwrap();
        let group = |role: &str| {
            view["state"]
                .as_array()
                .unwrap()
                .iter()
                .find(|g| g["role"] == role)
                .cloned()
        };
        let params = group("param").expect("param state");
        assert_eq!(params["elements"].as_u64(), Some(trainable), "{model}");
        assert_eq!(
            params["bytes"].as_u64(),
            Some(4 * trainable),
            "{model}: float32"
        );
        let acc = group("accumulator").expect("accumulators");
        assert_eq!(acc["elements"].as_u64(), Some(trainable), "{model}");
        let total: u64 = view["state"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(view["state_bytes"].as_u64(), Some(total));
        let ort = &view["engines"][0];
        assert_eq!(ort["engine"], "ort");
        assert_eq!(ort["runs"], true, "{model}: standard ops only");
    }
}

fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

// ------------------------------------------------------------------- Python host

/// The Python host example, run by a Python without onnxruntime (`-S`: no site-packages),
/// says which Python to use instead of a traceback.
#[test]
fn python_example_names_the_python_to_use() {
    let Ok(out) = Command::new("python3")
        .args(["-S", "examples/train_step.py", "step.onnx", "data.npz"])
        .current_dir(root())
        .output()
    else {
        eprintln!("SKIPPED: no python3");
        return;
    };
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("is not installed for"), "{err}");
    assert!(err.contains(".venv-ort/bin/python"), "{err}");
    assert!(!err.contains("Traceback"), "{err}");
}

/// The first thing a new user tries is `train` on the model they have. What is not a step
/// yet (ONNX Runtime's artifacts folder or its training model, a forward model) is refused
/// (exit 2, nothing written) with the `rewrite` that makes one, and that command, run as
/// printed, writes a step `train` then trains.
#[test]
fn train_on_what_is_not_a_step_prints_the_rewrite_that_makes_one() {
    let cases = [
        (
            "graphs/mlp_ce_adamw",
            "graphs/mlp_ce_adamw/data.npz",
            "artifacts",
        ),
        (
            "graphs/mlp_ce_adamw/training_model.onnx",
            "graphs/mlp_ce_adamw/data.npz",
            "the training model of ONNX Runtime's artifacts",
        ),
        (
            "graphs/forward/torch_mlp/dynamo.onnx",
            "graphs/forward/torch_mlp/data.npz",
            "a forward model",
        ),
    ];
    for (model, data, what) in cases {
        let dir = tempfile::tempdir().unwrap();
        let model = root().join(model);
        let data = root().join(data);
        let run = |args: &[&str]| {
            Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
                .args(args)
                .current_dir(dir.path())
                .output()
                .expect("run onnx-ga")
        };
        let train = |step: &Path| {
            run(&[
                "train",
                s(step),
                "--data",
                s(&data),
                "--micro-batch",
                "4",
                "--steps",
                "8",
                "--save-state",
                "s.npz",
            ])
        };
        let refused = train(&model);
        let err = stderr(&refused);
        assert_eq!(refused.status.code(), Some(2), "{err}");
        assert!(
            err.contains(what) && err.contains("not a training step"),
            "{err}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "nothing written"
        );

        let command = err
            .split("`onnx-ga ")
            .nth(1)
            .and_then(|rest| rest.split('`').next())
            .unwrap_or_else(|| panic!("a command in backticks: {err}"));
        let args: Vec<&str> = command.split_whitespace().collect();
        assert_eq!(args[0], "rewrite", "{command}");
        let rewritten = run(&args);
        assert!(
            rewritten.status.success(),
            "{command}: {}",
            stderr(&rewritten)
        );
        let trained = train(&dir.path().join("step.onnx"));
        assert!(trained.status.success(), "{}", stderr(&trained));
        // Two windows of K = 4 applied: the optimizer stepped twice.
        let state = onnx_ga::data::read_state(&dir.path().join("s.npz")).unwrap();
        match &state["ga.opt_step"] {
            onnx_ga::data::Tensor::I64(steps) => assert_eq!(steps.iter().sum::<i64>(), 2),
            other => panic!("ga.opt_step: {other:?}"),
        }
    }
}

/// A state saved by a step made otherwise (here AdamW's, resumed into an SGD step) is
/// refused, naming the way on: write its parameters into the model (`export`) and rewrite
/// that. Followed, the new step starts from exactly those parameters.
#[test]
fn a_state_from_another_optimizer_names_the_way_to_start_from_its_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name);
    let forward = root().join("graphs/forward/torch_mlp/dynamo.onnx");
    let data = root().join("graphs/forward/torch_mlp/data.npz");
    let rewrite = |model: &Path, out: &str, optimizer: &str| {
        ok(&[
            "rewrite",
            s(model),
            "-o",
            s(&d(out)),
            "--accum-steps",
            "4",
            "--loss-fn",
            "cross-entropy",
            "--optimizer",
            optimizer,
            "--lr",
            "0.01",
        ]);
    };
    let train = |step: &str, extra: &[&str]| {
        let step = d(step);
        let mut args = vec![
            "train",
            s(&step),
            "--data",
            s(&data),
            "--micro-batch",
            "4",
            "--quiet",
        ];
        args.extend(extra);
        onnx_ga(&args)
    };
    rewrite(&forward, "adamw.onnx", "adamw");
    rewrite(&forward, "sgd.onnx", "sgd");
    let adamw_state = d("adamw.npz");
    assert!(train(
        "adamw.onnx",
        &["--steps", "8", "--save-state", s(&adamw_state)]
    )
    .status
    .success());

    let refused = train(
        "sgd.onnx",
        &["--steps", "8", "--init-state", s(&adamw_state)],
    );
    let err = stderr(&refused);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    assert!(
        err.contains("is not a state of this model")
            && err.contains("saved by a step made otherwise")
            && err.contains("onnx-ga export"),
        "{err}"
    );

    // The way on: the parameters into the model, the model rewritten.
    ok(&[
        "export",
        s(&d("sgd.onnx")),
        "--state",
        s(&adamw_state),
        "-o",
        s(&d("trained.onnx")),
    ]);
    rewrite(&d("trained.onnx"), "sgd_from_adamw.onnx", "sgd");
    let start = d("start.npz");
    let out = train(
        "sgd_from_adamw.onnx",
        &["--steps", "0", "--save-state", s(&start)],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let (saved, started) = (
        onnx_ga::data::read_state(&adamw_state).unwrap(),
        onnx_ga::data::read_state(&start).unwrap(),
    );
    let params: Vec<&String> = started.keys().filter(|k| !k.starts_with("ga.")).collect();
    assert!(!params.is_empty());
    for name in params {
        assert_eq!(
            started[name], saved[name],
            "{name}: starts where AdamW left it"
        );
    }
}
