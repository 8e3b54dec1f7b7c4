//! Which rows each micro-step takes (`onnx_ga::sample_order`, `train --shuffle SEED`): in
//! order, micro-step g takes stream positions [g·B, (g+1)·B) mod N; shuffled, each epoch of
//! the stream is a permutation of the rows drawn from the seed and the epoch.

use std::collections::BTreeMap;
use std::path::Path;

use ndarray_npy::NpzWriter;
use onnx_ga::data::Tensor;
use onnx_ga::sample_order::SampleOrder;
use tempfile::TempDir;

use crate::common::{cli_rewritten, cli_train, ort_available, root};

fn epoch(order: SampleOrder, n: usize, e: u128) -> Vec<usize> {
    (0..n as u128)
        .map(|j| order.row_at(n, e * n as u128 + j))
        .collect()
}

#[test]
fn every_shuffled_epoch_is_a_permutation_of_the_rows_and_each_differs() {
    for n in [1, 2, 3, 5, 8, 63, 64, 65, 1000, 4097] {
        for seed in [0, 7, u64::MAX] {
            let order = SampleOrder::Shuffled { seed };
            let epochs: Vec<Vec<usize>> = (0..3).map(|e| epoch(order, n, e)).collect();
            for (e, rows) in epochs.iter().enumerate() {
                let mut sorted = rows.clone();
                sorted.sort_unstable();
                assert_eq!(
                    sorted,
                    (0..n).collect::<Vec<_>>(),
                    "N {n}, seed {seed}, epoch {e}"
                );
            }
            if n >= 8 {
                let identity: Vec<usize> = (0..n).collect();
                assert_ne!(epochs[0], identity, "N {n}, seed {seed}");
                assert_ne!(epochs[0], epochs[1], "N {n}, seed {seed}");
                assert_ne!(epochs[1], epochs[2], "N {n}, seed {seed}");
                let other = SampleOrder::Shuffled { seed: seed ^ 1 };
                assert_ne!(epochs[0], epoch(other, n, 0), "N {n}, seed {seed}");
            }
            // The same order every time it is asked for.
            assert_eq!(epochs[2], epoch(order, n, 2));
        }
    }
    // An epoch far along the stream, of data too large to list.
    let huge = SampleOrder::Shuffled { seed: 3 };
    let row = huge.row_at(usize::MAX, u128::from(u64::MAX) * 1000);
    assert!(row < usize::MAX);
}

/// Micro-batches straddle epochs: the stream is cut into B positions at a time whatever N.
#[test]
fn micro_batches_cut_the_stream_of_epochs() {
    for (n, b) in [(64, 8), (37, 8), (5, 5), (7, 3), (1000, 999)] {
        for order in [SampleOrder::InOrder, SampleOrder::Shuffled { seed: 11 }] {
            let stream: Vec<usize> = (0..4).flat_map(|e| epoch(order, n, e)).collect();
            for g in 0..(4 * n / b) as u64 {
                let at = g as usize * b;
                assert_eq!(
                    order.rows(n, b, g),
                    stream[at..at + b],
                    "{order:?}: N {n}, B {b}, micro-step {g}"
                );
            }
        }
    }
    // In order, as the README says: rows g·B mod N onwards, wrapping; far along too.
    for (n, b, g) in [
        (64, 8, 3u64),
        (37, 8, 5),
        (10, 10, u64::MAX),
        (1 << 40, 1 << 20, u64::MAX),
    ] {
        let want: Vec<usize> = (0..b as u128)
            .map(|j| ((u128::from(g) * b as u128 + j) % n as u128) as usize)
            .collect();
        assert_eq!(
            SampleOrder::InOrder.rows(n, b, g),
            want,
            "N {n}, B {b}, g {g}"
        );
    }
}

/// Which row lands at a position is uniform over the rows: a chi-square test of the rows
/// seen at each of the 8 positions over 4000 epochs of 8 rows (49 degrees of freedom: a
/// fair shuffle exceeds 100 with probability about 2e-5; the seed is fixed, so the test
/// is deterministic).
#[test]
fn shuffled_rows_land_uniformly_over_positions() {
    let (n, epochs) = (8usize, 4000u128);
    let order = SampleOrder::Shuffled { seed: 2026 };
    let mut counts = vec![[0u32; 8]; n];
    for e in 0..epochs {
        for (position, row) in epoch(order, n, e).into_iter().enumerate() {
            counts[position][row] += 1;
        }
    }
    let expected = epochs as f64 / n as f64;
    let chi2: f64 = counts
        .iter()
        .flatten()
        .map(|c| (*c as f64 - expected).powi(2) / expected)
        .sum();
    assert!(chi2 < 100.0, "chi-square {chi2:.1} over {counts:?}");
}

fn write_data(path: &Path, data: &BTreeMap<String, Tensor>) {
    let mut npz = NpzWriter::new(std::fs::File::create(path).unwrap());
    for (name, t) in data {
        match t {
            Tensor::F32(a) => npz.add_array(name.as_str(), a),
            Tensor::I64(a) => npz.add_array(name.as_str(), a),
            other => panic!("{name}: {:?}", other.elem_type()),
        }
        .unwrap();
    }
    npz.finish().unwrap();
}

fn run(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "onnx-ga {args:?}: {err}");
    err
}

/// `train --shuffle 11` for 3 epochs trains bit for bit like `train` in order on the rows
/// written out in the shuffled order; a run resumed halfway with the same seed ends in the
/// same state file, and resuming without the seed says the order changed.
#[test]
fn train_shuffle_takes_the_rows_in_the_shuffled_order_across_epochs_and_resumes() {
    if !ort_available() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let d = dir.path();
    let step = cli_rewritten(d, "step.onnx", &[]);
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let state = |name: &str| d.join(name).to_str().unwrap().to_string();

    let shuffled = state("shuffled.npz");
    run(&[
        cli_train(&step, &data, "24", &["--quiet", "--shuffle", "11"]),
        vec!["--save-state", &shuffled],
    ]
    .concat());

    // The reference: the 24 micro-batches' rows (3 epochs of 64) written out, in order.
    let order = SampleOrder::Shuffled { seed: 11 };
    let stream: Vec<usize> = (0..24).flat_map(|g| order.rows(64, 8, g)).collect();
    let original = onnx_ga::data::read_npz(&data).unwrap();
    let laid_out: BTreeMap<String, Tensor> = original
        .iter()
        .map(|(k, t)| (k.clone(), t.rows(&stream)))
        .collect();
    let laid_out_file = d.join("laid_out.npz");
    write_data(&laid_out_file, &laid_out);
    let reference = state("reference.npz");
    run(&[
        cli_train(&step, &laid_out_file, "24", &["--quiet"]),
        vec!["--save-state", &reference],
    ]
    .concat());
    let bytes = |p: &str| std::fs::read(p).unwrap();
    assert!(
        bytes(&shuffled) == bytes(&reference),
        "--shuffle trains otherwise"
    );

    // In order, the same 24 micro-steps end elsewhere.
    let in_order = state("in_order.npz");
    run(&[
        cli_train(&step, &data, "24", &["--quiet"]),
        vec!["--save-state", &in_order],
    ]
    .concat());
    assert!(bytes(&in_order) != bytes(&shuffled));

    // Halfway, then resumed with the same seed: the same state, and no note.
    let resumed = state("resumed.npz");
    run(&[
        cli_train(&step, &data, "12", &["--quiet", "--shuffle", "11"]),
        vec!["--save-state", &resumed],
    ]
    .concat());
    let kept = state("kept.npz");
    std::fs::copy(&resumed, &kept).unwrap();
    std::fs::copy(
        format!("{resumed}.progress.json"),
        format!("{kept}.progress.json"),
    )
    .unwrap();
    let err = run(&[
        cli_train(&step, &data, "12", &["--shuffle", "11"]),
        vec!["--init-state", &resumed, "--save-state", &resumed],
    ]
    .concat());
    assert!(err.contains("resuming at micro-step 12"), "{err}");
    assert!(!err.contains("was saved by a run"), "{err}");
    assert!(
        bytes(&resumed) == bytes(&shuffled),
        "the resumed run differs"
    );

    // Resumed without it: trains on, with a note that the order is not the first run's.
    let err = run(&[
        cli_train(&step, &data, "12", &[]),
        vec!["--init-state", &kept, "--save-state", &kept],
    ]
    .concat());
    assert!(
        err.contains("was saved by a run taking the data's rows shuffled with --shuffle 11; this run takes them in order"),
        "{err}"
    );
}
