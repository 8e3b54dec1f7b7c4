//! onnx-ga's fused optimizer kernels (src/fused_ops/, swapped in by src/passes/fuse/ for
//! ONNX Runtime on the CPU) against the standard-op updates they replace: the same step
//! file trained with `fused_kernels` on and off must agree bit for bit, losses and every
//! state tensor, over 8 windows: Adam and AdamW in both modes, ORT's, torch's and Keras'
//! formulas, with AGC, loss scaling and weighted normalisation, split and whole, 1 and 2
//! threads. Each case also checks that the fused trainer did fuse (and how many updates), so
//! that it cannot pass by running the standard graph twice.

use crate::common;

use std::path::Path;

use crate::common::{ort_available, read_npz, root};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::proto::ModelProto;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};
use std::collections::BTreeMap;

const MICRO_STEPS: u64 = 32;

/// Every session in place, however small its states (the trainer's default leaves the
/// shipped graphs' sessions apart: [`small_states_stay_apart`]), so that the in-place
/// machinery is exercised on these graphs. BatchNorm and the layer-norm
/// gradients stay in standard ops: their fused kernels sum in another order
/// (tests/fused_batch_norm.rs, tests/fused_layer_norm_grad.rs).
fn options(fused: bool, threads: usize, split: bool) -> TrainOptions {
    TrainOptions {
        session: SessionOptions {
            threads,
            fused_kernels: fused,
            fused_batch_norm: false,
            fused_layer_norm_grad: false,
            in_place_min_total: 0,
            ..SessionOptions::default()
        },
        split,
        ..TrainOptions::default()
    }
}

/// The Adam family's optimizer passes the fused-kernel tests run: AdamW in both modes, with
/// and without bias correction, Adam with L2, Keras' Adam.
const ADAM_FAMILY: [&str; 5] = [
    "optimizer(lr=0.01)",
    "optimizer(kind=adamw,lr=0.01,weight_decay=0.1,adam_mode=0)",
    "optimizer(kind=adamw,lr=0.01,adam_mode=1,correct_bias=false)",
    "optimizer(kind=adam,lr=0.01,weight_decay=0.01)",
    "optimizer(kind=adam,lr=0.01,formula=keras)",
];

/// The trainer's default options (fused kernels or not), BatchNorm and the layer-norm
/// gradients as written, on `threads`,
/// with host updates or not.
fn defaults(fused: bool, threads: usize, host_updates: bool) -> TrainOptions {
    TrainOptions {
        session: SessionOptions {
            fused_kernels: fused,
            fused_batch_norm: false,
            fused_layer_norm_grad: false,
            threads,
            host_updates,
            ..SessionOptions::default()
        },
        ..TrainOptions::default()
    }
}

/// Steps `fused` and `standard` through the same [`MICRO_STEPS`] micro-batches of 8 of
/// `data`, asserting that every micro-step's metrics and the final state agree bit for bit.
fn assert_trains_alike(
    what: &str,
    fused: &mut Trainer,
    standard: &mut Trainer,
    data: &BTreeMap<String, Tensor>,
) {
    let samples = fused.check_data(data, Path::new("data.npz")).unwrap();
    for i in 0..MICRO_STEPS {
        let batch = micro_batch(data, samples, 8, i);
        let (a, b) = (
            fused.step(&batch, false).unwrap(),
            standard.step(&batch, false).unwrap(),
        );
        assert_eq!(a, b, "{what}: micro-step {i}");
    }
    let (a, b) = (fused.state().unwrap(), standard.state().unwrap());
    assert!(a.keys().eq(b.keys()), "{what}: the same states");
    for (name, value) in b {
        assert_eq!(
            &a[name], value,
            "{what}: state '{name}' after {MICRO_STEPS} micro-steps"
        );
    }
}

/// Trains `step` for [`MICRO_STEPS`] micro-batches of 8 with and without the fused kernels
/// and asserts that both train alike; returns how many updates the fused trainer fused.
fn fused_trains_like_standard(
    what: &str,
    step: &ModelProto,
    data: &BTreeMap<String, Tensor>,
    threads: usize,
    split: bool,
) -> usize {
    let mut fused = Trainer::with_options(step, &options(true, threads, split))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut standard = Trainer::with_options(step, &options(false, 1, split)).unwrap();
    assert_eq!(standard.fused_updates(), 0, "{what}");
    assert_trains_alike(what, &mut fused, &mut standard, data);
    // The split sessions update in place (at least the accumulators); the whole graph's
    // states leave through its If, never in place.
    match split {
        true => assert!(fused.in_place_updates() > 0, "{what}: nothing in place"),
        false => assert_eq!(fused.in_place_updates(), 0, "{what}"),
    }
    fused.fused_updates()
}

fn shipped(model: &str) -> BTreeMap<String, Tensor> {
    read_npz(&root().join("graphs").join(model).join("data.npz"))
}

/// Every Adam-family update of the shipped graphs is fused, whatever surrounds it.
#[test]
fn fused_adamw_trains_bit_identically_on_shipped_graphs() {
    if !ort_available() {
        return;
    }
    let optimizers = [
        // ONNX Runtime's AdamW (adam_mode 1), its defaults.
        "optimizer(lr=0.01)",
        // adam_mode 1 with decoupled weight decay, and without bias correction.
        "optimizer(kind=adamw,lr=0.01,weight_decay=0.1,adam_mode=1)",
        "optimizer(kind=adamw,lr=0.01,adam_mode=1,correct_bias=false)",
        // PyTorch's AdamW (adam_mode 0), with and without decay.
        "optimizer(kind=adamw,lr=0.01,weight_decay=0.1,adam_mode=0)",
        "optimizer(kind=adamw,lr=0.01,weight_decay=0,adam_mode=0)",
        // Adam with L2 (the gradient plus wd p), and Keras' formula.
        "optimizer(kind=adam,lr=0.01,weight_decay=0.01)",
        "optimizer(kind=adam,lr=0.01,formula=keras)",
    ];
    let models = ["mlp_ce_adamw", "transformer_block", "cnn_bn"];
    each_pipeline(&models, &optimizers, "weighted", |what, _, fused| {
        // Small parameters share one flat update: at least one per step.
        assert!(fused >= 1, "{what}: {fused} updates fused");
    });
}

/// Every `optimizer` on every shipped `model`, alone and behind AGC, loss scaling and the
/// grad-accum normalisation `normalize`, trained fused and standard
/// ([`fused_trains_like_standard`]); `check(what, step, fused)` judges the fused count.
fn each_pipeline(
    models: &[&str],
    optimizers: &[&str],
    normalize: &str,
    check: impl Fn(&str, &ModelProto, usize),
) {
    for model in models {
        let data = shipped(model);
        for optimizer in optimizers {
            for around in [
                "grad-accum(steps=4)".to_string(),
                "grad-accum(steps=4),agc(clip=0.01,include_final=true)".to_string(),
                "grad-accum(steps=4),loss-scale(init=1024,interval=2)".to_string(),
                format!("grad-accum(steps=4,normalize={normalize})"),
            ] {
                let spec = format!("{around},{optimizer},legalize-ort,dce");
                let step = common::rewrite_shipped(model, &spec);
                let what = format!("{model}: {spec}");
                let fused = fused_trains_like_standard(&what, &step, &data, 1, true);
                check(&what, &step, fused);
            }
        }
    }
}

/// SGD, momentum and Nesterov, with L2 and the window's mean folded in, alone and with AGC,
/// loss scaling and weighted normalisation.
#[test]
fn fused_sgd_family_trains_bit_identically_on_shipped_graphs() {
    if !ort_available() {
        return;
    }
    let optimizers = [
        "optimizer(kind=sgd,lr=0.05)",
        "optimizer(kind=sgd,lr=0.05,weight_decay=0.01)",
        "optimizer(kind=momentum,lr=0.05,momentum=0.9)",
        "optimizer(kind=momentum,lr=0.05,momentum=0.9,weight_decay=0.01)",
        "optimizer(kind=nesterov,lr=0.05,momentum=0.9)",
        "optimizer(kind=nesterov,lr=0.05,momentum=0.9,weight_decay=0.01)",
    ];
    let models = ["mlp_mse_sgd", "mlp_ce_adamw", "cnn_bn"];
    each_pipeline(&models, &optimizers, "sum", |what, step, fused| {
        let params = onnx_ga::state::Manifest::from_model(step)
            .unwrap()
            .state
            .iter()
            .filter(|e| e.role == onnx_ga::state::Role::Param)
            .count();
        assert_eq!(fused, params, "{what}: every parameter's update fused");
    });
    let spec = "grad-accum(steps=4),optimizer(kind=nesterov,lr=0.05,momentum=0.9),legalize-ort,dce";
    let step = common::rewrite_shipped("mlp_ce_adamw", spec);
    fused_trains_like_standard(
        "mlp_ce_adamw whole",
        &step,
        &shipped("mlp_ce_adamw"),
        1,
        false,
    );
}

/// The whole step (its apply `If`: the update sits in the then-branch) and two threads (the
/// kernel splits large tensors across ONNX Runtime's pool) train alike too.
#[test]
fn fused_adamw_whole_and_on_two_threads() {
    if !ort_available() {
        return;
    }
    for model in ["mlp_ce_adamw", "transformer_block"] {
        let data = shipped(model);
        let spec = "grad-accum(steps=4),loss-scale(init=1024,interval=2),optimizer(kind=adamw,lr=0.01,weight_decay=0.1,adam_mode=0),legalize-ort,dce";
        let step = common::rewrite_shipped(model, spec);
        let whole = fused_trains_like_standard(&format!("{model} whole"), &step, &data, 1, false);
        let split = fused_trains_like_standard(&format!("{model} split"), &step, &data, 1, true);
        // The whole step has one session, the split one an apply session with the update.
        assert!(
            whole >= 1 && whole == split,
            "{model}: whole {whole}, split {split}"
        );
        fused_trains_like_standard(&format!("{model} threads 2"), &step, &data, 2, true);
    }
}

/// Mixed precision: fp16 with dynamic loss scaling and bf16 keep float32 master weights and
/// moments, so their updates fuse too (bf16 compute has no ONNX Runtime CPU kernel for every
/// op; fp16 runs on the CPU).
#[test]
fn fused_adamw_with_mixed_precision() {
    if !ort_available() {
        return;
    }
    for model in ["mlp_ce_adamw", "transformer_block"] {
        let data = shipped(model);
        let spec = "grad-accum(steps=4),loss-scale,optimizer(lr=0.01),legalize-ort,precision(dtype=fp16),dce";
        let step = common::rewrite_shipped(model, spec);
        let what = format!("{model}: {spec}");
        let fused = fused_trains_like_standard(&what, &step, &data, 1, true);
        assert!(fused >= 1, "{what}: {fused} updates fused");
    }
}

/// Forward models through our autodiff with torch's AdamW (adam_mode 0, the default for
/// them) and Keras' Adam: the tensors are larger than one kernel chunk nowhere here, so the
/// two-thread run below uses a parameter of more than 65536 elements.
#[test]
fn fused_adamw_on_forward_models() {
    if !ort_available() {
        return;
    }
    for (model, export, optimizer) in [
        ("torch_mlp", "legacy", "optimizer(kind=adamw,lr=0.01)"),
        ("torch_cnn", "legacy", "optimizer(kind=adamw,lr=0.01)"),
        (
            "keras_mlp",
            "keras",
            "optimizer(kind=adam,lr=0.01,formula=keras)",
        ),
    ] {
        let dir = root().join("graphs/forward").join(model);
        let path = dir.join(format!("{export}.onnx"));
        let proto = onnx_ga::model::load_model_with_data(&path).unwrap();
        let graph = onnx_ga::signature::forward(proto, &path);
        let spec = format!(
            "autodiff(loss_fn=cross-entropy,grads=internal),grad-accum(steps=4),{optimizer},legalize-ort,dce"
        );
        let step = onnx_ga::step::build_step(graph, &spec, true)
            .unwrap_or_else(|e| panic!("{model}: {e}"))
            .model
            .to_proto();
        let data = read_npz(&dir.join("data.npz"));
        let what = format!("{model}: {spec}");
        let fused = fused_trains_like_standard(&what, &step, &data, 1, true);
        assert!(fused >= 1, "{what}: {fused} updates fused");
    }
}

/// A parameter larger than the kernel's chunk (65536 elements) is updated by several tasks
/// of the intra-op pool in a session: the same bits on 1 and 2 threads as the standard ops,
/// and as the host's update in one piece (`engine::host_updates`, the default for sessions
/// this small).
#[test]
fn fused_adamw_splits_large_parameters_across_threads() {
    if !ort_available() {
        return;
    }
    let step = large_linear_step();
    let data = varied_linear_data();
    for host in [true, false] {
        for threads in [1, 2] {
            let what = format!("linear 512x256, {threads} threads, host updates {host}");
            let mut options = options(true, threads, true);
            options.session.host_updates = host;
            let mut fused = Trainer::with_options(&step, &options).unwrap();
            let mut standard =
                Trainer::with_options(&step, &self::options(false, 1, true)).unwrap();
            assert_eq!(fused.fused_updates(), 2, "{what}: the weight and the bias");
            // The accumulate session's two accumulations and the apply's two updates.
            assert_eq!(fused.host_updates(), if host { 4 } else { 0 }, "{what}");
            assert_trains_alike(&what, &mut fused, &mut standard, &data);
        }
    }
}

/// In place, a micro-step the host discards (its loss is NaN, `OnNonFinite::Skip` and
/// `Stop`) leaves every state as it was: the kernels' gate kept them from writing. Checked
/// against the standard ops (value semantics: the host puts the old values back) with the
/// NaN at a window's start, inside it and at its apply, and with `Keep`, where the NaN
/// must reach the state alike.
#[test]
fn in_place_updates_leave_a_discarded_micro_step_unwritten() {
    use onnx_ga::train::OnNonFinite;
    if !ort_available() {
        return;
    }
    let step = large_linear_step();
    let data = large_linear_data(
        |i| ((i * 13) % 100) as f32 / 100.0 - 0.5,
        |i| ((i * 7) % 50) as f32 / 25.0 - 1.0,
    );
    // Micro-steps 4 (a window's start), 6 (inside) and 9 see NaN inputs. A discarded
    // micro-step does not count, so under Skip and Stop the window after 4 and 6 is 5, 7, 8
    // and 9: 9 is its apply (under Keep, 9 continues a window).
    let poisoned = [4u64, 6, 9];
    let policies = [OnNonFinite::Skip, OnNonFinite::Stop, OnNonFinite::Keep];
    // The apply's updates on the host (the default) and bound in the session.
    for (policy, host) in policies.into_iter().flat_map(|p| [(p, true), (p, false)]) {
        let what = format!("{policy:?}, host updates {host}");
        let mut fused_options = options(true, 1, true);
        fused_options.session.host_updates = host;
        let mut in_place = Trainer::with_options(&step, &fused_options).unwrap();
        let mut standard = Trainer::with_options(&step, &options(false, 1, true)).unwrap();
        // The two accumulators in the accumulate and the window-start sessions, and the
        // apply's p, m and v of both parameters.
        assert_eq!(in_place.in_place_updates(), 2 + 2 + 6, "{what}");
        // The accumulate session's two accumulations and the apply's two updates on the
        // host, the gate computed there from the loss.
        assert_eq!(in_place.host_updates(), if host { 4 } else { 0 }, "{what}");
        in_place.set_on_nonfinite(policy);
        standard.set_on_nonfinite(policy);
        let samples = in_place.check_data(&data, Path::new("data.npz")).unwrap();
        for i in 0..16 {
            let mut batch = micro_batch(&data, samples, 8, i);
            if poisoned.contains(&i) {
                poison(&mut batch);
            }
            let (a, b) = (in_place.step(&batch, false), standard.step(&batch, false));
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(format!("{a:?}"), format!("{b:?}"), "{what}: micro-step {i}")
                }
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{what}: {i}"),
                (a, b) => panic!("{what}: micro-step {i}: {a:?} vs {b:?}"),
            }
            let (a, b) = (in_place.state().unwrap(), standard.state().unwrap());
            for (name, value) in b {
                let same = match (&a[name], value) {
                    // NaN != NaN: compare the bits.
                    (Tensor::F32(x), Tensor::F32(y)) => x
                        .iter()
                        .zip(y.iter())
                        .all(|(p, q)| p.to_bits() == q.to_bits()),
                    (x, y) => x == y,
                };
                assert!(same, "{what}: state '{name}' after micro-step {i}");
            }
        }
    }
}

/// In place trains exactly like apart on forward models whose backward reads each weight
/// again (for the gradient of the layer below), through views ONNX Runtime's optimizer folds
/// away (a weight's `Transpose` into its MatMuls): the kernels must be ordered after those
/// reads. Torch's BERT, GPT and ViT exports, SGD and AdamW, 3 windows, every state and loss
/// bit for bit; and with SGD the apply updates its parameters in place. With the kernels
/// kept in the sessions (no host updates) the weight gradients are made inside their
/// accumulators (these exports' `Transpose(Gemm)`), bit for bit alike too.
#[test]
fn in_place_waits_for_every_read_of_a_weight() {
    if !ort_available() {
        return;
    }
    for model in ["torch_bert", "torch_gpt", "torch_vit"] {
        for optimizer in [
            "optimizer(kind=sgd,lr=0.1)",
            "optimizer(kind=adamw,lr=0.01)",
        ] {
            let what = format!("{model} {optimizer}");
            let path = root()
                .join("graphs/forward")
                .join(model)
                .join("dynamo.onnx");
            let proto = onnx_ga::model::load_model_with_data(&path).unwrap();
            let graph = onnx_ga::signature::forward(proto, &path);
            let spec = format!(
                "autodiff(loss_fn=cross-entropy,ignore_index=-100,grads=internal),grad-accum(steps=4),{optimizer},legalize-ort,dce"
            );
            let step = onnx_ga::step::build_step(graph, &spec, true)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .model
                .to_proto();
            let data = read_npz(&root().join("graphs/forward").join(model).join("data.npz"));
            let make = |in_place_updates: bool, host_updates: bool| {
                let options = TrainOptions {
                    session: SessionOptions {
                        in_place_updates,
                        host_updates,
                        in_place_min_total: 0,
                        ..SessionOptions::default()
                    },
                    ..TrainOptions::default()
                };
                Trainer::with_options(&step, &options).unwrap_or_else(|e| panic!("{what}: {e}"))
            };
            let (mut in_place, mut apart) = (make(true, true), make(false, true));
            // The kernels in the sessions: the weight gradients made inside their
            // accumulators, whatever form the export gives them (`Transpose(Gemm)` here).
            let mut in_sessions = make(true, false);
            assert_eq!(apart.in_place_updates(), 0, "{what}");
            assert!(
                in_sessions.accumulated_products() > 0,
                "{what}: no product fused"
            );
            // SGD updates each parameter on its own; AdamW puts these small models' parameters
            // into one flat group, whose update is not in place (its parameter is a Concat).
            let accumulators = step_accumulators(&step);
            if optimizer.contains("sgd") {
                assert!(
                    in_place.in_place_updates() > 2 * accumulators,
                    "{what}: {} in place, {accumulators} accumulators: the apply updates nothing in place",
                    in_place.in_place_updates()
                );
            }
            let samples = in_place.check_data(&data, Path::new("data.npz")).unwrap();
            for i in 0..12 {
                let batch = micro_batch(&data, samples, 4, i);
                let (a, b, c) = (
                    in_place.step(&batch, false).unwrap(),
                    apart.step(&batch, false).unwrap(),
                    in_sessions.step(&batch, false).unwrap(),
                );
                assert_eq!(a, b, "{what}: micro-step {i}");
                assert_eq!(c, b, "{what}: micro-step {i}, kernels in the sessions");
            }
            let (a, b) = (in_place.state().unwrap(), apart.state().unwrap());
            let c = in_sessions.state().unwrap();
            for (name, value) in b {
                assert_eq!(&a[name], value, "{what}: state '{name}'");
                assert_eq!(
                    &c[name], value,
                    "{what}: state '{name}', kernels in the sessions"
                );
            }
        }
    }
}

/// What the trainer's defaults leave apart, bit for bit like the standard ops either way: a
/// session whose in-place states hold under `in_place::MIN_SESSION_ELEMENTS` in all binds
/// none (binding costs per state and run). The shipped MLP and the 512x256 linear layer are
/// under it; with the session minimum off, the linear layer's accumulators go in place, the
/// weight's (131072 elements) and the bias's (256) alike: a small one left a standard `Add`
/// would be a fresh buffer bound again every run.
#[test]
fn small_states_stay_apart() {
    if !ort_available() {
        return;
    }
    let options = |fused: bool, min_total: Option<i64>| TrainOptions {
        session: SessionOptions {
            fused_kernels: fused,
            fused_batch_norm: false,
            fused_layer_norm_grad: false,
            in_place_min_total: min_total.unwrap_or(SessionOptions::default().in_place_min_total),
            // The updates bound in ONNX Runtime: the host's need no minimum (below).
            host_updates: false,
            ..SessionOptions::default()
        },
        ..TrainOptions::default()
    };
    let linear = || {
        (
            large_linear_step(),
            large_linear_data(
                |i| ((i * 13) % 100) as f32 / 100.0 - 0.5,
                |i| ((i * 7) % 50) as f32 / 25.0 - 1.0,
            ),
        )
    };
    let mlp = || {
        let spec = "grad-accum(steps=4),optimizer(kind=sgd,lr=0.05),legalize-ort,dce";
        (
            common::rewrite_shipped("mlp_ce_adamw", spec),
            shipped("mlp_ce_adamw"),
        )
    };
    let cases = [
        ("mlp_ce_adamw, defaults", mlp(), None, 0),
        ("linear 512x256, defaults", linear(), None, 0),
        // The weight's and the bias's accumulators in the accumulate session, and the
        // apply's p, m and v of both parameters.
        (
            "linear 512x256, no session minimum",
            linear(),
            Some(0),
            2 + 6,
        ),
    ];
    for (what, (step, data), min_total, expected) in cases {
        let mut fused = Trainer::with_options(&step, &options(true, min_total)).unwrap();
        let mut standard = Trainer::with_options(&step, &options(false, min_total)).unwrap();
        // The window start writes every accumulator in place, at any size: its outputs bound
        // once to the accumulators' buffers cost no run anything.
        let accumulators = fused.window_start_in_place();
        assert_eq!(accumulators, step_accumulators(&step), "{what}");
        assert_eq!(fused.in_place_updates() - accumulators, expected, "{what}");
        assert!(fused.fused_updates() >= 1, "{what}: the kernels still run");
        assert_trains_alike(what, &mut fused, &mut standard, &data);
    }
}

/// Sessions that update nothing in place (the trainer's default for models this small) run
/// every AdamW update that shares its scalars in one `AdamWUpdates` node, the flat group
/// of small parameters cut back into its members (`passes::fuse::adamw_group`). Each Adam
/// family formula, alone and behind AGC, loss scaling and weighted normalisation, trains bit
/// for bit as the standard-op step does, and the grouping happened.
#[test]
fn grouped_adamw_updates_train_bit_identically() {
    if !ort_available() {
        return;
    }
    // Else the sessions give their updates to the host (the next test).
    let options = |fused: bool| defaults(fused, 1, false);
    let optimizers = ADAM_FAMILY;
    for model in ["mlp_ce_adamw", "transformer_block", "cnn_bn"] {
        let data = shipped(model);
        for optimizer in optimizers {
            for around in [
                "grad-accum(steps=4)",
                "grad-accum(steps=4),agc(clip=0.01,include_final=true)",
                "grad-accum(steps=4),loss-scale(init=1024,interval=2)",
                "grad-accum(steps=4,normalize=weighted)",
            ] {
                let spec = format!("{around},{optimizer},legalize-ort,dce");
                let step = common::rewrite_shipped(model, &spec);
                let what = format!("{model}: {spec}");
                let mut fused = Trainer::with_options(&step, &options(true)).unwrap();
                let mut standard = Trainer::with_options(&step, &options(false)).unwrap();
                // Apart but for the window start's accumulators, written in place at any size.
                let start = fused.window_start_in_place();
                assert_eq!(start, step_accumulators(&step), "{what}");
                assert_eq!(
                    fused.in_place_updates(),
                    start,
                    "{what}: this case is apart"
                );
                assert!(
                    fused.grouped_updates() >= 2,
                    "{what}: {} updates grouped",
                    fused.grouped_updates()
                );
                assert_eq!(standard.grouped_updates(), 0, "{what}");
                assert_trains_alike(&what, &mut fused, &mut standard, &data);
            }
        }
    }
}

/// The trainer's default on the CPU for small models: the accumulations and the apply's
/// optimizer updates leave their sessions and run on the host after them, in place on the
/// state (`passes::fuse::host`, `engine::host_updates`), the gate computed from the loss by
/// the host. Every optimizer
/// family, alone and behind AGC, loss scaling and weighted normalisation, on one and two
/// threads, trains bit for bit as the standard-op step does, and the host ran the updates.
#[test]
fn host_updates_train_bit_identically() {
    if !ort_available() {
        return;
    }
    let options = |fused: bool, threads: usize| defaults(fused, threads, true);
    let optimizers = ADAM_FAMILY.into_iter().chain([
        "optimizer(kind=sgd,lr=0.05)",
        "optimizer(kind=momentum,lr=0.05,momentum=0.9,weight_decay=0.01)",
        "optimizer(kind=nesterov,lr=0.05,momentum=0.9)",
    ]);
    let arounds = [
        "grad-accum(steps=4)",
        "grad-accum(steps=4),agc(clip=0.01,include_final=true)",
        "grad-accum(steps=4),loss-scale(init=1024,interval=2)",
        "grad-accum(steps=4,normalize=weighted)",
        "grad-accum(steps=3)",
    ];
    for model in ["mlp_ce_adamw", "transformer_block"] {
        let data = shipped(model);
        for optimizer in optimizers.clone() {
            for around in arounds {
                let spec = format!("{around},{optimizer},legalize-ort,dce");
                let step = common::rewrite_shipped(model, &spec);
                for threads in [1, 2] {
                    let what = format!("{model}: {spec}, {threads} threads");
                    let mut fused = Trainer::with_options(&step, &options(true, threads)).unwrap();
                    let mut standard = Trainer::with_options(&step, &options(false, 1)).unwrap();
                    // The accumulations at least: under loss scaling each update is gated
                    // by a `Where` (a window with an overflow is skipped), which reads its
                    // kernel's outputs, so the kernels stay in the session (grouped).
                    let accumulators = step_accumulators(&step);
                    let updates = fused.host_updates();
                    match around.contains("loss-scale") {
                        true => assert_eq!(updates, accumulators, "{what}"),
                        false => assert!(updates > accumulators, "{what}: {updates}"),
                    }
                    assert_eq!(standard.host_updates(), 0, "{what}");
                    assert_trains_alike(&what, &mut fused, &mut standard, &data);
                }
            }
        }
    }
}

/// The weight's gradient made inside its accumulator (`AccumulateProduct`): at micro-batches
/// of 8, 24 and 32 by onnx-ga's kernel, at 40 and 64 by the kernel on AVX2 (its limit there
/// is 64) and by ONNX Runtime's `Gemm` on AVX-512 (32), at 72 by the `Gemm` on both, into a
/// buffer of its own and then added. The apply's own weight gradient likewise, made by its
/// AdamW update (`passes::fuse::apply_product`). Both train bit for bit as the standard
/// ops, on one thread and on two (the 512 rows split into tasks), with micro-steps of NaN
/// inputs discarded (the gate leaves the accumulator unwritten) at a window's start and
/// inside one, and at an apply; and without the option nothing is fused so.
#[test]
fn weight_gradients_made_in_their_accumulators_train_bit_identically() {
    use onnx_ga::train::OnNonFinite;
    if !ort_available() {
        return;
    }
    let data = |rows: usize| {
        let tensor = |cols: usize, f: &dyn Fn(usize) -> f32| {
            let values = (0..rows * cols).map(f).collect();
            Tensor::F32(ndarray::ArrayD::from_shape_vec(vec![rows, cols], values).unwrap())
        };
        BTreeMap::from([
            (
                "x".to_string(),
                tensor(512, &|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5),
            ),
            (
                "y".to_string(),
                tensor(256, &|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0),
            ),
        ])
    };
    for batch in [8usize, 24, 32, 40, 64, 72] {
        let step = large_linear_step_of(batch as i64);
        let data = data(2 * batch + 3);
        for threads in [1, 2] {
            let what = format!("micro-batch {batch}, {threads} threads");
            let mut fused_options = options(true, threads, true);
            fused_options.session.host_updates = false;
            let mut fused = Trainer::with_options(&step, &fused_options).unwrap();
            // The weight's, in the accumulate session and in the window start (written
            // there, its accumulator unread); the bias's gradient is a ReduceSum. The
            // apply's own product is made in its update (by ONNX Runtime's Gemm past the
            // kernel's `k`: 72 on AVX2, 40-72 on AVX-512).
            assert_eq!(fused.accumulated_products(), 2, "{what}");
            assert_eq!(fused.apply_products(), 1, "{what}");
            let mut standard = Trainer::with_options(&step, &options(false, 1, true)).unwrap();
            for trainer in [&mut fused, &mut standard] {
                trainer.set_on_nonfinite(OnNonFinite::Skip);
            }
            let samples = fused.check_data(&data, Path::new("data.npz")).unwrap();
            for i in 0..24 {
                let mut micro = micro_batch(&data, samples, batch, i);
                if [8, 13, 19].contains(&i) {
                    poison(&mut micro);
                }
                let (a, b) = (fused.step(&micro, false), standard.step(&micro, false));
                assert_eq!(format!("{a:?}"), format!("{b:?}"), "{what}: micro-step {i}");
            }
            let (a, b) = (fused.state().unwrap(), standard.state().unwrap());
            for (name, value) in b {
                assert_eq!(&a[name], value, "{what}: state '{name}'");
            }
        }
        let mut off = options(true, 1, true);
        off.session.host_updates = false;
        off.session.fused_weight_grads = false;
        let trainer = Trainer::with_options(&step, &off).unwrap();
        assert_eq!(
            (trainer.accumulated_products(), trainer.apply_products()),
            (0, 0),
            "micro-batch {batch}, off"
        );
    }
}

/// Weight gradients kept as their operands until the window needs their sum
/// (`engine::deferred_products`) train bit for bit as the standard ops and as the kernel
/// that adds each micro-step's product at once: windows of 3, 4 and 6, one and two threads,
/// a window ended early by a flush, K lowered inside a window and raised again, micro-steps
/// of NaN inputs discarded (the first of a window and one inside), the state read mid-window
/// (the held accumulator is behind, `state` adds what was kept), and a checkpoint written
/// mid-window and resumed. The window's first product is kept too (from the second window
/// on, once the accumulating kernel has said it sums in place), so its accumulator's buffer
/// (the last window's stale sum: the apply does not zero it) is first written by the sum.
#[test]
fn weight_gradients_kept_for_the_window_train_bit_identically() {
    use onnx_ga::train::OnNonFinite;
    if !ort_available() {
        return;
    }
    let data = varied_linear_data();
    let dir = tempfile::tempdir().unwrap();
    for steps in [3i64, 4, 6] {
        let step = large_linear_step_with(8, steps);
        for threads in [1, 2] {
            let what = format!("K {steps}, {threads} threads");
            let make = |fused: bool, defer: bool| {
                let mut options = options(fused, threads, true);
                options.session.host_updates = false;
                options.session.defer_weight_grads = defer;
                let mut trainer = Trainer::with_options(&step, &options).unwrap();
                trainer.set_on_nonfinite(OnNonFinite::Skip);
                trainer
            };
            let mut kept = make(true, true);
            let mut at_once = make(true, false);
            let mut standard = make(false, false);
            let mut resumed: Option<Trainer> = None;
            let samples = kept.check_data(&data, Path::new("data.npz")).unwrap();
            let mut behind = 0;
            // Window starts after which an accumulator was behind: their product kept.
            let mut first_kept = 0;
            let mut window_starts = false;
            for i in 0..30u64 {
                let mut micro = micro_batch(&data, samples, 8, i);
                if [6, 17].contains(&i) {
                    poison(&mut micro);
                }
                let flush = i == 10;
                let k = match i {
                    15 => Some(2),
                    21 => Some(steps),
                    _ => None,
                };
                let mut trainers = vec![&mut kept, &mut at_once, &mut standard];
                trainers.extend(resumed.as_mut());
                if let Some(k) = k {
                    for t in trainers.iter_mut() {
                        t.set_accum_steps(k).unwrap();
                    }
                }
                let results: Vec<_> = trainers
                    .iter_mut()
                    .map(|t| {
                        // Not the step number: the resumed trainer counts from its resume.
                        let m = t.step(&micro, flush);
                        m.map(|m| (m.loss.to_bits(), m.applied, m.skipped, m.discarded))
                    })
                    .collect();
                let metrics: Vec<String> = results.iter().map(|m| format!("{m:?}")).collect();
                let (applied, discarded) = match &results[0] {
                    Ok((_, applied, _, discarded)) => (*applied, *discarded),
                    Err(_) => (false, false),
                };
                for (m, who) in metrics
                    .iter()
                    .zip(["kept", "at once", "standard", "resumed"])
                    .skip(1)
                {
                    assert_eq!(&metrics[0], m, "{what}: micro-step {i}, {who}");
                }
                if !kept.accumulators_behind().is_empty() {
                    behind += 1;
                    first_kept += usize::from(window_starts && !discarded);
                    // Read mid-window: the held accumulator plus what was kept.
                    let (a, b) = (kept.state().unwrap(), standard.state().unwrap());
                    assert_same_state(a, b, &format!("{what}: micro-step {i}"));
                }
                window_starts = match discarded {
                    true => window_starts,
                    false => applied,
                };
                if i == 13 {
                    let path = dir.path().join(format!("k{steps}t{threads}.safetensors"));
                    kept.save_state(&path).unwrap();
                    let mut fresh = make(true, true);
                    fresh.load_state(&path).unwrap();
                    resumed = Some(fresh);
                }
            }
            assert!(behind >= 6, "{what}: behind after {behind} micro-steps");
            assert!(first_kept >= 4, "{what}: {first_kept} window starts kept");
            let standard_state = standard.state().unwrap();
            let resumed = resumed.unwrap();
            for (who, trainer) in [
                ("kept", &kept),
                ("at once", &at_once),
                ("resumed", &resumed),
            ] {
                assert_same_state(
                    trainer.state().unwrap(),
                    standard_state,
                    &format!("{what}: {who}"),
                );
            }
        }
    }
}

/// Weight gradients kept for the window's sum under every optimizer family and every
/// wrapper the step has around the accumulation (AGC, loss scaling, a sum instead of the
/// mean), with micro-steps of NaN inputs inside a window and at its apply (loss scaling
/// skips its window, the others discard the micro-step): every micro-step's metrics and the
/// state after 16 micro-steps bit for bit as the standard ops, the products made (and kept)
/// in both the window start and the accumulating session, and under plain AdamW and SGD
/// added by the apply's update.
#[test]
fn weight_gradients_kept_under_every_optimizer_train_bit_identically() {
    if !ort_available() {
        return;
    }
    let data = varied_linear_data();
    let optimizers = [
        "optimizer(kind=sgd,lr=0.05)",
        "optimizer(kind=momentum,lr=0.05,momentum=0.9,weight_decay=0.01)",
        "optimizer(kind=nesterov,lr=0.05,momentum=0.9)",
        "optimizer(kind=adam,lr=0.01,weight_decay=0.01)",
        "optimizer(kind=adamw,lr=0.01,weight_decay=0.1)",
    ];
    let arounds = [
        "grad-accum(steps=4)",
        "grad-accum(steps=4),agc(clip=0.01,include_final=true)",
        "grad-accum(steps=4),loss-scale(init=1024,interval=2)",
        "grad-accum(steps=4,normalize=sum)",
    ];
    for optimizer in optimizers {
        for around in arounds {
            let training = format!("{around},{optimizer}");
            let step = large_linear_step_training(8, &training);
            let make = |fused: bool| {
                let mut options = options(fused, 1, true);
                options.session.host_updates = false;
                let mut trainer = Trainer::with_options(&step, &options).unwrap();
                trainer.set_on_nonfinite(onnx_ga::train::OnNonFinite::Skip);
                trainer
            };
            let (mut kept, mut standard) = (make(true), make(false));
            assert_eq!(kept.accumulated_products(), 2, "{training}");
            // The apply's own weight gradient is made inside its update where the update's
            // addend is that product: plain (not Adam's L2, added to it first).
            let plain = around == "grad-accum(steps=4)" && !optimizer.contains("kind=adam,");
            assert_eq!(kept.apply_products(), usize::from(plain), "{training}");
            let samples = kept.check_data(&data, Path::new("data.npz")).unwrap();
            let (mut behind, mut skipped) = (0, 0);
            // Applies, and those that found the accumulators behind (the products of the
            // micro-step before kept for the apply's update to add).
            let (mut applies, mut applies_behind) = (0, 0);
            for i in 0..16u64 {
                let mut micro = micro_batch(&data, samples, 8, i);
                // Inside the third window, then its applying micro-step.
                if [9, 12].contains(&i) {
                    poison(&mut micro);
                }
                let was_behind = !kept.accumulators_behind().is_empty();
                let (a, b) = (kept.step(&micro, false), standard.step(&micro, false));
                assert_eq!(
                    format!("{a:?}"),
                    format!("{b:?}"),
                    "{training}: micro-step {i}"
                );
                behind += usize::from(!kept.accumulators_behind().is_empty());
                skipped += usize::from(a.as_ref().is_ok_and(|m| m.skipped));
                if a.is_ok_and(|m| m.applied) {
                    applies += 1;
                    applies_behind += usize::from(was_behind);
                }
            }
            // Plain AdamW and SGD (with or without momentum) add the kept products in
            // their update, so the micro-step before each apply kept its product too; AGC
            // and loss scaling read the gradient whole before the update, so that
            // micro-step made the sum.
            if around == "grad-accum(steps=4)" && !optimizer.contains("kind=adam,") {
                assert_eq!(applies_behind, applies, "{training}: {applies} applies");
                assert!(applies >= 3, "{training}: {applies} applies");
            }
            if around.contains("agc") || around.contains("loss-scale") {
                assert_eq!(applies_behind, 0, "{training}");
            }
            assert_eq!(
                skipped > 0,
                around.contains("loss-scale"),
                "{training}: {skipped}"
            );
            // Two micro-steps of most windows end behind (the window start and the first
            // accumulating one; three under plain AdamW and SGD), one fewer of the first
            // window: its start ran before the accumulating kernel said it sums in place.
            assert!(behind >= 6, "{training}: behind after {behind} micro-steps");
            assert_same_state(kept.state().unwrap(), standard.state().unwrap(), &training);
        }
    }
}

/// Makes a micro-batch's inputs `x` all NaN (its loss is not finite).
fn poison(micro: &mut BTreeMap<String, Tensor>) {
    if let Some(Tensor::F32(x)) = micro.get_mut("x") {
        x.fill(f32::NAN);
    }
}

/// Every state tensor of `a` equal to `b`'s, a NaN where `b` has one (loss scaling
/// accumulates a non-finite micro-step's gradient until its apply skips the window).
fn assert_same_state_nan(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (name, value) in b {
        match (&a[name], value) {
            (Tensor::F32(x), Tensor::F32(y)) => {
                let same = x.shape() == y.shape()
                    && x.iter()
                        .zip(y)
                        .all(|(p, q)| p == q || (p.is_nan() && q.is_nan()));
                assert!(same, "{what}: state '{name}'");
            }
            (x, y) => assert_eq!(x, y, "{what}: state '{name}'"),
        }
    }
}

/// Every state tensor of `a` equal to `b`'s, bit for bit.
fn assert_same_state(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (name, value) in b {
        assert_eq!(&a[name], value, "{what}: state '{name}'");
    }
}

/// How many accumulators the step's manifest declares.
fn step_accumulators(step: &ModelProto) -> usize {
    let manifest = onnx_ga::state::Manifest::from_model(step).unwrap();
    manifest
        .state
        .iter()
        .filter(|e| e.role == onnx_ga::state::Role::Accumulator)
        .count()
}

/// 64 samples for [`large_linear_step`]: x (64 x 512) and y (64 x 256), element i of each
/// from `x(i)` and `y(i)`.
fn large_linear_data(
    x: impl Fn(usize) -> f32,
    y: impl Fn(usize) -> f32,
) -> BTreeMap<String, Tensor> {
    let tensor = |dims: [usize; 2], f: &dyn Fn(usize) -> f32| {
        let values = (0..dims[0] * dims[1]).map(f).collect();
        Tensor::F32(ndarray::ArrayD::from_shape_vec(dims.to_vec(), values).unwrap())
    };
    BTreeMap::from([
        ("x".to_string(), tensor([64, 512], &x)),
        ("y".to_string(), tensor([64, 256], &y)),
    ])
}

/// [`large_linear_data`] with values spread over [-0.5, 0.5) and [-1, 1) in no pattern a
/// product would line up with.
fn varied_linear_data() -> BTreeMap<String, Tensor> {
    large_linear_data(
        |i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5,
        |i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0,
    )
}

/// y = x W + b with W of 512 x 256 = 131072 elements, mean squared error, AdamW mode 0,
/// micro-batches of 8.
fn large_linear_step() -> ModelProto {
    large_linear_step_of(8)
}

/// [`large_linear_step`] for micro-batches of `batch`.
fn large_linear_step_of(batch: i64) -> ModelProto {
    large_linear_step_with(batch, 4)
}

/// [`large_linear_step`] for micro-batches of `batch` and windows of `steps`.
fn large_linear_step_with(batch: i64, steps: i64) -> ModelProto {
    let training = format!("grad-accum(steps={steps}),optimizer(kind=adamw,lr=0.01)");
    large_linear_step_training(batch, &training)
}

/// [`large_linear_step`] for micro-batches of `batch`, trained by `training` (the passes
/// between the autodiff and the legalisation).
fn large_linear_step_training(batch: i64, training: &str) -> ModelProto {
    use onnx_ga::ir::builder::Builder;
    use onnx_ga::ir::{tensor_type, BodyId};
    let mut model = common::empty_model(17);
    let float = onnx_ga::proto::elem::FLOAT;
    let x = model.add_input(BodyId::MAIN, "x", tensor_type(float, &[batch, 512]), None);
    let y = model.add_input(BodyId::MAIN, "y", tensor_type(float, &[batch, 256]), None);
    let w: Vec<f32> = (0..512 * 256)
        .map(|i| ((i * 31) % 97) as f32 / 970.0 - 0.05)
        .collect();
    let w = model.add_initializer(
        BodyId::MAIN,
        "w",
        onnx_ga::ir::builder::tensor_f32(&[512, 256], &w),
    );
    let b = model.add_initializer(
        BodyId::MAIN,
        "b",
        onnx_ga::ir::builder::tensor_f32(&[256], &vec![0.0; 256]),
    );
    let mut builder = Builder::new(&mut model, BodyId::MAIN, "test");
    let xw = builder.op("MatMul", &[x, w], vec![], "xw");
    let out = builder.op("Add", &[xw, b], vec![], "out");
    model.add_output(BodyId::MAIN, out, Some(tensor_type(float, &[batch, 256])));
    let _ = y;
    let proto = model.to_proto();
    let path = Path::new("large_linear.onnx");
    let graph = onnx_ga::signature::forward(proto, path);
    let spec = format!("autodiff(loss_fn=mse,labels=y,grads=internal),{training},legalize-ort,dce");
    onnx_ga::step::build_step(graph, &spec, true)
        .unwrap_or_else(|e| panic!("{spec}: {e}"))
        .model
        .to_proto()
}

/// In place, the session's binding is kept from one run to the next
/// (`engine/kept_binding.rs`) and binds again only what changed: a flush fed on some
/// micro-steps only (another set of inputs: a fresh binding), a learning rate changed
/// between micro-steps (a host input copied into the bound value), states replaced by
/// another session's outputs (rebound by their buffers). With the host's updates, the
/// gradients they read and the loss are written into buffers the binding keeps; without
/// them, the kernels' sessions keep their loss so. Every micro-step's metrics and every
/// state bit for bit as the standard ops train.
#[test]
fn a_kept_binding_follows_flushes_and_changed_controls() {
    if !ort_available() {
        return;
    }
    let step = large_linear_step();
    let data = large_linear_data(
        |i| ((i * 17) % 100) as f32 / 100.0 - 0.5,
        |i| ((i * 3) % 50) as f32 / 25.0 - 1.0,
    );
    // With the host's scalar chain the sessions never read the flush flag; without it the
    // apply reads it on flushed micro-steps only.
    for (host_scalars, host_updates) in [(true, true), (false, true), (true, false)] {
        let with = |fused| {
            let mut o = options(fused, 1, true);
            o.session.host_scalars = host_scalars;
            o.session.host_updates = host_updates;
            o
        };
        let mut in_place = Trainer::with_options(&step, &with(true)).unwrap();
        let mut standard = Trainer::with_options(&step, &with(false)).unwrap();
        assert!(in_place.in_place_updates() > 0);
        assert_eq!(in_place.host_updates() > 0, host_updates);
        let samples = in_place.check_data(&data, Path::new("data.npz")).unwrap();
        for i in 0..24u64 {
            let what =
                format!("host scalars {host_scalars}, host updates {host_updates}, micro-step {i}");
            if i == 9 || i == 17 {
                let lr = 0.003 * (i as f32);
                in_place.set_learning_rate(lr).unwrap();
                standard.set_learning_rate(lr).unwrap();
            }
            let flush = [2u64, 7, 8, 15].contains(&i);
            let batch = micro_batch(&data, samples, 8, i);
            let (a, b) = (
                in_place.step(&batch, flush).unwrap(),
                standard.step(&batch, flush).unwrap(),
            );
            assert_eq!(a, b, "{what}");
            let (a, b) = (in_place.state().unwrap(), standard.state().unwrap());
            for (name, value) in b {
                assert_eq!(&a[name], value, "{what}: state '{name}'");
            }
        }
    }
}

/// `train --no-host-updates` leaves the accumulations and the apply's updates in the
/// sessions and saves the same state, byte for byte, as the default run, where the host runs
/// them for a model this small.
#[test]
fn train_saves_the_same_state_with_and_without_host_updates() {
    if !ort_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let step = common::cli_rewritten(dir.path(), "step.onnx", &[]);
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let states: Vec<Vec<u8>> = [
        ("host.npz", &[][..]),
        ("session.npz", &["--no-host-updates"][..]),
    ]
    .into_iter()
    .map(|(name, extra)| common::cli_trained_state(&step, &data, dir.path(), name, extra, None))
    .collect();
    assert!(states[0] == states[1], "the saved states differ");
}

/// The fast paths under any schedule the trainer allows, not only the ones written out
/// above (it found [`a_discarded_window_start_leaves_no_gradient_behind`]'s bug): for six
/// seeds, 48 micro-steps whose flushes, window sizes (1 to 6, changed mid-window),
/// discarded micro-steps (NaN inputs, anywhere: a window's first, the one before its apply,
/// the apply itself, right after a flush), learning rates and resumes are drawn at random,
/// on one and two threads, under AdamW, SGD with momentum (the two kernels that sum kept
/// products), AGC, loss scaling (which skips the window instead) and Nesterov on a window's
/// sum. Four trainers take every micro-step: every session on the kernels in place (weight
/// gradients kept, the apply's made in its updates; now and then saved and replaced by a
/// fresh trainer resumed from the file), the same with the apply's gradient written by
/// ONNX Runtime's `Gemm`, the trainer's defaults (at this size the host runs the updates),
/// and the standard ops. Every micro-step's metrics, the state every 8 micro-steps (read
/// mid-window: what the window kept added) and at the end, bit for bit (a NaN where the
/// standard ops have one).
#[test]
fn the_fast_paths_follow_any_schedule_bit_identically() {
    use onnx_ga::train::OnNonFinite;
    if !ort_available() {
        return;
    }
    let data = varied_linear_data();
    // The two kernels that sum kept products, the wrappers around the accumulation that
    // read the gradient whole first (AGC, loss scaling: its windows skipped by the graph,
    // not discarded), and a window's sum instead of its mean.
    let trainings = [
        "grad-accum(steps=4),optimizer(kind=adamw,lr=0.01)",
        "grad-accum(steps=4),optimizer(kind=momentum,lr=0.05,momentum=0.9)",
        "grad-accum(steps=4),agc(clip=0.01,include_final=true),optimizer(kind=adamw,lr=0.01)",
        "grad-accum(steps=4),loss-scale(init=1024,interval=2),optimizer(kind=adamw,lr=0.01)",
        "grad-accum(steps=4,normalize=sum),optimizer(kind=nesterov,lr=0.05,momentum=0.9)",
    ];
    let dir = tempfile::tempdir().unwrap();
    let mut resumed_runs = 0;
    for training in trainings {
        let step = large_linear_step_training(8, training);
        for seed in 1..=6u64 {
            let threads = 1 + (seed % 2) as usize;
            let what = format!("{training}, seed {seed}, {threads} threads");
            let make = |options: &TrainOptions| {
                let mut trainer = Trainer::with_options(&step, options).unwrap();
                trainer.set_on_nonfinite(OnNonFinite::Skip);
                trainer
            };
            let kernels = |apply_products: bool| {
                let mut o = options(true, threads, true);
                o.session.host_updates = false;
                o.session.apply_products = apply_products;
                o
            };
            let mut trainers = [
                ("kernels", make(&kernels(true))),
                ("apply's Gemm", make(&kernels(false))),
                ("defaults", make(&defaults(true, threads, true))),
                ("standard", make(&options(false, threads, true))),
            ];
            let samples = trainers[0]
                .1
                .check_data(&data, Path::new("data.npz"))
                .unwrap();
            let mut draws = Draws(seed);
            let (mut flushes, mut resized, mut poisoned, mut applied) = (0, 0, 0, 0);
            let (mut window_size, mut learning_rate, mut resumes) = (None, None, 0);
            for i in 0..48u64 {
                let mut micro = micro_batch(&data, samples, 8, i);
                let flush = draws.one_in(6);
                let k = draws.one_in(8).then(|| 1 + draws.below(6) as i64);
                let poison_it = draws.one_in(7);
                if poison_it {
                    poison(&mut micro);
                }
                let lr = draws
                    .one_in(9)
                    .then(|| 0.001 * (1 + draws.below(20)) as f32);
                // The kernels' trainer saved and replaced by a fresh one resumed from it.
                if draws.one_in(12) {
                    let path = dir.path().join(format!("s{seed}-{i}.safetensors"));
                    trainers[0].1.save_state(&path).unwrap();
                    let mut resumed = make(&kernels(true));
                    resumed.load_state(&path).unwrap();
                    if let Some(k) = window_size {
                        resumed.set_accum_steps(k).unwrap();
                    }
                    if let Some(lr) = learning_rate {
                        resumed.set_learning_rate(lr).unwrap();
                    }
                    trainers[0].1 = resumed;
                    resumes += 1;
                }
                let mut metrics = Vec::new();
                window_size = k.or(window_size);
                learning_rate = lr.or(learning_rate);
                for (who, trainer) in trainers.iter_mut() {
                    if let Some(k) = k {
                        trainer.set_accum_steps(k).unwrap();
                    }
                    if let Some(lr) = lr {
                        trainer.set_learning_rate(lr).unwrap();
                    }
                    let m = trainer
                        .step(&micro, flush)
                        .unwrap_or_else(|e| panic!("{what}: micro-step {i}, {who}: {e}"));
                    metrics.push((*who, m));
                }
                // The loss by its bits (a discarded micro-step's is NaN); not the step number:
                // a resumed trainer counts from its resume.
                let key = |m: &onnx_ga::train::StepMetrics| {
                    (m.loss.to_bits(), m.applied, m.skipped, m.discarded, m.scale)
                };
                let (_, first) = &metrics[0];
                for (who, m) in &metrics[1..] {
                    assert_eq!(
                        key(first),
                        key(m),
                        "{what}: micro-step {i}, {who} against kernels"
                    );
                }
                flushes += usize::from(flush);
                resized += usize::from(k.is_some());
                poisoned += usize::from(first.discarded || first.skipped);
                applied += usize::from(first.applied);
                if i % 8 == 7 || i == 47 {
                    let standard = trainers[3].1.state().unwrap();
                    for (who, trainer) in &trainers[..3] {
                        let state = trainer.state().unwrap();
                        let what = format!("{what}: {who}, micro-step {i}");
                        assert_same_state_nan(state, standard, &what);
                    }
                }
            }
            // The schedule exercised what it is for.
            assert!(
                flushes > 0 && resized > 0 && poisoned > 0 && applied > 4,
                "{what}: {flushes} flushes, {resized} sizes, {poisoned} discarded, {applied} applied"
            );
            resumed_runs += usize::from(resumes > 0);
            assert!(
                trainers[0].1.accumulated_products() > 0,
                "{what}: no product kept"
            );
        }
    }
    assert!(
        resumed_runs >= 10,
        "{resumed_runs} schedules resumed the kernels' trainer"
    );
}

/// A window's first micro-step discarded (NaN inputs, `--on-nonfinite skip`), then a
/// session that reads the accumulators before the window's first micro-step runs again: an
/// apply at once (a flush, as `train --flush` ends a run; K set to 1), or the state read or
/// saved. The window-start session writes its accumulators in place without reading them,
/// and ONNX Runtime's own nodes write them whatever the gate says: the discarded gradients
/// (NaN) were left there, and the apply trained every parameter and moment into NaN. The
/// trainer now puts zeros back. Every micro-step and the state bit for bit as the standard
/// ops, under the trainer's defaults (the host's updates at this size) and with every
/// session on the kernels in place.
#[test]
fn a_discarded_window_start_leaves_no_gradient_behind() {
    use onnx_ga::train::OnNonFinite;
    if !ort_available() {
        return;
    }
    let data = large_linear_data(
        |i| ((i * 37) % 200) as f32 / 200.0 - 0.5,
        |i| ((i * 11) % 90) as f32 / 45.0 - 1.0,
    );
    let step = large_linear_step();
    let kernels = {
        let mut o = options(true, 1, true);
        o.session.host_updates = false;
        o
    };
    let dir = tempfile::tempdir().unwrap();
    // Before the discarded window start: nothing (the run's first micro-step), two windows,
    // or two windows and a resume from their state; after it: a flush, K lowered to 1, the
    // state read.
    for before in ["nothing", "two windows", "a resume"] {
        for follow in ["flush", "K 1", "state"] {
            for (who, fused) in [
                ("defaults", defaults(true, 1, true)),
                ("kernels", kernels.clone()),
            ] {
                let what = format!("{who}: {before}, a discarded window start, then {follow}");
                let make = |o: &TrainOptions| {
                    let mut t = Trainer::with_options(&step, o).unwrap();
                    t.set_on_nonfinite(OnNonFinite::Skip);
                    t
                };
                let standard_options = options(false, 1, true);
                let (mut fused_t, mut standard) = (make(&fused), make(&standard_options));
                let samples = fused_t.check_data(&data, Path::new("data.npz")).unwrap();
                let windows = if before == "nothing" { 0 } else { 8 };
                let both = |f: &mut Trainer, s: &mut Trainer, i: u64, flush: bool| {
                    let mut micro = micro_batch(&data, samples, 8, i);
                    if i == windows {
                        poison(&mut micro);
                    }
                    let (a, b) = (
                        f.step(&micro, flush).unwrap(),
                        s.step(&micro, flush).unwrap(),
                    );
                    assert_eq!(a.discarded, i == windows, "{what}: micro-step {i}");
                    assert_eq!(
                        (a.loss.to_bits(), a.applied),
                        (b.loss.to_bits(), b.applied),
                        "{what}: micro-step {i}"
                    );
                    a
                };
                for i in 0..windows {
                    both(&mut fused_t, &mut standard, i, false);
                }
                if before == "a resume" {
                    let path = dir.path().join(format!("{who}-{follow}.safetensors"));
                    fused_t.save_state(&path).unwrap();
                    fused_t = make(&fused);
                    fused_t.load_state(&path).unwrap();
                }
                both(&mut fused_t, &mut standard, windows, false);
                if follow == "K 1" {
                    fused_t.set_accum_steps(1).unwrap();
                    standard.set_accum_steps(1).unwrap();
                }
                if follow != "state" {
                    let m = both(&mut fused_t, &mut standard, windows + 1, follow == "flush");
                    assert!(m.applied && m.loss.is_finite(), "{what}: {m:?}");
                }
                let state = fused_t.state().unwrap();
                for (name, value) in state {
                    if let Tensor::F32(v) = value {
                        assert!(
                            v.iter().all(|x| x.is_finite()),
                            "{what}: '{name}' not finite"
                        );
                    }
                }
                assert_same_state(state, standard.state().unwrap(), &what);
            }
        }
    }
}

/// SplitMix64: the test schedule's draws, the same on every run.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}
