//! The step's control inputs from the host: the learning rate (for schedules) and K. Each
//! must train exactly like a step rewritten with that value, split or whole.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{ort_available, read_npz, root};
use onnx_ga::data::Tensor;
use onnx_ga::proto::ModelProto;
use onnx_ga::state::Role;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

const MODEL: &str = "mlp_ce_adamw";

fn step(k: i64, lr: f32) -> ModelProto {
    common::rewrite_shipped(
        MODEL,
        &format!("grad-accum(steps={k}),optimizer(lr={lr},weight_decay=0.01),legalize-ort,dce"),
    )
}

fn trainer(step: &ModelProto, split: bool) -> Trainer {
    let options = TrainOptions {
        split,
        ..TrainOptions::default()
    };
    Trainer::with_options(step, &options).unwrap_or_else(|e| panic!("{e}"))
}

fn data() -> BTreeMap<String, Tensor> {
    read_npz(&root().join("graphs").join(MODEL).join("data.npz"))
}

/// Micro-steps `from..to`; returns which applied.
fn run(t: &mut Trainer, data: &BTreeMap<String, Tensor>, from: u64, to: u64) -> Vec<bool> {
    let samples = t.check_data(data, Path::new("data.npz")).unwrap();
    (from..to)
        .map(|i| {
            t.step(&micro_batch(data, samples, 8, i), false)
                .unwrap()
                .applied
        })
        .collect()
}

#[test]
fn a_learning_rate_schedule_equals_steps_rewritten_with_each_rate() {
    if !ort_available() {
        return;
    }
    let data = data();
    let dir = tempfile::tempdir().unwrap();
    for split in [true, false] {
        // Two windows at 0.01, then two at 0.003 set from the host...
        let mut scheduled = trainer(&step(4, 0.01), split);
        run(&mut scheduled, &data, 0, 8);
        let halfway = dir.path().join(format!("halfway-{split}.npz"));
        scheduled.save_state(&halfway).unwrap();
        scheduled.set_learning_rate(0.003).unwrap();
        run(&mut scheduled, &data, 8, 16);
        // ...equal two windows of a step rewritten with 0.003, from the same state.
        let mut rewritten = trainer(&step(4, 0.003), split);
        rewritten.load_state(&halfway).unwrap();
        run(&mut rewritten, &data, 8, 16);
        assert_eq!(
            scheduled.state().unwrap(),
            rewritten.state().unwrap(),
            "split={split}"
        );
    }
}

#[test]
fn learning_rate_zero_leaves_parameters_bit_identical() {
    if !ort_available() {
        return;
    }
    let data = data();
    let mut t = trainer(&step(4, 0.01), true);
    let params = |t: &Trainer| -> BTreeMap<String, Tensor> {
        let state = t.state().unwrap();
        t.manifest
            .state
            .iter()
            .filter(|e| e.role == Role::Param)
            .map(|e| (e.input.clone(), state[&e.input].clone()))
            .collect()
    };
    let before = params(&t);
    t.set_learning_rate(0.0).unwrap();
    assert_eq!(
        run(&mut t, &data, 0, 8),
        [false, false, false, true].repeat(2)
    );
    assert_eq!(
        params(&t),
        before,
        "lr 0 (and so lr * weight decay 0) moves nothing"
    );
    assert_eq!(
        t.state().unwrap()["ga.opt_step"],
        Tensor::I64(ndarray::arr0(2).into_dyn()),
        "the windows still applied"
    );
}

#[test]
fn changing_k_equals_a_step_rewritten_with_that_k() {
    if !ort_available() {
        return;
    }
    let data = data();
    for split in [true, false] {
        let mut changed = trainer(&step(4, 0.01), split);
        changed.set_accum_steps(2).unwrap();
        let mut rewritten = trainer(&step(2, 0.01), split);
        let applied = run(&mut changed, &data, 0, 8);
        assert_eq!(applied, [false, true].repeat(4), "split={split}");
        assert_eq!(run(&mut rewritten, &data, 0, 8), applied);
        assert_eq!(
            changed.state().unwrap(),
            rewritten.state().unwrap(),
            "split={split}"
        );
        // Back to 4 from a window boundary: windows of 4 again.
        changed.set_accum_steps(4).unwrap();
        assert_eq!(
            run(&mut changed, &data, 8, 16),
            [false, false, false, true].repeat(2)
        );
    }
}

#[test]
fn bad_controls_are_errors() {
    if !ort_available() {
        return;
    }
    let mut t = trainer(&step(4, 0.01), true);
    for k in [0, -3] {
        let e = t.set_accum_steps(k).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
    }
    for lr in [f32::NAN, f32::INFINITY, -0.1] {
        let e = t.set_learning_rate(lr).unwrap_err().to_string();
        assert!(e.contains("finite and not negative"), "{e}");
    }
    // A step written without the learning-rate record (an older file) says so.
    let mut older = step(4, 0.01);
    older
        .metadata_props
        .retain(|p| p.key() != "onnx_ga.learning_rate");
    let mut t = trainer(&older, true);
    let e = t.set_learning_rate(0.1).unwrap_err().to_string();
    assert!(e.contains("onnx_ga.learning_rate"), "{e}");
}
