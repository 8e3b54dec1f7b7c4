//! The data and state readers (.npz, .safetensors) and the trainer's input checks on
//! arbitrary bytes: the bytes are written to a file (the readers take paths), read, and
//! checked against a real step (graphs/mlp_ce_adamw rewritten once, on tract): as data
//! (`check_data`, a micro-batch) and as an init state (`load_state`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

struct Fixture {
    dir: PathBuf,
    data_inputs: Vec<String>,
    trainer: Mutex<onnx_ga::train::Trainer>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let graph = onnx_ga::signature::open(
            &root.join("graphs/mlp_ce_adamw"),
            &Default::default(),
        )
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
            trainer: Mutex::new(trainer),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let fx = fixture();
    // The first byte picks the format.
    let (kind, bytes) = match data.split_first() {
        Some((k, rest)) => (*k, rest),
        None => return,
    };
    let path = fx.dir.join(if kind & 1 == 0 { "x.npz" } else { "x.safetensors" });
    std::fs::write(&path, bytes).unwrap();
    let read = if kind & 1 == 0 {
        onnx_ga::data::read_npz(&path)
    } else {
        onnx_ga::data::read_safetensors(&path)
    };
    let Ok(arrays) = read else {
        return;
    };
    let mut trainer = fx.trainer.lock().unwrap();
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
});
