//! The rewrite of a tiny hand-written gradient graph (linear regression), as snapshots that
//! read as a review of the rewrite, one per normalisation and optimizer, and checked
//! numerically against the closed-form gradient.
//!
//! The graph: y = x W, d = y - t, loss = mean(d^2), and its backward pass seeded by the
//! scalar initializer `loss_grad`: dL/dy = seed * 2 d / N, W_grad = x^T dL/dy.

use crate::common;

use std::path::Path;

use crate::common::{assert_close, ort_available};
use ndarray::{array, Array2, ArrayD};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::SessionOptions;
use onnx_ga::proto::ModelProto;
use onnx_ga::signature::{self, ExplicitRoles};
use onnx_ga::train::Trainer;

use crate::common::LINEAR_REGRESSION_W0 as W0;

fn linear_regression() -> ModelProto {
    common::linear_regression(true, &[])
}

fn roles() -> ExplicitRoles {
    common::linear_regression_roles()
}

fn rewrite(spec: &str) -> onnx_ga::step::Step {
    let graph = signature::from_model(
        linear_regression(),
        &roles(),
        Path::new("linear_regression.onnx"),
    )
    .unwrap();
    onnx_ga::step::build_step(graph, spec, true).unwrap_or_else(|e| panic!("{spec}: {e}"))
}

fn snapshot(name: &str, spec: &str) {
    let step = rewrite(spec);
    let doc = common::step_document(&step);
    insta::assert_snapshot!(name, doc);
}

#[test]
fn snapshot_mean_sgd() {
    snapshot(
        "mean_sgd",
        "grad-accum(steps=2,normalize=mean),optimizer(kind=sgd,lr=0.1),dce",
    );
}

#[test]
fn snapshot_sum_momentum() {
    snapshot(
        "sum_momentum",
        "grad-accum(steps=2,normalize=sum),optimizer(kind=momentum,lr=0.1,momentum=0.9),dce",
    );
}

#[test]
fn snapshot_weighted_nesterov() {
    snapshot(
        "weighted_nesterov",
        "grad-accum(steps=2,normalize=weighted:sample_weight),optimizer(kind=nesterov,lr=0.1),dce",
    );
}

#[test]
fn snapshot_mean_adamw_where() {
    snapshot("mean_adamw_where", "grad-accum(steps=2,normalize=mean,apply=where),optimizer(kind=adamw,lr=0.1,weight_decay=0.01),dce");
}

#[test]
fn snapshot_mean_adam() {
    snapshot(
        "mean_adam",
        "grad-accum(steps=2,normalize=mean),optimizer(kind=adam,lr=0.1),dce",
    );
}

fn batch(x: Array2<f32>, t: Array2<f32>) -> std::collections::BTreeMap<String, Tensor> {
    let ones = Tensor::F32(ndarray::ArrayD::ones(vec![x.nrows()]));
    [
        ("x".to_string(), Tensor::F32(x.into_dyn())),
        ("t".to_string(), Tensor::F32(t.into_dyn())),
        ("sample_weight".to_string(), ones),
    ]
    .into_iter()
    .collect()
}

/// Two micro-batches of 2 then apply: W - lr * 2/4 x^T (x W - t) over all 4 samples.
#[test]
fn window_update_equals_closed_form() {
    if !ort_available() {
        return;
    }
    let x = array![[1.0f32, 2.0], [0.5, -1.0], [3.0, 0.25], [-2.0, 1.5]];
    let t = array![[1.0f32], [0.0], [2.0], [-1.0]];
    let w0 = Array2::from_shape_vec((2, 1), W0.to_vec()).unwrap();
    let residual = x.dot(&w0) - &t;
    let expected: ArrayD<f32> = (&w0 - &(x.t().dot(&residual) * (0.1 * 2.0 / 4.0))).into_dyn();
    for apply in ["if", "where"] {
        let step = rewrite(&format!(
            "grad-accum(steps=2,normalize=mean,apply={apply}),optimizer(kind=sgd,lr=0.1),dce"
        ));
        let mut trainer = Trainer::new(&step.model.to_proto(), &SessionOptions::default()).unwrap();
        let first = trainer
            .step(
                &batch(
                    x.slice(ndarray::s![0..2, ..]).to_owned(),
                    t.slice(ndarray::s![0..2, ..]).to_owned(),
                ),
                false,
            )
            .unwrap();
        assert!(!first.applied);
        assert_eq!(
            trainer.state().unwrap()["W"],
            Tensor::F32(w0.clone().into_dyn()),
            "{apply}: W must not move before the window ends"
        );
        let second = trainer
            .step(
                &batch(
                    x.slice(ndarray::s![2..4, ..]).to_owned(),
                    t.slice(ndarray::s![2..4, ..]).to_owned(),
                ),
                false,
            )
            .unwrap();
        assert!(second.applied);
        assert_close(
            &format!("W ({apply})"),
            &trainer.state().unwrap()["W"],
            &Tensor::F32(expected.clone()),
            1e-6,
            1e-7,
        );
    }
}
