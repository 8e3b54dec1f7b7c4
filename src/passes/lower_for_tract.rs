//! `lower-for-tract`: lowers what tract-onnx (0.23) cannot run in our step graphs to
//! standard ops it has, reusing `legalize-ort`'s lowerings:
//!
//! - `SoftmaxCrossEntropyLoss` and `NegativeLogLikelihoodLoss` (forward): tract parses them
//!   but cannot type them ("Operator can not be made a TypedOp"); lowered to `LogSoftmax`,
//!   `GatherElements` and reductions with ONNX's semantics (weights, `ignore_index`);
//! - `BatchNormalization` (inference mode): tract runs it only with constant scale, bias,
//!   mean and variance, and in our steps they are parameters, or computed (the per-channel
//!   affine of the BatchNorm lowerings); lowered to `Mul` and `Add` per channel;
//! - `com.microsoft` `FusedMatMul` and `Gelu` (standard ONNX Runtime has them, tract does
//!   not): `Gemm`/`MatMul` with transposes, and the exact GELU from `Erf`;
//! - `MaxUnpool` (what `legalize-ort` makes of MaxPoolGrad when pooling windows do not
//!   overlap; tract has no MaxUnpool): a `ScatterElements` into zeros of the output shape;
//! - float16 `Gemm` (after the above, so a Gemm that `FusedMatMul` became is included):
//!   tract expands Gemm with float32 `alpha` and `beta` constants, so a half Gemm with a bias
//!   (or `alpha` ≠ 1) fails to type ("expected F16 got F32"); lowered to `Transpose`,
//!   `MatMul`, and `Mul`/`Add` by float16 constants (`legalize/gemm_half.rs`). Float32 Gemms
//!   stay (tract handles them), and with them fp16 steps (`precision(dtype=fp16)`) run on
//!   tract in half, Gemms included; tract has no bfloat16.
//!
//! - integer `CumSum` (Hugging Face's packed-sequence check in its masks): tract folds
//!   integers computed from shapes into symbolic dims and cannot sum those ("TDim is not a
//!   number"); summed in float64 and cast back (`legalize/cumsum_integer.rs`), exact for
//!   every int32 and for int64 sums below 2^53.
//!
//! - `ReverseSequence` (tf2onnx's Bidirectional layers; tract has none): a `GatherElements`
//!   along the time axis at the mirrored positions (`legalize/reverse_sequence.rs`).
//!
//! - `Loop` (tract has none): a while loop counting to a bound becomes a counted Loop
//!   (`legalize/while_as_counted.rs`: tf2onnx's recurrent layers over a run-time length),
//!   and a counted Loop a `Scan` over `Range(0, M)` (`legalize/loop_as_scan.rs`: the
//!   recurrent layers `autodiff` makes Loops, every backward Loop).
//!
//! - `Slice` bounds beyond the int32 range (PyTorch's `INT64_MAX` for "to the end"), which
//!   tract misreads (a row short): clamped to ±(2^31 - 1) ([`clamp_slice_bounds`]).
//!
//! - `Dropout` in training mode (tract runs only its inference form): a uniform draw, a
//!   comparison and a scale (`legalize/dropout_draw.rs`); and `RandomUniformLike` /
//!   `RandomNormalLike`, which tract parses by their node's name, named so
//!   ([`name_random_likes`]).
//!
//! Anything else of `com.microsoft` is an error naming the node. The pass runs at the end of
//! a `rewrite --engine tract` pipeline, and `train --engine tract` applies it in memory to a
//! step written for ONNX Runtime ([`lower_model`]), so one step file serves both engines.

use super::legalize::{self, LegalizeOrt};
use super::{Pass, PassContext, PassError, PassReport};
use crate::ir::Model;
use crate::proto::ModelProto;

pub const PASS: &str = "lower-for-tract";

#[derive(Clone, Debug, Default)]
pub struct LowerForTract;

impl LowerForTract {
    fn lowerings(running_var: super::RunningVar) -> LegalizeOrt {
        LegalizeOrt {
            fused_matmul: true,
            gelu: true,
            batch_norm: true,
            sce: true,
            nll: true,
            max_unpool: true,
            running_var,
        }
    }
}

impl Pass for LowerForTract {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Lower
    }

    /// Only standard-domain ops are left (tract runs no com.microsoft op).
    fn ensures(&self, model: &Model, _cx: &PassContext<'_>) -> Result<(), PassError> {
        let left = model.all_nodes().find(|&n| {
            crate::ir::normalize_domain(model.node(n).proto.domain()) == "com.microsoft"
        });
        match left {
            None => Ok(()),
            Some(n) => Err(super::broken(
                PASS,
                format!(
                    "com.microsoft op {} ('{}') is left",
                    model.node(n).proto.op_type(),
                    model.node(n).proto.name()
                ),
            )),
        }
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        let running_var = cx.bn_running_var();
        let (window, state) = cx.bn_window();
        lower(model, state, window, running_var)
    }
}

/// The pass's work: `legalize-ort`'s lowerings, then tract's own (the float16 Gemms, among
/// them those that a float16 `FusedMatMul` became, and the integer CumSums).
fn lower(
    model: &mut Model,
    state: &mut Vec<crate::state::StateEntry>,
    window: Option<&mut crate::passes::window::Window>,
    running_var: super::RunningVar,
) -> Result<PassReport, PassError> {
    let mut report =
        LowerForTract::lowerings(running_var).lower_model(model, PASS, state, window)?;
    let own = legalize::lower_for_tract(model, PASS)?;
    report.changed |= own.changed;
    report.added += own.added;
    report.removed += own.removed;
    if clamp_slice_bounds(model) > 0 {
        report.changed = true;
    }
    if name_random_likes(model) > 0 {
        report.changed = true;
    }
    Ok(report)
}

/// The ops tract 0.23 takes for their `Random...` form unless the node's name ends in
/// "Like": its parser tests the name, not the op type, and then asks for the `shape`
/// attribute only the `Random...` forms have ("expected attribute 'shape'").
const RANDOM_LIKES: [&str; 2] = ["RandomUniformLike", "RandomNormalLike"];

/// Whether `node` is a `RandomUniformLike` or `RandomNormalLike` whose name tract misreads.
fn misnamed_random_like(node: &crate::proto::NodeProto) -> bool {
    RANDOM_LIKES.contains(&node.op_type())
        && crate::ir::normalize_domain(node.domain()).is_empty()
        && !node.name().ends_with("Like")
}

/// Gives every [`misnamed_random_like`] node, at any depth, a name ending in "Like" (its
/// own with `.Like` added: still unique). Returns how many it renamed.
fn name_random_likes(model: &mut Model) -> usize {
    let misnamed: Vec<_> = model
        .all_nodes()
        .filter(|&n| misnamed_random_like(&model.node(n).proto))
        .collect();
    for &n in &misnamed {
        let proto = &mut model.node_mut(n).proto;
        proto.name = Some(format!("{}.Like", proto.name()));
    }
    misnamed.len()
}

/// tract 0.23 misreads int64 `Slice` bounds beyond the int32 range: PyTorch's "to the end"
/// (`INT64_MAX`) cut an 8-row mask to 7 rows (torch_bert, torch_vit), and planning then
/// failed on shapes that do not unify. A slice never spans 2^31 elements here, so the
/// constants that reach a `Slice`'s starts or ends (through `Cast`, `Reshape`, `Unsqueeze`,
/// `Squeeze`, `Identity`, `Concat`) are clamped to ±(2^31 - 1), which slices the same.
/// Returns how many constants changed.
fn clamp_slice_bounds(model: &mut Model) -> usize {
    use crate::ir::ValueId;
    const LIMIT: i64 = i32::MAX as i64;
    fn clamp(t: &crate::proto::TensorProto) -> Option<crate::proto::TensorProto> {
        if t.data_type() != crate::proto::tensor_proto::DataType::Int64 as i32 {
            return None;
        }
        let mut t = t.clone();
        let mut changed = false;
        let mut fix = |v: &mut i64| {
            let c = (*v).clamp(-LIMIT, LIMIT);
            changed |= c != *v;
            *v = c;
        };
        if let Some(raw) = t.raw_data.as_mut() {
            for chunk in raw.chunks_exact_mut(8) {
                let mut v = i64::from_le_bytes(chunk.try_into().expect("8 bytes"));
                fix(&mut v);
                chunk.copy_from_slice(&v.to_le_bytes());
            }
        }
        t.int64_data.iter_mut().for_each(&mut fix);
        changed.then_some(t)
    }
    let mut pending: Vec<ValueId> = Vec::new();
    for n in model.all_nodes() {
        let node = model.node(n);
        if node.proto.op_type() == "Slice"
            && crate::ir::normalize_domain(node.proto.domain()).is_empty()
        {
            pending.extend(
                [1, 2]
                    .iter()
                    .filter_map(|s| node.inputs.get(*s).copied().flatten()),
            );
        }
    }
    let mut seen = std::collections::HashSet::new();
    let mut changed = 0;
    while let Some(v) = pending.pop() {
        if !seen.insert(v) {
            continue;
        }
        let body = model.defining_body(v);
        let is_input = model.body(body).inputs.iter().any(|(i, _)| *i == v);
        if let Some(t) = model.initializer(v) {
            if !is_input {
                if let Some(t) = clamp(t) {
                    model.set_initializer(v, t);
                    changed += 1;
                }
            }
            continue;
        }
        let Some((producer, _)) = model.producer(v) else {
            continue;
        };
        let node = model.node(producer);
        if !crate::ir::normalize_domain(node.proto.domain()).is_empty() {
            continue;
        }
        match node.proto.op_type() {
            "Constant" => {
                let attr = node
                    .proto
                    .attribute
                    .iter()
                    .position(|a| a.name() == "value");
                let fixed = attr.and_then(|i| node.proto.attribute[i].t.as_ref().and_then(clamp));
                if let (Some(i), Some(t)) = (attr, fixed) {
                    model.node_mut(producer).proto.attribute[i].t = Some(t);
                    changed += 1;
                }
            }
            "Cast" | "Reshape" | "Unsqueeze" | "Squeeze" | "Identity" => {
                pending.extend(node.inputs.first().copied().flatten());
            }
            "Concat" => pending.extend(node.inputs.iter().flatten().copied()),
            _ => {}
        }
    }
    changed
}

/// Whether tract lacks an op of this domain and type that the pass lowers (or that nothing
/// can lower: any other `com.microsoft` op). `Gemm` is not among them: tract lacks only its
/// float16 form, which [`needs_lowering`] looks for.
pub fn tract_lacks(domain: &str, op_type: &str) -> bool {
    match crate::ir::normalize_domain(domain) {
        "" => matches!(
            op_type,
            "SoftmaxCrossEntropyLoss"
                | "NegativeLogLikelihoodLoss"
                | "BatchNormalization"
                | "MaxUnpool"
        ),
        "com.microsoft" => true,
        _ => false,
    }
}

/// Whether `model` (its subgraphs included) holds an op that tract lacks, a float16 `Gemm`
/// or an integer `CumSum`.
pub fn needs_lowering(model: &ModelProto) -> bool {
    fn graph_has(g: &crate::proto::GraphProto, f: fn(&crate::proto::NodeProto) -> bool) -> bool {
        g.node.iter().any(|n| {
            f(n) || n.attribute.iter().any(|a| {
                a.g.as_ref().is_some_and(|s| graph_has(s, f))
                    || a.graphs.iter().any(|s| graph_has(s, f))
            })
        })
    }
    let Some(g) = model.graph.as_ref() else {
        return false;
    };
    if graph_has(g, |n| {
        tract_lacks(n.domain(), n.op_type()) || misnamed_random_like(n)
    }) {
        return true;
    }
    // A Slice, and an int64 constant beyond the int32 range that may be its bound, which
    // tract misreads ([`clamp_slice_bounds`]).
    fn beyond_int32(t: &crate::proto::TensorProto) -> bool {
        const LIMIT: u64 = i32::MAX as u64;
        t.data_type() == crate::proto::tensor_proto::DataType::Int64 as i32
            && (t.int64_data.iter().any(|v| v.unsigned_abs() > LIMIT)
                || t.raw_data().chunks_exact(8).any(|c| {
                    i64::from_le_bytes(c.try_into().expect("8 bytes")).unsigned_abs() > LIMIT
                }))
    }
    if graph_has(g, |n| {
        n.op_type() == "Slice" && crate::ir::normalize_domain(n.domain()).is_empty()
    }) && (g.initializer.iter().any(beyond_int32)
        || graph_has(g, |n| {
            n.op_type() == "Constant"
                && n.attribute
                    .iter()
                    .any(|a| a.name() == "value" && a.t.as_ref().is_some_and(beyond_int32))
        }))
    {
        return true;
    }
    // A Gemm's or a CumSum's element type may need a walk up its producers: ask the IR,
    // only when there is one at all (or a ReverseSequence, which tract lacks).
    if !graph_has(g, |n| {
        matches!(
            n.op_type(),
            "Gemm" | "CumSum" | "ReverseSequence" | "Loop" | "Dropout"
        ) && crate::ir::normalize_domain(n.domain()).is_empty()
    }) {
        return false;
    }
    let ir = Model::from_proto(model.clone());
    let mut nodes = ir.all_nodes();
    nodes.any(|n| {
        legalize::loop_as_scan::takes(&ir, n)
            || legalize::while_as_counted::takes(&ir, n)
            || legalize::TRACT_LOWERINGS
                .iter()
                .any(|(takes, _)| takes(&ir, n))
    })
}

/// `model` ready for tract: itself when it has nothing tract lacks, else [`lower_model`].
pub fn prepare(model: &ModelProto) -> Result<std::borrow::Cow<'_, ModelProto>, PassError> {
    if needs_lowering(model) {
        Ok(std::borrow::Cow::Owned(lower_model(model)?))
    } else {
        Ok(std::borrow::Cow::Borrowed(model))
    }
}

/// `model` with the ops tract lacks lowered, its inputs, outputs and metadata untouched.
pub fn lower_model(model: &ModelProto) -> Result<ModelProto, PassError> {
    super::lowered_in_memory(model, PASS, |ir, state| {
        lower(ir, state, None, super::RunningVar::Biased).map(|_| ())
    })
}
