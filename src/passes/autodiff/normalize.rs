//! Forward normalisation before differentiation: the model a user exported for inference
//! becomes the model they train.
//!
//! - **BatchNormalization -> training form.** Inference exports normalise with the running
//!   statistics; training normalises with the batch's own. Every BatchNormalization becomes
//!   `com.microsoft::BatchNormInternal(training_mode = 1)` (what ORT's training graphs have,
//!   and what `legalize-ort` lowers to standard ops), its running statistics become graph
//!   inputs backed by their initializers, and the lowering turns their update into
//!   `bn_stat` state (per window or per micro-step, `--bn-stats`). Never ONNX's own
//!   BatchNormalization in training mode on initializer statistics: ONNX Runtime 1.31 writes
//!   its running outputs in place into those inputs and merges equal-valued initializers,
//!   so zero/one statistics alias BN biases and weights (measured: a loss 4.1e-4 off and
//!   drifting between runs).
//!   A BatchNormalization whose mean and variance the graph computes (tf2onnx's Keras
//!   LayerNormalization) is arithmetic on them and is written out instead.
//! - **Dropout**, in any body, gets `training_mode = true` (`--dropout train`, the default:
//!   the mask the forward draws is reused by the backward), or is removed (`--dropout off`;
//!   an Identity in a body, whose output must be computed there).
//! - **SplitToSequence + SequenceAt** at constant positions (what the torch exporter writes
//!   for `x.split(n)`) become one `Split`, so no sequence reaches the gradient.
//! - **If** with a condition known before the run (shape arithmetic the facts fold) is
//!   replaced by the branch it takes; one on data stays, and `if_grad` differentiates it.
//! - **Scan** becomes the Loop it is (`scan_as_loop`), which the next step treats as any,
//!   in whatever body it is.
//! - **Loop** with a trip count known before the run is unrolled first (`unroll_loop`:
//!   tf2onnx's Keras SimpleRNN and GRU), so what its body holds is normalised like the rest.
//!   These three repeat until nothing changes: control flow nested in an unrolled body or
//!   an inlined branch lands in the main graph (an If on the iteration number is decided
//!   once the iteration is).
//! - **LSTM, GRU, RNN** are unrolled into their cell equations over the (known) sequence
//!   length (`unroll_rnn`), so their gradients come from the rules of the ops they are made of.
//! - **CastLike(X, like)** whose `like` has a known element type becomes `Cast(X, to)`. The
//!   dynamo exporter casts scalar constants "like" an activation; ONNX Runtime's CUDA
//!   provider has no CastLike kernel, so it ran on the CPU and the activation was copied to
//!   the host at every micro-step only for its type.

use std::collections::HashMap;

use crate::ir::builder::{attr_float, attr_int, tensor_bool, Builder, NodeAttributes};
use crate::ir::inline::Branch;
use crate::ir::{BodyId, Model, NodeId, Use, ValueId};
use crate::passes::PassError;

use super::rules::node_error;
use super::shapes::{constant_ints, known_ints, Facts};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropoutMode {
    Train,
    Off,
}

impl DropoutMode {
    /// The word of autodiff's `dropout=` option and `--dropout`.
    pub fn as_str(self) -> &'static str {
        match self {
            DropoutMode::Train => "train",
            DropoutMode::Off => "off",
        }
    }
}

value_enum!(DropoutMode: DropoutMode::Train, DropoutMode::Off);

/// What becomes of a `Loop`: unrolled into its iterations where its trip count is known
/// before the run (`unroll_loop`; the default), or kept as a Loop whose gradient is a Loop
/// too (`loop_grad`; a graph that does not grow with the sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopMode {
    Unroll,
    Keep,
}

impl LoopMode {
    /// The word of autodiff's `loops=` option and `--loops`.
    pub fn as_str(self) -> &'static str {
        match self {
            LoopMode::Unroll => "unroll",
            LoopMode::Keep => "keep",
        }
    }
}

value_enum!(LoopMode: LoopMode::Unroll, LoopMode::Keep);

/// What normalisation changed, for the report.
#[derive(Default)]
pub struct Normalized {
    /// Running statistics that became graph inputs (their update becomes `bn_stat` state).
    pub bn_stats: Vec<ValueId>,
    pub batch_norms: usize,
    pub dropouts: usize,
    pub splits: usize,
    pub recurrent: usize,
    pub attention: usize,
    /// Loops unrolled: name and trip count.
    pub loops: Vec<(String, usize)>,
    /// Ifs the shape facts decide, replaced by the branch they take: name and branch.
    pub ifs: Vec<(String, Branch)>,
    /// Scans rewritten as Loops.
    pub scans: usize,
}

pub fn normalize(
    model: &mut Model,
    dropout: DropoutMode,
    loops: LoopMode,
    pass: &'static str,
) -> Result<Normalized, PassError> {
    // Control flow, until nothing changes: Ifs the shapes decide are inlined, Scans become
    // Loops (at any depth: a kept Loop's body is differentiated by the same rules), Loops
    // with a known trip count are unrolled. Each may bring control flow that was nested in
    // a body into the main graph: an unrolled iteration may decide an If, an inlined branch
    // may hold a Loop.
    let mut out = Normalized::default();
    loop {
        out.ifs.extend(inline_decided_ifs(model)?);
        out.scans += rewrite_scans(model, pass)?;
        let unrolled = match loops {
            LoopMode::Unroll => unroll_loops(model, pass)?,
            LoopMode::Keep => Vec::new(),
        };
        if unrolled.is_empty() {
            break;
        }
        out.loops.extend(unrolled);
    }
    let nodes: Vec<NodeId> = model.body_nodes(BodyId::MAIN).collect();
    let inputs = computed_statistics_inputs(model, &nodes);
    for node in nodes {
        let p = &model.node(node).proto;
        if !p.domain().is_empty() && p.domain() != "ai.onnx" {
            continue;
        }
        match p.op_type() {
            "BatchNormalization" => {
                // (A match guard would hold the op type's borrow of the model.)
                #[allow(clippy::collapsible_match)]
                if batch_norm(model, node, pass, inputs.get(&node), &mut out)? {
                    out.batch_norms += 1;
                }
            }
            "SplitToSequence" => {
                // (A match guard would hold the op type's borrow of the model.)
                #[allow(clippy::collapsible_match)]
                if split_to_sequence(model, node, pass)? {
                    out.splits += 1;
                }
            }
            _ => {}
        }
    }
    // Dropouts at any depth: those of bodies train too (a kept Loop's backward reads the
    // masks its forward drew; an If's refuses them).
    let dropouts: Vec<NodeId> = model
        .all_nodes()
        .filter(|n| {
            let p = &model.node(*n).proto;
            p.op_type() == "Dropout" && (p.domain().is_empty() || p.domain() == "ai.onnx")
        })
        .collect();
    for node in dropouts {
        dropout_node(model, node, dropout, pass)?;
        out.dropouts += 1;
    }
    cast_likes_to_casts(model);
    // The sequence length comes from the shape facts, inferred again before each layer:
    // a stacked layer reads the values the one before it was unrolled into.
    out.recurrent = rewrite_each(
        model,
        super::unroll_rnn::is_recurrent,
        |model, node, shapes| super::unroll_rnn::unroll(model, node, shapes, loops, pass),
    )?;
    out.attention = rewrite_each(
        model,
        super::expand_attention::is_attention,
        |model, node, shapes| super::expand_attention::expand(model, node, shapes, pass),
    )?;
    Ok(out)
}

/// Replaces every If of the main graph whose condition is known before the run (shape
/// arithmetic: TorchScript's `if x.dim() == 4`, an exporter's check of a size) by the branch
/// it takes, until none is left (an inlined branch may hold Ifs of its own); each one's name
/// and branch. One that is not stays, differentiated by `if_grad`.
fn inline_decided_ifs(model: &mut Model) -> Result<Vec<(String, Branch)>, PassError> {
    let mut inlined = Vec::new();
    // Most models hold no If: no shape inference for them.
    while model
        .body_nodes(BodyId::MAIN)
        .any(|n| super::if_grad::is_if(model, n))
    {
        let shapes = super::shapes::Shapes::infer(model);
        let decided: Vec<(NodeId, Branch)> = model
            .body_nodes(BodyId::MAIN)
            .filter(|n| super::if_grad::is_if(model, *n))
            .filter_map(|n| {
                let condition = model.node(n).inputs.first().copied().flatten()?;
                match known_ints(model, &shapes, condition)?.as_slice() {
                    [0] => Some((n, Branch::Else)),
                    [_] => Some((n, Branch::Then)),
                    _ => None,
                }
            })
            .collect();
        if decided.is_empty() {
            break;
        }
        for (node, branch) in decided {
            let name = match model.node(node).proto.name() {
                "" => "If".to_string(),
                name => name.to_string(),
            };
            model
                .inline_if(node, branch)
                .map_err(|e| node_error(model, node, e.to_string()))?;
            inlined.push((name, branch));
        }
    }
    Ok(inlined)
}

/// Unrolls every Loop of the main graph whose trip count is known before the run; each
/// one's name and trip count. One that is not stays, and the autodiff says why if a
/// gradient must pass it.
fn unroll_loops(model: &mut Model, pass: &'static str) -> Result<Vec<(String, usize)>, PassError> {
    let loops: Vec<NodeId> = model
        .body_nodes(BodyId::MAIN)
        .filter(|n| super::loop_parts::is_loop(model, *n))
        .collect();
    let mut unrolled = Vec::new();
    for node in loops {
        let shapes = super::shapes::Shapes::infer(model);
        let name = match model.node(node).proto.name() {
            "" => "Loop".to_string(),
            name => name.to_string(),
        };
        if let Some(trips) = super::unroll_loop::unroll(model, node, &shapes, pass)? {
            unrolled.push((name, trips));
        }
    }
    Ok(unrolled)
}

/// Rewrites every Scan as a Loop (`scan_as_loop`), wherever it is, an outer one before
/// those nested in its body (which move with it); how many.
fn rewrite_scans(model: &mut Model, pass: &'static str) -> Result<usize, PassError> {
    let is_scan = |model: &Model, n: NodeId| {
        let p = &model.node(n).proto;
        crate::ir::normalize_domain(p.domain()).is_empty()
            && super::scan_as_loop::is_scan(p.op_type())
    };
    let mut rewritten = 0;
    loop {
        let outermost = model
            .all_nodes()
            .find(|n| is_scan(model, *n) && !in_scan_body(model, model.node(*n).body));
        let Some(scan) = outermost else { break };
        let shapes = super::shapes::Shapes::infer(model);
        super::scan_as_loop::rewrite(model, scan, &shapes, pass)?;
        rewritten += 1;
    }
    Ok(rewritten)
}

/// Whether `body` is a Scan's body or nested in one.
fn in_scan_body(model: &Model, body: BodyId) -> bool {
    let mut scope = Some(body);
    while let Some(b) = scope {
        if let Some(owner) = model.body(b).owner {
            if super::scan_as_loop::is_scan(model.node(owner).proto.op_type()) {
                return true;
            }
        }
        scope = model.body(b).parent;
    }
    false
}

/// Rewrites every default-domain node of the main graph whose op `selects` picks with
/// `rewrite`, the shape facts inferred again before each; how many it rewrote.
fn rewrite_each(
    model: &mut Model,
    selects: fn(&str) -> bool,
    rewrite: impl Fn(&mut Model, NodeId, &super::shapes::Shapes) -> Result<(), PassError>,
) -> Result<usize, PassError> {
    let nodes: Vec<NodeId> = model
        .body_nodes(BodyId::MAIN)
        .filter(|n| {
            let p = &model.node(*n).proto;
            (p.domain().is_empty() || p.domain() == "ai.onnx") && selects(p.op_type())
        })
        .collect();
    for &node in &nodes {
        let shapes = super::shapes::Shapes::infer(model);
        rewrite(model, node, &shapes)?;
    }
    Ok(nodes.len())
}

/// The training form of a BatchNormalization on running statistics (true), or the
/// arithmetic of one on statistics the graph computes (false).
fn batch_norm(
    model: &mut Model,
    node: NodeId,
    pass: &'static str,
    x_facts: Option<&Facts>,
    out: &mut Normalized,
) -> Result<bool, PassError> {
    let n = model.node(node).clone();
    let input = |i: usize| {
        n.inputs
            .get(i)
            .copied()
            .flatten()
            .ok_or_else(|| node_error(model, node, format!("input {i} is required but absent")))
    };
    let (x, scale, bias, mean, var) = (input(0)?, input(1)?, input(2)?, input(3)?, input(4)?);
    let epsilon = n.proto.attr_float("epsilon").ok().flatten().unwrap_or(1e-5);
    let momentum = n.proto.attr_float("momentum").ok().flatten().unwrap_or(0.9);
    let computed = [mean, var]
        .iter()
        .filter(|s| model.initializer(**s).is_none())
        .count();
    match computed {
        0 => {}
        2 => {
            let facts = x_facts.cloned().unwrap_or_default();
            return with_computed_statistics(model, node, pass, epsilon, &facts).map(|()| false);
        }
        _ => {
            return Err(node_error(
                model,
                node,
                "one statistic is an initializer and the other computed by the graph: neither running statistics to train with nor a normalisation the graph computes".into(),
            ))
        }
    }
    for stat in [mean, var] {
        model.promote_initializer_to_input(stat);
        if !out.bn_stats.contains(&stat) {
            out.bn_stats.push(stat);
        }
    }
    let y_name = n
        .outputs
        .first()
        .copied()
        .flatten()
        .map(|v| model.name(v).to_string())
        .unwrap_or_else(|| "bn".into());
    let mut b = Builder::new(model, BodyId::MAIN, pass);
    model_require_ms(b.model);
    let hints = [
        format!("{y_name}_train"),
        format!("{y_name}_running_mean"),
        format!("{y_name}_running_var"),
        format!("{y_name}_saved_mean"),
        format!("{y_name}_saved_inv_std"),
    ];
    let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
    let internal = b.node(
        "BatchNormInternal",
        "com.microsoft",
        &[Some(x), Some(scale), Some(bias), Some(mean), Some(var)],
        &hints,
        vec![
            attr_float("epsilon", epsilon),
            attr_float("momentum", momentum),
            attr_int("training_mode", 1),
        ],
    );
    for slot in 0..3 {
        if let Some(Some(old)) = n.outputs.get(slot) {
            let new = model.output(internal, slot);
            model.replace_value(*old, new);
        }
    }
    model
        .remove_node(node)
        .map_err(|e| node_error(model, node, format!("could not replace the node: {e}")))?;
    Ok(true)
}

fn model_require_ms(model: &mut Model) {
    model.require_opset("com.microsoft", 1);
}

fn dropout_node(
    model: &mut Model,
    node: NodeId,
    mode: DropoutMode,
    pass: &'static str,
) -> Result<(), PassError> {
    let opset = model.opset("").unwrap_or(1);
    if opset < 12 {
        return Err(node_error(model, node, format!("Dropout of opset {opset} (before 12 it has no training_mode input) is not supported")));
    }
    match mode {
        DropoutMode::Off => {
            let n = model.node(node).clone();
            if n.outputs
                .get(1)
                .copied()
                .flatten()
                .is_some_and(|m| !model.uses(m).is_empty())
            {
                return Err(node_error(
                    model,
                    node,
                    "--dropout off: the dropout mask is used by the model".into(),
                ));
            }
            let x = n
                .inputs
                .first()
                .copied()
                .flatten()
                .ok_or_else(|| node_error(model, node, "input 0 is absent".into()))?;
            if n.body != BodyId::MAIN {
                // The identity it is: a body's output may not be an outer value itself.
                for slot in 1..n.inputs.len() {
                    model.set_input(node, slot, None);
                }
                let node_mut = model.node_mut(node);
                node_mut.inputs.truncate(1);
                node_mut.outputs.truncate(1);
                node_mut.proto.op_type = Some("Identity".into());
                node_mut.proto.attribute.clear();
                return Ok(());
            }
            if let Some(Some(y)) = n.outputs.first() {
                model.replace_value(*y, x);
            }
            model
                .remove_node(node)
                .map_err(|e| node_error(model, node, format!("could not remove the node: {e}")))
        }
        DropoutMode::Train => {
            let t =
                model.add_initializer(BodyId::MAIN, "dropout_training", tensor_bool(&[], &[true]));
            let _ = pass;
            let len = model.node(node).inputs.len();
            if len < 3 {
                // Inputs are positional: pad the optional ratio with "absent".
                model.node_mut(node).inputs.resize(3, None);
            }
            model.set_input(node, 2, Some(t));
            Ok(())
        }
    }
}

/// `SplitToSequence(X, split?; axis, keepdims)` read only by `SequenceAt` at constant
/// positions becomes `Split` (plus `Squeeze` for `keepdims = 0`). Returns whether it did.
fn split_to_sequence(
    model: &mut Model,
    node: NodeId,
    pass: &'static str,
) -> Result<bool, PassError> {
    let n = model.node(node).clone();
    let Some(Some(seq)) = n.outputs.first().copied() else {
        return Ok(false);
    };
    let mut reads = Vec::new();
    for u in model.uses(seq).to_vec() {
        let Use::Node { node: at, slot: 0 } = u else {
            return Ok(false);
        };
        let a = model.node(at);
        if a.proto.op_type() != "SequenceAt" {
            return Ok(false);
        }
        let Some(pos) = a
            .inputs
            .get(1)
            .copied()
            .flatten()
            .and_then(|v| constant_ints(model, v))
        else {
            return Ok(false);
        };
        reads.push((at, pos.first().copied().unwrap_or(0)));
    }
    let x = n
        .inputs
        .first()
        .copied()
        .flatten()
        .ok_or_else(|| node_error(model, node, "input 0 is absent".into()))?;
    let axis = n.proto.attr_int("axis").ok().flatten().unwrap_or(0);
    let keepdims = n.proto.attr_int("keepdims").ok().flatten().unwrap_or(1);
    let split = n.inputs.get(1).copied().flatten();
    let shapes = super::shapes::Shapes::infer(model);
    let dims = shapes.get(x).dims;
    let rank = dims.as_ref().map(|d| d.len() as i64);
    let a = match rank {
        Some(r) if axis < 0 => axis + r,
        _ => axis,
    };
    let total = dims
        .as_ref()
        .and_then(|d| d.get(a as usize))
        .and_then(|d| d.known());
    let sizes: Vec<i64> = match split {
        None => match total {
            Some(t) => vec![1; t as usize],
            None => return Ok(false),
        },
        Some(s) => {
            let Some(v) = constant_ints(model, s) else {
                return Ok(false);
            };
            let scalar =
                super::shapes::constant_tensor(model, s).is_some_and(|t| t.dims.is_empty());
            if scalar {
                // A scalar chunk size: equal parts of that size, the last one smaller.
                let (Some(t), c) = (total, v[0]) else {
                    return Ok(false);
                };
                if c <= 0 {
                    return Ok(false);
                }
                let mut parts = vec![c; (t / c) as usize];
                if t % c != 0 {
                    parts.push(t % c);
                }
                parts
            } else {
                v
            }
        }
    };
    let mut b = Builder::new(model, BodyId::MAIN, pass);
    let name = b.model.name(seq).to_string();
    let hints: Vec<String> = (0..sizes.len()).map(|i| format!("{name}_{i}")).collect();
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    let opset = b.model.opset("").unwrap_or(13);
    let sizes_v = b.ints("split_sizes", &sizes);
    let split_node = if opset >= 13 {
        b.node(
            "Split",
            "",
            &[Some(x), Some(sizes_v)],
            &hint_refs,
            vec![attr_int("axis", axis)],
        )
    } else {
        b.node(
            "Split",
            "",
            &[Some(x)],
            &hint_refs,
            vec![
                attr_int("axis", axis),
                crate::ir::builder::attr_ints("split", &sizes),
            ],
        )
    };
    for (at, pos) in reads {
        let count = sizes.len() as i64;
        let p = if pos < 0 { pos + count } else { pos };
        if p < 0 || p >= count {
            return Err(node_error(
                b.model,
                at,
                format!("position {pos} is outside the {count} parts"),
            ));
        }
        let mut part = b.model.output(split_node, p as usize);
        if keepdims == 0 {
            let axes = b.ints("squeeze_axes", &[axis]);
            part = b.op(
                "Squeeze",
                &[part, axes],
                vec![],
                &format!("{name}_{p}_squeezed"),
            );
        }
        let old = b.model.output(at, 0);
        b.model.replace_value(old, part);
        b.model
            .remove_node(at)
            .map_err(|e| node_error(model_of(&b), at, format!("{e}")))?;
    }
    b.model
        .remove_node(node)
        .map_err(|e| node_error(model_of(&b), node, format!("{e}")))?;
    Ok(true)
}

fn model_of<'a>(b: &'a Builder<'_>) -> &'a Model {
    b.model
}

/// `CastLike(X, like)` -> `Cast(X, to = elem(like))` wherever `like`'s element type is known
/// (its `saturate` attribute kept: Cast has it from the same opset).
fn cast_likes_to_casts(model: &mut Model) {
    let cast_likes: Vec<NodeId> = model
        .body_nodes(BodyId::MAIN)
        .filter(|n| {
            let p = &model.node(*n).proto;
            (p.domain().is_empty() || p.domain() == "ai.onnx") && p.op_type() == "CastLike"
        })
        .collect();
    if cast_likes.is_empty() {
        return;
    }
    let shapes = super::shapes::Shapes::infer(model);
    for node in cast_likes {
        let Some(Some(like)) = model.node(node).inputs.get(1).copied() else {
            continue;
        };
        let Some(elem) = shapes.get(like).elem else {
            continue;
        };
        model.set_input(node, 1, None);
        let n = model.node_mut(node);
        n.inputs.truncate(1);
        n.proto.op_type = Some("Cast".into());
        n.proto.attribute.retain(|a| a.name() == "saturate");
        n.proto.attribute.push(attr_int("to", elem as i64));
    }
}

/// The facts of X of each BatchNormalization among `nodes` whose statistics the graph
/// computes, from one shape inference before any is written out (writing one out replaces
/// its output by a new value, which a later one may read as its X).
fn computed_statistics_inputs(model: &Model, nodes: &[NodeId]) -> HashMap<NodeId, Facts> {
    let computed: Vec<(NodeId, ValueId)> = nodes
        .iter()
        .filter_map(|n| {
            let node = model.node(*n);
            let default_domain = matches!(node.proto.domain(), "" | "ai.onnx");
            if !default_domain || node.proto.op_type() != "BatchNormalization" {
                return None;
            }
            let stat_computed = |slot: usize| {
                node.inputs
                    .get(slot)
                    .copied()
                    .flatten()
                    .is_some_and(|v| model.initializer(v).is_none())
            };
            let x = node.inputs.first().copied().flatten()?;
            (stat_computed(3) || stat_computed(4)).then_some((*n, x))
        })
        .collect();
    if computed.is_empty() {
        return HashMap::new();
    }
    let shapes = super::shapes::Shapes::infer(model);
    computed
        .into_iter()
        .map(|(n, x)| (n, shapes.get(x)))
        .collect()
}

/// A BatchNormalization whose mean and variance the graph computes is no running-statistics
/// layer but arithmetic on those: tf2onnx writes Keras's LayerNormalization so (a fused
/// batch norm over a reshaped view, its statistics from ReduceMean and ReduceSumSquare).
/// Written out, the rules differentiate it, statistics included:
/// `Y = (X - mean) · scale / sqrt(var + epsilon) + B`, the `[C]` vectors on axis 1.
fn with_computed_statistics(
    model: &mut Model,
    node: NodeId,
    pass: &'static str,
    epsilon: f32,
    x_facts: &Facts,
) -> Result<(), PassError> {
    let n = model.node(node).clone();
    let [x, scale, bias, mean, var] = [0, 1, 2, 3, 4].map(|i| n.inputs.get(i).copied().flatten());
    let (Some(x), Some(scale), Some(bias), Some(mean), Some(var)) = (x, scale, bias, mean, var)
    else {
        return Err(node_error(model, node, "an input is absent".into()));
    };
    let (Some(rank), Some(elem)) = (x_facts.rank(), x_facts.elem) else {
        return Err(node_error(
            model,
            node,
            format!(
                "its statistics are computed by the graph, and writing it out needs the rank and type of '{}', which are neither declared nor derivable",
                model.name(x)
            ),
        ));
    };
    let Some(y) = n.outputs.first().copied().flatten() else {
        return Err(node_error(model, node, "output 0 is absent".into()));
    };
    if n.outputs
        .iter()
        .skip(1)
        .flatten()
        .any(|v| !model.uses(*v).is_empty())
    {
        return Err(node_error(
            model,
            node,
            "its running-statistics outputs are read, with statistics the graph computes".into(),
        ));
    }
    let hint = model.name(y).to_string();
    let mut b = Builder::new(model, BodyId::MAIN, pass);
    // [C] -> [C, 1, ..]: each vector on axis 1 of X.
    let mut per_channel = vec![-1i64];
    per_channel.resize(rank.saturating_sub(1).max(1), 1);
    let shape = b.ints(&format!("{hint}_per_channel"), &per_channel);
    let eps = b.constant(
        &format!("{hint}_epsilon"),
        crate::ir::emit::scalar_tensor(elem, f64::from(epsilon)),
    );
    // Per channel first, so that X is read once by each of the two full-size ops:
    // Y = X · g + (B - mean · g), g = scale / sqrt(var + epsilon).
    let var_eps = b.op("Add", &[var, eps], vec![], &format!("{hint}_var_eps"));
    let std = b.op("Sqrt", &[var_eps], vec![], &format!("{hint}_std"));
    let gain = b.op("Div", &[scale, std], vec![], &format!("{hint}_gain"));
    let mean_gain = b.op("Mul", &[mean, gain], vec![], &format!("{hint}_mean_gain"));
    let shift = b.op("Sub", &[bias, mean_gain], vec![], &format!("{hint}_shift"));
    let [gain, shift] = [(gain, "gain"), (shift, "shift")].map(|(v, what)| {
        b.op(
            "Reshape",
            &[v, shape],
            vec![],
            &format!("{hint}_{what}_c11"),
        )
    });
    let scaled = b.op("Mul", &[x, gain], vec![], &format!("{hint}_scaled"));
    let out = b.op("Add", &[scaled, shift], vec![], &format!("{hint}_out"));
    model.replace_value(y, out);
    model
        .remove_node(node)
        .map_err(|e| node_error(model, node, format!("could not replace the node: {e}")))
}
