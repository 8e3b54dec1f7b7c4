//! The split runner (`src/split.rs`): a step with an `If` apply region runs as two
//! specialised graphs, one per branch. It must train exactly like the exported graph, bit
//! for bit, on every shipped graph and with every pass that adds to the apply region
//! (AGC, dynamic loss scaling with its overflow windows, flush, resume mid-window).

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{ort_available, read_npz, root};
use onnx_ga::data::Tensor;
use onnx_ga::engine::EngineKind;
use onnx_ga::proto::ModelProto;
use onnx_ga::signature;
use onnx_ga::state::Role;
use onnx_ga::train::{micro_batch, StepMetrics, TrainOptions, Trainer};

const GRAPHS: [&str; 6] = common::SHIPPED_GRAPHS;

fn rewrite(model: &str, spec: &str) -> ModelProto {
    common::rewrite_shipped(model, spec)
}

fn trainer(step: &ModelProto, split: bool) -> Trainer {
    let t = Trainer::with_options(
        step,
        &TrainOptions {
            split,
            ..TrainOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(t.is_split(), split, "the runner asked for");
    t
}

/// Runs `steps` micro-steps of 8 samples; flushes the micro-steps in `flush_at`.
fn run(
    t: &mut Trainer,
    data: &BTreeMap<String, Tensor>,
    steps: u64,
    flush_at: &[u64],
) -> Vec<StepMetrics> {
    let samples = t.check_data(data, Path::new("data.npz")).unwrap();
    (0..steps)
        .map(|i| {
            t.step(&micro_batch(data, samples, 8, i), flush_at.contains(&i))
                .unwrap()
        })
        .collect()
}

fn assert_same_training(what: &str, step: &ModelProto, data: &BTreeMap<String, Tensor>) {
    let mut whole = trainer(step, false);
    let mut split = trainer(step, true);
    // 11 micro-steps with K=4: two full windows, a flushed partial one, one micro-step more.
    let flush_at = [9];
    let m_whole = run(&mut whole, data, 11, &flush_at);
    let m_split = run(&mut split, data, 11, &flush_at);
    assert_eq!(m_whole, m_split, "{what}: metrics");
    let applied: Vec<bool> = m_split.iter().map(|m| m.applied).collect();
    assert_eq!(
        applied,
        [false, false, false, true, false, false, false, true, false, true, false],
        "{what}: windows"
    );
    let (a, b) = (whole.state().unwrap(), split.state().unwrap());
    assert_eq!(a.len(), b.len());
    for (name, value) in a {
        assert_eq!(value, &b[name], "{what}: state '{name}' differs");
    }
}

#[test]
fn split_trains_bit_identically_on_every_shipped_graph() {
    if !ort_available() {
        return;
    }
    for model in GRAPHS {
        let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
        for spec in [
            "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce",
            "grad-accum(steps=4,normalize=sum,bn_stats=micro),agc(clip=0.01),optimizer(kind=nesterov,lr=0.01,momentum=0.9),legalize-ort,dce",
            "grad-accum(steps=4),loss-scale(init=65536,interval=2),agc(clip=0.05),optimizer(lr=0.01),legalize-ort,dce",
        ] {
            assert_same_training(&format!("{model} {spec}"), &rewrite(model, spec), &data);
        }
    }
}

#[test]
fn split_with_weighted_normalisation_trains_bit_identically() {
    if !ort_available() {
        return;
    }
    // The window's weight sum is one more state the branches route (counted in the graph
    // from the labels of the cross-entropy graphs).
    for model in ["mlp_ce_adamw", "transformer_block", "cnn_bn"] {
        let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
        let spec = "grad-accum(steps=4,normalize=weighted),optimizer(lr=0.01),legalize-ort,dce";
        let step = rewrite(model, spec);
        let manifest = onnx_ga::state::Manifest::from_model(&step).unwrap();
        assert!(
            manifest.state.iter().any(|e| e.role == Role::WeightSum),
            "{model}: a weight-sum state"
        );
        assert_same_training(&format!("{model} {spec}"), &step, &data);
    }
}

#[test]
fn split_skips_overflow_windows_like_the_whole_graph() {
    if !ort_available() {
        return;
    }
    // 2^127 overflows the scaled gradients: windows are skipped and the scale backs off
    // until it fits; parameters must stay bit-identical to the whole graph's throughout.
    let model = "mlp_ce_adamw";
    let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
    let step = rewrite(
        model,
        "grad-accum(steps=4),loss-scale(init=170141183460469231731687303715884105728),optimizer(lr=0.01),legalize-ort,dce",
    );
    assert_same_training("overflowing loss scale", &step, &data);
}

#[test]
fn split_resumes_mid_window_from_a_saved_state() {
    if !ort_available() {
        return;
    }
    let model = "transformer_block";
    let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
    let step = rewrite(
        model,
        "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce",
    );
    let mut straight = trainer(&step, true);
    run(&mut straight, &data, 10, &[]);

    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("state.npz");
    let mut first = trainer(&step, true);
    run(&mut first, &data, 6, &[]);
    first.save_state(&saved).unwrap();
    let mut resumed = trainer(&step, true);
    resumed.load_state(&saved).unwrap();
    let samples = resumed.check_data(&data, Path::new("data.npz")).unwrap();
    for i in 6..10 {
        let m = resumed
            .step(&micro_batch(&data, samples, 8, i), false)
            .unwrap();
        // The host's branch choice follows the loaded micro-step counter (2 of 4).
        assert_eq!(m.applied, i == 7, "micro-step {i}");
    }
    assert_eq!(straight.state().unwrap(), resumed.state().unwrap());
}

/// The two specialisations of the small linear-regression step, as a reviewable document.
#[test]
fn snapshot_specialisations() {
    let graph = signature::from_model(
        common::linear_regression(true, &[]),
        &common::linear_regression_roles(),
        Path::new("linear_regression.onnx"),
    )
    .unwrap();
    let step = onnx_ga::step::build_step(
        graph,
        "grad-accum(steps=2,normalize=mean),optimizer(kind=adam,lr=0.1),dce",
        true,
    )
    .unwrap();
    let model = step.model.to_proto();
    let split = onnx_ga::split::split_step(&model, &step.manifest)
        .unwrap()
        .expect("an If apply region");
    let mut doc = format!(
        "## Trigger\n{:?}\n",
        step.manifest.apply.as_ref().expect("recorded")
    );
    for (name, s) in [("accumulate", &split.accumulate), ("apply", &split.apply)] {
        doc.push_str(&format!(
            "\n## {name}: unchanged state\n{}\n\n## {name}: graph\n{}",
            s.unchanged.iter().cloned().collect::<Vec<_>>().join(", "),
            onnx_ga::ir::print::print_model(&onnx_ga::ir::Model::from_proto(s.model.clone()))
        ));
        assert!(
            s.model
                .graph
                .as_ref()
                .unwrap()
                .node
                .iter()
                .all(|n| n.op_type() != "If"),
            "{name}: the If is gone"
        );
    }
    // Nothing but accumulation moves on a micro-step that does not apply.
    let held_still: std::collections::BTreeSet<String> = step
        .manifest
        .state
        .iter()
        .filter(|e| matches!(e.role, Role::Param | Role::Moment | Role::OptStep))
        .map(|e| e.input.clone())
        .collect();
    assert_eq!(held_still.len(), 4, "W, its two moments, the step counter");
    assert_eq!(split.accumulate.unchanged, held_still);
    assert!(split.apply.unchanged.is_empty());
    insta::assert_snapshot!("linear_regression_adam", doc);
}

#[test]
fn split_runs_on_tract_too() {
    if !cfg!(feature = "tract") || !ort_available() {
        return;
    }
    let model = "mlp_mse_sgd";
    let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
    let step = rewrite(
        model,
        "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,lower-for-tract,dce",
    );
    let mut on_tract = Trainer::with_options(
        &step,
        &TrainOptions {
            engine: EngineKind::Tract,
            ..TrainOptions::default()
        },
    )
    .unwrap();
    assert!(on_tract.is_split());
    let mut on_ort = trainer(&step, true);
    run(&mut on_tract, &data, 8, &[]);
    run(&mut on_ort, &data, 8, &[]);
    for (name, value) in on_ort.state().unwrap() {
        common::assert_close(name, &on_tract.state().unwrap()[name], value, 1e-5, 1e-6);
    }
}

/// The IoBinding path that `--device cuda` takes (state bound where it lives, outputs bound
/// to device memory, the loss to host memory), run on the CPU: it must train exactly like
/// plain runs, split and whole.
#[test]
fn io_binding_path_trains_bit_identically() {
    if !ort_available() {
        return;
    }
    for model in ["mlp_ce_adamw", "cnn_bn"] {
        let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
        let step = rewrite(
            model,
            "grad-accum(steps=4),loss-scale(init=65536,interval=2),optimizer(lr=0.01),legalize-ort,dce",
        );
        for split in [true, false] {
            let bound_options = TrainOptions {
                split,
                session: onnx_ga::engine::ort::SessionOptions {
                    io_binding: true,
                    ..Default::default()
                },
                ..TrainOptions::default()
            };
            let mut bound = Trainer::with_options(&step, &bound_options).unwrap();
            let mut plain = trainer(&step, split);
            let m_bound = run(&mut bound, &data, 11, &[9]);
            let m_plain = run(&mut plain, &data, 11, &[9]);
            assert_eq!(m_bound, m_plain, "{model} split={split}: metrics");
            assert_eq!(
                bound.state().unwrap(),
                plain.state().unwrap(),
                "{model} split={split}: state"
            );
        }
    }
}

/// The apply leaves the accumulators the window start overwrites unread holding the
/// window's sums (`src/train/zero_after_apply.rs`); they must count as zero everywhere they
/// are seen. Against the whole graph, state compared after every micro-step (the state
/// handed out right after an apply), with an apply right after an apply (a flush at a
/// window's first micro-step, then K = 1), and a discarded non-finite window start. The
/// micro-step counter, which the host counts for the sessions that continue a window
/// (`src/train/host_counter.rs`), is part of that state.
#[test]
fn accumulators_left_to_the_window_start_count_as_zero() {
    if !ort_available() {
        return;
    }
    for model in ["mlp_ce_adamw", "cnn_bn", "transformer_block"] {
        let data = read_npz(&root().join("graphs").join(model).join("data.npz"));
        let step = rewrite(
            model,
            "grad-accum(steps=4),agc(clip=0.05),optimizer(kind=adamw,lr=0.01),legalize-ort,dce",
        );
        let mut whole = trainer(&step, false);
        let mut split = trainer(&step, true);
        assert!(
            split.zeros_left_to_the_window_start() > 0,
            "{model}: the apply writes zeros the window start overwrites"
        );
        // The counter too is compared below, micro-step by micro-step: the host counts it.
        assert!(split.micro_steps_counted_by_host(), "{model}");
        assert!(!whole.micro_steps_counted_by_host(), "{model}");
        let samples = split.check_data(&data, Path::new("data.npz")).unwrap();
        // Windows: 0-3, 4 (flushed), 5-8, then 9 (a window start after an apply) sees NaN
        // samples and is discarded, 10-12 (K = 1 from 12 on: it applies), 13, 14, 15.
        let poisoned = micro_batch(&data, samples, 8, 9);
        let nan_at = {
            let (name, t) = poisoned
                .iter()
                .find(|(_, t)| matches!(t, Tensor::F32(_)))
                .expect("a float data input");
            let mut t = t.clone();
            if let Tensor::F32(a) = &mut t {
                a.iter_mut().for_each(|v| *v = f32::NAN);
            }
            (name.clone(), t)
        };
        for t in [&mut whole, &mut split] {
            t.set_on_nonfinite(onnx_ga::train::OnNonFinite::Skip);
        }
        for i in 0..16u64 {
            if i == 12 {
                whole.set_accum_steps(1).unwrap();
                split.set_accum_steps(1).unwrap();
            }
            let mut batch = micro_batch(&data, samples, 8, i);
            if i == 9 {
                batch.insert(nan_at.0.clone(), nan_at.1.clone());
            }
            // A flush at micro-step 4: the window's first, right after an apply.
            let flush = i == 4;
            let (a, b) = (
                whole.step(&batch, flush).unwrap(),
                split.step(&batch, flush).unwrap(),
            );
            // (NaN is no loss equal to itself: its bits are.)
            let key = |m: &StepMetrics| (m.applied, m.discarded, m.loss.to_bits());
            assert_eq!(key(&a), key(&b), "{model}: micro-step {i}: metrics");
            assert_eq!(b.discarded, i == 9, "{model}: micro-step {i}: discarded");
            let (sa, sb) = (whole.state().unwrap(), split.state().unwrap());
            for (name, value) in sa {
                assert_eq!(value, &sb[name], "{model}: micro-step {i}: state '{name}'");
            }
        }
    }
}
