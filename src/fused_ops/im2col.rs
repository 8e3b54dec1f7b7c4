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
        // Checked: the attributes come from the model file.
        let axis = |size: usize, a: usize| {
            let span = self.kernel[a]
                .checked_sub(1)?
                .checked_mul(self.dilations[a])?
                .checked_add(1)?;
            let padded = size
                .checked_add(self.pads[a])?
                .checked_add(self.pads[a + 2])?;
            (padded >= span && self.strides[a] > 0).then(|| (padded - span) / self.strides[a] + 1)
        };
        Some([axis(h, 0)?, axis(w, 1)?])
    }

    pub fn taps(&self) -> usize {
        self.kernel[0] * self.kernel[1]
    }
}

/// How each tap of a window reads a plane of a given size: worked out once per node, since
/// a plane of a small image is unfolded in about as long as it takes to work out (the
/// ResNet-8's 8x8 planes: 64 elements a tap).
#[derive(Clone, Debug)]
pub struct Unfolding {
    pub(super) hw: [usize; 2],
    pub(super) out: [usize; 2],
    pub(super) strides: [usize; 2],
    pub(super) taps: Vec<Tap>,
}

/// One tap: the output rows `[y0, y1)` and columns `[x0, x1)` that read inside X, and the
/// input element read by output `(y0, x0)`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tap {
    pub(super) y: [usize; 2],
    pub(super) x: [usize; 2],
    pub(super) first: usize,
}

impl Unfolding {
    /// `None` when the window does not fit a plane of `[h, w]`.
    pub fn new(window: &Window2d, [h, w]: [usize; 2]) -> Option<Unfolding> {
        let [ho, wo] = window.output([h, w])?;
        let [kh, kw] = window.kernel;
        let [sh, sw] = window.strides;
        let [dh, dw] = window.dilations;
        let (top, left) = (window.pads[0] as isize, window.pads[1] as isize);
        let mut taps = Vec::with_capacity(kh * kw);
        for i in 0..kh {
            for j in 0..kw {
                let column = |x: usize| x as isize * sw as isize + (j * dw) as isize - left;
                let row = |y: usize| y as isize * sh as isize + (i * dh) as isize - top;
                let x0 = (0..wo).find(|&x| column(x) >= 0).unwrap_or(wo);
                let x1 = (x0..wo).find(|&x| column(x) >= w as isize).unwrap_or(wo);
                let y0 = (0..ho).find(|&y| row(y) >= 0).unwrap_or(ho);
                let y1 = (y0..ho).find(|&y| row(y) >= h as isize).unwrap_or(ho);
                let first = match y0 < y1 && x0 < x1 {
                    true => row(y0) as usize * w + column(x0) as usize,
                    false => 0,
                };
                taps.push(Tap {
                    y: [y0, y1],
                    x: [x0, x1],
                    first,
                });
            }
        }
        Some(Unfolding {
            hw: [h, w],
            out: [ho, wo],
            strides: [sh, sw],
            taps,
        })
    }

    /// Unfolds one plane `x` into `out` (`taps` planes of `[Ho, Wo]`).
    pub fn plane(&self, x: &[f32], out: &mut [f32]) {
        let ([h, w], [ho, wo], [sh, sw]) = (self.hw, self.out, self.strides);
        let x = &x[..(h * w).min(x.len())];
        let plane = ho * wo;
        // Rows that keep their width (unit strides) are, inside X, one run of X shifted by
        // the tap's offset: one copy, then the columns that wrapped into a neighbouring row
        // are zeroed. Short rows copied one by one cost more in setup than in bytes.
        let one_run = sh == 1 && sw == 1 && wo == w;
        for (tap, dst) in self.taps.iter().zip(out.chunks_exact_mut(plane)) {
            let ([y0, y1], [x0, x1]) = (tap.y, tap.x);
            dst[..y0 * wo].fill(0.0);
            dst[y1 * wo..].fill(0.0);
            let inside = &mut dst[y0 * wo..y1 * wo];
            if inside.is_empty() {
                continue;
            }
            if x0 == x1 {
                inside.fill(0.0);
                continue;
            }
            if one_run {
                // inside[k] = x[start + k] with start = first - x0; what falls before or
                // after X lies in columns outside [x0, x1), zeroed below with the others.
                let start = tap.first as isize - x0 as isize;
                let lo = (-start).clamp(0, inside.len() as isize) as usize;
                let hi =
                    (x.len() as isize - start).clamp(lo as isize, inside.len() as isize) as usize;
                let from = (start + lo as isize) as usize;
                inside[..lo].fill(0.0);
                inside[hi..].fill(0.0);
                inside[lo..hi].copy_from_slice(&x[from..from + (hi - lo)]);
                if x0 > 0 || x1 < wo {
                    for r in inside.chunks_exact_mut(wo) {
                        zero_edges(r, x0, x1);
                    }
                }
                continue;
            }
            let n = x1 - x0;
            for (k, r) in inside.chunks_exact_mut(wo).enumerate() {
                let base = tap.first + k * sh * w;
                zero_edges(r, x0, x1);
                let r = &mut r[x0..x1];
                match sw {
                    1 => r.copy_from_slice(&x[base..base + n]),
                    // The downsampling convolutions'. Long rows by pairs, so that the
                    // compiler deinterleaves whole vectors (the last pair may end past the
                    // row); short ones (8 in the ResNet-8) measured faster element by element.
                    2 if n >= 12 => {
                        let row_end = (base / w + 1) * w;
                        let pairs = &x[base..(base + 2 * n).min(row_end)];
                        let (body, last) = r.split_at_mut(pairs.len() / 2);
                        for (o, pair) in body.iter_mut().zip(pairs.chunks_exact(2)) {
                            *o = pair[0];
                        }
                        if let Some(o) = last.first_mut() {
                            *o = pairs[pairs.len() - 1];
                        }
                    }
                    2 => {
                        let src = &x[base..];
                        for (k, o) in r.iter_mut().enumerate() {
                            *o = src[2 * k];
                        }
                    }
                    _ => {
                        for (o, v) in r.iter_mut().zip(x[base..].iter().step_by(sw)) {
                            *o = *v;
                        }
                    }
                }
            }
        }
    }
}

/// Zeroes a row's columns outside `[x0, x1)`: one or none on each side for the usual pads,
/// written directly rather than through a fill call per row.
#[inline]
fn zero_edges(r: &mut [f32], x0: usize, x1: usize) {
    match x0 {
        0 => {}
        1 => r[0] = 0.0,
        _ => r[..x0].fill(0.0),
    }
    match r.len() - x1 {
        0 => {}
        1 => r[x1] = 0.0,
        _ => r[x1..].fill(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the definition, element by element, with strides, uneven pads and dilation.
    #[test]
    fn plane_unfolds_by_the_definition() {
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
            // Rows that keep their width (one copy per tap): uneven pads, dilation, a 1x1,
            // a window taller than X, and the ResNet-8's stride 2.
            Window2d {
                kernel: [3, 3],
                strides: [1, 1],
                pads: [0, 2, 2, 0],
                dilations: [1, 1],
            },
            Window2d {
                kernel: [3, 3],
                strides: [1, 1],
                pads: [2, 2, 2, 2],
                dilations: [2, 2],
            },
            Window2d {
                kernel: [1, 1],
                strides: [1, 1],
                pads: [0, 0, 0, 0],
                dilations: [1, 1],
            },
            Window2d {
                kernel: [7, 3],
                strides: [1, 1],
                pads: [3, 1, 3, 1],
                dilations: [1, 1],
            },
            Window2d {
                kernel: [3, 3],
                strides: [2, 2],
                pads: [1, 1, 1, 1],
                dilations: [1, 1],
            },
        ];
        // Planes of 7 columns, and of 32 (stride-2 rows long enough to go by pairs, one
        // whose last pair ends past the row).
        for ((h, w), window) in [(5usize, 7usize), (6, 32)]
            .into_iter()
            .flat_map(|hw| windows.iter().map(move |window| (hw, *window)))
        {
            let x: Vec<f32> = (0..h * w).map(|v| v as f32 + 1.0).collect();
            let [ho, wo] = window.output([h, w]).unwrap();
            let mut out = vec![f32::NAN; window.taps() * ho * wo];
            Unfolding::new(&window, [h, w]).unwrap().plane(&x, &mut out);
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
