//! The unfolding of a 2-D convolution's input (im2col), what the fused `Im2Col` operator
//! computes: the `Conv` with identity filters that the weight-gradient lowering writes
//! (`passes/legalize/conv_grad.rs`, `unfold`) is a copy, run as a grouped convolution
//! (per channel an unfolding and a GEMM by the identity: every tap written twice and
//! multiplied). This writes each tap once.
//!
//! ```text
//! Im2Col(X [N, C, H, W]; kernel_shape [kh, kw], strides, pads [t, l, b, r], dilations)
//!   -> cols [N, C·kh·kw, Ho, Wo]
//! cols[n, (c·kh + i)·kw + j, y, x] = X[n, c, y·sh + i·dh - t, x·sw + j·dw - l]   (0 outside X)
//! Ho = (H + t + b - ((kh - 1)·dh + 1)) / sh + 1, and Wo alike
//! ```
//!
//! The same numbers as the convolution for finite inputs, bit for bit: there each output is
//! `1 · x` plus zeros. (The convolution turns an infinity into NaN, by `0 · inf` at the
//! other taps, and -0 into +0; the copy keeps both.)

/// The unfolding on onnx-ga's kernel (see the module's comment).
pub const IM2COL: &str = "Im2Col";

/// One 2-D convolution's window geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window2d {
    pub kernel: [usize; 2],
    pub strides: [usize; 2],
    /// `[top, left, bottom, right]`, ONNX's order.
    pub pads: [usize; 4],
    pub dilations: [usize; 2],
}

impl Window2d {
    /// The output's `[Ho, Wo]` for an input plane `[h, w]`; `None` when the window does not
    /// fit once.
    pub fn output(&self, [h, w]: [usize; 2]) -> Option<[usize; 2]> {
        let axis = |size: usize, a: usize, pad: usize| {
            let span = (self.kernel[a].checked_sub(1)?) * self.dilations[a] + 1;
            let padded = size + pad;
            (padded >= span && self.strides[a] > 0).then(|| (padded - span) / self.strides[a] + 1)
        };
        Some([
            axis(h, 0, self.pads[0] + self.pads[2])?,
            axis(w, 1, self.pads[1] + self.pads[3])?,
        ])
    }

    pub fn taps(&self) -> usize {
        self.kernel[0] * self.kernel[1]
    }
}

/// Unfolds one channel plane `x` (`[h, w]`) into `out`, its `taps` output planes of
/// `[Ho, Wo]` each, in tap order.
pub fn im2col_plane(window: &Window2d, x: &[f32], [h, w]: [usize; 2], out: &mut [f32]) {
    let Some([ho, wo]) = window.output([h, w]) else {
        return;
    };
    let plane = ho * wo;
    let [kh, kw] = window.kernel;
    let [sh, sw] = window.strides;
    let [dh, dw] = window.dilations;
    let (top, left) = (window.pads[0] as isize, window.pads[1] as isize);
    for i in 0..kh {
        for j in 0..kw {
            let tap = i * kw + j;
            let Some(dst) = out.get_mut(tap * plane..(tap + 1) * plane) else {
                return;
            };
            // The output columns whose input column lies inside X: [x0, x1).
            let column = |x: usize| x as isize * sw as isize + (j * dw) as isize - left;
            let x0 = (0..wo).find(|&x| column(x) >= 0).unwrap_or(wo);
            let x1 = (x0..wo).find(|&x| column(x) >= w as isize).unwrap_or(wo);
            for (y, row) in dst.chunks_exact_mut(wo).enumerate() {
                let iy = y as isize * sh as isize + (i * dh) as isize - top;
                if iy < 0 || iy >= h as isize {
                    row.fill(0.0);
                    continue;
                }
                let src = &x[iy as usize * w..(iy as usize + 1) * w];
                row[..x0].fill(0.0);
                row[x1..].fill(0.0);
                if sw == 1 {
                    let start = column(x0) as usize;
                    row[x0..x1].copy_from_slice(&src[start..start + (x1 - x0)]);
                } else {
                    for (x, out) in (x0..x1).zip(row[x0..x1].iter_mut()) {
                        *out = src[column(x) as usize];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the definition, element by element, with strides, uneven pads and dilation.
    #[test]
    fn plane_unfolds_by_the_definition() {
        let (h, w) = (5usize, 7usize);
        let x: Vec<f32> = (0..h * w).map(|v| v as f32 + 1.0).collect();
        let windows = [
            Window2d {
                kernel: [3, 3],
                strides: [1, 1],
                pads: [1, 1, 1, 1],
                dilations: [1, 1],
            },
            Window2d {
                kernel: [3, 2],
                strides: [2, 3],
                pads: [0, 2, 1, 0],
                dilations: [1, 1],
            },
            Window2d {
                kernel: [2, 3],
                strides: [1, 2],
                pads: [2, 1, 0, 3],
                dilations: [2, 2],
            },
        ];
        for window in windows {
            let [ho, wo] = window.output([h, w]).unwrap();
            let mut out = vec![f32::NAN; window.taps() * ho * wo];
            im2col_plane(&window, &x, [h, w], &mut out);
            for i in 0..window.kernel[0] {
                for j in 0..window.kernel[1] {
                    for y in 0..ho {
                        for xo in 0..wo {
                            let iy = (y * window.strides[0] + i * window.dilations[0]) as isize
                                - window.pads[0] as isize;
                            let ix = (xo * window.strides[1] + j * window.dilations[1]) as isize
                                - window.pads[1] as isize;
                            let inside =
                                (0..h as isize).contains(&iy) && (0..w as isize).contains(&ix);
                            let want = if inside {
                                x[iy as usize * w + ix as usize]
                            } else {
                                0.0
                            };
                            let got = out[((i * window.kernel[1] + j) * ho + y) * wo + xo];
                            assert_eq!(got, want, "{window:?} tap ({i}, {j}) at ({y}, {xo})");
                        }
                    }
                }
            }
        }
    }
}
