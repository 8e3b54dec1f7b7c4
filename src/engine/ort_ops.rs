//! onnx-ga's fused operators ([`crate::fused_ops`]) as ONNX Runtime custom operators
//! (CPU), registered with every session [`super::ort::OrtSession`] opens with
//! `fused_kernels`. A model only contains them after `passes::fuse` ran on it in
//! memory; files never do.

use std::sync::Mutex;

use ::ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorDomain, OperatorInput,
    OperatorOutput, ShapeInferenceContext,
};
use ::ort::value::TensorElementType;

use crate::fused_ops::{
    adamw_slot, adamw_update, sgd_slot, sgd_update, AdamWScalars, SgdScalars, ADAMW_UPDATE, DOMAIN,
    SGD_UPDATE,
};

/// The domain with every fused operator, for a session builder.
pub fn domain() -> ::ort::Result<OperatorDomain> {
    OperatorDomain::new(DOMAIN)?
        .add(AdamWUpdate)?
        .add(SgdUpdate)
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

/// Elements per task of the intra-op thread pool: large enough that a task's overhead is
/// small, small enough that 2-4 threads share a 1M-element parameter evenly.
const CHUNK: usize = 1 << 16;

/// Scalar input `slot` of a fused operator's node: `None` when the optional input is
/// absent, an error naming `op` when it is not one element.
fn scalar_input(ctx: &ComputeContext, op: &str, slot: usize) -> ::ort::Result<Option<f32>> {
    let Some(value) = ctx.input(slot)? else {
        return Ok(None);
    };
    match value.try_extract_tensor::<f32>()?.1 {
        [x] => Ok(Some(*x)),
        data => Err(::ort::Error::new(format!(
            "{op}: input {slot} has {} elements, not one",
            data.len()
        ))),
    }
}

struct AdamWUpdate;

impl Operator for AdamWUpdate {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        ADAMW_UPDATE
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..adamw_slot::COUNT).map(|slot| match slot {
            adamw_slot::A
            | adamw_slot::C
            | adamw_slot::LR_WD
            | adamw_slot::GRAD_ADDEND
            | adamw_slot::GRAD_DIVISOR => OperatorInput::optional(TensorElementType::Float32),
            _ => OperatorInput::required(TensorElementType::Float32),
        })
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

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ::ort::Result<Self::Kernel<'attr>> {
        Ok(Box::new(|ctx: &ComputeContext| adamw_kernel(ctx)))
    }
}

fn adamw_kernel(ctx: &ComputeContext) -> ::ort::Result<()> {
    let missing =
        |slot: usize| ::ort::Error::new(format!("{ADAMW_UPDATE}: input {slot} is missing"));
    let scalar = |slot: usize| scalar_input(ctx, ADAMW_UPDATE, slot);
    let required = |slot: usize| scalar(slot)?.ok_or_else(|| missing(slot));
    let corrections = match (scalar(adamw_slot::A)?, scalar(adamw_slot::C)?) {
        (Some(a), Some(c)) => Some((a, c)),
        (None, None) => None,
        _ => {
            return Err(::ort::Error::new(format!(
                "{ADAMW_UPDATE}: the bias corrections a and c come together"
            )))
        }
    };
    let s = AdamWScalars {
        alpha: required(adamw_slot::ALPHA)?,
        one_minus_alpha: required(adamw_slot::ONE_MINUS_ALPHA)?,
        beta: required(adamw_slot::BETA)?,
        one_minus_beta: required(adamw_slot::ONE_MINUS_BETA)?,
        epsilon: required(adamw_slot::EPSILON)?,
        lr: required(adamw_slot::LR)?,
        corrections,
        lr_wd: scalar(adamw_slot::LR_WD)?,
        divisor: scalar(adamw_slot::GRAD_DIVISOR)?,
    };
    let tensor = |slot: usize| ctx.input(slot)?.ok_or_else(|| missing(slot));
    let (p, g, m, v) = (
        tensor(adamw_slot::PARAM)?,
        tensor(adamw_slot::GRAD)?,
        tensor(adamw_slot::M)?,
        tensor(adamw_slot::V)?,
    );
    let (shape, p) = p.try_extract_tensor::<f32>()?;
    let shape = shape.to_vec();
    let (_, g) = g.try_extract_tensor::<f32>()?;
    let (_, m) = m.try_extract_tensor::<f32>()?;
    let (_, v) = v.try_extract_tensor::<f32>()?;
    let addend = ctx.input(adamw_slot::GRAD_ADDEND)?;
    let addend = match &addend {
        Some(a) => Some(a.try_extract_tensor::<f32>()?.1),
        None => None,
    };
    let sizes = [g.len(), m.len(), v.len()];
    if sizes
        .iter()
        .chain(addend.map(<[f32]>::len).as_ref())
        .any(|&l| l != p.len())
    {
        return Err(::ort::Error::new(format!(
            "{ADAMW_UPDATE}: parameter ({}), gradient, moments and addend differ in size ({sizes:?}, {:?})",
            p.len(),
            addend.map(<[f32]>::len)
        )));
    }
    let output = |slot: usize| {
        ctx.output(slot, shape.clone())?
            .ok_or_else(|| ::ort::Error::new(format!("{ADAMW_UPDATE}: output {slot} missing")))
    };
    let (mut p_out, mut m_out, mut v_out) = (output(0)?, output(1)?, output(2)?);
    let (_, p_out) = p_out.try_extract_tensor_mut::<f32>()?;
    let (_, m_out) = m_out.try_extract_tensor_mut::<f32>()?;
    let (_, v_out) = v_out.try_extract_tensor_mut::<f32>()?;
    let chunks = p_out
        .chunks_mut(CHUNK)
        .zip(m_out.chunks_mut(CHUNK))
        .zip(v_out.chunks_mut(CHUNK))
        .map(|((p, m), v)| (p, m, v));
    in_chunks(ctx, p.len(), chunks, |range, out| {
        let inputs = (
            &p[range.clone()],
            &g[range.clone()],
            addend.map(|a| &a[range.clone()]),
            &m[range.clone()],
            &v[range],
        );
        adamw_update(&s, inputs, out);
    })
}

/// Runs `update(range, outputs)` over `len` elements in chunks of [`CHUNK`], `outputs` giving
/// each chunk's disjoint output slices in order: inline for one chunk, else as tasks of ONNX
/// Runtime's intra-op pool, each taking its chunk once.
fn in_chunks<O: Send>(
    ctx: &ComputeContext,
    len: usize,
    outputs: impl Iterator<Item = O>,
    update: impl Fn(std::ops::Range<usize>, O) + Sync,
) -> ::ort::Result<()> {
    let tasks: Vec<Mutex<Option<O>>> = outputs.map(|o| Mutex::new(Some(o))).collect();
    let run = |i: usize| {
        if let Ok(Some(out)) = tasks[i].lock().map(|mut t| t.take()) {
            update(i * CHUNK..((i + 1) * CHUNK).min(len), out);
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

struct SgdUpdate;

impl Operator for SgdUpdate {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        SGD_UPDATE
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        (0..sgd_slot::COUNT).map(|slot| match slot {
            sgd_slot::PARAM | sgd_slot::GRAD | sgd_slot::LR => {
                OperatorInput::required(TensorElementType::Float32)
            }
            _ => OperatorInput::optional(TensorElementType::Float32),
        })
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
        Ok(Box::new(move |ctx: &ComputeContext| {
            sgd_kernel(ctx, nesterov)
        }))
    }
}

/// One input as a float32 slice (`None` when the optional input is absent).
macro_rules! slice_of {
    ($value:expr) => {
        match &$value {
            Some(v) => Some(v.try_extract_tensor::<f32>()?.1),
            None => None,
        }
    };
}

fn sgd_kernel(ctx: &ComputeContext, nesterov: bool) -> ::ort::Result<()> {
    let scalar = |slot: usize| scalar_input(ctx, SGD_UPDATE, slot);
    let lr = scalar(sgd_slot::LR)?
        .ok_or_else(|| ::ort::Error::new(format!("{SGD_UPDATE}: no learning rate")))?;
    let mu = scalar(sgd_slot::MU)?;
    let s = SgdScalars {
        lr,
        momentum: mu.map(|mu| (mu, nesterov)),
        wd: scalar(sgd_slot::WD)?,
        divisor: scalar(sgd_slot::GRAD_DIVISOR)?,
    };
    let missing = |slot: usize| ::ort::Error::new(format!("{SGD_UPDATE}: input {slot} is missing"));
    let p = ctx
        .input(sgd_slot::PARAM)?
        .ok_or_else(|| missing(sgd_slot::PARAM))?;
    let g = ctx
        .input(sgd_slot::GRAD)?
        .ok_or_else(|| missing(sgd_slot::GRAD))?;
    let (buf, addend) = (ctx.input(sgd_slot::BUF)?, ctx.input(sgd_slot::GRAD_ADDEND)?);
    let (shape, p) = p.try_extract_tensor::<f32>()?;
    let shape = shape.to_vec();
    let g = g.try_extract_tensor::<f32>()?.1;
    let (buf, addend) = (slice_of!(buf), slice_of!(addend));
    if buf.is_some() != mu.is_some() {
        return Err(::ort::Error::new(format!(
            "{SGD_UPDATE}: a momentum buffer and its momentum come together"
        )));
    }
    let sizes = [
        Some(g.len()),
        buf.map(<[f32]>::len),
        addend.map(<[f32]>::len),
    ];
    if sizes.iter().flatten().any(|&l| l != p.len()) {
        return Err(::ort::Error::new(format!(
            "{SGD_UPDATE}: parameter ({}), gradient, buffer and addend differ in size ({sizes:?})",
            p.len()
        )));
    }
    let mut p_out = ctx
        .output(0, shape.clone())?
        .ok_or_else(|| ::ort::Error::new(format!("{SGD_UPDATE}: output 0 missing")))?;
    let p_out = p_out.try_extract_tensor_mut::<f32>()?.1;
    let mut buf_out = match buf {
        Some(_) => Some(
            ctx.output(1, shape)?
                .ok_or_else(|| ::ort::Error::new(format!("{SGD_UPDATE}: output 1 missing")))?,
        ),
        None => None,
    };
    let buf_out = match &mut buf_out {
        Some(v) => Some(v.try_extract_tensor_mut::<f32>()?.1),
        None => None,
    };
    let mut buf_chunks = buf_out.map(|b| b.chunks_mut(CHUNK));
    let chunks = p_out
        .chunks_mut(CHUNK)
        .map(move |p| (p, buf_chunks.as_mut().and_then(Iterator::next)));
    in_chunks(ctx, p.len(), chunks, |range, out| {
        let inputs = (
            &p[range.clone()],
            &g[range.clone()],
            addend.map(|a| &a[range.clone()]),
            buf.map(|b| &b[range]),
        );
        sgd_update(&s, inputs, out);
    })
}
