//! A weight gradient made inside its accumulator, what the fused `AccumulateProduct`
//! operator computes where the step writes `Add(acc, Gemm(A, B, transA = 1))`: a linear
//! layer's weight gradient `Aᵀ·B` (`A` the layer's output gradient and `B` its input, or the
//! other way round; `k` rows each, the micro-batch) added to the window's sum.
//!
//! ```text
//! AccumulateProduct(acc [m, n], A [k, m], B [k, n], [keep], [loss]) -> acc' [m, n]
//! s_ij  = fma(A[k-1,i], B[k-1,j], ... fma(A[1,i], B[1,j], fma(A[0,i], B[0,j], +0)))
//! acc'_ij = acc_ij + s_ij          (with `overwrites`: acc'_ij = s_ij, acc not read)
//! ```
//!
//! Why: the standard ops write the gradient, then read it back beside the accumulator and
//! write the accumulator. With the small `k` that gradient accumulation is for, the product
//! is a rank-k update that costs about its output's bytes, so the gradient pass and the
//! accumulation's are the same size: made in the accumulator, the gradient is never
//! written (the 1.9M-parameter MLP at B 8, one thread: a micro-step that only accumulates
//! went from 1.33 to 1.06x the gradient graph's time; benches/README.md, "Run X").
//!
//! The order is ONNX Runtime's own: MLAS's SGEMM runs one fused multiply-add chain along
//! `k` from zero for `k` up to 128 (measured against it element by element), and the
//! accumulation adds the product to the accumulator; so a fused step gives the standard
//! step's bits. This kernel takes `k` up to [`largest_fast_contraction`], where it beats
//! MLAS plus the accumulation; above it (or without AVX2 and FMA) the operator has ONNX
//! Runtime's own `Gemm` make the product, and adds it (`engine::ort_ops`): the standard op's
//! bits again.

use super::Io;

/// The fused operator (see the module's comment).
pub const ACCUMULATE_PRODUCT: &str = "AccumulateProduct";

/// The string attribute naming the node's accumulator (its state input), under which a
/// trainer that keeps products until the window needs them (`engine::deferred_products`)
/// keeps this node's.
pub const ACCUMULATOR: &str = "accumulator";

/// The int attribute that, at 1, makes the node's output the product alone, its
/// accumulator input not read (`s_ij`, written as ONNX Runtime's `Gemm` writes it): the
/// window-start specialisation's weight gradients (`train::window_start`), whose
/// accumulators hold nothing yet, made by the kernel so that a trainer may keep them too.
pub const OVERWRITES: &str = "overwrites";

/// Input slots of [`ACCUMULATE_PRODUCT`].
pub mod accumulate_product_slot {
    pub const ACC: usize = 0;
    /// `[k, m]`: its column `i` multiplies row `i` of the accumulator.
    pub const A: usize = 1;
    /// `[k, n]`.
    pub const B: usize = 2;
    /// The gate ([`super::super::keeps`]).
    pub const KEEP: usize = 3;
    pub const LOSS: usize = crate::fused_ops::loss_slot(KEEP);
    /// Ordering inputs from here on (see [`super::super`]'s comment).
    pub const AFTER: usize = 5;
    pub const COUNT: usize = 5;
}

/// Tasks that split the accumulator at multiples of this many rows keep every tile of the
/// kernel full and on A's panels (a multiple of both widths' tile rows).
pub const TASK_ROWS: usize = AVX512_TILE_ROWS;

/// The largest `k` the kernel takes on AVX-512. Measured (one thread, the accumulator out of
/// L2, a 1024 x 1024 weight; benches/README.md, "Run X"): at `k` = 8 the fused update costs
/// 0.22 ms against MLAS's product (0.20) plus the accumulation (0.31), at 32 0.61 against
/// 0.41 + 0.31; from about 48 MLAS's faster product wins.
const AVX512_CONTRACTION: usize = 32;

/// The largest `k` the kernel takes on AVX2. Measured on an AVX2-only CPU (AMD EPYC, Zen 3;
/// benches/README.md, "Run AL"), the realistic MLP's step against its gradient graph, one
/// and two threads: at B 32 the accumulating micro-steps 1.10-1.16x with ONNX Runtime's
/// product and an added pass, 0.97-1.02x on the kernel; at B 48 and 64 the window 1.10-1.16x
/// against 1.08-1.12x on the kernel (with the products kept, `engine::deferred_products`).
/// Past 64 not measured. (Until then it was 16, a guess from run X's AVX-512 CPU, where the
/// kernel's AVX2 form ran at 44-64 GFLOP/s.)
const AVX2_CONTRACTION: usize = 64;

/// The shapes of one product: `A` is `[k, m]`, `B` `[k, n]`, the accumulator `[m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProductShape {
    pub k: usize,
    pub m: usize,
    pub n: usize,
}

/// The largest `k` for which this CPU's form of the kernel beats ONNX Runtime's product plus
/// the accumulation: AVX-512 or AVX2, each with FMA; 0 without (the portable loop gives the
/// same bits, slower).
pub fn largest_fast_contraction() -> usize {
    match fast_lanes() {
        Some(16) => AVX512_CONTRACTION,
        Some(_) => AVX2_CONTRACTION,
        None => 0,
    }
}

/// The vector width of the kernel's fastest form on this CPU (`None`: the portable loop).
fn fast_lanes() -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        let fma = std::is_x86_feature_detected!("fma");
        if fma && std::is_x86_feature_detected!("avx512f") {
            return Some(16);
        }
        if fma && std::is_x86_feature_detected!("avx2") {
            return Some(8);
        }
    }
    None
}

/// `acc' = acc + Aᵀ·B` for the accumulator's rows `first_row..` that `io` holds (whole rows
/// of `shape.n`), in the order of the module's comment. Tasks that each take some rows of
/// one product share a [`ProductOperands`] instead, and a caller that runs many products
/// keeps a [`ProductLayout`] for them.
pub fn accumulate_product(
    a: &[f32],
    b: &[f32],
    shape: ProductShape,
    first_row: usize,
    io: Io<'_, 1>,
) {
    ProductLayout::default()
        .operands(a, b, shape)
        .accumulate(first_row, io)
}

/// The memory [`ProductOperands`] lays `A` and `B` out in, kept by the caller from one
/// product to the next: the layouts are a few hundred KiB, which the allocator may hand
/// back as fresh pages, to be faulted in, on every run (the operator keeps one per thread,
/// as `ConvWeightGrad` keeps its columns).
#[derive(Default)]
pub struct ProductLayout {
    /// `B` in the blocks the kernel reads ([`pack_blocks`]).
    blocks: Lines,
    /// `A` in the panels the kernel reads ([`pack_panels`]).
    panels: Lines,
}

/// Kept memory that hands out runs starting on a cache line: the kernel loads B's blocks
/// whole vectors at a time, and a 64-byte vector from a line's start is one line, where
/// from the 16-byte start an allocation guarantees it is two. (No change measured in the
/// kernel's bench, where both were misaligned and aligned by turns; benches/README.md,
/// "Run AJ".)
#[derive(Default)]
struct Lines {
    memory: Vec<f32>,
    start: usize,
    len: usize,
}

/// The floats of a cache line.
const LINE: usize = 64 / std::mem::size_of::<f32>();

impl Lines {
    /// `len` floats from a line's start, to be written over (what the memory held before
    /// is left in them).
    fn on_line(&mut self, len: usize) -> &mut [f32] {
        // Kept memory is written once, by the caller: only what it lacks is zeroed first.
        self.memory.truncate(len + LINE);
        self.memory.resize(len + LINE, 0.0);
        self.start = self.memory.as_ptr().align_offset(64).min(LINE);
        self.len = len;
        &mut self.memory[self.start..self.start + len]
    }

    fn as_slice(&self) -> &[f32] {
        &self.memory[self.start..self.start + self.len]
    }

    fn clear(&mut self) {
        self.len = 0;
    }
}

impl ProductLayout {
    /// `A` and `B` laid out for this CPU's kernel in this memory (the portable loop reads
    /// them in place).
    ///
    /// # Panics
    /// When `a` is not `k x m` or `b` not `k x n` elements.
    pub fn operands<'a>(
        &'a mut self,
        a: &'a [f32],
        b: &'a [f32],
        shape: ProductShape,
    ) -> ProductOperands<'a> {
        let ProductShape { k, m, n } = shape;
        assert!(
            a.len() == k * m && b.len() == k * n,
            "AccumulateProduct: A {} and B {} elements for {shape:?}",
            a.len(),
            b.len(),
        );
        let lanes = fast_lanes();
        match lanes {
            Some(16) => self.lay_out::<AVX512_BLOCK_COLUMNS, AVX512_TILE_ROWS>(a, b, shape),
            Some(_) => self.lay_out::<AVX2_BLOCK_COLUMNS, AVX2_TILE_ROWS>(a, b, shape),
            None => {
                self.blocks.clear();
                self.panels.clear();
            }
        }
        ProductOperands {
            a,
            b,
            shape,
            lanes,
            packed: self.blocks.as_slice(),
            panels: self.panels.as_slice(),
        }
    }

    /// B in blocks of `COLUMNS` (the kernel's two vectors), A in panels of `ROWS` (its
    /// tile's) where `k` is above [`A_IN_PLACE_UP_TO_K`].
    fn lay_out<const COLUMNS: usize, const ROWS: usize>(
        &mut self,
        a: &[f32],
        b: &[f32],
        shape: ProductShape,
    ) {
        pack_blocks::<COLUMNS>(b, shape, &mut self.blocks);
        match shape.k > A_IN_PLACE_UP_TO_K {
            true => pack_panels::<ROWS>(a, shape, &mut self.panels),
            false => self.panels.clear(),
        }
    }
}

/// The two operands of one product, `B` laid out for the kernel once: the tasks that add it
/// into their rows of the accumulator all read the one layout. (Laid out per task, the
/// MLP's 1024-row weight gradients at k 32 were packed 13 and 16 times a run, an allocation
/// of 100-128 KiB each: their kernels ran 707 and 814 µs in the session against 445 and 573
/// alone; benches/README.md, "Run AI".)
pub struct ProductOperands<'a> {
    a: &'a [f32],
    b: &'a [f32],
    shape: ProductShape,
    /// The vector width of the kernel that runs (`None`: the portable loop).
    lanes: Option<usize>,
    /// `B` in the blocks that kernel reads ([`pack_blocks`]; empty for the portable loop).
    packed: &'a [f32],
    /// `A` in the panels that kernel reads ([`pack_panels`]; empty for the portable loop
    /// and up to [`A_IN_PLACE_UP_TO_K`]).
    panels: &'a [f32],
}

impl ProductOperands<'_> {
    /// [`accumulate_product`] for the accumulator's rows `first_row..` that `io` holds.
    ///
    /// # Panics
    /// When `io` is not whole rows within the product's.
    pub fn accumulate(&self, first_row: usize, io: Io<'_, 1>) {
        self.run(first_row, io.written(), SumFrom::Accumulator)
    }

    /// The product alone (`s_ij`, the chain of the module's comment) written over the
    /// accumulator's rows `first_row..` that `out` holds, which are not read: a window's
    /// first weight gradient, written as the standard `Gemm` writes it.
    ///
    /// # Panics
    /// When `out` is not whole rows within the product's.
    pub fn write(&self, first_row: usize, out: &mut [f32]) {
        self.run(first_row, out, SumFrom::Nothing)
    }

    fn run(&self, first_row: usize, acc: &mut [f32], from: SumFrom) {
        let ProductOperands { a, b, shape, .. } = *self;
        let (m, n) = (shape.m, shape.n);
        let rows = acc.len() / n.max(1);
        assert!(
            rows * n == acc.len() && first_row + rows <= m,
            "AccumulateProduct: rows {first_row}+{rows} of {shape:?}",
        );
        if acc.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let operands = (a, b, self.packed, self.panels);
        #[cfg(target_arch = "x86_64")]
        match self.lanes {
            // SAFETY: the CPU has the vectors and FMA (`fast_lanes`), the sizes were checked
            // here and in `new`, which packed B and A for this width.
            Some(16) => {
                return unsafe { simd::rows_avx512(operands, shape, (first_row, from), acc) }
            }
            Some(8) => return unsafe { simd::rows_avx2(operands, shape, (first_row, from), acc) },
            _ => {}
        }
        with_widest_vectors!(portable_rows(a, b, shape, (first_row, from), acc))
    }
}

/// What a sum of products starts from: the accumulator's value (`acc + s_1 + ...`), or
/// nothing (`s_1 + s_2 + ...`, the first product written as it is and the accumulator not
/// read: a window whose first weight gradient was kept too, `engine::deferred_products`).
/// Written as it is, not added to a zero: `0 + s` is `s` but for the sign of a zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SumFrom {
    #[default]
    Accumulator,
    Nothing,
}

impl SumFrom {
    /// The buffer a sum from here is made in: the state's (copied into the output when
    /// apart), or, from nothing, the output unread.
    pub fn buffer(self, io: Io<'_, 1>) -> &mut [f32] {
        match self {
            SumFrom::Accumulator => io.written(),
            SumFrom::Nothing => io.unread(),
        }
    }
}

/// The products of `pairs` (one accumulator's, every pair of its `m` and `n`) added to the
/// accumulator's rows `first_row..` that `io` holds, one after the other:
/// `acc' = ((acc + s_1) + s_2) + ...`, each `s_p` pair `p`'s chain of the module's comment.
/// So each element takes the same operations in the same order as one
/// [`accumulate_product`] per pair, run in turn: the same bits. From
/// [`SumFrom::Nothing`] the accumulator is not read and the first pair's chain is written
/// ([`ProductOperands::write`]), then the others added: the bits of a window whose first
/// micro-step wrote its gradient.
///
/// Why: a window's weight gradients kept until the window needs their sum
/// (`engine::deferred_products`) are added in one pass over the accumulator instead of one
/// per micro-step. The rows go [`GROUP_ROWS`] at a time, every pair over a group before the
/// next group: the group stays in cache between pairs, so the accumulator is read from
/// memory and written back once for all of them.
///
/// # Panics
/// When the pairs' accumulators differ in shape, or `io` is not whole rows within them.
pub fn accumulate_products(
    pairs: &[ProductOperands<'_>],
    (first_row, from): (usize, SumFrom),
    io: Io<'_, 1>,
) {
    let Some(first) = pairs.first() else {
        // Nothing to add; nothing to write over (no pair says what).
        io.written();
        return;
    };
    let acc = from.buffer(io);
    let (m, n) = (first.shape.m, first.shape.n);
    assert!(
        pairs.iter().all(|p| (p.shape.m, p.shape.n) == (m, n)),
        "AccumulateProduct: the products of one accumulator differ in shape",
    );
    if acc.is_empty() {
        return;
    }
    for (group, rows) in acc.chunks_mut(GROUP_ROWS * n).enumerate() {
        let row = first_row + group * GROUP_ROWS;
        for (p, pair) in pairs.iter().enumerate() {
            let from = match p {
                0 => from,
                _ => SumFrom::Accumulator,
            };
            pair.run(row, rows, from);
        }
    }
}

/// Rows of the accumulator [`accumulate_products`] adds every pair to before it goes on: a
/// multiple of the tiles' rows, so that a group starting on a panel of A ends on one
/// (1024 columns: 32 KiB, an L1 data cache's worth or less).
const GROUP_ROWS: usize = TASK_ROWS;

/// B's full blocks of `width` columns, each block's `k` rows one after the other (the
/// columns past the last full block are read from B): a tile reads its `k` rows of B from
/// one contiguous run instead of `k` rows a B row apart, which at a power-of-two row (1024
/// columns: 4 KiB) all fall in one L1 set with the accumulator's rows and evict each other.
///
/// With the prefetch of the kernel's tile, measured on a 1024-row accumulator (AMD EPYC Zen
/// 4, one thread, five alternations, benches/README.md "Run Z"): 784 columns, k 8: the same
/// in cache, 365 -> 278 µs after a 48 MiB stream; k 32: 772 -> 599 after one. 1024 columns,
/// k 8: 255 -> 270 in cache (within its spread), 395 -> 365 after; k 32: 782 -> 719 and 900
/// -> 798. The same operations in the same order: the same bits.
fn pack_blocks<const COLUMNS: usize>(b: &[f32], shape: ProductShape, into: &mut Lines) {
    column_blocks::<COLUMNS>(b, (shape.k, shape.n), into)
}

/// The columns of B a tile reads: two vectors.
const AVX512_BLOCK_COLUMNS: usize = 2 * 16;
const AVX2_BLOCK_COLUMNS: usize = 2 * 8;

/// The full blocks of `WIDTH` columns of a `[k, columns]` matrix, each block's `k` rows one
/// after the other (the columns past the last full block left out), in `into`. The matrix
/// is read row by row, one stream; each piece is a few vectors, which with the width a
/// constant are moves instead of calls to `memcpy`: A's panels at k 32 were 4096 such
/// calls, and laying out both operands of a 1024 x 1024 product took 23-27 µs against
/// 17-21 now in the kernel's bench, 37-45 against 24-30 in the MLP's session
/// (benches/README.md, "Run AJ").
fn column_blocks<const WIDTH: usize>(
    matrix: &[f32],
    (k, columns): (usize, usize),
    into: &mut Lines,
) {
    let blocks = columns / WIDTH;
    let (pieces, _) = into.on_line(blocks * k * WIDTH).as_chunks_mut::<WIDTH>();
    for (p, row) in matrix.chunks_exact(columns.max(1)).take(k).enumerate() {
        let (row, _) = row.as_chunks::<WIDTH>();
        for (block, from) in row.iter().enumerate() {
            pieces[block * k + p] = *from;
        }
    }
}

/// Rows per tile: with two vectors a row, twice as many chains in registers, and room left
/// for the row of `B` and a broadcast of `A`. AVX-512 (32 registers): 8, the fastest of 2-8
/// rows by 1-4 vectors measured at `k` 8 and 32 (12 measured in run AI: no faster); AVX2
/// (16): 4.
const AVX512_TILE_ROWS: usize = 8;
const AVX2_TILE_ROWS: usize = 4;

/// Up to this `k` the kernel reads A in place: its `k` lines a tile reads fit one L1 set's
/// ways (8 on Zen 4, 12 on Golden Cove), and the copy costs more than it saves (1024 x 256 at
/// k 8, one thread: 42-44 µs in place, 45-65 with panels; benches/README.md, "Run AI").
const A_IN_PLACE_UP_TO_K: usize = 8;

/// A's full panels of `rows` columns (rows of the product), each panel's `k` rows one after
/// the other: a tile reads its `rows` coefficients for each `p` from one contiguous run
/// instead of `k` rows of A a row of A apart, which at 1024 columns (4 KiB) all fall in one
/// L1 set, more lines than its ways at k = 32.
fn pack_panels<const ROWS: usize>(a: &[f32], shape: ProductShape, into: &mut Lines) {
    column_blocks::<ROWS>(a, (shape.k, shape.m), into)
}

/// The same chains a row at a time, `BLOCK` columns of partial sums on the stack.
#[inline(always)]
fn portable_rows(
    a: &[f32],
    b: &[f32],
    shape: ProductShape,
    (first_row, from): (usize, SumFrom),
    acc: &mut [f32],
) {
    const BLOCK: usize = 256;
    let ProductShape { k, m, n } = shape;
    for (r, row) in acc.chunks_exact_mut(n).enumerate() {
        let i = first_row + r;
        for (c, out) in row.chunks_mut(BLOCK).enumerate() {
            let j0 = c * BLOCK;
            let mut s = [0f32; BLOCK];
            let s = &mut s[..out.len()];
            for p in 0..k {
                let coefficient = a[p * m + i];
                let b_row = &b[p * n + j0..p * n + j0 + out.len()];
                for (s, &x) in s.iter_mut().zip(b_row) {
                    *s = coefficient.mul_add(x, *s);
                }
            }
            match from {
                SumFrom::Accumulator => out.iter_mut().zip(s.iter()).for_each(|(o, s)| *o += *s),
                SumFrom::Nothing => out.copy_from_slice(s),
            }
        }
    }
}

/// The kernel on x86-64 vectors, one body for both widths ([`Lanes`]).
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{ProductShape, SumFrom};
    use std::arch::x86_64::*;

    /// One vector of float32 lanes and the operations the kernel uses, each one instruction.
    /// Every method is unsafe: the CPU must have the width's instructions and FMA, and each
    /// pointer must hold the lanes it reads or writes (the masked ones: the mask's lanes).
    trait Lanes: Copy {
        const LANES: usize;
        /// Rows per tile (`super::AVX512_TILE_ROWS`, `super::AVX2_TILE_ROWS`).
        const ROWS: usize;
        /// Which lanes a masked load or store touches.
        type Mask: Copy;
        /// The first `lanes` lanes (at most [`Self::LANES`]).
        unsafe fn first(lanes: usize) -> Self::Mask;
        unsafe fn zero() -> Self;
        unsafe fn splat(x: f32) -> Self;
        unsafe fn load(from: *const f32) -> Self;
        unsafe fn load_masked(mask: Self::Mask, from: *const f32) -> Self;
        unsafe fn store(self, to: *mut f32);
        unsafe fn store_masked(self, mask: Self::Mask, to: *mut f32);
        /// `a·b + self`, one rounding.
        unsafe fn fma(self, a: Self, b: Self) -> Self;
        unsafe fn add(self, other: Self) -> Self;
    }

    impl Lanes for __m512 {
        const LANES: usize = 16;
        const ROWS: usize = super::AVX512_TILE_ROWS;
        type Mask = __mmask16;
        #[inline(always)]
        unsafe fn first(lanes: usize) -> __mmask16 {
            ((1u32 << lanes) - 1) as __mmask16
        }
        #[inline(always)]
        unsafe fn zero() -> Self {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(from: *const f32) -> Self {
            _mm512_loadu_ps(from)
        }
        #[inline(always)]
        unsafe fn load_masked(mask: __mmask16, from: *const f32) -> Self {
            _mm512_maskz_loadu_ps(mask, from)
        }
        #[inline(always)]
        unsafe fn store(self, to: *mut f32) {
            _mm512_storeu_ps(to, self)
        }
        #[inline(always)]
        unsafe fn store_masked(self, mask: __mmask16, to: *mut f32) {
            _mm512_mask_storeu_ps(to, mask, self)
        }
        #[inline(always)]
        unsafe fn fma(self, a: Self, b: Self) -> Self {
            _mm512_fmadd_ps(a, b, self)
        }
        #[inline(always)]
        unsafe fn add(self, other: Self) -> Self {
            _mm512_add_ps(self, other)
        }
    }

    impl Lanes for __m256 {
        const LANES: usize = 8;
        const ROWS: usize = super::AVX2_TILE_ROWS;
        type Mask = __m256i;
        #[inline(always)]
        unsafe fn first(lanes: usize) -> __m256i {
            let on: [i32; 8] = std::array::from_fn(|l| if l < lanes { -1 } else { 0 });
            _mm256_loadu_si256(on.as_ptr().cast())
        }
        #[inline(always)]
        unsafe fn zero() -> Self {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(from: *const f32) -> Self {
            _mm256_loadu_ps(from)
        }
        #[inline(always)]
        unsafe fn load_masked(mask: __m256i, from: *const f32) -> Self {
            _mm256_maskload_ps(from, mask)
        }
        #[inline(always)]
        unsafe fn store(self, to: *mut f32) {
            _mm256_storeu_ps(to, self)
        }
        #[inline(always)]
        unsafe fn store_masked(self, mask: __m256i, to: *mut f32) {
            _mm256_maskstore_ps(to, mask, self)
        }
        #[inline(always)]
        unsafe fn fma(self, a: Self, b: Self) -> Self {
            _mm256_fmadd_ps(a, b, self)
        }
        #[inline(always)]
        unsafe fn add(self, other: Self) -> Self {
            _mm256_add_ps(self, other)
        }
    }

    /// How many tiles ahead [`tile`] asks for the accumulator's lines.
    const PREFETCH_TILES: usize = 3;

    /// `R` rows of the accumulator from `acc` (row `i` of the product: `first_row + i`) by
    /// `V` vectors from column `j`, with `MASKED` the last of them cut to `mask`'s lanes;
    /// the chains added to them, or written over them unread (`from`).
    ///
    /// # Safety
    /// The width's instructions and FMA; `R` rows from `i` and the lanes of `V` vectors from
    /// `j` (the last masked) within the checked shapes.
    #[inline(always)]
    unsafe fn tile<S: Lanes, const R: usize, const V: usize, const MASKED: bool>(
        ((a, a_stride), acc): ((*const f32, usize), *mut f32),
        (b, b_stride): (*const f32, usize),
        (shape, from): (ProductShape, SumFrom),
        (i, j): (usize, usize),
        mask: S::Mask,
    ) {
        let ProductShape { k, n, .. } = shape;
        let masked = |v: usize| MASKED && v + 1 == V;
        // The accumulator's lines this row block reaches PREFETCH_TILES tiles on, asked for
        // now into L2: a tile reads R rows a row apart, more streams than the hardware
        // prefetchers follow, so the lines would otherwise come from memory when the tile
        // adds to them. Not into L1: at a power-of-two row (4 KiB) the R rows share one L1
        // set, and lines asked for early there evict the tile's own (measured: slower).
        for r in 0..R {
            let ahead = acc.wrapping_add((i + r) * n + j + PREFETCH_TILES * V * S::LANES);
            for line in 0..(V * S::LANES).div_ceil(16) {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(16 * line) as *const i8);
            }
        }
        let mut s = [[S::zero(); V]; R];
        for p in 0..k {
            let mut x = [S::zero(); V];
            for (v, x) in x.iter_mut().enumerate() {
                let from = b.add(p * b_stride + v * S::LANES);
                *x = match masked(v) {
                    true => S::load_masked(mask, from),
                    false => S::load(from),
                };
            }
            for (r, s) in s.iter_mut().enumerate() {
                let coefficient = S::splat(*a.add(p * a_stride + r));
                for v in 0..V {
                    s[v] = s[v].fma(coefficient, x[v]);
                }
            }
        }
        for (r, s) in s.iter().enumerate() {
            for (v, s) in s.iter().enumerate() {
                let out = acc.add((i + r) * n + j + v * S::LANES);
                match (masked(v), from) {
                    (true, SumFrom::Accumulator) => {
                        S::load_masked(mask, out).add(*s).store_masked(mask, out)
                    }
                    (false, SumFrom::Accumulator) => S::load(out).add(*s).store(out),
                    (true, SumFrom::Nothing) => s.store_masked(mask, out),
                    (false, SumFrom::Nothing) => s.store(out),
                }
            }
        }
    }

    /// `R` rows from `i`, every column; `a` the tile's coefficients of A (its `R` for `p` at
    /// `a.0 + p * a.1`).
    ///
    /// # Safety
    /// As [`tile`].
    #[inline(always)]
    unsafe fn row_block<S: Lanes, const R: usize>(
        (a, b, acc): ((*const f32, usize), *const f32, *mut f32),
        packed: &[f32],
        shape: (ProductShape, SumFrom),
        i: usize,
    ) {
        let (k, n, lanes) = (shape.0.k, shape.0.n, S::LANES);
        let all = S::first(lanes);
        let width = 2 * lanes;
        let mut j = 0;
        while j + width <= n {
            // The block's k rows of B, packed one after the other.
            let block = packed.as_ptr().add(j / width * k * width);
            tile::<S, R, 2, false>((a, acc), (block, width), shape, (i, j), all);
            j += width;
        }
        if j + lanes <= n {
            tile::<S, R, 1, false>((a, acc), (b.add(j), n), shape, (i, j), all);
            j += lanes;
        }
        if j < n {
            let mask = S::first(n - j);
            tile::<S, R, 1, true>((a, acc), (b.add(j), n), shape, (i, j), mask);
        }
    }

    /// The rows `acc` holds, from row `first_row` of the product; `packed` is B in the
    /// blocks of two of this width's vectors (`super::pack_blocks`), `panels` A in panels of
    /// `S::ROWS` rows (`super::pack_panels`) or empty (A read in place).
    ///
    /// # Safety
    /// As [`tile`], with `a`, `b`, `packed`, `panels` and `acc` of the sizes
    /// `super::ProductOperands` checks and makes.
    #[inline(always)]
    unsafe fn rows<S: Lanes>(
        (a, b, packed, panels): (&[f32], &[f32], &[f32], &[f32]),
        shape: ProductShape,
        (first_row, from): (usize, SumFrom),
        acc: &mut [f32],
    ) {
        let (k, m) = (shape.k, shape.m);
        let rows = acc.len() / shape.n.max(1);
        let shape = (shape, from);
        let (b, acc) = (b.as_ptr(), acc.as_mut_ptr());
        // Row `i`'s coefficients in A itself, a row of A (m elements) apart per p.
        let in_a = |i: usize| (a.as_ptr().add(first_row + i), m);
        let mut i = 0;
        while i + S::ROWS <= rows {
            // A whole panel where the block starts at one (tasks split at multiples of
            // the tile), else A itself: the same values, the same operations.
            let row = first_row + i;
            let on_panel = !panels.is_empty() && row.is_multiple_of(S::ROWS) && row + S::ROWS <= m;
            let coefficients = match on_panel {
                true => (panels.as_ptr().add(row / S::ROWS * k * S::ROWS), S::ROWS),
                false => in_a(i),
            };
            match S::ROWS {
                8 => row_block::<S, 8>((coefficients, b, acc), packed, shape, i),
                _ => row_block::<S, 4>((coefficients, b, acc), packed, shape, i),
            }
            i += S::ROWS;
        }
        // The rows left: four and two a tile where they can be (a one-row tile keeps two
        // chains in flight, a quarter of what the FMA units take).
        if S::ROWS > 4 && i + 4 <= rows {
            row_block::<S, 4>((in_a(i), b, acc), packed, shape, i);
            i += 4;
        }
        if i + 2 <= rows {
            row_block::<S, 2>((in_a(i), b, acc), packed, shape, i);
            i += 2;
        }
        if i < rows {
            row_block::<S, 1>((in_a(i), b, acc), packed, shape, i);
        }
    }

    /// [`rows`] on AVX-512.
    ///
    /// # Safety
    /// AVX-512F and FMA; the sizes of [`rows`], `packed` in blocks of 32 columns, `panels`
    /// of 8 rows.
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn rows_avx512(
        operands: (&[f32], &[f32], &[f32], &[f32]),
        shape: ProductShape,
        first_row: (usize, SumFrom),
        acc: &mut [f32],
    ) {
        rows::<__m512>(operands, shape, first_row, acc)
    }

    /// [`rows`] on AVX2.
    ///
    /// # Safety
    /// AVX2 and FMA; the sizes of [`rows`], `packed` in blocks of 16 columns, `panels` of 4
    /// rows.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_avx2(
        operands: (&[f32], &[f32], &[f32], &[f32]),
        shape: ProductShape,
        first_row: (usize, SumFrom),
        acc: &mut [f32],
    ) {
        rows::<__m256>(operands, shape, first_row, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic spread of values of both signs and many magnitudes.
    fn values(seed: u32, len: usize) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9e37_79b9) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let unit = (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                unit * 2f32.powi((state % 7) as i32 - 3)
            })
            .collect()
    }

    type Kernel = fn(&[f32], &[f32], ProductShape, (usize, SumFrom), &mut [f32]);

    /// What `pack` lays out of `matrix`.
    fn laid_out(
        pack: fn(&[f32], ProductShape, &mut Lines),
        matrix: &[f32],
        shape: ProductShape,
    ) -> Vec<f32> {
        let mut into = Lines::default();
        pack(matrix, shape, &mut into);
        into.as_slice().to_vec()
    }

    /// Every way this CPU can run the kernel: the portable loop, and each vector width it has.
    fn kernels() -> Vec<(&'static str, Kernel)> {
        let mut kernels: Vec<(&'static str, Kernel)> = vec![("portable", portable_rows)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("fma") {
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 and FMA; the test's sizes are the checked ones.
                    kernels.push(("avx2", |a, b, s, r, acc| unsafe {
                        simd::rows_avx2(
                            (
                                a,
                                b,
                                &laid_out(pack_blocks::<AVX2_BLOCK_COLUMNS>, b, s),
                                &laid_out(pack_panels::<AVX2_TILE_ROWS>, a, s),
                            ),
                            s,
                            r,
                            acc,
                        )
                    }));
                }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F and FMA; the sizes as above.
                    kernels.push(("avx512", |a, b, s, r, acc| unsafe {
                        simd::rows_avx512(
                            (
                                a,
                                b,
                                &laid_out(pack_blocks::<AVX512_BLOCK_COLUMNS>, b, s),
                                &laid_out(pack_panels::<AVX512_TILE_ROWS>, a, s),
                            ),
                            s,
                            r,
                            acc,
                        )
                    }));
                }
            }
        }
        kernels
    }

    /// The module's chains `s_ij`, one element at a time.
    fn products(a: &[f32], b: &[f32], shape: ProductShape) -> Vec<f32> {
        let ProductShape { k, m, n } = shape;
        let mut s = vec![0f32; m * n];
        for (ij, s) in s.iter_mut().enumerate() {
            let (i, j) = (ij / n, ij % n);
            *s = (0..k).fold(0f32, |s, p| a[p * m + i].mul_add(b[p * n + j], s));
        }
        s
    }

    /// The module's formula, one element at a time.
    fn chain(a: &[f32], b: &[f32], shape: ProductShape, acc: &[f32]) -> Vec<f32> {
        let s = products(a, b, shape);
        acc.iter().zip(&s).map(|(acc, s)| acc + s).collect()
    }

    /// Every tile shape and tail of the kernel (rows by 8 and one, columns by two vectors, one
    /// and masked), on every vector width the CPU has and the portable loop, in place and
    /// apart, row ranges as the threads split them, in a layout kept from other shapes, gives
    /// the chain's bits; and the chain is the product to float32 rounding (float64 sums).
    #[test]
    fn the_product_is_the_fused_chain() {
        let mut kept = ProductLayout::default();
        for k in [1, 3, 8, 17, 32, 64] {
            for m in [1, 7, 8, 9, 17] {
                for n in [1, 15, 16, 17, 33, 48, 70] {
                    let shape = ProductShape { k, m, n };
                    let (a, b) = (values(1, k * m), values(2, k * n));
                    let acc = values(3, m * n);
                    let want = chain(&a, &b, shape, &acc);
                    let mut in_place = acc.clone();
                    // Two pieces, split at a row as the kernel's tasks are.
                    let split = m / 2 * n;
                    let (top, bottom) = in_place.split_at_mut(split);
                    accumulate_product(&a, &b, shape, 0, Io::InPlace([top]));
                    accumulate_product(&a, &b, shape, m / 2, Io::InPlace([bottom]));
                    let mut apart = vec![0f32; m * n];
                    accumulate_product(&a, &b, shape, 0, Io::Apart([&acc], [&mut apart]));
                    // The layout kept from the shapes before, as the operator keeps it: what
                    // it held is written over.
                    let mut kept_layout = acc.clone();
                    kept.operands(&a, &b, shape)
                        .accumulate(0, Io::InPlace([&mut kept_layout]));
                    let mut results = vec![
                        ("in place", in_place),
                        ("apart", apart),
                        ("kept layout", kept_layout),
                    ];
                    for (what, kernel) in kernels() {
                        let mut got = acc.clone();
                        kernel(&a, &b, shape, (0, SumFrom::Accumulator), &mut got);
                        results.push((what, got));
                    }
                    // Written over, unread: the chains themselves.
                    let s = products(&a, &b, shape);
                    let mut written = vec![f32::NAN; m * n];
                    kept.operands(&a, &b, shape).write(0, &mut written);
                    let mut writes = vec![("written, kept layout", written)];
                    for (what, kernel) in kernels() {
                        let mut got = vec![f32::NAN; m * n];
                        kernel(&a, &b, shape, (0, SumFrom::Nothing), &mut got);
                        writes.push((what, got));
                    }
                    for (what, got) in &writes {
                        let same = got.iter().zip(&s).all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(same, "{what}: written {shape:?}");
                    }
                    for (what, got) in &results {
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits());
                        assert!(same, "{what}, {shape:?}");
                    }
                    for i in 0..m {
                        for j in 0..n {
                            let exact: f64 = (0..k)
                                .map(|p| a[p * m + i] as f64 * b[p * n + j] as f64)
                                .sum::<f64>()
                                + acc[i * n + j] as f64;
                            let scale: f64 = (0..k)
                                .map(|p| (a[p * m + i] as f64 * b[p * n + j] as f64).abs())
                                .sum::<f64>()
                                + (acc[i * n + j] as f64).abs();
                            let error = (want[i * n + j] as f64 - exact).abs();
                            assert!(
                                error <= (k + 1) as f64 * f32::EPSILON as f64 * scale,
                                "{shape:?} ({i}, {j}): {} vs {exact}",
                                want[i * n + j]
                            );
                        }
                    }
                }
            }
        }
    }

    /// Several products added by one pass give, element by element, the bits of one
    /// [`accumulate_product`] per product in turn: pairs of different `k` (with A in place
    /// and on panels), rows from a task's offset on and off a tile's multiple, in place
    /// and apart; no pairs leave the accumulator as it was. From nothing, the accumulator
    /// (NaN) is not read and the first product is its chain of the module's comment,
    /// written as it is.
    #[test]
    fn products_in_one_pass_are_the_products_in_turn() {
        for (m, n) in [(1, 5), (9, 33), (20, 70), (37, 16)] {
            let ks = [3, 8, 1, 17, 32];
            let operands: Vec<(Vec<f32>, Vec<f32>, ProductShape)> = ks
                .iter()
                .enumerate()
                .map(|(p, &k)| {
                    let shape = ProductShape { k, m, n };
                    (
                        values(10 + p as u32, k * m),
                        values(20 + p as u32, k * n),
                        shape,
                    )
                })
                .collect();
            let acc = values(9, m * n);
            for pairs in 0..=ks.len() {
                let mut want = acc.clone();
                for (a, b, shape) in &operands[..pairs] {
                    accumulate_product(a, b, *shape, 0, Io::InPlace([&mut want]));
                }
                let mut layouts: Vec<ProductLayout> =
                    (0..pairs).map(|_| ProductLayout::default()).collect();
                let laid_out: Vec<ProductOperands<'_>> = layouts
                    .iter_mut()
                    .zip(&operands)
                    .map(|(layout, (a, b, shape))| layout.operands(a, b, *shape))
                    .collect();
                // In place, in two tasks split at a row that is not a tile's multiple.
                let mut in_place = acc.clone();
                let split = m / 2 + 1;
                let (top, bottom) = in_place.split_at_mut(split.min(m) * n);
                let from = (0, SumFrom::Accumulator);
                accumulate_products(&laid_out, from, Io::InPlace([top]));
                let from = (split.min(m), SumFrom::Accumulator);
                accumulate_products(&laid_out, from, Io::InPlace([bottom]));
                let mut apart = vec![0f32; m * n];
                let from = (0, SumFrom::Accumulator);
                accumulate_products(&laid_out, from, Io::Apart([&acc], [&mut apart]));
                for (what, got) in [("in place", &in_place), ("apart", &apart)] {
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits());
                    assert!(same, "{what}, {pairs} pairs, {m} x {n}");
                }
                let Some((a, b, shape)) = operands[..pairs].first() else {
                    continue;
                };
                let mut fresh = products(a, b, *shape);
                for (a, b, shape) in &operands[1..pairs] {
                    accumulate_product(a, b, *shape, 0, Io::InPlace([&mut fresh]));
                }
                let mut in_place = vec![f32::NAN; m * n];
                let (top, bottom) = in_place.split_at_mut(split.min(m) * n);
                accumulate_products(&laid_out, (0, SumFrom::Nothing), Io::InPlace([top]));
                let from = (split.min(m), SumFrom::Nothing);
                accumulate_products(&laid_out, from, Io::InPlace([bottom]));
                let mut apart = vec![f32::NAN; m * n];
                let from = (0, SumFrom::Nothing);
                accumulate_products(&laid_out, from, Io::Apart([&acc], [&mut apart]));
                let mut written = vec![f32::NAN; m * n];
                laid_out[0].write(0, &mut written);
                let first = products(a, b, *shape);
                for (what, got, want) in [
                    ("from nothing, in place", &in_place, &fresh),
                    ("from nothing, apart", &apart, &fresh),
                    ("written", &written, &first),
                ] {
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(g, w)| g.to_bits() == w.to_bits());
                    assert!(same, "{what}, {pairs} pairs, {m} x {n}");
                }
            }
        }
    }

    /// Empty operands: `k` = 0 adds zero (as the standard `Gemm`'s zeros and `Add` do), an
    /// empty accumulator is left alone.
    #[test]
    fn empty_shapes() {
        let acc = values(7, 6);
        let mut got = acc.clone();
        let shape = ProductShape { k: 0, m: 2, n: 3 };
        accumulate_product(&[], &[], shape, 0, Io::InPlace([&mut got]));
        let plus_zero: Vec<u32> = acc.iter().map(|x| (x + 0.0).to_bits()).collect();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            plus_zero
        );
        for shape in [
            ProductShape { k: 3, m: 2, n: 0 },
            ProductShape { k: 3, m: 0, n: 4 },
        ] {
            let (a, b) = (vec![1.0; shape.k * shape.m], vec![1.0; shape.k * shape.n]);
            accumulate_product(&a, &b, shape, 0, Io::InPlace([&mut []]));
        }
    }

    /// Non-finite operands spread as the standard ops spread them, on every kernel: NaN
    /// where the chain meets one, and the infinities' signs.
    #[test]
    fn non_finite_values_spread_as_in_the_chain() {
        let shape = ProductShape { k: 2, m: 2, n: 20 };
        let mut a = values(4, 4);
        let mut b = values(5, 40);
        a[1] = f32::INFINITY; // row 1, p = 0
        b[20 + 3] = f32::NAN; // p = 1, column 3
        b[5] = 0.0; // inf · 0 in row 1, column 5
        let acc = values(6, 40);
        let want = chain(&a, &b, shape, &acc);
        let mut got = acc.clone();
        accumulate_product(&a, &b, shape, 0, Io::InPlace([&mut got]));
        for (what, kernel) in kernels() {
            let mut other = acc.clone();
            kernel(&a, &b, shape, (0, SumFrom::Accumulator), &mut other);
            for (o, w) in other.iter().zip(&want) {
                assert!(
                    o.to_bits() == w.to_bits() || (o.is_nan() && w.is_nan()),
                    "{what}"
                );
            }
        }
        for (g, w) in got.iter().zip(&want) {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{g} vs {w}"
            );
        }
        assert!(got[3].is_nan() && got[20 + 5].is_nan() && got[20].is_infinite());
    }
}
