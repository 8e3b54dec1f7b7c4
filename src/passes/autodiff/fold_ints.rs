//! Small integer tensors worked out before running: the shapes, axes, pads and slice bounds
//! exporters compute with ONNX ops instead of writing them down.
//!
//! A value folds when it is a constant, `Shape` of a value whose dims are known (a named
//! batch dim stays a name), or one of a few ops over such values. Each folded value keeps
//! its own shape where the ops allow, so that layout-sensitive ops fold too: torch's
//! TorchScript exporter turns `F.pad(x, [l, r, t, b])` into
//! `Reshape(Transpose(Slice(Reshape(Concat(pads, ConstantOfShape(..)), [-1, 2]), steps -1),
//! [1, 0]), [-1])` (EfficientNet's and MobileNetV2's padding), which is a constant.
//!
//! Everything read from the file is checked: sizes are capped, arithmetic is checked, and an
//! op or layout this does not know leaves the value unfolded (never guessed).

use super::shapes::{constant_tensor, slice_range, tensor_ints, Dim};
use crate::ir::builder::NodeAttributes;
use crate::ir::{Model, ValueDef, ValueId};
use crate::proto::tensor_proto::DataType;

/// More elements than any shape, axes or pads tensor has: larger values are not folded.
const MOST_ELEMENTS: usize = 4096;

/// A folded tensor: its values in row-major order, and its shape where it is known (`None`:
/// the values are right, their layout is not known, so only flat uses fold).
#[derive(Clone, Debug)]
struct Folded {
    values: Vec<Dim>,
    shape: Option<Vec<usize>>,
}

impl Folded {
    fn vector(values: Vec<Dim>) -> Folded {
        let n = values.len();
        Folded {
            values,
            shape: Some(vec![n]),
        }
    }

    fn known(&self) -> Option<Vec<i64>> {
        self.values.iter().map(Dim::known).collect()
    }

    /// The shape, where the values agree with it.
    fn dims(&self) -> Option<&[usize]> {
        let s = self.shape.as_deref()?;
        (s.iter().product::<usize>() == self.values.len()).then_some(s)
    }
}

/// The values of `v` as dims, folded up to `depth` nodes back; `dims_of` gives the dims a
/// `Shape` reads.
pub(super) fn fold_dims(
    model: &Model,
    dims_of: &dyn Fn(ValueId) -> Option<Vec<Dim>>,
    v: ValueId,
    depth: usize,
) -> Option<Vec<Dim>> {
    fold(model, dims_of, v, depth).map(|f| f.values)
}

fn fold(
    model: &Model,
    dims_of: &dyn Fn(ValueId) -> Option<Vec<Dim>>,
    v: ValueId,
    depth: usize,
) -> Option<Folded> {
    if let Some(t) = constant_tensor(model, v) {
        let ints = tensor_ints(t).or_else(|| integral_floats(t))?;
        let values: Vec<Dim> = ints.into_iter().map(Dim::Known).collect();
        let shape: Option<Vec<usize>> = t.dims.iter().map(|d| usize::try_from(*d).ok()).collect();
        return Some(Folded { values, shape });
    }
    let ValueDef::Node { node, slot: 0 } = model.value(v).def else {
        return None;
    };
    let n = model.node(node);
    let p = &n.proto;
    if !(p.domain().is_empty() || p.domain() == "ai.onnx") || depth == 0 {
        return None;
    }
    let input = |i: usize| n.inputs.get(i).copied().flatten();
    let arg = |i: usize| input(i).and_then(|x| fold(model, dims_of, x, depth - 1));
    let ints = |i: usize| arg(i)?.known();
    let int_attr = |name: &str| p.attr_int(name).ok().flatten();
    let ints_attr = |name: &str| p.attr(name).map(|a| a.ints.clone());
    let folded = match p.op_type() {
        "Constant" => {
            if let Some(a) = p.attr("value_ints") {
                Folded::vector(a.ints.iter().copied().map(Dim::Known).collect())
            } else {
                let i = p.attr("value_int")?.i();
                Folded {
                    values: vec![Dim::Known(i)],
                    shape: Some(vec![]),
                }
            }
        }
        "Shape" => {
            // The dims the shape facts give, else those of a value that folds itself.
            let d = match dims_of(input(0)?) {
                Some(d) => d,
                None => arg(0)?
                    .dims()?
                    .iter()
                    .map(|d| Dim::Known(*d as i64))
                    .collect(),
            };
            let r = d.len() as i64;
            let clamp = |x: i64| (if x < 0 { x + r } else { x }).clamp(0, r) as usize;
            let start = clamp(int_attr("start").unwrap_or(0));
            let end = clamp(int_attr("end").unwrap_or(r));
            Folded::vector(d.get(start..end.max(start))?.to_vec())
        }
        "Identity" => arg(0)?,
        "Cast" => {
            let to = int_attr("to")?;
            let x = arg(0)?;
            // To an integer: the values are whole (a float folds only as whole numbers). To
            // float or double: whole numbers float32 holds exactly.
            let exact = |most: u64| {
                x.values
                    .iter()
                    .all(|d| d.known().is_none_or(|k| k.unsigned_abs() <= most))
            };
            match to {
                t if t == DataType::Int64 as i64 || t == DataType::Int32 as i64 => x,
                t if t == DataType::Float as i64 && exact(1 << 24) => x,
                t if t == DataType::Double as i64 && exact(1 << 53) => x,
                _ => return None,
            }
        }
        // Whole numbers are their own ceiling and floor; a division of whole numbers in
        // float (MobileViT's `ceil(h / patch)`) is rounded here in integers.
        "Ceil" | "Floor" => {
            let ceil = p.op_type() == "Ceil";
            match quotient_operands(model, input(0)?) {
                Some((a, b)) => {
                    let (a, b) = (
                        fold(model, dims_of, a, depth - 1)?,
                        fold(model, dims_of, b, depth - 1)?,
                    );
                    elementwise(&[a, b], |v| match (&v[0], &v[1]) {
                        (Dim::Known(x), Dim::Known(y)) => {
                            rounded_quotient(*x, *y, ceil).map_or(Dim::Unknown, Dim::Known)
                        }
                        _ => Dim::Unknown,
                    })?
                }
                None if float_valued(model, input(0)?, 16) => arg(0)?,
                None => return None,
            }
        }
        "Reshape" => {
            let x = arg(0)?;
            let target = ints(1)?;
            let shape = reshaped(x.dims(), x.values.len(), &target, int_attr("allowzero"));
            Folded {
                values: x.values,
                shape,
            }
        }
        "Unsqueeze" | "Squeeze" => {
            let x = arg(0)?;
            // Axes that do not fold leave the values folded and their layout unknown.
            let given = input(1).is_some() || p.attr("axes").is_some();
            let axes = match input(1) {
                Some(_) => ints(1),
                None => ints_attr("axes"),
            };
            let shape = x.dims().and_then(|d| match (p.op_type(), axes) {
                ("Unsqueeze", Some(a)) => unsqueezed(d, &a),
                (_, Some(a)) => squeezed(d, Some(&a)),
                // Squeeze without axes: every axis of size 1.
                (_, None) if !given && p.op_type() == "Squeeze" => squeezed(d, None),
                _ => None,
            });
            Folded {
                values: x.values,
                shape,
            }
        }
        "Flatten" => {
            let x = arg(0)?;
            let shape = x.dims().and_then(|d| {
                // axis in [-r, r]: a negative one counts from the rank, not from r + 1.
                let axis = int_attr("axis").unwrap_or(1);
                let axis = if axis < 0 {
                    axis + d.len() as i64
                } else {
                    axis
                };
                let axis = normalized(axis, d.len() + 1)?;
                Some(vec![d[..axis].iter().product(), d[axis..].iter().product()])
            });
            Folded {
                values: x.values,
                shape,
            }
        }
        "Concat" => {
            let parts = (0..n.inputs.len()).map(arg).collect::<Option<Vec<_>>>()?;
            concat(&parts, int_attr("axis").unwrap_or(0))?
        }
        "Gather" => {
            let data = arg(0)?;
            // One axis of a vector (or of values laid out as one).
            if data.dims().is_some_and(|d| d.len() != 1) {
                return None;
            }
            let indices = arg(1)?;
            let len = data.values.len() as i64;
            let values = indices
                .known()?
                .iter()
                .map(|i| {
                    let i = if *i < 0 { i + len } else { *i };
                    data.values.get(usize::try_from(i).ok()?).cloned()
                })
                .collect::<Option<Vec<_>>>()?;
            Folded {
                values,
                shape: indices.shape,
            }
        }
        "Slice" => {
            let x = arg(0)?;
            let (starts, ends) = (ints(1)?, ints(2)?);
            let axes = match input(3) {
                Some(_) => Some(ints(3)?),
                None => None,
            };
            let steps = match input(4) {
                Some(_) => ints(4)?,
                None => vec![1; starts.len()],
            };
            slice(&x, &starts, &ends, axes.as_deref(), &steps)?
        }
        "Transpose" => {
            let x = arg(0)?;
            let d = x.dims()?.to_vec();
            let perm: Vec<usize> = match ints_attr("perm") {
                Some(p) => p
                    .iter()
                    .map(|a| usize::try_from(*a).ok())
                    .collect::<Option<_>>()?,
                None => (0..d.len()).rev().collect(),
            };
            transpose(&x.values, &d, &perm)?
        }
        "ConstantOfShape" => {
            let shape: Vec<usize> = ints(0)?
                .iter()
                .map(|d| usize::try_from(*d).ok())
                .collect::<Option<_>>()?;
            let count = shape
                .iter()
                .try_fold(1usize, |acc, d| acc.checked_mul(*d))?;
            if count > MOST_ELEMENTS {
                return None;
            }
            let fill = match p.attr("value").and_then(|a| a.t.as_ref()) {
                Some(t) => *tensor_ints(t)?.first()?,
                None => return None, // float zeros by default: not an integer tensor
            };
            Folded {
                values: vec![Dim::Known(fill); count],
                shape: Some(shape),
            }
        }
        // torch writes the axes of a broadcasting Unsqueeze this way (GroupNorm's scale:
        // `Range(1, rank - 1, 1)`); a short one only, as axes and shapes are.
        "Range" => {
            let [start, limit, delta] = [ints(0)?, ints(1)?, ints(2)?].map(|v| v.first().copied());
            let (start, limit, delta) = (start?, limit?, delta?);
            // ceil((limit - start) / delta) elements, checked: the values come from the file.
            let count = match delta {
                0 => return None,
                d => limit
                    .checked_sub(start)?
                    .checked_add(d - d.signum())?
                    .checked_div(d)?
                    .max(0),
            };
            if count > 64 {
                return None;
            }
            Folded::vector(
                (0..count)
                    .map(|i| Some(Dim::Known(start.checked_add(i.checked_mul(delta)?)?)))
                    .collect::<Option<_>>()?,
            )
        }
        "Add" | "Sub" | "Mul" | "Div" | "Mod" => {
            // Mod with fmod = 1 is C's remainder (the dividend's sign): not folded.
            if p.op_type() == "Mod" && int_attr("fmod") == Some(1) {
                return None;
            }
            // Whole numbers in float: exact while float32 holds them; a Div only where it
            // divides (its quotient is not whole otherwise), no Mod.
            let float = float_valued(model, input(0)?, 16);
            if float && p.op_type() == "Mod" {
                return None;
            }
            elementwise(&[arg(0)?, arg(1)?], |v| match (&v[0], &v[1]) {
                (Dim::Known(x), Dim::Known(y)) => match p.op_type() {
                    "Add" => x.checked_add(*y),
                    "Sub" => x.checked_sub(*y),
                    "Mul" => x.checked_mul(*y),
                    // The divisor's sign, as Python's `%` (torch's `W % 2`).
                    "Mod" => x
                        .checked_rem(*y)
                        .map(|r| match r != 0 && (r < 0) != (*y < 0) {
                            true => r + y,
                            false => r,
                        }),
                    _ if float => x.checked_rem(*y).filter(|r| *r == 0).and(x.checked_div(*y)),
                    // Integer Div truncates, as ONNX Runtime's kernel does.
                    _ => x.checked_div(*y),
                }
                .filter(|r| !float || r.unsigned_abs() <= 1 << 24)
                .map_or(Dim::Unknown, Dim::Known),
                // A named size times or exactly over a number or a name (BLOOM's batch
                // times its heads, and back): the product, by name.
                (x, y) => {
                    let (x, y) = match (x.monomial(), y.monomial()) {
                        (Some(x), Some(y)) => (x, y),
                        _ => return Dim::Unknown,
                    };
                    match p.op_type() {
                        "Mul" => x.times(&y),
                        "Div" => x.over(&y),
                        _ => None,
                    }
                    .map_or(Dim::Unknown, |m| m.dim())
                }
            })?
        }
        // torch's `expand(n, -1)`: `Where(Equal(shape, -1), ones, shape)`, with the batch a
        // name. Booleans fold as 1 and 0 (what a Cast to an integer makes of them).
        "Equal" => elementwise(&[arg(0)?, arg(1)?], |v| match (&v[0], &v[1]) {
            (Dim::Known(x), Dim::Known(y)) => Dim::Known((x == y) as i64),
            (Dim::Symbol(a), Dim::Symbol(b)) if a == b => Dim::Known(1),
            // A size is never negative.
            (Dim::Symbol(_), Dim::Known(k)) | (Dim::Known(k), Dim::Symbol(_)) if *k < 0 => {
                Dim::Known(0)
            }
            _ => Dim::Unknown,
        })?,
        // Comparisons and logic fold to 1 and 0 as Equal does: an If's condition on shapes
        // (TorchScript's `if x.dim() == 4`) decides its branch before the run.
        "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" => {
            let op = p.op_type();
            elementwise(&[arg(0)?, arg(1)?], |v| match (&v[0], &v[1]) {
                (Dim::Known(x), Dim::Known(y)) => Dim::Known(match op {
                    "Less" => x < y,
                    "Greater" => x > y,
                    "LessOrEqual" => x <= y,
                    _ => x >= y,
                } as i64),
                _ => Dim::Unknown,
            })?
        }
        "Not" => elementwise(&[arg(0)?], |v| match v[0] {
            Dim::Known(x) => Dim::Known((x == 0) as i64),
            _ => Dim::Unknown,
        })?,
        "And" | "Or" | "Xor" => {
            let op = p.op_type();
            elementwise(&[arg(0)?, arg(1)?], |v| match (&v[0], &v[1]) {
                (Dim::Known(x), Dim::Known(y)) => {
                    let (x, y) = (*x != 0, *y != 0);
                    Dim::Known(match op {
                        "And" => x && y,
                        "Or" => x || y,
                        _ => x != y,
                    } as i64)
                }
                _ => Dim::Unknown,
            })?
        }
        // The element count: the product of the dims (by name where names take part).
        "Size" => {
            let d = dims_of(input(0)?)?;
            Folded {
                values: vec![super::shapes::product(&d)],
                shape: Some(Vec::new()),
            }
        }
        "Where" => elementwise(&[arg(0)?, arg(1)?, arg(2)?], |v| match v[0] {
            Dim::Known(0) => v[2].clone(),
            Dim::Known(_) => v[1].clone(),
            _ => Dim::Unknown,
        })?,
        _ => return None,
    };
    (folded.values.len() <= MOST_ELEMENTS).then_some(folded)
}

/// The values of a float32 or float64 constant, when every one is a whole number that
/// float32 holds exactly (the `2.0` of torch's `ceil(h / 2.0) * 2.0`).
fn integral_floats(t: &crate::proto::TensorProto) -> Option<Vec<i64>> {
    let values: Vec<f64> = match crate::data::Tensor::from_tensor_proto(t).ok()? {
        crate::data::Tensor::F32(a) => a.iter().map(|x| f64::from(*x)).collect(),
        crate::data::Tensor::F64(a) => a.iter().copied().collect(),
        _ => return None,
    };
    values
        .iter()
        .map(|x| (x.fract() == 0.0 && x.abs() <= f64::from(1u32 << 24)).then_some(*x as i64))
        .collect()
}

/// Whether `v` holds floats, as far as the ops that make small tensors tell: a float
/// constant, a Cast to a float type, or an op whose result has its first input's type.
fn float_valued(model: &Model, v: ValueId, depth: usize) -> bool {
    let is_float = |t: i32| {
        [
            DataType::Float,
            DataType::Double,
            DataType::Float16,
            DataType::Bfloat16,
        ]
        .iter()
        .any(|f| *f as i32 == t)
    };
    if let Some(t) = constant_tensor(model, v) {
        return is_float(t.data_type());
    }
    let ValueDef::Node { node, slot: 0 } = model.value(v).def else {
        return false;
    };
    let n = model.node(node);
    match n.proto.op_type() {
        "Cast" => n
            .proto
            .attr_int("to")
            .ok()
            .flatten()
            .is_some_and(|t| is_float(t as i32)),
        "Add" | "Sub" | "Mul" | "Div" | "Ceil" | "Floor" | "Neg" | "Abs" | "Identity"
        | "Reshape" | "Unsqueeze" | "Squeeze" | "Concat" | "Gather" | "Slice" => {
            depth > 0
                && n.inputs
                    .first()
                    .copied()
                    .flatten()
                    .is_some_and(|x| float_valued(model, x, depth - 1))
        }
        _ => false,
    }
}

/// The operands of `v = Div(a, b)` in float, if that is what `v` is.
fn quotient_operands(model: &Model, v: ValueId) -> Option<(ValueId, ValueId)> {
    let ValueDef::Node { node, slot: 0 } = model.value(v).def else {
        return None;
    };
    let n = model.node(node);
    let (a, b) = (
        n.inputs.first().copied().flatten()?,
        n.inputs.get(1).copied().flatten()?,
    );
    (n.proto.op_type() == "Div" && n.proto.domain().is_empty() && float_valued(model, v, 16))
        .then_some((a, b))
}

/// `⌈x / y⌉` or `⌊x / y⌋` of whole numbers, exactly (`None` for y = 0 or on overflow).
fn rounded_quotient(x: i64, y: i64, ceil: bool) -> Option<i64> {
    let q = x.checked_div(y)?;
    let exact = x.checked_rem(y)? == 0;
    // Truncation rounds towards zero: one more for a positive quotient's ceiling, one less
    // for a negative quotient's floor.
    let positive = (x < 0) == (y < 0);
    Some(match (exact, ceil, positive) {
        (true, ..) => q,
        (false, true, true) => q + 1,
        (false, false, false) => q - 1,
        _ => q,
    })
}

/// An elementwise op over folded operands of one length, or of length one (broadcast):
/// `f` of each position's operands; the layout of the longest operand where the others
/// agree with it or are single values, else unknown.
fn elementwise(parts: &[Folded], f: impl Fn(&[Dim]) -> Dim) -> Option<Folded> {
    let len = parts.iter().map(|p| p.values.len()).max()?;
    if parts
        .iter()
        .any(|p| p.values.len() != len && p.values.len() != 1)
    {
        return None;
    }
    let values = (0..len)
        .map(|i| {
            let at: Vec<Dim> = parts
                .iter()
                .map(|p| p.values[if p.values.len() == 1 { 0 } else { i }].clone())
                .collect();
            f(&at)
        })
        .collect();
    // The full-length operands' common layout, if no single value has more axes (which
    // would add leading axes); equal lengths of different ranks: unknown.
    let (full, single): (Vec<&Folded>, Vec<&Folded>) =
        parts.iter().partition(|p| p.values.len() == len);
    let shape = full[0].dims().map(<[usize]>::to_vec).filter(|s| {
        full.iter().all(|p| p.dims() == Some(s.as_slice()))
            && single
                .iter()
                .all(|p| p.dims().is_some_and(|d| d.len() <= s.len()))
    });
    Some(Folded { values, shape })
}

/// An axis in `0..rank` from one that may count from the end.
fn normalized(axis: i64, rank: usize) -> Option<usize> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    usize::try_from(a).ok().filter(|a| *a < rank)
}

/// Reshape's output shape: `0` copies the input's dim (unless `allowzero`), one `-1` takes
/// what is left.
fn reshaped(
    input: Option<&[usize]>,
    count: usize,
    target: &[i64],
    allowzero: Option<i64>,
) -> Option<Vec<usize>> {
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, t) in target.iter().enumerate() {
        match *t {
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            0 if allowzero != Some(1) => out.push(*input?.get(i)?),
            t => out.push(usize::try_from(t).ok()?),
        }
    }
    let known: usize = out.iter().product();
    if let Some(i) = infer {
        if known == 0 || !count.is_multiple_of(known) {
            return None;
        }
        out[i] = count / known;
    }
    (out.iter().product::<usize>() == count).then_some(out)
}

fn unsqueezed(dims: &[usize], axes: &[i64]) -> Option<Vec<usize>> {
    let rank = dims.len() + axes.len();
    let mut at: Vec<usize> = axes
        .iter()
        .map(|a| normalized(*a, rank))
        .collect::<Option<_>>()?;
    at.sort_unstable();
    let mut rest = dims.iter();
    (0..rank)
        .map(|i| match at.binary_search(&i) {
            Ok(_) => Some(1),
            Err(_) => rest.next().copied(),
        })
        .collect()
}

fn squeezed(dims: &[usize], axes: Option<&[i64]>) -> Option<Vec<usize>> {
    let drop: Vec<usize> = match axes {
        Some(axes) => axes
            .iter()
            .map(|a| normalized(*a, dims.len()).filter(|a| dims[*a] == 1))
            .collect::<Option<_>>()?,
        None => (0..dims.len()).filter(|i| dims[*i] == 1).collect(),
    };
    Some(
        dims.iter()
            .enumerate()
            .filter(|(i, _)| !drop.contains(i))
            .map(|(_, d)| *d)
            .collect(),
    )
}

/// Row-major strides of `dims`.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

fn concat(parts: &[Folded], axis: i64) -> Option<Folded> {
    // Vectors, or values whose layout is not known, joined end to end (axis 0).
    let flat = parts.iter().all(|f| f.dims().is_none_or(|d| d.len() <= 1));
    if flat {
        if axis != 0 && axis != -1 {
            return None;
        }
        let values: Vec<Dim> = parts.iter().flat_map(|f| f.values.clone()).collect();
        let all_vectors = parts.iter().all(|f| f.dims().is_some());
        let n = values.len();
        return Some(Folded {
            values,
            shape: all_vectors.then(|| vec![n]),
        });
    }
    let shapes: Vec<&[usize]> = parts.iter().map(|f| f.dims()).collect::<Option<_>>()?;
    let rank = shapes[0].len();
    let axis = normalized(axis, rank)?;
    if shapes
        .iter()
        .any(|s| s.len() != rank || (0..rank).any(|i| i != axis && s[i] != shapes[0][i]))
    {
        return None;
    }
    let outer: usize = shapes[0][..axis].iter().product();
    let inner: usize = shapes[0][axis + 1..].iter().product();
    let mut values = Vec::new();
    for o in 0..outer {
        for (f, s) in parts.iter().zip(&shapes) {
            let block = s[axis] * inner;
            values.extend_from_slice(f.values.get(o * block..(o + 1) * block)?);
        }
    }
    let mut shape = shapes[0].to_vec();
    shape[axis] = shapes.iter().map(|s| s[axis]).sum();
    Some(Folded {
        values,
        shape: Some(shape),
    })
}

fn slice(
    x: &Folded,
    starts: &[i64],
    ends: &[i64],
    axes: Option<&[i64]>,
    steps: &[i64],
) -> Option<Folded> {
    let n = starts.len();
    if ends.len() != n || steps.len() != n || axes.is_some_and(|a| a.len() != n) {
        return None;
    }
    // Values without a known layout slice as a vector.
    let dims: Vec<usize> = match x.dims() {
        Some(d) => d.to_vec(),
        None => vec![x.values.len()],
    };
    let rank = dims.len();
    // Per axis: the first index read and the step, and how many are read.
    let mut first = vec![0i64; rank];
    let mut step = vec![1i64; rank];
    let mut len: Vec<usize> = dims.clone();
    for j in 0..n {
        let axis = match axes {
            Some(a) => normalized(a[j], rank)?,
            None => j,
        };
        if axis >= rank {
            return None;
        }
        let (f, l) = slice_range(dims[axis] as i64, starts[j], ends[j], steps[j])?;
        first[axis] = f;
        step[axis] = steps[j];
        len[axis] = usize::try_from(l).ok()?;
    }
    let stride = strides(&dims);
    let count: usize = len.iter().product();
    let mut values = Vec::with_capacity(count);
    for flat in 0..count {
        let mut rest = flat;
        let mut at = 0usize;
        for a in (0..rank).rev() {
            let i = (rest % len[a]) as i64;
            rest /= len[a];
            let index = usize::try_from(first[a] + i * step[a]).ok()?;
            at += index * stride[a];
        }
        values.push(x.values.get(at)?.clone());
    }
    Some(Folded {
        values,
        shape: x.dims().map(|_| len),
    })
}

fn transpose(values: &[Dim], dims: &[usize], perm: &[usize]) -> Option<Folded> {
    let rank = dims.len();
    let mut seen = vec![false; rank];
    if perm.len() != rank
        || perm
            .iter()
            .any(|a| *a >= rank || std::mem::replace(&mut seen[*a], true))
    {
        return None;
    }
    let out_dims: Vec<usize> = perm.iter().map(|a| dims[*a]).collect();
    let stride = strides(dims);
    let count = values.len();
    let mut out = Vec::with_capacity(count);
    for flat in 0..count {
        let mut rest = flat;
        let mut at = 0usize;
        for k in (0..rank).rev() {
            let i = rest % out_dims[k];
            rest /= out_dims[k];
            at += i * stride[perm[k]];
        }
        out.push(values.get(at)?.clone());
    }
    Some(Folded {
        values: out,
        shape: Some(out_dims),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::BodyId;

    fn folded(text: &str, name: &str) -> Vec<i64> {
        let model = Model::from_proto(crate::ir::text::parse_model(text).unwrap());
        let v = model.lookup(BodyId::MAIN, name).unwrap();
        fold_dims(&model, &|_| None, v, 16)
            .unwrap()
            .iter()
            .map(|d| d.known().unwrap())
            .collect()
    }

    /// MobileViT through torch's TorchScript exporter: the patch grid's height
    /// `int(ceil(h / 2.0) * 2.0) / 2` in float arithmetic, h = 5 and 6 read from a shape.
    #[test]
    fn a_ceiling_of_a_float_division_folds_to_whole_numbers() {
        let text = r#"
<ir_version: 8, opset_import: ["" : 17]>
g (float[1] x) => (int64[2] grid, int64[2] floor) {
  hw = Constant<value = int64[2] {5, 6}>()
  hf = Cast<to = 1>(hw)
  two = Constant<value = float {2.0}>()
  q = Div(hf, two)
  up = Ceil(q)
  padded = Mul(up, two)
  whole = Cast<to = 7>(padded)
  two_i = Constant<value = int64 {2}>()
  grid = Div(whole, two_i)
  down = Floor(q)
  floor = Cast<to = 7>(down)
}"#;
        assert_eq!(folded(text, "grid"), [3, 3]);
        assert_eq!(folded(text, "floor"), [2, 3]);
    }

    /// An If's condition on shapes (TorchScript's `if x.dim() == 4 and x.size(0) > 1`):
    /// comparisons, logic and Size fold to 1 and 0; a boolean constant reads as 1 and 0.
    #[test]
    fn comparisons_logic_and_sizes_fold_to_ones_and_zeros() {
        let text = r#"
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,3,4,5] x) => (bool four_d, bool wide, bool either, bool neither, int64 n) {
  s = Shape(x)
  rank = Size(s)
  four = Constant<value = int64 {4}>()
  four_d = Equal(rank, four)
  zero = Constant<value = int64 {0}>()
  rows = Gather(s, zero)
  one = Constant<value = int64 {1}>()
  many = Greater(rows, one)
  few = LessOrEqual(rows, one)
  wide = And(four_d, many)
  yes = Constant<value = bool {1}>()
  either = Or(few, yes)
  neither = Not(either)
  n = Size(x)
}"#;
        let model = Model::from_proto(crate::ir::text::parse_model(text).unwrap());
        // The dims the shape facts give: x's, and its shape's (a vector of 4).
        let (x, s) = (
            model.lookup(BodyId::MAIN, "x").unwrap(),
            model.lookup(BodyId::MAIN, "s").unwrap(),
        );
        let dims_of = |v: ValueId| match v {
            v if v == x => Some([2, 3, 4, 5].into_iter().map(Dim::Known).collect()),
            v if v == s => Some(vec![Dim::Known(4)]),
            _ => None,
        };
        let fold_of = |name| {
            let v = model.lookup(BodyId::MAIN, name).unwrap();
            fold_dims(&model, &dims_of, v, 16)
                .and_then(|d| d.iter().map(Dim::known).collect::<Option<Vec<i64>>>())
        };
        assert_eq!(fold_of("four_d"), Some(vec![1]));
        assert_eq!(fold_of("wide"), Some(vec![1]));
        assert_eq!(fold_of("either"), Some(vec![1]));
        assert_eq!(fold_of("neither"), Some(vec![0]));
        assert_eq!(fold_of("n"), Some(vec![120]));
    }

    /// A float quotient that is not whole, a float remainder and a value float32 cannot
    /// hold exactly are not folded (an integer Div truncates, and folds).
    #[test]
    fn float_values_fold_only_as_exact_whole_numbers() {
        let text = r#"
<ir_version: 8, opset_import: ["" : 17]>
g (float[1] x) => (float[2] q, float[2] r, float[1] big, double[1] lowest, int64[2] t) {
  hw = Constant<value = int64[2] {5, 6}>()
  hf = Cast<to = 1>(hw)
  two = Constant<value = float {2.0}>()
  q = Div(hf, two)
  r = Mod<fmod = 1>(hf, two)
  huge = Constant<value = int64[1] {16777217}>()
  big = Cast<to = 1>(huge)
  least = Constant<value = int64[1] {-9223372036854775808}>()
  lowest = Cast<to = 11>(least)
  two_i = Constant<value = int64 {2}>()
  t = Div(hw, two_i)
}"#;
        let model = Model::from_proto(crate::ir::text::parse_model(text).unwrap());
        let fold_of = |name| {
            fold_dims(
                &model,
                &|_| None,
                model.lookup(BodyId::MAIN, name).unwrap(),
                16,
            )
        };
        assert_eq!(fold_of("q"), Some(vec![Dim::Unknown, Dim::Known(3)]));
        assert_eq!(fold_of("r"), None);
        assert_eq!(fold_of("big"), None);
        assert_eq!(fold_of("lowest"), None);
        assert_eq!(folded(text, "t"), [2, 3]);
    }

    #[test]
    fn rounded_quotients_of_every_sign() {
        for (x, y, ceil, floor) in [
            (7, 2, 4, 3),
            (-7, 2, -3, -4),
            (7, -2, -3, -4),
            (-7, -2, 4, 3),
            (6, 3, 2, 2),
            (0, 5, 0, 0),
        ] {
            assert_eq!(rounded_quotient(x, y, true), Some(ceil), "ceil {x}/{y}");
            assert_eq!(rounded_quotient(x, y, false), Some(floor), "floor {x}/{y}");
        }
        assert_eq!(rounded_quotient(1, 0, true), None);
        assert_eq!(rounded_quotient(i64::MIN, -1, true), None);
    }

    /// torch's TorchScript export of `F.pad(x, [0, 1, 0, 1])` on a 4-D input (EfficientNet's
    /// stem): ONNX pads [0, 0, 0, 0, 0, 0, 1, 1], every axis's begin, then every end.
    #[test]
    fn torchs_pad_conversion_folds_to_onnx_pads() {
        let text = r#"
<ir_version: 8, opset_import: ["" : 17]>
g (float[1] x) => (int64[8] pads)
<int64[4] torch_pads = {0, 1, 0, 1}, int64[1] zero = {0}, int64 eight = {8},
 int64[2] pairs = {-1, 2}, int64[1] start = {-1}, int64[1] end = {-9223372036854775807},
 int64[1] axis = {0}, int64[1] back = {-1}, int64[1] flat = {-1}>
{
  shape = Shape (torch_pads)
  count = Gather (shape, zero)
  missing = Sub (eight, count)
  zeros = ConstantOfShape <value = int64[1] {0}> (missing)
  joined = Concat <axis = 0> (torch_pads, zeros)
  paired = Reshape (joined, pairs)
  reversed = Slice (paired, start, end, axis, back)
  t = Transpose <perm = [1, 0]> (reversed)
  flattened = Reshape (t, flat)
  pads = Cast <to = 7> (flattened)
}
"#;
        assert_eq!(folded(text, "pads"), vec![0, 0, 0, 0, 0, 0, 1, 1]);
    }

    /// torchvision's Swin pads to even sizes with `W % 2` (ONNX Mod, fmod 0: the divisor's
    /// sign); integer Div truncates as ONNX Runtime's kernel does.
    #[test]
    fn mod_takes_the_divisors_sign_and_div_truncates() {
        let text = r#"
<ir_version: 8, opset_import: ["" : 17]>
g (float[1] x) => (int64[4] m, int64[4] d)
<int64[4] a = {7, -7, 7, -7}, int64[4] b = {2, 2, -2, -2}>
{
  m = Mod (a, b)
  d = Div (a, b)
}
"#;
        assert_eq!(folded(text, "m"), vec![1, 1, -1, -1]);
        assert_eq!(folded(text, "d"), vec![3, -3, -3, 3]);
    }

    /// Flatten's axis counts from the rank when negative: [2, 3, 4] at -1 is [6, 4], whose
    /// transpose reads the values column by column.
    #[test]
    fn flatten_with_a_negative_axis_splits_before_the_last() {
        let text = r#"
<ir_version: 8, opset_import: ["" : 17]>
g (float[1] x) => (int64[24] t)
<int64[2, 3, 4] a = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}>
{
  f = Flatten <axis = -1> (a)
  t = Transpose (f)
}
"#;
        let expected: Vec<i64> = (0..4)
            .flat_map(|c| (0..6).map(move |r| r * 4 + c))
            .collect();
        assert_eq!(folded(text, "t"), expected);
    }

    #[test]
    fn concat_slice_and_transpose_follow_the_layout() {
        let text = r#"
<ir_version: 8, opset_import: ["" : 17]>
g (float[1] x) => (int64[2] sliced, int64[8] t)
<int64[2, 3] a = {1, 2, 3, 4, 5, 6}, int64[2, 1] c = {7, 8}, int64[2] s = {1, 3},
 int64[2] e = {2, -5}, int64[2] axes = {0, 1}, int64[2] steps = {1, -2}>
{
  joined = Concat <axis = 1> (a, c)
  sliced = Slice (joined, s, e, axes, steps)
  t = Transpose (joined)
}
"#;
        // Row 1 of [[1, 2, 3, 7], [4, 5, 6, 8]], columns 3 and 1.
        assert_eq!(folded(text, "sliced"), vec![8, 5]);
        assert_eq!(folded(text, "t"), vec![1, 4, 2, 5, 3, 6, 7, 8]);
    }
}
