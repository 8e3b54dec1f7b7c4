//! onnx-ga's fused operators ([`crate::fused_ops`]) as ONNX Runtime custom operators
//! (CPU), registered with every session [`super::ort::OrtSession`] opens with
//! `fused_kernels`. A model only contains them after `passes::fuse` ran on it in
//! memory; files never do.

use std::sync::{Arc, Mutex};

use ::ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorDomain, OperatorInput,
    OperatorOutput, ShapeInferenceContext,
};
use ::ort::value::TensorElementType;

use super::deferred_products::{DeferredProducts, Kept, ProductPair};
use super::kernel_io;

use crate::fused_ops::{
    accumulate_grad, accumulate_product_slot, accumulate_products, accumulate_slot,
    adamw_group_slot, adamw_slot, adamw_update, batch_norm_grad_channel, batch_norm_train_channel,
    blocked_weight, conv_weight_grad_slot, folded_size, gelu_forward_slot, gelu_grad,
    gelu_quotient, gelu_slot, gelu_tail, largest_fast_contraction, layer_norm_grad_rows,
    layer_norm_grad_slot, leading_sum, relu_grad, sgd_slot, sgd_update, AdamWScalars,
    BatchNormLayout, ChannelStats, GeluGradScalars, GeluScalars, Io, ProductLayout, ProductShape,
    RowLayout, SgdIo, SgdScalars, SumFrom, Unfolding, Window2d, ACCUMULATE_GRAD,
    ACCUMULATE_PRODUCT, ADAMW_UPDATE, ADAMW_UPDATES, BATCH_NORM_GRAD, BATCH_NORM_TRAIN,
    BLOCKED_WEIGHT, COL2IM, CONV_WEIGHT_GRAD, DOMAIN, GELU, GELU_GRAD, IM2COL, LAYER_NORM_GRAD,
    LAYER_NORM_GRAD_ROWS, LEADING_SUM, PRODUCT_ACCUMULATOR, PRODUCT_OVERWRITES, PRODUCT_TASK_ROWS,
    RELU_GRAD, ROW_TRANSPOSE, SGD_UPDATE,
};

/// The domain with every fused operator, for a session builder; its `AccumulateProduct`
/// keeps products in `deferred` when given (`super::deferred_products`).
pub fn domain(deferred: Option<Arc<DeferredProducts>>) -> ::ort::Result<OperatorDomain> {
    OperatorDomain::new(DOMAIN)?
        .add(AdamWUpdate {
            deferred: deferred.clone(),
        })?
        .add(AdamWUpdates)?
        .add(SgdUpdate {
            deferred: deferred.clone(),
        })?
        .add(AccumulateGrad)?
        .add(AccumulateProduct { deferred })?
        .add(BatchNormTrain)?
        .add(BatchNormGrad)?
        .add(Im2Col)?
        .add(Col2Im)?
        .add(ConvWeightGrad)?
        .add(RowTranspose)?
        .add(Gelu)?
        .add(GeluGrad)?
        .add(LayerNormGrad)?
        .add(ReluGrad)?
        .add(LeadingSum)?
        .add(BlockedWeight)
}

/// Runs `make_session`, serialised with every other until one session with the fused
/// domain (`with_domain`) has been made. ONNX Runtime 1.31.1 adds a custom domain to ONNX's
/// process-wide domain table when a session is made, checking first whether it is there,
/// without a lock: two sessions made at once on two threads can both add it, and the second
/// fails ("the domain is already exist", measured in the test harness's parallel tests). Once
/// it is in the table, the check finds it and sessions are made concurrently again.
pub fn first_registration<T, E>(
    with_domain: bool,
    make_session: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    static FIRST: Mutex<()> = Mutex::new(());
    if !with_domain || REGISTERED.load(Ordering::Acquire) {
        return make_session();
    }
    let _first = FIRST
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let made = make_session();
    if made.is_ok() {
        REGISTERED.store(true, Ordering::Release);
    }
    made
}

/// One input as a float32 slice (`None` when the optional input is absent).
/// Optional float input `slot` of `op`: `None` when absent.
fn optional_f32s<'c>(
    ctx: &'c ComputeContext,
    op: &str,
    slot: usize,
) -> ::ort::Result<Option<&'c [f32]>> {
    kernel_io::input(ctx, op, slot)?
        .map(|value| value.f32s(op, slot))
        .transpose()
}

/// Float input `slot` of `op`, which it requires: its shape and data.
fn f32_input<'c>(
    ctx: &'c ComputeContext,
    op: &str,
    slot: usize,
) -> ::ort::Result<(&'c [i64], &'c [f32])> {
    let value = kernel_io::required(ctx, op, slot)?;
    Ok((value.shape, value.f32s(op, slot)?))
}

/// Output `slot` of `op`, a float tensor of `shape`, to write.
fn f32_output<'c>(
    ctx: &'c ComputeContext,
    op: &str,
    slot: usize,
    shape: &[i64],
) -> ::ort::Result<&'c mut [f32]> {
    Ok(kernel_io::output(ctx, op, slot, shape)?.into_slice())
}

/// Elements per task of the intra-op thread pool, about: large enough that a task's
/// overhead is small, small enough that 2-4 threads share a 1M-element parameter evenly.
const CHUNK: usize = 1 << 16;

/// A cache line of floats: tasks that start at a multiple of it never share a line.
const LINE_FLOATS: usize = 16;

/// Elements per task for `len` elements in tasks of whole `unit`s: at most about [`CHUNK`]
/// (one unit where a unit is larger) and a power-of-two count of tasks, of equal size
/// where the units divide so, which the pool's 2 or 4 threads then share evenly (the MLP's
/// 802,816-element layer in tasks of CHUNK was 13 tasks: 7 on one thread, 6 on the other).
fn even_chunk(len: usize, unit: usize) -> usize {
    let unit = unit.max(1);
    let tasks = len.div_ceil(CHUNK).next_power_of_two();
    len.div_ceil(unit).div_ceil(tasks).max(1) * unit
}

/// Scalar input `slot` of a fused operator's node: `None` when the optional input is
/// absent, an error naming `op` when it is not one element.
fn scalar_input(ctx: &ComputeContext, op: &str, slot: usize) -> ::ort::Result<Option<f32>> {
    match optional_f32s(ctx, op, slot)? {
        None => Ok(None),
        Some([x]) => Ok(Some(*x)),
        Some(data) => Err(::ort::Error::new(format!(
            "{op}: input {slot} has {} elements, not one",
            data.len()
        ))),
    }
}

/// Scalar input `slot` of a fused operator's node that must be there: an error naming
/// `op` when it is absent or not one element.
fn required_scalar(ctx: &ComputeContext, op: &str, slot: usize) -> ::ort::Result<f32> {
    scalar_input(ctx, op, slot)?
        .ok_or_else(|| ::ort::Error::new(format!("{op}: input {slot} is missing")))
}

/// The gate of a fused update ([`crate::fused_ops::keeps`]) from its `keep` slot and the
/// `loss` slot after it.
fn gate(ctx: &ComputeContext, op: &str, keep_slot: usize) -> ::ort::Result<bool> {
    let keep = match kernel_io::input(ctx, op, keep_slot)? {
        None => None,
        Some(value) => match value.bools(op, keep_slot)? {
            [keep] => Some(*keep),
            data => {
                return Err(::ort::Error::new(format!(
                    "{op}: input {keep_slot} has {} elements, not one",
                    data.len()
                )))
            }
        },
    };
    let loss = scalar_input(ctx, op, crate::fused_ops::loss_slot(keep_slot))?;
    Ok(crate::fused_ops::keeps(keep, loss))
}

/// Runs a fused update of the `N` states at input slots `state` into outputs
/// `first_output..first_output + N`, all of one shape, `update(range, io)` per task
/// ([`even_chunk`] of cache lines). In place when the session
/// bound every output to its state's own buffer (`passes::fuse::in_place`), apart when it
/// bound none; with `keep` false the state stays as it was (in place: untouched).
fn run_update<const N: usize>(
    ctx: &ComputeContext,
    op: &str,
    state: [usize; N],
    first_output: usize,
    keep: bool,
    update: impl Fn(std::ops::Range<usize>, Io<'_, N>) + Sync,
) -> ::ort::Result<()> {
    run_update_by(ctx, op, (state, first_output), keep, LINE_FLOATS, update)
}

/// [`run_update`] in tasks of whole `unit`s of elements ([`even_chunk`]).
fn run_update_by<const N: usize>(
    ctx: &ComputeContext,
    op: &str,
    (state, first_output): ([usize; N], usize),
    keep: bool,
    unit: usize,
    update: impl Fn(std::ops::Range<usize>, Io<'_, N>) + Sync,
) -> ::ort::Result<()> {
    let inputs = state
        .iter()
        .map(|&slot| kernel_io::required(ctx, op, slot))
        .collect::<::ort::Result<Vec<_>>>()?;
    let len = inputs[0].len();
    if inputs.iter().any(|i| i.len() != len) {
        return Err(::ort::Error::new(format!(
            "{op}: the states it updates differ in size ({:?})",
            inputs.iter().map(|i| i.len()).collect::<Vec<_>>()
        )));
    }
    let shape = inputs[0].shape;
    let chunk = even_chunk(len, unit);
    let outputs = (first_output..first_output + N)
        .map(|slot| kernel_io::output(ctx, op, slot, shape))
        .collect::<::ort::Result<Vec<_>>>()?;
    let aliased: Vec<bool> = outputs
        .iter()
        .zip(&inputs)
        .map(|(o, i)| o.address() == i.address())
        .collect();
    let in_place = aliased.iter().all(|&a| a);
    if !in_place && aliased.iter().any(|&a| a) {
        return Err(::ort::Error::new(format!(
            "{op}: only some of its outputs share their input's buffer ({aliased:?})"
        )));
    }
    // In place, the states are read through their outputs alone (the same memory).
    let sources: Vec<&[f32]> = match in_place {
        true => Vec::new(),
        false => inputs
            .iter()
            .zip(state)
            .map(|(i, slot)| i.f32s(op, slot))
            .collect::<::ort::Result<_>>()?,
    };
    let mut outs: Vec<&mut [f32]> = outputs
        .into_iter()
        .map(kernel_io::Output::into_slice)
        .collect();
    if !keep {
        if !in_place {
            for (out, input) in outs.iter_mut().zip(&sources) {
                out.copy_from_slice(input);
            }
        }
        return Ok(());
    }
    let outs: [&mut [f32]; N] = outs
        .try_into()
        .map_err(|_| ::ort::Error::new(format!("{op}: {N} outputs expected")))?;
    let mut pieces = outs.map(|o| o.chunks_mut(chunk));
    let chunks = std::iter::from_fn(|| {
        let next: [Option<&mut [f32]>; N] = std::array::from_fn(|k| pieces[k].next());
        next.iter()
            .all(Option::is_some)
            .then(|| next.map(|p| p.unwrap_or_default()))
    });
    in_chunks(ctx, (len, chunk), chunks, |range, out| {
        let io = match in_place {
            true => Io::InPlace(out),
            false => Io::Apart(std::array::from_fn(|k| &sources[k][range.clone()]), out),
        };
        update(range, io)
    })
}

struct AdamWUpdate {
    /// The trainer's kept products, in its apply session
    /// (`SessionOptions::deferred_products`).
    deferred: Option<Arc<DeferredProducts>>,
}

impl Operator for AdamWUpdate {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ADAMW_UPDATE
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..adamw_slot::COUNT)
            .map(|slot| match slot {
                adamw_slot::A
                | adamw_slot::C
                | adamw_slot::LR_WD
                | adamw_slot::GRAD_ADDEND
                | adamw_slot::GRAD_DIVISOR
                | adamw_slot::LOSS
                | adamw_slot::ADDEND_A
                | adamw_slot::ADDEND_B => OperatorInput::optional(TensorElementType::Float32),
                adamw_slot::KEEP => OperatorInput::optional(TensorElementType::Bool),
                _ => OperatorInput::required(TensorElementType::Float32),
            })
            .chain([OperatorInput::variadic(0)])
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [(); 3].map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let param = ctx.inputs()[adamw_slot::PARAM].clone();
        for slot in 0..3 {
            ctx.set_output(slot, &param)?;
        }
        Ok(())
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let with_kept = KeptSum {
            op: ADAMW_UPDATE,
            slots: GradientSlots {
                param: adamw_slot::PARAM,
                grad: adamw_slot::GRAD,
                addend: adamw_slot::GRAD_ADDEND,
                addend_product: [adamw_slot::ADDEND_A, adamw_slot::ADDEND_B],
            },
            deferred: summed_at_apply(&self.deferred, kctx),
            gemm: InvokedOp::gemm(kctx, [1, 0], ADAMW_UPDATE)?,
        };
        Ok(Box::new(move |ctx: &ComputeContext| {
            adamw_kernel(ctx, &with_kept)
        }))
    }
}

/// The scalars of an AdamW update from input slots `slots` ([`AdamWScalars::read`]).
fn adamw_scalars(
    ctx: &ComputeContext,
    op: &str,
    slots: [usize; adamw_group_slot::MEMBERS],
) -> ::ort::Result<AdamWScalars> {
    AdamWScalars::read(slots, |slot| {
        scalar_input(ctx, op, slot).map_err(|e| e.to_string())
    })
    .map_err(|message: String| ::ort::Error::new(format!("{op}: {message}")))
}

/// One parameter's AdamW update, its gradient as [`KeptSum`] reads it: with kept products
/// added, and the addend given as its product's operands, row block by row block.
fn adamw_kernel(ctx: &ComputeContext, with_kept: &KeptSum) -> ::ort::Result<()> {
    let s = adamw_scalars(ctx, ADAMW_UPDATE, adamw_group_slot::FROM_SINGLE)?;
    let keep = gate(ctx, ADAMW_UPDATE, adamw_slot::KEEP)?;
    let state = [adamw_slot::PARAM, adamw_slot::M, adamw_slot::V];
    with_kept.update(ctx, (state, keep), |gradient, io| {
        adamw_update(&s, gradient, io)
    })
}

/// Where an update's gradient comes from: its input slots.
struct GradientSlots {
    /// The parameter, whose shape the gradient has.
    param: usize,
    /// The gradient input (at an apply, the window's accumulator).
    grad: usize,
    addend: usize,
    /// The addend as its product's operands.
    addend_product: [usize; 2],
}

/// What an update's gradient is made of: its gradient input `g` (the window's accumulator
/// at an apply), and an addend added to it first, given (`g_addend`) or as the operands of
/// its product (`addend_a`, `addend_b`; `passes::fuse::apply_product`).
struct UpdateGradient<'c> {
    g: &'c [f32],
    addend: Option<&'c [f32]>,
    product: Option<AddendProduct<'c>>,
}

/// An addend `Aᵀ·B` given as `A` `[k, m]` and `B` `[k, n]`, the parameter `[m, n]`.
struct AddendProduct<'c> {
    a: &'c [f32],
    b: &'c [f32],
    shape: ProductShape,
    /// Both as ONNX Runtime's values, for its `Gemm`.
    values: [*const ::ort::sys::OrtValue; 2],
}

impl<'c> UpdateGradient<'c> {
    /// Reads them from `op`'s `slots`, checking that they are the parameter's size.
    fn read(
        ctx: &'c ComputeContext,
        op: &str,
        slots: &GradientSlots,
    ) -> ::ort::Result<UpdateGradient<'c>> {
        let GradientSlots {
            param: param_slot,
            grad: g_slot,
            addend: addend_slot,
            addend_product: [a_slot, b_slot],
        } = *slots;
        let param = kernel_io::required(ctx, op, param_slot)?;
        let len = param.len();
        let g = f32_input(ctx, op, g_slot)?.1;
        let addend = optional_f32s(ctx, op, addend_slot)?;
        if g.len() != len || addend.is_some_and(|a| a.len() != len) {
            return Err(::ort::Error::new(format!(
                "{op}: parameter ({len}), gradient ({}) and addend ({:?}) differ in size",
                g.len(),
                addend.map(<[f32]>::len)
            )));
        }
        let operands = (
            kernel_io::input(ctx, op, a_slot)?,
            kernel_io::input(ctx, op, b_slot)?,
        );
        let product = match operands {
            (None, None) => None,
            (Some(a), Some(b)) if addend.is_none() => {
                let dims = [a.shape, b.shape, param.shape];
                let shape = product_shape(op, dims, "the parameter")?;
                let (a_values, b_values) = (a.f32s(op, a_slot)?, b.f32s(op, b_slot)?);
                if a_values.len() != shape.k * shape.m || b_values.len() != shape.k * shape.n {
                    return Err(::ort::Error::new(format!(
                        "{op}: the addend's operands are not their shapes' sizes"
                    )));
                }
                Some(AddendProduct {
                    a: a_values,
                    b: b_values,
                    shape,
                    values: [a.value(), b.value()],
                })
            }
            _ => {
                return Err(::ort::Error::new(format!(
                    "{op}: an addend and its product's operands are given together, or one \
                     operand alone"
                )))
            }
        };
        Ok(UpdateGradient { g, addend, product })
    }
}

thread_local! {
    /// The window's gradient sum for the rows of one task of [`KeptSum::update`], one per
    /// thread that runs its tasks, kept between runs.
    static KEPT_SUM: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };

    /// Where [`KeptSum::update`] lays out an addend's operands when no trainer keeps
    /// products for the update (nothing kept in it), one per thread that runs sessions, kept
    /// between runs as [`PRODUCT_LAYOUT`] is.
    static ADDEND_LAYOUT: std::cell::RefCell<Kept> = std::cell::RefCell::new(Kept::default());
}

/// An optimizer update whose gradient is made as it is read: its gradient input an
/// accumulator that may be behind by the products the trainer keeps for it (a node told its
/// accumulator by `passes::fuse::apply_kept_sum`: `deferred` is the trainer's table and
/// that name), its addend given as its product's operands (`passes::fuse::apply_product`),
/// or both.
struct KeptSum {
    op: &'static str,
    slots: GradientSlots,
    deferred: Option<(Arc<DeferredProducts>, String)>,
    /// ONNX Runtime's `Gemm(A, B, transA = 1)`, for an addend's product past the kernel's
    /// `k`.
    gemm: InvokedOp,
}

impl KeptSum {
    /// The update of the states at `state`'s slots (the gate keeping) from the gradient
    /// [`UpdateGradient`] describes. With products kept for the accumulator, or the addend
    /// as its product's operands (where `k` suits the kernel), each task first makes its
    /// rows of the gradient in memory of its own thread (the accumulator's rows plus every
    /// kept product, then the addend's, in the order of `fused_ops::accumulate_products`:
    /// the bits the standard ops write; the kept products alone when they start from
    /// nothing), then runs `update` on those rows from it: the accumulator is not written,
    /// nor the addend's product. Otherwise `update` runs on the accumulator as it is, and
    /// the addend given or made by ONNX Runtime's `Gemm`. A discarded micro-step leaves
    /// what is kept for the next try.
    fn update<const N: usize>(
        &self,
        ctx: &ComputeContext,
        (state, keep): ([usize; N], bool),
        update: impl Fn((&[f32], Option<&[f32]>), Io<'_, N>) + Sync,
    ) -> ::ort::Result<()> {
        let UpdateGradient { g, addend, product } =
            UpdateGradient::read(ctx, self.op, &self.slots)?;
        if !keep {
            return run_update(ctx, self.op, state, 0, false, |_, _| {});
        }
        // Past the kernel's `k`, ONNX Runtime's product as the addend: the standard op's
        // bits and passes.
        let made;
        let (addend, own) = match product {
            Some(p) if p.shape.k > largest_fast_contraction() => {
                made = self.mlas_product(ctx, &p)?;
                (Some(made.extract_tensor().1), None)
            }
            Some(p) => (None, Some((p.a, p.b, p.shape))),
            None => (addend, None),
        };
        if let Some((table, name)) = &self.deferred {
            let mut kept = table.take(name);
            let ran = match kept.is_empty() && own.is_none() {
                true => None,
                false => Some(self.summed(ctx, state, (g, addend), (&mut kept, own), &update)),
            };
            table.put_back(name, kept);
            if let Some(ran) = ran {
                return ran;
            }
        } else if let Some(own) = own {
            return ADDEND_LAYOUT.with(|alone| match alone.try_borrow_mut() {
                Ok(mut alone) => {
                    self.summed(ctx, state, (g, addend), (&mut alone, Some(own)), &update)
                }
                Err(_) => Err(::ort::Error::new(format!(
                    "{}: its layout is in use on this thread",
                    self.op
                ))),
            });
        }
        run_update(ctx, self.op, state, 0, keep, |range, io| {
            update((&g[range.clone()], addend.map(|a| &a[range])), io)
        })
    }

    /// The update from the gradient made by its tasks (see [`Self::update`]): `kept`'s
    /// products, then `own` (the addend's operands), added to the accumulator `g`; `kept` is
    /// left empty once the update ran.
    fn summed<const N: usize>(
        &self,
        ctx: &ComputeContext,
        state: [usize; N],
        (g, addend): (&[f32], Option<&[f32]>),
        (kept, own): (&mut Kept, Option<ProductPair<'_>>),
        update: impl Fn((&[f32], Option<&[f32]>), Io<'_, N>) + Sync,
    ) -> ::ort::Result<()> {
        let op = self.op;
        let dims = kernel_io::required(ctx, op, self.slots.grad)?.shape;
        let own_sides = own.map(|(_, _, shape)| (shape.m, shape.n));
        let sides = match (kept.sides(), own_sides) {
            (Some(kept), Some(own)) if kept != own => None,
            (kept, own) => kept.or(own),
        };
        let (m, n) = match (dims, sides) {
            (&[m, n], Some(sides))
                if usize::try_from(m) == Ok(sides.0) && usize::try_from(n) == Ok(sides.1) =>
            {
                sides
            }
            (dims, sides) => {
                return Err(::ort::Error::new(format!(
                    "{op}: its accumulator {dims:?} is not the kept products' and the \
                     addend's {sides:?}"
                )))
            }
        };
        if m * n != g.len() {
            return Err(::ort::Error::new(format!(
                "{op}: the accumulator holds {} elements, not {m} x {n}",
                g.len()
            )));
        }
        let from = kept.from();
        let operands = kept.operands(own);
        let ran = run_update_by(
            ctx,
            op,
            (state, 0),
            true,
            PRODUCT_TASK_ROWS * n,
            |range, io| {
                let rows = (range.start / n, from);
                let sum_then_update = |sum: &mut Vec<f32>| {
                    sum.resize(range.len(), 0.0);
                    let acc = Io::Apart([&g[range.clone()]], [&mut sum[..]]);
                    accumulate_products(&operands, rows, acc);
                    update((&sum[..], addend.map(|a| &a[range.clone()])), io);
                };
                KEPT_SUM.with(|sum| match sum.try_borrow_mut() {
                    Ok(mut sum) => sum_then_update(&mut sum),
                    Err(_) => sum_then_update(&mut Vec::new()),
                })
            },
        );
        drop(operands);
        // Summed into the update: forgotten (after a failed run they stay, as the state does).
        if ran.is_ok() {
            kept.clear();
        }
        ran
    }

    /// ONNX Runtime's product of the addend's operands, in memory of its own.
    fn mlas_product(
        &self,
        ctx: &ComputeContext,
        p: &AddendProduct<'_>,
    ) -> ::ort::Result<::ort::value::Tensor<f32>> {
        let shape = [p.shape.m, p.shape.n];
        let mut made =
            ::ort::value::Tensor::<f32>::new(&::ort::memory::Allocator::default(), shape)?;
        use ::ort::AsPointer;
        self.gemm
            .run(RunningContext::of(ctx), &p.values, made.ptr_mut())?;
        Ok(made)
    }
}

/// The accumulator a fused update is told it reads (`passes::fuse::apply_kept_sum`), with
/// the trainer's table, which learns now, before any run, that this update sums what it
/// keeps for that accumulator.
fn summed_at_apply(
    deferred: &Option<Arc<DeferredProducts>>,
    kctx: &KernelContext<'_>,
) -> Option<(Arc<DeferredProducts>, String)> {
    match (deferred, kctx.get::<String>(PRODUCT_ACCUMULATOR)) {
        (Some(table), Some(name)) => {
            table.set_summed_at_apply(&name);
            Some((Arc::clone(table), name))
        }
        _ => None,
    }
}

struct AdamWUpdates;

impl Operator for AdamWUpdates {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ADAMW_UPDATES
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        use adamw_group_slot as at;
        (0..at::MEMBERS)
            .map(|slot| match slot {
                at::A | at::C | at::LR_WD | at::GRAD_DIVISOR => {
                    OperatorInput::optional(TensorElementType::Float32)
                }
                _ => OperatorInput::required(TensorElementType::Float32),
            })
            .chain([OperatorInput::variadic(4).homogenous(TensorElementType::Float32)])
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::variadic(3).homogenous(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let members = kctx.get::<i64>("members").unwrap_or(0);
        let members = usize::try_from(members)
            .ok()
            .filter(|&m| m > 0)
            .ok_or_else(|| {
                ::ort::Error::new(format!("{ADAMW_UPDATES}: attribute 'members' is {members}"))
            })?;
        let addends = kctx.get::<i64>("addends").unwrap_or(0) == 1;
        Ok(Box::new(move |ctx: &ComputeContext| {
            adamw_group_kernel(ctx, members, addends)
        }))
    }
}

/// Each member's update as [`adamw_kernel`] makes it, one after the other.
fn adamw_group_kernel(ctx: &ComputeContext, members: usize, addends: bool) -> ::ort::Result<()> {
    let s = adamw_scalars(ctx, ADAMW_UPDATES, std::array::from_fn(|k| k))?;
    let width = if addends { 5 } else { 4 };
    let have = ctx.num_inputs()?;
    if have != adamw_group_slot::MEMBERS + members * width {
        return Err(::ort::Error::new(format!(
            "{ADAMW_UPDATES}: {have} inputs for {members} members of {width}"
        )));
    }
    for k in 0..members {
        let first = adamw_group_slot::MEMBERS + k * width;
        let (grad, addend) = (first + 1, addends.then_some(first + 2));
        let (m, v) = (first + width - 2, first + width - 1);
        let g = f32_input(ctx, ADAMW_UPDATES, grad)?.1;
        let addend = match addend {
            Some(slot) => Some(f32_input(ctx, ADAMW_UPDATES, slot)?.1),
            None => None,
        };
        let len = kernel_io::required(ctx, ADAMW_UPDATES, first)?.len();
        if g.len() != len || addend.is_some_and(|a| a.len() != len) {
            return Err(::ort::Error::new(format!(
                "{ADAMW_UPDATES}: member {k}: parameter ({len}), gradient ({}) and addend \
                 ({:?}) differ in size",
                g.len(),
                addend.map(<[f32]>::len)
            )));
        }
        run_update(
            ctx,
            ADAMW_UPDATES,
            [first, m, v],
            3 * k,
            true,
            |range, io| {
                let gradient = (&g[range.clone()], addend.map(|a| &a[range]));
                adamw_update(&s, gradient, io);
            },
        )?;
    }
    Ok(())
}

/// Runs `update(range, outputs)` over `len` elements in chunks of `chunk` (at least one),
/// `outputs` giving each chunk's disjoint output slices in order: inline for one chunk, else
/// as tasks of ONNX Runtime's intra-op pool, each taking its chunk once.
fn in_chunks<O: Send>(
    ctx: &ComputeContext,
    (len, chunk): (usize, usize),
    outputs: impl Iterator<Item = O>,
    update: impl Fn(std::ops::Range<usize>, O) + Sync,
) -> ::ort::Result<()> {
    let tasks: Vec<Mutex<Option<O>>> = outputs.map(|o| Mutex::new(Some(o))).collect();
    let run = |i: usize| {
        if let Ok(Some(out)) = tasks[i].lock().map(|mut t| t.take()) {
            update(i * chunk..((i + 1) * chunk).min(len), out);
        }
    };
    match tasks.len() {
        0 => Ok(()),
        1 => {
            run(0);
            Ok(())
        }
        n => ctx.par_for(n, 0, run),
    }
}

struct SgdUpdate {
    /// The trainer's kept products, in its apply session
    /// (`SessionOptions::deferred_products`).
    deferred: Option<Arc<DeferredProducts>>,
}

impl Operator for SgdUpdate {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        SGD_UPDATE
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..sgd_slot::COUNT)
            .map(|slot| match slot {
                sgd_slot::PARAM | sgd_slot::GRAD | sgd_slot::LR => {
                    OperatorInput::required(TensorElementType::Float32)
                }
                sgd_slot::KEEP => OperatorInput::optional(TensorElementType::Bool),
                _ => OperatorInput::optional(TensorElementType::Float32),
            })
            .chain([OperatorInput::variadic(0)])
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [
            OperatorOutput::required(TensorElementType::Float32),
            OperatorOutput::optional(TensorElementType::Float32),
        ]
    }

    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        // Output 1 (the buffer) exists only with a buffer input, which the context cannot
        // tell from an omitted one: left to the kernel.
        let param = ctx.inputs()[sgd_slot::PARAM].clone();
        ctx.set_output(0, &param)
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let nesterov = kctx.get::<i64>("nesterov").unwrap_or(0) != 0;
        let with_kept = KeptSum {
            op: SGD_UPDATE,
            slots: GradientSlots {
                param: sgd_slot::PARAM,
                grad: sgd_slot::GRAD,
                addend: sgd_slot::GRAD_ADDEND,
                addend_product: [sgd_slot::ADDEND_A, sgd_slot::ADDEND_B],
            },
            deferred: summed_at_apply(&self.deferred, kctx),
            gemm: InvokedOp::gemm(kctx, [1, 0], SGD_UPDATE)?,
        };
        Ok(Box::new(move |ctx: &ComputeContext| {
            sgd_kernel(ctx, nesterov, &with_kept)
        }))
    }
}

/// One parameter's SGD update, with its momentum buffer when given, its gradient as in
/// [`adamw_kernel`].
fn sgd_kernel(ctx: &ComputeContext, nesterov: bool, with_kept: &KeptSum) -> ::ort::Result<()> {
    let has_buffer = kernel_io::input(ctx, SGD_UPDATE, sgd_slot::BUF)?.is_some();
    let s = SgdScalars::read(nesterov, has_buffer, |slot| {
        scalar_input(ctx, SGD_UPDATE, slot).map_err(|e| e.to_string())
    })
    .map_err(|message: String| ::ort::Error::new(format!("{SGD_UPDATE}: {message}")))?;
    let keep = gate(ctx, SGD_UPDATE, sgd_slot::KEEP)?;
    match has_buffer {
        true => with_kept.update(
            ctx,
            ([sgd_slot::PARAM, sgd_slot::BUF], keep),
            |gradient, io| sgd_update(&s, gradient, SgdIo::Momentum(io)),
        ),
        false => with_kept.update(ctx, ([sgd_slot::PARAM], keep), |gradient, io| {
            sgd_update(&s, gradient, SgdIo::Plain(io))
        }),
    }
}

struct AccumulateGrad;

impl Operator for AccumulateGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ACCUMULATE_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::optional(TensorElementType::Bool),
            OperatorInput::optional(TensorElementType::Float32),
            OperatorInput::variadic(0),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let acc = ctx.inputs()[accumulate_slot::ACC].clone();
        ctx.set_output(0, &acc)
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ::ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| accumulate_kernel(ctx)))
    }
}

fn accumulate_kernel(ctx: &ComputeContext) -> ::ort::Result<()> {
    let g = f32_input(ctx, ACCUMULATE_GRAD, accumulate_slot::GRAD)?.1;
    let keep = gate(ctx, ACCUMULATE_GRAD, accumulate_slot::KEEP)?;
    let len = kernel_io::required(ctx, ACCUMULATE_GRAD, accumulate_slot::ACC)?.len();
    if g.len() != len {
        return Err(::ort::Error::new(format!(
            "{ACCUMULATE_GRAD}: accumulator ({len}) and gradient ({}) differ in size",
            g.len()
        )));
    }
    run_update(
        ctx,
        ACCUMULATE_GRAD,
        [accumulate_slot::ACC],
        0,
        keep,
        |range, io| accumulate_grad(&g[range], io),
    )
}

struct AccumulateProduct {
    /// The trainer's kept products, in its accumulating session
    /// (`SessionOptions::deferred_products`).
    deferred: Option<Arc<DeferredProducts>>,
}

impl Operator for AccumulateProduct {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ACCUMULATE_PRODUCT
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::optional(TensorElementType::Bool),
            OperatorInput::optional(TensorElementType::Float32),
            OperatorInput::variadic(0),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [
            OperatorOutput::required(TensorElementType::Float32),
            OperatorOutput::optional(TensorElementType::Float32),
        ]
    }

    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        // Output 1, the product where ONNX Runtime's Gemm makes it, is the accumulator's
        // shape too.
        let acc = ctx.inputs()[accumulate_product_slot::ACC].clone();
        ctx.set_output(0, &acc)?;
        ctx.set_output(1, &acc)
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let gemm = InvokedOp::gemm_transposed_a(kctx)?;
        // Products are kept only where the trainer keeps them and knows the accumulator.
        let deferred = match (&self.deferred, kctx.get::<String>(PRODUCT_ACCUMULATOR)) {
            (Some(table), Some(name)) => Some((Arc::clone(table), name)),
            _ => None,
        };
        let overwrites = kctx.get::<i64>(PRODUCT_OVERWRITES).unwrap_or(0) == 1;
        Ok(Box::new(move |ctx: &ComputeContext| {
            accumulate_product_kernel(ctx, &gemm, deferred.as_ref(), overwrites)
        }))
    }
}

/// An operator of ONNX Runtime's own, made once per kernel and run from inside it
/// (`InvokeOp`) on values of the running kernel: its computation and bits where onnx-ga's
/// kernel fuses what surrounds it.
struct InvokedOp {
    op: std::ptr::NonNull<::ort::sys::OrtOp>,
    /// What it is, for errors ("ONNX Runtime's Gemm").
    what: &'static str,
    /// The fused operator that runs it.
    owner: &'static str,
}

// SAFETY: the operator is made once and never changed; ONNX Runtime runs an operator's
// kernel from whichever thread runs the session, as it runs its own, and its kernels'
// `Compute` keeps no state between calls.
unsafe impl Send for InvokedOp {}
unsafe impl Sync for InvokedOp {}

/// One attribute of an operator made by [`InvokedOp::new`]: its name, a pointer to its one
/// value, and the value's kind.
type OpAttribute<'a> = (
    &'a std::ffi::CStr,
    *const std::ffi::c_void,
    ::ort::sys::OrtOpAttrType,
);

impl InvokedOp {
    /// `op_type` of the standard domain at opset `version`, float32, `inputs` inputs and one
    /// output, with `attributes` (CreateOp takes no defaults: every attribute the kernel
    /// reads).
    fn new(
        info: &KernelContext<'_>,
        (op_type, version): (&std::ffi::CStr, i32),
        attributes: &[OpAttribute<'_>],
        inputs: i32,
        (owner, what): (&'static str, &'static str),
    ) -> ::ort::Result<InvokedOp> {
        use ::ort::sys::ONNXTensorElementDataType;
        use ::ort::AsPointer;
        let api = ::ort::api();
        let context = || format!("{owner}: making {what}");
        let mut made_attributes = Vec::with_capacity(attributes.len());
        let mut made = Ok(());
        for &(name, data, kind) in attributes {
            let mut attribute = std::ptr::null_mut();
            // SAFETY: a C string, one value of `kind` read, an out pointer; released below.
            let status =
                unsafe { (api.CreateOpAttr)(name.as_ptr(), data, 1, kind, &mut attribute) };
            made = kernel_io::check(status, context);
            if made.is_err() {
                break;
            }
            made_attributes.push(attribute.cast_const());
        }
        let mut type_names = [c"T".as_ptr()];
        let types = [ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT];
        let mut op = std::ptr::null_mut();
        // SAFETY: the kernel info of the kernel being made, C strings and arrays that live
        // through the call (ONNX Runtime copies what it keeps), an out pointer.
        let status = made.map(|()| unsafe {
            (api.CreateOp)(
                info.ptr(),
                op_type.as_ptr(),
                c"".as_ptr(),
                version,
                type_names.as_mut_ptr(),
                types.as_ptr(),
                1,
                made_attributes.as_ptr(),
                made_attributes.len() as i32,
                inputs,
                1,
                &mut op,
            )
        });
        for attribute in made_attributes {
            // SAFETY: made above, read by CreateOp only during the call.
            unsafe { (api.ReleaseOpAttr)(attribute.cast_mut()) };
        }
        kernel_io::check(status?, context)?;
        let op = std::ptr::NonNull::new(op)
            .ok_or_else(|| ::ort::Error::new(format!("{}: no operator", context())))?;
        Ok(InvokedOp { op, what, owner })
    }

    /// ONNX Runtime's `Gemm(A, B, transA = 1)` (opset 13): MLAS's product where it is faster
    /// than ours.
    fn gemm_transposed_a(info: &KernelContext<'_>) -> ::ort::Result<InvokedOp> {
        Self::gemm(info, [1, 0], ACCUMULATE_PRODUCT)
    }

    /// ONNX Runtime's `Gemm(A, B, transA, transB)` (opset 13) without C, for `owner`.
    fn gemm(
        info: &KernelContext<'_>,
        [trans_a, trans_b]: [i64; 2],
        owner: &'static str,
    ) -> ::ort::Result<InvokedOp> {
        use ::ort::sys::OrtOpAttrType::{ORT_OP_ATTR_FLOAT, ORT_OP_ATTR_INT};
        // C absent: beta is never read.
        let one = 1f32;
        let int = |v: &i64| (v as *const i64).cast();
        let float = |v: &f32| (v as *const f32).cast();
        let attributes: [OpAttribute<'_>; 4] = [
            (c"transA", int(&trans_a), ORT_OP_ATTR_INT),
            (c"transB", int(&trans_b), ORT_OP_ATTR_INT),
            (c"alpha", float(&one), ORT_OP_ATTR_FLOAT),
            (c"beta", float(&one), ORT_OP_ATTR_FLOAT),
        ];
        InvokedOp::new(
            info,
            (c"Gemm", 13),
            &attributes,
            2,
            (owner, "ONNX Runtime's Gemm"),
        )
    }

    /// ONNX Runtime's `Erf` (opset 13).
    fn erf(info: &KernelContext<'_>) -> ::ort::Result<InvokedOp> {
        InvokedOp::new(info, (c"Erf", 13), &[], 1, (GELU, "ONNX Runtime's Erf"))
    }

    /// Runs it on `inputs` into `output`, values of the running kernel's context (or views
    /// of their memory).
    fn run(
        &self,
        ctx: RunningContext,
        inputs: &[*const ::ort::sys::OrtValue],
        output: *mut ::ort::sys::OrtValue,
    ) -> ::ort::Result<()> {
        let outputs = [output];
        // SAFETY: the running kernel's context and live values; the operator is ours.
        let status = unsafe {
            (::ort::api().InvokeOp)(
                ctx.0,
                self.op.as_ptr(),
                inputs.as_ptr(),
                inputs.len() as i32,
                outputs.as_ptr(),
                1,
            )
        };
        kernel_io::check(status, || format!("{}: {}", self.owner, self.what))
    }
}

/// The context of the kernel that is running, for [`InvokedOp::run`] from its tasks too.
#[derive(Clone, Copy)]
struct RunningContext(*const ::ort::sys::OrtKernelContext);

// SAFETY: `InvokeOp` only reads the context (its thread pool, allocator and logger) to run
// the invoked operator on values it is given, and the context outlives the kernel's tasks
// (`par_for` returns when they are done).
unsafe impl Send for RunningContext {}
unsafe impl Sync for RunningContext {}

impl RunningContext {
    fn of(ctx: &ComputeContext) -> RunningContext {
        use ::ort::AsPointer;
        RunningContext(ctx.ptr())
    }
}

impl Drop for InvokedOp {
    fn drop(&mut self) {
        // SAFETY: made by CreateOp, released once.
        unsafe { (::ort::api().ReleaseOp)(self.op.as_ptr()) };
    }
}

thread_local! {
    /// The memory [`accumulate_product_kernel`] lays its operands out in, one per thread
    /// that runs sessions (the kernel lays out on the calling thread; its tasks only read),
    /// kept between runs and shared by every node, so that it holds the largest node's
    /// layout once.
    static PRODUCT_LAYOUT: std::cell::RefCell<ProductLayout> =
        std::cell::RefCell::new(ProductLayout::default());
}

/// The shape of a product `Aᵀ·B` from the dimensions of `A` `[k, m]`, `B` `[k, n]` and
/// what it is added to (`target`, `[m, n]`); an error naming `op` and the target otherwise.
fn product_shape(
    op: &str,
    [a, b, target]: [&[i64]; 3],
    target_name: &str,
) -> ::ort::Result<ProductShape> {
    match (a, b, target) {
        (&[k, m], &[k_b, n], &[m_t, n_t]) if k == k_b && m == m_t && n == n_t => {
            let dim = |d: i64| usize::try_from(d).ok();
            match (dim(k), dim(m), dim(n)) {
                (Some(k), Some(m), Some(n)) => Ok(ProductShape { k, m, n }),
                _ => Err(::ort::Error::new(format!("{op}: a negative dimension"))),
            }
        }
        (a, b, t) => Err(::ort::Error::new(format!(
            "{op}: A {a:?}, B {b:?} and {target_name} {t:?} are not [k, m], [k, n] and [m, n]"
        ))),
    }
}

/// A fused product's run. With `deferred` (the trainer's table and this node's
/// accumulator), a kept micro-step whose window goes on keeps its product for later
/// instead, where the bounds of `engine::deferred_products` leave room; a run that makes
/// the sum adds the kept products and its own in one pass. With `overwrites` (a window's
/// first product) the accumulator is not read: see [`first_product`].
fn accumulate_product_kernel(
    ctx: &ComputeContext,
    gemm: &InvokedOp,
    deferred: Option<&(Arc<DeferredProducts>, String)>,
    overwrites: bool,
) -> ::ort::Result<()> {
    use accumulate_product_slot as at;
    let op = ACCUMULATE_PRODUCT;
    let (a, b) = (
        kernel_io::required(ctx, op, at::A)?,
        kernel_io::required(ctx, op, at::B)?,
    );
    let acc = kernel_io::required(ctx, op, at::ACC)?;
    let shape = product_shape(op, [a.shape, b.shape, acc.shape], "the accumulator")?;
    let keep = gate(ctx, op, at::KEEP)?;
    let fast = shape.k <= largest_fast_contraction();
    let operand_values = || -> ::ort::Result<(&[f32], &[f32])> {
        let (a, b) = (a.f32s(op, at::A)?, b.f32s(op, at::B)?);
        if a.len() != shape.k * shape.m || b.len() != shape.k * shape.n {
            return Err(::ort::Error::new(format!(
                "{op}: A or B is not its shape's size"
            )));
        }
        Ok((a, b))
    };
    if overwrites {
        let in_place = kernel_io::output(ctx, op, 0, acc.shape)?.address() == acc.address();
        let dims = ([a.value(), b.value()], acc.shape, in_place);
        return first_product(
            (ctx, gemm),
            deferred,
            (keep, fast, shape),
            dims,
            operand_values,
        );
    }
    if let Some((table, name)) = deferred {
        // Only an accumulator updated in place is kept behind: one written apart would be
        // replaced, and a discarded micro-step's old value put back, beside the table.
        let in_place = kernel_io::output(ctx, op, 0, acc.shape)?.address() == acc.address();
        let mut kept = table.take(name);
        kept.set_summed_in_place(in_place);
        // The window goes on, or the apply's update adds what is kept.
        let waits = !table.sum_now() || kept.summed_at_apply();
        let later = in_place && waits && (!keep || (fast && kept.has_room_for(shape)));
        let ran = match later {
            // The window goes on: this micro-step's product (if kept) waits with the
            // others; the accumulator stays as it is.
            true => operand_values().map(|(a, b)| {
                if keep {
                    kept.keep(a, b, shape);
                }
            }),
            false => sum_with_kept(
                (ctx, gemm),
                &mut kept,
                (keep, fast, shape),
                ([a.value(), b.value()], acc.shape),
                operand_values,
            ),
        };
        table.put_back(name, kept);
        ran?;
        if later {
            return run_update(ctx, op, [at::ACC], 0, false, |_, _| {});
        }
        return Ok(());
    }
    // A discarded micro-step: the accumulator stays as it was, nothing to multiply.
    if !keep {
        return run_update(ctx, op, [at::ACC], 0, keep, |_, _| {});
    }
    if fast {
        let (a, b) = operand_values()?;
        return product_on_kernel(ctx, (a, b, shape), SumFrom::Accumulator);
    }
    // MLAS's product, then added: the standard ops' computation, bits and passes.
    let product = mlas_product(ctx, gemm, acc.shape, [a.value(), b.value()])?;
    run_update(ctx, op, [at::ACC], 0, keep, |range, io| {
        accumulate_grad(&product[range], io)
    })
}

/// A window's first product, the accumulator's whole next value (its buffer holds nothing
/// of this window and is not read): written by the kernel when `fast`, else by ONNX
/// Runtime's `Gemm` straight into the output, as the window start's own `Gemm` writes it.
/// With `deferred`, a window that goes on keeps it instead, in place and within the bounds
/// of `engine::deferred_products`: the accumulator's kept products then sum from nothing
/// and the buffer is first written by the window's sum.
fn first_product<'v>(
    (ctx, gemm): (&ComputeContext, &InvokedOp),
    deferred: Option<&(Arc<DeferredProducts>, String)>,
    (keep, fast, shape): (bool, bool, ProductShape),
    (values, acc_dims, in_place): ([*const ::ort::sys::OrtValue; 2], &[i64], bool),
    operand_values: impl Fn() -> ::ort::Result<(&'v [f32], &'v [f32])>,
) -> ::ort::Result<()> {
    use accumulate_product_slot as at;
    let op = ACCUMULATE_PRODUCT;
    // A discarded micro-step: the accumulator stays as it was, and so does what is kept
    // for it.
    if !keep {
        return run_update(ctx, op, [at::ACC], 0, false, |_, _| {});
    }
    if let Some((table, name)) = deferred {
        let mut kept = table.take(name);
        // The product replaces the accumulator's value, products kept for it included.
        kept.clear();
        let later = in_place
            && kept.first_may_wait()
            && !table.sum_now()
            && fast
            && kept.has_room_for(shape);
        let ran = match later {
            true => operand_values().map(|(a, b)| kept.keep_first(a, b, shape)),
            false => Ok(()),
        };
        table.put_back(name, kept);
        ran?;
        if later {
            return run_update(ctx, op, [at::ACC], 0, false, |_, _| {});
        }
    }
    if fast {
        let (a, b) = operand_values()?;
        return product_on_kernel(ctx, (a, b, shape), SumFrom::Nothing);
    }
    let out = kernel_io::output(ctx, op, 0, acc_dims)?;
    gemm.run(RunningContext::of(ctx), &values, out.value())
}

/// The kernel's product `Aᵀ·B` added to the accumulator, or written over it unread
/// (`from`), in tasks of whole tiles of rows (83 rows of 784 columns left 3 rows a task on
/// one-row tiles), every one reading the operands laid out once in this thread's kept
/// memory.
fn product_on_kernel(
    ctx: &ComputeContext,
    (a, b, shape): (&[f32], &[f32], ProductShape),
    from: SumFrom,
) -> ::ort::Result<()> {
    let op = ACCUMULATE_PRODUCT;
    let tile = PRODUCT_TASK_ROWS * shape.n;
    PRODUCT_LAYOUT.with(|layout| match layout.try_borrow_mut() {
        Ok(mut layout) => {
            let operands = layout.operands(a, b, shape);
            let state = ([accumulate_product_slot::ACC], 0);
            run_update_by(ctx, op, state, true, tile, |range, io| {
                let row = range.start / shape.n.max(1);
                match from {
                    SumFrom::Accumulator => operands.accumulate(row, io),
                    SumFrom::Nothing => operands.write(row, io.unread()),
                }
            })
        }
        Err(_) => Err(::ort::Error::new(format!(
            "{op}: its layout is in use on this thread"
        ))),
    })
}

/// MLAS's product `Aᵀ·B` into the operator's output 1 (ONNX Runtime's arena): the standard
/// ops' computation and bits, to be added to the accumulator.
fn mlas_product<'c>(
    ctx: &'c ComputeContext,
    gemm: &InvokedOp,
    shape: &[i64],
    operands: [*const ::ort::sys::OrtValue; 2],
) -> ::ort::Result<&'c [f32]> {
    let product = kernel_io::output(ctx, ACCUMULATE_PRODUCT, 1, shape)?;
    gemm.run(RunningContext::of(ctx), &operands, product.value())?;
    Ok(product.into_slice())
}

/// The accumulator plus every product `kept` holds, in order, then this run's own when it
/// is kept (`keep`), in one pass: by the kernel when `fast`, else after MLAS's product (see
/// [`mlas_product`]). `kept` is left empty.
fn sum_with_kept<'v>(
    (ctx, gemm): (&ComputeContext, &InvokedOp),
    kept: &mut Kept,
    (keep, fast, shape): (bool, bool, ProductShape),
    (values, acc_dims): ([*const ::ort::sys::OrtValue; 2], &[i64]),
    operand_values: impl FnOnce() -> ::ort::Result<(&'v [f32], &'v [f32])>,
) -> ::ort::Result<()> {
    use accumulate_product_slot as at;
    let op = ACCUMULATE_PRODUCT;
    let state = ([at::ACC], 0);
    let tile = PRODUCT_TASK_ROWS * shape.n;
    let first_row = |range: &std::ops::Range<usize>| range.start / shape.n.max(1);
    let from = kept.from();
    let summed = if keep && fast {
        let (a, b) = operand_values()?;
        let operands = kept.operands(Some((a, b, shape)));
        run_update_by(ctx, op, state, true, tile, |range, io| {
            accumulate_products(&operands, (first_row(&range), from), io)
        })
    } else {
        let product = match keep {
            true => Some(mlas_product(ctx, gemm, acc_dims, values)?),
            false => None,
        };
        let operands = kept.operands(None);
        let anything = keep || !operands.is_empty();
        run_update_by(ctx, op, state, anything, tile, |range, io| {
            // From nothing the kept products are the whole value (at least one is kept).
            let acc = from.buffer(io);
            let from = (first_row(&range), from);
            accumulate_products(&operands, from, Io::InPlace([&mut *acc]));
            if let Some(product) = product {
                accumulate_grad(&product[range], Io::InPlace([acc]));
            }
        })
    };
    kept.clear();
    summed
}

/// `ty` has a known rank and every dimension known. ort reports a tensor of unknown rank
/// with no dimensions, which set as an output would declare a scalar, and a symbolic
/// dimension as -1, which set as an output ONNX Runtime's shape inference takes as the
/// number -1 (a `Reshape` of a fused kernel's output with a symbolic batch then fails to
/// load: "Invalid dimension value: -64", met with a fused GELU forward of the GPT). Outputs
/// like such an input are left to the kernel (none of these operators has a scalar tensor
/// input).
fn known_shape(ty: &::ort::value::ValueType) -> bool {
    matches!(ty, ::ort::value::ValueType::Tensor { shape, .. }
        if !shape.is_empty() && shape.iter().all(|&d| d >= 0))
}

/// An output shape from its sizes and their names, `None` when an unknown size has no name:
/// an unknown size passes on only under its name (see `known_shape`).
fn with_named_dims(
    dims: Vec<i64>,
    symbols: Vec<String>,
) -> Option<(::ort::value::Shape, ::ort::value::SymbolicDimensions)> {
    let unnamed_unknown = dims
        .iter()
        .zip(&symbols)
        .any(|(&d, s)| d < 0 && s.is_empty());
    (!unnamed_unknown).then(|| {
        (
            ::ort::value::Shape::new(dims),
            ::ort::value::SymbolicDimensions::new(symbols),
        )
    })
}

struct BatchNormTrain;

impl Operator for BatchNormTrain {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        BATCH_NORM_TRAIN
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [(); 3].map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [(); 4].map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let (x, scale) = (ctx.inputs()[0].clone(), ctx.inputs()[1].clone());
        if known_shape(&x) {
            ctx.set_output(0, &x)?;
        }
        if known_shape(&scale) {
            for slot in 1..4 {
                ctx.set_output(slot, &scale)?;
            }
        }
        Ok(())
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let epsilon = kctx.get::<f32>("epsilon").ok_or_else(|| {
            ::ort::Error::new(format!("{BATCH_NORM_TRAIN}: no 'epsilon' attribute"))
        })?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            batch_norm_train_kernel(ctx, epsilon)
        }))
    }
}

/// X's layout and the per-channel inputs' data, checked to have one value per channel.
fn batch_norm_layout(
    op: &str,
    shape: &[i64],
    per_channel: &[&[f32]],
) -> ::ort::Result<BatchNormLayout> {
    let layout = BatchNormLayout::of(shape).ok_or_else(|| {
        ::ort::Error::new(format!("{op}: X has shape {shape:?}, not [N, C, ...]"))
    })?;
    if let Some(bad) = per_channel.iter().find(|v| v.len() != layout.channels) {
        return Err(::ort::Error::new(format!(
            "{op}: a per-channel input has {} values for {} channels",
            bad.len(),
            layout.channels
        )));
    }
    Ok(layout)
}

/// Elements per task of a BatchNorm kernel: whole channels, about this many elements each.
const BATCH_NORM_TASK: usize = 1 << 15;

/// Runs `f(channel, its output planes)` for every channel of `layout`, the channels grouped
/// into tasks of about [`BATCH_NORM_TASK`] elements on ONNX Runtime's intra-op pool; returns
/// each channel's result in order.
fn per_channel<R: Send>(
    ctx: &ComputeContext,
    layout: BatchNormLayout,
    out: &mut [f32],
    f: impl Fn(usize, &mut [&mut [f32]]) -> R + Sync,
) -> ::ort::Result<Vec<R>> {
    let BatchNormLayout {
        channels, plane, ..
    } = layout;
    if channels == 0 {
        return Ok(Vec::new());
    }
    let mut planes: Vec<Vec<&mut [f32]>> = (0..channels).map(|_| Vec::new()).collect();
    if plane > 0 {
        for (p, piece) in out.chunks_mut(plane).enumerate() {
            planes[p % channels].push(piece);
        }
    }
    let group = (BATCH_NORM_TASK / layout.per_channel().max(1)).clamp(1, channels);
    // Each task takes its channels' output planes once.
    type Planes<'a> = Vec<Vec<&'a mut [f32]>>;
    let mut tasks: Vec<Mutex<Option<Planes<'_>>>> = Vec::new();
    let mut planes = planes.into_iter();
    loop {
        let chunk: Vec<_> = planes.by_ref().take(group).collect();
        if chunk.is_empty() {
            break;
        }
        tasks.push(Mutex::new(Some(chunk)));
    }
    let results: Vec<Mutex<Option<R>>> = (0..channels).map(|_| Mutex::new(None)).collect();
    let run = |t: usize| {
        let Ok(Some(mut chunk)) = tasks[t].lock().map(|mut c| c.take()) else {
            return;
        };
        for (k, out) in chunk.iter_mut().enumerate() {
            let c = t * group + k;
            let r = f(c, out);
            if let Ok(mut slot) = results[c].lock() {
                *slot = Some(r);
            }
        }
    };
    match tasks.len() {
        1 => run(0),
        n => ctx.par_for(n, 0, run)?,
    }
    results
        .into_iter()
        .map(|r| r.into_inner().ok().flatten())
        .collect::<Option<Vec<R>>>()
        .ok_or_else(|| ::ort::Error::new("a BatchNorm task did not run".to_string()))
}

/// Writes `values` into output `slot`, shaped `[values.len()]`.
fn write_vector(ctx: &ComputeContext, op: &str, slot: usize, values: &[f32]) -> ::ort::Result<()> {
    f32_output(ctx, op, slot, &[values.len() as i64])?.copy_from_slice(values);
    Ok(())
}

fn batch_norm_train_kernel(ctx: &ComputeContext, epsilon: f32) -> ::ort::Result<()> {
    let op = BATCH_NORM_TRAIN;
    let (shape, x) = f32_input(ctx, op, 0)?;
    let (scale, bias) = (f32_input(ctx, op, 1)?.1, f32_input(ctx, op, 2)?.1);
    let layout = batch_norm_layout(op, shape, &[scale, bias])?;
    let y = f32_output(ctx, op, 0, shape)?;
    let stats: Vec<ChannelStats> = per_channel(ctx, layout, y, |c, out| {
        batch_norm_train_channel(&layout.planes(x, c), out, scale[c], bias[c], epsilon)
    })?;
    let column = |f: fn(&ChannelStats) -> f32| stats.iter().map(f).collect::<Vec<f32>>();
    write_vector(ctx, op, 1, &column(|s| s.mean))?;
    write_vector(ctx, op, 2, &column(|s| s.var))?;
    write_vector(ctx, op, 3, &column(|s| s.inv_std))
}

struct BatchNormGrad;

impl Operator for BatchNormGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        BATCH_NORM_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [(); 5].map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [(); 3].map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let (x, scale) = (ctx.inputs()[1].clone(), ctx.inputs()[2].clone());
        if known_shape(&x) {
            ctx.set_output(0, &x)?;
        }
        if known_shape(&scale) {
            ctx.set_output(1, &scale)?;
            ctx.set_output(2, &scale)?;
        }
        Ok(())
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ::ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| batch_norm_grad_kernel(ctx)))
    }
}

fn batch_norm_grad_kernel(ctx: &ComputeContext) -> ::ort::Result<()> {
    let op = BATCH_NORM_GRAD;
    let (dy_shape, dy) = f32_input(ctx, op, 0)?;
    let (shape, x) = f32_input(ctx, op, 1)?;
    if dy_shape != shape {
        return Err(::ort::Error::new(format!(
            "{op}: dY has shape {dy_shape:?}, X {shape:?}"
        )));
    }
    let scale = f32_input(ctx, op, 2)?.1;
    let (mean, inv_std) = (f32_input(ctx, op, 3)?.1, f32_input(ctx, op, 4)?.1);
    let layout = batch_norm_layout(op, shape, &[scale, mean, inv_std])?;
    let dx = f32_output(ctx, op, 0, shape)?;
    let sums: Vec<(f32, f32)> = per_channel(ctx, layout, dx, |c, out| {
        let (g, v) = (layout.planes(dy, c), layout.planes(x, c));
        batch_norm_grad_channel(&g, &v, out, scale[c], mean[c], inv_std[c])
    })?;
    write_vector(ctx, op, 1, &sums.iter().map(|s| s.0).collect::<Vec<f32>>())?;
    write_vector(ctx, op, 2, &sums.iter().map(|s| s.1).collect::<Vec<f32>>())
}

struct Im2Col;

impl Operator for Im2Col {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        IM2COL
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [OperatorInput::required(TensorElementType::Float32)]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let window = window_attributes(kctx, IM2COL)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            im2col_kernel(ctx, &window)
        }))
    }
}

/// Image-channel planes per task of [`Im2Col`].
const IM2COL_TASK_ELEMENTS: usize = 1 << 16;

fn im2col_kernel(ctx: &ComputeContext, window: &Window2d) -> ::ort::Result<()> {
    let (shape, x) = f32_input(ctx, IM2COL, 0)?;
    let dims: Option<Vec<usize>> = shape.iter().map(|&d| usize::try_from(d).ok()).collect();
    let Some(&[n, c, h, w]) = dims.as_deref() else {
        return Err(::ort::Error::new(format!(
            "{IM2COL}: X has shape {shape:?}, not [N, C, H, W]"
        )));
    };
    let [ho, wo] = window.output([h, w]).ok_or_else(|| {
        ::ort::Error::new(format!(
            "{IM2COL}: the window {window:?} does not fit X {shape:?}"
        ))
    })?;
    let taps = window.taps();
    let out_shape = [n as i64, (c * taps) as i64, ho as i64, wo as i64];
    let out = f32_output(ctx, IM2COL, 0, &out_shape)?;
    let (in_plane, out_block) = (h * w, taps * ho * wo);
    if in_plane == 0 || out_block == 0 {
        return Ok(());
    }
    let unfolding = Unfolding::new(window, [h, w]).ok_or_else(|| {
        ::ort::Error::new(format!(
            "{IM2COL}: the window {window:?} does not fit X {shape:?}"
        ))
    })?;
    // Whole (image, channel) blocks per task.
    let per_task = (IM2COL_TASK_ELEMENTS / out_block).max(1);
    let tasks: Vec<Mutex<Option<&mut [f32]>>> = out
        .chunks_mut(per_task * out_block)
        .map(|chunk| Mutex::new(Some(chunk)))
        .collect();
    let run = |t: usize| {
        let Ok(Some(chunk)) = tasks[t].lock().map(|mut c| c.take()) else {
            return;
        };
        for (k, block) in chunk.chunks_mut(out_block).enumerate() {
            let plane = t * per_task + k;
            let src = &x[plane * in_plane..(plane + 1) * in_plane];
            unfolding.plane(src, block);
        }
    };
    match tasks.len() {
        1 => run(0),
        count => ctx.par_for(count, 0, run)?,
    }
    Ok(())
}

/// The attributes of a 2-D window, read the way [`Im2Col`] and [`Col2Im`] both take them.
fn window_attributes(kctx: &KernelContext, op: &str) -> ::ort::Result<Window2d> {
    let ints = |name: &str, len: usize| -> ::ort::Result<Vec<usize>> {
        let values = kctx.get::<Vec<i64>>(name).unwrap_or_default();
        let values: Option<Vec<usize>> = values.iter().map(|&v| usize::try_from(v).ok()).collect();
        values.filter(|v| v.len() == len).ok_or_else(|| {
            ::ort::Error::new(format!("{op}: attribute '{name}' is not {len} sizes"))
        })
    };
    let (k, s, p, d) = (
        ints("kernel_shape", 2)?,
        ints("strides", 2)?,
        ints("pads", 4)?,
        ints("dilations", 2)?,
    );
    Ok(Window2d {
        kernel: [k[0], k[1]],
        strides: [s[0], s[1]],
        pads: [p[0], p[1], p[2], p[3]],
        dilations: [d[0], d[1]],
    })
}

struct ConvWeightGrad;

impl Operator for ConvWeightGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        CONV_WEIGHT_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [(); 2].map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    /// `[1, C·kh·kw, M]` from X's C and dY's M, when both are known (see `known_shape`).
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        use conv_weight_grad_slot as at;
        let taps = ctx
            .attr::<Vec<i64>>("kernel_shape")
            .ok()
            .filter(|k| k.len() == 2 && k.iter().all(|&d| d >= 0))
            .and_then(|k| k[0].checked_mul(k[1]));
        let inputs = ctx.inputs();
        let channels = |ty: &::ort::value::ValueType| match ty {
            ::ort::value::ValueType::Tensor { shape, .. } if shape.len() == 4 && shape[1] >= 0 => {
                Some(shape[1])
            }
            _ => None,
        };
        let (Some(taps), Some(c), Some(m)) =
            (taps, channels(&inputs[at::X]), channels(&inputs[at::DY]))
        else {
            return Ok(());
        };
        let Some(rows) = c.checked_mul(taps) else {
            return Ok(());
        };
        let mut out = inputs[at::X].clone();
        if let ::ort::value::ValueType::Tensor {
            shape,
            dimension_symbols,
            ..
        } = &mut out
        {
            *shape = ::ort::value::Shape::new(vec![1, rows, m]);
            *dimension_symbols = ::ort::value::SymbolicDimensions::new(vec![String::new(); 3]);
        }
        ctx.set_output(0, &out)
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let window = window_attributes(kctx, CONV_WEIGHT_GRAD)?;
        let gemm = InvokedOp::gemm(kctx, [0, 1], CONV_WEIGHT_GRAD)?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            UNFOLD_BUFFERS.with(|buffers| match buffers.try_borrow_mut() {
                Ok(mut buffers) => conv_weight_grad_kernel(ctx, &window, &gemm, &mut buffers),
                Err(_) => Err(::ort::Error::new(format!(
                    "{CONV_WEIGHT_GRAD}: its buffers are in use on this thread"
                ))),
            })
        }))
    }
}

/// [`ConvWeightGrad`]'s working memory: an image's columns, and the product of an image
/// after the first. Kept between runs: buffers of a few hundred KiB freed and allocated
/// again would be fresh pages, faulted in, on every run.
#[derive(Default)]
struct UnfoldBuffers {
    cols: Vec<f32>,
    product: Vec<f32>,
}

thread_local! {
    /// One [`UnfoldBuffers`] per thread that runs sessions, shared by every `ConvWeightGrad`
    /// node it runs (one at a time: the kernel runs on the session's calling thread), so
    /// that they hold only the largest node's columns, not each node's.
    static UNFOLD_BUFFERS: std::cell::RefCell<UnfoldBuffers> =
        std::cell::RefCell::new(UnfoldBuffers::default());
}

/// [`ConvWeightGrad`], image by image in order: unfold the image, ONNX Runtime's GEMM by
/// its dY (`transB`), the first image's product written to dWᵀ, every later one added to
/// it. On the calling thread: the pass gives it only to one-thread sessions.
fn conv_weight_grad_kernel(
    ctx: &ComputeContext,
    window: &Window2d,
    gemm: &InvokedOp,
    buffers: &mut UnfoldBuffers,
) -> ::ort::Result<()> {
    use ::ort::AsPointer;
    use conv_weight_grad_slot as at;
    let op = CONV_WEIGHT_GRAD;
    let (x_shape, x) = f32_input(ctx, op, at::X)?;
    let (dy_shape, dy) = f32_input(ctx, op, at::DY)?;
    let sizes = |shape: &[i64]| -> Option<[usize; 4]> {
        let dims: Option<Vec<usize>> = shape.iter().map(|&d| usize::try_from(d).ok()).collect();
        dims?.try_into().ok()
    };
    let (Some([n, c, h, w]), Some([dy_n, m, dy_h, dy_w])) = (sizes(x_shape), sizes(dy_shape))
    else {
        return Err(::ort::Error::new(format!(
            "{op}: X {x_shape:?} and dY {dy_shape:?} are not [N, C, H, W] and [N, M, Ho, Wo]"
        )));
    };
    if dy_n != n || window.output([h, w]) != Some([dy_h, dy_w]) {
        return Err(::ort::Error::new(format!(
            "{op}: dY {dy_shape:?} is not the output gradient of X {x_shape:?} through the \
             window {window:?}"
        )));
    }
    let (taps, plane, in_plane) = (window.taps(), dy_h * dy_w, h * w);
    let rows = c * taps;
    let sum = f32_output(ctx, op, 0, &[1, rows as i64, m as i64])?;
    if sum.is_empty() {
        return Ok(());
    }
    // No image, or an empty plane: sums of nothing.
    if n == 0 || plane == 0 || in_plane == 0 {
        sum.fill(0.0);
        return Ok(());
    }
    let unfolding = Unfolding::new(window, [h, w]).ok_or_else(|| {
        ::ort::Error::new(format!(
            "{op}: the window {window:?} does not fit X {x_shape:?}"
        ))
    })?;
    let UnfoldBuffers { cols, product } = buffers;
    cols.resize(rows * plane, 0.0);
    product.resize(rows * m, 0.0);
    let running = RunningContext::of(ctx);
    for image in 0..n {
        let image_x = &x[image * c * in_plane..(image + 1) * c * in_plane];
        for (src, block) in image_x
            .chunks_exact(in_plane)
            .zip(cols.chunks_exact_mut(taps * plane))
        {
            unfolding.plane(src, block);
        }
        let a = ::ort::value::TensorRef::from_array_view(([rows, plane], &cols[..]))?;
        let dy_image = &dy[image * m * plane..(image + 1) * m * plane];
        let b = ::ort::value::TensorRef::from_array_view(([m, plane], dy_image))?;
        let target: &mut [f32] = if image == 0 { sum } else { product };
        let y = ::ort::value::TensorRefMut::from_array_view_mut(([rows, m], target))?;
        // The GEMM writes through this view (the pointer is the view's own).
        gemm.run(running, &[a.ptr(), b.ptr()], y.ptr().cast_mut())?;
        drop(y);
        if image > 0 {
            accumulate_grad(product, Io::InPlace([&mut *sum]));
        }
    }
    Ok(())
}

struct RowTranspose;

impl Operator for RowTranspose {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ROW_TRANSPOSE
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [OperatorInput::required(TensorElementType::Float32)]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    /// X's dimensions (and their names) in `perm`'s order, so that ONNX Runtime's fusions
    /// downstream see the shape (see [`BlockedWeight`]'s).
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let perm: Option<Vec<usize>> = ctx
            .attr::<Vec<i64>>("perm")
            .ok()
            .and_then(|p| p.iter().map(|&a| usize::try_from(a).ok()).collect());
        let Some((perm, mut x)) = perm.zip(ctx.inputs().into_iter().next()) else {
            return Ok(());
        };
        let ::ort::value::ValueType::Tensor {
            shape,
            dimension_symbols,
            ..
        } = &mut x
        else {
            return Ok(());
        };
        let rank = shape.len();
        let valid = rank > 0
            && perm.len() == rank
            && dimension_symbols.len() == rank
            && perm.iter().all(|&p| p < rank);
        if !valid {
            return Ok(());
        }
        let dims: Vec<i64> = perm.iter().map(|&p| shape[p]).collect();
        let symbols: Vec<String> = perm.iter().map(|&p| dimension_symbols[p].clone()).collect();
        if let Some(named) = with_named_dims(dims, symbols) {
            (*shape, *dimension_symbols) = named;
            ctx.set_output(0, &x)?;
        }
        Ok(())
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let perm: Option<Vec<usize>> = kctx
            .get::<Vec<i64>>("perm")
            .and_then(|p| p.iter().map(|&a| usize::try_from(a).ok()).collect());
        let perm = perm.ok_or_else(|| {
            ::ort::Error::new(format!(
                "{ROW_TRANSPOSE}: attribute 'perm' is not a list of axes"
            ))
        })?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            row_transpose_kernel(ctx, &perm)
        }))
    }
}

/// [`RowTranspose`] in tasks of whole output rows ([`even_chunk`]).
fn row_transpose_kernel(ctx: &ComputeContext, perm: &[usize]) -> ::ort::Result<()> {
    let op = ROW_TRANSPOSE;
    let (shape, x) = f32_input(ctx, op, 0)?;
    let dims: Option<Vec<usize>> = shape.iter().map(|&d| usize::try_from(d).ok()).collect();
    let layout = dims
        .as_deref()
        .and_then(|dims| RowLayout::new(dims, perm))
        .ok_or_else(|| {
            ::ort::Error::new(format!(
                "{op}: perm {perm:?} does not keep the last axis of X {shape:?} last"
            ))
        })?;
    let out_shape: Vec<i64> = layout.out_dims().iter().map(|&d| d as i64).collect();
    let out = f32_output(ctx, op, 0, &out_shape)?;
    let row = layout.row();
    if out.is_empty() || row == 0 {
        return Ok(());
    }
    let task = even_chunk(out.len(), row);
    in_chunks(
        ctx,
        (out.len(), task),
        out.chunks_mut(task),
        |range, out| layout.copy_rows(x, range.start / row, out),
    )
}

struct Col2Im;

impl Operator for Col2Im {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        COL2IM
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::required(TensorElementType::Float32),
            OperatorInput::optional(TensorElementType::Float32),
        ]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    /// `[N, channels, H, W]` from `like`'s `[N, *, Hi, Wi]`, so that ONNX Runtime's fusions
    /// downstream see the shape (see [`BlockedWeight`]'s).
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let ints = |name: &str| -> Option<Vec<usize>> {
            let values = ctx.attr::<Vec<i64>>(name).ok()?;
            values.iter().map(|&v| usize::try_from(v).ok()).collect()
        };
        let window = match (
            ints("kernel_shape").as_deref(),
            ints("strides").as_deref(),
            ints("pads").as_deref(),
            ints("dilations").as_deref(),
        ) {
            (Some(&[kh, kw]), Some(&[sh, sw]), Some(&[t, l, b, r]), Some(&[dh, dw])) => Window2d {
                kernel: [kh, kw],
                strides: [sh, sw],
                pads: [t, l, b, r],
                dilations: [dh, dw],
            },
            _ => return Ok(()),
        };
        let (Some(&[ph, pw]), Ok(channels)) = (
            ints("output_padding").as_deref(),
            ctx.attr::<i64>("channels"),
        ) else {
            return Ok(());
        };
        let Some(mut like) = ctx.inputs().into_iter().nth(1) else {
            return Ok(());
        };
        let ::ort::value::ValueType::Tensor {
            shape,
            dimension_symbols,
            ..
        } = &mut like
        else {
            return Ok(());
        };
        if shape.len() != 4 || dimension_symbols.len() != 4 {
            return Ok(());
        }
        // An unknown batch passes on only under its name (see `known_shape`).
        if shape[0] < 0 && dimension_symbols[0].is_empty() {
            return Ok(());
        }
        let (Ok(hi), Ok(wi)) = (usize::try_from(shape[2]), usize::try_from(shape[3])) else {
            return Ok(());
        };
        let Some([h, w]) = folded_size(&window, [hi, wi], [ph, pw]) else {
            return Ok(());
        };
        let dims = vec![shape[0], channels, h as i64, w as i64];
        let mut symbols = dimension_symbols.to_vec();
        symbols[1..].iter_mut().for_each(|s| s.clear());
        *shape = ::ort::value::Shape::new(dims);
        *dimension_symbols = ::ort::value::SymbolicDimensions::new(symbols);
        ctx.set_output(0, &like)
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let window = window_attributes(kctx, COL2IM)?;
        let padding = kctx
            .get::<Vec<i64>>("output_padding")
            .and_then(|p| match p.as_slice() {
                &[ph, pw] => Some([usize::try_from(ph).ok()?, usize::try_from(pw).ok()?]),
                _ => None,
            })
            .ok_or_else(|| {
                ::ort::Error::new(format!(
                    "{COL2IM}: attribute 'output_padding' is not 2 sizes"
                ))
            })?;
        let channels = kctx
            .get::<i64>("channels")
            .and_then(|c| usize::try_from(c).ok())
            .ok_or_else(|| {
                ::ort::Error::new(format!("{COL2IM}: attribute 'channels' is not a count"))
            })?;
        Ok(Box::new(move |ctx: &ComputeContext| {
            col2im_kernel(ctx, &window, padding, channels)
        }))
    }
}

/// Output elements per task of [`Col2Im`], in whole planes. Small: at 32K a B 8 fold of
/// 16 channels of 16 x 16 was one task, on one thread, and lost to `ConvTranspose`
/// (1.17x); at 4K it gains (0.79x; benches/col2im.rs).
const COL2IM_TASK_ELEMENTS: usize = 1 << 12;

fn col2im_kernel(
    ctx: &ComputeContext,
    window: &Window2d,
    padding: [usize; 2],
    channels: usize,
) -> ::ort::Result<()> {
    let (cols_shape, cols) = f32_input(ctx, COL2IM, 0)?;
    let like = kernel_io::required(ctx, COL2IM, 1)?.shape;
    let dims = |shape: &[i64]| -> Option<Vec<usize>> {
        shape.iter().map(|&d| usize::try_from(d).ok()).collect()
    };
    let taps = window.taps();
    let (Some(&[n, _, hi, wi]), Some(&[nc, rows, plane])) =
        (dims(like).as_deref(), dims(cols_shape).as_deref())
    else {
        return Err(::ort::Error::new(format!(
            "{COL2IM}: columns {cols_shape:?} and like {like:?} are not [N, C·kh·kw, Hi·Wi] and [N, M, Hi, Wi]"
        )));
    };
    if nc != n || rows != channels * taps || plane != hi * wi {
        return Err(::ort::Error::new(format!(
            "{COL2IM}: columns {cols_shape:?} do not hold {channels} channels of {taps} taps over like {like:?}"
        )));
    }
    let too_small = || {
        ::ort::Error::new(format!(
            "{COL2IM}: the window {window:?} with output padding {padding:?} does not fold {like:?}"
        ))
    };
    let [h, w] = folded_size(window, [hi, wi], padding).ok_or_else(too_small)?;
    let bias = optional_f32s(ctx, COL2IM, 2)?;
    if let Some(b) = bias.filter(|b| b.len() != channels) {
        return Err(::ort::Error::new(format!(
            "{COL2IM}: a bias of {} values for {channels} channels",
            b.len()
        )));
    }
    let out_shape = [n, channels, h, w].map(|d| d as i64);
    let out = f32_output(ctx, COL2IM, 0, &out_shape)?;
    let (out_plane, cols_block) = (h * w, taps * plane);
    if out.is_empty() {
        return Ok(());
    }
    let unfolding = Unfolding::new(window, [h, w]).ok_or_else(too_small)?;
    // Whole (image, channel) planes per task.
    let per_task = (COL2IM_TASK_ELEMENTS / out_plane).max(1);
    let tasks: Vec<Mutex<Option<&mut [f32]>>> = out
        .chunks_mut(per_task * out_plane)
        .map(|chunk| Mutex::new(Some(chunk)))
        .collect();
    let run = |t: usize| {
        let Ok(Some(chunk)) = tasks[t].lock().map(|mut c| c.take()) else {
            return;
        };
        for (k, dst) in chunk.chunks_mut(out_plane).enumerate() {
            let plane = t * per_task + k;
            let at = plane * cols_block;
            let b = bias.map(|b| b[plane % channels]);
            unfolding.fold(&cols[at..at + cols_block], dst, b);
        }
    };
    match tasks.len() {
        1 => run(0),
        count => ctx.par_for(count, 0, run)?,
    }
    Ok(())
}

struct Gelu;

impl Operator for Gelu {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        GELU
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [(); gelu_forward_slot::COUNT].map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [(); 2].map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    /// y and A take x's shape.
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        match ctx.inputs().first().cloned() {
            Some(x) if known_shape(&x) => {
                ctx.set_output(gelu_forward_slot::Y, &x)?;
                ctx.set_output(gelu_forward_slot::A, &x)
            }
            _ => Ok(()),
        }
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let erf = InvokedOp::erf(kctx)?;
        Ok(Box::new(move |ctx: &ComputeContext| gelu_kernel(ctx, &erf)))
    }
}

/// [`GELU`] by tasks of [`even_chunk`] elements, each through its three steps while it is in
/// cache: `u = x / f` written where y goes, ONNX Runtime's `Erf` from there into A's chunk,
/// then `A` and `y` ([`crate::fused_ops::gelu_tail`]).
fn gelu_kernel(ctx: &ComputeContext, erf: &InvokedOp) -> ::ort::Result<()> {
    use ::ort::AsPointer;
    use gelu_forward_slot as at;
    let op = GELU;
    let scalar = |slot: usize| required_scalar(ctx, op, slot);
    let s = GeluScalars {
        divisor: scalar(at::DIVISOR)?,
        one: scalar(at::ONE)?,
        half: scalar(at::HALF)?,
    };
    let (shape, x) = f32_input(ctx, op, at::X)?;
    let y = f32_output(ctx, op, at::Y, shape)?;
    let a = f32_output(ctx, op, at::A, shape)?;
    let len = y.len();
    let failed: Mutex<Option<::ort::Error>> = Mutex::new(None);
    let running = RunningContext::of(ctx);
    let chunk = even_chunk(len, LINE_FLOATS);
    let chunks = y.chunks_mut(chunk).zip(a.chunks_mut(chunk));
    in_chunks(ctx, (len, chunk), chunks, |range, (y, a)| {
        let x = &x[range];
        gelu_quotient(&s, x, y);
        let erf_of_u = (|| {
            let u = ::ort::value::TensorRef::from_array_view(([y.len()], &*y))?;
            let e = ::ort::value::TensorRefMut::from_array_view_mut(([a.len()], &mut *a))?;
            // Erf writes A's chunk through this view (the pointer is the view's own).
            erf.run(running, &[u.ptr()], e.ptr().cast_mut())
        })();
        match erf_of_u {
            Ok(()) => gelu_tail(&s, x, a, y),
            Err(e) => {
                if let Ok(mut first) = failed.lock() {
                    first.get_or_insert(e);
                }
            }
        }
    })?;
    match failed.into_inner() {
        Ok(None) => Ok(()),
        Ok(Some(e)) => Err(e),
        Err(_) => Err(::ort::Error::new(format!("{op}: a chunk's task panicked"))),
    }
}

struct LayerNormGrad;

impl Operator for LayerNormGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        LAYER_NORM_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [(); layer_norm_grad_slot::COUNT]
            .map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [(); 3].map(|_| OperatorOutput::required(TensorElementType::Float32))
    }

    /// dX takes X's shape, dScale and dBias the scale's.
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        use layer_norm_grad_slot as at;
        let inputs = ctx.inputs();
        let (x, scale) = (inputs[at::X].clone(), inputs[at::SCALE].clone());
        if known_shape(&x) {
            ctx.set_output(0, &x)?;
        }
        if known_shape(&scale) {
            ctx.set_output(1, &scale)?;
            ctx.set_output(2, &scale)?;
        }
        Ok(())
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ::ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| layer_norm_grad_kernel(ctx)))
    }
}

/// [`LAYER_NORM_GRAD`] by blocks of rows, each block's column sums apart, then added in
/// block order: the same numbers on any number of threads.
fn layer_norm_grad_kernel(ctx: &ComputeContext) -> ::ort::Result<()> {
    use layer_norm_grad_slot as at;
    let op = LAYER_NORM_GRAD;
    let (shape, dy) = f32_input(ctx, op, at::DY)?;
    let (x_shape, x) = f32_input(ctx, op, at::X)?;
    let (scale_shape, scale) = f32_input(ctx, op, at::SCALE)?;
    let (_, mean) = f32_input(ctx, op, at::MEAN)?;
    let (_, inv_std) = f32_input(ctx, op, at::INV_STD)?;
    let n = scale.len();
    let rows = dy.len().checked_div(n).unwrap_or(0);
    let fits = x_shape == shape
        && scale_shape.len() == 1
        && shape.last().is_some_and(|&d| d as usize == n)
        && mean.len() == rows
        && inv_std.len() == rows;
    if !fits {
        return Err(::ort::Error::new(format!(
            "{op}: dY {shape:?}, X {x_shape:?}, scale {scale_shape:?}, {} means and {} \
             inverse deviations do not make rows of the scale's length",
            mean.len(),
            inv_std.len()
        )));
    }
    let dx = f32_output(ctx, op, 0, shape)?;
    let dscale = f32_output(ctx, op, 1, scale_shape)?;
    let dbias = f32_output(ctx, op, 2, scale_shape)?;
    dscale.fill(0.0);
    dbias.fill(0.0);
    if rows == 0 {
        return Ok(());
    }
    let block = LAYER_NORM_GRAD_ROWS * n;
    let mut partial = vec![0f32; rows.div_ceil(LAYER_NORM_GRAD_ROWS) * 2 * n];
    let blocks = dx.chunks_mut(block).zip(partial.chunks_mut(2 * n));
    in_chunks(ctx, (dy.len(), block), blocks, |range, (dx, sums)| {
        let (first, last) = (range.start / n, range.end / n);
        let (dscale, dbias) = sums.split_at_mut(n);
        layer_norm_grad_rows(
            (&dy[range.clone()], &x[range], scale),
            (&mean[first..last], &inv_std[first..last]),
            dx,
            (dscale, dbias),
        )
    })?;
    for sums in partial.chunks_exact(2 * n) {
        let (s, b) = sums.split_at(n);
        dscale.iter_mut().zip(s).for_each(|(d, v)| *d += v);
        dbias.iter_mut().zip(b).for_each(|(d, v)| *d += v);
    }
    Ok(())
}

struct GeluGrad;

impl Operator for GeluGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        GELU_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [(); gelu_slot::COUNT].map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    /// G's shape (the pass matched G, x, u and A of one shape).
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        match ctx.inputs().first() {
            Some(g) if known_shape(g) => ctx.set_output(0, g),
            _ => Ok(()),
        }
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ::ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| gelu_grad_kernel(ctx)))
    }
}

fn gelu_grad_kernel(ctx: &ComputeContext) -> ::ort::Result<()> {
    let op = GELU_GRAD;
    let scalar = |slot: usize| required_scalar(ctx, op, slot);
    let s = GeluGradScalars {
        half: scalar(gelu_slot::HALF)?,
        k: scalar(gelu_slot::K)?,
        sqrt2: scalar(gelu_slot::SQRT2)?,
        forward_sqrt2: scalar(gelu_slot::FORWARD_SQRT2)?,
    };
    let (shape, g) = f32_input(ctx, op, gelu_slot::G)?;
    let mut data: Vec<&[f32]> = vec![g];
    for slot in [gelu_slot::X, gelu_slot::A] {
        let (s, d) = f32_input(ctx, op, slot)?;
        if s != shape {
            return Err(::ort::Error::new(format!(
                "{op}: input {slot} has shape {s:?}, not G's {shape:?}"
            )));
        }
        data.push(d);
    }
    let dx = f32_output(ctx, op, 0, shape)?;
    let len = dx.len();
    let chunk = even_chunk(len, LINE_FLOATS);
    in_chunks(ctx, (len, chunk), dx.chunks_mut(chunk), |range, out| {
        let part = |k: usize| &data[k][range.clone()];
        gelu_grad(&s, [part(0), part(1), part(2)], out)
    })
}

struct ReluGrad;

impl Operator for ReluGrad {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        RELU_GRAD
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [(); 2].map(|_| OperatorInput::required(TensorElementType::Float32))
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    /// dY's shape when Y's is the same (a ReLU's gradient); where they broadcast, or are
    /// unknown, the kernel says.
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let inputs = ctx.inputs();
        match inputs.as_slice() {
            [dy, y] if known_shape(dy) && dy == y => ctx.set_output(0, dy),
            _ => Ok(()),
        }
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ::ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| relu_grad_kernel(ctx)))
    }
}

fn relu_grad_kernel(ctx: &ComputeContext) -> ::ort::Result<()> {
    let (shape, dy) = f32_input(ctx, RELU_GRAD, 0)?;
    let (y_shape, y) = f32_input(ctx, RELU_GRAD, 1)?;
    if shape != y_shape {
        return relu_grad_broadcast(ctx, (shape, dy), (y_shape, y));
    }
    let dx = f32_output(ctx, RELU_GRAD, 0, shape)?;
    let len = dx.len();
    let chunk = even_chunk(len, LINE_FLOATS);
    in_chunks(ctx, (len, chunk), dx.chunks_mut(chunk), |range, out| {
        relu_grad(&dy[range.clone()], &y[range], out)
    })
}

/// [`ReluGrad`] of operands of different shapes, broadcast as the `Mul` it replaced
/// broadcasts them (ONNX's rules are numpy's, as ndarray's). A ReLU's own gradient never
/// gets here; a mask a model makes of another tensor may.
fn relu_grad_broadcast(
    ctx: &ComputeContext,
    (dy_shape, dy): (&[i64], &[f32]),
    (y_shape, y): (&[i64], &[f32]),
) -> ::ort::Result<()> {
    let view = |shape: &[i64], data: &[f32]| {
        let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        ndarray::ArrayViewD::from_shape(dims, data)
            .map(|v| v.to_owned())
            .map_err(|e| ::ort::Error::new(format!("{RELU_GRAD}: {e}")))
    };
    let (dy, y) = (view(dy_shape, dy)?, view(y_shape, y)?);
    let mask = y.mapv(|v| if v > 0.0 { 1.0f32 } else { 0.0 });
    // numpy's rule, axes aligned at the end: equal, or one of them 1.
    let rank = dy.ndim().max(mask.ndim());
    let dim = |a: &ndarray::ArrayD<f32>, k: usize| {
        (k + a.ndim()).checked_sub(rank).map_or(1, |i| a.shape()[i])
    };
    let target: Option<Vec<usize>> = (0..rank)
        .map(|k| match (dim(&dy, k), dim(&mask, k)) {
            (p, q) if p == q || q == 1 => Some(p),
            (1, q) => Some(q),
            _ => None,
        })
        .collect();
    let broadcast = target.and_then(|t| Some((dy.broadcast(t.clone())?, mask.broadcast(t)?)));
    let Some((dy, mask)) = broadcast else {
        return Err(::ort::Error::new(format!(
            "{RELU_GRAD}: dY {dy_shape:?} and Y {y_shape:?} do not broadcast"
        )));
    };
    let dx = ndarray::Zip::from(&dy).and(&mask).map_collect(|g, m| g * m);
    let out_shape: Vec<i64> = dx.shape().iter().map(|&d| d as i64).collect();
    let out = f32_output(ctx, RELU_GRAD, 0, &out_shape)?;
    for (o, v) in out.iter_mut().zip(dx.iter()) {
        *o = *v;
    }
    Ok(())
}

struct LeadingSum;

impl Operator for LeadingSum {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        LEADING_SUM
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [OperatorInput::required(TensorElementType::Float32)]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    /// X's trailing axes (after `axes` ones of 1 with `keepdims`), so that ONNX Runtime's
    /// fusions downstream see the shape (see [`BlockedWeight`]'s).
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let axes = ctx
            .attr::<i64>("axes")
            .ok()
            .and_then(|j| usize::try_from(j).ok());
        let keepdims = ctx.attr::<i64>("keepdims").unwrap_or(1) != 0;
        let Some((axes, mut x)) = axes.zip(ctx.inputs().into_iter().next()) else {
            return Ok(());
        };
        let ::ort::value::ValueType::Tensor {
            shape,
            dimension_symbols,
            ..
        } = &mut x
        else {
            return Ok(());
        };
        if shape.is_empty() || axes > shape.len() || dimension_symbols.len() != shape.len() {
            return Ok(());
        }
        let kept = if keepdims { axes } else { 0 };
        let dims: Vec<i64> = std::iter::repeat_n(1, kept)
            .chain(shape[axes..].iter().copied())
            .collect();
        let symbols: Vec<String> = std::iter::repeat_n(String::new(), kept)
            .chain(dimension_symbols[axes..].iter().cloned())
            .collect();
        if let Some(named) = with_named_dims(dims, symbols) {
            (*shape, *dimension_symbols) = named;
            ctx.set_output(0, &x)?;
        }
        Ok(())
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let axes = kctx
            .get::<i64>("axes")
            .and_then(|j| usize::try_from(j).ok())
            .ok_or_else(|| {
                ::ort::Error::new(format!("{LEADING_SUM}: attribute 'axes' is not a count"))
            })?;
        let keepdims = kctx.get::<i64>("keepdims").unwrap_or(1) != 0;
        let threads = kctx
            .get::<i64>("threads")
            .map_or(1, |t| usize::try_from(t).unwrap_or(1).max(1));
        Ok(Box::new(move |ctx: &ComputeContext| {
            leading_sum_kernel(ctx, axes, keepdims, threads)
        }))
    }
}

/// The fewest columns a task of [`LeadingSum`] takes: narrower, each row's piece is too
/// short a read.
const LEADING_SUM_TASK_COLUMNS: usize = 512;

/// [`LeadingSum`] on its session's `threads`: one task per thread, each a block of whole
/// columns. More tasks would only read shorter pieces of each row (one thread of cold
/// `[512, 1024]`: 0.20 ms in 512-column tasks, as fast as ONNX Runtime's 0.11 in one).
fn leading_sum_kernel(
    ctx: &ComputeContext,
    axes: usize,
    keepdims: bool,
    threads: usize,
) -> ::ort::Result<()> {
    let (shape, x) = f32_input(ctx, LEADING_SUM, 0)?;
    if axes > shape.len() {
        return Err(::ort::Error::new(format!(
            "{LEADING_SUM}: {axes} leading axes summed of X {shape:?}"
        )));
    }
    let (leading, trailing) = shape.split_at(axes);
    let size = |dims: &[i64]| dims.iter().map(|&d| d.max(0) as usize).product::<usize>();
    let (rows, columns) = (size(leading), size(trailing));
    let kept = if keepdims { axes } else { 0 };
    let out_shape: Vec<i64> = std::iter::repeat_n(1, kept)
        .chain(trailing.iter().copied())
        .collect();
    let out = f32_output(ctx, LEADING_SUM, 0, &out_shape)?;
    if columns == 0 {
        return Ok(());
    }
    let tasks = threads
        .min(columns.div_ceil(LEADING_SUM_TASK_COLUMNS))
        .max(1);
    let block = 16 * columns.div_ceil(tasks).div_ceil(16);
    in_chunks(
        ctx,
        (columns, block),
        out.chunks_mut(block),
        |range, out| leading_sum(x, (rows, columns), range.start, out),
    )
}

struct BlockedWeight;

impl Operator for BlockedWeight {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        BLOCKED_WEIGHT
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [OperatorInput::required(TensorElementType::Float32)]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    /// W's shape, its two channel axes swapped for the transposed form. ONNX Runtime's own
    /// fusions downstream need the shapes: without them the shortcut convolutions' `Conv`
    /// + `Add` and the channel halves' `Slice`s to `Split` were not fused (the ResNet-8).
    fn infer_shape(&self, ctx: &mut ShapeInferenceContext) -> ::ort::Result<()> {
        let transposed = ctx.attr::<i64>("transposed").unwrap_or(0) != 0;
        let Some(mut w) = ctx.inputs().into_iter().next() else {
            return Ok(());
        };
        if let ::ort::value::ValueType::Tensor {
            shape,
            dimension_symbols,
            ..
        } = &mut w
        {
            if shape.len() != 4 || dimension_symbols.len() != 4 {
                return Ok(());
            }
            if transposed {
                shape.swap(0, 1);
                let mut symbols = dimension_symbols.to_vec();
                symbols.swap(0, 1);
                *dimension_symbols = ::ort::value::SymbolicDimensions::new(symbols);
            }
        }
        ctx.set_output(0, &w)
    }

    fn create_kernel<'attr>(
        &self,
        kctx: &KernelContext<'attr>,
    ) -> ::ort::Result<Self::Kernel<'attr>> {
        let block = kctx
            .get::<i64>("block")
            .and_then(|b| usize::try_from(b).ok())
            .filter(|b| *b > 0)
            .ok_or_else(|| {
                ::ort::Error::new(format!("{BLOCKED_WEIGHT}: attribute 'block' is not a size"))
            })?;
        let transposed = kctx.get::<i64>("transposed").unwrap_or(0) != 0;
        Ok(Box::new(move |ctx: &ComputeContext| {
            blocked_weight_kernel(ctx, block, transposed)
        }))
    }
}

fn blocked_weight_kernel(
    ctx: &ComputeContext,
    block: usize,
    transposed: bool,
) -> ::ort::Result<()> {
    let (shape, w) = f32_input(ctx, BLOCKED_WEIGHT, 0)?;
    let dims: Option<Vec<usize>> = shape.iter().map(|&d| usize::try_from(d).ok()).collect();
    let Some(&[m, c, kh, kw]) = dims.as_deref() else {
        return Err(::ort::Error::new(format!(
            "{BLOCKED_WEIGHT}: W has shape {shape:?}, not [M, C, kh, kw]"
        )));
    };
    if m % block != 0 || c % block != 0 {
        return Err(::ort::Error::new(format!(
            "{BLOCKED_WEIGHT}: W {shape:?} is not in blocks of {block} channels"
        )));
    }
    let out_shape = if transposed {
        [c, m, kh, kw]
    } else {
        [m, c, kh, kw]
    }
    .map(|d| d as i64);
    let out = f32_output(ctx, BLOCKED_WEIGHT, 0, &out_shape)?;
    blocked_weight(w, [m, c, kh, kw], block, transposed, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tasks [`even_chunk`] makes: whole units, at most about [`CHUNK`] elements each
    /// (one unit where a unit is larger), a power-of-two count, equal where the units
    /// divide so, and every element in one.
    #[test]
    fn even_chunks() {
        let tasks = |len: usize, unit: usize| {
            let chunk = even_chunk(len, unit);
            assert_eq!(chunk % unit.max(1), 0, "{len} by {unit}");
            (chunk, len.div_ceil(chunk))
        };
        // The MLP's layers: 1024 x 784 and 1024 x 1024, by lines and by 8-row tiles.
        assert_eq!(tasks(802_816, LINE_FLOATS), (50_176, 16));
        assert_eq!(tasks(802_816, 8 * 784), (50_176, 16));
        assert_eq!(tasks(1 << 20, LINE_FLOATS), (CHUNK, 16));
        assert_eq!(tasks(1 << 20, 8 * 1024), (CHUNK, 16));
        // Small: one task. Units larger than CHUNK: one a task.
        assert_eq!(tasks(10_240, LINE_FLOATS), (10_240, 1));
        assert_eq!(tasks(1000, LINE_FLOATS), (1008, 1));
        assert_eq!(tasks(0, LINE_FLOATS), (LINE_FLOATS, 0));
        assert_eq!(tasks(16 * 200_000, 200_000), (200_000, 16));
        // Uneven units: tasks of whole units, the last one shorter, none beyond.
        for (len, unit) in [
            (1_000_003, 16),
            (777_777, 8 * 100),
            (65_537, 16),
            (3 << 20, 7),
        ] {
            let (chunk, count) = tasks(len, unit);
            assert!(
                count <= len.div_ceil(CHUNK).next_power_of_two(),
                "{len} by {unit}"
            );
            assert!(chunk <= CHUNK + 2 * unit, "{len} by {unit}: {chunk}");
            assert!(chunk * count >= len && chunk * (count - 1) < len);
        }
    }
}
