//! `agc(clip=0.01, eps=1e-3, exclude=GLOB;GLOB, include_final=false, axes=NAME:AXES;...)`:
//! adaptive gradient clipping (Brock et al. 2021) of the window's normalised gradient, in the
//! apply region between normalisation (and unscaling) and the optimizer.
//!
//! For each unit u of a parameter W with window gradient G:
//!
//! ```text
//! max_norm_u = clip * max(||W_u||, eps)
//! G_u       <- G_u * (max_norm_u / ||G_u||)   if ||G_u|| > max_norm_u
//! G_u       <- G_u * 1                          otherwise (bit-exact identity)
//! ```
//!
//! Norms are `ReduceL2` over the unit's reduction axes with `keepdims`, so the factor
//! broadcasts back over the unit. The factor is a `Where`, so an unclipped unit (including a
//! zero gradient, whose ratio would be infinite) is multiplied by exactly 1.
//!
//! Units follow the ONNX layout of the op that consumes the parameter in the forward pass
//! (see [`derive_units`]). Forward nodes are those the loss depends on: ORT's gradient nodes
//! also read the parameters (`Gemm`, `ConvGrad`, `FusedMatMul` ...) but the loss never
//! depends on them. The final layer (the parametrised op nearest the loss on each path, with
//! its bias) is excluded unless `include_final=true`, as in the paper.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, attr_ints, Builder, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, Model, NodeId, Use, ValueId};
use crate::signature::TrainingSignature;

pub const PASS: &str = "agc";

/// How a parameter's gradient is cut into units.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Units {
    /// One unit: the norm of the whole tensor.
    Whole,
    /// The norm over `axes` (kept as size-1 dims); one unit per index of the other axes.
    Axes { axes: Vec<i64> },
    /// The tensor viewed as `view` (a reshape), then the norm over `axes` of that view.
    /// Grouped ConvTranspose: [C, M/g, k...] as [g, C/g, M/g, prod(k)], axes [1, 3].
    View { view: Vec<i64>, axes: Vec<i64> },
}

impl Units {
    /// Units in a tensor of `dims`.
    pub fn count(&self, dims: &[i64]) -> i64 {
        match self {
            Units::Whole => 1,
            Units::Axes { axes } => kept(dims, axes),
            Units::View { view, axes } => kept(view, axes),
        }
    }

    /// Short text: `whole`, `axes [1,2,3]`, `view [2,2,3,9] axes [1,3]`.
    pub fn describe(&self) -> String {
        let list = |v: &[i64]| {
            v.iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            Units::Whole => "whole".into(),
            Units::Axes { axes } => format!("axes [{}]", list(axes)),
            Units::View { view, axes } => format!("view [{}] axes [{}]", list(view), list(axes)),
        }
    }
}

fn kept(dims: &[i64], axes: &[i64]) -> i64 {
    dims.iter()
        .enumerate()
        .filter(|(i, _)| !axes.contains(&(*i as i64)))
        .map(|(_, d)| *d)
        .product()
}

/// Per-parameter reduction axes: `None` reduces the whole tensor.
pub type AxesOverride = (String, Option<Vec<i64>>);

/// Which parameters are clipped, and overrides of the derived units.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// Clip the final layer too.
    pub include_final: bool,
    /// Glob patterns (`*`, `?`) of parameter names not to clip.
    pub exclude: Vec<String>,
    /// Per-parameter reduction axes: `None` is the whole tensor.
    pub axes: Vec<AxesOverride>,
}

impl Selection {
    /// The selection as `agc` options: `include_final=true`, `exclude=A;B`,
    /// `axes=NAME:all;NAME:1/2`, each only when it selects something.
    pub fn options_text(&self) -> Vec<String> {
        let mut options = Vec::new();
        if self.include_final {
            options.push("include_final=true".into());
        }
        if !self.exclude.is_empty() {
            options.push(format!("exclude={}", self.exclude.join(";")));
        }
        if !self.axes.is_empty() {
            let items: Vec<String> = self
                .axes
                .iter()
                .map(|(name, axes)| match axes {
                    None => format!("{name}:all"),
                    Some(a) => format!(
                        "{name}:{}",
                        a.iter()
                            .map(|x| x.to_string())
                            .collect::<Vec<_>>()
                            .join("/")
                    ),
                })
                .collect();
            options.push(format!("axes={}", items.join(";")));
        }
        options
    }
}

/// The options of an `agc` spec: `clip`, `eps` (`None`: not written, the default), then
/// the selection's.
pub fn options_text(clip: f32, eps: Option<f32>, selection: &Selection) -> Vec<String> {
    let mut options = vec![format!("clip={clip}")];
    if let Some(eps) = eps {
        options.push(format!("eps={eps}"));
    }
    options.extend(selection.options_text());
    options
}

/// The AGC plan of one trainable parameter.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParamUnits {
    pub name: String,
    pub dims: Vec<i64>,
    pub units: Units,
    pub unit_count: i64,
    /// How the units were decided, e.g. `Conv 'conv' W: per output channel`.
    pub rule: String,
    /// Set when the whole-tensor fallback was taken for a reason worth reporting.
    pub note: Option<String>,
    /// A parameter of the final layer.
    pub final_layer: bool,
    /// Why the parameter is not clipped; `None` when it is.
    pub excluded: Option<String>,
}

/// What [`plan`] found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub params: Vec<ParamUnits>,
    /// The final-layer op(s), e.g. `Gemm 'logits' (fc2.weight, fc2.bias)`.
    pub final_layer: Vec<String>,
}

fn fail(message: String) -> PassError {
    PassError::Other {
        pass: PASS.into(),
        message,
    }
}

/// Units of every trainable parameter of `signature`, the final layer, and exclusions.
/// Errors on a selection that names nothing (a typo must not silently clip everything).
pub fn plan(
    model: &Model,
    signature: &TrainingSignature,
    selection: &Selection,
) -> Result<Plan, String> {
    let main = BodyId::MAIN;
    let loss = model
        .lookup(main, &signature.loss)
        .ok_or_else(|| format!("loss '{}' is not a value of the graph", signature.loss))?;
    let forward = forward_nodes(model, loss);
    let trainable: Vec<(&str, ValueId, &[i64])> = signature
        .trainable()
        .filter_map(|p| {
            model
                .lookup(main, &p.name)
                .map(|v| (p.name.as_str(), v, p.dims.as_slice()))
        })
        .collect();
    let params: HashSet<ValueId> = trainable.iter().map(|(_, v, _)| *v).collect();
    let (final_nodes, final_params) = final_layer(model, &forward, loss, &params);
    let final_layer = final_nodes
        .iter()
        .map(|(n, ps)| {
            let names: Vec<&str> = ps.iter().map(|v| model.name(*v)).collect();
            format!("{} ({})", describe_node(model, *n), names.join(", "))
        })
        .collect();

    for pattern in &selection.exclude {
        if !trainable
            .iter()
            .any(|(name, _, _)| glob_match(pattern, name))
        {
            return Err(format!(
                "exclude pattern '{pattern}' matches no trainable parameter"
            ));
        }
    }
    for (name, axes) in &selection.axes {
        let Some((_, _, dims)) = trainable.iter().find(|(n, _, _)| n == name) else {
            return Err(format!(
                "axes override for '{name}': no trainable parameter has that name"
            ));
        };
        if let Some(axes) = axes {
            let rank = dims.len() as i64;
            if let Some(a) = axes.iter().find(|a| **a < -rank || **a >= rank.max(1)) {
                return Err(format!(
                    "axes override for '{name}': axis {a} is out of range for rank {rank}"
                ));
            }
        }
    }

    let mut out = Vec::new();
    for (name, value, dims) in &trainable {
        let (units, rule, note) = match selection.axes.iter().find(|(n, _)| n == name) {
            Some((_, axes)) => {
                let units = match axes {
                    None => Units::Whole,
                    Some(axes) => Units::Axes {
                        axes: normalize_axes(axes, dims.len()),
                    },
                };
                (units, "overridden (axes=...)".to_string(), None)
            }
            None => derive_units(model, &forward, *value, dims),
        };
        let final_layer = final_params.contains(value);
        let excluded = if let Some(p) = selection.exclude.iter().find(|p| glob_match(p, name)) {
            Some(format!("excluded by '{p}'"))
        } else if final_layer && !selection.include_final {
            Some("final layer".to_string())
        } else {
            None
        };
        out.push(ParamUnits {
            name: name.to_string(),
            dims: dims.to_vec(),
            unit_count: units.count(dims),
            units,
            rule,
            note,
            final_layer,
            excluded,
        });
    }
    Ok(Plan {
        params: out,
        final_layer,
    })
}

fn normalize_axes(axes: &[i64], rank: usize) -> Vec<i64> {
    let mut out: Vec<i64> = axes
        .iter()
        .map(|a| if *a < 0 { a + rank as i64 } else { *a })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Nodes of the main graph that the loss depends on: the forward pass.
pub fn forward_nodes(model: &Model, loss: ValueId) -> HashSet<NodeId> {
    let mut seen = HashSet::new();
    let mut stack = vec![loss];
    let mut visited_values = HashSet::new();
    while let Some(v) = stack.pop() {
        if !visited_values.insert(v) {
            continue;
        }
        let Some((node, _)) = model.producer(v) else {
            continue;
        };
        if model.node(node).body != BodyId::MAIN || !seen.insert(node) {
            continue;
        }
        stack.extend(model.node(node).inputs.iter().flatten().copied());
    }
    seen
}

fn describe_node(model: &Model, n: NodeId) -> String {
    let node = model.node(n);
    let name = match node.proto.name() {
        "" => node
            .outputs
            .iter()
            .flatten()
            .next()
            .map(|v| model.name(*v).to_string())
            .unwrap_or_default(),
        name => name.to_string(),
    };
    format!("{} '{name}'", node.proto.op_type())
}

/// Ops that pass a parameter through without changing its layout.
fn is_passthrough(op: &str) -> bool {
    matches!(op, "Identity" | "Cast")
}

/// The parameter `v` is, seen through Identity, Cast and Transpose.
fn param_root(model: &Model, v: ValueId, params: &HashSet<ValueId>) -> Option<ValueId> {
    if params.contains(&v) {
        return Some(v);
    }
    let (node, 0) = model.producer(v)? else {
        return None;
    };
    let n = model.node(node);
    if is_passthrough(n.proto.op_type()) || n.proto.op_type() == "Transpose" {
        param_root(model, n.inputs.first().copied().flatten()?, params)
    } else {
        None
    }
}

/// The final layer: walking back from the loss through parameter-free forward ops, the first
/// op on each path that reads a trainable parameter. When that op is a bias add
/// (Add/Sub/Sum), the parametrised op producing its other operand is included too
/// (MatMul + Add). Returns the ops with their parameters, and all those parameters.
fn final_layer(
    model: &Model,
    forward: &HashSet<NodeId>,
    loss: ValueId,
    params: &HashSet<ValueId>,
) -> (Vec<(NodeId, Vec<ValueId>)>, HashSet<ValueId>) {
    let reads = |n: NodeId| -> Vec<ValueId> {
        let mut out: Vec<ValueId> = model
            .node(n)
            .inputs
            .iter()
            .flatten()
            .filter_map(|v| param_root(model, *v, params))
            .collect();
        out.dedup();
        out
    };
    let mut found: Vec<(NodeId, Vec<ValueId>)> = Vec::new();
    let mut seen_nodes = HashSet::new();
    let mut queue = std::collections::VecDeque::from([loss]);
    while let Some(v) = queue.pop_front() {
        let Some((n, _)) = model.producer(v) else {
            continue;
        };
        if !forward.contains(&n) || !seen_nodes.insert(n) {
            continue;
        }
        let direct = reads(n);
        if direct.is_empty() {
            queue.extend(model.node(n).inputs.iter().flatten().copied());
            continue;
        }
        let mut layer = direct.clone();
        if matches!(model.node(n).proto.op_type(), "Add" | "Sub" | "Sum") {
            for u in model.node(n).inputs.iter().flatten() {
                if param_root(model, *u, params).is_some() {
                    continue;
                }
                let Some((m, _)) = model.producer(*u) else {
                    continue;
                };
                let op = model.node(m).proto.op_type();
                if forward.contains(&m)
                    && matches!(op, "MatMul" | "Gemm" | "Conv" | "ConvTranspose")
                {
                    for p in reads(m) {
                        if !layer.contains(&p) {
                            layer.push(p);
                        }
                    }
                }
            }
        }
        found.push((n, layer));
    }
    let all = found
        .iter()
        .flat_map(|(_, ps)| ps.iter().copied())
        .collect();
    (found, all)
}

/// The units of parameter `param` (of shape `dims`), from its forward consumers:
///
/// - rank 0 and 1 (biases, gains, LayerNorm and BatchNorm scales): the whole tensor;
/// - Conv W [M, C/g, k...]: per output channel, axes 1..;
/// - ConvTranspose W [C, M/g, k...]: per output channel (axis 1 within each group);
/// - Gemm B: per output (transB=1 [N, K]: axis 1; transB=0 [K, N]: axis 0); Gemm A: per
///   row of the output (transA=0 [M, K]: axis 1; transA=1 [K, M]: axis 0);
/// - MatMul right operand [.., in, out]: per column (axis -2); left operand [.., rows, in]:
///   per row (axis -1);
/// - Gather data (embedding table): per slice along the gather axis (per row);
/// - seen through Identity, Cast and Transpose (axes mapped back through the permutation).
///
/// Consumers that disagree, or none of these: the whole tensor, with a note.
/// Returns the units, the rule that decided them, and the note.
pub fn derive_units(
    model: &Model,
    forward: &HashSet<NodeId>,
    param: ValueId,
    dims: &[i64],
) -> (Units, String, Option<String>) {
    let rank = dims.len();
    if rank <= 1 {
        let what = if rank == 0 { "scalar" } else { "vector" };
        return (Units::Whole, format!("{what}: whole tensor"), None);
    }
    let mut found: Vec<(Units, String)> = Vec::new();
    let mut unknown: Vec<String> = Vec::new();
    let identity: Vec<i64> = (0..rank as i64).collect();
    consumers(
        model,
        forward,
        param,
        dims,
        &identity,
        &mut found,
        &mut unknown,
        0,
    );
    let mut distinct: Vec<&Units> = Vec::new();
    for (u, _) in &found {
        if !distinct.contains(&u) {
            distinct.push(u);
        }
    }
    if !unknown.is_empty() {
        let mut all: Vec<String> = found.iter().map(|(_, r)| r.clone()).collect();
        all.extend(unknown.iter().cloned());
        return (
            Units::Whole,
            "whole tensor (fallback)".into(),
            Some(format!(
                "no unit rule for {}; whole-tensor norm (override with axes=NAME:AXES)",
                all.join(", ")
            )),
        );
    }
    match distinct.len() {
        0 => (
            Units::Whole,
            "whole tensor (fallback)".into(),
            Some(
                "no forward consumer found; whole-tensor norm (override with axes=NAME:AXES)"
                    .into(),
            ),
        ),
        1 => {
            let rules: Vec<String> = found.iter().map(|(_, r)| r.clone()).collect();
            (distinct[0].clone(), rules.join("; "), None)
        }
        _ => {
            let rules: Vec<String> = found
                .iter()
                .map(|(u, r)| format!("{r} -> {}", u.describe()))
                .collect();
            (
                Units::Whole,
                "whole tensor (fallback)".into(),
                Some(format!(
                    "consumers disagree ({}); whole-tensor norm (override with axes=NAME:AXES)",
                    rules.join("; ")
                )),
            )
        }
    }
}

/// Collects the unit rule of every forward consumer of `v`. `perm[i]` is the parameter axis
/// that axis i of `v` is (v is the parameter seen through transposes).
#[allow(clippy::too_many_arguments)]
fn consumers(
    model: &Model,
    forward: &HashSet<NodeId>,
    v: ValueId,
    param_dims: &[i64],
    perm: &[i64],
    found: &mut Vec<(Units, String)>,
    unknown: &mut Vec<String>,
    depth: usize,
) {
    let rank = perm.len() as i64;
    let to_param = |axes: &[i64]| -> Units {
        let mut mapped: Vec<i64> = axes.iter().map(|a| perm[*a as usize]).collect();
        mapped.sort_unstable();
        Units::Axes { axes: mapped }
    };
    for u in model.uses(v) {
        let Use::Node { node, slot } = *u else {
            continue;
        };
        if !forward.contains(&node) {
            continue;
        }
        let n = model.node(node);
        let op = n.proto.op_type();
        let domain = crate::ir::normalize_domain(n.proto.domain());
        let what = format!("{} input {slot}", describe_node(model, node));
        let int =
            |name: &str, default: i64| n.proto.attr_int(name).ok().flatten().unwrap_or(default);
        if !domain.is_empty() {
            unknown.push(what);
            continue;
        }
        match (op, slot) {
            (op, 0) if is_passthrough(op) && depth < 8 => {
                if let Some(out) = n.outputs.first().copied().flatten() {
                    consumers(
                        model,
                        forward,
                        out,
                        param_dims,
                        perm,
                        found,
                        unknown,
                        depth + 1,
                    );
                }
            }
            ("Transpose", 0) if depth < 8 => {
                let p = n
                    .proto
                    .attr_ints("perm")
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| (0..rank).rev().collect());
                if p.len() != perm.len() || p.iter().any(|a| *a < 0 || *a >= rank) {
                    unknown.push(what);
                    continue;
                }
                let composed: Vec<i64> = p.iter().map(|a| perm[*a as usize]).collect();
                if let Some(out) = n.outputs.first().copied().flatten() {
                    consumers(
                        model,
                        forward,
                        out,
                        param_dims,
                        &composed,
                        found,
                        unknown,
                        depth + 1,
                    );
                }
            }
            ("Conv", 1) if rank >= 3 => found.push((
                to_param(&(1..rank).collect::<Vec<_>>()),
                format!("{what} (Conv W [M,C/g,k...]): per output channel"),
            )),
            ("ConvTranspose", 1) if rank >= 3 => {
                let group = int("group", 1).max(1);
                let transposed = perm.iter().enumerate().any(|(i, a)| *a != i as i64);
                if group == 1 {
                    let axes: Vec<i64> = (0..rank).filter(|a| *a != 1).collect();
                    found.push((
                        to_param(&axes),
                        format!("{what} (ConvTranspose W [C,M/g,k...]): per output channel"),
                    ));
                } else if transposed
                    || param_dims.iter().any(|d| *d <= 0)
                    || param_dims[0] % group != 0
                {
                    unknown.push(format!("{what} (grouped, layout not static)"));
                } else {
                    let k: i64 = param_dims[2..].iter().product();
                    found.push((
                        Units::View {
                            view: vec![group, param_dims[0] / group, param_dims[1], k],
                            axes: vec![1, 3],
                        },
                        format!("{what} (ConvTranspose W [C,M/g,k...], group {group}): per output channel"),
                    ));
                }
            }
            ("Gemm", 1) if rank == 2 => {
                let (axis, layout) = if int("transB", 0) != 0 {
                    (1, "transB=1 [N,K]")
                } else {
                    (0, "transB=0 [K,N]")
                };
                found.push((
                    to_param(&[axis]),
                    format!("{what} (Gemm B {layout}): per output"),
                ));
            }
            ("Gemm", 0) if rank == 2 => {
                let (axis, layout) = if int("transA", 0) != 0 {
                    (0, "transA=1 [K,M]")
                } else {
                    (1, "transA=0 [M,K]")
                };
                found.push((
                    to_param(&[axis]),
                    format!("{what} (Gemm A {layout}): per row"),
                ));
            }
            ("MatMul", 1) => found.push((
                to_param(&[rank - 2]),
                format!("{what} (MatMul right [in,out]): per column"),
            )),
            ("MatMul", 0) => found.push((
                to_param(&[rank - 1]),
                format!("{what} (MatMul left [rows,in]): per row"),
            )),
            ("Gather", 0) => {
                let mut axis = int("axis", 0);
                if axis < 0 {
                    axis += rank;
                }
                let axes: Vec<i64> = (0..rank).filter(|a| *a != axis).collect();
                found.push((to_param(&axes), format!("{what} (Gather data): per row")));
            }
            _ => unknown.push(what),
        }
    }
}

/// `*` matches any run of characters, `?` any one character; everything else literally.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = name.chars().collect();
    let (mut pi, mut si) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, si));
            pi += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// The pass.
#[derive(Clone, Debug)]
pub struct Agc {
    pub clip: f32,
    pub eps: f32,
    pub selection: Selection,
}

impl Default for Agc {
    fn default() -> Self {
        Agc {
            clip: 0.01,
            eps: 1e-3,
            selection: Selection::default(),
        }
    }
}

/// Parses `NAME:AXES;NAME:AXES` with AXES `all` or `A/B/...` (the axes reduced over).
pub fn parse_axes_overrides(text: &str) -> Result<Vec<AxesOverride>, String> {
    text.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            let (name, axes) = item
                .rsplit_once(':')
                .ok_or_else(|| format!("'{item}' is not NAME:AXES"))?;
            let axes = axes.trim();
            let axes = if axes == "all" || axes.is_empty() {
                None
            } else {
                Some(
                    axes.split('/')
                        .map(|a| {
                            a.trim()
                                .parse::<i64>()
                                .map_err(|_| format!("'{item}': axis '{a}' is not an integer"))
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                )
            };
            Ok((name.trim().to_string(), axes))
        })
        .collect()
}

impl Agc {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&["clip", "eps", "exclude", "include_final", "axes"])?;
        let spec_error = |message: String| PassError::Spec {
            spec: PASS.into(),
            message,
        };
        let clip: f32 = options.parse("clip")?.unwrap_or(0.01);
        let eps: f32 = options.parse("eps")?.unwrap_or(1e-3);
        if !(clip.is_finite() && clip > 0.0) {
            return Err(spec_error(format!(
                "clip={clip}: must be a positive number"
            )));
        }
        if !(eps.is_finite() && eps > 0.0) {
            return Err(spec_error(format!("eps={eps}: must be a positive number")));
        }
        let exclude = options
            .get("exclude")
            .map(|e| {
                e.split(';')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let axes = match options.get("axes") {
            Some(text) => parse_axes_overrides(text).map_err(spec_error)?,
            None => Vec::new(),
        };
        Ok(Agc {
            clip,
            eps,
            selection: Selection {
                include_final: options.parse("include_final")?.unwrap_or(false),
                exclude,
                axes,
            },
        })
    }
}

impl Agc {
    /// The resolved settings (the pipeline marks those the spec gave), with how many
    /// parameters are clipped.
    fn recipe(&self, plan: &Plan) -> crate::recipe::Section {
        use crate::recipe::Origin::Default;
        let mut s = crate::recipe::Section::new(PASS);
        s.set_f32("clip", self.clip, Default);
        s.set_f32("eps", self.eps, Default);
        s.set("include_final", self.selection.include_final, Default);
        if !self.final_layer_excluded_note(plan).is_empty() {
            s.note("include_final", self.final_layer_excluded_note(plan));
        }
        s.set("exclude", self.selection.exclude.clone(), Default);
        let clipped = plan.params.iter().filter(|p| p.excluded.is_none()).count();
        s.set(
            "clipped",
            format!("{clipped} of {} parameters", plan.params.len()),
            Default,
        );
        s.note("clipped", "inspect --agc lists each parameter's units");
        s
    }

    fn final_layer_excluded_note(&self, plan: &Plan) -> String {
        match (self.selection.include_final, plan.final_layer.is_empty()) {
            (false, false) => format!("final layer not clipped: {}", plan.final_layer.join(", ")),
            _ => String::new(),
        }
    }
}

impl Pass for Agc {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Clip
    }

    /// The window, its gradients not yet consumed by an optimizer.
    fn requires(&self, _model: &Model, cx: &PassContext<'_>) -> Result<(), PassError> {
        super::requires_unconsumed_gradients(cx, PASS)
    }

    fn spec(&self) -> String {
        super::spec_text(
            PASS,
            &options_text(self.clip, Some(self.eps), &self.selection),
        )
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        let plan = plan(model, cx.signature, &self.selection).map_err(fail)?;
        cx.recipe.push(self.recipe(&plan));
        let window = cx.window_mut(PASS)?;
        let by_name: BTreeMap<&str, &ParamUnits> =
            plan.params.iter().map(|p| (p.name.as_str(), p)).collect();
        let nodes_before = model.all_nodes().count();
        let opset = model.opset("").unwrap_or(1);
        let any_clipped = window
            .params()
            .iter()
            .any(|p| by_name.get(p.name()).is_some_and(|u| u.excluded.is_none()));
        if !any_clipped {
            let final_layer = if plan.final_layer.is_empty() {
                String::new()
            } else {
                format!(" (final layer: {})", plan.final_layer.join(", "))
            };
            return Ok(PassReport {
                changed: false,
                notes: vec![format!("no parameter to clip{final_layer}")],
                ..Default::default()
            });
        }
        let scalars = {
            let mut b = window.builder(model, PASS);
            (
                b.scalar_f32("agc.clip", self.clip),
                b.scalar_f32("agc.eps", self.eps),
                b.scalar_f32("agc.one", 1.0),
            )
        };
        let mut clipped = Vec::new();
        let mut excluded = Vec::new();
        let mut notes = Vec::new();
        let body = window.body();
        for p in window.params_mut() {
            let Some(units) = by_name.get(p.name()) else {
                excluded.push(format!("{} (not in the plan)", p.name()));
                continue;
            };
            if let Some(why) = &units.excluded {
                excluded.push(format!("{} ({why})", p.name()));
                continue;
            }
            if let Some(note) = &units.note {
                notes.push(format!("{}: {note}", p.name()));
            }
            let mut b = Builder::new(model, body, PASS);
            let grad = emit_clip(
                &mut b,
                opset,
                p.value(),
                p.grad(),
                &units.units,
                p.dims(),
                scalars,
                p.name(),
            );
            p.set_grad(grad);
            clipped.push(format!("{} {}", p.name(), units.units.describe()));
        }
        window.mark_clipped();
        let mut report_notes = vec![format!(
            "clip={} eps={:e}; clipped {}: {}",
            self.clip,
            self.eps,
            clipped.len(),
            clipped.join(", ")
        )];
        if !excluded.is_empty() {
            report_notes.push(format!("not clipped: {}", excluded.join(", ")));
        }
        report_notes.extend(notes);
        Ok(PassReport {
            changed: !clipped.is_empty(),
            added: model.all_nodes().count().saturating_sub(nodes_before),
            removed: 0,
            notes: report_notes,
        })
    }
}

/// `ReduceL2` with keepdims over `axes` (all axes for `None`), in the form of `opset`.
fn reduce_l2(
    b: &mut Builder<'_>,
    opset: i64,
    x: ValueId,
    axes: Option<&[i64]>,
    hint: &str,
) -> ValueId {
    match axes {
        None => b.op("ReduceL2", &[x], vec![attr_int("keepdims", 1)], hint),
        Some(axes) if crate::ir::emit::axes_as_input("ReduceL2", opset) => {
            let a = b.ints(&format!("{hint}.axes"), axes);
            b.op("ReduceL2", &[x, a], vec![attr_int("keepdims", 1)], hint)
        }
        Some(axes) => b.op(
            "ReduceL2",
            &[x],
            vec![attr_ints("axes", axes), attr_int("keepdims", 1)],
            hint,
        ),
    }
}

/// G * Where(||G_u|| > clip max(||W_u||, eps), clip max(||W_u||, eps) / ||G_u||, 1).
#[allow(clippy::too_many_arguments)]
fn emit_clip(
    b: &mut Builder<'_>,
    opset: i64,
    w: ValueId,
    g: ValueId,
    units: &Units,
    dims: &[i64],
    (clip, eps, one): (ValueId, ValueId, ValueId),
    name: &str,
) -> ValueId {
    let hint = |s: &str| format!("agc.{name}.{s}");
    let (w_view, g_view, axes) = match units {
        Units::Whole => (w, g, None),
        Units::Axes { axes } => (w, g, Some(axes.as_slice())),
        Units::View { view, axes } => {
            let shape = b.ints(&hint("view_shape"), view);
            let wv = b.op("Reshape", &[w, shape], vec![], &hint("w_view"));
            let gv = b.op("Reshape", &[g, shape], vec![], &hint("g_view"));
            (wv, gv, Some(axes.as_slice()))
        }
    };
    let (w_norm, g_norm) = if dims.is_empty() {
        (
            b.abs(w_view, &hint("w_norm")),
            b.abs(g_view, &hint("g_norm")),
        )
    } else {
        (
            reduce_l2(b, opset, w_view, axes, &hint("w_norm")),
            reduce_l2(b, opset, g_view, axes, &hint("g_norm")),
        )
    };
    // max_norm = clip · max(||W||, eps);  G · (||G|| > max_norm ? max_norm / ||G|| : 1)
    let w_floor = b.max(w_norm, eps, &hint("w_norm_eps"));
    let max_norm = b.mul(w_floor, clip, &hint("max_norm"));
    let over = b.greater(g_norm, max_norm, &hint("over"));
    let ratio = b.div(max_norm, g_norm, &hint("ratio"));
    let factor = b.select(over, ratio, one, &hint("factor"));
    let scaled = b.mul(g_view, factor, &hint("grad"));
    match units {
        Units::View { .. } => {
            let shape = b.ints(&hint("shape"), dims);
            b.op(
                "Reshape",
                &[scaled, shape],
                vec![],
                &format!("{name}.agc_grad"),
            )
        }
        _ => scaled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("fc2.*", "fc2.weight"));
        assert!(glob_match("*bias", "fc1.bias"));
        assert!(glob_match("fc?.weight", "fc1.weight"));
        assert!(!glob_match("fc?.weight", "fc10.weight"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "axxbyyc"));
        assert!(!glob_match("a*b*c", "axxbyy"));
        assert!(glob_match("conv.weight", "conv.weight"));
        assert!(!glob_match("conv.weight", "conv.weights"));
    }

    #[test]
    fn axes_overrides() {
        assert_eq!(
            parse_axes_overrides("conv.weight:1/2/3;fc.w:all;a::b:0").unwrap(),
            vec![
                ("conv.weight".to_string(), Some(vec![1, 2, 3])),
                ("fc.w".to_string(), None),
                ("a::b".to_string(), Some(vec![0])),
            ]
        );
        assert!(parse_axes_overrides("conv.weight").is_err());
        assert!(parse_axes_overrides("w:x").is_err());
    }

    #[test]
    fn unit_counts() {
        assert_eq!(Units::Whole.count(&[4, 3]), 1);
        assert_eq!(
            Units::Axes {
                axes: vec![1, 2, 3]
            }
            .count(&[4, 3, 3, 3]),
            4
        );
        assert_eq!(
            Units::View {
                view: vec![2, 2, 3, 9],
                axes: vec![1, 3]
            }
            .count(&[4, 3, 3, 3]),
            6
        );
    }
}
