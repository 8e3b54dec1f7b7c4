//! A stride-1 2-D convolution's weight gradient straight from X and dY, what the fused
//! `ConvWeightGrad` operator computes: the lowering (`passes/legalize/conv_grad.rs`) unfolds
//! X into its taps (`Im2Col`, `kh·kw` times X's size), multiplies each image's taps by its dY
//! (`MatMul`) and sums the images (`ReduceSum`). At the ResNet-8's 16-channel layers and
//! batch 32 the taps are 19 MB written and read back for 150 MFLOP of products: memory, not
//! arithmetic, sets the time. This reads X and dY once and keeps the taps in registers.
//!
//! ```text
//! ConvWeightGrad(X [N, C, H, W], dY [N, M, Ho, Wo]; kernel_shape [kh, kw], pads [t, l, b, r],
//!                dilations [dh, dw]; stride 1)  ->  dWᵀ [1, C·kh·kw, M]
//! dWᵀ[0, (c·kh + i)·kw + j, m] = Σ_n Σ_{y, x} dY[n, m, y, x] · X[n, c, y + i·dh - t, x + j·dw - l]
//!                                (0 outside X)
//! ```
//!
//! The layout is the lowering's `ReduceSum` output (one group), so the node replaces it and
//! the `Transpose`/`Reshape` to W's shape stay.
//!
//! How: X's plane is copied once per image and channel into a zero-padded plane of row
//! stride `S = W + l + r`, and each dY plane into rows of the same stride (zeros past `Wo`).
//! Then tap `(i, j)` is the padded plane read from offset `i·dh·S + j·dw`, and every output
//! is one dot product over the flattened planes: no bounds inside the loop, the padding's
//! zeros and dY's zero columns cancel what lies outside. The dot products run 16 lanes wide,
//! [`TAP_BLOCK`] taps by [`M_BLOCK`] output channels at a time (12 vector accumulators; each
//! loaded X vector serves 4 products, each dY vector 3), with fused multiply-adds where the
//! CPU has them.
//!
//! Not bit-identical to the lowering: the sums run per lane, then across lanes and images,
//! where the GEMM sums each image's positions and ReduceSum the images. Within float32
//! rounding of the definition (tests: against float64 sums).

/// The weight gradient on onnx-ga's kernel (see the module's comment).
pub const CONV_WEIGHT_GRAD: &str = "ConvWeightGrad";

/// Lanes of one vector accumulator: one AVX-512 register of float32.
const LANES: usize = 16;
/// Taps per block of the inner loop.
const TAP_BLOCK: usize = 3;
/// Output channels per block of the inner loop.
const M_BLOCK: usize = 4;

/// One stride-1 weight gradient's sizes and window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightGradShape {
    /// Images.
    pub n: usize,
    /// X's channels.
    pub c: usize,
    /// X's plane, `[H, W]`.
    pub plane: [usize; 2],
    /// dY's channels (W's outputs).
    pub m: usize,
    pub kernel: [usize; 2],
    /// `[top, left, bottom, right]`, ONNX's order.
    pub pads: [usize; 4],
    pub dilations: [usize; 2],
}

impl WeightGradShape {
    /// dY's plane `[Ho, Wo]`; `None` when the window does not fit once.
    pub fn output(&self) -> Option<[usize; 2]> {
        let axis = |a: usize, size: usize, pad: usize| {
            let span = self.kernel[a].checked_sub(1)? * self.dilations[a] + 1;
            (size + pad + 1).checked_sub(span).filter(|out| *out > 0)
        };
        Some([
            axis(0, self.plane[0], self.pads[0] + self.pads[2])?,
            axis(1, self.plane[1], self.pads[1] + self.pads[3])?,
        ])
    }

    pub fn taps(&self) -> usize {
        self.kernel[0] * self.kernel[1]
    }

    /// Rows of the output: `C·kh·kw`.
    pub fn rows(&self) -> usize {
        self.c * self.taps()
    }
}

/// The padded planes' geometry: what both copies and the dot products index.
#[derive(Clone, Copy, Debug)]
struct Padded {
    /// Row stride `S = W + l + r`.
    stride: usize,
    /// dY's flattened plane `Ho·S`, rounded up to whole vectors: every dot product's length.
    length: usize,
    /// A padded X plane's length: `length` plus the farthest tap's offset, whole vectors.
    x_length: usize,
    /// Each tap's offset into the padded X plane, in tap order.
    offsets: [usize; MAX_TAPS],
    ho: usize,
    wo: usize,
}

/// The most taps a kernel may have here (7×7 and smaller, or any kh·kw up to this).
pub const MAX_TAPS: usize = 64;

impl Padded {
    fn of(shape: &WeightGradShape) -> Option<Padded> {
        let [ho, wo] = shape.output()?;
        if shape.taps() > MAX_TAPS {
            return None;
        }
        let stride = shape.plane[1] + shape.pads[1] + shape.pads[3];
        let length = (ho * stride).div_ceil(LANES) * LANES;
        let mut offsets = [0; MAX_TAPS];
        for i in 0..shape.kernel[0] {
            for j in 0..shape.kernel[1] {
                offsets[i * shape.kernel[1] + j] =
                    i * shape.dilations[0] * stride + j * shape.dilations[1];
            }
        }
        let farthest = offsets[..shape.taps()].iter().copied().max().unwrap_or(0);
        Some(Padded {
            stride,
            length,
            x_length: (length + farthest).div_ceil(LANES) * LANES,
            offsets,
            ho,
            wo,
        })
    }
}

/// Copies dY's planes (`[N·M, Ho·Wo]`) into `out`, rows of the padded stride, zeros past
/// `Wo` and past `Ho` rows: `[N·M, length]`. Every element of `out` is written (it is a
/// buffer kept from an earlier call).
fn pad_dy(padded: &Padded, dy: &[f32], out: &mut Vec<f32>) {
    let plane = padded.ho * padded.wo;
    let planes = dy.len() / plane.max(1);
    out.resize(planes * padded.length, 0.0);
    for (src, dst) in dy
        .chunks_exact(plane)
        .zip(out.chunks_exact_mut(padded.length))
    {
        let (rows, tail) = dst.split_at_mut(padded.ho * padded.stride);
        for (row, dst_row) in src
            .chunks_exact(padded.wo)
            .zip(rows.chunks_exact_mut(padded.stride))
        {
            dst_row[..padded.wo].copy_from_slice(row);
            dst_row[padded.wo..].fill(0.0);
        }
        tail.fill(0.0);
    }
}

/// Copies one X plane `[H, W]` into `out` (`x_length`, zeroed before by the caller or left
/// zero where it was), at row `t` and column `l` of the padded stride.
fn pad_x(shape: &WeightGradShape, padded: &Padded, x: &[f32], out: &mut [f32]) {
    let [_, w] = shape.plane;
    let (top, left) = (shape.pads[0], shape.pads[1]);
    for (r, row) in x.chunks_exact(w).enumerate() {
        let start = (r + top) * padded.stride + left;
        out[start..start + w].copy_from_slice(row);
    }
}

/// dWᵀ for the output rows of channels `channels` (`out`: their rows, `[len · taps, M]`),
/// from `x` (all of X) and `dy_padded` ([`pad_dy`] of all of dY).
fn channels_grad(
    shape: &WeightGradShape,
    padded: &Padded,
    x: &[f32],
    dy_padded: &[f32],
    channels: std::ops::Range<usize>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above).
            return unsafe { channels_grad_avx512(shape, padded, x, dy_padded, channels, out) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { channels_grad_avx2(shape, padded, x, dy_padded, channels, out) };
        }
    }
    channels_grad_body::<false>(shape, padded, x, dy_padded, channels, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn channels_grad_avx512(
    shape: &WeightGradShape,
    padded: &Padded,
    x: &[f32],
    dy_padded: &[f32],
    channels: std::ops::Range<usize>,
    out: &mut [f32],
) {
    channels_grad_body::<true>(shape, padded, x, dy_padded, channels, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn channels_grad_avx2(
    shape: &WeightGradShape,
    padded: &Padded,
    x: &[f32],
    dy_padded: &[f32],
    channels: std::ops::Range<usize>,
    out: &mut [f32],
) {
    channels_grad_body::<true>(shape, padded, x, dy_padded, channels, out)
}

#[inline(always)]
fn channels_grad_body<const FMA: bool>(
    shape: &WeightGradShape,
    padded: &Padded,
    x: &[f32],
    dy_padded: &[f32],
    channels: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (taps, m) = (shape.taps(), shape.m);
    let in_plane = shape.plane[0] * shape.plane[1];
    // Images per block: enough that a block's dot products are long (small planes would
    // otherwise load and store the accumulators every few vectors).
    let images = (BLOCK_LENGTH / padded.length).clamp(1, shape.n.max(1));
    // Lane-wise sums over the images: [channel, tap, m][lane].
    let mut sums = vec![[0f32; LANES]; channels.len() * taps * m];
    let mut x_padded = vec![0f32; images * padded.x_length];
    for n0 in (0..shape.n).step_by(images) {
        let count = images.min(shape.n - n0);
        let dy_images = &dy_padded[n0 * m * padded.length..(n0 + count) * m * padded.length];
        for (k, c) in channels.clone().enumerate() {
            for (i, dst) in x_padded
                .chunks_exact_mut(padded.x_length)
                .take(count)
                .enumerate()
            {
                let plane = &x[((n0 + i) * shape.c + c) * in_plane..][..in_plane];
                pad_x(shape, padded, plane, dst);
            }
            let sums = &mut sums[k * taps * m..(k + 1) * taps * m];
            for t0 in (0..taps).step_by(TAP_BLOCK) {
                let tb = TAP_BLOCK.min(taps - t0);
                for m0 in (0..m).step_by(M_BLOCK) {
                    let mb = M_BLOCK.min(m - m0);
                    let block = Block {
                        x: &x_padded,
                        x_length: padded.x_length,
                        offsets: &padded.offsets[t0..t0 + tb],
                        dy: dy_images,
                        length: padded.length,
                        images: count,
                        m,
                        m0,
                    };
                    match (tb, mb) {
                        (3, 4) => block.run::<3, 4, FMA>(sums, t0),
                        (3, mb) => block.run_m::<3, FMA>(mb, sums, t0),
                        (2, mb) => block.run_m::<2, FMA>(mb, sums, t0),
                        (_, mb) => block.run_m::<1, FMA>(mb, sums, t0),
                    }
                }
            }
        }
    }
    for (row, lanes) in out.iter_mut().zip(&sums) {
        *row = lanes.iter().sum();
    }
}

/// The fewest elements one block's dot products run over (images times plane), where the
/// batch has them.
const BLOCK_LENGTH: usize = 1024;

/// One block of the dot products: taps `offsets` against output channels `m0..m0 + MB`,
/// over `images` images.
struct Block<'a> {
    /// The images' padded X planes of one channel, `[images, x_length]`.
    x: &'a [f32],
    x_length: usize,
    offsets: &'a [usize],
    /// The images' padded dY planes, `[images, M, length]`.
    dy: &'a [f32],
    length: usize,
    images: usize,
    m: usize,
    m0: usize,
}

impl Block<'_> {
    /// `run` with the block's channel count known only at run time (the last block).
    #[inline(always)]
    fn run_m<const TB: usize, const FMA: bool>(
        &self,
        mb: usize,
        sums: &mut [[f32; LANES]],
        t0: usize,
    ) {
        match mb {
            4 => self.run::<TB, 4, FMA>(sums, t0),
            3 => self.run::<TB, 3, FMA>(sums, t0),
            2 => self.run::<TB, 2, FMA>(sums, t0),
            _ => self.run::<TB, 1, FMA>(sums, t0),
        }
    }

    /// Adds the block's dot products, lane by lane, into `sums` (`[tap, m][lane]` of one
    /// channel).
    #[inline(always)]
    fn run<const TB: usize, const MB: usize, const FMA: bool>(
        &self,
        sums: &mut [[f32; LANES]],
        t0: usize,
    ) {
        let (len, m) = (self.length, self.m);
        let mut acc = [[[0f32; LANES]; MB]; TB];
        for (t, row) in acc.iter_mut().enumerate() {
            for (b, lanes) in row.iter_mut().enumerate() {
                *lanes = sums[(t0 + t) * m + self.m0 + b];
            }
        }
        for image in 0..self.images {
            let x = &self.x[image * self.x_length..][..self.x_length];
            let dy = &self.dy[image * m * len..][..m * len];
            let xs: [&[f32]; TB] = std::array::from_fn(|t| &x[self.offsets[t]..][..len]);
            let dys: [&[f32]; MB] = std::array::from_fn(|b| &dy[(self.m0 + b) * len..][..len]);
            let vectors = len / LANES;
            for v in 0..vectors {
                let at = v * LANES;
                let mut g = [[0f32; LANES]; MB];
                for b in 0..MB {
                    // SAFETY: at + LANES <= vectors·LANES <= len, each slice's length.
                    g[b] = unsafe { *(dys[b].as_ptr().add(at) as *const [f32; LANES]) };
                }
                for t in 0..TB {
                    // SAFETY: as for g.
                    let xv = unsafe { *(xs[t].as_ptr().add(at) as *const [f32; LANES]) };
                    for b in 0..MB {
                        for l in 0..LANES {
                            acc[t][b][l] = if FMA {
                                xv[l].mul_add(g[b][l], acc[t][b][l])
                            } else {
                                xv[l] * g[b][l] + acc[t][b][l]
                            };
                        }
                    }
                }
            }
        }
        for (t, row) in acc.iter().enumerate() {
            for (b, lanes) in row.iter().enumerate() {
                sums[(t0 + t) * m + self.m0 + b] = *lanes;
            }
        }
    }
}

/// Output channels of X per task of [`conv_weight_grad`]'s pool.
pub const CHANNELS_PER_TASK: usize = 1;

/// The whole weight gradient, `out` = dWᵀ `[C·kh·kw, M]`, channels' rows computed by
/// `run_tasks(tasks, task)` (the caller's thread pool: each task writes only its own rows).
/// `None` when the shapes do not fit `shape` (the caller says so).
pub fn conv_weight_grad(
    shape: &WeightGradShape,
    x: &[f32],
    dy: &[f32],
    out: &mut [f32],
    run_tasks: impl FnOnce(usize, &(dyn Fn(usize) + Sync)),
) -> Option<()> {
    let padded = Padded::of(shape)?;
    let in_plane = shape.plane[0] * shape.plane[1];
    let out_plane = padded.ho * padded.wo;
    if x.len() != shape.n * shape.c * in_plane
        || dy.len() != shape.n * shape.m * out_plane
        || out.len() != shape.rows() * shape.m
    {
        return None;
    }
    if out.is_empty() {
        return Some(());
    }
    DY_PADDED.with(|buffer| {
        let mut dy_padded = buffer.borrow_mut();
        pad_dy(&padded, dy, &mut dy_padded);
        let dy_padded: &[f32] = &dy_padded;
        let per_channel = shape.taps() * shape.m;
        let tasks: Vec<std::sync::Mutex<Option<&mut [f32]>>> = out
            .chunks_mut(CHANNELS_PER_TASK * per_channel)
            .map(|rows| std::sync::Mutex::new(Some(rows)))
            .collect();
        let task = |k: usize| {
            let Ok(Some(rows)) = tasks[k].lock().map(|mut r| r.take()) else {
                return;
            };
            let first = k * CHANNELS_PER_TASK;
            let channels = first..first + rows.len() / per_channel;
            channels_grad(shape, &padded, x, dy_padded, channels, rows);
        };
        run_tasks(tasks.len(), &task);
    });
    Some(())
}

thread_local! {
    /// dY padded ([`pad_dy`]), kept from call to call: megabytes at batch 32, which a fresh
    /// allocation would fault in page by page each time.
    static DY_PADDED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition in float64.
    fn reference(shape: &WeightGradShape, x: &[f32], dy: &[f32]) -> Vec<f64> {
        let [ho, wo] = shape.output().unwrap();
        let [h, w] = shape.plane;
        let [kh, kw] = shape.kernel;
        let mut out = vec![0f64; shape.rows() * shape.m];
        for n in 0..shape.n {
            for c in 0..shape.c {
                for i in 0..kh {
                    for j in 0..kw {
                        for m in 0..shape.m {
                            let mut s = 0f64;
                            for y in 0..ho {
                                for xo in 0..wo {
                                    let iy = (y + i * shape.dilations[0]) as isize
                                        - shape.pads[0] as isize;
                                    let ix = (xo + j * shape.dilations[1]) as isize
                                        - shape.pads[1] as isize;
                                    if (0..h as isize).contains(&iy)
                                        && (0..w as isize).contains(&ix)
                                    {
                                        let xv = x[((n * shape.c + c) * h + iy as usize) * w
                                            + ix as usize];
                                        let g = dy[((n * shape.m + m) * ho + y) * wo + xo];
                                        s += xv as f64 * g as f64;
                                    }
                                }
                            }
                            out[((c * kh + i) * kw + j) * shape.m + m] += s;
                        }
                    }
                }
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let v = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8;
                (v % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Against the float64 definition, on geometries that exercise every block size, uneven
    /// pads, dilation and planes narrower than a vector.
    #[test]
    fn weight_gradient_is_the_definition() {
        let shapes = [
            (2, 3, [7, 9], 5, [3, 3], [1, 1, 1, 1], [1, 1]),
            (3, 2, [6, 5], 7, [3, 2], [2, 0, 1, 1], [1, 2]),
            (1, 4, [20, 18], 4, [3, 3], [1, 1, 1, 1], [1, 1]),
            (2, 1, [4, 4], 3, [1, 1], [0, 0, 0, 0], [1, 1]),
            (2, 2, [5, 6], 9, [2, 3], [0, 2, 1, 0], [2, 1]),
        ];
        for (n, c, plane, m, kernel, pads, dilations) in shapes {
            let shape = WeightGradShape {
                n,
                c,
                plane,
                m,
                kernel,
                pads,
                dilations,
            };
            let [ho, wo] = shape.output().unwrap();
            let x = values(n * c * plane[0] * plane[1], 7);
            let dy = values(n * m * ho * wo, 13);
            let mut out = vec![f32::NAN; shape.rows() * m];
            conv_weight_grad(&shape, &x, &dy, &mut out, |count, task| {
                (0..count).for_each(task)
            })
            .unwrap();
            let want = reference(&shape, &x, &dy);
            let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
            for (k, (got, want)) in out.iter().zip(&want).enumerate() {
                let gap = (*got as f64 - want).abs() / scale;
                assert!(gap < 1e-6, "{shape:?} element {k}: {got} vs {want}");
            }
        }
    }

    /// Sizes that do not match the shape are refused, not read out of bounds.
    #[test]
    fn mismatched_sizes_are_refused() {
        let shape = WeightGradShape {
            n: 1,
            c: 1,
            plane: [4, 4],
            m: 1,
            kernel: [3, 3],
            pads: [1, 1, 1, 1],
            dilations: [1, 1],
        };
        let mut out = vec![0f32; 9];
        let ran = conv_weight_grad(&shape, &[0.0; 15], &[0.0; 16], &mut out, |count, task| {
            (0..count).for_each(task)
        });
        assert!(ran.is_none());
    }
}
