//! Data movement: the gradient moves back the way the data came, reshaped, transposed,
//! sliced or scattered into place.
//!
//! ```text
//! Reshape/Flatten/Squeeze/Unsqueeze   dX = Reshape(dY, shape(X))
//! Identity, Dropout(inference)        dX = dY
//! Transpose(perm)                     dX = Transpose(dY, perm⁻¹)
//! Expand                              dX = dY summed back to shape(X)
//! Concat(axis)                        dXi = Split(dY, sizes of the Xi along axis)[i]
//! Split(axis)                         dX = Concat(dYi, or zeros where Yi has no gradient)
//! Slice (step 1)                      dX = Pad(dY, the rows the slice dropped, with 0)
//! Slice (step k ≠ 1 on an axis)       dX = ScatterElements(zeros, first + j·k, dY; that axis)
//! Pad (constant)                      dX = Slice(dY, pads_begin, pads_begin + shape(X))
//! Tile(r)                             dX = ReduceSum(Reshape(dY, [r0, d0, r1, d1, ..]), axes 0, 2, ..)
//! Cast / CastLike                     dX = Cast(dY, type of X)
//! Dropout (training, mask M)          dX = dY · M / (1 - ratio)              DropoutGrad
//! Gather(axis)                        dX = zeros(shape X), dY scatter-added at the indices  GatherGrad
//! GatherElements(axis)                the same per element                  GatherElementsGrad
//! TopK(axis) -> values, indices      dX = zeros(shape X), dvalues put at the indices  GatherElementsGrad
//! Trilu(k, upper)                     dX = Trilu(dY, k, upper)
//! ReverseSequence(lens)               dX = ReverseSequence(dY, lens): a reversal of each
//!                                          sequence's first lens steps is its own inverse
//! CumSum(axis, exclusive, reverse)    dX = CumSum(dY, axis, exclusive, not reverse)
//! DepthToSpace(b, DCR)                dX = SpaceToDepth(dY, b)
//! DepthToSpace(b, CRD)                dX = SpaceToDepth(dY, b) with its channels from
//!                                          (bh, bw, c) order back to (c, bh, bw)
//! SpaceToDepth(b)                     dX = DepthToSpace(dY, b, DCR)
//! ```
//!
//! SpaceToDepth is the inverse permutation of DepthToSpace in DCR mode (its reshape puts
//! the block offsets before the channels, as DCR's does); CRD orders the channels the
//! other way.

use super::super::shapes::{Dim, Facts};
use super::{Grad, InputGrads};
use crate::ir::builder::{attr_int, attr_ints, attr_string, attr_tensor};
use crate::ir::emit::Emit;
use crate::ir::{Model, NodeId, ValueId};
use crate::passes::PassError;

fn hint(cx: &Grad<'_>, x: ValueId) -> String {
    format!("{}_grad", cx.model().name(x))
}

fn first_only(n: usize, g: ValueId) -> InputGrads {
    let mut out = vec![None; n.max(1)];
    out[0] = Some(g);
    out
}

pub fn reshape_like(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let h = hint(cx, x);
    let shape = cx.shape_of(x);
    let g = cx.op_like("Reshape", &[cx.dy(node, dys, 0)?, shape], vec![], &h, x);
    Ok(first_only(wants.len(), g))
}

pub fn identity(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    Ok(first_only(wants.len(), cx.dy(node, dys, 0)?))
}

pub fn transpose(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let perm = match cx.ints_attr(node, "perm")? {
        Some(p) => p,
        None => (0..cx.need_rank(node, x)? as i64).rev().collect(),
    };
    let mut inverse = vec![-1i64; perm.len()];
    for (i, p) in perm.iter().enumerate() {
        match usize::try_from(*p).ok().and_then(|p| inverse.get_mut(p)) {
            Some(slot) if *slot < 0 => *slot = i as i64,
            _ => {
                return Err(cx.error(
                    node,
                    format!("attribute 'perm' = {perm:?} is not a permutation"),
                ))
            }
        }
    }
    let h = hint(cx, x);
    Ok(vec![Some(cx.op_like(
        "Transpose",
        &[cx.dy(node, dys, 0)?],
        vec![attr_ints("perm", &inverse)],
        &h,
        x,
    ))])
}

pub fn expand(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let y = cx.forward_output(node, 0)?;
    let dy = cx.dy(node, dys, 0)?;
    // The target shape is not an operand: nothing tells whose size y has.
    let g = cx.unbroadcast_from(node, dy, y, x, None)?;
    Ok(first_only(wants.len(), g))
}

/// The node's `axis` attribute, non-negative and checked against X's rank.
fn axis_of(cx: &Grad<'_>, node: NodeId, x: ValueId, default: i64) -> Result<i64, PassError> {
    let axis = cx.int_attr(node, "axis", default)?;
    let rank = cx.need_rank(node, x)? as i64;
    let a = if axis < 0 { axis + rank } else { axis };
    if a < 0 || a >= rank {
        return Err(cx.error(
            node,
            format!("attribute 'axis' = {axis} is out of range for rank {rank}"),
        ));
    }
    Ok(a)
}

/// `Split(x, sizes; axis)` in the opset's form (sizes as an input from 13).
fn split_by(
    cx: &mut Grad<'_>,
    x: ValueId,
    sizes: ValueId,
    static_sizes: Option<&[i64]>,
    axis: i64,
    hints: &[String],
) -> NodeId {
    let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
    if cx.opset() >= 13 {
        cx.b.node(
            "Split",
            "",
            &[Some(x), Some(sizes)],
            &hints,
            vec![attr_int("axis", axis)],
        )
    } else {
        let s = static_sizes.unwrap_or_default();
        cx.b.node(
            "Split",
            "",
            &[Some(x)],
            &hints,
            vec![attr_int("axis", axis), attr_ints("split", s)],
        )
    }
}

pub fn concat(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x0 = cx.input(node, 0)?;
    let axis = axis_of(cx, node, x0, 0)?;
    let inputs: Vec<ValueId> = (0..wants.len())
        .map(|i| cx.input(node, i))
        .collect::<Result<_, _>>()?;
    let known: Option<Vec<i64>> = inputs
        .iter()
        .map(|x| {
            cx.facts(*x)
                .dims
                .and_then(|d| d.get(axis as usize).and_then(|d| d.known()))
        })
        .collect();
    let sizes = match &known {
        Some(s) => cx.ints(s),
        None if cx.opset() >= 13 => {
            let idx = cx.ints(&[axis]);
            let parts: Vec<ValueId> = inputs
                .iter()
                .map(|x| {
                    let s = cx.shape_of(*x);
                    cx.op("Gather", &[s, idx], vec![], "concat_sizes")
                })
                .collect();
            cx.op("Concat", &parts, vec![attr_int("axis", 0)], "concat_sizes")
        }
        None => {
            return Err(cx.error(
                node,
                "the sizes of the inputs along the axis must be known before opset 13".into(),
            ))
        }
    };
    let hints: Vec<String> = inputs.iter().map(|x| hint(cx, *x)).collect();
    let s = split_by(
        cx,
        cx.dy(node, dys, 0)?,
        sizes,
        known.as_deref(),
        axis,
        &hints,
    );
    let mut out = vec![None; wants.len()];
    for (i, want) in wants.iter().enumerate() {
        if *want {
            let v = cx.output_like(s, i, inputs[i]);
            out[i] = Some(v);
        }
    }
    Ok(out)
}

pub fn split(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let axis = axis_of(cx, node, x, 0)?;
    let h = hint(cx, x);
    let mut parts = Vec::new();
    for (slot, dy) in dys.iter().enumerate() {
        let Some(Some(y)) = cx.model().node(node).outputs.get(slot).copied() else {
            return Err(cx.error(node, format!("output {slot} is omitted")));
        };
        parts.push(match dy {
            Some(d) => *d,
            None => cx.zeros_like(node, y, &h)?,
        });
    }
    let g = cx.op_like("Concat", &parts, vec![attr_int("axis", axis)], &h, x);
    Ok(first_only(wants.len(), g))
}

pub fn slice(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let x = cx.input(node, 0)?;
    if cx.opset() < 10 {
        return Err(cx.error(
            node,
            "Slice before opset 10 (attributes) is not supported by the gradient rule".into(),
        ));
    }
    let rank = cx.need_rank(node, x)?;
    let constant = |cx: &Grad<'_>, slot: usize| -> Result<Option<Vec<i64>>, PassError> {
        match cx.opt_input(node, slot) {
            None => Ok(None),
            Some(v) => super::super::shapes::known_ints(cx.model(), cx.shapes, v)
                .map(Some)
                .ok_or_else(|| {
                    cx.error(
                        node,
                        format!("input {slot} ('{}') is not a constant", cx.model().name(v)),
                    )
                }),
        }
    };
    if known_input(cx, node, 1).flatten().is_none() || known_input(cx, node, 2).flatten().is_none()
    {
        return slice_at_run_time(cx, node, dy, x, rank, wants);
    }
    let starts = constant(cx, 1)?.unwrap_or_default();
    let ends = constant(cx, 2)?.unwrap_or_default();
    let axes = constant(cx, 3)?.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = constant(cx, 4)?.unwrap_or_else(|| vec![1; starts.len()]);
    let n = starts.len();
    if ends.len() != n || axes.len() != n || steps.len() != n {
        return Err(cx.error(
            node,
            format!(
                "starts, ends, axes and steps have different lengths ({n}, {}, {}, {})",
                ends.len(),
                axes.len(),
                steps.len()
            ),
        ));
    }
    let dims = cx.facts(x).dims.unwrap_or_default();
    let mut pads = vec![0i64; 2 * rank];
    // Unit-step axes of a size known only at run time (a sequence of any length): their
    // pads computed from the size then, (axis, start, end).
    let mut at_run_time: Vec<(usize, Bound, Bound)> = Vec::new();
    // Axes with a step other than 1: (axis, first index read, step, elements read, size).
    let mut strided: Vec<(usize, i64, i64, i64, i64)> = Vec::new();
    for (j, axis) in axes.iter().enumerate() {
        let a = if *axis < 0 { axis + rank as i64 } else { *axis };
        if a < 0 || a >= rank as i64 {
            return Err(cx.error(node, format!("axis {axis} is out of range for rank {rank}")));
        }
        let a = a as usize;
        let size = dims.get(a).and_then(|d| d.known());
        let (start, end, step) = (starts[j], ends[j], steps[j]);
        match size {
            Some(size) if step != 1 => {
                let Some((first, len)) = super::super::shapes::slice_range(size, start, end, step)
                else {
                    return Err(cx.error(node, format!("step 0 on axis {a}")));
                };
                strided.push((a, first, step, len, size));
            }
            Some(size) => {
                let norm = |v: i64| (if v < 0 { v + size } else { v }).clamp(0, size);
                let (s, e) = (norm(start), norm(end));
                pads[a] = s;
                pads[a + rank] = (size - e.max(s)).max(0);
            }
            None if step == 1 && start >= 0 && end >= i32::MAX as i64 => pads[a] = start,
            None if step == 1 => at_run_time.push((a, Bound::Known(start), Bound::Known(end))),
            None => {
                return Err(cx.error(
                    node,
                    format!(
                        "the size of axis {a} of '{}' must be known",
                        cx.model().name(x)
                    ),
                ));
            }
        }
    }
    if !strided.is_empty() && cx.opset() < 11 {
        return Err(cx.error(
            node,
            "a Slice with steps other than 1 needs opset 11 (ScatterElements) for its gradient"
                .into(),
        ));
    }
    let h = hint(cx, x);
    // Unit steps: the rows the slice dropped come back as zeros.
    let mut g = if pads.iter().any(|p| *p != 0) || strided.is_empty() || !at_run_time.is_empty() {
        let p = match at_run_time.is_empty() {
            true => cx.ints(&pads),
            false => pads_at_run_time(cx, x, &pads, &at_run_time, &h),
        };
        let padded = cx.op("Pad", &[dy, p], vec![], &h);
        // X's facts, with the strided axes still at their sliced length.
        let mut f = cx.facts(x);
        if let Some(d) = f.dims.as_mut() {
            for (a, _, _, len, _) in &strided {
                if let Some(slot) = d.get_mut(*a) {
                    *slot = Dim::Known(*len);
                }
            }
        }
        cx.shapes.set(padded, f);
        if strided.is_empty() {
            return Ok(first_only(wants.len(), padded));
        }
        padded
    } else {
        dy
    };
    // Other steps, one axis at a time: ScatterElements puts element j of the axis at
    // index first + j·step of a zero tensor with the axis at full size. The indices are
    // distinct, so nothing adds up; a negative step just counts down.
    let zero = Grad::zero_value(cx.elem(node, x)?);
    for (a, first, step, len, full) in strided {
        // Shape(g) with axis a at full size (a < rank: checked above).
        let target = match cx.facts(g).static_dims() {
            Some(mut d) if d.len() == rank => {
                d[a] = full;
                cx.ints(&d)
            }
            _ => {
                let shape = cx.shape_of(g);
                let mut keep = vec![1i64; rank];
                keep[a] = 0;
                let mut put = vec![0i64; rank];
                put[a] = full;
                let (keep, put) = (cx.ints(&keep), cx.ints(&put));
                let kept = cx.op("Mul", &[shape, keep], vec![], &h);
                cx.op("Add", &[kept, put], vec![], &h)
            }
        };
        let zeros = cx.op(
            "ConstantOfShape",
            &[target],
            vec![attr_tensor("value", zero.clone())],
            &h,
        );
        let mut idx_dims = vec![1i64; rank];
        idx_dims[a] = len;
        let idx: Vec<i64> = (0..len).map(|j| first + j * step).collect();
        let idx = cx.b.model.add_initializer(
            cx.b.body,
            &format!("{h}_indices"),
            crate::ir::builder::tensor_i64(&idx_dims, &idx),
        );
        let gshape = cx.shape_of(g);
        let idx = cx.op("Expand", &[idx, gshape], vec![], &h);
        let scattered = cx.op(
            "ScatterElements",
            &[zeros, idx, g],
            vec![attr_int("axis", a as i64)],
            &h,
        );
        // g's facts with axis a at full size.
        let mut f = cx.facts(g);
        if let Some(d) = f.dims.as_mut() {
            if let Some(slot) = d.get_mut(a) {
                *slot = Dim::Known(full);
            }
        }
        cx.shapes.set(scattered, f);
        g = scattered;
    }
    let f = cx.facts(x);
    cx.shapes.set(g, f);
    Ok(first_only(wants.len(), g))
}

/// Input `slot` of `node` as integers known before the run: `None` when the input is
/// absent, `Some(None)` when it is computed only at run time.
fn known_input(cx: &Grad<'_>, node: NodeId, slot: usize) -> Option<Option<Vec<i64>>> {
    cx.opt_input(node, slot)
        .map(|v| super::super::shapes::known_ints(cx.model(), cx.shapes, v))
}

/// A unit-step Slice's start or end on one axis: a number, or element `index` of the
/// Slice's own starts or ends input, computed at run time (GPT-NeoX's rotary half,
/// `x[..., Shape(x)[3] / 2:]` behind Casts no shape arithmetic follows).
#[derive(Clone, Copy)]
enum Bound {
    Known(i64),
    AtRunTime { bounds: ValueId, index: usize },
}

/// The gradient of a Slice whose starts or ends are known only at run time: its axes and
/// steps must be known and the steps 1; each axis sliced is padded back from bounds
/// computed then.
fn slice_at_run_time(
    cx: &mut Grad<'_>,
    node: NodeId,
    dy: ValueId,
    x: ValueId,
    rank: usize,
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let known = |cx: &Grad<'_>, slot: usize| known_input(cx, node, slot);
    let (starts, ends) = (cx.input(node, 1)?, cx.input(node, 2)?);
    let count = cx
        .facts(starts)
        .static_dims()
        .and_then(|d| d.first().copied());
    let axes = match known(cx, 3) {
        Some(Some(axes)) => axes,
        Some(None) => {
            return Err(cx.error(
                node,
                "the axes of a Slice whose bounds are computed at run time must be constants"
                    .into(),
            ))
        }
        None => match count {
            Some(n) => (0..n).collect(),
            None => {
                return Err(cx.error(
                    node,
                    "the number of bounds of a Slice computed at run time must be known".into(),
                ))
            }
        },
    };
    if let Some(steps) = known(cx, 4) {
        if steps.is_none_or(|s| s.iter().any(|s| *s != 1)) {
            return Err(cx.error(
                node,
                "a Slice whose bounds are computed at run time needs steps of 1 for its gradient"
                    .into(),
            ));
        }
    }
    let bound = |cx: &Grad<'_>, slot: usize, bounds: ValueId, index: usize| match known(cx, slot)
        .flatten()
        .and_then(|v| v.get(index).copied())
    {
        Some(v) => Bound::Known(v),
        None => Bound::AtRunTime { bounds, index },
    };
    let mut at_run_time = Vec::new();
    for (j, axis) in axes.iter().enumerate() {
        let a = if *axis < 0 { axis + rank as i64 } else { *axis };
        if a < 0 || a >= rank as i64 {
            return Err(cx.error(node, format!("axis {axis} is out of range for rank {rank}")));
        }
        at_run_time.push((a as usize, bound(cx, 1, starts, j), bound(cx, 2, ends, j)));
    }
    let h = hint(cx, x);
    let pads = pads_at_run_time(cx, x, &vec![0; 2 * rank], &at_run_time, &h);
    let g = cx.op_like("Pad", &[dy, pads], vec![], &h, x);
    Ok(first_only(wants.len(), g))
}

/// Pad's `pads` for a unit-step Slice's gradient where some sliced axes have a size or
/// bounds known only at run time: `known` as given, and for each (axis, start, end) of
/// `dynamic` the rows before the start and after the end, from the size as Slice clamps
/// them: `s = clamp(start (+ size if negative), 0, size)`, likewise `e`; pads `s` and
/// `size - max(e, s)`.
fn pads_at_run_time(
    cx: &mut Grad<'_>,
    x: ValueId,
    known: &[i64],
    dynamic: &[(usize, Bound, Bound)],
    h: &str,
) -> ValueId {
    let rank = known.len() / 2;
    let mut entries: Vec<ValueId> = known.iter().map(|p| cx.ints(&[*p])).collect();
    let shape = cx.shape_of(x);
    let zero = cx.ints(&[0]);
    for &(a, start, end) in dynamic {
        let (from, to) = (cx.ints(&[a as i64]), cx.ints(&[a as i64 + 1]));
        let size = cx.op("Slice", &[shape, from, to], vec![], &format!("{h}_size"));
        let clamp = |cx: &mut Grad<'_>, v: Bound| -> ValueId {
            match v {
                Bound::Known(v) if v < 0 => {
                    let c = cx.ints(&[v]);
                    let shifted = cx.op("Add", &[size, c], vec![], h);
                    cx.op("Max", &[shifted, zero], vec![], h)
                }
                Bound::Known(v) => {
                    let c = cx.ints(&[v]);
                    cx.op("Min", &[c, size], vec![], h)
                }
                Bound::AtRunTime { bounds, index } => {
                    let (from, to) = (cx.ints(&[index as i64]), cx.ints(&[index as i64 + 1]));
                    let mut v = cx.op("Slice", &[bounds, from, to], vec![], h);
                    if cx.facts(bounds).elem != Some(crate::proto::elem::INT64) {
                        v = cx.op(
                            "Cast",
                            &[v],
                            vec![attr_int("to", crate::proto::elem::INT64 as i64)],
                            h,
                        );
                    }
                    let negative = cx.op("Less", &[v, zero], vec![], h);
                    let shifted = cx.op("Add", &[v, size], vec![], h);
                    let v = cx.op("Where", &[negative, shifted, v], vec![], h);
                    let v = cx.op("Min", &[v, size], vec![], h);
                    cx.op("Max", &[v, zero], vec![], h)
                }
            }
        };
        let s = clamp(cx, start);
        let e = clamp(cx, end);
        let e = cx.op("Max", &[e, s], vec![], h);
        let after = cx.op("Sub", &[size, e], vec![], h);
        entries[a] = s;
        entries[a + rank] = after;
    }
    let pads = cx.op(
        "Concat",
        &entries,
        vec![attr_int("axis", 0)],
        &format!("{h}_pads"),
    );
    cx.shapes.set(
        pads,
        Facts {
            elem: Some(crate::proto::elem::INT64),
            dims: Some(vec![Dim::Known(2 * rank as i64)]),
        },
    );
    pads
}

/// A constant Pad's gradient: where the pads are known constants that add elements, the
/// slice of dY that X was copied to; otherwise [`unpad`].
pub fn pad(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let mode = cx
        .string_attr(node, "mode")?
        .unwrap_or_else(|| "constant".into());
    if mode != "constant" {
        return Err(cx.error(
            node,
            format!("attribute 'mode' = {mode} is not supported by the gradient rule"),
        ));
    }
    let rank = cx.need_rank(node, x)?;
    let pads_input = cx.opt_input(node, 1);
    let pads = match cx.ints_attr(node, "pads")? {
        Some(p) => Some(p),
        None => pads_input.and_then(|v| super::super::shapes::constant_ints(cx.model(), v)),
    };
    let Some(pads) = pads.filter(|p| p.iter().all(|p| *p >= 0)) else {
        return unpad(cx, node, dys, wants, pads_input);
    };
    let axes: Vec<i64> = match cx.opt_input(node, 3) {
        Some(v) => super::super::shapes::constant_ints(cx.model(), v)
            .ok_or_else(|| cx.error(node, "the axes input is not a constant".into()))?
            .iter()
            .map(|a| if *a < 0 { a + rank as i64 } else { *a })
            .collect(),
        None => (0..rank as i64).collect(),
    };
    let n = axes.len();
    if pads.len() != 2 * n {
        return Err(cx.error(node, format!("{} pads for {n} axes", pads.len())));
    }
    let h = hint(cx, x);
    let begins = cx.ints(&pads[..n]);
    let shape = cx.shape_of(x);
    let shape_at = if n == rank && axes.iter().enumerate().all(|(i, a)| *a == i as i64) {
        shape
    } else {
        let idx = cx.ints(&axes);
        cx.op("Gather", &[shape, idx], vec![], &h)
    };
    let ends = cx.op("Add", &[begins, shape_at], vec![], &h);
    let axes_v = cx.ints(&axes);
    let g = cx.op_like(
        "Slice",
        &[cx.dy(node, dys, 0)?, begins, ends, axes_v],
        vec![],
        &h,
        x,
    );
    Ok(first_only(wants.len(), g))
}

/// The gradient of a constant Pad whose pads are computed at run time (Swin pads its
/// feature maps to a multiple of the window: `(w - W % w) % w`) or remove elements (negative
/// pads): `Pad(dY, -pads)` on the same axes, which takes back what was added and puts zeros
/// where elements were removed, whatever each pad's sign.
fn unpad(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
    pads: Option<ValueId>,
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let h = hint(cx, x);
    let dy = cx.dy(node, dys, 0)?;
    let Some(pads) = pads else {
        // Opset < 11: the pads are an attribute.
        let negated: Vec<i64> = cx
            .ints_attr(node, "pads")?
            .unwrap_or_default()
            .iter()
            .map(|p| -p)
            .collect();
        let g = cx.op_like("Pad", &[dy], vec![attr_ints("pads", &negated)], &h, x);
        return Ok(first_only(wants.len(), g));
    };
    let negated = cx.op("Neg", &[pads], vec![], &h);
    let axes = cx.opt_input(node, 3);
    let inputs = [Some(dy), Some(negated), None, axes];
    let used = if axes.is_some() { 4 } else { 2 };
    let g = cx.b.node("Pad", "", &inputs[..used], &[&h], vec![]);
    Ok(first_only(wants.len(), cx.output_like(g, 0, x)))
}

pub fn tile(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let reps_v = cx.input(node, 1)?;
    let reps = super::super::shapes::constant_ints(cx.model(), reps_v)
        .ok_or_else(|| cx.error(node, "the repeats input is not a constant".into()))?;
    let dims = cx.facts(x).static_dims().ok_or_else(|| {
        cx.error(
            node,
            format!("the dims of '{}' must be known", cx.model().name(x)),
        )
    })?;
    if reps.len() != dims.len() {
        return Err(cx.error(
            node,
            format!("{} repeats for a rank-{} input", reps.len(), dims.len()),
        ));
    }
    let interleaved: Vec<i64> = reps.iter().zip(&dims).flat_map(|(r, d)| [*r, *d]).collect();
    let axes: Vec<i64> = (0..dims.len() as i64).map(|i| 2 * i).collect();
    let h = hint(cx, x);
    let shape = cx.ints(&interleaved);
    let r = cx.op("Reshape", &[cx.dy(node, dys, 0)?, shape], vec![], &h);
    let g = cx.reduce("ReduceSum", r, &axes, false, &h);
    let f = cx.facts(x);
    cx.shapes.set(g, f);
    Ok(first_only(wants.len(), g))
}

pub fn cast(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let elem = cx.elem(node, x)?;
    // A Cast to the type it reads (T5's layer norm casts float32 hidden states to float32)
    // passes dY on as it is: no Cast back.
    if cx.int_attr(node, "to", 0)? == elem as i64 {
        return identity(cx, node, dys, wants);
    }
    let h = hint(cx, x);
    let g = cx.op_like(
        "Cast",
        &[cx.dy(node, dys, 0)?],
        vec![attr_int("to", elem as i64)],
        &h,
        x,
    );
    Ok(first_only(wants.len(), g))
}

/// Whether a Dropout node drops at run time: its `training_mode` input is the constant true
/// (the autodiff's normalisation sets it so for `--dropout train`).
pub fn dropout_drops(model: &Model, node: NodeId) -> bool {
    model
        .node(node)
        .inputs
        .get(2)
        .copied()
        .flatten()
        .and_then(|v| super::super::shapes::constant_tensor(model, v))
        .and_then(crate::ir::emit::tensor_scalar)
        .is_some_and(|v| v != 0.0)
}

pub fn dropout(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    // Only output 0 is float: the mask carries no gradient, so dY is there whenever the
    // sweep calls this rule; without it the gradient is zero.
    if dys.first().copied().flatten().is_none() {
        return Ok(vec![None; wants.len()]);
    }
    if !dropout_drops(cx.model(), node) {
        return identity(cx, node, dys, wants);
    }
    let x = cx.input(node, 0)?;
    let y = cx.model().name(cx.forward_output(node, 0)?).to_string();
    let mask = cx.b.model.ensure_node_output(node, 1, &format!("{y}_mask"));
    let ratio = cx.opt_input(node, 1);
    let h = hint(cx, x);
    let g = cx.ort_op(
        "DropoutGrad",
        &[Some(cx.dy(node, dys, 0)?), Some(mask), ratio],
        &[&h],
        vec![],
    );
    let v = cx.output_like(g, 0, x);
    Ok(first_only(wants.len(), v))
}

pub fn gather(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let mut indices = cx.input(node, 1)?;
    let mut dy = cx.dy(node, dys, 0)?;
    let h = hint(cx, x);
    let shape = cx.shape_of(x);
    let attrs = cx.attrs_of(node, &["axis"]);
    // Off axis 0 the lowering of GatherGrad takes one-dimensional indices only. Gathering
    // with the indices flattened gives Y reshaped to X[:axis] + [numel(I)] + X[axis+1:]:
    // flatten the indices and reshape dY to that.
    if cx.int_attr(node, "axis", 0)? != 0 && cx.rank(indices) != Some(1) {
        let axis = axis_of(cx, node, x, 0)? as usize;
        let fi = cx.facts(indices);
        let count = fi.static_dims().map(|d| d.iter().product::<i64>());
        let minus_one = cx.ints(&[-1]);
        indices = cx.op("Reshape", &[indices, minus_one], vec![], &h);
        cx.shapes.set(
            indices,
            Facts {
                elem: fi.elem,
                dims: Some(vec![count.map_or(Dim::Unknown, Dim::Known)]),
            },
        );
        let fx = cx.facts(x);
        let target = match fx.static_dims() {
            Some(mut d) => {
                d[axis] = -1;
                cx.ints(&d)
            }
            None => {
                let (zero, a, a1, end) = (
                    cx.ints(&[0]),
                    cx.ints(&[axis as i64]),
                    cx.ints(&[axis as i64 + 1]),
                    cx.ints(&[i64::MAX]),
                );
                let before = cx.op("Slice", &[shape, zero, a], vec![], &h);
                let after = cx.op("Slice", &[shape, a1, end], vec![], &h);
                cx.op(
                    "Concat",
                    &[before, minus_one, after],
                    vec![attr_int("axis", 0)],
                    &h,
                )
            }
        };
        dy = cx.op("Reshape", &[dy, target], vec![], &h);
        let mut dims = fx.dims.clone();
        if let Some(d) = dims.as_mut() {
            d[axis] = count.map_or(Dim::Unknown, Dim::Known);
        }
        cx.shapes.set(
            dy,
            Facts {
                elem: fx.elem,
                dims,
            },
        );
    }
    let g = cx.ort_op(
        "GatherGrad",
        &[Some(shape), Some(indices), Some(dy)],
        &[&h],
        attrs,
    );
    let v = cx.output_like(g, 0, x);
    Ok(first_only(wants.len(), v))
}

pub fn gather_elements(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let indices = cx.input(node, 1)?;
    let axis = cx.int_attr(node, "axis", 0)?;
    gathered_elements(cx, node, dys, wants, indices, axis)
}

/// TopK's values are `GatherElements(X, indices, axis)`: the same gradient, the indices
/// read from the forward (each selected once, so nothing adds up).
pub fn top_k(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let indices = cx.forward_output(node, 1)?;
    let axis = cx.int_attr(node, "axis", -1)?;
    gathered_elements(cx, node, dys, wants, indices, axis)
}

/// The gradient of input 0 of a node whose output 0 is `GatherElements(X, indices, axis)`:
/// zeros of X's shape with dY added at the indices (`GatherElementsGrad`).
fn gathered_elements(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
    indices: ValueId,
    axis: i64,
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let h = hint(cx, x);
    let shape = cx.shape_of(x);
    let g = cx.ort_op(
        "GatherElementsGrad",
        &[Some(cx.dy(node, dys, 0)?), Some(shape), Some(indices)],
        &[&h],
        vec![attr_int("axis", axis)],
    );
    let v = cx.output_like(g, 0, x);
    Ok(first_only(wants.len(), v))
}

pub fn trilu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let h = hint(cx, x);
    let mut inputs = vec![cx.dy(node, dys, 0)?];
    inputs.extend(cx.opt_input(node, 1));
    let attrs = cx.attrs_of(node, &["upper"]);
    let g = cx.op_like("Trilu", &inputs, attrs, &h, x);
    Ok(first_only(wants.len(), g))
}

pub fn reverse_sequence(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let lens = cx.input(node, 1)?;
    let h = hint(cx, x);
    let attrs = cx.attrs_of(node, &["batch_axis", "time_axis"]);
    let g = cx.op_like(
        "ReverseSequence",
        &[cx.dy(node, dys, 0)?, lens],
        attrs,
        &h,
        x,
    );
    Ok(first_only(wants.len(), g))
}

pub fn cum_sum(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let axis = cx.input(node, 1)?;
    let h = hint(cx, x);
    let exclusive = cx.int_attr(node, "exclusive", 0)?;
    let reverse = cx.int_attr(node, "reverse", 0)?;
    let g = cx.op_like(
        "CumSum",
        &[cx.dy(node, dys, 0)?, axis],
        vec![
            attr_int("exclusive", exclusive),
            attr_int("reverse", i64::from(reverse == 0)),
        ],
        &h,
        x,
    );
    Ok(first_only(wants.len(), g))
}

fn block_size(cx: &Grad<'_>, node: NodeId) -> Result<i64, PassError> {
    match cx.int_attr(node, "blocksize", 0)? {
        b if b > 0 => Ok(b),
        b => Err(cx.error(node, format!("attribute 'blocksize' = {b} is not positive"))),
    }
}

pub fn depth_to_space(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let h = hint(cx, x);
    let b = block_size(cx, node)?;
    let dy = cx.dy(node, dys, 0)?;
    let blocks_first = cx.op_like("SpaceToDepth", &[dy], vec![attr_int("blocksize", b)], &h, x);
    let mode = cx
        .string_attr(node, "mode")?
        .unwrap_or_else(|| "DCR".into());
    match mode.as_str() {
        "DCR" => Ok(vec![Some(blocks_first)]),
        "CRD" => {
            // [N, b²·C', H, W] -> [N, b², C', H·W] -> [N, C', b², H·W] -> X's shape.
            let channels = cx
                .facts(x)
                .dims
                .as_ref()
                .and_then(|d| d.get(1).and_then(Dim::known))
                .ok_or_else(|| {
                    cx.error(
                        node,
                        "the gradient of CRD mode needs the input's channel count, which is neither declared nor derivable".into(),
                    )
                })?;
            let area = b.checked_mul(b).ok_or_else(|| {
                cx.error(node, format!("attribute 'blocksize' = {b} is too large"))
            })?;
            let per_block = channels / area;
            let split_shape = cx.ints(&[0, area, per_block, -1]);
            let split = cx.op("Reshape", &[blocks_first, split_shape], vec![], &h);
            let swapped = cx.op(
                "Transpose",
                &[split],
                vec![attr_ints("perm", &[0, 2, 1, 3])],
                &h,
            );
            let shape = cx.shape_of(x);
            Ok(vec![Some(cx.op_like(
                "Reshape",
                &[swapped, shape],
                vec![],
                &h,
                x,
            ))])
        }
        other => Err(cx.error(
            node,
            format!("attribute 'mode' = '{other}' is not DCR or CRD"),
        )),
    }
}

pub fn space_to_depth(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let x = cx.input(node, 0)?;
    let h = hint(cx, x);
    let b = block_size(cx, node)?;
    let mut attrs = vec![attr_int("blocksize", b)];
    // `mode` came with opset 11; before it DepthToSpace was DCR only.
    if cx.opset() >= 11 {
        attrs.push(attr_string("mode", "DCR"));
    }
    let g = cx.op_like("DepthToSpace", &[cx.dy(node, dys, 0)?], attrs, &h, x);
    Ok(vec![Some(g)])
}
