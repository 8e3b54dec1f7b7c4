//! Hostile and mistaken input to `onnx-ga train` and `rewrite` (issue 11, "Panics,
//! crashes, hangs, OOM"): each case runs the built binary under a timeout and asserts the
//! exit code, what stderr says, and that nothing panicked.
//!
//! - arrays of DATA.npz that the step does not take (fewer rows, 0-d, empty, strings,
//!   5,000 of them) are ignored with one note, never decoded;
//! - micro-batches larger than the data set (up to `usize::MAX`) are refused;
//! - a FIFO (or a directory) as step, data, state, checkpoint or external data is refused
//!   at once instead of blocking for ever;
//! - allocation bombs: an `.npy` header claiming (2^40, 16), a deflate bomb beyond the memory
//!   budget, external data far larger than its tensor: refused before allocating.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use onnx_ga::data::Tensor;
use onnx_ga::proto::tensor_proto::DataLocation;
use onnx_ga::proto::StringStringEntryProto;
use prost::Message;
use tempfile::TempDir;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `onnx-ga ARGS` in `dir` (with `env`), killing it after 60 s: a hang is a failure.
fn run(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_onnx-ga"));
    cmd.args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("run onnx-ga");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("onnx-ga {args:?} hung (killed after 60 s)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `onnx-ga ARGS` exits 2 without a panic, and its stderr holds every one of `wanted`.
fn fails(dir: &Path, args: &[&str], env: &[(&str, &str)], wanted: &[&str]) -> String {
    let out = run(dir, args, env);
    let err = stderr(&out);
    assert!(
        !err.contains("panicked"),
        "onnx-ga {args:?} panicked: {err}"
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "onnx-ga {args:?}: want exit code 2, got {}; stderr: {err}",
        out.status
    );
    for w in wanted {
        assert!(
            err.contains(w),
            "onnx-ga {args:?}: stderr lacks {w:?}: {err}"
        );
    }
    err
}

/// `onnx-ga ARGS` exits 0 without a panic; returns stderr.
fn succeeds(dir: &Path, args: &[&str]) -> String {
    let out = run(dir, args, &[]);
    let err = stderr(&out);
    assert!(
        !err.contains("panicked"),
        "onnx-ga {args:?} panicked: {err}"
    );
    assert!(out.status.success(), "onnx-ga {args:?} failed: {err}");
    err
}

/// A folder with `step.onnx`, mlp_ce_adamw rewritten.
fn step_dir() -> TempDir {
    let dir = TempDir::new().unwrap();
    let graphs = root().join("graphs/mlp_ce_adamw");
    succeeds(
        dir.path(),
        &[
            "rewrite",
            graphs.to_str().unwrap(),
            "-o",
            "step.onnx",
            "--lr",
            "0.01",
        ],
    );
    dir
}

/// The `.npy` bytes of an array: descriptor, shape (as Python writes the tuple), data.
fn npy(descr: &str, shape: &[u64], data: &[u8]) -> Vec<u8> {
    let dims = match shape {
        [] => "()".to_string(),
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {dims}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn npy_of(t: &Tensor) -> Vec<u8> {
    let shape: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
    match t {
        Tensor::F32(a) => npy(
            "<f4",
            &shape,
            &a.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
        ),
        Tensor::I64(a) => npy(
            "<i8",
            &shape,
            &a.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
        ),
        other => panic!("unexpected {other:?}"),
    }
}

/// Writes an `.npz` of (name, .npy bytes, deflated?) entries.
fn write_npz(path: &Path, entries: &[(String, Vec<u8>, bool)]) {
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    for (name, bytes, deflate) in entries {
        let method = if *deflate {
            zip::CompressionMethod::Deflated
        } else {
            zip::CompressionMethod::Stored
        };
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(method)
            .large_file(bytes.len() > u32::MAX as usize / 2);
        zip.start_file(format!("{name}.npy"), options).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
}

/// mlp_ce_adamw's data (input, labels) as entries, plus `extra`.
fn data_with(extra: Vec<(String, Vec<u8>, bool)>) -> Vec<(String, Vec<u8>, bool)> {
    let data = onnx_ga::data::read_npz(&root().join("graphs/mlp_ce_adamw/data.npz")).unwrap();
    let mut entries: Vec<_> = data
        .iter()
        .map(|(k, v)| (k.clone(), npy_of(v), false))
        .collect();
    entries.extend(extra);
    entries
}

fn train_args<'a>(data: &'a str, micro_batch: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "step.onnx",
        "--data",
        data,
        "--micro-batch",
        micro_batch,
        "--steps",
        "4",
        "--engine",
        "tract",
    ]
}

#[test]
fn unused_arrays_in_the_data_are_ignored_with_one_note() {
    let dir = step_dir();
    let extra = vec![
        (
            "fewer_rows".to_string(),
            npy("<f4", &[3, 2], &[0; 24]),
            false,
        ),
        (
            "zero_d".to_string(),
            npy("<f4", &[], &1f32.to_le_bytes()),
            false,
        ),
        ("empty".to_string(), npy("<f4", &[0], &[]), true),
        // A NumPy string array ('<U2': 2 UCS-4 characters each).
        (
            "text".to_string(),
            npy(
                "<U2",
                &[2],
                &[b'a', 0, 0, 0, b'b', 0, 0, 0, b'c', 0, 0, 0, 0, 0, 0, 0],
            ),
            false,
        ),
    ];
    write_npz(&dir.path().join("extra.npz"), &data_with(extra));
    let err = succeeds(dir.path(), &train_args("extra.npz", "8"));
    assert_eq!(err.matches("ignoring").count(), 1, "{err}");
    assert!(
        err.contains("ignoring 4 arrays the step does not take"),
        "{err}"
    );
    for name in ["fewer_rows", "zero_d", "empty", "text"] {
        assert!(err.contains(&format!("'{name}'")), "{name}: {err}");
    }

    let many: Vec<_> = (0..5000)
        .map(|i| (format!("x{i}"), npy("<f4", &[1], &[0; 4]), false))
        .collect();
    write_npz(&dir.path().join("many.npz"), &data_with(many));
    let err = succeeds(dir.path(), &train_args("many.npz", "8"));
    assert_eq!(err.matches("ignoring").count(), 1, "{err}");
    assert!(
        err.contains("ignoring 5000 arrays") && err.contains("and 4995 more"),
        "{err}"
    );

    // An array the step does take is still checked: a string array as `labels`.
    let data = onnx_ga::data::read_npz(&root().join("graphs/mlp_ce_adamw/data.npz")).unwrap();
    write_npz(
        &dir.path().join("bad.npz"),
        &[
            ("input".to_string(), npy_of(&data["input"]), false),
            ("labels".to_string(), npy("<U1", &[64], &[0; 256]), false),
        ],
    );
    fails(
        dir.path(),
        &train_args("bad.npz", "8"),
        &[],
        &["bad.npz", "labels", "element type"],
    );
}

#[test]
fn micro_batches_larger_than_the_data_are_refused() {
    let dir = step_dir();
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let data = data.to_str().unwrap();
    for b in ["18446744073709551615", "100000000", "65"] {
        fails(
            dir.path(),
            &train_args(data, b),
            &[],
            &[
                &format!("--micro-batch {b} is larger than the data set"),
                "holds 64 samples",
            ],
        );
    }
    succeeds(dir.path(), &train_args(data, "64"));
}

fn mkfifo(path: &Path) {
    let status = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(status.success(), "mkfifo {}", path.display());
}

#[test]
fn fifos_and_folders_are_refused_not_read() {
    let dir = step_dir();
    let d = dir.path();
    mkfifo(&d.join("fifo.npz"));
    mkfifo(&d.join("fifo.onnx"));
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let data = data.to_str().unwrap();
    // The data.
    fails(
        d,
        &train_args("fifo.npz", "8"),
        &[],
        &["fifo.npz", "FIFO", "only regular files"],
    );
    // The step.
    let mut args = train_args(data, "8");
    args[1] = "fifo.onnx";
    fails(d, &args, &[], &["fifo.onnx", "FIFO"]);
    // The initial state.
    let mut args = train_args(data, "8");
    args.extend(["--init-state", "fifo.npz"]);
    fails(d, &args, &[], &["fifo.npz", "FIFO"]);
    // A folder as the data.
    std::fs::create_dir(d.join("folder.npz")).unwrap();
    fails(
        d,
        &train_args("folder.npz", "8"),
        &[],
        &["folder.npz", "a directory"],
    );

    // The checkpoint of an artifacts folder.
    let artifacts = d.join("artifacts");
    std::fs::create_dir(&artifacts).unwrap();
    for f in [
        "training_model.onnx",
        "eval_model.onnx",
        "optimizer_model.onnx",
    ] {
        std::fs::copy(
            root().join("graphs/mlp_ce_adamw").join(f),
            artifacts.join(f),
        )
        .unwrap();
    }
    mkfifo(&artifacts.join("checkpoint"));
    fails(
        d,
        &["rewrite", "artifacts", "-o", "out.onnx", "--lr", "0.01"],
        &[],
        &["checkpoint", "FIFO"],
    );
    assert!(!d.join("out.onnx").exists());

    // External data.
    let model = forward_with_external(d, "weights.bin", None);
    mkfifo(&d.join("weights.bin"));
    fails(
        d,
        &forward_rewrite(&model),
        &[],
        &["fc1.weight", "weights.bin", "FIFO"],
    );
}

/// graphs/forward/torch_mlp's dynamo export with `fc1.weight` (32x16 float, 2,048 bytes)
/// moved to external data at `location` (the file is the caller's to make), with `length`
/// when given; returns its file name in `dir`.
fn forward_with_external(dir: &Path, location: &str, length: Option<u64>) -> String {
    let path = root().join("graphs/forward/torch_mlp/dynamo.onnx");
    let mut model = onnx_ga::model::load_model(&path).unwrap();
    let init = model
        .graph
        .as_mut()
        .unwrap()
        .initializer
        .iter_mut()
        .find(|t| t.name() == "fc1.weight")
        .unwrap();
    init.raw_data = None;
    init.float_data.clear();
    init.data_location = Some(DataLocation::External as i32);
    init.external_data = vec![StringStringEntryProto {
        key: Some("location".into()),
        value: Some(location.into()),
    }];
    if let Some(length) = length {
        init.external_data.push(StringStringEntryProto {
            key: Some("length".into()),
            value: Some(length.to_string()),
        });
    }
    let name = format!("external_{}.onnx", location.replace('.', "_"));
    std::fs::write(dir.join(&name), model.encode_to_vec()).unwrap();
    name
}

fn forward_rewrite(model: &str) -> Vec<&str> {
    vec![
        "rewrite",
        model,
        "--loss-fn",
        "cross-entropy",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "-o",
        "out.onnx",
    ]
}

#[test]
fn allocation_bombs_are_refused_before_allocating() {
    let dir = step_dir();
    let d = dir.path();

    // A 200-byte npz whose header claims (2^40, 16) floats (64 TiB).
    let labels = onnx_ga::data::read_npz(&root().join("graphs/mlp_ce_adamw/data.npz")).unwrap()
        ["labels"]
        .clone();
    write_npz(
        &d.join("claims.npz"),
        &[
            ("input".into(), npy("<f4", &[1 << 40, 16], &[]), false),
            ("labels".into(), npy_of(&labels), false),
        ],
    );
    fails(
        d,
        &train_args("claims.npz", "8"),
        &[],
        &[
            "claims.npz",
            "array 'input'",
            "claims shape [1099511627776, 16]",
        ],
    );

    // A deflate bomb: 64 MiB of zeros in about 64 KB, beyond a 16 MB budget.
    let zeros = vec![0u8; 64 << 20];
    write_npz(
        &d.join("bomb.npz"),
        &[
            ("input".into(), npy("<f4", &[1 << 20, 16], &zeros), true),
            ("labels".into(), npy_of(&labels), false),
        ],
    );
    let size = std::fs::metadata(d.join("bomb.npz")).unwrap().len();
    assert!(size < 1 << 20, "the bomb is {size} bytes");
    fails(
        d,
        &train_args("bomb.npz", "8"),
        &[("ONNX_GA_MEMORY_LIMIT", "16000000")],
        &[
            "bomb.npz",
            "array 'input'",
            "more than the 16000000 bytes of memory available",
        ],
    );

    // An archive entry whose directory claims 4 GiB from a few hundred compressed bytes
    // (more than deflate can make of them): refused before inflating.
    write_npz(
        &d.join("liar.npz"),
        &[
            ("input".into(), npy("<f4", &[64, 16], &[0; 4096]), true),
            ("labels".into(), npy_of(&labels), false),
        ],
    );
    let mut bytes = std::fs::read(d.join("liar.npz")).unwrap();
    let central = bytes
        .windows(4)
        .position(|w| w == [0x50, 0x4b, 0x01, 0x02])
        .expect("a central directory entry");
    bytes[central + 24..central + 28].copy_from_slice(&0xFFFF_FF00u32.to_le_bytes());
    std::fs::write(d.join("liar.npz"), bytes).unwrap();
    fails(
        d,
        &train_args("liar.npz", "8"),
        &[],
        &[
            "liar.npz",
            "array 'input'",
            "more than compression can make of them",
        ],
    );

    // External data of 8 GiB (a sparse file) for a 2,048-byte tensor.
    let model = forward_with_external(d, "big.bin", Some(8 << 30));
    let big = std::fs::File::create(d.join("big.bin")).unwrap();
    big.set_len(8 << 30).unwrap();
    drop(big);
    fails(
        d,
        &forward_rewrite(&model),
        &[],
        &[
            "fc1.weight",
            "length is 8589934592 bytes",
            "dims [32, 16] holds 2048",
        ],
    );
    assert!(!d.join("out.onnx").exists());
    // Without a length ("to the end of the file") only the tensor's 2,048 bytes are read.
    let model = forward_with_external(d, "big.bin", None);
    succeeds(d, &forward_rewrite(&model));
}

/// An explicit `ORT_DYLIB_PATH` that names no loadable library is an error naming it (exit
/// 2), not a silent fallback to tract.
#[test]
fn a_wrong_ort_dylib_path_is_an_error_not_a_fallback() {
    let dir = step_dir();
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let data = data.to_str().unwrap();
    let not_a_library = dir.path().join("step.onnx");
    let not_a_library = not_a_library.to_str().unwrap();
    for path in ["/nonexistent/libonnxruntime.so", not_a_library] {
        let mut args = train_args(data, "8");
        args.truncate(args.len() - 2); // --engine auto, the default
        let err = fails(dir.path(), &args, &[("ORT_DYLIB_PATH", path)], &[path]);
        assert!(!err.contains("tract"), "{err}");
    }
}

/// Optimizer hyperparameters outside what the update is defined for are refused naming
/// the option; an option the optimizer does not take is a warning.
#[test]
fn invalid_hyperparameters_are_refused_ignored_ones_warned() {
    let dir = TempDir::new().unwrap();
    let graphs = root().join("graphs/mlp_ce_adamw");
    let graphs = graphs.to_str().unwrap();
    let cases: [(&[&str], &str); 7] = [
        (&["--lr=-1"], "lr=-1: must be finite and not negative"),
        (&["--lr", "nan"], "lr=NaN: must be finite and not negative"),
        (&["--lr", "inf"], "lr=inf: must be finite"),
        (
            &["--lr", "0.1", "--beta1", "1.5"],
            "beta1=1.5: must be in [0, 1)",
        ),
        (
            &["--lr", "0.1", "--beta2", "1"],
            "beta2=1: must be in [0, 1)",
        ),
        (
            &["--lr", "0.1", "--eps", "0"],
            "eps=0: must be finite and above 0",
        ),
        (
            &["--lr", "0.1", "--weight-decay", "nan"],
            "weight_decay=NaN: must be finite and not negative",
        ),
    ];
    for (extra, wanted) in cases {
        let mut args = vec!["rewrite", graphs, "-o", "out.onnx"];
        args.extend(extra);
        fails(dir.path(), &args, &[], &[wanted]);
        assert!(!dir.path().join("out.onnx").exists());
    }
    let err = succeeds(
        dir.path(),
        &[
            "rewrite",
            graphs,
            "-o",
            "out.onnx",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
            "--beta1",
            "0.5",
            "--momentum",
            "0.9",
        ],
    );
    assert!(
        err.contains("warning: beta1, momentum ignored: sgd takes no such option"),
        "{err}"
    );
}

/// `--threads` is bounded by the cores (100,000 crashed ONNX Runtime), and tract, which
/// ignores it, says so.
#[test]
fn threads_are_bounded_and_tract_says_it_ignores_them() {
    let dir = step_dir();
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let data = data.to_str().unwrap();
    let mut args = train_args(data, "8");
    args.extend(["--threads", "100000"]);
    fails(
        dir.path(),
        &args,
        &[],
        &["--threads 100000: at most", "cores available"],
    );
    let mut args = train_args(data, "8");
    args.extend(["--threads", "2"]);
    let err = succeeds(dir.path(), &args);
    assert!(
        err.contains("warning: --threads 2 is ignored: tract runs on one thread"),
        "{err}"
    );
}

/// Labels outside the classes, and indices outside an embedding, are refused before any
/// engine runs, naming the array, the row and the node (tract panicked on them, ONNX Runtime
/// failed in an unnamed node).
#[test]
fn out_of_range_labels_are_refused_naming_the_row() {
    let dir = step_dir();
    let mut data = onnx_ga::data::read_npz(&root().join("graphs/mlp_ce_adamw/data.npz")).unwrap();
    let Tensor::I64(labels) = data.get_mut("labels").unwrap() else {
        panic!("labels are int64")
    };
    labels[[5]] = 10; // 10 classes: 0..=9
    write_npz(
        &dir.path().join("labels.npz"),
        &data
            .iter()
            .map(|(k, v)| (k.clone(), npy_of(v), false))
            .collect::<Vec<_>>(),
    );
    for engine in ["tract", "auto"] {
        let mut args = train_args("labels.npz", "8");
        *args.last_mut().unwrap() = engine;
        fails(
            dir.path(),
            &args,
            &[],
            &[
                "labels.npz",
                "array 'labels': value 10 at row 5 is outside [0, 10)",
                "SoftmaxCrossEntropyLoss",
            ],
        );
    }
}

/// Below the host's checks, a panic inside tract is an error of the run, not a crash.
#[test]
fn a_panic_inside_tract_is_an_error() {
    use onnx_ga::engine::EngineKind;
    let dir = step_dir();
    let step = onnx_ga::model::load_model_with_data(&dir.path().join("step.onnx")).unwrap();
    let options = onnx_ga::engine::ort::SessionOptions {
        threads: 1,
        optimize: true,
        ..Default::default()
    };
    let mut trainer =
        onnx_ga::train::Trainer::with_engine(&step, EngineKind::Tract, &options).unwrap();
    let data = onnx_ga::data::read_npz(&root().join("graphs/mlp_ce_adamw/data.npz")).unwrap();
    let mut batch = onnx_ga::train::micro_batch(&data, 64, 8, 0);
    let Tensor::I64(labels) = batch.get_mut("labels").unwrap() else {
        panic!("labels are int64")
    };
    labels[[0]] = 1 << 40;
    let err = match trainer.step(&batch, false) {
        Ok(_) => panic!("an out-of-range label must fail the run"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("tract"), "{err}");
}

#[test]
fn empty_axes_are_refused() {
    let data = std::collections::BTreeMap::from([(
        "x".to_string(),
        Tensor::F32(ndarray::ArrayD::zeros(ndarray::IxDyn(&[4, 0]))),
    )]);
    let data = onnx_ga::dataset::Dataset::from_arrays(data);
    let err = onnx_ga::index_check::check_data(&data, &[]).unwrap_err();
    assert!(
        err.contains("array 'x' has shape [4, 0]: axis 1 is empty"),
        "{err}"
    );
}

/// `rewrite` on a step it wrote, or on a training_model.onnx without its folder, says what
/// the file is and what to pass (it said "gradient '' ... is not a value of the graph").
#[test]
fn rewriting_a_step_or_a_lone_training_graph_says_what_to_pass() {
    let dir = step_dir();
    fails(
        dir.path(),
        &["rewrite", "step.onnx", "-o", "again.onnx", "--lr", "0.1"],
        &[],
        &[
            "step.onnx is already a training step",
            "onnx-ga train step.onnx",
        ],
    );
    let lone = root().join("graphs/mlp_ce_adamw/training_model.onnx");
    let lone = lone.to_str().unwrap();
    for extra in [
        &["--lr", "0.1"][..],
        &["--lr", "0.1", "--optimizer", "adamw"],
    ] {
        let mut args = vec!["rewrite", lone, "-o", "again.onnx"];
        args.extend(extra);
        fails(dir.path(), &args, &[], &["pass the artifacts folder"]);
    }
    assert!(!dir.path().join("again.onnx").exists());
}

/// State, progress and metrics files get the permissions of any other output (0666 less
/// the umask), not tempfile's 0600.
#[cfg(unix)]
#[test]
fn state_and_metrics_files_take_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = step_dir();
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let mut args = train_args(data.to_str().unwrap(), "8");
    args.extend([
        "--save-state",
        "s.npz",
        "--metrics",
        "m.jsonl",
        "--save-every",
        "1",
    ]);
    succeeds(dir.path(), &args);
    // What a plain create gives under this process's umask (the same as the child's).
    let plain = dir.path().join("plain");
    std::fs::File::create(&plain).unwrap();
    let mode = |p: &str| {
        std::fs::metadata(dir.path().join(p))
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    };
    for f in ["s.npz", "m.jsonl", "s.npz.progress.json"] {
        assert_eq!(mode(f), mode("plain"), "{f}");
    }
}

/// A step its engine cannot load is written with a warning saying which engine and why
/// (`--precision bf16`: neither the CPU provider nor tract has the kernels; a pipeline
/// without legalize-ort keeps ops only the training build has), and `inspect` says so.
#[test]
fn steps_an_engine_cannot_load_are_warned_about() {
    let dir = TempDir::new().unwrap();
    let graphs = root().join("graphs/mlp_ce_adamw");
    let graphs = graphs.to_str().unwrap();
    let rewrite = |out: &str, extra: &[&str]| {
        let mut args = vec!["rewrite", graphs, "-o", out];
        args.extend(extra);
        succeeds(dir.path(), &args)
    };
    let err = rewrite("bf16.onnx", &["--lr", "0.1", "--precision", "bf16"]);
    assert!(
        err.contains("warning: ort loads this bf16 step only with --device cuda"),
        "{err}"
    );
    let err = rewrite(
        "bf16_tract.onnx",
        &["--lr", "0.1", "--precision", "bf16", "--engine", "tract"],
    );
    assert!(
        err.contains("warning: tract cannot load this step: tract has no bfloat16"),
        "{err}"
    );
    let err = rewrite(
        "training_ops.onnx",
        &["--pipeline", "grad-accum(steps=2),optimizer(lr=0.1),dce"],
    );
    assert!(
        err.contains("warning: ort cannot load this step: standard ONNX Runtime lacks com.microsoft::ReluGrad"),
        "{err}"
    );
    let err = rewrite("fine.onnx", &["--lr", "0.1"]);
    assert!(!err.contains("warning"), "{err}");

    // What inspect shows of them.
    let fits = |file: &str| {
        let proto = onnx_ga::model::load_model(&dir.path().join(file)).unwrap();
        let manifest = onnx_ga::state::Manifest::from_model(&proto).unwrap();
        let model = onnx_ga::ir::Model::from_proto(proto);
        let ops = onnx_ga::inspect::training_only_ops(&model);
        onnx_ga::inspect::StepView::of(&model, &manifest, &ops)
            .unwrap()
            .engines
    };
    let tract = |file: &str| {
        fits(file)
            .into_iter()
            .find(|f| f.engine == "tract")
            .unwrap()
    };
    assert!(!tract("bf16.onnx").runs);
    assert_eq!(tract("bf16.onnx").note, "tract has no bfloat16");
    assert!(fits("training_ops.onnx").iter().all(|f| !f.runs));
    assert!(fits("fine.onnx").iter().all(|f| f.runs));
}

/// A step that decodes and validates but that an engine refuses (here a Gemm whose transB
/// was flipped, so its inner dimensions disagree) is a problem of the input: exit 2 with
/// the engine's reason, on both engines.
#[test]
fn a_step_an_engine_refuses_exits_2() {
    let dir = step_dir();
    let path = dir.path().join("step.onnx");
    let mut model = onnx_ga::model::load_model(&path).unwrap();
    let gemm = model
        .graph
        .as_mut()
        .unwrap()
        .node
        .iter_mut()
        .find(|n| n.op_type() == "Gemm")
        .expect("the MLP has a Gemm");
    let trans_b = gemm
        .attribute
        .iter_mut()
        .find(|a| a.name() == "transB")
        .expect("transB");
    trans_b.i = Some(1 - trans_b.i());
    std::fs::write(dir.path().join("bad.onnx"), model.encode_to_vec()).unwrap();
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    for engine in ["tract", "ort"] {
        if engine == "ort" && !ort_present() {
            continue;
        }
        let mut args = train_args(data.to_str().unwrap(), "8");
        args[1] = "bad.onnx";
        *args.last_mut().unwrap() = engine;
        fails(
            dir.path(),
            &args,
            &[],
            &[if engine == "ort" {
                "ONNX Runtime"
            } else {
                "tract"
            }],
        );
    }
}

/// Whether ONNX Runtime loads here (ORT_DYLIB_PATH or the repository's .venv-ort).
fn ort_present() -> bool {
    onnx_ga::runtime::init_onnxruntime().is_ok()
}
