//! `train --draw-seed`: a step with dropout trains the same twice with one seed, on ONNX
//! Runtime and tract, and every micro-step draws its own mask, whichever of the split
//! runner's sessions (window start, accumulate, apply) runs it.

use std::collections::BTreeMap;

use onnx_ga::data::Tensor;
use onnx_ga::engine::EngineKind;
use onnx_ga::proto::ModelProto;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

use crate::common::{labelled_data, ort_available, worst_state_gap};

/// A linear layer, ReLU, a Dropout of half, a linear layer and a cross-entropy: the step
/// (K = 4, SGD) for ONNX Runtime or tract.
pub(crate) fn dropout_step() -> ModelProto {
    step_of(DROPOUT_MLP)
}

/// The same model with a Dropout its author seeded.
fn seeded_dropout_step() -> ModelProto {
    step_of(&DROPOUT_MLP.replace("Dropout (h, ratio)", "Dropout <seed = 5> (h, ratio)"))
}

const DROPOUT_MLP: &str = r#"<ir_version: 8, opset_import: ["" : 17]>
dropout_mlp (float[N,8] x, int64[N] labels) => (float loss)
{
  p1 = MatMul (x, w1)
  h = Relu (p1)
  d = Dropout (h, ratio)
  logits = MatMul (d, w2)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}
"#;

fn step_of(text: &str) -> ModelProto {
    let mut model = onnx_ga::ir::text::parse_model(text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    crate::common::push_parameters(
        graph,
        &[("w1", &[8, 32], 31, 0.5), ("w2", &[32, 4], 32, 0.5)],
    );
    crate::common::push_initializer(graph, "ratio", &[], &[0.5]);
    crate::common::ort_step(
        model,
        "dropout_mlp.onnx",
        "grad-accum(steps=4),optimizer(kind=sgd,lr=0.1)",
    )
}

/// The losses of 12 micro-steps (three windows) of `step` on one fixed micro-batch, and the
/// state after them.
fn run(
    step: &ModelProto,
    engine: EngineKind,
    seed: Option<u64>,
    batch: &BTreeMap<String, Tensor>,
) -> (Vec<f32>, BTreeMap<String, Tensor>) {
    let options = TrainOptions {
        engine,
        draw_seed: seed,
        ..TrainOptions::default()
    };
    let mut trainer = Trainer::with_options(step, &options).unwrap_or_else(|e| panic!("{e}"));
    let losses = (0..12)
        .map(|_| trainer.step(batch, false).unwrap().loss)
        .collect();
    (losses, trainer.state().unwrap().clone())
}

/// Whether two states are the same numbers ([`worst_state_gap`] 0, the suite's bit-identity).
fn same_state(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> bool {
    a.len() == b.len() && worst_state_gap("draw_seed", a, b).0 == 0.0
}

/// Two runs of `step` with `seed` train bit for bit alike, and the four micro-steps of the
/// first window draw four masks; returns the losses and the state.
fn repeats(
    step: &ModelProto,
    engine: EngineKind,
    seed: Option<u64>,
    batch: &BTreeMap<String, Tensor>,
) -> (Vec<f32>, BTreeMap<String, Tensor>) {
    let (losses, state) = run(step, engine, seed, batch);
    let (again, state_again) = run(step, engine, seed, batch);
    assert_eq!(
        losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        again.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        "{engine:?}, seed {seed:?}: two runs: {losses:?} against {again:?}"
    );
    assert!(
        same_state(&state, &state_again),
        "{engine:?}, seed {seed:?}: two final states"
    );

    // Within the first window the parameters do not change and the batch is the same, so
    // only the masks tell the micro-steps apart: window start, accumulate twice, apply.
    let first: Vec<f32> = losses[..4].to_vec();
    for i in 0..4 {
        for j in i + 1..4 {
            assert_ne!(
                first[i].to_bits(),
                first[j].to_bits(),
                "{engine:?}, seed {seed:?}: micro-steps {i} and {j} drew the same mask: {first:?}"
            );
        }
    }

    (losses, state)
}

fn check(engine: EngineKind) {
    let step = dropout_step();
    let data = labelled_data(&[16, 8], 5, 4);
    let batch = micro_batch(&data, 16, 8, 0);
    let (losses, state) = repeats(&step, engine, Some(11), &batch);
    let (other, other_state) = run(&step, engine, Some(12), &batch);
    assert_ne!(
        losses, other,
        "{engine:?}: seeds 11 and 12 drew the same masks"
    );
    assert!(
        !same_state(&state, &other_state),
        "{engine:?}: seeds 11 and 12, one state"
    );
}

/// A Dropout its author seeded, trained without `--draw-seed`: the run repeats, and the
/// split runner's sessions still draw apart (with the author's seed kept verbatim in each,
/// the window start's first mask was the accumulate's first).
#[test]
fn an_author_seeded_dropout_draws_apart_in_each_session() {
    let step = seeded_dropout_step();
    let data = labelled_data(&[16, 8], 5, 4);
    let batch = micro_batch(&data, 16, 8, 0);
    if ort_available() {
        repeats(&step, EngineKind::Ort, None, &batch);
    }
    repeats(&step, EngineKind::Tract, None, &batch);
}

#[test]
fn one_seed_trains_the_same_twice_on_onnx_runtime() {
    if !ort_available() {
        return;
    }
    check(EngineKind::Ort);
}

#[test]
fn one_seed_trains_the_same_twice_on_tract() {
    check(EngineKind::Tract);
}

/// The CLI: `--draw-seed` twice, the same state file; the note says the draws are seeded,
/// and without the flag that runs differ.
#[test]
fn the_cli_repeats_a_dropout_run_with_a_seed() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model_path = dir.path().join("dropout_mlp.onnx");
    let step = dropout_step();
    std::fs::write(&model_path, prost::Message::encode_to_vec(&step)).unwrap();
    let data = labelled_data(&[16, 8], 5, 4);
    let data_path = dir.path().join("data.npz");
    onnx_ga::data::write_npz(&data_path, data.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
    let train = |name: &str, extra: &[&str]| {
        let state = dir.path().join(name);
        let mut args = crate::common::cli_train(&model_path, &data_path, "12", &["--save-state"]);
        args.push(state.to_str().unwrap());
        args.extend_from_slice(extra);
        let out = crate::common::onnx_ga_cli(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "train {extra:?}: {stderr}");
        (std::fs::read(&state).unwrap(), stderr)
    };
    let (a, said) = train("a.npz", &["--draw-seed", "3"]);
    assert!(said.contains("seeded from --draw-seed 3"), "{said}");
    let (b, _) = train("b.npz", &["--draw-seed", "3"]);
    assert!(a == b, "--draw-seed 3 twice: the state files differ");
    let (_, unseeded) = train("c.npz", &[]);
    assert!(
        unseeded.contains("--draw-seed SEED makes them repeat"),
        "{unseeded}"
    );
}
