//! ONNX Runtime sessions: over host tensors ([`OrtSession::run`]), and over values that stay
//! in ONNX Runtime's memory between runs ([`OrtSession::run_held`], what the trainer uses so
//! that state never visits the host).
//!
//! On the CPU a held value is simply the previous run's output, fed back as an input. On
//! CUDA the run goes through an `IoBinding`: state inputs are bound where they already live
//! (device memory), every output is bound to the device, and ONNX Runtime allocates each
//! output fresh from its device arena, so a state's old and new buffers alternate
//! (ping-pong) without a copy to the host and without aliasing an input that the same run
//! still reads. Only data inputs (host arrays) cross to the device, once per run.

use std::borrow::Cow;
use std::str::FromStr;

use ::ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ::ort::session::{builder::GraphOptimizationLevel, Session, SessionInputValue};
use ::ort::value::{DynValue, Tensor as OrtTensor, TensorElementType, TensorRef, ValueType};

use super::EngineError;
use crate::data::Tensor;
use crate::proto::ModelProto;

fn ort_err(context: &str) -> impl Fn(::ort::Error) -> EngineError + '_ {
    move |e| EngineError::Ort {
        context: context.to_string(),
        message: e.to_string(),
    }
}

/// Where ONNX Runtime runs a session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
    /// The CUDA execution provider on this GPU (needs an ONNX Runtime built with CUDA, such
    /// as the `onnxruntime-gpu` package).
    Cuda(i32),
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<i32>) {
                Some(Ok(id)) if id >= 0 => Ok(Device::Cuda(id)),
                _ => Err(format!("unknown device '{other}' (cpu, cuda, cuda:N)")),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(id) => write!(f, "cuda:{id}"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Intra-op threads; 0 lets ONNX Runtime choose.
    pub threads: usize,
    /// Graph optimizations (on by default; tests of exact kernels may turn them off).
    pub optimize: bool,
    /// Where the session runs (ONNX Runtime only; tract runs on the CPU).
    pub device: Device,
    /// Run held values through an `IoBinding` even on the CPU (on CUDA always). The CPU
    /// needs none; this exists so that the path CUDA takes is tested where there is no GPU.
    pub io_binding: bool,
    /// Take CPU memory from the one arena registered in the environment
    /// ([`crate::runtime::register_shared_cpu_arena`]) instead of an arena per session: the
    /// trainer sets it so that its two specialised sessions share their activation memory.
    pub shared_arena: bool,
    /// Let intra-op worker threads spin (busy-wait) for work between parallel sections, as
    /// ONNX Runtime does by default (`session.intra_op.allow_spinning`). Sessions that take
    /// turns must not: the idle session's spinning pool takes the cores the running one
    /// needs. The trainer's two specialisations turn it off (at 2 threads on a 2-core
    /// machine the split step went from 0.70x to 1.5x the speed of 1 thread; benches/README.md).
    pub spin: bool,
    /// Register onnx-ga's fused CPU kernels ([`crate::fused_ops`]) with the session, and let
    /// the trainer swap the standard-op optimizer updates for them in memory
    /// (`passes::fuse`; on the CPU only: on CUDA a CPU kernel would copy every
    /// parameter to the host and back), and the session its BatchNorm layers
    /// ([`Self::fused_batch_norm`]). Off runs the step exactly as written.
    pub fused_kernels: bool,
    /// Run on the environment's shared intra-op pool when it has `threads` threads
    /// ([`crate::runtime::shared_pool_threads`]; it spins), instead of a pool of the
    /// session's own: the trainer sets it for its specialised sessions, which take turns.
    pub shared_pool: bool,
    /// With `fused_kernels`: let the trainer's specialised sessions update the states their
    /// fused kernels write (accumulators, parameters, moments) in place, each output bound
    /// to its input's buffer (`passes::fuse::in_place`). Off keeps value semantics: every
    /// run writes fresh buffers.
    pub in_place_updates: bool,
    /// ONNX Runtime's memory pattern: each run's intermediates planned into one block,
    /// allocated as one. The trainer turns it off for its specialised sessions: in the one
    /// arena they share, each session's block stays reserved beside the others' (peak RSS
    /// on the ResNet-8 with BatchNorm at B 32: 217 -> 100 MiB; benches/README.md, "Run I").
    pub memory_pattern: bool,
    /// On the CPU with graph optimizations: run the convolutions the rule of
    /// `passes::nchwc_conv` admits on ONNX Runtime's blocked-layout (NCHWc) kernels, which
    /// its own optimizer applies only to constant weights. Within float32 rounding of the
    /// im2col kernel, not bit-identical. Off runs every convolution as written.
    pub nchwc_convs: bool,
    /// With `fused_kernels`, on the CPU: run each training-mode BatchNorm layer's forward
    /// and backward, as the legalize lowerings write them, on onnx-ga's two fused kernels
    /// (`passes::fused_batch_norm`). Within float32 rounding of the standard ops, not
    /// bit-identical. Off runs them as written.
    pub fused_batch_norm: bool,
    /// With `fused_kernels`, on the CPU: the weight gradients' unfoldings (`Conv` with
    /// identity filters, `passes/legalize/conv_grad.rs`) on onnx-ga's `Im2Col` kernel
    /// (`passes::fused_im2col`); bit-identical for finite values.
    pub fused_im2col: bool,
    /// With `fused_kernels`, on the CPU, on two threads or more: the transposed
    /// convolutions without groups (the strided convolutions' data gradients, a decoder's
    /// upsampling) as one batched product and onnx-ga's `Col2Im` kernel, which folds the
    /// images in parallel (`passes::fused_col2im`); bit-identical.
    pub fused_col2im: bool,
    /// With `fused_kernels` and `fused_im2col`, on the CPU, on one thread: each weight
    /// gradient's unfolding, per-image product and sum over the images
    /// (`passes/legalize/conv_grad.rs`) on onnx-ga's `ConvWeightGrad` kernel, one image's
    /// columns in cache at a time (`passes::fused_conv_weight_grad`); bit-identical.
    pub fused_conv_weight_grad: bool,
    /// With `fused_conv_weight_grad`: the fewest elements in one image's columns for which
    /// the kernel is used (`passes::fused_conv_weight_grad::MIN_IMAGE_COLUMNS` by default;
    /// 0 takes every one, which tests use on small graphs).
    pub conv_weight_grad_min_columns: i64,
    /// With `fused_kernels`, on the CPU: a `Transpose` that keeps the last axis last (a
    /// transformer's head split and merge) on onnx-ga's `RowTranspose` kernel, whole rows
    /// copied over the session's threads (`passes::fused_transpose`); bit-identical.
    pub fused_transpose: bool,
    /// With `fused_kernels`, on the CPU: the ReLU gradients (`Mul(dY, Cast(Greater(Y, 0)))`,
    /// `passes/legalize/relu_grad.rs`) on onnx-ga's `ReluGrad` kernel, one pass instead of
    /// three (`passes::fused_relu_grad`); bit-identical.
    pub fused_relu_grad: bool,
    /// With `fused_kernels`, on the CPU: the exact GELU's gradients (ten elementwise ops of
    /// our autodiff) on onnx-ga's `GeluGrad` kernel, one pass (`passes::fused_gelu_grad`).
    /// The same operations but the exponential's, so within its rounding.
    pub fused_gelu_grad: bool,
    /// With `fused_kernels`, on the CPU: the exact GELU's forwards (five elementwise ops as
    /// a model exports them) on onnx-ga's `Gelu` kernel, one pass around ONNX Runtime's own
    /// `Erf`, bit-identical (`passes::fused_gelu`).
    pub fused_gelu: bool,
    /// With `fused_kernels`, on the CPU: layer normalisation's gradients (thirteen ops of
    /// the legalize lowering) on onnx-ga's `LayerNormGrad` kernel, one pass, within the
    /// rounding of its sums (`passes::fused_layer_norm_grad`).
    pub fused_layer_norm_grad: bool,
    /// With `fused_kernels`, on the CPU: a linear layer's `MatMul` on more than two axes
    /// and its bias `Add` as one `Gemm` with the bias as C, between two Reshapes (standard
    /// ops; `passes::bias_in_gemm`). Within float32 rounding: the bias is added first.
    pub bias_in_gemm: bool,
    /// With `fused_kernels`, on the CPU: a `ReduceSum` over leading axes (the sums over
    /// the batch of bias and convolution weight gradients) on onnx-ga's `LeadingSum`
    /// kernel, one pass over X on any number of threads (`passes::fused_leading_sum`);
    /// bit-identical.
    pub fused_leading_sum: bool,
    /// With `fused_kernels` and `in_place_updates`, on the CPU: a weight gradient
    /// `Gemm(A, B, transA = 1)` and its accumulation as one `AccumulateProduct` node, which
    /// at a small micro-batch makes the gradient inside the accumulator
    /// (`passes::fuse::accumulate_product`); bit-identical.
    pub fused_weight_grads: bool,
    /// With `in_place_updates`: a session whose in-place states would hold fewer elements
    /// in all runs apart (`passes::fuse::in_place::MIN_SESSION_ELEMENTS` by default; 0:
    /// never apart for being small).
    pub in_place_min_total: i64,
    /// Let the trainer take the scalar nodes of its sessions whose inputs the host holds
    /// (counters, controls, the bias corrections) out of them and compute them itself
    /// before each run (`engine::host_scalars`); bit-identical. Off runs every node in the
    /// session.
    pub host_scalars: bool,
    /// With `in_place_updates`: a specialised session whose every in-place state is a
    /// fused optimizer update's or accumulation's, and which holds fewer than
    /// `passes::fuse::host::MAX_ELEMENTS` elements in them, runs those updates on the host
    /// after the run, in place, on the calling thread (`passes::fuse::host`,
    /// `engine::host_updates`). The same kernels, so the same bits. Off leaves them in the
    /// session (bound in place, or apart below `in_place_min_total`).
    pub host_updates: bool,
    /// With `fused_weight_grads`: keep the weight gradients' operands in this table instead
    /// of adding each micro-step's product to its accumulator, until the window needs the
    /// sum (`engine::deferred_products`). The trainer sets it for its window start,
    /// accumulating and apply sessions where `defer_weight_grads` lets it; bit-identical.
    pub deferred_products: Option<std::sync::Arc<super::deferred_products::DeferredProducts>>,
    /// Let the trainer keep weight gradients for the window's sum (`deferred_products`).
    /// Off adds each micro-step's product to its accumulator as it is made.
    pub defer_weight_grads: bool,
    /// With `fused_weight_grads`: the apply's own weight gradients made inside its fused
    /// optimizer updates (`passes::fuse::apply_product`); bit-identical. Off has ONNX
    /// Runtime's `Gemm` write them for the update to read.
    pub apply_products: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            threads: 1,
            optimize: true,
            device: Device::Cpu,
            io_binding: false,
            shared_arena: false,
            spin: true,
            fused_kernels: true,
            shared_pool: false,
            in_place_updates: true,
            memory_pattern: true,
            nchwc_convs: true,
            fused_batch_norm: true,
            fused_im2col: true,
            fused_col2im: true,
            fused_conv_weight_grad: true,
            conv_weight_grad_min_columns: crate::passes::fused_conv_weight_grad::MIN_IMAGE_COLUMNS,
            fused_transpose: true,
            fused_relu_grad: true,
            fused_gelu_grad: true,
            fused_gelu: true,
            fused_layer_norm_grad: true,
            bias_in_gemm: true,
            fused_leading_sum: true,
            fused_weight_grads: true,
            in_place_min_total: crate::passes::fuse::in_place::MIN_SESSION_ELEMENTS,
            host_scalars: true,
            host_updates: true,
            deferred_products: None,
            defer_weight_grads: true,
            apply_products: true,
        }
    }
}

/// One ONNX Runtime session.
pub struct OrtSession {
    session: Session,
    /// Where bound outputs go (device memory on CUDA); `None`: no IoBinding, plain runs.
    device_memory: Option<MemoryInfo<'static>>,
    /// Outputs the host reads every run (the loss, flags): bound to CPU memory, so that only
    /// they cross from the device.
    host_outputs: std::collections::HashSet<String>,
    pub input_names: Vec<String>,
    pub output_names: Vec<String>,
    /// (state input, its next value) pairs updated in place ([`Self::set_in_place`]), and
    /// their inputs, for the lookups of every run.
    in_place: Vec<(String, String)>,
    in_place_inputs: std::collections::HashMap<String, String>,
    /// [`Self::input_names`] as a set: a run looks up every in-place state in it.
    input_set: std::collections::HashSet<String>,
    /// The input of the fused kernels' gate, fed by the host (`fused_ops::KEEP_NONFINITE`).
    pub keep_input: Option<String>,
    /// See [`Self::nchwc_convs`].
    nchwc_convs: usize,
    /// See [`Self::fused_batch_norms`].
    fused_batch_norms: usize,
    /// See [`Self::fused_unfoldings`].
    fused_unfoldings: usize,
    /// See [`Self::fused_relu_grads`].
    fused_relu_grads: usize,
    /// See [`Self::fused_gelu_grads`].
    fused_gelu_grads: usize,
    /// See [`Self::fused_gelus`].
    fused_gelus: usize,
    /// See [`Self::fused_layer_norm_grads`].
    fused_layer_norm_grads: usize,
    /// See [`Self::biases_in_gemm`].
    biases_in_gemm: usize,
    /// See [`Self::fused_leading_sums`].
    fused_leading_sums: usize,
    /// See [`Self::fused_foldings`].
    fused_foldings: usize,
    /// See [`Self::fused_conv_weight_grads`].
    fused_conv_weight_grads: usize,
    /// See [`Self::fused_transposes`].
    fused_transposes: usize,
    /// See [`Self::nchwc_weights_on_kernel`].
    nchwc_weights_on_kernel: usize,
    /// Inputs of the model that nothing in it reads, left out of the session
    /// ([`without_unread_inputs`]); a run given them ignores them.
    unread_inputs: std::collections::HashSet<String>,
    /// Which of the last run's feeds the session reads ([`ReadFilter`]).
    read_filter: ReadFilter,
    /// Scalar nodes taken out of the model, which the host computes before each run
    /// (`super::host_scalars`; run by [`super::Engine`]).
    host_scalars: Option<std::sync::Arc<super::host_scalars::HostScalars>>,
    /// The binding of in-place runs on the CPU, kept from one run to the next
    /// ([`super::kept_binding`]).
    kept: Option<Box<super::kept_binding::KeptBinding>>,
    /// The optimizer updates the host runs after each run, in place
    /// (`passes::fuse::host`; run by [`super::Engine`]).
    pub(super) host_updates: Option<Box<super::host_updates::Prepared>>,
    /// The outputs of static shape and at most [`SMALL_OUTPUT`] elements (the loss, flags).
    small_outputs: Vec<String>,
    /// The outputs runs through the kept binding write into buffers of the binding's own
    /// ([`Self::add_transient`]): the small outputs, and what the host reads before the
    /// next run.
    transient: Vec<String>,
}

/// The most elements of an output that a run with a kept binding writes into a buffer of
/// its own and the host then copies ([`OrtSession::small_outputs`]): a copy of a scalar
/// costs less than ONNX Runtime allocating it and ort wrapping it.
pub const SMALL_OUTPUT: i64 = 16;

impl OrtSession {
    pub fn new(model: &ModelProto, options: &SessionOptions) -> Result<OrtSession, EngineError> {
        // A step declaring a newer opset or IR version than ONNX Runtime loads (one written
        // from an onnx 1.23 model by an older onnx-ga): moved down where no node's meaning
        // changes (`passes::fit_opset`), else refused with the nodes that keep it there.
        let fitted =
            crate::passes::fit_opset::fit_for_ort(model).map_err(|e| EngineError::Ort {
                context: "loading the model".into(),
                message: e.to_string(),
            })?;
        let model = fitted.as_ref();
        // On CUDA: the ops its provider has no kernel for, lowered so that they do not run
        // on the CPU with copies around them (`passes::lower_for_cuda`).
        let for_cuda = match options.device {
            Device::Cuda(_) => {
                Some(crate::passes::lower_for_cuda::prepare(model).map_err(|e| {
                    EngineError::Ort {
                        context: "lowering what the CUDA provider has no kernel for".into(),
                        message: e.to_string(),
                    }
                })?)
            }
            Device::Cpu => None,
        };
        let model = for_cuda.as_deref().unwrap_or(model);
        let blocked = match nchwc_block(options)? {
            Some(block) => {
                let own_kernel = options.fused_kernels && options.device == Device::Cpu;
                crate::passes::nchwc_conv::rewrite(model, block, own_kernel).map_err(|e| {
                    EngineError::Ort {
                        context: "putting the convolutions on the blocked kernels".into(),
                        message: e.to_string(),
                    }
                })?
            }
            None => None,
        };
        // The model as given, standard ops but for the trainer's fusions: the shape facts
        // the passes after onnx-ga's first operators read (inferred once, when first read).
        let facts_from = crate::passes::FactsBefore::new(model);
        let model = blocked.as_ref().map_or(model, |b| &b.model);
        // onnx-ga's own CPU kernels, each pass on the model the previous one left.
        let ours = |on: bool| on && options.fused_kernels && options.device == Device::Cpu;
        // First: it reads the shapes of the products' inputs, which the shape facts do not
        // carry through onnx-ga's own operators.
        let biases = in_memory(
            ours(options.bias_in_gemm),
            "adding the linear layers' biases inside their products",
            || crate::passes::bias_in_gemm::rewrite(model),
        )?;
        let model = biases.as_ref().map_or(model, |b| &b.model);
        let fused_bn = in_memory(
            ours(options.fused_batch_norm),
            "putting BatchNorm on the fused kernels",
            || crate::passes::fused_batch_norm::rewrite(model),
        )?;
        let model = fused_bn.as_ref().map_or(model, |f| &f.model);
        let unfolded = in_memory(
            ours(options.fused_im2col),
            "putting the unfoldings on the fused kernel",
            || crate::passes::fused_im2col::rewrite(model),
        )?;
        let model = unfolded.as_ref().map_or(model, |u| &u.model);
        // Right after the unfoldings it takes: it reads the channels of X and dY from the
        // model as given.
        let weight_grads = in_memory(
            ours(options.fused_conv_weight_grad),
            "putting the convolutions' weight gradients on the fused kernel",
            || {
                crate::passes::fused_conv_weight_grad::rewrite(
                    model,
                    &facts_from,
                    options.threads,
                    options.conv_weight_grad_min_columns,
                )
            },
        )?;
        let model = weight_grads.as_ref().map_or(model, |g| &g.model);
        let foldings = in_memory(
            ours(options.fused_col2im),
            "putting the transposed convolutions on a product and the fused folding",
            || crate::passes::fused_col2im::rewrite(model, options.threads),
        )?;
        let model = foldings.as_ref().map_or(model, |f| &f.model);
        let relu_grads = in_memory(
            ours(options.fused_relu_grad),
            "putting the ReLU gradients on the fused kernel",
            || crate::passes::fused_relu_grad::rewrite(model),
        )?;
        let model = relu_grads.as_ref().map_or(model, |r| &r.model);
        let gelu_grads = in_memory(
            ours(options.fused_gelu_grad),
            "putting the GELU gradients on the fused kernel",
            || crate::passes::fused_gelu_grad::rewrite(model),
        )?;
        let model = gelu_grads.as_ref().map_or(model, |g| &g.model);
        // After the gradients: theirs reads the forward's ops as nodes.
        let gelus = in_memory(
            ours(options.fused_gelu),
            "putting the GELU forwards on the fused kernel",
            || crate::passes::fused_gelu::rewrite(model),
        )?;
        let model = gelus.as_ref().map_or(model, |g| &g.model);
        let layer_norm_grads = in_memory(
            ours(options.fused_layer_norm_grad),
            "putting the layer-norm gradients on the fused kernel",
            || crate::passes::fused_layer_norm_grad::rewrite(model),
        )?;
        let model = layer_norm_grads.as_ref().map_or(model, |l| &l.model);
        let transposes = in_memory(
            ours(options.fused_transpose),
            "putting the row transposes on the fused kernel",
            || crate::passes::fused_transpose::rewrite(model, &facts_from),
        )?;
        let model = transposes.as_ref().map_or(model, |t| &t.model);
        // Last: the kernels above take some sums over leading axes into themselves. Its
        // shape facts come from the model as it stood before them.
        let sums = in_memory(
            ours(options.fused_leading_sum),
            "putting the sums over leading axes on the fused kernel",
            || crate::passes::fused_leading_sum::rewrite(model, &facts_from, options.threads),
        )?;
        let model = sums.as_ref().map_or(model, |s| &s.model);
        let (pruned, unread) = without_unread_inputs(model);
        let bytes = crate::model::encode_model(pruned.as_ref().unwrap_or(model));
        let mut session = Self::from_bytes(&bytes, options)?;
        session.nchwc_weights_on_kernel = blocked.as_ref().map_or(0, |b| b.weights_on_kernel);
        session.nchwc_convs = blocked.map_or(0, |b| b.convs);
        session.fused_batch_norms = fused_bn.map_or(0, |f| f.forward + f.backward);
        session.fused_unfoldings = unfolded.map_or(0, |u| u.unfoldings);
        session.fused_relu_grads = relu_grads.map_or(0, |r| r.relu_grads);
        session.fused_gelu_grads = gelu_grads.map_or(0, |g| g.gelu_grads);
        session.fused_gelus = gelus.map_or(0, |g| g.gelus);
        session.fused_layer_norm_grads = layer_norm_grads.map_or(0, |l| l.layer_norm_grads);
        session.biases_in_gemm = biases.map_or(0, |b| b.biases);
        session.fused_leading_sums = sums.map_or(0, |s| s.sums);
        session.fused_foldings = foldings.map_or(0, |f| f.foldings);
        session.fused_conv_weight_grads = weight_grads.map_or(0, |g| g.weight_grads);
        session.fused_transposes = transposes.map_or(0, |t| t.transposes);
        session.unread_inputs = unread;
        Ok(session)
    }

    /// Convolutions this session runs on the blocked kernels (`SessionOptions::nchwc_convs`).
    pub fn nchwc_convs(&self) -> usize {
        self.nchwc_convs
    }

    /// BatchNorm forwards and backwards this session runs on the fused kernels
    /// (`SessionOptions::fused_batch_norm`).
    pub fn fused_batch_norms(&self) -> usize {
        self.fused_batch_norms
    }

    /// Weight-gradient unfoldings this session runs on `Im2Col`
    /// (`SessionOptions::fused_im2col`).
    pub fn fused_unfoldings(&self) -> usize {
        self.fused_unfoldings
    }

    /// ReLU gradients this session runs on `ReluGrad` (`SessionOptions::fused_relu_grad`).
    pub fn fused_relu_grads(&self) -> usize {
        self.fused_relu_grads
    }

    /// GELU gradients this session runs on `GeluGrad` (`SessionOptions::fused_gelu_grad`).
    pub fn fused_gelu_grads(&self) -> usize {
        self.fused_gelu_grads
    }

    /// GELU forwards this session runs on `Gelu` (`SessionOptions::fused_gelu`).
    pub fn fused_gelus(&self) -> usize {
        self.fused_gelus
    }

    /// Layer-norm gradients this session runs on `LayerNormGrad`
    /// (`SessionOptions::fused_layer_norm_grad`).
    pub fn fused_layer_norm_grads(&self) -> usize {
        self.fused_layer_norm_grads
    }

    /// Linear layers whose bias this session adds inside their `Gemm`
    /// (`SessionOptions::bias_in_gemm`).
    pub fn biases_in_gemm(&self) -> usize {
        self.biases_in_gemm
    }

    /// Weights of the blocked convolutions this session puts in their layout on
    /// `BlockedWeight` (`SessionOptions::nchwc_convs` with `fused_kernels`).
    pub fn nchwc_weights_on_kernel(&self) -> usize {
        self.nchwc_weights_on_kernel
    }

    /// Sums over leading axes this session runs on `LeadingSum`
    /// (`SessionOptions::fused_leading_sum`).
    pub fn fused_leading_sums(&self) -> usize {
        self.fused_leading_sums
    }

    /// Transposed convolutions this session runs as a product and `Col2Im`
    /// (`SessionOptions::fused_col2im`).
    pub fn fused_foldings(&self) -> usize {
        self.fused_foldings
    }

    /// Convolutions' weight gradients this session runs on `ConvWeightGrad`
    /// (`SessionOptions::fused_conv_weight_grad`).
    pub fn fused_conv_weight_grads(&self) -> usize {
        self.fused_conv_weight_grads
    }

    /// Transposes this session runs on `RowTranspose` (`SessionOptions::fused_transpose`).
    pub fn fused_transposes(&self) -> usize {
        self.fused_transposes
    }

    pub fn from_bytes(bytes: &[u8], options: &SessionOptions) -> Result<OrtSession, EngineError> {
        if let Some(message) = crate::model::too_large_to_parse(bytes.len()) {
            return Err(EngineError::Ort {
                context: "loading the model".into(),
                message,
            });
        }
        let mut builder = crate::runtime::session_builder()?;
        let shared_pool = options.shared_pool
            && options.threads > 1
            && crate::runtime::shared_pool_threads() == Some(options.threads);
        if !shared_pool {
            builder = builder
                .with_independent_thread_pool()
                .map_err(|e| ort_err("thread pool")(e.into()))?;
        }
        if !options.spin && !shared_pool {
            builder = builder
                .with_intra_op_spinning(false)
                .map_err(|e| ort_err("intra-op spinning")(e.into()))?;
        }
        if options.threads > 0 && !shared_pool {
            builder = builder
                .with_intra_threads(options.threads)
                .map_err(|e| ort_err("threads")(e.into()))?;
        }
        let level = if options.optimize {
            GraphOptimizationLevel::All
        } else {
            GraphOptimizationLevel::Disable
        };
        builder = builder
            .with_optimization_level(level)
            .map_err(|e| ort_err("optimization level")(e.into()))?;
        if options.shared_arena {
            crate::runtime::register_shared_cpu_arena()?;
            builder = builder
                .with_env_allocators()
                .map_err(|e| ort_err("shared arena")(e.into()))?;
        }
        if !options.memory_pattern {
            builder = builder
                .with_memory_pattern(false)
                .map_err(|e| ort_err("memory pattern")(e.into()))?;
        }
        // For profiling: ONNX Runtime's own profiler, one JSON file per session.
        if let Some(prefix) = std::env::var_os("ONNX_GA_ORT_PROFILE") {
            builder = builder
                .with_profiling(prefix)
                .map_err(|e| ort_err("profiling")(e.into()))?;
        }
        if options.fused_kernels && options.device == Device::Cpu {
            let domain = super::ort_ops::domain(options.deferred_products.clone())
                .map_err(ort_err("onnx-ga's fused kernels"))?;
            builder = builder
                .with_operators(domain)
                .map_err(|e| ort_err("onnx-ga's fused kernels")(e.into()))?;
        }
        let device_memory = match options.device {
            Device::Cpu if options.io_binding => Some(MemoryInfo::default()),
            Device::Cpu => None,
            Device::Cuda(id) => {
                builder = builder
                    .with_execution_providers([::ort::ep::CUDA::default()
                        .with_device_id(id)
                        // float32 means float32: ONNX Runtime's default rounds MatMul and
                        // Conv inputs to TF32 (10 mantissa bits), PyTorch's does not.
                        .with_tf32(false)
                        .build()
                        .error_on_failure()])
                    .map_err(|e| {
                        EngineError::Unavailable(format!(
                            "the CUDA execution provider (device {id}) is not available: {}. \
                         It needs an ONNX Runtime built with CUDA (the onnxruntime-gpu package; \
                         point ORT_DYLIB_PATH at its libonnxruntime) and a visible GPU",
                            e.to_string().trim_end_matches('.')
                        ))
                    })?;
                Some(
                    MemoryInfo::new(
                        AllocationDevice::CUDA,
                        id,
                        AllocatorType::Device,
                        MemoryType::Default,
                    )
                    .map_err(ort_err("CUDA memory info"))?,
                )
            }
        };
        let fused_domain = options.fused_kernels && options.device == Device::Cpu;
        let session = super::ort_ops::first_registration(fused_domain, || {
            builder
                .commit_from_memory(bytes)
                .map_err(ort_err("loading the model"))
        })?;
        let input_names: Vec<String> = session
            .inputs()
            .iter()
            .map(|i| i.name().to_string())
            .collect();
        let input_set = input_names.iter().cloned().collect();
        let output_names = session
            .outputs()
            .iter()
            .map(|o| o.name().to_string())
            .collect();
        let small_outputs: Vec<String> = session
            .outputs()
            .iter()
            .filter(|o| {
                o.dtype().tensor_shape().is_some_and(|shape| {
                    shape.iter().all(|&d| d >= 0) && shape.iter().product::<i64>() <= SMALL_OUTPUT
                })
            })
            .map(|o| o.name().to_string())
            .collect();
        Ok(OrtSession {
            session,
            device_memory,
            host_outputs: Default::default(),
            input_names,
            output_names,
            in_place: Vec::new(),
            in_place_inputs: Default::default(),
            input_set,
            keep_input: None,
            nchwc_convs: 0,
            fused_batch_norms: 0,
            fused_unfoldings: 0,
            fused_relu_grads: 0,
            fused_gelu_grads: 0,
            fused_gelus: 0,
            fused_layer_norm_grads: 0,
            biases_in_gemm: 0,
            fused_leading_sums: 0,
            fused_foldings: 0,
            fused_conv_weight_grads: 0,
            fused_transposes: 0,
            nchwc_weights_on_kernel: 0,
            unread_inputs: Default::default(),
            read_filter: ReadFilter::default(),
            host_scalars: None,
            kept: None,
            host_updates: None,
            transient: small_outputs.clone(),
            small_outputs,
        })
    }

    /// Runs the model once; returns every output by name, in the model's output order.
    pub fn run(
        &mut self,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, EngineError> {
        let mut feeds: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(inputs.len());
        for (name, tensor) in inputs {
            if !self.unread_inputs.contains(*name) {
                feeds.push((Cow::Owned(name.to_string()), to_ort(name, tensor)?));
            }
        }
        let outputs = self.session.run(feeds).map_err(ort_err("run"))?;
        let mut result = Vec::with_capacity(outputs.len());
        for (name, value) in outputs.iter() {
            result.push((name.to_string(), from_ort(name, &value)?));
        }
        Ok(result)
    }
}

impl OrtSession {
    /// Names outputs the host reads every run; [`run_held`](Self::run_held) returns them in
    /// CPU memory (on the CPU nothing changes).
    pub fn set_host_outputs(&mut self, names: &[&str]) {
        self.host_outputs = names.iter().map(|n| n.to_string()).collect();
    }

    /// Declares the (state input, its next value) pairs that
    /// [`run_held_in_place`](Self::run_held_in_place) updates in place (the model's fused
    /// kernels must allow it: `passes::fuse::in_place`).
    pub fn set_in_place(&mut self, pairs: Vec<(String, String)>) {
        self.in_place_inputs = pairs.iter().cloned().collect();
        self.in_place = pairs;
    }

    /// Gives the host the scalar nodes split off the session's model.
    pub fn set_host_scalars(&mut self, scalars: super::host_scalars::HostScalars) {
        self.host_scalars = Some(std::sync::Arc::new(scalars));
    }

    /// The scalar nodes the host computes for this session.
    pub fn host_scalars(&self) -> Option<std::sync::Arc<super::host_scalars::HostScalars>> {
        self.host_scalars.clone()
    }

    /// The ONNX Runtime session itself, for measurements of what a run costs around the
    /// graph (benches/scale.rs `floor_bound`).
    #[doc(hidden)]
    pub fn raw_session(&mut self) -> &mut Session {
        &mut self.session
    }

    /// Whether the state input `name` is updated in place.
    pub fn updates_in_place(&self, name: &str) -> bool {
        self.in_place_inputs.contains_key(name)
    }

    /// The state inputs updated in place, with their outputs.
    pub fn in_place(&self) -> &[(String, String)] {
        &self.in_place
    }

    /// Runs the model once with `host` inputs (host arrays, lent without a copy on the CPU)
    /// and `held` inputs (values an earlier run produced, wherever they live). Returns every
    /// output as an ONNX Runtime value on the session's device, in the model's output order.
    pub fn run_held(
        &mut self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
    ) -> Result<Vec<(String, DynValue)>, EngineError> {
        self.run_held_in_place(host, held, &mut [])
    }

    /// [`run_held`](Self::run_held), with the states of [`in_place`](Self::in_place) given
    /// separately: each is read from and written into its own buffer (the value must be
    /// ONNX Runtime's, not lent host memory: [`to_ort_allocated`]). Their outputs are not
    /// returned: the value given holds the next value after the run.
    pub fn run_held_in_place(
        &mut self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
        in_place: &mut [(&str, &mut DynValue)],
    ) -> Result<Vec<(String, DynValue)>, EngineError> {
        let (host, held) = self.only_read(host, held);
        let (host, held) = (&*host, &*held);
        if self.device_memory.is_none() && in_place.is_empty() {
            let mut feeds: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
                Vec::with_capacity(host.len() + held.len());
            for (name, tensor) in host {
                feeds.push((Cow::Borrowed(*name), to_ort(name, tensor)?));
            }
            for (name, value) in held {
                feeds.push((Cow::Borrowed(*name), SessionInputValue::from(*value)));
            }
            let outputs = self.session.run(feeds).map_err(ort_err("run"))?;
            return take_outputs(&self.output_names, outputs);
        }
        if self.device_memory.is_none() {
            return self.run_kept(host, held, in_place);
        }
        let host_memory = MemoryInfo::default();
        let memory = self.device_memory.as_ref().unwrap_or(&host_memory);
        // A fresh binding per run: binding every output anew makes ONNX Runtime allocate it
        // from the device arena instead of reusing last run's buffer, which is this run's
        // state input (reuse would alias an input the run still reads). Only the in-place
        // outputs are bound to their inputs, on purpose.
        let mut binding = self
            .session
            .create_binding()
            .map_err(ort_err("IoBinding"))?;
        for (name, tensor) in host {
            // Owned host tensors: binding copies them to the device once.
            let value = to_owned_ort(name, tensor)?;
            binding
                .bind_input(*name, &value)
                .map_err(ort_err(&format!("binding input '{name}'")))?;
        }
        for (name, value) in held {
            binding
                .bind_input(*name, *value)
                .map_err(ort_err(&format!("binding input '{name}'")))?;
        }
        let mut bound = std::collections::HashSet::new();
        for (name, value) in in_place.iter_mut() {
            let output = in_place_output(&self.in_place_inputs, name)?;
            // A window start's accumulators are written, not read.
            if self.input_set.contains(*name) {
                binding
                    .bind_input(*name, &**value)
                    .map_err(ort_err(&format!("binding input '{name}'")))?;
            }
            binding
                .bind_output(output.as_str(), &mut **value)
                .map_err(ort_err(&format!("binding output '{output}' to '{name}'")))?;
            bound.insert(output.as_str());
        }
        let mut returned = Vec::with_capacity(self.output_names.len() - bound.len());
        for name in &self.output_names {
            if bound.contains(name.as_str()) {
                continue;
            }
            let to = match self.host_outputs.contains(name) {
                true => &host_memory,
                false => memory,
            };
            binding
                .bind_output_to_device(name.as_str(), to)
                .map_err(ort_err(&format!("binding output '{name}'")))?;
            returned.push(name.clone());
        }
        let outputs = self.session.run_binding(&binding).map_err(ort_err("run"))?;
        take_outputs(&returned, outputs)
    }
}

impl OrtSession {
    /// The feeds the session reads: most sessions read every input, and then they go
    /// through as given.
    fn only_read<'f, 'a, 'b>(
        &mut self,
        host: &'f [HostFeed<'a>],
        held: &'f [HeldFeed<'b>],
    ) -> (Cow<'f, [HostFeed<'a>]>, Cow<'f, [HeldFeed<'b>]>) {
        if self.unread_inputs.is_empty() {
            return (Cow::Borrowed(host), Cow::Borrowed(held));
        }
        let names = host
            .iter()
            .map(|(n, _)| *n)
            .chain(held.iter().map(|(n, _)| *n));
        let reads = self.read_filter.reads(names, &self.unread_inputs);
        let (host_reads, held_reads) = reads.split_at(host.len());
        (
            Cow::Owned(only_read(host, host_reads)),
            Cow::Owned(only_read(held, held_reads)),
        )
    }

    /// The outputs of static shape and at most [`SMALL_OUTPUT`] elements.
    pub fn small_outputs(&self) -> &[String] {
        &self.small_outputs
    }

    /// Adds outputs the host reads of a run before the next to those runs through the kept
    /// binding ([`run_held_transient`](Self::run_held_transient), in-place runs on the CPU)
    /// write into buffers of the binding's own; the small outputs are there from the start,
    /// and the engine copies them out ([`transient_outputs`](Self::transient_outputs)).
    pub fn add_transient(&mut self, names: &[String]) {
        for name in names {
            if !self.transient.contains(name) {
                self.transient.push(name.clone());
            }
        }
        self.kept = None;
    }

    /// [`run_held`](Self::run_held) through the binding kept across runs, with the outputs
    /// [`add_transient`](Self::add_transient) named written into buffers that binding keeps:
    /// the host reads them right after the run ([`transient_outputs`]
    /// (Self::transient_outputs)), and the next run overwrites them. They are not returned.
    /// On a device this is a plain [`run_held`](Self::run_held) that returns every output.
    pub fn run_held_transient(
        &mut self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
    ) -> Result<Vec<(String, DynValue)>, EngineError> {
        if self.device_memory.is_some() {
            return self.run_held(host, held);
        }
        let (host, held) = self.only_read(host, held);
        let (host, held) = (&*host, &*held);
        self.run_kept(host, held, &mut [])
    }

    /// The last run's values of the outputs [`run_held_transient`](Self::run_held_transient)
    /// kept, by name (none on a device, where that run returns them).
    pub fn transient_outputs(&self) -> &[(String, DynValue)] {
        self.kept.as_ref().map_or(&[], |k| k.transient_outputs())
    }

    /// A run on the CPU through the binding kept across runs: `in_place` states read and
    /// written in their own buffers, the transient outputs kept (see
    /// [`add_transient`](Self::add_transient)).
    fn run_kept(
        &mut self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
        in_place: &mut [(&str, &mut DynValue)],
    ) -> Result<Vec<(String, DynValue)>, EngineError> {
        let mut kept = match self.kept.take() {
            Some(k) if k.serves(host, held, in_place) => k,
            _ => Box::new(super::kept_binding::KeptBinding::new(&self.session)?),
        };
        let (pairs, inputs) = (&self.in_place_inputs, &self.input_set);
        // A window start's accumulators are written, not read.
        let state_of = |name: &str| {
            let output = in_place_output(pairs, name)?.clone();
            Ok((output, inputs.contains(name)))
        };
        // A failed run leaves the binding behind: the next starts afresh.
        let outputs = kept.run(
            &mut self.session,
            &self.output_names,
            host,
            held,
            in_place,
            &state_of,
            &self.transient,
        )?;
        self.kept = Some(kept);
        Ok(outputs)
    }
}

/// A feed from host memory, and one ONNX Runtime holds.
type HostFeed<'a> = (&'a str, &'a Tensor);
type HeldFeed<'a> = (&'a str, &'a DynValue);

/// Which feeds of a run the session reads, remembered for the next run's: a trainer feeds
/// the same names run after run (its state's, its controls'), and looking each up in the
/// set of unread inputs hashed every name every run (~2% of a step at 8K parameters, the
/// scale bench). A run whose names differ is looked up afresh.
#[derive(Default)]
struct ReadFilter {
    names: Vec<String>,
    reads: Vec<bool>,
}

impl ReadFilter {
    /// For each of `names`, whether the session reads it (is not in `unread`).
    fn reads<'n>(
        &mut self,
        names: impl Iterator<Item = &'n str> + Clone,
        unread: &std::collections::HashSet<String>,
    ) -> &[bool] {
        let same = names.clone().count() == self.names.len()
            && names.clone().zip(&self.names).all(|(a, b)| a == b);
        if !same {
            self.names = names.clone().map(str::to_string).collect();
            self.reads = names.map(|n| !unread.contains(n)).collect();
        }
        &self.reads
    }
}

/// The feeds whose `reads` flag is set.
fn only_read<T: Copy>(feeds: &[T], reads: &[bool]) -> Vec<T> {
    feeds
        .iter()
        .zip(reads)
        .filter(|(_, read)| **read)
        .map(|(f, _)| *f)
        .collect()
}

/// The output the in-place state `input` is written to (`pairs`: a session's
/// `in_place_inputs`).
fn in_place_output<'p>(
    pairs: &'p std::collections::HashMap<String, String>,
    input: &str,
) -> Result<&'p String, EngineError> {
    pairs.get(input).ok_or_else(|| EngineError::Input {
        name: input.to_string(),
        message: "is not a state this session updates in place".into(),
    })
}

/// `names`' values from a run's outputs, in that order. The outputs come in the order they
/// were asked for (model order, or binding order), so they are taken as they come, their
/// names checked; only when they do not match does a map find them (a lookup by name is a
/// linear search: hundreds of states make that quadratic).
fn take_outputs(
    names: &[String],
    outputs: ::ort::session::SessionOutputs<'_>,
) -> Result<Vec<(String, DynValue)>, EngineError> {
    let values: Vec<(&str, DynValue)> = outputs.into_iter().collect();
    let in_order = values.len() == names.len()
        && values
            .iter()
            .zip(names)
            .all(|((got, _), want)| *got == want.as_str());
    if in_order {
        return Ok(names
            .iter()
            .cloned()
            .zip(values.into_iter().map(|(_, v)| v))
            .collect());
    }
    let mut values: std::collections::HashMap<&str, DynValue> = values.into_iter().collect();
    names
        .iter()
        .map(|name| {
            values
                .remove(name.as_str())
                .map(|v| (name.clone(), v))
                .ok_or_else(|| EngineError::Output {
                    name: name.clone(),
                    message: "the run did not return it".into(),
                })
        })
        .collect()
}

/// A held value copied to the host (from the device first when it lives there).
pub fn held_to_host(name: &str, value: &DynValue) -> Result<Tensor, EngineError> {
    let err = |message: String| EngineError::Output {
        name: name.to_string(),
        message,
    };
    let tensor = value
        .view()
        .downcast::<::ort::value::DynTensorValueType>()
        .map_err(|e| err(e.to_string()))?;
    if tensor.memory_info().is_cpu_accessible() {
        return from_ort(name, &value.view());
    }
    let copied = tensor
        .to(AllocationDevice::CPU, 0)
        .map_err(|e| err(format!("copying to the host: {e}")))?;
    from_ort(name, &copied.into_dyn().view())
}

/// `rewrite()` when `on`: one of a session's in-memory passes onto onnx-ga's kernels, its
/// error said as what it was `doing`.
fn in_memory<R>(
    on: bool,
    doing: &str,
    rewrite: impl FnOnce() -> Result<Option<R>, crate::passes::PassError>,
) -> Result<Option<R>, EngineError> {
    match on {
        true => rewrite().map_err(|e| EngineError::Ort {
            context: doing.into(),
            message: e.to_string(),
        }),
        false => Ok(None),
    }
}

/// `model` without the graph inputs nothing in it reads (no node, in any subgraph, and no
/// graph output), and their names; `None` when every input is read. Why: a specialised
/// session keeps every state input of the step, and the accumulate branch reads neither
/// the moments nor (on the ResNet-8 with BatchNorm) the running statistics: 80 of its 159
/// inputs, each bound and looked up by name on every run.
fn without_unread_inputs(
    model: &ModelProto,
) -> (Option<ModelProto>, std::collections::HashSet<String>) {
    fn reads(graph: &crate::proto::GraphProto, into: &mut std::collections::HashSet<String>) {
        for node in &graph.node {
            into.extend(node.input.iter().filter(|i| !i.is_empty()).cloned());
            for a in &node.attribute {
                a.g.iter().chain(&a.graphs).for_each(|g| reads(g, into));
            }
        }
        into.extend(graph.output.iter().map(|o| o.name().to_string()));
    }
    let Some(graph) = model.graph.as_ref() else {
        return (None, Default::default());
    };
    let mut read = std::collections::HashSet::new();
    reads(graph, &mut read);
    let unread: std::collections::HashSet<String> = graph
        .input
        .iter()
        .map(|i| i.name().to_string())
        .filter(|name| !read.contains(name))
        .collect();
    if unread.is_empty() {
        return (None, unread);
    }
    let mut pruned = model.clone();
    let g = pruned.graph.as_mut().expect("checked above");
    g.input.retain(|i| !unread.contains(i.name()));
    g.initializer.retain(|t| !unread.contains(t.name()));
    (Some(pruned), unread)
}

/// The channel block of ONNX Runtime's NCHWc kernels on this CPU, when `options` let a
/// session use them ([`SessionOptions::nchwc_convs`]) and the blocks are 8 or 16 wide (AVX2,
/// AVX-512; 4-wide blocks gain nothing over the GEMM). Asked of ONNX Runtime itself, once:
/// `ReorderInput` pads 4 channels up to one block. The filter layout the rewrite writes
/// depends on it, so it is never guessed from CPU flags.
pub fn nchwc_block(options: &SessionOptions) -> Result<Option<i64>, EngineError> {
    static BLOCK: std::sync::OnceLock<Option<i64>> = std::sync::OnceLock::new();
    if !(options.nchwc_convs && options.optimize && options.device == Device::Cpu) {
        return Ok(None);
    }
    if let Some(block) = BLOCK.get() {
        return Ok(*block);
    }
    let text = "<ir_version: 8, opset_import: [\"\" : 17, \"com.microsoft.nchwc\" : 1]>\n\
                probe (float[1,4,1,1] x) => (float y) { y = com.microsoft.nchwc.ReorderInput (x) }";
    let model = crate::ir::text::parse_model(text).map_err(|e| EngineError::Ort {
        context: "the NCHWc probe".into(),
        message: e.to_string(),
    })?;
    let plain = SessionOptions {
        nchwc_convs: false,
        fused_kernels: false,
        ..SessionOptions::default()
    };
    // A build without ONNX Runtime's contrib kernels has no blocked layout: not an error.
    let x = Tensor::F32(ndarray::ArrayD::zeros(ndarray::IxDyn(&[1, 4, 1, 1])));
    let block = OrtSession::new(&model, &plain)
        .and_then(|mut s| s.run(&[("x", &x)]))
        .ok()
        .and_then(|outputs| outputs.into_iter().next())
        .and_then(|(_, y)| y.shape().get(1).map(|c| *c as i64))
        .filter(|block| *block >= 8);
    Ok(*BLOCK.get_or_init(|| block))
}

/// A host tensor copied into memory ONNX Runtime allocated (float32; other types as
/// [`to_owned_ort`]): a value a session may write into (`IoBinding` binds outputs only to
/// such values, never to lent or Rust-owned memory).
pub fn to_ort_allocated(name: &str, tensor: &Tensor) -> Result<DynValue, EngineError> {
    let Tensor::F32(a) = tensor else {
        return to_owned_ort(name, tensor);
    };
    let err = |e: ::ort::Error| EngineError::Input {
        name: name.to_string(),
        message: e.to_string(),
    };
    let allocator = ::ort::memory::Allocator::default();
    let shape: Vec<i64> = a.shape().iter().map(|&d| d as i64).collect();
    let mut value = OrtTensor::<f32>::new(&allocator, shape).map_err(err)?;
    let (_, data) = value.extract_tensor_mut();
    match a.as_slice() {
        Some(contiguous) => data.copy_from_slice(contiguous),
        None => data
            .iter_mut()
            .zip(a.iter())
            .for_each(|(to, from)| *to = *from),
    }
    Ok(value.into_dyn())
}

/// A host tensor as a value ONNX Runtime owns (a copy).
pub fn to_owned_ort(name: &str, tensor: &Tensor) -> Result<DynValue, EngineError> {
    let err = |e: ::ort::Error| EngineError::Input {
        name: name.to_string(),
        message: e.to_string(),
    };
    macro_rules! own {
        ($a:expr) => {
            OrtTensor::from_array($a.as_standard_layout().into_owned())
                .map_err(err)?
                .into_dyn()
        };
    }
    Ok(match tensor {
        Tensor::F32(a) => own!(a),
        Tensor::F64(a) => own!(a),
        Tensor::I64(a) => own!(a),
        Tensor::I32(a) => own!(a),
        Tensor::Bool(a) => own!(a),
    })
}

/// The tensor as a session input. Contiguous host arrays (all of ours in practice) are
/// lent to ONNX Runtime without a copy; anything else is copied into standard layout.
fn to_ort<'a>(name: &str, tensor: &'a Tensor) -> Result<SessionInputValue<'a>, EngineError> {
    let err = |e: ::ort::Error| EngineError::Input {
        name: name.to_string(),
        message: e.to_string(),
    };
    macro_rules! lend {
        ($a:expr) => {
            if $a.is_standard_layout() {
                SessionInputValue::from(TensorRef::from_array_view($a).map_err(err)?.into_dyn())
            } else {
                SessionInputValue::from(to_owned_ort(name, tensor)?)
            }
        };
    }
    Ok(match tensor {
        Tensor::F32(a) => lend!(a),
        Tensor::F64(a) => lend!(a),
        Tensor::I64(a) => lend!(a),
        Tensor::I32(a) => lend!(a),
        Tensor::Bool(a) => lend!(a),
    })
}

/// A held value's ONNX element type and shape, read from its type information (no copy of
/// its data, wherever it lives): what a state file's header needs before any values.
pub fn held_layout(name: &str, value: &DynValue) -> Result<(i32, Vec<usize>), EngineError> {
    use crate::proto::tensor_proto::DataType as D;
    let unsupported = |what: String| EngineError::Output {
        name: name.to_string(),
        message: what,
    };
    let ValueType::Tensor { ty, shape, .. } = value.dtype() else {
        return Err(unsupported(format!(
            "is a {:?}, not a tensor",
            value.dtype()
        )));
    };
    let elem = match ty {
        TensorElementType::Float32 => D::Float,
        TensorElementType::Float64 => D::Double,
        TensorElementType::Int64 => D::Int64,
        TensorElementType::Int32 => D::Int32,
        TensorElementType::Bool => D::Bool,
        other => {
            return Err(unsupported(format!(
                "element type {other:?} is not supported on the host"
            )))
        }
    };
    let dims = shape
        .iter()
        .map(|d| usize::try_from(*d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| unsupported(format!("has a dimension of unknown size: {shape:?}")))?;
    Ok((elem as i32, dims))
}

fn from_ort(name: &str, value: &::ort::value::DynValueRef<'_>) -> Result<Tensor, EngineError> {
    let err = |e: ::ort::Error| EngineError::Output {
        name: name.to_string(),
        message: e.to_string(),
    };
    let ty = match value.dtype() {
        ValueType::Tensor { ty, .. } => *ty,
        other => {
            return Err(EngineError::Output {
                name: name.to_string(),
                message: format!("is a {other:?}, not a tensor"),
            })
        }
    };
    Ok(match ty {
        TensorElementType::Float32 => {
            Tensor::F32(value.try_extract_array::<f32>().map_err(err)?.to_owned())
        }
        TensorElementType::Float64 => {
            Tensor::F64(value.try_extract_array::<f64>().map_err(err)?.to_owned())
        }
        TensorElementType::Int64 => {
            Tensor::I64(value.try_extract_array::<i64>().map_err(err)?.to_owned())
        }
        TensorElementType::Int32 => {
            Tensor::I32(value.try_extract_array::<i32>().map_err(err)?.to_owned())
        }
        TensorElementType::Bool => {
            Tensor::Bool(value.try_extract_array::<bool>().map_err(err)?.to_owned())
        }
        other => {
            return Err(EngineError::Output {
                name: name.to_string(),
                message: format!("element type {other:?} is not supported on the host"),
            })
        }
    })
}
