//! A convolution's weight in ONNX Runtime's blocked (`OIHWBiBo`) layout in one pass, what
//! the fused `BlockedWeight` operator computes: `passes/nchwc_conv.rs` otherwise writes it
//! as `Reshape`, a six-axis `Transpose` and `Reshape` (and a `Slice` flipping the taps for
//! a data gradient), and ONNX Runtime 1.31.1 moves that `Transpose` one element at a time:
//! 0.15-0.2 ms for a 64x64x3x3 weight, twice a step per weight (benches/README.md, "Run
//! AA"). A copy, so the same bits.
//!
//! ```text
//! b: the block; W[M, C, kh, kw]
//! forward:     out[A, B, y, x, p, q] = W[A·b + q, B·b + p, y, x]               -> [M, C, kh, kw]
//! transposed:  out[A, B, y, x, p, q] = W[B·b + p, A·b + q, kh-1-y, kw-1-x]     -> [C, M, kh, kw]
//! ```
//!
//! The transposed form is the weight of the blocked `Conv` that computes a stride-1
//! convolution's data gradient: channels swapped, taps flipped.

/// The blocked weight on onnx-ga's kernel (see the module's comment).
pub const BLOCKED_WEIGHT: &str = "BlockedWeight";

/// `w` (`[m, c, kh, kw]`) in the blocked layout of `block` channels, forward or
/// `transposed`, into `out` (as many elements). `m` and `c` are multiples of `block`.
pub fn blocked_weight(
    w: &[f32],
    [m, c, kh, kw]: [usize; 4],
    block: usize,
    transposed: bool,
    out: &mut [f32],
) {
    let taps = kh * kw;
    // The source element of output (A, B, tap, p, q), as an offset into W.
    let source = |a: usize, b: usize, tap: usize, p: usize, q: usize| {
        if transposed {
            ((b * block + p) * c + a * block + q) * taps + (taps - 1 - tap)
        } else {
            ((a * block + q) * c + b * block + p) * taps + tap
        }
    };
    let (outer, inner) = if transposed {
        (c / block, m / block)
    } else {
        (m / block, c / block)
    };
    let mut at = 0;
    for a in 0..outer {
        for b in 0..inner {
            for tap in 0..taps {
                for p in 0..block {
                    for q in 0..block {
                        out[at] = w[source(a, b, tap, p, q)];
                        at += 1;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array, Axis, IxDyn};

    /// The standard ops' form, by ndarray: W viewed as six axes, permuted as the pass's
    /// `Transpose` permutes them (taps flipped first for the transposed form).
    fn by_transpose(w: &[f32], [m, c, kh, kw]: [usize; 4], b: usize, transposed: bool) -> Vec<f32> {
        let mut w4 = Array::from_shape_vec(IxDyn(&[m, c, kh, kw]), w.to_vec()).unwrap();
        if transposed {
            w4.invert_axis(Axis(2));
            w4.invert_axis(Axis(3));
        }
        let six = w4
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order(IxDyn(&[m / b, b, c / b, b, kh, kw]))
            .unwrap();
        let perm = if transposed {
            [2, 0, 4, 5, 1, 3]
        } else {
            [0, 2, 4, 5, 3, 1]
        };
        six.permuted_axes(IxDyn(&perm)).iter().copied().collect()
    }

    #[test]
    fn the_blocked_layout_is_the_standard_ops_transpose() {
        for (dims, block) in [
            ([4, 8, 3, 3], 4),
            ([8, 4, 3, 3], 4),
            ([6, 6, 1, 2], 2),
            ([16, 32, 3, 3], 16),
        ] {
            let n: usize = dims.iter().product();
            let w: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            for transposed in [false, true] {
                let mut out = vec![f32::NAN; n];
                blocked_weight(&w, dims, block, transposed, &mut out);
                let want = by_transpose(&w, dims, block, transposed);
                assert_eq!(
                    out, want,
                    "{dims:?}, block {block}, transposed {transposed}"
                );
            }
        }
    }
}
