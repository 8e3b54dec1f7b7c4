//! Rewrites a shipped ONNX Runtime artifacts folder into a gradient-accumulation step
//! (K=4 micro-batches of 8 per AdamW update) and trains it 8 windows on ONNX Runtime.
//!
//! `cargo run --example train_artifacts -- graphs/mlp_ce_adamw`
//! (ONNX Runtime: `bash scripts/install-ort.sh`, found automatically afterwards.)

use std::path::PathBuf;

use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::signature::{self, ExplicitRoles};
use onnx_ga::train::{micro_batch, Trainer};

fn main() -> anyhow::Result<()> {
    let folder = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "graphs/mlp_ce_adamw".into()),
    );
    let (k, batch, windows) = (4u64, 8usize, 8u64);

    let graph = signature::open(&folder, &ExplicitRoles::default())?;
    let spec = format!("grad-accum(steps={k},normalize=mean),optimizer(lr=0.01),legalize-ort,dce");
    let step = onnx_ga::step::build_step(graph, &spec, false)?;
    println!(
        "{} state tensors; pipeline {}",
        step.manifest.state.len(),
        step.manifest.pipeline
    );

    let mut trainer = Trainer::new(&step.model.to_proto(), &SessionOptions::default())?;
    let data = onnx_ga::data::read_npz(&folder.join("data.npz"))?;
    let samples = trainer.check_data(&data, &folder.join("data.npz"))?;
    let mut window_loss = 0.0;
    for i in 0..k * windows {
        let m = trainer.step(&micro_batch(&data, samples, batch, i), false)?;
        window_loss += m.loss / k as f32;
        if m.applied {
            println!(
                "window {:2}: mean micro-batch loss {window_loss:.5}",
                (i + 1) / k
            );
            window_loss = 0.0;
        }
    }
    Ok(())
}
