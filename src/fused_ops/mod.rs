//! onnx-ga's own fused operators: what each computes, its domain, name and input slots. The
//! exported step never contains them (it stays standard ONNX, so any host runs it); an engine
//! that has their kernels swaps a recognised standard-op subgraph for one node in memory
//! (`passes::fuse` for the optimizer updates, `passes::fused_batch_norm` for BatchNorm; the
//! ONNX Runtime kernels in `engine::ort_ops`). This module is the one place both sides
//! read: the rewrite for the slots, the kernel for the arithmetic.
//!
//! Every operator that updates a state ends with two kinds of optional input: the gate, its
//! `KEEP` and `LOSS` slots ([`keeps`]), and, from its `AFTER` slot on, ordering inputs
//! (variadic, any type): values the kernel never reads, there only so that the nodes making
//! them run before it. A kernel that updates a state in place is ordered after every other
//! reader of that state (`passes::fuse::in_place::plan`): the backward reads a layer's
//! weight again for the gradient of the layer below, which nothing else orders before the
//! weight's update.

/// The operator domain of the fused operators (never written to a file).
pub const DOMAIN: &str = "ai.onnx_ga";
pub const DOMAIN_VERSION: i64 = 1;

/// `AdamWUpdate(p, g, m, v, alpha, one_minus_alpha, beta, one_minus_beta, epsilon, lr,
/// [a], [c], [lr_wd], [g_addend], [g_divisor], [keep], [loss], [addend_a], [addend_b]) ->
/// (p', m', v')`: one
/// parameter's AdamW step, element by element, in the order of operations of the standard-op
/// lowering (`passes::legalize::adamw_optimizer::lower_adamw_for_params`), so that float32
/// results are bit-identical to it:
///
/// ```text
/// g = (g + g_addend) / g_divisor   (each when given: the window's accumulated gradient,
///                                   its sum and mean folded in instead of two more passes)
/// m' = m·α + g·(1-α)               v' = v·β + (g·(1-β))·g
/// adam_mode 1: δ = (m'·lr) / (√v' + ε);         p' = p - δ, then with lr_wd: p' - p'·lr_wd
/// adam_mode 0: δ = (m'·lr) / ((√(v'/c) + ε)·a); p' = (p - p·lr_wd) - δ   (a, c required)
/// ```
///
/// `lr` is the learning rate the elementwise chain multiplies by: in mode 1 already scaled
/// by the bias corrections (`lr·√c/a`, a scalar the graph computes once per step).
///
/// With the string attribute `accumulator` ([`PRODUCT_ACCUMULATOR`]), `g` is that
/// accumulator, read by this node alone, and a trainer that keeps the window's weight
/// gradients as their operands has the kernel add them to `g` first
/// (`passes::fuse::apply_kept_sum`, `engine::deferred_products`).
///
/// With `addend_a` `[k, m]` and `addend_b` `[k, n]` instead of `g_addend` (a parameter of
/// `[m, n]`), the addend is their product `addend_aᵀ·addend_b`, the apply's own weight
/// gradient (`passes::fuse::apply_product`). Where `k` suits onnx-ga's product kernel, each
/// task makes its rows of it as it updates them, so it is never written whole; the chains
/// of [`accumulate_product`], added to `g` as `g_addend` is: the bits of
/// `Gemm(addend_a, addend_b, transA = 1)` given as `g_addend`.
pub const ADAMW_UPDATE: &str = "AdamWUpdate";

/// Input slots of [`ADAMW_UPDATE`]; every scalar is a one-element float32 tensor.
pub mod adamw_slot {
    pub const PARAM: usize = 0;
    pub const GRAD: usize = 1;
    pub const M: usize = 2;
    pub const V: usize = 3;
    pub const ALPHA: usize = 4;
    pub const ONE_MINUS_ALPHA: usize = 5;
    pub const BETA: usize = 6;
    pub const ONE_MINUS_BETA: usize = 7;
    pub const EPSILON: usize = 8;
    pub const LR: usize = 9;
    /// Bias correction 1 - α^t (mode 0 only).
    pub const A: usize = 10;
    /// Bias correction 1 - β^t (mode 0 only).
    pub const C: usize = 11;
    /// lr · weight decay (optional: absent means no decoupled decay).
    pub const LR_WD: usize = 12;
    /// Added to the gradient first (optional; same size).
    pub const GRAD_ADDEND: usize = 13;
    /// The gradient is divided by it, after the addend (optional scalar).
    pub const GRAD_DIVISOR: usize = 14;
    /// The gate ([`super::keeps`]).
    pub const KEEP: usize = 15;
    pub const LOSS: usize = super::loss_slot(KEEP);
    /// The addend as the operands of its product, `[k, m]` and `[k, n]` (optional, both or
    /// neither, and then no `GRAD_ADDEND`; see [`super::ADAMW_UPDATE`]).
    pub const ADDEND_A: usize = 17;
    pub const ADDEND_B: usize = 18;
    /// Ordering inputs from here on (any number, any type, never read: see the module's comment).
    pub const AFTER: usize = 19;
    pub const COUNT: usize = 19;
}

/// `AdamWUpdates(alpha, one_minus_alpha, beta, one_minus_beta, epsilon, lr, [a], [c],
/// [lr_wd], [g_divisor], members...) -> (p', m', v')...`: the [`ADAMW_UPDATE`] of several
/// parameters that share every scalar, in one node. Attribute `members` counts them; each
/// member is `(p, g, m, v)`, or `(p, g, g_addend, m, v)` when attribute `addends` is 1, and
/// its outputs are `(p', m', v')` in member order, each of its own `p`'s shape. The same
/// arithmetic per element as [`ADAMW_UPDATE`] (so the same bits); one dispatch instead of
/// one per parameter, and no `Concat`/`Split` around a flat group of small parameters
/// (`passes::fuse::adamw_group`). No gate and no ordering inputs: only sessions that update
/// nothing in place get it.
pub const ADAMW_UPDATES: &str = "AdamWUpdates";

/// Input slots of [`ADAMW_UPDATES`] before its members (the scalars of [`adamw_slot`]).
pub mod adamw_group_slot {
    pub const ALPHA: usize = 0;
    pub const ONE_MINUS_ALPHA: usize = 1;
    pub const BETA: usize = 2;
    pub const ONE_MINUS_BETA: usize = 3;
    pub const EPSILON: usize = 4;
    pub const LR: usize = 5;
    pub const A: usize = 6;
    pub const C: usize = 7;
    pub const LR_WD: usize = 8;
    pub const GRAD_DIVISOR: usize = 9;
    /// The first member's first tensor.
    pub const MEMBERS: usize = 10;
    /// Each fixed slot's [`super::adamw_slot`] counterpart, in slot order.
    pub const FROM_SINGLE: [usize; MEMBERS] = [
        super::adamw_slot::ALPHA,
        super::adamw_slot::ONE_MINUS_ALPHA,
        super::adamw_slot::BETA,
        super::adamw_slot::ONE_MINUS_BETA,
        super::adamw_slot::EPSILON,
        super::adamw_slot::LR,
        super::adamw_slot::A,
        super::adamw_slot::C,
        super::adamw_slot::LR_WD,
        super::adamw_slot::GRAD_DIVISOR,
    ];
}

/// The scalars of one [`ADAMW_UPDATE`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    pub alpha: f32,
    pub one_minus_alpha: f32,
    pub beta: f32,
    pub one_minus_beta: f32,
    pub epsilon: f32,
    pub lr: f32,
    /// Mode 0: `Some((a, c))`, the bias corrections; mode 1: `None`.
    pub corrections: Option<(f32, f32)>,
    pub lr_wd: Option<f32>,
    /// The gradient is divided by it before the update (see [`adamw_update`]).
    pub divisor: Option<f32>,
}

impl AdamWScalars {
    /// The scalars of an update whose scalar inputs sit at `slots` (in the order of
    /// [`adamw_group_slot::FROM_SINGLE`]), `scalar(slot)` reading one (`None`: absent). The
    /// one reading of these slots, for ONNX Runtime's kernel and the host's alike.
    pub fn read<E: From<String>>(
        slots: [usize; adamw_group_slot::MEMBERS],
        scalar: impl Fn(usize) -> Result<Option<f32>, E>,
    ) -> Result<AdamWScalars, E> {
        use adamw_group_slot as at;
        let get = |k: usize| scalar(slots[k]);
        let required =
            |k: usize| get(k)?.ok_or_else(|| E::from(format!("input {} is missing", slots[k])));
        let corrections = match (get(at::A)?, get(at::C)?) {
            (Some(a), Some(c)) => Some((a, c)),
            (None, None) => None,
            _ => return Err(E::from("the bias corrections a and c come together".into())),
        };
        Ok(AdamWScalars {
            alpha: required(at::ALPHA)?,
            one_minus_alpha: required(at::ONE_MINUS_ALPHA)?,
            beta: required(at::BETA)?,
            one_minus_beta: required(at::ONE_MINUS_BETA)?,
            epsilon: required(at::EPSILON)?,
            lr: required(at::LR)?,
            corrections,
            lr_wd: get(at::LR_WD)?,
            divisor: get(at::GRAD_DIVISOR)?,
        })
    }
}

/// Calls `f(args)`, an `#[inline(always)]` kernel body, compiled for the widest vectors the
/// CPU has (AVX-512, AVX2, else the build's baseline: SSE2 on x86-64), chosen at run time.
/// The same bits each way: every operation is one IEEE-754 operation per element (add, mul,
/// div, sqrt, and the fused multiply-adds written as such, `mul_add`), correctly rounded at
/// any width, and nothing else is contracted into an FMA (Rust never contracts `a * b + c`;
/// where the hardware has no FMA, `mul_add` is still one rounding, in software). Why: the
/// AdamW body's divisions and square root per element bound it on the baseline's 4-wide
/// vectors (benches/README.md, "Run H").
macro_rules! with_widest_vectors {
    ($f:ident($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,fma")]
            unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX-512F and FMA (checked just above).
                unsafe { avx512(#[inline(always)] || $f($($arg),*)) }
            } else if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX2 and FMA (checked just above).
                unsafe { avx2(#[inline(always)] || $f($($arg),*)) }
            } else {
                $f($($arg),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $f($($arg),*)
        }
    }};
}

mod batch_norm;
mod blocked_weight;
mod col2im;
mod conv_weight_grad;
mod gelu;
mod gelu_grad;
mod im2col;
mod layer_norm_grad;
mod leading_sum;
mod product;
mod quotient;
mod relu_grad;
mod row_transpose;
pub use batch_norm::{
    batch_norm_grad_channel, batch_norm_train_channel, BatchNormLayout, ChannelStats,
    BATCH_NORM_GRAD, BATCH_NORM_TRAIN,
};
pub use blocked_weight::{blocked_weight, BLOCKED_WEIGHT};
pub use col2im::{folded_size, COL2IM};
pub use conv_weight_grad::{conv_weight_grad_slot, CONV_WEIGHT_GRAD};
pub use gelu::{gelu_forward_slot, gelu_quotient, gelu_tail, GeluScalars, GELU};
pub use gelu_grad::{gelu_grad, gelu_slot, GeluGradScalars, GELU_GRAD};
pub use im2col::{Unfolding, Window2d, IM2COL};
pub use layer_norm_grad::{
    layer_norm_grad_rows, layer_norm_grad_slot, LAYER_NORM_GRAD, ROWS as LAYER_NORM_GRAD_ROWS,
};
pub use leading_sum::{leading_sum, LEADING_SUM};
pub use product::{
    accumulate_product, accumulate_product_slot, accumulate_products, largest_fast_contraction,
    ProductLayout, ProductOperands, ProductShape, SumFrom, ACCUMULATE_PRODUCT,
    ACCUMULATOR as PRODUCT_ACCUMULATOR, OVERWRITES as PRODUCT_OVERWRITES,
    TASK_ROWS as PRODUCT_TASK_ROWS,
};
use quotient::KnownDivisor;
pub use relu_grad::{relu_grad, RELU_GRAD};
pub use row_transpose::{RowLayout, ROW_TRANSPOSE};

/// Where an update reads the state it updates (parameter, moments, buffer) and writes its
/// next value: separate buffers, or one buffer per state updated in place (the session bound
/// the output to the input's buffer: `passes::fuse::in_place`). Every element is read before
/// it is written, so both give the same numbers.
pub enum Io<'a, const N: usize> {
    Apart([&'a [f32]; N], [&'a mut [f32]; N]),
    InPlace([&'a mut [f32]; N]),
}

impl<'a> Io<'a, 1> {
    /// The one buffer to update in place: the state's own, or the output with the state
    /// copied into it.
    pub fn written(self) -> &'a mut [f32] {
        match self {
            Io::InPlace([state]) => state,
            Io::Apart([src], [dst]) => {
                dst.copy_from_slice(src);
                dst
            }
        }
    }
    /// The one buffer to write a next value into that does not depend on the state: the
    /// state's own, or the output (the state not copied).
    pub fn unread(self) -> &'a mut [f32] {
        match self {
            Io::InPlace([state]) => state,
            Io::Apart(_, [dst]) => dst,
        }
    }
}

impl<const N: usize> Io<'_, N> {
    /// Elements per state (every one the same, checked).
    pub fn common_len(&self) -> Option<usize> {
        // Without collecting: the host's updates check it on every run.
        let same = |mut lens: std::slice::Iter<'_, usize>| {
            let n = *lens.next()?;
            lens.all(|&l| l == n).then_some(n)
        };
        match self {
            Io::Apart(src, dst) => {
                let n = same(src.map(|s| s.len()).iter())?;
                dst.iter().all(|d| d.len() == n).then_some(n)
            }
            Io::InPlace(buf) => same(buf.each_ref().map(|b| b.len()).iter()),
        }
    }
}

/// `next = f(i, state)` for every element i, state read from `io` and written back.
/// Monomorphised per `f`, and the slices cut to one length, so that each loop vectorises.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // i indexes N slices at once
fn each<const N: usize>(io: Io<'_, N>, n: usize, f: impl Fn(usize, [f32; N]) -> [f32; N]) {
    match io {
        Io::Apart(src, dst) => {
            let src = src.map(|s| &s[..n]);
            let dst = dst.map(|d| &mut d[..n]);
            for i in 0..n {
                let next = f(i, std::array::from_fn(|k| src[k][i]));
                for k in 0..N {
                    dst[k][i] = next[k];
                }
            }
        }
        Io::InPlace(buf) => {
            let buf = buf.map(|b| &mut b[..n]);
            for i in 0..n {
                let next = f(i, std::array::from_fn(|k| buf[k][i]));
                for k in 0..N {
                    buf[k][i] = next[k];
                }
            }
        }
    }
}

/// The gradient an update reads: `g`, plus `addend` when given (equal lengths).
pub type Gradient<'a> = (&'a [f32], Option<&'a [f32]>);

/// One AdamW step over `g` (plus its addend) and the state `[p, m, v]` in `io` (equal
/// lengths). Each line is one standard op of the lowering, rounded to float32 where it is:
/// Rust does not contract `a * b + c` into a fused multiply-add, so neither does this.
pub fn adamw_update(s: &AdamWScalars, gradient: Gradient<'_>, io: Io<'_, 3>) {
    with_widest_vectors!(adamw_portable(s, gradient, io))
}

#[inline(always)]
fn adamw_portable(s: &AdamWScalars, (g, addend): Gradient<'_>, io: Io<'_, 3>) {
    let n = g.len();
    assert!(
        io.common_len() == Some(n) && addend.is_none_or(|d| d.len() == n),
        "AdamWUpdate: operands of different lengths"
    );
    // One loop per variant, each monomorphised so that it vectorises.
    let gd = (&g[..n], addend.map_or(&[][..], |d| &d[..n]));
    match (addend.is_some(), s.divisor.map(Divisor::of)) {
        (false, None) => update_with(s, gd, |g, _, i| g[i], io, n),
        (false, Some(Divisor::Reciprocal(r))) => update_with(s, gd, |g, _, i| g[i] * r, io, n),
        (false, Some(Divisor::Other(k))) => update_with(s, gd, |g, _, i| g[i] / k, io, n),
        (true, None) => update_with(s, gd, |g, d, i| g[i] + d[i], io, n),
        (true, Some(Divisor::Reciprocal(r))) => {
            update_with(s, gd, |g, d, i| (g[i] + d[i]) * r, io, n)
        }
        (true, Some(Divisor::Other(k))) => update_with(s, gd, |g, d, i| (g[i] + d[i]) / k, io, n),
    }
}

/// A gradient's element `i` from the gradient `g` and its addend `d` (empty when none),
/// given the slices rather than capturing them, so that a loop over blocks can hand it a
/// block's, of a length the compiler knows: an index it cannot prove in bounds keeps a
/// loop from vectorising.
trait GradAt: Fn(&[f32], &[f32], usize) -> f32 {}
impl<F: Fn(&[f32], &[f32], usize) -> f32> GradAt for F {}

/// How a kernel divides the window's gradient sum by its count K.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Divisor {
    /// K is a power of two whose reciprocal `r` is a normal float: `x * r` is then the same
    /// real number as `x / K` (a scaling by a power of two), and both operations round it
    /// correctly, so they give the same bits for every x, subnormal results, zeros,
    /// infinities and NaN included. A multiplication costs a fraction of a division: the
    /// AdamW update of 8320 elements, hot in L1, ran 4.4 µs with the division and 3.0
    /// without (benches/README.md, "Run U"; from 131K elements up the bytes bound it).
    Reciprocal(f32),
    /// Any other K: divided, as the standard op does.
    Other(f32),
}

impl Divisor {
    fn of(k: f32) -> Divisor {
        let bits = k.to_bits();
        let (exponent, mantissa) = ((bits >> 23) & 0xff, bits & 0x7f_ffff);
        // 2^e with e in -126..=126: its reciprocal 2^-e is normal and finite.
        match mantissa == 0 && (1..=253).contains(&exponent) {
            true => Divisor::Reciprocal(1.0 / k),
            false => Divisor::Other(k),
        }
    }
}

/// The update with gradient element `grad_at(g, d, i)`.
#[inline(always)]
fn update_with(
    s: &AdamWScalars,
    (g, d): (&[f32], &[f32]),
    grad_at: impl GradAt,
    io: Io<'_, 3>,
    n: usize,
) {
    let grad = |i| grad_at(g, d, i);
    match (s.corrections, s.lr_wd) {
        (None, None) => each(io, n, |i, [p, m, v]| {
            let (m1, v1) = moments(s, grad(i), m, v);
            let delta = (m1 * s.lr) / (v1.sqrt() + s.epsilon);
            [p - delta, m1, v1]
        }),
        (None, Some(k)) => each(io, n, |i, [p, m, v]| {
            let (m1, v1) = moments(s, grad(i), m, v);
            let delta = (m1 * s.lr) / (v1.sqrt() + s.epsilon);
            let stepped = p - delta;
            [stepped - stepped * k, m1, v1]
        }),
        (Some((a, c)), wd) => match (KnownDivisor::new(c), io) {
            // v'/c without dividing, where the values allow (`quotient`): the same bits.
            (Some(divisor), Io::InPlace(state)) => {
                corrected_in_place(s, (a, divisor), wd, (g, d, grad_at), state, n)
            }
            (_, io) => each(
                io,
                n,
                #[inline(always)]
                |i, [p, m, v]| {
                    let (m1, v1) = moments(s, grad(i), m, v);
                    [corrected(s, a, wd, p, m1, v1 / c), m1, v1]
                },
            ),
        },
    }
}

/// Mode 0's update in place, by blocks of 64 elements, `v'/c` without a division
/// ([`KnownDivisor::quotient`]). A block where a `v'` is out of the divisor's range
/// ([`KnownDivisor::takes`]) or a quotient is refused computes its parameters again from
/// the saved ones, dividing: the same bits either way.
#[inline(always)]
fn corrected_in_place(
    s: &AdamWScalars,
    (a, divisor): (f32, KnownDivisor),
    wd: Option<f32>,
    (g, d, grad_at): (&[f32], &[f32], impl GradAt),
    [p, m, v]: [&mut [f32]; 3],
    n: usize,
) {
    const BLOCK: usize = 64;
    let c = divisor.divisor();
    // Blocks as arrays of a fixed length: loops the compiler vectorises whole.
    let (p_blocks, p_tail) = p[..n].as_chunks_mut::<BLOCK>();
    let (m_blocks, m_tail) = m[..n].as_chunks_mut::<BLOCK>();
    let (v_blocks, v_tail) = v[..n].as_chunks_mut::<BLOCK>();
    let (g_blocks, g_tail) = g.as_chunks::<BLOCK>();
    // The addend's blocks, zeros without one (never read then).
    let (d_blocks, d_tail) = d.as_chunks::<BLOCK>();
    let (zeros, mut d_blocks) = ([0f32; BLOCK], d_blocks.iter());
    let mut saved = [0f32; BLOCK];
    let blocks = p_blocks
        .iter_mut()
        .zip(m_blocks)
        .zip(v_blocks)
        .zip(g_blocks);
    for (((p, m), v), gb) in blocks {
        let db = d_blocks.next().unwrap_or(&zeros);
        let mut refused = 0u32;
        for l in 0..BLOCK {
            let (m1, v1) = moments(s, grad_at(gb, db, l), m[l], v[l]);
            (m[l], v[l]) = (m1, v1);
            let (q, exact) = divisor.quotient(v1);
            refused |= !(divisor.takes(v1) & exact) as u32;
            saved[l] = p[l];
            p[l] = corrected(s, a, wd, p[l], m1, q);
        }
        // A value out of the range, or a quotient the check refused: the block's
        // parameters again, dividing.
        if refused != 0 {
            for l in 0..BLOCK {
                p[l] = corrected(s, a, wd, saved[l], m[l], v[l] / c);
            }
        }
    }
    for i in 0..p_tail.len() {
        let (m1, v1) = moments(s, grad_at(g_tail, d_tail, i), m_tail[i], v_tail[i]);
        (m_tail[i], v_tail[i]) = (m1, v1);
        p_tail[i] = corrected(s, a, wd, p_tail[i], m1, v1 / c);
    }
}

/// Mode 0's parameter step from the corrected second moment `q = v'/c`:
/// `p' = (p - p·lr_wd) - (m'·lr) / ((√q + ε)·a)`, the decay only with `wd`.
#[inline(always)]
fn corrected(s: &AdamWScalars, a: f32, wd: Option<f32>, p: f32, m1: f32, q: f32) -> f32 {
    let denom = (q.sqrt() + s.epsilon) * a;
    let decayed = match wd {
        Some(k) => p - p * k,
        None => p,
    };
    decayed - (m1 * s.lr) / denom
}

/// m' = m·α + g·(1-α),  v' = v·β + (g·(1-β))·g.
#[inline(always)]
fn moments(s: &AdamWScalars, g: f32, m: f32, v: f32) -> (f32, f32) {
    let m1 = m * s.alpha + g * s.one_minus_alpha;
    let v1 = v * s.beta + (g * s.one_minus_beta) * g;
    (m1, v1)
}

/// `SgdUpdate(p, g, lr, [buf], [mu], [wd], [g_addend], [g_divisor], [keep], [loss],
/// [addend_a], [addend_b]) -> (p', [buf'])`, attribute `nesterov` (0 or 1): one parameter's
/// SGD step in the optimizer pass's order of operations (`passes::optimizer`, bit-identical
/// in float32):
///
/// ```text
/// g = (g + g_addend) / g_divisor    (each when given, as for AdamWUpdate)
/// with wd:       g = g + p·wd       (L2)
/// with buf, mu:  buf' = buf·mu + g;  d = nesterov ? g + buf'·mu : buf'     (else d = g)
/// p' = p - lr·d
/// ```
///
/// The `accumulator` attribute and the addend as a product as for [`ADAMW_UPDATE`].
pub const SGD_UPDATE: &str = "SgdUpdate";

/// Input slots of [`SGD_UPDATE`]; scalars are one-element float32 tensors.
pub mod sgd_slot {
    pub const PARAM: usize = 0;
    pub const GRAD: usize = 1;
    pub const LR: usize = 2;
    /// The momentum buffer (optional; with it, `MU` too and a second output).
    pub const BUF: usize = 3;
    pub const MU: usize = 4;
    /// L2 weight decay (optional).
    pub const WD: usize = 5;
    pub const GRAD_ADDEND: usize = 6;
    pub const GRAD_DIVISOR: usize = 7;
    /// The gate ([`super::keeps`]).
    pub const KEEP: usize = 8;
    pub const LOSS: usize = super::loss_slot(KEEP);
    /// The addend as the operands of its product (as [`super::adamw_slot::ADDEND_A`]).
    pub const ADDEND_A: usize = 10;
    pub const ADDEND_B: usize = 11;
    /// Ordering inputs from here on (see the module's comment).
    pub const AFTER: usize = 12;
    pub const COUNT: usize = 12;
}

/// The scalars of one [`SGD_UPDATE`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    pub lr: f32,
    /// `Some((mu, nesterov))` with a momentum buffer.
    pub momentum: Option<(f32, bool)>,
    pub wd: Option<f32>,
    pub divisor: Option<f32>,
}

impl SgdScalars {
    /// The scalars of an [`SGD_UPDATE`] node, `scalar(slot)` reading its input `slot`
    /// (`None`: absent); `has_buffer`: whether it updates a momentum buffer.
    pub fn read<E: From<String>>(
        nesterov: bool,
        has_buffer: bool,
        scalar: impl Fn(usize) -> Result<Option<f32>, E>,
    ) -> Result<SgdScalars, E> {
        let lr = scalar(sgd_slot::LR)?.ok_or_else(|| E::from("no learning rate".to_string()))?;
        let mu = scalar(sgd_slot::MU)?;
        if has_buffer != mu.is_some() {
            return Err(E::from(
                "a momentum buffer and its momentum come together".to_string(),
            ));
        }
        Ok(SgdScalars {
            lr,
            momentum: mu.map(|mu| (mu, nesterov)),
            wd: scalar(sgd_slot::WD)?,
            divisor: scalar(sgd_slot::GRAD_DIVISOR)?,
        })
    }
}

/// The state an SGD step updates: the parameter, and its momentum buffer when it has one.
pub enum SgdIo<'a> {
    Plain(Io<'a, 1>),
    Momentum(Io<'a, 2>),
}

/// One SGD step over `g` (plus its addend) and the state in `io` (equal lengths).
pub fn sgd_update(s: &SgdScalars, gradient: Gradient<'_>, io: SgdIo<'_>) {
    with_widest_vectors!(sgd_portable(s, gradient, io))
}

#[inline(always)]
fn sgd_portable(s: &SgdScalars, (g, addend): Gradient<'_>, io: SgdIo<'_>) {
    let n = g.len();
    let len = match &io {
        SgdIo::Plain(io) => io.common_len(),
        SgdIo::Momentum(io) => io.common_len(),
    };
    assert!(
        len == Some(n)
            && addend.is_none_or(|d| d.len() == n)
            && matches!(io, SgdIo::Momentum(_)) == s.momentum.is_some(),
        "SgdUpdate: operands of different lengths, or a buffer without its momentum"
    );
    let (g, addend) = (&g[..n], addend.map(|d| &d[..n]));
    match (addend, s.divisor.map(Divisor::of)) {
        (None, None) => sgd_with(s, |i| g[i], io, n),
        (None, Some(Divisor::Reciprocal(r))) => sgd_with(s, |i| g[i] * r, io, n),
        (None, Some(Divisor::Other(k))) => sgd_with(s, |i| g[i] / k, io, n),
        (Some(d), None) => sgd_with(s, |i| g[i] + d[i], io, n),
        (Some(d), Some(Divisor::Reciprocal(r))) => sgd_with(s, |i| (g[i] + d[i]) * r, io, n),
        (Some(d), Some(Divisor::Other(k))) => sgd_with(s, |i| (g[i] + d[i]) / k, io, n),
    }
}

#[inline(always)]
fn sgd_with(s: &SgdScalars, grad: impl Fn(usize) -> f32, io: SgdIo<'_>, n: usize) {
    match s.wd {
        // L2 as its own monomorphised gradient, so that each loop below stays branch-free
        // and vectorises (a branch on wd inside the loop kept it scalar: 8x slower).
        Some(wd) => sgd_loops(s, |i, p| grad(i) + p * wd, io, n),
        None => sgd_loops(s, |i, _| grad(i), io, n),
    }
}

/// The loops, with gradient element `grad(i, p)` (p: the parameter's element).
#[inline(always)]
fn sgd_loops(s: &SgdScalars, grad: impl Fn(usize, f32) -> f32, io: SgdIo<'_>, n: usize) {
    let lr = s.lr;
    match (s.momentum, io) {
        (Some((mu, true)), SgdIo::Momentum(io)) => each(io, n, |i, [p, buf]| {
            let g = grad(i, p);
            let b = buf * mu + g;
            [p - lr * (g + b * mu), b]
        }),
        (Some((mu, false)), SgdIo::Momentum(io)) => each(io, n, |i, [p, buf]| {
            let b = buf * mu + grad(i, p);
            [p - lr * b, b]
        }),
        (_, SgdIo::Plain(io)) => each(io, n, |i, [p]| [p - lr * grad(i, p)]),
        // sgd_update checked that a buffer comes with its momentum.
        (None, SgdIo::Momentum(_)) => unreachable!("SgdUpdate: a buffer without momentum"),
    }
}

/// `AccumulateGrad(acc, g, [keep], [loss]) -> acc'`: the window's gradient sum,
/// `acc' = acc + g` element by element (the standard `Add` it replaces, bit-identical), with
/// the gate of every fused update ([`keeps`]).
pub const ACCUMULATE_GRAD: &str = "AccumulateGrad";

pub mod accumulate_slot {
    pub const ACC: usize = 0;
    pub const GRAD: usize = 1;
    /// The gate ([`super::keeps`]).
    pub const KEEP: usize = 2;
    pub const LOSS: usize = super::loss_slot(KEEP);
    /// Ordering inputs from here on (see the module's comment).
    pub const AFTER: usize = 4;
    pub const COUNT: usize = 4;
}

/// `acc' = acc + g` over `io` (`[acc]`).
pub fn accumulate_grad(g: &[f32], io: Io<'_, 1>) {
    with_widest_vectors!(accumulate_portable(g, io))
}

#[inline(always)]
fn accumulate_portable(g: &[f32], io: Io<'_, 1>) {
    let n = g.len();
    assert!(
        io.common_len() == Some(n),
        "AccumulateGrad: operands of different lengths"
    );
    let g = &g[..n];
    each(io, n, |i, [acc]| [acc + g[i]]);
}

/// The gate of every fused update, from its two optional inputs: `keep` (a bool scalar at
/// its `KEEP` slot) and `loss` (a float32 scalar at its `LOSS` slot, the one after `KEEP`).
/// The update is made when `keep` is true or `loss` is finite, each of the two counting only
/// when given, and always when neither is; otherwise the node leaves its state as it was
/// (outputs equal to inputs; in place, untouched), and a state updated in place needs no
/// copy to put back.
///
/// The fuse pass gives the step's loss and the input [`KEEP_NONFINITE`], which the trainer
/// feeds true unless it discards a micro-step with a non-finite loss (`OnNonFinite::Stop`
/// or `Skip` without loss scaling). The kernels read the loss themselves: ONNX has no
/// IsFinite, and `Or(Not(Or(IsNaN, IsInf)), keep)` is five more nodes in every session.
pub fn keeps(keep: Option<bool>, loss: Option<f32>) -> bool {
    match (keep, loss) {
        (None, None) => true,
        (keep, loss) => keep == Some(true) || loss.is_some_and(f32::is_finite),
    }
}

/// The gate's `LOSS` slot of a fused operator whose `KEEP` slot is `keep_slot`: the one after
/// it, in every slot module (`LOSS = KEEP + 1`), so that code generic over the operators
/// finds both from one number.
pub const fn loss_slot(keep_slot: usize) -> usize {
    keep_slot + 1
}

pub const KEEP_NONFINITE: &str = "ga.keep_nonfinite";

#[cfg(test)]
mod tests {
    use super::*;

    /// The gate as the session's standard ops wrote it before the kernels read the loss:
    /// `Or(Not(Or(IsNaN(loss), IsInf(loss))), keep)`, each input counting when given.
    #[test]
    fn the_gate_keeps_a_finite_loss_or_what_the_host_keeps() {
        let losses = [None, Some(0.5), Some(-0.0), Some(f32::MAX), Some(f32::NAN)];
        let losses = losses
            .into_iter()
            .chain([Some(f32::INFINITY), Some(f32::NEG_INFINITY)]);
        for loss in losses {
            for keep in [None, Some(false), Some(true)] {
                let finite = loss.map(|l| !(l.is_nan() || l.is_infinite()));
                let expected = match (keep, finite) {
                    (None, None) => true,
                    (Some(k), None) => k,
                    (None, Some(f)) => f,
                    (Some(k), Some(f)) => f || k,
                };
                assert_eq!(keeps(keep, loss), expected, "keep {keep:?}, loss {loss:?}");
            }
        }
    }

    /// AdamW's usual scalars (β 0.9 and 0.999, ε 1e-8, lr 1e-3) with these corrections,
    /// weight decay and divisor.
    fn adamw(corrections: Option<(f32, f32)>, lr_wd: f32, divisor: Option<f32>) -> AdamWScalars {
        AdamWScalars {
            alpha: 0.9,
            one_minus_alpha: 1.0 - 0.9,
            beta: 0.999,
            one_minus_beta: 1.0 - 0.999,
            epsilon: 1e-8,
            lr: 1e-3,
            corrections,
            lr_wd: Some(lr_wd),
            divisor,
        }
    }

    /// The closed form in float64 agrees with the float32 update to float32 rounding.
    #[test]
    fn adamw_update_is_adamw() {
        let corrections = (1.0 - 0.9f32.powi(3), 1.0 - 0.999f32.powi(3));
        let s = adamw(Some(corrections), 1e-3 * 1e-2, None);
        let (p, g, m, v) = (
            [0.5f32, -1.5],
            [0.25f32, 3.0],
            [0.1f32, -0.2],
            [0.01f32, 0.5],
        );
        let (mut po, mut mo, mut vo) = ([0f32; 2], [0f32; 2], [0f32; 2]);
        adamw_update(
            &s,
            (&g, None),
            Io::Apart([&p, &m, &v], [&mut po, &mut mo, &mut vo]),
        );
        // In place: the same numbers.
        let (mut pi, mut mi, mut vi) = (p, m, v);
        adamw_update(&s, (&g, None), Io::InPlace([&mut pi, &mut mi, &mut vi]));
        assert_eq!((pi, mi, vi), (po, mo, vo));
        for i in 0..2 {
            let f = |x: f32| x as f64;
            let m1 = f(m[i]) * f(s.alpha) + f(g[i]) * f(s.one_minus_alpha);
            let v1 = f(v[i]) * f(s.beta) + f(g[i]) * f(g[i]) * f(s.one_minus_beta);
            let (a, c) = s.corrections.map(|(a, c)| (f(a), f(c))).unwrap();
            let p1 = f(p[i]) * (1.0 - f(s.lr_wd.unwrap()))
                - f(s.lr) * m1 / (a * ((v1 / c).sqrt() + f(s.epsilon)));
            for (got, want) in [(po[i], p1), (mo[i], m1), (vo[i], v1)] {
                assert!(
                    (f(got) - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs(),
                    "{got} vs {want}"
                );
            }
        }
    }

    /// x * (1/K) and x / K give the same bits for every power-of-two K the kernels take a
    /// reciprocal of, over bit patterns of every class (normal, subnormal, zero, infinity,
    /// NaN), and the kernels divide by any other K.
    #[test]
    fn a_power_of_two_divisor_multiplies_to_the_same_bits() {
        let powers = [
            2f32.powi(-126),
            0.25,
            0.5,
            1.0,
            2.0,
            4.0,
            8.0,
            1024.0,
            -4.0,
            2f32.powi(126),
        ];
        for k in powers {
            assert_eq!(Divisor::of(k), Divisor::Reciprocal(1.0 / k), "{k}");
        }
        for k in [
            3.0f32,
            6.0,
            2f32.powi(127),
            2f32.powi(-127),
            0.0,
            f32::INFINITY,
            f32::NAN,
        ] {
            assert!(matches!(Divisor::of(k), Divisor::Other(_)), "{k}");
        }
        // A xorshift over all 32-bit patterns, plus the edges of each class.
        let mut state = 0x9e37_79b9u32;
        let mut xs: Vec<f32> = (0..1 << 18)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                f32::from_bits(state)
            })
            .collect();
        xs.extend([
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::MAX,
            f32::INFINITY,
        ]);
        xs.extend([f32::NEG_INFINITY, f32::NAN, f32::from_bits(0x7f80_0001)]);
        for k in powers {
            let r = 1.0 / k;
            for &x in &xs {
                assert_eq!((x / k).to_bits(), (x * r).to_bits(), "{x:e} / {k:e}");
            }
        }
        // Through the kernels: the same bits as the division written out.
        let n = 1000;
        let g: Vec<f32> = xs[..n].iter().map(|x| x.clamp(-1e30, 1e30)).collect();
        let d: Vec<f32> = xs[n..2 * n].iter().map(|x| x.clamp(-1e30, 1e30)).collect();
        for k in [4.0f32, 3.0, 0.5] {
            let s = adamw(None, 1e-5, Some(k));
            let (p, m, v) = (vec![0.5f32; n], vec![0.01f32; n], vec![0.02f32; n]);
            let (mut po, mut mo, mut vo) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            let io = Io::Apart([&p, &m, &v], [&mut po, &mut mo, &mut vo]);
            adamw_update(&s, (&g, Some(&d)), io);
            for i in 0..n {
                let grad = (g[i] + d[i]) / k;
                let m1 = m[i] * s.alpha + grad * s.one_minus_alpha;
                let v1 = v[i] * s.beta + (grad * s.one_minus_beta) * grad;
                let stepped = p[i] - (m1 * s.lr) / (v1.sqrt() + s.epsilon);
                let p1 = stepped - stepped * s.lr_wd.unwrap();
                for (got, want) in [(po[i], p1), (mo[i], m1), (vo[i], v1)] {
                    assert_eq!(got.to_bits(), want.to_bits(), "AdamW, K = {k}, element {i}");
                }
            }
            let sgd = SgdScalars {
                lr: 0.1,
                momentum: None,
                wd: None,
                divisor: Some(k),
            };
            let mut out = vec![0f32; n];
            sgd_update(
                &sgd,
                (&g, Some(&d)),
                SgdIo::Plain(Io::Apart([&p], [&mut out])),
            );
            for i in 0..n {
                let want = p[i] - 0.1 * ((g[i] + d[i]) / k);
                assert_eq!(
                    out[i].to_bits(),
                    want.to_bits(),
                    "SGD, K = {k}, element {i}"
                );
            }
        }
    }

    /// Mode 0 in place (its `v'/c` without a division where a block's values allow,
    /// `quotient`) gives the bits of the update written out with the division, for every
    /// gradient variant, with and without decay: over blocks whose second moments are all
    /// in range, blocks holding a zero, a subnormal, a huge value or a NaN, and a tail.
    #[test]
    fn the_bias_correction_skips_its_division_to_the_same_bits() {
        let n = 64 * 6 + 37;
        let mut state = 0x1234_5679u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 8) as f32 / (1 << 24) as f32
        };
        let g: Vec<f32> = (0..n).map(|_| next() * 2.0 - 1.0).collect();
        let d: Vec<f32> = (0..n).map(|_| next() - 0.5).collect();
        let p: Vec<f32> = (0..n).map(|_| next() * 4.0 - 2.0).collect();
        let m: Vec<f32> = (0..n).map(|_| (next() - 0.5) * 0.1).collect();
        let mut v: Vec<f32> = (0..n).map(|_| next() * next() * 0.01).collect();
        // Blocks 2 to 5 hold one value out of the divisor-free range each.
        for (block, x) in [(2, 0.0), (3, 1e-40), (4, 3e30), (5, f32::NAN)] {
            v[block * 64 + 17] = x;
        }
        for t in [1, 2, 10, 1000] {
            let corrections = (1.0 - 0.9f32.powi(t), 1.0 - 0.999f32.powi(t));
            for (lr_wd, addend, divisor) in [
                (None, false, None),
                (Some(1e-2f32), true, Some(4.0f32)),
                (Some(1e-2), false, Some(3.0)),
                (None, true, None),
            ] {
                let mut s = adamw(Some(corrections), lr_wd.unwrap_or(0.0), divisor);
                s.lr_wd = lr_wd;
                let addend = addend.then_some(&d[..]);
                let (mut pi, mut mi, mut vi) = (p.clone(), m.clone(), v.clone());
                adamw_update(&s, (&g, addend), Io::InPlace([&mut pi, &mut mi, &mut vi]));
                let (a, c) = corrections;
                for i in 0..n {
                    let mut grad = match addend {
                        Some(d) => g[i] + d[i],
                        None => g[i],
                    };
                    if let Some(k) = divisor {
                        grad /= k;
                    }
                    let m1 = m[i] * s.alpha + grad * s.one_minus_alpha;
                    let v1 = v[i] * s.beta + (grad * s.one_minus_beta) * grad;
                    let decayed = lr_wd.map_or(p[i], |k| p[i] - p[i] * k);
                    let p1 = decayed - (m1 * s.lr) / (((v1 / c).sqrt() + s.epsilon) * a);
                    for (got, want) in [(pi[i], p1), (mi[i], m1), (vi[i], v1)] {
                        assert_eq!(got.to_bits(), want.to_bits(), "t {t}, element {i}");
                    }
                }
            }
        }
    }

    /// Nesterov with L2 and the mean folded in, against the closed form in float64.
    #[test]
    fn sgd_update_is_nesterov() {
        let s = SgdScalars {
            lr: 0.1,
            momentum: Some((0.9, true)),
            wd: Some(0.01),
            divisor: Some(4.0),
        };
        let (p, g, d, buf) = (
            [1.0f32, -2.0],
            [0.5f32, 1.5],
            [0.25f32, -0.5],
            [0.1f32, 0.2],
        );
        let (mut po, mut bo) = ([0f32; 2], [0f32; 2]);
        let io = SgdIo::Momentum(Io::Apart([&p, &buf], [&mut po, &mut bo]));
        sgd_update(&s, (&g, Some(&d)), io);
        let (mut pi, mut bi) = (p, buf);
        sgd_update(
            &s,
            (&g, Some(&d)),
            SgdIo::Momentum(Io::InPlace([&mut pi, &mut bi])),
        );
        assert_eq!((pi, bi), (po, bo));
        for i in 0..2 {
            let f = |x: f32| x as f64;
            let grad = (f(g[i]) + f(d[i])) / 4.0 + f(p[i]) * f(0.01);
            let b = f(buf[i]) * f(0.9) + grad;
            let p1 = f(p[i]) - f(0.1) * (grad + b * f(0.9));
            for (got, want) in [(po[i], p1), (bo[i], b)] {
                assert!((f(got) - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs().max(1.0));
            }
        }
    }
}
