//! Convolutions on ONNX Runtime's blocked-layout CPU kernels (NCHWc), in memory, for a
//! session: `Conv(X, W, B)` becomes `ReorderOutput(nchwc.Conv(ReorderInput(X), blocked(W),
//! B))`, and the data gradient `ConvTranspose(dY, W)` of a stride-1 convolution becomes the
//! same blocked `Conv` of dY with W's channels swapped and its taps flipped. The step file
//! is never rewritten: it stays standard ONNX.
//!
//! Why: ONNX Runtime's own NCHWc transformer applies only to weights that are constant
//! initializers, which a training step's parameters never are, so every training
//! convolution ran on the im2col + GEMM kernel. The blocked kernel reads the weight at run
//! time (`contrib_ops/cpu/nchwc_ops.cc`), so the weight can be put in its layout by standard
//! ops inside the graph: a Reshape, a Transpose and a Reshape of a few thousand floats per
//! run. With onnx-ga's fused kernels in the session, one `BlockedWeight` node does it
//! instead, by one copy, the same bits: ONNX Runtime moves the six-axis Transpose one
//! element at a time (0.15-0.2 ms for 64x64x3x3; benches/README.md, "Run AA").
//!
//! Measured on this AVX-512 machine (`benches/README.md`, "Convolution backward"), 3x3
//! convolutions with 16 or more channels at 16x16 or wider: 0.58-0.70x the im2col kernel's
//! time forward, 0.72-0.92x for the stride-1 data gradient (reorders included); 1x1
//! convolutions lose (1.3x: ONNX Runtime runs them as one GEMM already), and so does the
//! 3-channel stem (0.9-1.4x). 8x8 images lost at small batches on that machine (1.0-1.4x);
//! on an Emerald Rapids Xeon, in the ResNet-8's floor (ONNX Runtime's profiler, the last
//! block's two 64-channel convolutions and the data gradient, weight layouts included,
//! normalised by the unchanged GEMMs' time) they take 0.70x (B 32, one thread) and 0.58x
//! (B 32, two threads) of the im2col kernel's time, 0.97x and 1.26x at B 8 (`benches/README.md`,
//! run S): the batch is not known when a session is made, and the larger batch has more to
//! gain, so 8 wide is admitted. Hence the rule below.
//!
//! Rewritten: a `Conv` or a stride-1, undilated `ConvTranspose` of the main graph, 2-D,
//! one group, explicit pads, float32, a kernel larger than 1x1, input and output channels
//! multiples of the kernel's block size, an output at least [`MIN_WIDTH`] wide (static
//! shapes), and a weight that is not a constant. A `Relu` that is the convolution's only
//! reader is folded into the kernel, as ONNX Runtime's `FusedConv` would have.
//!
//! Not bit-identical: the blocked kernel sums each output over its taps in another order
//! than the GEMM, so results differ from the im2col kernel's within float32 rounding
//! (tests/nchwc_conv.rs bounds it).
//!
//! In-place updates stay ordered: every node this adds that reads a weight is upstream of
//! the convolution's original output, so an update that waited on something downstream of
//! the convolution still runs after every read ([`super::fuse::in_place`]).

use std::collections::HashMap;

use super::autodiff::shapes::{constant_tensor, Facts, Shapes};
use crate::ir::builder::{attr_int, attr_ints, attr_string, Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, Use, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "nchwc-conv";
/// ONNX Runtime's contrib domain of the blocked-layout kernels.
pub const DOMAIN: &str = "com.microsoft.nchwc";
pub const DOMAIN_VERSION: i64 = 1;
/// The narrowest output this rewrites (see the module's measurements).
pub const MIN_WIDTH: i64 = 8;

/// A session's model with its convolutions on the blocked kernels.
pub struct Rewritten {
    pub model: ModelProto,
    /// Convolutions rewritten (forward and data-gradient alike).
    pub convs: usize,
    /// Weights put in the blocked layout by onnx-ga's `BlockedWeight` kernel.
    pub weights_on_kernel: usize,
}

/// `model` with every convolution the rule admits on the blocked kernels of `block`
/// channels (ONNX Runtime's `MlasNchwcGetBlockSize`); `None` when none is. `own_kernel`:
/// the session has onnx-ga's fused kernels, and the weights go in the blocked layout on
/// `BlockedWeight` (one copy) instead of the standard ops' six-axis `Transpose`.
pub fn rewrite(
    model: &ModelProto,
    block: i64,
    own_kernel: bool,
) -> Result<Option<Rewritten>, super::PassError> {
    let has_conv = model.graph.as_ref().is_some_and(|g| {
        g.node
            .iter()
            .any(|n| matches!(n.op_type(), "Conv" | "ConvTranspose"))
    });
    if !has_conv || block < 2 {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    let candidates: Vec<(NodeId, Plan)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| plan(&ir, &shapes, n, block).map(|p| (n, p)))
        .collect();
    if candidates.is_empty() {
        return Ok(None);
    }
    let mut rewriter = Rewriter {
        block,
        own_kernel,
        inputs: HashMap::new(),
        weights: HashMap::new(),
    };
    for (node, plan) in &candidates {
        rewriter.rewrite(&mut ir, *node, plan);
    }
    ir.require_opset(DOMAIN, DOMAIN_VERSION);
    if own_kernel {
        ir.require_opset(crate::fused_ops::DOMAIN, crate::fused_ops::DOMAIN_VERSION);
    }
    crate::ir::verify::verify(&ir).map_err(|errors| super::PassError::Verify {
        pass: PASS.into(),
        errors,
    })?;
    Ok(Some(Rewritten {
        model: ir.to_proto(),
        convs: candidates.len(),
        weights_on_kernel: if own_kernel {
            rewriter.weights.len()
        } else {
            0
        },
    }))
}

/// How one convolution goes onto the blocked kernel.
struct Plan {
    /// The data gradient of a stride-1 convolution: the weight's channels are swapped and
    /// its taps flipped, the pads become `k - 1 - p`.
    transposed: bool,
    /// The blocked kernel's weight dims `[out channels, in channels, kh, kw]`.
    dims: [i64; 4],
    pads: [i64; 4],
    strides: [i64; 2],
    dilations: [i64; 2],
}

/// The plan for `node` when the module's rule admits it.
fn plan(model: &Model, shapes: &Shapes, node: NodeId, block: i64) -> Option<Plan> {
    let n = model.node(node);
    let transposed = match n.proto.op_type() {
        "Conv" => false,
        "ConvTranspose" => true,
        _ => return None,
    };
    if !normalize_domain(n.proto.domain()).is_empty() || n.outputs.len() != 1 {
        return None;
    }
    let (x, w) = (n.inputs.first().copied()??, n.inputs.get(1).copied()??);
    let y = n.outputs[0]?;
    // An attribute of the wrong type leaves the node as it is: ONNX Runtime says what is
    // wrong with it, not this rewrite.
    let ints = |name: &str| n.proto.attr_ints(name).ok();
    let group = n.proto.attr_int("group").ok()?.unwrap_or(1);
    let auto_pad = n.proto.attr_string("auto_pad").ok()?;
    if group != 1 || !matches!(auto_pad.as_deref(), None | Some("NOTSET")) {
        return None;
    }
    if transposed && (ints("output_shape")?.is_some() || nonzero(ints("output_padding")?)) {
        return None;
    }
    let float32 = |f: &Facts| f.elem == Some(DataType::Float as i32);
    let (x_facts, w_facts, y_facts) = (shapes.get(x), shapes.get(w), shapes.get(y));
    let w_dims: [i64; 4] = w_facts.static_dims()?.try_into().ok()?;
    let y_dims = y_facts.dims.as_ref().filter(|d| d.len() == 4)?;
    let width = y_dims[3].known()?;
    // X's facts may be unknown (a gradient): W's type and rank are X's.
    let x_other =
        x_facts.elem.is_some() && !float32(&x_facts) || x_facts.rank().is_some_and(|r| r != 4);
    if !float32(&w_facts) || x_other {
        return None;
    }
    if constant_tensor(model, w).is_some() {
        // ONNX Runtime's own transformer reorders constant weights once, at load.
        return None;
    }
    let [m, c, kh, kw] = w_dims;
    if let Some(kernel) = ints("kernel_shape")? {
        if kernel != [kh, kw] {
            return None;
        }
    }
    let pads: [i64; 4] = ints("pads")?.unwrap_or(vec![0; 4]).try_into().ok()?;
    let strides: [i64; 2] = ints("strides")?.unwrap_or(vec![1; 2]).try_into().ok()?;
    let dilations: [i64; 2] = ints("dilations")?.unwrap_or(vec![1; 2]).try_into().ok()?;
    let (dims, pads) = if transposed {
        // ConvTranspose(dY, W[M, C, kh, kw]) at stride 1 = Conv(dY, W'[C, M, kh, kw]),
        // W'[c, m, i, j] = W[m, c, kh-1-i, kw-1-j], each pad p -> k-1-p.
        if strides != [1, 1] || dilations != [1, 1] {
            return None;
        }
        let k = [kh, kw, kh, kw];
        let flipped: [i64; 4] = std::array::from_fn(|i| k[i] - 1 - pads[i]);
        if flipped.iter().any(|p| *p < 0) {
            return None;
        }
        ([c, m, kh, kw], flipped)
    } else {
        ([m, c, kh, kw], pads)
    };
    let admitted = kh * kw > 1
        && dims[0] % block == 0
        && dims[1] % block == 0
        && width >= MIN_WIDTH
        && pads.iter().all(|p| *p >= 0)
        && strides.iter().chain(&dilations).all(|s| *s >= 1);
    admitted.then_some(Plan {
        transposed,
        dims,
        pads,
        strides,
        dilations,
    })
}

fn nonzero(values: Option<Vec<i64>>) -> bool {
    values.is_some_and(|v| v.iter().any(|x| *x != 0))
}

/// Emits the blocked form; shares one reordered input per value and one blocked weight per
/// (weight, form) across the convolutions that read them.
struct Rewriter {
    block: i64,
    /// Weights on onnx-ga's `BlockedWeight` kernel rather than the standard ops.
    own_kernel: bool,
    inputs: HashMap<ValueId, ValueId>,
    weights: HashMap<(ValueId, bool), ValueId>,
}

impl Rewriter {
    fn rewrite(&mut self, model: &mut Model, node: NodeId, plan: &Plan) {
        let n = model.node(node);
        let (x, w) = (n.inputs[0].expect("planned"), n.inputs[1].expect("planned"));
        let bias = n.inputs.get(2).copied().flatten();
        let y = n.outputs[0].expect("planned");
        let relu = folded_relu(model, y);
        let xb = self.reordered_input(model, x);
        let wb = self.blocked_weight(model, w, plan);
        let mut attributes = vec![
            attr_ints("kernel_shape", &plan.dims[2..]),
            attr_ints("pads", &plan.pads),
            attr_ints("strides", &plan.strides),
            attr_ints("dilations", &plan.dilations),
            attr_int("group", 1),
        ];
        if relu.is_some() {
            attributes.push(attr_string("activation", "Relu"));
        }
        let result = relu.map_or(y, |r| model.node(r).outputs[0].expect("a Relu's output"));
        let hint = format!("{}.nchwc", model.name(result));
        let mut b = Builder::new(model, BodyId::MAIN, PASS);
        let conv = b.node(
            "Conv",
            DOMAIN,
            &[Some(xb), Some(wb), bias],
            &[&hint],
            attributes,
        );
        let yb = b.model.output(conv, 0);
        let reorder = b.node(
            "ReorderOutput",
            DOMAIN,
            &[Some(yb)],
            &[&format!("{hint}.reordered")],
            vec![attr_int("channels", plan.dims[0])],
        );
        let out = b.model.output(reorder, 0);
        model.replace_value(result, out);
        // The replaced nodes read nothing now: the Relu first (it reads y), then the conv.
        for old in relu.into_iter().chain([node]) {
            model
                .remove_node(old)
                .expect("its output was replaced by the blocked kernel's");
        }
    }

    fn reordered_input(&mut self, model: &mut Model, x: ValueId) -> ValueId {
        if let Some(xb) = self.inputs.get(&x) {
            return *xb;
        }
        let hint = format!("{}.nchwc", model.name(x));
        let node = Builder::new(model, BodyId::MAIN, PASS).node(
            "ReorderInput",
            DOMAIN,
            &[Some(x)],
            &[&hint],
            Vec::new(),
        );
        let xb = model.output(node, 0);
        self.inputs.insert(x, xb);
        xb
    }

    /// W in the kernel's `OIHWBiBo` layout (`MlasReorderFilterOIHWBiBo`): for each block of
    /// output channels, each block of input channels, each tap, a `block x block` tile with
    /// the output channel fastest. As dims: `[O/b, I/b, kh, kw, b(in), b(out)]`, handed to
    /// the kernel as `[O, I, kh, kw]`.
    fn blocked_weight(&mut self, model: &mut Model, w: ValueId, plan: &Plan) -> ValueId {
        if let Some(wb) = self.weights.get(&(w, plan.transposed)) {
            return *wb;
        }
        let b = self.block;
        let [o, i, kh, kw] = plan.dims;
        let hint = format!("{}.nchwc", model.name(w));
        let mut builder = Builder::new(model, BodyId::MAIN, PASS);
        if self.own_kernel {
            let node = builder.node(
                crate::fused_ops::BLOCKED_WEIGHT,
                crate::fused_ops::DOMAIN,
                &[Some(w)],
                &[&hint],
                vec![
                    attr_int("block", b),
                    attr_int("transposed", plan.transposed as i64),
                ],
            );
            let wb = model.output(node, 0);
            self.weights.insert((w, plan.transposed), wb);
            return wb;
        }
        let (source, split, perm) = if plan.transposed {
            // W[M, C, kh, kw] with its taps flipped, read as [M/b, b, C/b, b, kh, kw]: the
            // blocked kernel's input channels are W's first axis, its outputs the second.
            let starts = builder.ints("flip_starts", &[-1, -1]);
            let ends = builder.ints("flip_ends", &[i64::MIN, i64::MIN]);
            let axes = builder.ints("flip_axes", &[2, 3]);
            let steps = builder.ints("flip_steps", &[-1, -1]);
            let flipped = builder.op(
                "Slice",
                &[w, starts, ends, axes, steps],
                Vec::new(),
                &format!("{hint}.flipped"),
            );
            (flipped, [i / b, b, o / b, b, kh, kw], [2, 0, 4, 5, 1, 3])
        } else {
            (w, [o / b, b, i / b, b, kh, kw], [0, 2, 4, 5, 3, 1])
        };
        let split = builder.ints("block_split", &split);
        let tiles = builder.op(
            "Reshape",
            &[source, split],
            Vec::new(),
            &format!("{hint}.split"),
        );
        let tiles = builder.op(
            "Transpose",
            &[tiles],
            vec![attr_ints("perm", &perm)],
            &format!("{hint}.tiles"),
        );
        let dims = builder.ints("kernel_dims", &plan.dims);
        let wb = builder.op("Reshape", &[tiles, dims], Vec::new(), &hint);
        self.weights.insert((w, plan.transposed), wb);
        wb
    }
}

/// The `Relu` that is `y`'s only reader, in the main graph, when there is one.
fn folded_relu(model: &Model, y: ValueId) -> Option<NodeId> {
    let [Use::Node { node, slot: 0 }] = model.uses(y) else {
        return None;
    };
    let relu = model.node(*node);
    let plain = relu.proto.op_type() == "Relu"
        && normalize_domain(relu.proto.domain()).is_empty()
        && relu.body == BodyId::MAIN
        && relu.outputs.len() == 1
        && relu.outputs[0].is_some();
    plain.then_some(*node)
}
