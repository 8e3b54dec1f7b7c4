//! Training data left in its file (`onnx_ga::dataset`): arrays NumPy stored plainly
//! (`np.savez`) are read a micro-batch at a time from their offset, the others decoded into
//! memory. The reference is the whole archive decoded by `ndarray-npy` (the in-memory reader
//! every state file goes through), rows picked by `ndarray`'s `select`.

use std::collections::BTreeMap;
use std::path::Path;

use ndarray::{ArrayD, IxDyn, ShapeBuilder};
use ndarray_npy::NpzWriter;
use onnx_ga::data::Tensor;
use onnx_ga::dataset::Dataset;
use onnx_ga::index_check::IndexLimit;
use onnx_ga::sample_order::SampleOrder;
use onnx_ga::train::micro_batch;
use tempfile::TempDir;

use crate::common::{cli_rewritten, cli_train, ort_available, root};

/// Values that differ in every element, so a row read from the wrong offset shows.
fn counting<T>(shape: &[usize], of: impl Fn(usize) -> T) -> ArrayD<T> {
    let n = shape.iter().product();
    ArrayD::from_shape_vec(IxDyn(shape), (0..n).map(of).collect()).unwrap()
}

/// An `.npz` of five arrays of `rows` rows: four np.savez would leave in the file (float32,
/// float64, int64, int32) and a bool one, plus a Fortran-ordered float32 array; `compress`
/// deflates them all, as np.savez_compressed does.
fn write_sample(path: &Path, rows: usize, compress: bool) -> BTreeMap<String, Tensor> {
    let fortran: ArrayD<f32> = ArrayD::from_shape_vec(
        IxDyn(&[rows, 3]).f(),
        (0..rows * 3).map(|i| i as f32 * 0.5).collect(),
    )
    .unwrap();
    let arrays = BTreeMap::from([
        (
            "f32".to_string(),
            Tensor::F32(counting(&[rows, 3, 5], |i| i as f32 * 0.25 - 7.0)),
        ),
        (
            "f64".to_string(),
            Tensor::F64(counting(&[rows, 2], |i| i as f64 / 3.0)),
        ),
        (
            "i64".to_string(),
            Tensor::I64(counting(&[rows, 4], |i| i as i64 * 1_000_000_007)),
        ),
        (
            "i32".to_string(),
            Tensor::I32(counting(&[rows], |i| -(i as i32))),
        ),
        (
            "mask".to_string(),
            Tensor::Bool(counting(&[rows, 2], |i| i % 3 == 0)),
        ),
        ("fortran".to_string(), Tensor::F32(fortran)),
    ]);
    let file = std::fs::File::create(path).unwrap();
    let mut npz = match compress {
        true => NpzWriter::new_compressed(file),
        false => NpzWriter::new(file),
    };
    for (name, t) in &arrays {
        match t {
            Tensor::F32(a) => npz.add_array(name.as_str(), a),
            Tensor::F64(a) => npz.add_array(name.as_str(), a),
            Tensor::I64(a) => npz.add_array(name.as_str(), a),
            Tensor::I32(a) => npz.add_array(name.as_str(), a),
            Tensor::Bool(a) => npz.add_array(name.as_str(), a),
        }
        .unwrap();
    }
    npz.finish().unwrap();
    arrays
}

fn names(arrays: &BTreeMap<String, Tensor>) -> Vec<String> {
    arrays.keys().cloned().collect()
}

#[test]
fn stored_arrays_stay_in_the_file_and_read_row_for_row() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("data.npz");
    let rows = 37;
    let written = write_sample(&path, rows, false);
    let reference = onnx_ga::data::read_npz(&path).unwrap();
    assert_eq!(reference, written, "ndarray-npy reads back what it wrote");

    let opened = Dataset::open(&path, &names(&written)).unwrap();
    let data = opened.dataset;
    assert!(opened.ignored.is_empty());
    let in_file: Vec<&str> = data.left_in_file().collect();
    assert_eq!(in_file, ["f32", "f64", "i32", "i64"]);
    let held: Vec<&str> = data.held().map(|(n, _)| n).collect();
    assert_eq!(held, ["fortran", "mask"]);

    // Micro-batches of 8 over 37 rows: one run of rows, or two where the window wraps.
    for step in 0..12 {
        let got = data
            .micro_batch(SampleOrder::InOrder, rows, 8, step)
            .unwrap();
        assert_eq!(
            got,
            micro_batch(&reference, rows, 8, step),
            "micro-step {step}"
        );
    }
    // Any rows, in any order.
    let picked = [36, 0, 5, 6, 7, 3, 3];
    let got = data.rows(&picked).unwrap();
    for (name, t) in &reference {
        assert_eq!(got[name], t.rows(&picked), "array '{name}'");
    }
    // A row past the end is an error naming the array, never bytes from elsewhere.
    let err = data.rows(&[rows]).unwrap_err().to_string();
    assert!(
        err.contains("data.npz") && err.contains("has 37 rows; row 37"),
        "{err}"
    );
}

#[test]
fn compressed_arrays_are_held_and_read_alike() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("data.npz");
    let written = write_sample(&path, 21, true);
    let data = Dataset::open(&path, &names(&written)).unwrap().dataset;
    assert_eq!(
        data.left_in_file().count(),
        0,
        "deflated arrays are decoded"
    );
    for step in 0..6 {
        assert_eq!(
            data.micro_batch(SampleOrder::InOrder, 21, 4, step).unwrap(),
            micro_batch(&written, 21, 4, step)
        );
    }
}

/// The index check reads an array left in the file a chunk (8 MiB) at a time and names the
/// row of the first bad value, wherever it falls among the chunks.
#[test]
fn the_index_check_walks_a_large_array_chunk_by_chunk() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("tokens.npz");
    let rows = 5000;
    let width = 512; // 4 KiB a row: the array is 20 MB, three chunks.
    let bad_row = 4321;
    let mut tokens = counting(&[rows, width], |i| (i % 50_000) as i64);
    tokens[[bad_row, 17]] = 50_257;
    let mut npz = NpzWriter::new(std::fs::File::create(&path).unwrap());
    npz.add_array("tokens", &tokens).unwrap();
    npz.finish().unwrap();

    let data = Dataset::open(&path, &["tokens".to_string()])
        .unwrap()
        .dataset;
    assert_eq!(data.left_in_file().collect::<Vec<_>>(), ["tokens"]);
    let limit = |high: i64| IndexLimit {
        input: "tokens".into(),
        low: -high,
        high,
        ignore: None,
        what: "rows of the embedding".into(),
        node: "'embed' (Gather)".into(),
    };
    let err = onnx_ga::index_check::check_data(&data, &[limit(50_257)]).unwrap_err();
    assert!(
        err.contains(&format!(
            "value 50257 at row {bad_row} is outside [-50257, 50257)"
        )),
        "{err}"
    );
    onnx_ga::index_check::check_data(&data, &[limit(50_258)]).unwrap();
}

/// mlp_ce_adamw's 64 rows repeated to `rows`, written uncompressed.
fn repeated_data(path: &Path, rows: usize) {
    let data = onnx_ga::data::read_npz(&root().join("graphs/mlp_ce_adamw/data.npz")).unwrap();
    let every: Vec<usize> = (0..rows).map(|r| r % 64).collect();
    let mut npz = NpzWriter::new(std::fs::File::create(path).unwrap());
    for (name, t) in &data {
        match t.rows(&every) {
            Tensor::F32(a) => npz.add_array(name.as_str(), &a),
            Tensor::I64(a) => npz.add_array(name.as_str(), &a),
            other => panic!("{name}: {:?}", other.elem_type()),
        }
        .unwrap();
    }
    npz.finish().unwrap();
}

/// The metrics lines of a `train --metrics` run, without the wall-clock fields.
fn losses(metrics: &Path) -> Vec<String> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            format!("{} {} {}", v["step"], v["loss"], v["applied"])
        })
        .collect()
}

/// Data four times the memory budget trains: its arrays stay in the file. The run equals
/// the one on the shipped 64 rows bit for bit (its 8 micro-batches of 8 are those rows), and
/// its state file is byte-identical.
#[test]
fn train_reads_data_larger_than_its_memory_budget_from_the_file() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let step = cli_rewritten(d, "step.onnx", &[]);
    let big = d.join("big.npz");
    repeated_data(&big, 1 << 20); // 1M rows: 64 MiB of input, 8 MiB of labels
    let budget = "16000000";
    assert!(std::fs::metadata(&big).unwrap().len() > 4 * 16_000_000);
    let shipped = root().join("graphs/mlp_ce_adamw/data.npz");
    let run = |data: &Path, tag: &str| {
        let metrics = d.join(format!("{tag}.jsonl"));
        let state = d.join(format!("{tag}-state.npz"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
            .args(cli_train(&step, data, "8", &["--quiet"]))
            .args(["--metrics", metrics.to_str().unwrap()])
            .args(["--save-state", state.to_str().unwrap()])
            .env("ONNX_GA_MEMORY_LIMIT", budget)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (losses(&metrics), std::fs::read(&state).unwrap())
    };
    let (big_losses, big_state) = run(&big, "big");
    let (shipped_losses, shipped_state) = run(&shipped, "shipped");
    assert_eq!(big_losses.len(), 8);
    assert_eq!(big_losses, shipped_losses);
    assert!(big_state == shipped_state, "the state files differ");

    // The same data compressed must be decoded whole: refused beyond the budget.
    let data = onnx_ga::data::read_npz(&big).unwrap();
    let compressed = d.join("compressed.npz");
    let mut npz = NpzWriter::new_compressed(std::fs::File::create(&compressed).unwrap());
    for (name, t) in &data {
        match t {
            Tensor::F32(a) => npz.add_array(name.as_str(), a),
            Tensor::I64(a) => npz.add_array(name.as_str(), a),
            _ => unreachable!(),
        }
        .unwrap();
    }
    npz.finish().unwrap();
    drop(data);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(cli_train(&step, &compressed, "8", &["--quiet"]))
        .env("ONNX_GA_MEMORY_LIMIT", budget)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("more than the 16000000 bytes of memory available"),
        "{err}"
    );
}

/// The archive `bytes` with one bit flipped in the data of array `name` (past its `.npy`
/// header, found after the entry's local file header).
fn damaged(bytes: &[u8], name: &str) -> Vec<u8> {
    let find = |hay: &[u8], needle: &[u8], from: usize| {
        from + hay[from..]
            .windows(needle.len())
            .position(|w| w == needle)
            .unwrap_or_else(|| panic!("{name}: not found"))
    };
    let entry = find(bytes, format!("{name}.npy").as_bytes(), 0);
    let magic = find(bytes, b"\x93NUMPY", entry);
    let header_len = u16::from_le_bytes([bytes[magic + 8], bytes[magic + 9]]) as usize;
    let mut out = bytes.to_vec();
    out[magic + 10 + header_len + 3] ^= 0x01;
    out
}

/// One flipped bit in any array's data, left in the file or decoded into memory: `open`
/// fails naming the file and the array (the archive's CRC-32, as `np.load` checks it),
/// instead of training on the altered numbers. The intact file opens.
#[test]
fn a_damaged_array_is_refused_by_its_crc() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("data.npz");
    let written = write_sample(&path, 21, false);
    let bytes = std::fs::read(&path).unwrap();
    Dataset::open(&path, &names(&written)).unwrap();
    for name in written.keys() {
        let bad = dir.path().join(format!("bad_{name}.npz"));
        std::fs::write(&bad, damaged(&bytes, name)).unwrap();
        let err = Dataset::open(&bad, &names(&written))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("array '{name}'"))
                && err.contains("CRC-32")
                && err.contains(bad.to_str().unwrap()),
            "{name}: {err}"
        );
        // onnx_ga::data::read_npz (the validation data, state files) alike.
        let err = onnx_ga::data::read_npz(&bad).unwrap_err().to_string();
        assert!(err.contains("CRC-32"), "{name}: {err}");
    }
}
