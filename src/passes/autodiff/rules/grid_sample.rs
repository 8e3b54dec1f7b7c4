//! GridSample on 2-D images: X [N, C, H, W] read at the points of grid [N, Ho, Wo, 2]
//! ((x, y) in [-1, 1]), as ONNX (opset 16 and 20) and torch's `grid_sample` define it:
//!
//! ```text
//! ix = a_x · gx + (W - 1)/2,   a_x = (W - 1)/2 (align_corners) or W/2;  iy alike with H
//! border: ix clamped to [0, W - 1] (its slope 0 outside);  zeros: points outside read 0
//! linear  x0 = ⌊ix⌋, x1 = x0 + 1, wx1 = ix - x0, wx0 = 1 - wx1 (y alike);
//!         Y = Σ_{a,b ∈ {0,1}} wy_a · wx_b · X[y_a, x_b]
//!   dX[y_a, x_b] += wy_a · wx_b · dY                  (a scatter-add per corner)
//!   d ix = Σ_c dY · (wy0 · (X[y0,x1] - X[y0,x0]) + wy1 · (X[y1,x1] - X[y1,x0]))
//!   d iy = Σ_c dY · (wx0 · (X[y1,x0] - X[y0,x0]) + wx1 · (X[y1,x1] - X[y0,x1]))
//!   d grid = (d ix · slope_x, d iy · slope_y)
//! nearest Y = X[round(iy), round(ix)] (half to even):  dX scatters dY there; d grid = 0
//! ```
//!
//! X's corner values are gathered from the view [N, C, H·W] at flat indices y·W + x (a
//! point outside weighs 0 and reads index 0), and dX is the same view scattered into with
//! `ScatterElements(reduction = add)`. H and W must be known. Not supported (an error naming
//! the node): the cubic mode, reflection padding, and inputs of other ranks.

use super::super::shapes::Dim;
use super::{Grad, InputGrads};
use crate::ir::builder::{attr_int, attr_string, tensor_i64};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
}

pub fn grid_sample(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let (x, grid) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let linear = match cx.string_attr(node, "mode")?.as_deref() {
        None | Some("bilinear" | "linear") => true,
        Some("nearest") => false,
        Some(other) => {
            return Err(cx.error(
                node,
                format!("mode '{other}' is not supported by the gradient rule (linear, nearest)"),
            ))
        }
    };
    let padding = match cx.string_attr(node, "padding_mode")?.as_deref() {
        None | Some("zeros") => Padding::Zeros,
        Some("border") => Padding::Border,
        Some(other) => {
            return Err(cx.error(
                node,
                format!(
                    "padding_mode '{other}' is not supported by the gradient rule (zeros, border)"
                ),
            ))
        }
    };
    let align = cx.int_attr(node, "align_corners", 0)? != 0;
    let elem = cx.elem(node, x)?;
    let (h, w) = match cx.facts(x).dims.as_deref() {
        Some([_, _, Dim::Known(h), Dim::Known(w)]) => (*h, *w),
        _ => {
            return Err(cx.error(
                node,
                format!(
                    "'{}' must be [N, C, H, W] with H and W known",
                    cx.model().name(x)
                ),
            ))
        }
    };
    let hint = format!("{}_grad", cx.model().name(x));
    let hn = |s: &str| format!("{hint}_{s}");

    // The sampling coordinates in pixels, and d(pixel)/d(grid) per point.
    let f = |cx: &mut Grad<'_>, v: f64| cx.scalar(elem, v);
    let coordinate = |cx: &mut Grad<'_>, axis: i64, size: i64, name: &str| {
        let index = cx.constant(&format!("grid_axis_{axis}"), tensor_i64(&[], &[axis]));
        let g = cx.op(
            "Gather",
            &[grid, index],
            vec![attr_int("axis", -1)],
            &hn(name),
        );
        let a = if align {
            (size - 1) as f64 / 2.0
        } else {
            size as f64 / 2.0
        };
        let (a_v, b_v) = (f(cx, a), f(cx, (size - 1) as f64 / 2.0));
        let scaled = cx.mul(g, a_v, &hn(name));
        let pixel = cx.add(scaled, b_v, &hn(name));
        match padding {
            Padding::Zeros => (pixel, a_v),
            Padding::Border => {
                let (lo, hi) = (f(cx, 0.0), f(cx, (size - 1) as f64));
                let clamped = cx.op("Clip", &[pixel, lo, hi], vec![], &hn(name));
                let above = cx.greater_or_equal(pixel, lo, &hn(name));
                let below = cx.op("LessOrEqual", &[pixel, hi], vec![], &hn(name));
                let inside = cx.and(above, below, &hn(name));
                let inside = cx.cast_to(inside, elem, &hn(name));
                let slope = cx.mul(inside, a_v, &hn(name));
                (clamped, slope)
            }
        }
    };
    let (ix, slope_x) = coordinate(cx, 0, w, "ix");
    let (iy, slope_y) = coordinate(cx, 1, h, "iy");

    // The views: X and dY as [N, C, P], P = H·W or Ho·Wo.
    let view = cx.ints(&[0, 0, -1]);
    let x_flat = cx.op("Reshape", &[x, view], vec![], &hn("x_flat"));
    let dy_flat = cx.op("Reshape", &[dy, view], vec![], &hn("dy_flat"));
    let dy_shape = cx.op("Shape", &[dy_flat], vec![], &hn("dy_flat_shape"));
    let point_view = cx.ints(&[0, 1, -1]);
    let int = |cx: &mut Grad<'_>, v: i64| cx.constant(&format!("gs_i{v}"), tensor_i64(&[], &[v]));

    // One corner (or the nearest point): its flat index [N, C, P] and whether it is inside,
    // as a float mask [N, 1, P].
    let corner = |cx: &mut Grad<'_>, xi: ValueId, yi: ValueId, name: &str| {
        let (zero, w_last, h_last) = (int(cx, 0), int(cx, w - 1), int(cx, h - 1));
        let in_x = {
            let a = cx.greater_or_equal(xi, zero, &hn(name));
            let b = cx.op("LessOrEqual", &[xi, w_last], vec![], &hn(name));
            cx.and(a, b, &hn(name))
        };
        let in_y = {
            let a = cx.greater_or_equal(yi, zero, &hn(name));
            let b = cx.op("LessOrEqual", &[yi, h_last], vec![], &hn(name));
            cx.and(a, b, &hn(name))
        };
        let inside = cx.and(in_x, in_y, &hn(name));
        let xs = cx.op("Clip", &[xi, zero, w_last], vec![], &hn(name));
        let ys = cx.op("Clip", &[yi, zero, h_last], vec![], &hn(name));
        let width = int(cx, w);
        let row = cx.mul(ys, width, &hn(name));
        let flat = cx.add(row, xs, &hn(name));
        let flat = cx.op("Reshape", &[flat, point_view], vec![], &hn(name));
        let index = cx.op("Expand", &[flat, dy_shape], vec![], &hn(name));
        let mask = cx.cast_to(inside, elem, &hn(name));
        let mask = cx.op("Reshape", &[mask, point_view], vec![], &hn(name));
        (index, mask)
    };

    let zeros = cx.zeros_like(node, x, &hn("zeros"))?;
    let mut dx_flat = cx.op("Reshape", &[zeros, view], vec![], &hn("dx_flat"));
    let scatter = |cx: &mut Grad<'_>, acc: ValueId, index: ValueId, weight: ValueId| {
        let updates = cx.mul(dy_flat, weight, &hn("updates"));
        cx.op(
            "ScatterElements",
            &[acc, index, updates],
            vec![attr_int("axis", 2), attr_string("reduction", "add")],
            &hn("scatter"),
        )
    };
    let mut out = vec![None; wants.len()];
    if !linear {
        let xi = cx.op("Round", &[ix], vec![], &hn("nx"));
        let yi = cx.op("Round", &[iy], vec![], &hn("ny"));
        let xi = cx.cast_to(xi, DataType::Int64 as i32, &hn("nx"));
        let yi = cx.cast_to(yi, DataType::Int64 as i32, &hn("ny"));
        let (index, mask) = corner(cx, xi, yi, "nearest");
        dx_flat = scatter(cx, dx_flat, index, mask);
        if super::wanted(wants, 1) {
            out[1] = Some(cx.zeros_like(node, grid, &format!("{}_grad", cx.model().name(grid)))?);
        }
    } else {
        let x0f = cx.op("Floor", &[ix], vec![], &hn("x0f"));
        let y0f = cx.op("Floor", &[iy], vec![], &hn("y0f"));
        let wx1 = cx.sub(ix, x0f, &hn("wx1"));
        let wy1 = cx.sub(iy, y0f, &hn("wy1"));
        let one = f(cx, 1.0);
        let wx0 = cx.sub(one, wx1, &hn("wx0"));
        let wy0 = cx.sub(one, wy1, &hn("wy0"));
        let x0 = cx.cast_to(x0f, DataType::Int64 as i32, &hn("x0"));
        let y0 = cx.cast_to(y0f, DataType::Int64 as i32, &hn("y0"));
        let i1 = int(cx, 1);
        let x1 = cx.add(x0, i1, &hn("x1"));
        let y1 = cx.add(y0, i1, &hn("y1"));
        let flat_w =
            |cx: &mut Grad<'_>, v: ValueId| cx.op("Reshape", &[v, point_view], vec![], &hn("w"));
        let (wx0, wx1, wy0, wy1) = (
            flat_w(cx, wx0),
            flat_w(cx, wx1),
            flat_w(cx, wy0),
            flat_w(cx, wy1),
        );
        // Each corner's flat index and inside-mask, corners[a][b] at (y_a, x_b).
        let mut corners = Vec::with_capacity(4);
        for (a, (yi, wy)) in [(y0, wy0), (y1, wy1)].into_iter().enumerate() {
            for (b, (xi, wx)) in [(x0, wx0), (x1, wx1)].into_iter().enumerate() {
                let name = format!("c{a}{b}");
                let (index, mask) = corner(cx, xi, yi, &name);
                let wyx = cx.mul(wy, wx, &hn(&name));
                let weight = cx.mul(wyx, mask, &hn(&name));
                dx_flat = scatter(cx, dx_flat, index, weight);
                corners.push((index, mask));
            }
        }
        if super::wanted(wants, 1) {
            // values[a][b] = X[y_a, x_b] (0 outside), [N, C, P].
            let values: Vec<ValueId> = corners
                .iter()
                .map(|&(index, mask)| {
                    let v = cx.op(
                        "GatherElements",
                        &[x_flat, index],
                        vec![attr_int("axis", 2)],
                        &hn("corner_value"),
                    );
                    cx.mul(v, mask, &hn("corner_value"))
                })
                .collect();
            let v = |a: usize, b: usize| values[2 * a + b];
            let diff = |cx: &mut Grad<'_>, p: ValueId, q: ValueId| cx.sub(p, q, &hn("diff"));
            // d ix, d iy per point, summed over the channels: [N, 1, P].
            let dx_row0 = diff(cx, v(0, 1), v(0, 0));
            let dx_row1 = diff(cx, v(1, 1), v(1, 0));
            let t0 = cx.mul(wy0, dx_row0, &hn("dix"));
            let t1 = cx.mul(wy1, dx_row1, &hn("dix"));
            let along_x = cx.add(t0, t1, &hn("dix"));
            let dy_col0 = diff(cx, v(1, 0), v(0, 0));
            let dy_col1 = diff(cx, v(1, 1), v(0, 1));
            let t0 = cx.mul(wx0, dy_col0, &hn("diy"));
            let t1 = cx.mul(wx1, dy_col1, &hn("diy"));
            let along_y = cx.add(t0, t1, &hn("diy"));
            let reduce = |cx: &mut Grad<'_>, t: ValueId, name: &str| {
                let p = cx.mul(dy_flat, t, &hn(name));
                let summed = cx.reduce("ReduceSum", p, &[1], false, &hn(name));
                // [N, P] -> [N, Ho, Wo], the shape of the pixel coordinate.
                let shape = cx.shape_of(ix);
                cx.op("Reshape", &[summed, shape], vec![], &hn(name))
            };
            let d_ix = reduce(cx, along_x, "dix");
            let d_iy = reduce(cx, along_y, "diy");
            let dgx = cx.mul(d_ix, slope_x, &hn("dgx"));
            let dgy = cx.mul(d_iy, slope_y, &hn("dgy"));
            let dgx = cx.unsqueeze(dgx, &[-1], &hn("dgx"));
            let dgy = cx.unsqueeze(dgy, &[-1], &hn("dgy"));
            let g_hint = format!("{}_grad", cx.model().name(grid));
            out[1] = Some(cx.op_like(
                "Concat",
                &[dgx, dgy],
                vec![attr_int("axis", -1)],
                &g_hint,
                grid,
            ));
        }
    }
    if super::wanted(wants, 0) {
        let shape = cx.shape_of(x);
        out[0] = Some(cx.op_like("Reshape", &[dx_flat, shape], vec![], &hint, x));
    }
    Ok(out)
}
