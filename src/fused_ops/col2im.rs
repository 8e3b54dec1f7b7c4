//! The folding of columns back into an image (col2im), what the fused `Col2Im` operator
//! computes: the adjoint of [`super::Im2Col`]'s unfolding, the second half of a transposed
//! convolution once a product made its columns.
//!
//! ```text
//! Col2Im(cols [N, C·kh·kw, Hi·Wi], like [N, *, Hi, Wi], [bias [C]]; channels C,
//!        kernel_shape [kh, kw], strides, pads [t, l, b, r], dilations,
//!        output_padding [ph, pw]) -> Y [N, C, H, W]
//! Y[n, c, y·sh + i·dh - t, x·sw + j·dw - l] += cols[n, (c·kh + i)·kw + j, y·Wi + x]
//!     (every tap that lands inside Y; Y starts at zero and takes its taps in (i, j) order;
//!     then Y[n, c] += bias[c] when given)
//! H = sh·(Hi - 1) + ph + (kh - 1)·dh + 1 - t - b, and W alike
//! ```
//!
//! `like` gives only the sizes `Hi`, `Wi` (the columns hold them flattened); its data is not
//! read.
//!
//! A transposed convolution `ConvTranspose(dY, W)` without groups is this folding of
//! `Wᵀ · dY` per image (W seen as `[M, C·kh·kw]`): what ONNX Runtime's CPU kernel does itself,
//! one image at a time, folding on one thread (`math::Col2im`), then adding the bias. Each
//! output element adds its taps in the same order, starting from zero, and then its bias, so
//! the folding gives the same bits.

use super::im2col::Unfolding;
use super::Window2d;

/// The folding on onnx-ga's kernel (see the module's comment).
pub const COL2IM: &str = "Col2Im";

/// The `[H, W]` of a transposed convolution's output for an input plane `[hi, wi]`; `None`
/// when it is empty or the window would not fold `[hi, wi]` back from it (an
/// `output_padding` not below the stride).
pub fn folded_size(
    window: &Window2d,
    [hi, wi]: [usize; 2],
    output_padding: [usize; 2],
) -> Option<[usize; 2]> {
    // Checked throughout: the attributes come from the model file.
    let axis = |a: usize, size: usize| -> Option<usize> {
        let span = window.kernel[a]
            .checked_sub(1)?
            .checked_mul(window.dilations[a])?
            .checked_add(1)?;
        let full = window.strides[a]
            .checked_mul(size.checked_sub(1)?)?
            .checked_add(output_padding[a])?
            .checked_add(span)?;
        full.checked_sub(window.pads[a].checked_add(window.pads[a + 2])?)
            .filter(|&s| s > 0)
    };
    let folded = [axis(0, hi)?, axis(1, wi)?];
    (window.output(folded) == Some([hi, wi])).then_some(folded)
}

impl Unfolding {
    /// Folds one channel's columns `cols` (`taps` planes of `[Hi, Wi]`) into its plane `out`
    /// (`[H, W]`, the plane this unfolding was made for): zero, then every tap added in
    /// order, then `bias` to every element. Without the bias, the adjoint of
    /// [`Unfolding::plane`].
    pub fn fold(&self, cols: &[f32], out: &mut [f32], bias: Option<f32>) {
        let ([h, w], [ho, wo], [sh, sw]) = (self.hw, self.out, self.strides);
        let out = &mut out[..h * w];
        out.fill(0.0);
        for (tap, src) in self.taps.iter().zip(cols.chunks_exact(ho * wo)) {
            let ([y0, y1], [x0, x1]) = (tap.y, tap.x);
            if y0 >= y1 || x0 >= x1 {
                continue;
            }
            let n = x1 - x0;
            for (k, row) in src[y0 * wo..y1 * wo].chunks_exact(wo).enumerate() {
                let base = tap.first + k * sh * w;
                let row = &row[x0..x1];
                match sw {
                    1 => {
                        for (o, v) in out[base..base + n].iter_mut().zip(row) {
                            *o += v;
                        }
                    }
                    // The strided convolutions': indexed into a slice of the exact span,
                    // which the compiler checks once (an iterator `step_by` measured 1.4-1.6x
                    // the time, the ResNet-8's planes on one thread).
                    _ => {
                        let dst = &mut out[base..base + sw * (n - 1) + 1];
                        for (m, v) in row.iter().enumerate() {
                            dst[sw * m] += v;
                        }
                    }
                }
            }
        }
        if let Some(b) = bias {
            for o in out.iter_mut() {
                *o += b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn windows() -> Vec<(Window2d, [usize; 2])> {
        let window = |kernel, strides, pads, dilations| Window2d {
            kernel,
            strides,
            pads,
            dilations,
        };
        vec![
            // The ResNet-8's downsampling and its shortcut, both with an output padding.
            (window([3, 3], [2, 2], [1, 1, 1, 1], [1, 1]), [1, 1]),
            (window([1, 1], [2, 2], [0, 0, 0, 0], [1, 1]), [1, 1]),
            (window([3, 3], [1, 1], [1, 1, 1, 1], [1, 1]), [0, 0]),
            (window([3, 2], [2, 3], [0, 2, 1, 0], [1, 1]), [0, 2]),
            (window([2, 3], [3, 2], [2, 1, 0, 3], [2, 2]), [1, 0]),
            (window([4, 4], [2, 2], [1, 1, 1, 1], [1, 1]), [0, 0]),
        ]
    }

    /// Against the definition: each output element the sum of the taps that land on it,
    /// added in (i, j) order from zero, bit for bit.
    #[test]
    fn fold_adds_each_tap_in_order() {
        for (window, padding) in windows() {
            for hi_wi in [[3usize, 4usize], [5, 9]] {
                let Some([h, w]) = folded_size(&window, hi_wi, padding) else {
                    panic!("{window:?} {padding:?} folds {hi_wi:?}");
                };
                let [ho, wo] = hi_wi;
                let taps = window.taps();
                let cols: Vec<f32> = (0..taps * ho * wo)
                    .map(|v| ((v * 7919) % 997) as f32 * 1.3e-3 - 0.6)
                    .collect();
                let mut out = vec![f32::NAN; h * w];
                Unfolding::new(&window, [h, w])
                    .unwrap()
                    .fold(&cols, &mut out, None);
                let mut want = vec![0.0f32; h * w];
                for i in 0..window.kernel[0] {
                    for j in 0..window.kernel[1] {
                        for y in 0..ho {
                            for x in 0..wo {
                                let oy = (y * window.strides[0] + i * window.dilations[0]) as isize
                                    - window.pads[0] as isize;
                                let ox = (x * window.strides[1] + j * window.dilations[1]) as isize
                                    - window.pads[1] as isize;
                                if (0..h as isize).contains(&oy) && (0..w as isize).contains(&ox) {
                                    want[oy as usize * w + ox as usize] +=
                                        cols[((i * window.kernel[1] + j) * ho + y) * wo + x];
                                }
                            }
                        }
                    }
                }
                for (k, (g, e)) in out.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        e.to_bits(),
                        "{window:?} {hi_wi:?}: element {k}"
                    );
                }
            }
        }
    }

    /// The folding is the unfolding's adjoint: <unfold(x), c> = <x, fold(c)> (in float64
    /// on small integers, exactly).
    #[test]
    fn fold_is_the_adjoint_of_unfold() {
        for (window, padding) in windows() {
            let [h, w] = folded_size(&window, [4, 6], padding).unwrap();
            let unfolding = Unfolding::new(&window, [h, w]).unwrap();
            let x: Vec<f32> = (0..h * w).map(|v| (v % 7) as f32 - 3.0).collect();
            let c: Vec<f32> = (0..window.taps() * 24)
                .map(|v| (v % 5) as f32 - 2.0)
                .collect();
            let mut unfolded = vec![0.0; c.len()];
            unfolding.plane(&x, &mut unfolded);
            let mut folded = vec![0.0; x.len()];
            unfolding.fold(&c, &mut folded, None);
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(p, q)| *p as f64 * *q as f64).sum()
            };
            assert_eq!(dot(&unfolded, &c), dot(&x, &folded), "{window:?}");
        }
    }

    /// The output sizes of ONNX's ConvTranspose, and none where the output padding reaches
    /// the stride.
    #[test]
    fn folded_size_is_conv_transpose_output() {
        let (window, _) = windows()[0];
        assert_eq!(folded_size(&window, [16, 16], [1, 1]), Some([32, 32]));
        assert_eq!(folded_size(&window, [16, 16], [0, 0]), Some([31, 31]));
        assert_eq!(folded_size(&window, [16, 16], [2, 0]), None);
        assert_eq!(folded_size(&window, [0, 16], [0, 0]), None);
        let huge = Window2d {
            strides: [usize::MAX / 2, 2],
            ..window
        };
        assert_eq!(folded_size(&huge, [16, 16], [1, 1]), None);
    }
}
