//! The data and state readers (.npz, .safetensors) and the trainer's input checks on
//! arbitrary bytes: the bytes are written to a file (the readers take paths), read, and
//! checked against a real step (graphs/mlp_ce_adamw rewritten once, on tract): as data
//! (`check_data`, a micro-batch) and as an init state (`load_state`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::cell::RefCell;
use std::path::{Path, PathBuf};

struct Fixture {
    dir: PathBuf,
    data_inputs: Vec<String>,
    trainer: RefCell<onnx_ga::train::Trainer>,
}

// libFuzzer runs the target on one thread; the Trainer is not Send (its collective seam is
// a plain trait object), so the fixture is per thread.
thread_local! {
    static FIXTURE: Fixture = make_fixture();
}

fn make_fixture() -> Fixture {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let graph = onnx_ga::signature::open(&root.join("graphs/mlp_ce_adamw"), &Default::default())
        .expect("shipped graph");
    let step = onnx_ga::step::build_step(
        graph,
        "grad-accum(steps=2),optimizer(lr=0.01),legalize-ort,dce",
        false,
    )
    .expect("step");
    let trainer = onnx_ga::train::Trainer::with_engine(
        &step.model.to_proto(),
        onnx_ga::engine::EngineKind::Tract,
        &Default::default(),
    )
    .expect("trainer");
    let dir = std::env::temp_dir().join(format!("onnx-ga-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    Fixture {
        dir,
        data_inputs: step.manifest.data_inputs.clone(),
        trainer: RefCell::new(trainer),
    }
}

fuzz_target!(|data: &[u8]| FIXTURE.with(|fx| check(fx, data)));

fn check(fx: &Fixture, data: &[u8]) {
    // The first byte picks the format.
    let (kind, bytes) = match data.split_first() {
        Some((k, rest)) => (*k, rest),
        None => return,
    };
    let path = fx.dir.join(if kind & 1 == 0 {
        "x.npz"
    } else {
        "x.safetensors"
    });
    std::fs::write(&path, bytes).unwrap();
    let read = if kind & 1 == 0 {
        onnx_ga::data::read_npz(&path)
    } else {
        onnx_ga::data::read_safetensors(&path)
    };
    let Ok(arrays) = read else {
        return;
    };
    let mut trainer = fx.trainer.borrow_mut();
    if let Ok(samples) = trainer.check_data(&arrays, &path) {
        if samples > 0 {
            // What the trainer feeds: the step's data inputs (checked above).
            let fed: std::collections::BTreeMap<_, _> = arrays
                .iter()
                .filter(|(k, _)| fx.data_inputs.contains(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let batch = 1 + (kind as usize >> 1) % 8;
            let _ = onnx_ga::train::micro_batch(&fed, samples, batch, 3);
        }
    }
    let _ = trainer.load_state(&path);
    drop(trainer);
    if kind & 1 == 0 {
        check_as_training_data(fx, &path, kind);
    }
}

/// The bytes as `train --data` reads them: arrays left in the file or decoded
/// (`dataset::Dataset`), checked, index-checked and read a micro-batch at a time, in order
/// and shuffled.
fn check_as_training_data(fx: &Fixture, path: &Path, kind: u8) {
    let Ok(opened) = onnx_ga::dataset::Dataset::open(path, &fx.data_inputs) else {
        return;
    };
    let data = opened.dataset;
    let limits = [onnx_ga::index_check::IndexLimit {
        input: "labels".into(),
        low: 0,
        high: 10,
        ignore: Some(-100),
        node: "SoftmaxCrossEntropyLoss".into(),
        what: "classes".into(),
    }];
    let _ = onnx_ga::index_check::check_data(&data, &limits);
    let trainer = fx.trainer.borrow();
    let Ok(samples) = trainer.check_data(&data, path) else {
        return;
    };
    let batch = 1 + (kind as usize >> 1) % 8;
    for order in [
        onnx_ga::sample_order::SampleOrder::InOrder,
        onnx_ga::sample_order::SampleOrder::Shuffled { seed: kind as u64 },
    ] {
        for step in [0, 3, u64::MAX] {
            let _ = data.micro_batch(order, samples, batch, step);
        }
    }
}
