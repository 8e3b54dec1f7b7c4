//! A seeded mutation campaign against the real binary: byte flips and truncations of a
//! training model, a checkpoint, a step, an npz data set and an npz state; proto-level
//! edits (op types, attributes, opset imports, initializers, dims, names); bad CLI option
//! values. Every run must end (a per-run timeout), exit 0 or 2 (never a panic, a signal
//! or exit 1 for a bad input), name the file (or option) it blames, write nothing on an
//! error, and leave its inputs as they were.
//!
//! `MUTATION_CASES` (default 480) and `MUTATION_SEED` (default 11) set the campaign.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::root;
use onnx_ga::proto::{AttributeProto, ModelProto, OperatorSetIdProto};
use prost::Message;

/// xorshift64*: small, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

const TIMEOUT: Duration = Duration::from_secs(30);

struct Fixture {
    dir: tempfile::TempDir,
    artifacts: PathBuf,
    step: PathBuf,
    data: PathBuf,
    state: PathBuf,
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_onnx-ga")
}

/// Runs the binary with a timeout: (exit code or None for a signal, stderr, timed out).
fn run(args: &[String]) -> (Option<i32>, String, bool) {
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn onnx-ga");
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        std::io::Read::read_to_end(&mut stderr, &mut s).ok();
        // Bounded: a run that prints megabytes is a finding of its own.
        s.truncate(64 * 1024);
        String::from_utf8_lossy(&s).into_owned()
    });
    let start = Instant::now();
    let (code, timed_out) = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break (status.code(), false);
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break (None, true);
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    (code, reader.join().unwrap(), timed_out)
}

fn setup() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let artifacts = dir.path().join("artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let src = root().join("graphs/mlp_ce_adamw");
    for f in [
        "checkpoint",
        "training_model.onnx",
        "optimizer_model.onnx",
        "eval_model.onnx",
    ] {
        std::fs::copy(src.join(f), artifacts.join(f)).unwrap();
    }
    let data = dir.path().join("data.npz");
    std::fs::copy(src.join("data.npz"), &data).unwrap();
    let step = dir.path().join("step.onnx");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (code, err, _) = run(&[
        "rewrite".into(),
        s(&artifacts),
        "-o".into(),
        s(&step),
        "--lr".into(),
        "0.01".into(),
        "--accum-steps".into(),
        "2".into(),
    ]);
    assert_eq!(code, Some(0), "{err}");
    let state = dir.path().join("state.npz");
    let (code, err, _) = run(&[
        "train".into(),
        s(&step),
        "--data".into(),
        s(&data),
        "--micro-batch".into(),
        "8".into(),
        "--steps".into(),
        "2".into(),
        "--engine".into(),
        "tract".into(),
        "--quiet".into(),
        "--save-state".into(),
        s(&state),
    ]);
    assert_eq!(code, Some(0), "{err}");
    Fixture {
        dir,
        artifacts,
        step,
        data,
        state,
    }
}

fn flip_or_truncate(rng: &mut Rng, bytes: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    match rng.below(4) {
        0 => b.truncate(rng.below(bytes.len())),
        1 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(b.len());
                b[i] = *rng.pick(&[0u8, 0xff, 0x7f, 0x80]);
            }
        }
        _ => {
            // A run of garbage in the middle.
            let i = rng.below(b.len());
            for j in i..(i + 1 + rng.below(32)).min(b.len()) {
                b[j] = rng.next() as u8;
            }
        }
    }
    b
}

/// One proto-level edit of a model; what it names (a node or tensor) when it has a name.
fn edit_model(rng: &mut Rng, m: &mut ModelProto) {
    let g = m.graph.get_or_insert_with(Default::default);
    let n_nodes = g.node.len();
    let n_inits = g.initializer.len();
    match rng.below(12) {
        0 if n_nodes > 0 => {
            let i = rng.below(n_nodes);
            g.node[i].op_type = Some(
                rng.pick(&[
                    "", "Foo", "Relu", "Add", "If", "Loop", "Gemm", "Conv", "Reshape",
                ])
                .to_string(),
            );
        }
        1 if n_nodes > 0 => {
            let i = rng.below(n_nodes);
            g.node[i].domain = Some(
                rng.pick(&["", "com.microsoft", "x.y", "ai.onnx.ml"])
                    .to_string(),
            );
        }
        2 if n_nodes > 0 => {
            // An attribute of another type, or a new unknown one.
            let i = rng.below(n_nodes);
            let node = &mut g.node[i];
            if let Some(a) = node.attribute.first_mut() {
                a.r#type = Some(rng.below(15) as i32);
                if rng.below(2) == 0 {
                    a.i = None;
                    a.f = Some(0.5);
                }
            } else {
                node.attribute.push(AttributeProto {
                    name: Some("bogus".into()),
                    r#type: Some(2),
                    i: Some(1),
                    ..Default::default()
                });
            }
        }
        3 => {
            let v = *rng.pick(&[None, Some(0), Some(-1), Some(1), Some(1000)]);
            match rng.below(3) {
                0 => m.opset_import.clear(),
                1 => m.opset_import.push(OperatorSetIdProto {
                    domain: Some(String::new()),
                    version: v,
                }),
                _ => {
                    if let Some(o) = m.opset_import.first_mut() {
                        o.version = v;
                    }
                }
            }
        }
        4 if n_inits > 0 => {
            let i = rng.below(n_inits);
            g.initializer[i].dims = match rng.below(4) {
                0 => vec![],
                1 => vec![-1],
                2 => vec![1 << 40, 1 << 40],
                _ => vec![rng.below(100) as i64, 7],
            };
        }
        5 if n_inits > 0 => {
            let i = rng.below(n_inits);
            g.initializer[i].data_type = Some(rng.below(30) as i32);
        }
        6 if n_inits > 0 => {
            let i = rng.below(n_inits);
            let t = &mut g.initializer[i];
            if let Some(raw) = t.raw_data.as_mut() {
                raw.truncate(rng.below(raw.len().max(1)));
            } else {
                t.raw_data = Some(vec![1, 2, 3]);
            }
        }
        7 if n_inits > 0 => {
            let t = g.initializer[rng.below(n_inits)].clone();
            g.initializer.push(t);
        }
        8 if n_nodes > 0 => {
            let i = rng.below(n_nodes);
            if let Some(x) = g.node[i].input.first_mut() {
                *x = "no_such_value".into();
            }
        }
        9 if n_nodes > 1 => {
            let (i, j) = (rng.below(n_nodes), rng.below(n_nodes));
            if let (Some(o), true) = (g.node[i].output.first().cloned(), i != j) {
                if let Some(p) = g.node[j].output.first_mut() {
                    *p = o;
                }
            }
        }
        10 if n_nodes > 0 => {
            let i = rng.below(n_nodes);
            g.node.remove(i);
        }
        _ => {
            if let Some(input) = g.input.first_mut() {
                input.r#type = None;
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Family {
    ModelBytes,
    CheckpointBytes,
    ModelProto,
    StepBytes,
    StepProto,
    DataBytes,
    StateBytes,
    Options,
}

const FAMILIES: [Family; 8] = [
    Family::ModelBytes,
    Family::CheckpointBytes,
    Family::ModelProto,
    Family::StepBytes,
    Family::StepProto,
    Family::DataBytes,
    Family::StateBytes,
    Family::Options,
];

struct Case {
    args: Vec<String>,
    /// Files the run reads: they must be unchanged after it.
    inputs: Vec<PathBuf>,
    /// Where it would write: absent after an error.
    output: Option<PathBuf>,
    /// What an error must name (a file name or an option).
    blame: Vec<String>,
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

fn case(rng: &mut Rng, fx: &Fixture, family: Family, i: usize) -> Case {
    let work = fx.dir.path().join(format!("case{i}"));
    std::fs::create_dir_all(&work).unwrap();
    let out = work.join("out.onnx");
    let train = |step: &Path, data: &Path, extra: &[String]| -> Vec<String> {
        let mut a = vec![
            "train".to_string(),
            s(step),
            "--data".into(),
            s(data),
            "--micro-batch".into(),
            "8".into(),
            "--steps".into(),
            "2".into(),
            "--engine".into(),
            "tract".into(),
            "--quiet".into(),
        ];
        a.extend(extra.iter().cloned());
        a
    };
    let copy_artifacts = |edit: &mut dyn FnMut(&Path)| {
        let a = work.join("artifacts");
        std::fs::create_dir_all(&a).unwrap();
        for e in std::fs::read_dir(&fx.artifacts).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, a.join(p.file_name().unwrap())).unwrap();
        }
        edit(&a);
        a
    };
    let inspect_or_rewrite = |rng: &mut Rng, a: &Path| -> Vec<String> {
        if rng.below(3) == 0 {
            vec!["inspect".into(), s(a)]
        } else {
            vec![
                "rewrite".into(),
                s(a),
                "-o".into(),
                s(&out),
                "--lr".into(),
                "0.01".into(),
            ]
        }
    };
    match family {
        Family::ModelBytes | Family::CheckpointBytes | Family::ModelProto => {
            let file = match family {
                Family::CheckpointBytes => "checkpoint",
                _ => "training_model.onnx",
            };
            let a = copy_artifacts(&mut |a: &Path| {
                let p = a.join(file);
                let bytes = std::fs::read(&p).unwrap();
                let new = if family == Family::ModelProto {
                    let mut m = ModelProto::decode(&bytes[..]).unwrap();
                    for _ in 0..1 + rng.below(2) {
                        edit_model(rng, &mut m);
                    }
                    m.encode_to_vec()
                } else {
                    flip_or_truncate(rng, &bytes)
                };
                std::fs::write(&p, new).unwrap();
            });
            let args = inspect_or_rewrite(rng, &a);
            let inputs = std::fs::read_dir(&a)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            Case {
                args,
                inputs,
                output: Some(out.clone()),
                blame: vec![file.into(), "artifacts".into()],
            }
        }
        Family::StepBytes | Family::StepProto => {
            let step = work.join("step.onnx");
            let bytes = std::fs::read(&fx.step).unwrap();
            let new = if family == Family::StepProto {
                let mut m = ModelProto::decode(&bytes[..]).unwrap();
                edit_model(rng, &mut m);
                m.encode_to_vec()
            } else {
                flip_or_truncate(rng, &bytes)
            };
            std::fs::write(&step, new).unwrap();
            let state = work.join("saved.npz");
            Case {
                args: train(&step, &fx.data, &["--save-state".into(), s(&state)]),
                inputs: vec![step, fx.data.clone()],
                output: Some(state),
                // A step whose weights load but diverge is stopped naming the micro-step.
                // Or an engine refusing it, naming the node.
                blame: vec!["step.onnx".into(), "micro-step".into(), "node".into()],
            }
        }
        Family::DataBytes => {
            let data = work.join("data.npz");
            std::fs::write(
                &data,
                flip_or_truncate(rng, &std::fs::read(&fx.data).unwrap()),
            )
            .unwrap();
            let state = work.join("saved.npz");
            Case {
                args: train(&fx.step, &data, &["--save-state".into(), s(&state)]),
                inputs: vec![fx.step.clone(), data],
                output: Some(state),
                blame: vec!["data.npz".into()],
            }
        }
        Family::StateBytes => {
            let init = work.join("init.npz");
            std::fs::write(
                &init,
                flip_or_truncate(rng, &std::fs::read(&fx.state).unwrap()),
            )
            .unwrap();
            // Not --metrics: its lines are written as they happen, by design.
            let saved = work.join("saved.npz");
            Case {
                args: train(
                    &fx.step,
                    &fx.data,
                    &[
                        "--init-state".into(),
                        s(&init),
                        "--save-state".into(),
                        s(&saved),
                    ],
                ),
                inputs: vec![fx.step.clone(), fx.data.clone(), init],
                output: Some(saved),
                // A state that loads but diverges is stopped naming the micro-step.
                blame: vec!["init.npz".into(), "micro-step".into()],
            }
        }
        Family::Options => {
            let values = [
                "0",
                "-1",
                "nan",
                "inf",
                "-inf",
                "1e400",
                "18446744073709551615",
                "99999999999999999999",
                "abc",
                "",
                "0.5",
                "1",
            ];
            let v = rng.pick(&values).to_string();
            if rng.below(2) == 0 {
                let opt = *rng.pick(&[
                    "--accum-steps",
                    "--lr",
                    "--agc",
                    "--agc-eps",
                    "--fuse-small",
                    "--loss-scale-init",
                    "--loss-scale-interval",
                    "--beta1",
                    "--eps",
                    "--weight-decay",
                ]);
                let mut args = vec!["rewrite".into(), s(&fx.artifacts), "-o".into(), s(&out)];
                if opt != "--lr" {
                    args.extend(["--lr".to_string(), "0.01".into()]);
                }
                // `--opt=VALUE`: a value like -1 is the option's, not a flag.
                args.push(format!("{opt}={v}"));
                Case {
                    args,
                    inputs: vec![fx.artifacts.join("training_model.onnx")],
                    output: Some(out.clone()),
                    blame: vec![opt.trim_start_matches('-').into()],
                }
            } else {
                let opt = *rng.pick(&[
                    "--micro-batch",
                    "--steps",
                    "--lr",
                    "--accum-steps",
                    "--threads",
                    "--start-step",
                    "--save-every",
                ]);
                // `--steps` of 2^64 - 1 is no bad input but a run that goes on until the
                // loss diverges (85,600 micro-steps, 15 s of CPU; a minute on a busy
                // machine): a run length is tested small.
                let v = match v.parse::<u64>() {
                    Ok(n) if opt == "--steps" && n > 1000 => "3".to_string(),
                    _ => v,
                };
                let state = work.join("saved.npz");
                let mut args = train(&fx.step, &fx.data, &["--save-state".into(), s(&state)]);
                // A later occurrence of a single-valued option is an error of its own in
                // clap: replace the value in place when the option is already there.
                if let Some(k) = args.iter().position(|a| a == opt) {
                    args.drain(k..k + 2);
                }
                args.push(format!("{opt}={v}"));
                Case {
                    args,
                    inputs: vec![fx.step.clone(), fx.data.clone()],
                    output: Some(state),
                    blame: vec![opt.trim_start_matches('-').into()],
                }
            }
        }
    }
}

fn digest(paths: &[PathBuf]) -> Vec<(PathBuf, Option<Vec<u8>>)> {
    paths
        .iter()
        .map(|p| (p.clone(), std::fs::read(p).ok()))
        .collect()
}

#[test]
fn mutated_inputs_never_panic_hang_or_write_partial_output() {
    let cases: usize = std::env::var("MUTATION_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(480);
    let seed: u64 = std::env::var("MUTATION_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(11);
    let start = Instant::now();
    let fx = setup();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut prepared = Vec::new();
    for i in 0..cases {
        let family = FAMILIES[i % FAMILIES.len()];
        let c = case(&mut rng, &fx, family, i);
        let before = digest(&c.inputs);
        prepared.push((i, family, c, before));
    }
    // Two workers: CI has two cores.
    let results = std::sync::Mutex::new(Vec::new());
    let queue = std::sync::Mutex::new(prepared.into_iter());
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| loop {
                let Some((i, family, c, before)) = queue.lock().unwrap().next() else {
                    break;
                };
                let (code, stderr, timed_out) = run(&c.args);
                let mut problems = Vec::new();
                if timed_out {
                    problems.push(format!("no exit within {TIMEOUT:?}"));
                }
                match code {
                    Some(0) | Some(2) => {}
                    None if !timed_out => problems.push("killed by a signal".into()),
                    None => {}
                    Some(c) => problems.push(format!("exit {c}")),
                }
                if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
                    problems.push("panicked".into());
                }
                if code == Some(2) {
                    if let Some(out) = &c.output {
                        if out.exists() {
                            problems.push(format!("wrote {} on an error", out.display()));
                        }
                    }
                    // An option may be named by its flag or its setting (weight_decay).
                    let named = |b: &String| {
                        stderr.contains(b.as_str()) || stderr.contains(&b.replace('-', "_"))
                    };
                    if !c.blame.iter().any(named) {
                        problems.push(format!("the error names none of {:?}", c.blame));
                    }
                }
                if digest(&c.inputs) != before {
                    problems.push("an input file changed".into());
                }
                results
                    .lock()
                    .unwrap()
                    .push((i, family, code, problems, c.args.clone(), stderr));
            });
        }
    });
    let results = results.into_inner().unwrap();
    let mut by_family: BTreeMap<Family, (usize, usize, usize)> = BTreeMap::new();
    let mut failures = Vec::new();
    for (i, family, code, problems, args, stderr) in &results {
        let e = by_family.entry(*family).or_default();
        e.0 += 1;
        if *code == Some(0) {
            e.1 += 1;
        } else {
            e.2 += 1;
        }
        if !problems.is_empty() {
            let tail: String = stderr.chars().take(600).collect();
            failures.push(format!(
                "case {i} ({family:?}): {}\n  args: {}\n  stderr: {tail}",
                problems.join("; "),
                args.join(" ")
            ));
        }
    }
    eprintln!(
        "mutation campaign: seed {seed}, {} runs in {:.1} s",
        results.len(),
        start.elapsed().as_secs_f64()
    );
    for (f, (n, ok, err)) in &by_family {
        eprintln!("  {f:?}: {n} runs, {ok} exit 0, {err} refused");
    }
    failures.sort();
    assert!(
        failures.is_empty(),
        "{} of {} runs broke a promise:\n{}",
        failures.len(),
        results.len(),
        failures.join("\n")
    );
}
