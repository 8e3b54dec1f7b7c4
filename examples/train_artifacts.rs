//! Rewrites a shipped ONNX Runtime artifacts folder into a gradient-accumulation step
//! (K=4 micro-batches of 8 per AdamW update) and trains it 8 windows on ONNX Runtime, with
//! the learning rate scheduled from the host (linear warm-up over 2 windows, then cosine
//! decay), as a host schedules any step's `ga.lr` input.
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
    let (peak_lr, warmup) = (0.01f32, 2u64);
    // The rate of window w (0-based): linear warm-up, then cosine decay to 10% of the peak.
    let schedule = |w: u64| -> f32 {
        if w < warmup {
            peak_lr * (w + 1) as f32 / warmup as f32
        } else {
            let progress = (w - warmup) as f32 / (windows - warmup).max(1) as f32;
            peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f32::consts::PI * progress).cos()))
        }
    };

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
        let window = i / k;
        if i % k == 0 {
            // Only the window's last micro-step reads it (the update); set per window.
            trainer.set_learning_rate(schedule(window))?;
        }
        let m = trainer.step(&micro_batch(&data, samples, batch, i), false)?;
        window_loss += m.loss / k as f32;
        if m.applied {
            println!(
                "window {:2}: lr {:.5}, mean micro-batch loss {window_loss:.5}",
                window + 1,
                schedule(window)
            );
            window_loss = 0.0;
        }
    }
    Ok(())
}
