//! The `onnx-ga` command line: parse, call the library, print. Exit codes: 0 success,
//! 2 bad input (unreadable or inconsistent files, bad arguments), 1 anything else.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use onnx_ga::signature::{self, ExplicitRoles};

// `train --distributed`: its own loop (windows, not micro-steps), on the helpers below.
#[path = "cli/train_distributed.rs"]
mod train_distributed;
#[path = "cli/validation.rs"]
mod validation;

#[derive(Parser)]
#[command(
    name = "onnx-ga",
    version,
    about = "Rewrite ONNX training graphs into gradient-accumulation training steps"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what a training graph contains: data, loss, seed, parameters, optimizer, ops.
    Inspect(InspectArgs),
    /// Rewrite a training graph into one self-contained training step.
    Rewrite(Box<RewriteArgs>),
    /// Train a rewritten step graph: one run per micro-batch, state fed back.
    Train(TrainArgs),
    /// Write a model with its parameters set to a trained state (`train --save-state`).
    Export(ExportArgs),
    /// Draw a training run's loss from its metrics file (`train --metrics`): PNG or SVG.
    Plot(PlotArgs),
}

#[derive(Args)]
struct PlotArgs {
    /// A metrics file written by `train --metrics` (one JSON line per micro-step).
    metrics: PathBuf,
    /// The picture to write (atomically): .png or .svg.
    #[arg(short, long)]
    output: PathBuf,
    /// Width in pixels.
    #[arg(long, default_value_t = onnx_ga::plot::DEFAULT_SIZE.0)]
    width: u32,
    /// Height in pixels.
    #[arg(long, default_value_t = onnx_ga::plot::DEFAULT_SIZE.1)]
    height: u32,
}

#[derive(Args)]
struct RewriteArgs {
    /// An ONNX Runtime training artifacts folder or an .onnx gradient graph.
    path: PathBuf,
    /// Where to write the step model.
    #[arg(short, long)]
    output: PathBuf,
    /// Also write the step's two specialisations, OUT.accumulate.onnx and OUT.apply.onnx,
    /// for hosts of their own (see examples/train_step.py): no apply `If`, no copies of
    /// unchanged state. Needs `--apply if`.
    #[arg(long)]
    split: bool,
    /// Write the step's initializers to OUT.data beside it (ONNX external data) instead of
    /// inside OUT. Done anyway when the input model keeps its weights in external data, and
    /// when a file would pass protobuf's 2 GiB limit, which ONNX Runtime enforces.
    #[arg(long)]
    external_data: bool,
    /// Micro-steps per optimizer step (the window K).
    #[arg(long, default_value_t = 1)]
    accum_steps: i64,
    /// How the window's gradient is normalised: mean, sum, weighted or weighted=INPUT.
    #[arg(long, default_value = "mean")]
    normalize: String,
    /// The optimizer (default: the one in optimizer_model.onnx).
    #[arg(long, value_enum)]
    optimizer: Option<onnx_ga::passes::optimizer::Kind>,
    /// Learning rate (an initializer-backed input of the step; a host may change it).
    #[arg(long)]
    lr: Option<f32>,
    #[arg(long)]
    weight_decay: Option<f32>,
    #[arg(long)]
    beta1: Option<f32>,
    #[arg(long)]
    beta2: Option<f32>,
    #[arg(long)]
    eps: Option<f32>,
    /// Whose optimizer formula and defaults: torch (torch.optim, the default for a forward
    /// model), ort (ONNX Runtime's AdamWOptimizer, the default for ORT artifacts) or keras.
    #[arg(long, value_enum)]
    optimizer_formula: Option<onnx_ga::passes::optimizer::Formula>,
    /// Momentum factor of the momentum and nesterov optimizers.
    #[arg(long)]
    momentum: Option<f32>,
    /// Adam/AdamW: parameters of at most N elements are updated together as one flat
    /// tensor (fewer ops, same numbers); 0 updates every tensor on its own. Default 1024.
    #[arg(long, value_name = "N")]
    fuse_small: Option<i64>,
    /// Train the parameters matching GLOB (`*`, `?`; repeatable) without weight decay, as a
    /// torch parameter group with weight_decay=0 does (e.g. `--no-decay '*bias'
    /// --no-decay '*ln*'`).
    #[arg(long, value_name = "GLOB")]
    no_decay: Vec<String>,
    /// How the window's update is applied: an If (default) or Where selects.
    #[arg(long, value_enum, default_value = "if")]
    apply: onnx_ga::passes::window::ApplyMode,
    /// When BatchNorm running statistics move: once per window from pooled statistics, or
    /// at every micro-step (ONNX Runtime's training build).
    #[arg(long, value_enum, default_value = "window")]
    bn_stats: onnx_ga::passes::BnStats,
    /// A full pipeline spec instead of the one the options above build, e.g.
    /// `legalize-ort` alone or `grad-accum(steps=4),optimizer(kind=sgd,lr=0.1),legalize-ort,dce`.
    #[arg(long)]
    pipeline: Option<String>,
    /// Verify the graph after every pass (always on in debug builds).
    #[arg(long)]
    verify: bool,
    /// Adaptive gradient clipping of the window's gradient with this clip factor: each unit
    /// is scaled down to ||G_u|| <= CLIP * max(||W_u||, eps) (the paper's default is 0.01).
    #[arg(long, value_name = "CLIP")]
    agc: Option<f32>,
    /// AGC's floor on the weight norm (default 1e-3).
    #[arg(long, value_name = "E", requires = "agc")]
    agc_eps: Option<f32>,
    #[command(flatten)]
    agc_select: AgcSelectArgs,
    /// Clip the window's gradient by its global norm, as torch.nn.utils.clip_grad_norm_:
    /// every gradient scaled by min(1, MAX / (||(||G_1||, ..., ||G_n||)|| + 1e-6)).
    #[arg(long, value_name = "MAX")]
    clip_norm: Option<f32>,
    /// Compute precision: fp16 and bf16 compute forward and backward in half precision with
    /// fp32 master weights and accumulators (the precision pass, after legalize-ort).
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "fp16", "bf16"])]
    precision: String,
    /// Loss scaling: dynamic, static:S or none (default: dynamic with fp16, else none).
    #[arg(long, value_name = "dynamic|static:S|none")]
    loss_scale: Option<String>,
    /// Initial scale of dynamic loss scaling (default 65536).
    #[arg(long, value_name = "S")]
    loss_scale_init: Option<f32>,
    /// Finite windows (optimizer steps) between growths of the scale (default 2000).
    #[arg(long, value_name = "N")]
    loss_scale_interval: Option<i64>,
    /// Consecutive overflowing windows before the scale backs off (default 1).
    #[arg(long, value_name = "H")]
    loss_scale_hysteresis: Option<i64>,
    /// The engine the step is for: tract also lowers the ops tract lacks (lower-for-tract).
    #[arg(long, value_enum, default_value = "ort")]
    engine: onnx_ga::passes::plan::TargetEngine,
    #[command(flatten)]
    roles: RoleArgs,
    #[command(flatten)]
    forward: ForwardArgs,
}

#[derive(Args)]
struct TrainArgs {
    /// A step model written by `onnx-ga rewrite`.
    model: PathBuf,
    /// An .npz with one array per data input, named like it; the first axis is samples.
    #[arg(long)]
    data: PathBuf,
    /// Samples per micro-step.
    #[arg(long)]
    micro_batch: usize,
    /// Micro-steps to run.
    #[arg(long)]
    steps: u64,
    /// Validation data: an .npz like --data (the model's inputs and the labels). Its loss,
    /// the model in inference form with the current parameters, is reported (progress,
    /// --metrics, --plot) every --eval-every optimizer steps and at the end.
    #[arg(long, value_name = "V.npz")]
    eval_data: Option<PathBuf>,
    /// The model the validation loss runs: the forward model `rewrite` was given (BatchNorm
    /// on its running statistics, no dropout), or the eval_model.onnx of ONNX Runtime's
    /// artifacts; the step's current parameters are fed to it, and the step's loss is
    /// appended as the step appended it. Default: the one the step records (the file
    /// `rewrite` read, if unchanged since: its SHA-256 is recorded too).
    #[arg(long, value_name = "MODEL.onnx", requires = "eval_data")]
    eval_model: Option<PathBuf>,
    /// Whether `eval_model` is the step's record rather than a flag (for the note).
    #[arg(skip)]
    eval_model_recorded: bool,
    /// Evaluate after every N optimizer steps too (default: only at the end).
    #[arg(long, value_name = "N", requires = "eval_data")]
    eval_every: Option<u64>,
    /// Rows per evaluation batch (default: --micro-batch).
    #[arg(long, value_name = "B", requires = "eval_data")]
    eval_batch: Option<usize>,
    /// Write the state here (atomically, with its progress file, like --save-state) each
    /// time the validation loss reaches a new lowest: the best model so far, for `export`.
    /// A resume keeps the lowest its progress file records.
    #[arg(long, value_name = "B.npz|B.safetensors", requires = "eval_data")]
    save_best: Option<PathBuf>,
    /// Stop early when N validations in a row (--eval-every) have not lowered the
    /// validation loss; what the end of the run writes is written then.
    #[arg(long, value_name = "N", requires = "eval_every")]
    patience: Option<u64>,
    /// Take the data's rows in a new pseudo-random order each epoch, drawn from SEED: every
    /// row once an epoch, the same order on every run, rank and resume. Default: in order.
    #[arg(long, value_name = "SEED")]
    shuffle: Option<u64>,
    /// Seed every random draw of the step from SEED (Dropout masks, RandomNormal/Uniform,
    /// Bernoulli, Multinomial; each node and session its own stream), so that a run with
    /// dropout repeats exactly. A resumed run restarts the streams: reproducible, not the
    /// first run's continuation. Default: the engine seeds them (runs differ).
    #[arg(long, value_name = "SEED")]
    draw_seed: Option<u64>,
    /// The engine: ONNX Runtime, tract (pure Rust), or auto: ONNX Runtime when its library
    /// is found, else tract.
    #[arg(long, value_enum, default_value = "auto")]
    engine: onnx_ga::engine::EngineKind,
    /// Where ONNX Runtime runs: cpu, or cuda / cuda:N (needs an ONNX Runtime built with
    /// CUDA). State stays on the device between micro-steps.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Run the exported graph as is, its apply `If` included, instead of one specialised
    /// graph per branch (the default; same results, faster).
    #[arg(long)]
    no_split: bool,
    /// Run the step as it is written, in standard ops, instead of on onnx-ga's fused CPU
    /// kernels (ONNX Runtime on the CPU): the optimizer's update (AdamW, Adam, SGD,
    /// momentum, Nesterov), the weight gradients' unfolding of a convolution's input and
    /// the ReLU gradients, the exact GELU's forward, the sums over leading axes (a bias
    /// gradient over the batch), on two threads or more the transposed convolutions'
    /// folding, on one thread a large convolution weight gradient as one kernel, and the
    /// transposes that keep the last axis (same results, bit for bit),
    /// BatchNorm (see --no-fused-batch-norm), the exact GELU's gradient (the same
    /// operations but the exponential's: within its rounding), layer normalisation's
    /// gradient (within the rounding of its sums), and a linear layer's bias added inside
    /// its product (one Gemm for MatMul + Add on more than two axes: within float32
    /// rounding).
    #[arg(long)]
    no_fused_kernels: bool,
    /// Run training-mode BatchNorm as the step writes it, some 35 standard ops a layer,
    /// instead of one fused kernel forward and one backward (faster; within float32
    /// rounding, not bit for bit).
    #[arg(long)]
    no_fused_batch_norm: bool,
    /// Run every convolution on ONNX Runtime's im2col kernels, as the step writes it,
    /// instead of the 3x3 and larger ones whose channels fit its blocked (NCHWc) CPU kernels
    /// there (faster; within float32 rounding, not bit for bit).
    #[arg(long)]
    no_nchwc: bool,
    /// Let ONNX Runtime run every node of the step, instead of the host computing the
    /// scalar ones whose inputs it holds (counters, flags, the optimizer's bias
    /// corrections) before each run; the same results, bit for bit.
    #[arg(long)]
    no_host_scalars: bool,
    /// Let ONNX Runtime run the optimizer updates and accumulations of small models (under
    /// 1 Mi elements of state a session), instead of the host running the same kernels
    /// after each run, in place; the same results, bit for bit.
    #[arg(long)]
    no_host_updates: bool,
    /// Learning rate for this run (default: the one the step was rewritten with).
    #[arg(long)]
    lr: Option<f32>,
    /// Micro-steps per window for this run (default: the step's K).
    #[arg(long, value_name = "K")]
    accum_steps: Option<i64>,
    /// Optimizer steps of linear learning-rate warm-up: lr·(w+1)/W at step w < W.
    #[arg(long, value_name = "W", default_value_t = 0)]
    warmup: u64,
    /// How the learning rate falls after the warm-up, reaching --min-lr at --decay-steps.
    #[arg(long, value_enum, default_value = "none")]
    decay: onnx_ga::lr_schedule::Decay,
    /// The optimizer step (counted from the start of training) where the decay ends.
    #[arg(long, value_name = "T")]
    decay_steps: Option<u64>,
    /// The learning rate the decay ends at.
    #[arg(long, value_name = "M", default_value_t = 0.0)]
    min_lr: f64,
    /// Intra-op threads of ONNX Runtime (0: it decides); tract runs on one thread.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Start from a state file written by --save-state (.npz or .safetensors).
    #[arg(long)]
    init_state: Option<PathBuf>,
    /// Write every state tensor here at the end (atomically), keyed by state input name
    /// (parameters by their initializer names): .npz or .safetensors, by extension. Next to
    /// it, S.progress.json records the micro-step it was taken after (what --init-state S
    /// resumes from). May be the --init-state file (a resume).
    #[arg(long)]
    save_state: Option<PathBuf>,
    /// Also checkpoint the state to --save-state (atomically, with its progress file) every
    /// N optimizer steps: an interrupted run loses at most N windows.
    #[arg(long, value_name = "N", requires = "save_state")]
    save_every: Option<u64>,
    /// Write one JSON line per micro-step here as it happens (step, loss, applied, scale;
    /// skipped / discarded when a window or micro-step was dropped). Resuming (a start step
    /// above 0) into an existing file keeps its lines up to the start step.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// A micro-step whose loss is NaN or infinite (on a step without loss scaling, which
    /// skips such windows itself): stop with an error naming it and its data rows, saving
    /// nothing more (the default), or skip: discard its state update and go on.
    #[arg(long, default_value = "stop")]
    on_nonfinite: onnx_ga::train::OnNonFinite,
    /// Apply the optimizer on the last micro-step even if its window is not full.
    #[arg(long)]
    flush: bool,
    /// Micro-steps already taken before this run (sets where sampling resumes). Default:
    /// the micro-step recorded in the --init-state file's progress file, else 0.
    #[arg(long)]
    start_step: Option<u64>,
    /// Data-parallel training, one process per rank of an MPI job: `mpirun -n R onnx-ga
    /// train ... --distributed mpi`. K stays micro-batches per optimizer step, spread over
    /// the ranks (K % R == 0); --steps counts the job's micro-steps; global micro-batch i goes
    /// to rank i mod R; rank 0 alone writes --save-state and --metrics. Needs a build with
    /// the cargo feature `mpi`.
    #[arg(long, value_name = "mpi", value_parser = ["mpi"])]
    distributed: Option<String>,
    /// Also draw the metrics as a loss plot here (.png or .svg, atomically), at the end and
    /// at each --save-every checkpoint (see `onnx-ga plot`).
    #[arg(long, value_name = "LOSS.png|svg", requires = "metrics")]
    plot: Option<PathBuf>,
    /// Print nothing but errors: no progress (a bar on a terminal, a line every few seconds
    /// elsewhere), notes or summary.
    #[arg(long)]
    quiet: bool,
}

impl TrainArgs {
    /// The order micro-steps take the data's rows in (`--shuffle`).
    fn order(&self) -> onnx_ga::sample_order::SampleOrder {
        match self.shuffle {
            Some(seed) => onnx_ga::sample_order::SampleOrder::Shuffled { seed },
            None => onnx_ga::sample_order::SampleOrder::InOrder,
        }
    }
}

#[derive(Args)]
struct ExportArgs {
    /// The model to write with trained values: a forward .onnx (parameters as initializers)
    /// or ONNX Runtime's eval_model.onnx (parameters as graph inputs); or the step, which
    /// exports the model `rewrite` made it from (recorded in the step).
    model: PathBuf,
    /// The trained state: a file written by `train --save-state` (.npz or .safetensors).
    #[arg(long)]
    state: PathBuf,
    /// Where to write the trained model (atomically).
    #[arg(short, long)]
    output: PathBuf,
    /// The step the state was trained with: its manifest says which state entries are
    /// parameters, and each of them must then be in MODEL.
    #[arg(long)]
    step: Option<PathBuf>,
}

#[derive(Args)]
struct InspectArgs {
    /// An ONNX Runtime training artifacts folder or an .onnx gradient graph.
    path: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also print the graph in ONNX textual syntax.
    #[arg(long)]
    graph: bool,
    /// Also print each trainable parameter's AGC units and whether AGC clips it.
    #[arg(long)]
    agc: bool,
    #[command(flatten)]
    agc_select: AgcSelectArgs,
    #[command(flatten)]
    roles: RoleArgs,
    /// A forward model: the loss and trainable set to show (nothing is written).
    #[command(flatten)]
    forward: ForwardArgs,
}

/// Roles of a plain gradient graph (not needed for ONNX Runtime artifacts).
#[derive(Args)]
struct RoleArgs {
    /// The loss tensor of a plain gradient graph.
    #[arg(long)]
    loss: Option<String>,
    /// The scalar initializer that seeds the backward pass.
    #[arg(long)]
    seed: Option<String>,
    /// PARAM=TENSOR: the gradient tensor of a parameter (repeatable).
    #[arg(long = "grad", value_parser = parse_grad)]
    grads: Vec<(String, String)>,
}

impl RoleArgs {
    fn roles(&self) -> ExplicitRoles {
        ExplicitRoles {
            loss: self.loss.clone(),
            seed: self.seed.clone(),
            grads: self.grads.clone(),
        }
    }
}

/// A forward model to differentiate (the `autodiff` pass): the loss and the trainable set.
#[derive(Args)]
struct ForwardArgs {
    /// Train a forward model with this loss on a model output (autodiff builds the backward
    /// pass). Without it, `--loss NAME` alone (no `--grad`) differentiates the model's own
    /// scalar loss.
    #[arg(long, value_enum)]
    loss_fn: Option<onnx_ga::passes::autodiff::LossFn>,
    /// The model output the loss reads (default: the first output).
    #[arg(long, value_name = "NAME", requires = "loss_fn")]
    model_output: Option<String>,
    /// The name of the new labels input.
    #[arg(long, default_value = "labels")]
    labels: String,
    /// The axis of the output holding the classes (cross-entropy, nll); default the last.
    #[arg(long, allow_hyphen_values = true, requires = "loss_fn")]
    class_axis: Option<i64>,
    /// Labels with this value count for nothing (PyTorch pads with -100).
    #[arg(long, allow_hyphen_values = true, requires = "loss_fn")]
    ignore_index: Option<i64>,
    /// How the loss reduces over samples (and tokens).
    #[arg(long, default_value = "mean", value_parser = ["mean", "sum"])]
    reduction: String,
    /// Keep the matching initializers constant (repeatable; `*` and `?` wildcards).
    #[arg(long, value_name = "GLOB")]
    freeze: Vec<String>,
    /// Train only the matching initializers (repeatable).
    #[arg(long, value_name = "GLOB")]
    trainable: Vec<String>,
    /// Dropout in training mode (its mask reused by the backward) or removed.
    #[arg(long, value_enum, default_value = "train")]
    dropout: onnx_ga::passes::autodiff::DropoutMode,
    /// ONNX Loops and recurrent layers (LSTM, GRU, RNN): unrolled into their iterations where
    /// the trip count or sequence length is known before the run (Keras's recurrent layers
    /// at a fixed sequence length), or kept as Loops, their gradient a Loop running the
    /// iterations backwards (always so for a length known only at run time; recurrent
    /// layers from opset 16).
    #[arg(long, value_enum, default_value = "unroll")]
    loops: onnx_ga::passes::autodiff::LoopMode,
    /// The variance BatchNorm running variances move with: unbiased (n - 1, PyTorch's
    /// BatchNorm) or biased (n: ONNX, ONNX Runtime's training build, Keras). Default: the
    /// convention of the model's producer (unbiased for `pytorch`).
    #[arg(long, value_enum)]
    bn_var: Option<onnx_ga::passes::RunningVar>,
}

impl ForwardArgs {
    /// The autodiff pass spec, when the input is a forward model to differentiate.
    fn autodiff_spec(
        &self,
        path: &std::path::Path,
        roles: &RoleArgs,
    ) -> anyhow::Result<Option<String>> {
        let mut options = Vec::new();
        match (&self.loss_fn, &roles.loss) {
            (Some(f), _) => {
                options.push(format!("loss_fn={}", f.as_str()));
                if let Some(o) = &self.model_output {
                    options.push(format!("output={o}"));
                }
                if self.labels != "labels" {
                    options.push(format!("labels={}", self.labels));
                }
                if let Some(a) = self.class_axis {
                    options.push(format!("class_axis={a}"));
                }
                if let Some(i) = self.ignore_index {
                    options.push(format!("ignore_index={i}"));
                }
                if self.reduction != "mean" {
                    options.push(format!("reduction={}", self.reduction));
                }
            }
            (None, Some(loss)) if roles.grads.is_empty() && path.is_file() => {
                let proto = onnx_ga::model::load_model(path)?;
                if !onnx_ga::signature::is_forward_model(&proto) {
                    return Ok(None);
                }
                options.push(format!("loss={loss}"));
            }
            _ => return Ok(None),
        }
        if !self.freeze.is_empty() {
            options.push(format!("freeze={}", self.freeze.join("|")));
        }
        if !self.trainable.is_empty() {
            options.push(format!("trainable={}", self.trainable.join("|")));
        }
        if self.dropout != onnx_ga::passes::autodiff::DropoutMode::Train {
            options.push(format!("dropout={}", self.dropout.as_str()));
        }
        if self.loops != onnx_ga::passes::autodiff::LoopMode::Unroll {
            options.push(format!("loops={}", self.loops.as_str()));
        }
        if let Some(v) = self.bn_var {
            options.push(format!("bn_var={}", v.as_str()));
        }
        Ok(Some(onnx_ga::passes::spec_text("autodiff", &options)))
    }
}

/// Which parameters AGC clips (`rewrite --agc`, `inspect --agc`).
#[derive(Args)]
struct AgcSelectArgs {
    /// Clip the final layer too (excluded by default, as in the paper).
    #[arg(long, requires = "agc")]
    agc_include_final: bool,
    /// Do not clip the parameters matching this glob (`*`, `?`); repeatable.
    #[arg(long, value_name = "GLOB", requires = "agc")]
    agc_exclude: Vec<String>,
    /// NAME=AXES: take the norm of parameter NAME over AXES (comma-separated, or `all`)
    /// instead of the units derived from its consumer; repeatable.
    #[arg(long, value_name = "NAME=AXES", requires = "agc")]
    agc_axes: Vec<String>,
}

impl AgcSelectArgs {
    /// `--agc-axes` as the `agc` pass writes it (`NAME:A/B;...`), checked.
    fn axes_text(&self) -> Result<String, UsageError> {
        let mut axes = Vec::new();
        for item in &self.agc_axes {
            let Some((name, list)) = item.rsplit_once('=') else {
                return Err(UsageError(format!(
                    "--agc-axes '{item}': expected NAME=AXES, e.g. conv.weight=1,2,3 or fc.weight=all"
                )));
            };
            if name.is_empty() || name.contains([',', ';', '(', ')']) {
                return Err(spec_chars("--agc-axes", item));
            }
            axes.push(format!("{name}:{}", list.replace(',', "/")));
        }
        Ok(axes.join(";"))
    }

    /// `--agc-exclude` globs a pipeline spec can carry.
    fn check_exclude(&self) -> Result<(), UsageError> {
        match self
            .agc_exclude
            .iter()
            .find(|g| g.contains([',', ';', '(', ')']))
        {
            Some(glob) => Err(spec_chars("--agc-exclude", glob)),
            None => Ok(()),
        }
    }

    /// The selection itself (`inspect --agc`, and the plan of `rewrite --agc`).
    fn selection(&self) -> Result<onnx_ga::passes::agc::Selection, UsageError> {
        Ok(onnx_ga::passes::agc::Selection {
            include_final: self.agc_include_final,
            // As the pass reads `exclude=`: trimmed, empty ones dropped.
            exclude: self
                .agc_exclude
                .iter()
                .map(|g| g.trim().to_string())
                .filter(|g| !g.is_empty())
                .collect(),
            axes: onnx_ga::passes::agc::parse_axes_overrides(&self.axes_text()?)
                .map_err(|e| UsageError(format!("--agc-axes: {e}")))?,
        })
    }
}

/// An option value that a pipeline spec cannot carry.
fn spec_chars(flag: &str, text: &str) -> UsageError {
    UsageError(format!(
        "{flag} '{text}': ',', ';', '|', '(' and ')' cannot be used in a pipeline spec"
    ))
}

fn parse_grad(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((p, g)) if !p.is_empty() && !g.is_empty() => Ok((p.to_string(), g.to_string())),
        _ => Err(format!("expected PARAM=TENSOR, got '{s}'")),
    }
}

/// An error with the exit code it deserves.
struct Failure {
    code: u8,
    error: anyhow::Error,
}

/// A failure whose message is on stderr already ([`Failure::report`]).
#[derive(Debug, thiserror::Error)]
#[error("(reported above)")]
struct Reported;

impl Failure {
    /// Prints `error: ...` to stderr (each cause once: several library errors include
    /// their source's text already) and keeps the exit code; a failure reported before
    /// prints nothing again.
    fn report(self) -> Failure {
        let error = &self.error;
        if error.downcast_ref::<Reported>().is_none() {
            let mut message = error.to_string();
            for cause in error.chain().skip(1) {
                let text = cause.to_string();
                if !message.contains(&text) {
                    message = format!("{message}: {text}");
                }
            }
            // One write of the whole line: the ranks of a data-parallel job share one
            // stderr, and a line written in pieces interleaves with theirs.
            use std::io::Write;
            let line = format!("error: {message}\n");
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        }
        Failure {
            code: self.code,
            error: anyhow::Error::new(Reported),
        }
    }
}

/// Problems of the input (files, graphs, data, arguments) exit with 2; failures of the
/// machinery (the runtime library, a run that ONNX Runtime rejects) with 1.
fn is_input_error(error: &anyhow::Error) -> bool {
    use onnx_ga::train::TrainError;
    error.downcast_ref::<signature::SignatureError>().is_some()
        || error.downcast_ref::<onnx_ga::model::ModelError>().is_some()
        || error
            .downcast_ref::<onnx_ga::checkpoint::CheckpointError>()
            .is_some()
        || error
            .downcast_ref::<onnx_ga::ir::verify::VerifyErrors>()
            .is_some()
        || error.downcast_ref::<onnx_ga::step::StepError>().is_some()
        || error.downcast_ref::<onnx_ga::passes::PassError>().is_some()
        || error.downcast_ref::<onnx_ga::data::DataError>().is_some()
        || error.downcast_ref::<UsageError>().is_some()
        || error.downcast_ref::<onnx_ga::split::SplitError>().is_some()
        || error
            .downcast_ref::<onnx_ga::distributed::apply_only::ApplyOnlyError>()
            .is_some()
        || error.downcast_ref::<onnx_ga::plot::PlotError>().is_some()
        || matches!(
            error.downcast_ref::<onnx_ga::evaluate::EvalError>(),
            Some(onnx_ga::evaluate::EvalError::Model { .. } | onnx_ga::evaluate::EvalError::Data { .. })
        )
        || matches!(
            error.downcast_ref::<onnx_ga::evaluate::EvalError>(),
            Some(onnx_ga::evaluate::EvalError::Engine { source: e, .. }) if engine_is_input(e) || matches!(e, onnx_ga::engine::EngineError::Runtime(r) if runtime_is_input(r))
        )
        || error
            .downcast_ref::<onnx_ga::trained::ExportError>()
            .is_some()
        || error
            .downcast_ref::<onnx_ga::runtime::RuntimeError>()
            .is_some_and(runtime_is_input)
        || matches!(
            error.downcast_ref::<onnx_ga::engine::EngineError>(),
            Some(onnx_ga::engine::EngineError::Runtime(e)) if runtime_is_input(e)
        )
        || matches!(
            error.downcast_ref::<TrainError>(),
            Some(TrainError::Engine(onnx_ga::engine::EngineError::Runtime(e))) if runtime_is_input(e)
        )
        // An engine refusing the step (at load: an op, a type, a shape) or failing on its
        // data (an index out of range) reports a problem of the step or the data.
        || matches!(
            error.downcast_ref::<onnx_ga::engine::EngineError>(),
            Some(e) if engine_is_input(e)
        )
        || matches!(
            error.downcast_ref::<TrainError>(),
            Some(TrainError::Engine(e)) if engine_is_input(e)
        )
        || matches!(error.downcast_ref::<TrainError>(), Some(TrainError::Model(_)))
        || matches!(
            error.downcast_ref::<TrainError>(),
            Some(
                TrainError::BadData { .. }
                    | TrainError::BadState { .. }
                    | TrainError::Step(_)
                    | TrainError::Data(_)
                    | TrainError::NonFinite { .. }
            )
        )
}

/// `--device` and `--engine` as given, checked together: tract runs on the CPU only, and a
/// GPU means ONNX Runtime (falling back to tract would silently train on the CPU).
pub(crate) fn device_and_engine(
    device: &str,
    requested: onnx_ga::engine::EngineKind,
) -> Result<(onnx_ga::engine::ort::Device, onnx_ga::engine::EngineKind), UsageError> {
    use onnx_ga::engine::{ort::Device, EngineKind};
    let device: Device = device.parse().map_err(UsageError)?;
    let requested = match (requested, device) {
        (_, Device::Cpu) => requested,
        (EngineKind::Tract, _) => {
            return Err(UsageError(format!(
                "--device {device}: tract runs on the CPU only (use --engine ort)"
            )))
        }
        _ => EngineKind::Ort,
    };
    Ok((device, requested))
}

/// `train --warmup/--decay`: the learning-rate schedule over the step's learning rate (or
/// `--lr`), and K, which turns micro-steps into optimizer steps; `None` without one.
pub(crate) fn lr_schedule(
    args: &TrainArgs,
    model: &onnx_ga::proto::ModelProto,
    manifest: &onnx_ga::state::Manifest,
) -> Result<Option<(onnx_ga::lr_schedule::LrSchedule, u64)>, UsageError> {
    use onnx_ga::data::Tensor;
    use onnx_ga::lr_schedule::{Decay, LrSchedule};
    if args.warmup == 0 && args.decay == Decay::None && args.decay_steps.is_none() {
        return Ok(None);
    }
    let scalar = |name: &str| -> Option<f64> {
        let graph = model.graph.as_ref()?;
        let t = graph.initializer.iter().find(|t| t.name() == name)?;
        match Tensor::from_tensor_proto(t).ok()? {
            Tensor::F32(a) if a.len() == 1 => a.iter().next().map(|v| *v as f64),
            Tensor::I64(a) if a.len() == 1 => a.iter().next().map(|v| *v as f64),
            _ => None,
        }
    };
    let step = args.model.display();
    let base = match (args.lr, &manifest.learning_rate) {
        (_, None) => {
            return Err(UsageError(format!(
                "{step}: a learning-rate schedule needs the step's learning-rate input, and it records none (onnx_ga.learning_rate)"
            )))
        }
        (Some(lr), _) => lr as f64,
        (None, Some(name)) => scalar(name).ok_or_else(|| {
            UsageError(format!(
                "{step}: the learning-rate input '{name}' has no scalar default; pass --lr"
            ))
        })?,
    };
    let k_input = manifest
        .apply
        .as_ref()
        .map_or("ga.accum_steps", |a| a.steps.as_str());
    let k = match args.accum_steps {
        Some(k) => k as f64,
        None => scalar(k_input).ok_or_else(|| {
            UsageError(format!(
                "{step}: a learning-rate schedule counts optimizer steps, and K ('{k_input}') has no scalar default; pass --accum-steps"
            ))
        })?,
    };
    let schedule = LrSchedule::new(base, args.warmup, args.decay, args.decay_steps, args.min_lr)
        .map_err(UsageError)?;
    Ok(Some((schedule, k.max(1.0) as u64)))
}

/// `train --lr` and `--accum-steps`: the step's control inputs, set by the host.
pub(crate) fn host_controls(
    trainer: &mut onnx_ga::train::Trainer,
    lr: Option<f32>,
    accum_steps: Option<i64>,
) -> Result<(), UsageError> {
    if let Some(lr) = lr {
        trainer
            .set_learning_rate(lr)
            .map_err(|e| UsageError(format!("--lr {lr}: {e}")))?;
    }
    if let Some(k) = accum_steps {
        trainer
            .set_accum_steps(k)
            .map_err(|e| UsageError(format!("--accum-steps {k}: {e}")))?;
    }
    Ok(())
}

/// An error making a Trainer is the step's (nothing else is read yet): it names the step
/// file, except ONNX Runtime missing, which is the setup's.
pub(crate) fn step_context(e: onnx_ga::train::TrainError, step: &std::path::Path) -> anyhow::Error {
    let setup = matches!(
        &e,
        onnx_ga::train::TrainError::Engine(onnx_ga::engine::EngineError::Runtime(_))
            | onnx_ga::train::TrainError::Collective(_)
    );
    match e {
        onnx_ga::train::TrainError::Model(m) => {
            anyhow::Error::new(UsageError(format!("{}: {m}", step.display())))
        }
        e if setup => anyhow::Error::new(e),
        e => anyhow::Error::new(e).context(format!("{}", step.display())),
    }
}

/// ONNX Runtime missing, or not loadable from where `ORT_DYLIB_PATH` (or the search) says:
/// the setup's problem, which the user fixes (exit 2), not a failure of ours.
fn runtime_is_input(e: &onnx_ga::runtime::RuntimeError) -> bool {
    use onnx_ga::runtime::RuntimeError;
    matches!(
        e,
        RuntimeError::EnvPath { .. } | RuntimeError::NotFound { .. } | RuntimeError::Load { .. }
    )
}

/// The engine errors that are about the step or the data an engine was given.
fn engine_is_input(e: &onnx_ga::engine::EngineError) -> bool {
    use onnx_ga::engine::EngineError;
    matches!(
        e,
        EngineError::Ort { .. }
            | EngineError::Tract { .. }
            | EngineError::Input { .. }
            | EngineError::Output { .. }
            | EngineError::Unavailable(_)
    )
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        let error = e.into();
        // Everything the library reports about files and graphs is a problem of the input.
        let input_error = is_input_error(&error);
        Failure {
            code: if input_error { 2 } else { 1 },
            error,
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => ExitCode::from(failure.report().code),
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Inspect(args) => inspect(args),
        Command::Rewrite(args) => rewrite(*args),
        Command::Train(args) => train(args),
        Command::Export(args) => export(args),
        Command::Plot(args) => plot(args),
    }
}

fn plot(args: PlotArgs) -> Result<(), Failure> {
    refuse_overwrite("-o", &args.output, &[("the metrics file", &args.metrics)])?;
    let size = (args.width, args.height);
    let drawn = onnx_ga::plot::plot_file(&args.metrics, &args.output, size)?;
    eprintln!(
        "wrote {} ({} micro-steps, {} windows, {} skipped, {} non-finite losses; moving average of {}{})",
        args.output.display(),
        drawn.micro_steps,
        drawn.windows,
        drawn.skipped,
        drawn.non_finite,
        drawn.average_of,
        match drawn.evaluations {
            0 => String::new(),
            n => format!("; {n} validation losses"),
        }
    );
    Ok(())
}

fn inspect(args: InspectArgs) -> Result<(), Failure> {
    // A forward model with a loss: the gradient graph autodiff would build, so the report
    // lists the trainable set (shapes, counts, gradients) before anything is written.
    let (graph, untrained) = match args.forward.autodiff_spec(&args.path, &args.roles)? {
        Some(autodiff) => {
            let (graph, untrained) =
                onnx_ga::passes::autodiff::differentiated_graph(&args.path, &autodiff)?;
            (graph, Some(untrained))
        }
        None => {
            let roles = args.roles.roles();
            match args.path.is_file() {
                true => {
                    let proto = onnx_ga::model::load_model_with_data(&args.path)?;
                    let no_roles = roles.loss.is_none() && roles.grads.is_empty();
                    if no_roles && signature::is_forward_model(&proto) && !has_gradients(&proto) {
                        return inspect_forward(&args, proto);
                    }
                    (signature::from_model(proto, &roles, &args.path)?, None)
                }
                false => (signature::open(&args.path, &roles)?, None),
            }
        }
    };
    let report = onnx_ga::inspect::report(&graph);
    // A rewritten step: its recipe, state by role, controls and engines.
    let step_view = match &graph.signature.source {
        signature::Source::Step { .. } => {
            let manifest = onnx_ga::state::Manifest::from_model(&graph.model.header)?;
            Some(
                onnx_ga::inspect::StepView::of(&graph.model, &manifest, &report.training_only_ops)
                    .map_err(|e| UsageError(format!("{}: {e}", args.path.display())))?,
            )
        }
        _ => None,
    };
    let agc = match args.agc {
        true => Some(
            onnx_ga::inspect::agc_plan(&graph, &args.agc_select.selection()?)
                .map_err(|e| UsageError(format!("--agc: {e}")))?,
        ),
        false => None,
    };
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        if let Some(plan) = &agc {
            value["agc"] = serde_json::to_value(plan)?;
        }
        if let Some(untrained) = &untrained {
            value["untrained"] = serde_json::to_value(untrained)?;
        }
        if let Some(view) = &step_view {
            value["step"] = serde_json::to_value(view)?;
        }
        if args.graph {
            value["graph"] =
                serde_json::Value::String(onnx_ga::ir::print::print_model(&graph.model));
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", onnx_ga::inspect::render_text(&report));
        if let Some(untrained) = &untrained {
            print!("{}", onnx_ga::inspect::render_untrained_text(untrained));
        }
        if let Some(view) = &step_view {
            print!("{}", view.render_text());
        }
        if let Some(plan) = &agc {
            print!("{}", onnx_ga::inspect::render_agc_text(plan));
        }
        if args.graph {
            println!();
            print!("{}", onnx_ga::ir::print::print_model(&graph.model));
        }
    }
    Ok(())
}

/// `inspect` of a forward model given no loss: what it takes and gives and how to go on.
fn inspect_forward(args: &InspectArgs, proto: onnx_ga::proto::ModelProto) -> Result<(), Failure> {
    if args.agc {
        return Err(UsageError(format!(
            "--agc: {} is a forward model: AGC's units come from the training graph; add --loss-fn (or --loss) to differentiate it first",
            args.path.display()
        ))
        .into());
    }
    let graph = signature::forward(proto, &args.path);
    let overview = onnx_ga::inspect::ForwardOverview::of(&graph, &args.path);
    let model = &graph.model;
    if args.json {
        let mut value = serde_json::json!({ "forward": overview });
        if args.graph {
            value["graph"] = serde_json::Value::String(onnx_ga::ir::print::print_model(model));
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", overview.render_text());
        if args.graph {
            println!();
            print!("{}", onnx_ga::ir::print::print_model(model));
        }
    }
    Ok(())
}

/// `--threads` beyond this many per core available is refused: ONNX Runtime creates every
/// thread up front (100,000 of them crashed it), and more threads than cores only contend.
const THREADS_PER_CORE: usize = 4;

/// `--threads N` for `engine`: refused above [`THREADS_PER_CORE`] times the cores this
/// process may use; a warning (returned) when the engine ignores it.
fn check_threads(
    threads: usize,
    engine: onnx_ga::engine::EngineKind,
) -> Result<Option<String>, UsageError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most = cores * THREADS_PER_CORE;
    if threads > most {
        return Err(UsageError(format!(
            "--threads {threads}: at most {most} ({THREADS_PER_CORE} per core, {cores} cores available; 0 lets ONNX Runtime decide)"
        )));
    }
    Ok(
        (engine == onnx_ga::engine::EngineKind::Tract && threads != 1)
            .then(|| format!("warning: --threads {threads} is ignored: tract runs on one thread")),
    )
}

/// A micro-batch takes distinct rows of the data: one larger than the data set would repeat
/// samples within itself (and a huge one would only exhaust memory).
fn check_micro_batch(batch: usize, samples: usize, data: &Path) -> Result<(), UsageError> {
    if batch > samples {
        return Err(UsageError(format!(
            "--micro-batch {batch} is larger than the data set: {} holds {samples} samples",
            data.display()
        )));
    }
    Ok(())
}

/// The step `train` runs, and the files it was read from (the model and its external data).
/// What is not a step yet (ONNX Runtime's artifacts folder, a forward model, a gradient
/// graph) is refused with the `rewrite` that makes one: the first thing a new user tries is
/// training the model they have.
pub(crate) fn load_step(
    path: &Path,
) -> Result<(onnx_ga::proto::ModelProto, Vec<PathBuf>), Failure> {
    let rewrite_first = |source: &Path, what: &str, flags: &str, choices: &str| {
        UsageError(format!(
            "{}: {what}, not a training step: make one first with `onnx-ga rewrite {} -o step.onnx --accum-steps 4{flags}`{choices}, then `onnx-ga train step.onnx ...` (`onnx-ga rewrite --help` lists the optimizers and their settings)",
            path.display(),
            onnx_ga::inspect::shell_word(&source.display().to_string())
        ))
    };
    let artifacts = |folder: &Path| folder.join(onnx_ga::signature::TRAINING_MODEL).is_file();
    if artifacts(path) {
        return Err(rewrite_first(
            path,
            "a folder of ONNX Runtime training artifacts",
            " --lr 0.001",
            " (the optimizer their optimizer_model.onnx configures)",
        )
        .into());
    }
    let (model, files) = onnx_ga::model::load_model_with_data_listing(path)?;
    let written_by_us = model
        .metadata_props
        .iter()
        .any(|p| p.key().starts_with("onnx_ga."));
    if written_by_us {
        return Ok((model, files));
    }
    let folder = path
        .parent()
        .filter(|f| artifacts(f) && path.ends_with(onnx_ga::signature::TRAINING_MODEL));
    let refusal = match folder {
        Some(folder) => rewrite_first(
            folder,
            "the training model of ONNX Runtime's artifacts",
            " --lr 0.001",
            " (the optimizer their optimizer_model.onnx configures)",
        ),
        None if has_gradients(&model) => rewrite_first(
            path,
            "a gradient graph",
            " --loss LOSS --seed SEED --grad PARAM=GRADIENT ... --optimizer adamw --lr 0.001",
            " (naming its loss, the seed of its backward pass and each parameter's gradient)",
        ),
        None => rewrite_first(
            path,
            "a model without onnx-ga's metadata (a forward model?)",
            " --loss-fn cross-entropy --optimizer adamw --lr 0.001",
            " (the loss on its first output; or nll, mse, l1, bce-logits; --loss NAME for a loss the model computes)",
        ),
    };
    Err(refusal.into())
}

/// Whether `model` looks like a gradient graph: an output named as a gradient (`*_grad`,
/// what ONNX Runtime's tooling and most exporters of backward graphs write).
fn has_gradients(model: &onnx_ga::proto::ModelProto) -> bool {
    model
        .graph
        .as_ref()
        .is_some_and(|g| g.output.iter().any(|o| o.name().ends_with("_grad")))
}

/// A command-line usage problem found after parsing.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UsageError(String);

/// The `loss-scale(...)` pass of `--precision` and `--loss-scale*`, if any.
fn loss_scale_plan(
    args: &RewriteArgs,
) -> Result<Option<onnx_ga::passes::plan::LossScalePlan>, UsageError> {
    if args.pipeline.is_some() && args.precision != "fp32" {
        return Err(UsageError(format!(
            "--precision builds its pass into the default pipeline; with --pipeline add precision(dtype={}) there instead",
            args.precision
        )));
    }
    let tuning = args.loss_scale_init.is_some()
        || args.loss_scale_interval.is_some()
        || args.loss_scale_hysteresis.is_some();
    if args.pipeline.is_some() && (args.loss_scale.is_some() || tuning) {
        return Err(UsageError(
            "--loss-scale builds its pass into the default pipeline; with --pipeline add loss-scale(...) there instead".into(),
        ));
    }
    let default = if args.precision == "fp16" {
        "dynamic"
    } else {
        "none"
    };
    loss_scale_plan_for(args.loss_scale.as_deref().unwrap_or(default), args)
}

/// The loss scaling `mode` (dynamic, static:S or none) with `args`' tuning.
fn loss_scale_plan_for(
    mode: &str,
    args: &RewriteArgs,
) -> Result<Option<onnx_ga::passes::plan::LossScalePlan>, UsageError> {
    use onnx_ga::passes::plan::LossScalePlan;
    let tuning = args.loss_scale_init.is_some()
        || args.loss_scale_interval.is_some()
        || args.loss_scale_hysteresis.is_some();
    if tuning && mode != "dynamic" {
        return Err(UsageError(format!(
            "--loss-scale-init, --loss-scale-interval and --loss-scale-hysteresis tune dynamic loss scaling, but --loss-scale is {mode}"
        )));
    }
    match mode {
        "none" => Ok(None),
        "dynamic" => Ok(Some(LossScalePlan::Dynamic {
            init: args.loss_scale_init,
            interval: args.loss_scale_interval,
            hysteresis: args.loss_scale_hysteresis,
        })),
        other => match other.strip_prefix("static:").map(str::parse::<f32>) {
            Some(Ok(s)) => Ok(Some(LossScalePlan::Static(s))),
            _ => Err(UsageError(format!(
                "--loss-scale {other}: expected dynamic, static:S (S a number) or none"
            ))),
        },
    }
}

fn rewrite(args: RewriteArgs) -> Result<(), Failure> {
    use onnx_ga::passes::fit_opset::{self, FitOpset};
    // Outputs: never a file the input reads, never each other, writable; before any work.
    let mut outputs = vec![("-o", args.output.clone())];
    if args.split {
        outputs.push(("--split", split_output(&args.output, "accumulate")));
        outputs.push(("--split", split_output(&args.output, "apply")));
    }
    let inputs = rewrite_inputs(&args.path);
    let inputs: Vec<(&str, &Path)> = inputs.iter().map(|(w, p)| (*w, p.as_path())).collect();
    // External data out when asked for or when the input has it; else only past 2 GiB,
    // which is known once the step is made (its data files are checked then).
    let input_external = inputs.iter().any(|(what, _)| *what == INPUT_EXTERNAL_DATA);
    let external = args.external_data || input_external;
    if external {
        let data: Vec<_> = outputs
            .iter()
            .map(|(f, p)| (*f, external_data_path(p)))
            .collect();
        outputs.extend(data);
    }
    for (flag, path) in &outputs {
        refuse_overwrite(flag, path, &inputs)?;
        check_writable(flag, path)?;
    }
    let loss_scale = loss_scale_plan(&args)?;
    if args.pipeline.is_some() && args.agc.is_some() {
        return Err(UsageError(
            "--agc builds its pass into the default pipeline; with --pipeline add agc(clip=...) there instead".into(),
        )
        .into());
    }
    if args.pipeline.is_some() && args.clip_norm.is_some() {
        return Err(UsageError(
            "--clip-norm builds its pass into the default pipeline; with --pipeline add clip-norm(max_norm=...) there instead".into(),
        )
        .into());
    }
    if let Some(max) = args.clip_norm.filter(|m| !(m.is_finite() && *m > 0.0)) {
        return Err(UsageError(format!("--clip-norm {max}: must be a positive number")).into());
    }
    // A forward model: autodiff first (in place of a bare `autodiff` in --pipeline).
    let autodiff = args.forward.autodiff_spec(&args.path, &args.roles)?;
    let forward = match &autodiff {
        Some(_) => Some(onnx_ga::model::load_model_with_data(&args.path)?),
        None => None,
    };
    // A model stored in float16 trains its float16 arithmetic as `--precision fp16` does, so
    // it gets the same default: dynamic loss scaling (its small gradients underflow).
    let loss_scale = match (&loss_scale, &forward) {
        (None, Some(proto))
            if args.loss_scale.is_none()
                && args.pipeline.is_none()
                && onnx_ga::passes::autodiff::stored_in_float16(proto) =>
        {
            loss_scale_plan_for("dynamic", &args)?
        }
        _ => loss_scale,
    };
    let spec = match &args.pipeline {
        Some(spec) => spec.clone(),
        None => {
            if args.accum_steps < 1 {
                return Err(UsageError(format!(
                    "--accum-steps {}: must be at least 1",
                    args.accum_steps
                ))
                .into());
            }
            use onnx_ga::passes::plan::{AgcPlan, StepPlan};
            let agc = match args.agc {
                Some(clip) => {
                    args.agc_select.check_exclude()?;
                    Some(AgcPlan {
                        clip,
                        eps: args.agc_eps,
                        selection: args.agc_select.selection()?,
                    })
                }
                None => None,
            };
            // Checked here, as the pass would check its spec.
            let normalize = args
                .normalize
                .replacen('=', ":", 1)
                .parse()
                .map_err(|message| onnx_ga::passes::PassError::Spec {
                    spec: onnx_ga::passes::grad_accum::PASS.into(),
                    message,
                })?;
            let plan = StepPlan {
                accumulation: onnx_ga::passes::grad_accum::GradAccum {
                    steps: args.accum_steps,
                    normalize,
                    apply: args.apply,
                    bn_stats: args.bn_stats,
                },
                loss_scale,
                agc,
                clip_norm: args.clip_norm,
                optimizer: onnx_ga::passes::optimizer::Optimizer {
                    kind: args.optimizer,
                    lr: args.lr,
                    weight_decay: args.weight_decay,
                    beta1: args.beta1,
                    beta2: args.beta2,
                    eps: args.eps,
                    momentum: args.momentum,
                    fuse_small: args.fuse_small,
                    formula: args.optimizer_formula,
                    no_decay: match args
                        .no_decay
                        .iter()
                        .find(|g| g.contains([',', ';', '(', ')', '|']))
                    {
                        Some(glob) => return Err(spec_chars("--no-decay", glob).into()),
                        None => args.no_decay.clone(),
                    },
                    ..Default::default()
                },
                precision: match args.precision.as_str() {
                    "fp32" => None,
                    half => Some(half.parse().map_err(UsageError)?),
                },
                engine: args.engine,
            };
            plan.spec()
        }
    };
    let spec = match &autodiff {
        None => spec,
        Some(ad) => onnx_ga::passes::autodiff::with_autodiff(&spec, ad)?,
    };
    let spec = match args.engine {
        onnx_ga::passes::plan::TargetEngine::Tract
            if !spec.contains(onnx_ga::passes::lower_for_tract::PASS) =>
        {
            format!("{spec},{}", onnx_ga::passes::lower_for_tract::PASS)
        }
        _ => spec,
    };
    // A forward model newer than ONNX Runtime loads (onnx 1.23's helpers stamp IR version
    // 14 and opset 28): its step is moved down last, where no node's meaning changes.
    let spec = match &forward {
        Some(proto)
            if FitOpset::default().exceeded_by(proto) && !spec.contains(fit_opset::PASS) =>
        {
            format!("{spec},{}", fit_opset::PASS)
        }
        _ => spec,
    };
    let graph = match forward {
        Some(proto) => onnx_ga::signature::forward(proto, &args.path),
        None => onnx_ga::passes::legalize_training::open_for_pipeline(
            &args.path,
            &args.roles.roles(),
            &spec,
        )?,
    };
    // The error names the input (a pass's message names the node, op or tensor in it),
    // unless it already does or is about the pipeline spec rather than the model.
    let step = onnx_ga::step::build_step(graph, &spec, args.verify).map_err(|e| {
        use onnx_ga::passes::PassError;
        let path = args.path.display().to_string();
        let of_the_spec = matches!(&e, onnx_ga::step::StepError::Pass(PassError::Spec { .. }));
        if of_the_spec || e.to_string().contains(&path) {
            anyhow::Error::new(e)
        } else {
            anyhow::Error::new(e).context(path)
        }
    })?;
    // The resolved recipe first, so a default the user did not expect shows before it is
    // written into a file.
    eprint!("recipe:\n{}", step.recipe.render_text());
    let mut proto = step.model.to_proto();
    // What `train --eval-data` validates with when not told (`eval_model`): the forward
    // model differentiated here, or the artifacts' eval model.
    let eval_model = match (&autodiff, args.path.is_dir()) {
        (Some(_), _) => Some(args.path.clone()),
        (None, true) => Some(args.path.join("eval_model.onnx")).filter(|p| p.is_file()),
        (None, false) => None,
    };
    if let Some(Ok(record)) =
        eval_model.map(|p| onnx_ga::eval_model::RecordedEvalModel::of_file(&p))
    {
        record.write(&mut proto);
    }
    // Everything is computed before anything is written: no partial output on an error.
    let mut specialised = Vec::new();
    if args.split {
        let split = onnx_ga::split::split_step(&proto, &step.manifest)
            .map_err(anyhow::Error::new)?
            .ok_or_else(|| {
                UsageError(
                    "--split: the step has no apply If (it was written with --apply where)".into(),
                )
            })?;
        for (branch, s) in [("accumulate", &split.accumulate), ("apply", &split.apply)] {
            let path = split_output(&args.output, branch);
            let model = onnx_ga::split::standalone(s, &step.manifest, branch);
            specialised.push((path, model));
        }
    }
    let mut files = vec![(args.output.clone(), proto)];
    files.extend(specialised);
    // Every file complete under a temporary name first, then all renamed: a failure
    // leaves none of them.
    let write_error = |path: &Path, source: std::io::Error| onnx_ga::model::ModelError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut staged = Vec::new();
    let mut written = Vec::new();
    for (path, model) in files {
        let oversized = onnx_ga::model::over_file_limit(&model);
        if external || oversized {
            let data = external_data_path(&path);
            if !external {
                refuse_overwrite("-o", &data, &inputs)?;
                check_writable("-o", &data)?;
            }
            let name = data
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            staged.extend(onnx_ga::model::stage_model_with_external_data(
                model,
                &path,
                &name,
                onnx_ga::model::EXTERNAL_DATA_MIN_BYTES,
            )?);
            written.push((path, Some(data)));
        } else {
            let bytes = onnx_ga::model::encode_model(&model);
            drop(model);
            let file =
                onnx_ga::atomic::Staged::new(&path, |w| std::io::Write::write_all(w, &bytes))
                    .map_err(|e| write_error(&path, e))?;
            staged.push(file);
            written.push((path, None));
        }
    }
    onnx_ga::atomic::commit_all(staged).map_err(|(path, e)| write_error(&path, e))?;
    for (pass, report) in &step.reports {
        eprintln!("{pass}: {report}");
    }
    let data_note = |data: &Option<PathBuf>| match data {
        Some(d) => format!("; its initializers in {}", d.display()),
        None => String::new(),
    };
    eprintln!(
        "wrote {} ({} state pairs, data inputs: {}, loss: {}{})",
        written[0].0.display(),
        step.manifest.state.len(),
        step.manifest.data_inputs.join(", "),
        step.manifest.loss,
        data_note(&written[0].1)
    );
    // A step its engine cannot load is written (another engine may), but never silently.
    let lacking = onnx_ga::inspect::training_only_ops(&step.model);
    if let Ok(view) = onnx_ga::inspect::StepView::of(&step.model, &step.manifest, &lacking) {
        for warning in view.engine_warnings(args.engine.as_str()) {
            eprintln!("warning: {warning}");
        }
    }
    for (path, data) in written.iter().skip(1) {
        eprintln!("wrote {}{}", path.display(), data_note(data));
    }
    Ok(())
}

/// What the input lists of `rewrite_inputs` call an input model's external data file.
const INPUT_EXTERNAL_DATA: &str = "the input model's external data";

/// Where a model written with external data (`rewrite`, `export`) keeps it: `OUT.data`
/// beside `OUT`.
fn external_data_path(output: &Path) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_os_string();
    name.push(".data");
    output.with_file_name(name)
}

fn export(mut args: ExportArgs) -> Result<(), Failure> {
    use onnx_ga::model::same_file;
    let (model, external) = onnx_ga::trained::load_model_for_export(&args.model)?;
    // A step is not what a user wants out, but it names what is: the model it was made from.
    let (model, external) = match the_model_a_step_was_made_from(&args.model, &model)? {
        None => (model, external),
        Some(made_from) => {
            drop(model);
            eprintln!(
                "{} is a training step: exporting the model it was made from, {} (recorded by `rewrite`, unchanged since)",
                args.model.display(),
                made_from.display()
            );
            if args.step.is_none() {
                args.step = Some(args.model.clone());
            }
            args.model = made_from;
            onnx_ga::trained::load_model_for_export(&args.model)?
        }
    };
    let out = &args.output;
    let mut inputs = vec![("the model", &args.model), ("the state file", &args.state)];
    inputs.extend(args.step.iter().map(|p| ("the step", p)));
    let refuse = |path: &std::path::Path| -> Result<(), Failure> {
        match inputs.iter().find(|(_, input)| same_file(input, path)) {
            Some((what, _)) => {
                Err(UsageError(format!("{}: refusing to overwrite {what}", path.display())).into())
            }
            None => Ok(()),
        }
    };
    refuse(out)?;
    let manifest = match &args.step {
        Some(path) => Some(
            onnx_ga::state::Manifest::from_model(&onnx_ga::model::load_model(path)?)
                .map_err(|e| anyhow::Error::new(e).context(format!("{}", path.display())))?,
        ),
        None => None,
    };
    // Only the state entries that can be model tensors are read; the rest are named.
    let wanted = onnx_ga::trained::state_to_read(&model, manifest.as_ref());
    let state = onnx_ga::data::read_state_only(&args.state, &wanted)?;
    // A model that kept its weights in an external file is written the same way.
    let data_path = external_data_path(out);
    let data_name = data_path
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    if !external.is_empty() {
        refuse(&data_path)?;
        if external.iter().any(|e| same_file(e, &data_path)) {
            return Err(UsageError(format!(
                "{}: refusing to overwrite the model's external data",
                data_path.display()
            ))
            .into());
        }
    }
    let sources = onnx_ga::trained::ExportSources {
        model_file: &args.model,
        state_file: Some(&args.state),
        manifest: manifest.as_ref(),
        unread_state: &state.ignored,
    };
    let (trained, report) = onnx_ga::trained::export_trained_with(model, &state.arrays, &sources)?;
    if external.is_empty() {
        onnx_ga::model::save_model(&trained, out)?;
    } else {
        // The trained model is given away: its data moves into the file, not copied.
        onnx_ga::model::commit_staged(onnx_ga::model::stage_model_with_external_data(
            trained,
            out,
            &data_name,
            onnx_ga::model::EXTERNAL_DATA_MIN_BYTES,
        )?)?;
    }
    let names = |list: &[String]| {
        let mut text = list.iter().take(8).cloned().collect::<Vec<_>>().join(", ");
        if list.len() > 8 {
            text.push_str(&format!(", ... ({} more)", list.len() - 8));
        }
        text
    };
    eprintln!(
        "set {} tensors: {} initializers replaced, {} graph inputs made initializers",
        report.set(),
        report.replaced.len(),
        report.converted.len()
    );
    if !report.constants.is_empty() {
        eprintln!(
            "kept {} initializers the state has no value for (constants): {}",
            report.constants.len(),
            names(&report.constants)
        );
    }
    if !report.not_in_model.is_empty() {
        eprintln!(
            "left out {} state entries that are not model tensors (accumulators, moments, counters): {}",
            report.not_in_model.len(),
            names(&report.not_in_model)
        );
    }
    eprintln!("inputs: {}", names(&report.inputs));
    match external.is_empty() {
        true => eprintln!("wrote {}", out.display()),
        false => eprintln!("wrote {} (data in {})", out.display(), data_path.display()),
    }
    Ok(())
}

fn train(mut args: TrainArgs) -> Result<(), Failure> {
    use onnx_ga::train::{TrainError, Trainer};
    // Before ONNX Runtime starts: the trainer's sessions share one pool of this size.
    if args.threads > 1 {
        onnx_ga::runtime::set_shared_pool_threads(args.threads);
    }
    onnx_ga::lr_schedule::check_flags(args.warmup, args.decay, args.decay_steps, args.min_lr)
        .map_err(UsageError)?;
    if args.distributed.is_some() {
        return train_distributed::train(args);
    }
    if args.micro_batch == 0 {
        return Err(UsageError("--micro-batch must be at least 1".into()).into());
    }
    if args.save_every == Some(0) {
        return Err(UsageError("--save-every 0: must be at least 1".into()).into());
    }
    let on_nonfinite = args.on_nonfinite;
    let (model, model_files) = load_step(&args.model)?;
    take_recorded_eval_model(&mut args, &model)?;
    check_train_outputs(&args, &model_files)?;
    check_plot_output(&args, &model_files)?;
    let display = onnx_ga::progress::Display::for_stderr(args.quiet);
    let mut progress = onnx_ga::progress::Progress::new(display, args.steps, args.micro_batch);
    // Before training, not after it: the state file's format is its extension.
    if let Some(path) = &args.save_state {
        onnx_ga::data::StateFormat::of(path)?;
    }
    let (device, requested) = device_and_engine(&args.device, args.engine)?;
    let (engine, why) = requested.resolve();
    match requested {
        onnx_ga::engine::EngineKind::Auto => progress.note(format!("engine: {engine} ({why})")),
        _ => progress.note(format!("engine: {engine} on {device}")),
    }
    if let Some(warning) = check_threads(args.threads, engine)? {
        progress.note(warning);
    }
    let options = onnx_ga::train::TrainOptions {
        engine,
        session: onnx_ga::engine::ort::SessionOptions {
            threads: args.threads,
            optimize: true,
            device,
            fused_kernels: !args.no_fused_kernels,
            nchwc_convs: !args.no_nchwc,
            fused_batch_norm: !args.no_fused_batch_norm,
            host_scalars: !args.no_host_scalars,
            host_updates: !args.no_host_updates,
            ..Default::default()
        },
        split: !args.no_split,
        draw_seed: args.draw_seed,
    };
    let mut trainer =
        Trainer::with_options(&model, &options).map_err(|e| step_context(e, &args.model))?;
    // The step file is not read again: its initial values now live in the trainer's state,
    // and a copy kept for the whole run would be one more of the parameters' size.
    let limits = onnx_ga::index_check::index_limits(&model, &trainer.manifest.data_inputs);
    let schedule = lr_schedule(&args, &model, &trainer.manifest)?;
    if let Some(note) = draw_note(&model, args.draw_seed) {
        progress.note(note);
    }
    drop(model);
    trainer.set_on_nonfinite(on_nonfinite);
    progress.note(format!(
        "runs: {}",
        if trainer.is_split() {
            "one specialised graph per branch of the apply If (accumulate / apply)"
        } else {
            "the exported graph whole"
        }
    ));
    if trainer.fused_updates() > 0 {
        progress.note(format!(
            "optimizer: runs as {} fused update(s) on onnx-ga's CPU kernels (small parameters share one; --no-fused-kernels: as written)",
            trainer.fused_updates()
        ));
    }
    if trainer.in_place_updates() > 0 {
        progress.note(format!(
            "state: {} tensor(s) updated in place (accumulators, parameters, moments), not copied each micro-step",
            trainer.in_place_updates()
        ));
    }
    if trainer.accumulated_products() > 0 {
        progress.note(format!(
            "weight gradients: {} made inside their accumulators (one kernel, not written and added; --no-fused-kernels: as written)",
            trainer.accumulated_products()
        ));
    }
    if trainer.apply_products() > 0 {
        progress.note(format!(
            "weight gradients: {} of the applying micro-step made inside their optimizer updates (not written and read back)",
            trainer.apply_products()
        ));
    }
    if trainer.nchwc_convs() > 0 {
        progress.note(format!(
            "convolutions: {} on ONNX Runtime's blocked (NCHWc) CPU kernels, summed over the sessions (--no-nchwc: im2col, as written)",
            trainer.nchwc_convs()
        ));
    }
    if trainer.fused_batch_norms() > 0 {
        progress.note(format!(
            "batch norm: {} forward and backward layer(s) on onnx-ga's fused CPU kernels, summed over the sessions (--no-fused-batch-norm: as written)",
            trainer.fused_batch_norms()
        ));
    }
    if trainer.fused_layer_norm_grads() > 0 {
        progress.note(format!(
            "layer norm: {} gradient(s) on onnx-ga's fused CPU kernel, summed over the sessions (within the rounding of its sums; --no-fused-kernels: as written)",
            trainer.fused_layer_norm_grads()
        ));
    }
    if trainer.biases_in_gemm() > 0 {
        progress.note(format!(
            "linear layers: {} bias(es) added inside their products (Gemm), summed over the sessions (within float32 rounding; --no-fused-kernels: as written)",
            trainer.biases_in_gemm()
        ));
    }
    if trainer.fused_leading_sums() > 0 {
        progress.note(format!(
            "sums over the batch: {} on onnx-ga's fused CPU kernel, summed over the sessions (bit-identical; --no-fused-kernels: as written)",
            trainer.fused_leading_sums()
        ));
    }
    if trainer.fused_foldings() > 0 {
        progress.note(format!(
            "transposed convolutions (strided data gradients, upsampling): {} as one product and onnx-ga's parallel fold (Col2Im), summed over the sessions (bit-identical; --no-fused-kernels: as written)",
            trainer.fused_foldings()
        ));
    }
    if trainer.fused_conv_weight_grads() > 0 {
        progress.note(format!(
            "convolution weight gradients: {} on onnx-ga's fused CPU kernel (unfolding, product and sum over the images in one), summed over the sessions (bit-identical; --no-fused-kernels: as written)",
            trainer.fused_conv_weight_grads()
        ));
    }
    if trainer.fused_transposes() > 0 {
        progress.note(format!(
            "transposes keeping the last axis (attention heads): {} on onnx-ga's fused CPU kernel, summed over the sessions (bit-identical; --no-fused-kernels: as written)",
            trainer.fused_transposes()
        ));
    }
    host_controls(&mut trainer, args.lr, args.accum_steps)?;
    let data = onnx_ga::dataset::Dataset::open(&args.data, &trainer.manifest.data_inputs)?;
    if let Some(note) = onnx_ga::data::ignored_note(&args.data, &data.ignored) {
        progress.note(note);
    }
    let data = data.dataset;
    if let Some(note) = held_data_note(&data, &args.data) {
        progress.note(note);
    }
    let samples = trainer.check_data(&data, &args.data)?;
    check_micro_batch(args.micro_batch, samples, &args.data)?;
    onnx_ga::index_check::check_data(&data, &limits)
        .map_err(|m| UsageError(format!("{}: {m}", args.data.display())))?;
    if let Some(path) = &args.init_state {
        load_initial_state(&mut trainer, path)?;
    }
    let (start_step, notes) = start_step(&trainer, &args)?;
    for note in notes {
        progress.note(note);
    }
    let mut validation =
        validation::Validation::open(&args, &trainer, &options, start_step, |n| progress.note(n))?;
    // Every check passed: from here on the outputs are written as training goes.
    let mut metrics_out = match &args.metrics {
        Some(path) => Some(MetricsFile::open(path, start_step)?),
        None => None,
    };
    progress.start_clock();
    // The micro-step the state file was last written after.
    let mut saved_at: Option<u64> = None;
    // Where the run ends: after its --steps, or earlier by --patience.
    let mut end = start_step + args.steps;
    for i in 0..args.steps {
        let step_index = start_step + i;
        let batch = data.micro_batch(args.order(), samples, args.micro_batch, step_index)?;
        let flush = args.flush && i + 1 == args.steps;
        let lr = match &schedule {
            Some((schedule, k)) => {
                let lr = schedule.at(step_index / k);
                trainer.set_learning_rate(lr)?;
                Some(lr)
            }
            None => None,
        };
        let mut metrics = match trainer.step(&batch, flush) {
            Ok(m) => m,
            Err(TrainError::NonFinite { loss, .. }) => {
                progress.abandon();
                let what = NonFiniteStep {
                    step: step_index + 1,
                    loss,
                    rows: args.order().rows(samples, args.micro_batch, step_index),
                    data: &args.data,
                };
                let mut message = what.describe(&trainer, &batch);
                message.push_str(&match (&args.save_state, saved_at) {
                    (Some(path), Some(at)) => format!(
                        "; stopped without saving it: {} holds the state after micro-step {at} (resume with --init-state {})",
                        path.display(),
                        path.display()
                    ),
                    (Some(path), None) => format!(
                        "; stopped: {} was not written",
                        path.display()
                    ),
                    (None, _) => "; stopped".to_string(),
                });
                message.push_str(
                    ". --on-nonfinite skip discards such micro-steps and goes on; loss scaling (rewrite --loss-scale) skips their windows",
                );
                return Err(UsageError(message).into());
            }
            // Named by the step file and the micro-step: an engine may first see a problem
            // of the file here (tract: a control input that lost its initializer).
            Err(e) => {
                return Err(step_context(e, &args.model)
                    .context(format!("micro-step {}", step_index + 1))
                    .into())
            }
        };
        metrics.step = step_index + 1;
        metrics.lr = lr;
        progress.record(&metrics);
        if metrics.discarded && progress.stats().discarded.len() <= 10 {
            let rows = args.order().rows(samples, args.micro_batch, step_index);
            progress.note(format!(
                "micro-step {}: the loss is {}; its update was discarded (data rows {} of {})",
                metrics.step,
                metrics.loss,
                row_ranges(&rows),
                args.data.display()
            ));
        }
        if flush && metrics.discarded {
            // One process has no apply without a micro-batch of its own (data parallel's
            // apply-only session applies a short window, `train::distributed`).
            progress.note(format!(
                "micro-step {}, the run's last, was to apply the window in progress (--flush) and was discarded: that window was not applied; its sums stay in the state, and a run resumed from it continues the window",
                metrics.step
            ));
        }
        if let Some(out) = &mut metrics_out {
            out.line(&serde_json::to_string(&metrics)?)?;
        }
        let windows = progress.stats().optimizer_steps;
        let mut stop = false;
        if let Some(v) = validation
            .as_mut()
            .filter(|_| validation::due(&args, metrics.applied, windows))
        {
            v.run(&trainer, metrics.step, metrics_out.as_mut(), |n| {
                progress.note(n)
            })?;
            if v.exhausted() {
                progress.note(v.stop_note(metrics.step));
                stop = true;
            }
        }
        if let (Some(every), Some(path)) = (args.save_every, &args.save_state) {
            if metrics.applied && windows.is_multiple_of(every) {
                save_checkpoint(
                    &trainer,
                    path,
                    metrics.step,
                    args.shuffle,
                    metrics_out.as_mut(),
                )?;
                saved_at = Some(metrics.step);
                progress.note(format!(
                    "checkpoint: {} after micro-step {} ({windows} optimizer steps in this run)",
                    path.display(),
                    metrics.step
                ));
                train_plot(&args, &progress)?;
            }
        }
        if stop {
            end = metrics.step;
            break;
        }
    }
    if let Some(v) = &mut validation {
        v.run(&trainer, end, metrics_out.as_mut(), |n| progress.note(n))?;
        if let Some(n) = v.unwritten_best() {
            progress.note(n);
        }
    }
    if let Some(path) = &args.save_state {
        if saved_at != Some(end) {
            save_checkpoint(&trainer, path, end, args.shuffle, metrics_out.as_mut())?;
        }
    }
    if let Some(out) = &mut metrics_out {
        out.sync()?;
    }
    progress.finish();
    train_plot(&args, &progress)?;
    Ok(())
}

/// The note for a large array of the data that is held in memory whole: NumPy compressed it
/// (or wrote it in an order the rows cannot be read from directly), so it could not be left
/// in the file and read a micro-batch at a time ([`onnx_ga::dataset`]).
fn held_data_note(data: &onnx_ga::dataset::Dataset, file: &Path) -> Option<String> {
    const WORTH_A_NOTE: usize = 256 << 20;
    let (name, bytes) = data.held().max_by_key(|(_, bytes)| *bytes)?;
    (bytes >= WORTH_A_NOTE).then(|| {
        format!(
            "note: {}: array '{name}' ({} MiB) is held in memory: it is compressed (np.savez_compressed), Fortran-ordered, big-endian or bool; an np.savez array is read from the file a micro-batch at a time",
            file.display(),
            bytes >> 20
        )
    })
}

/// `train --plot`: the metrics file drawn (it is complete up to here).
fn train_plot(args: &TrainArgs, progress: &onnx_ga::progress::Progress) -> Result<(), Failure> {
    if let (Some(plot), Some(metrics)) = (&args.plot, &args.metrics) {
        onnx_ga::plot::plot_file(metrics, plot, onnx_ga::plot::DEFAULT_SIZE)?;
        progress.note(format!("plot: {}", plot.display()));
    }
    Ok(())
}

/// `train --plot`: a .png or .svg that is none of the inputs or other outputs, writable.
fn check_plot_output(args: &TrainArgs, model_files: &[PathBuf]) -> Result<(), Failure> {
    let Some(plot) = &args.plot else {
        return Ok(());
    };
    onnx_ga::plot::Format::of(plot)?;
    let mut taken: Vec<(&str, &Path)> = model_files
        .iter()
        .map(|p| ("the model or its external data", p.as_path()))
        .collect();
    taken.push(("the data", &args.data));
    if let Some(path) = &args.eval_data {
        taken.push(("the validation data", path));
    }
    let eval_files = eval_model_inputs(args);
    taken.extend(eval_files.iter().map(|(what, p)| (*what, p.as_path())));
    let outputs = [
        ("the initial state", &args.init_state),
        ("the --save-state file", &args.save_state),
        ("the --metrics file", &args.metrics),
        ("the --save-best file", &args.save_best),
    ];
    for (what, path) in &outputs {
        if let Some(p) = path {
            taken.push((what, p.as_path()));
        }
    }
    refuse_overwrite("--plot", plot, &taken)?;
    check_writable("--plot", plot)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Outputs: checked before any work, never an input, written as they happen.
// ---------------------------------------------------------------------------------------

/// `OUT.<branch>.onnx`, where `rewrite --split` writes a specialisation.
fn split_output(output: &Path, branch: &str) -> PathBuf {
    output.with_extension(format!("{branch}.onnx"))
}

/// A model file and the external-data files it names (`what`, `what_data`). Best effort: a
/// model that cannot be read here is reported by whatever reads it.
fn model_and_data(
    what: &'static str,
    what_data: &'static str,
    file: PathBuf,
) -> Vec<(&'static str, PathBuf)> {
    let mut files = Vec::new();
    if let Ok(m) = onnx_ga::model::load_model(&file) {
        let dir = onnx_ga::atomic::parent_dir(&file);
        for data in onnx_ga::model::external_data_files(&m, &dir) {
            files.push((what_data, data));
        }
    }
    files.push((what, file));
    files
}

/// `train --eval-model`'s file and its external data: inputs no output may overwrite.
fn eval_model_inputs(args: &TrainArgs) -> Vec<(&'static str, PathBuf)> {
    args.eval_model.as_ref().map_or_else(Vec::new, |path| {
        model_and_data(
            "the eval model",
            "the eval model's external data",
            path.clone(),
        )
    })
}

/// The files `rewrite PATH` reads (or, for an artifacts folder, may read), with what each
/// is. Best effort: a model that cannot be read here is reported by the rewrite itself.
fn rewrite_inputs(path: &Path) -> Vec<(&'static str, PathBuf)> {
    let mut files = Vec::new();
    let model = |what: &'static str, file: PathBuf, files: &mut Vec<(&str, PathBuf)>| {
        files.extend(model_and_data(what, INPUT_EXTERNAL_DATA, file));
    };
    if path.is_dir() {
        for (what, name) in [
            ("the input model", "training_model.onnx"),
            ("the input optimizer model", "optimizer_model.onnx"),
            ("the input eval model", "eval_model.onnx"),
        ] {
            model(what, path.join(name), &mut files);
        }
        files.push(("the input checkpoint", path.join("checkpoint")));
        files.push(("the input checkpoint's data", path.join("checkpoint.data")));
    } else {
        model("the input model", path.to_path_buf(), &mut files);
    }
    files
}

/// `path` with its folder canonicalised (the file itself need not exist), for telling
/// whether two outputs are one file.
fn canonical_target(path: &Path) -> Option<PathBuf> {
    let dir = std::fs::canonicalize(onnx_ga::atomic::parent_dir(path)).ok()?;
    Some(dir.join(path.file_name()?))
}

/// Whether two paths name one file: the same existing file (symlinks, `..`, hard links),
/// or the same name in the same folder.
fn same_target(a: &Path, b: &Path) -> bool {
    onnx_ga::model::same_file(a, b)
        || matches!((canonical_target(a), canonical_target(b)), (Some(x), Some(y)) if x == y)
}

/// Refuses an output that would overwrite one of `inputs`.
fn refuse_overwrite(flag: &str, output: &Path, inputs: &[(&str, &Path)]) -> Result<(), UsageError> {
    match inputs.iter().find(|(_, input)| same_target(input, output)) {
        Some((what, input)) => Err(UsageError(format!(
            "{}: refusing to overwrite {what} {} ({flag}); nothing was written",
            output.display(),
            input.display()
        ))),
        None => Ok(()),
    }
}

/// Checks that an output can be written (its folder exists, it is not a folder, the folder
/// is writable), before the work that produces it.
fn check_writable(flag: &str, path: &Path) -> Result<(), UsageError> {
    onnx_ga::atomic::check_writable(path).map_err(|e| {
        UsageError(format!(
            "{}: cannot write {flag} there: {e}; nothing was written",
            path.display()
        ))
    })
}

/// When `model` (read from `path`) is a step written by `rewrite`: the forward model or
/// ONNX Runtime eval model it was made from (its record checked: the file `rewrite` read,
/// unchanged), or an error saying what to export instead.
fn the_model_a_step_was_made_from(
    path: &Path,
    model: &onnx_ga::proto::ModelProto,
) -> Result<Option<PathBuf>, UsageError> {
    let is_step = model
        .metadata_props
        .iter()
        .any(|p| p.key() == onnx_ga::state::STATE_KEY);
    if !is_step {
        return Ok(None);
    }
    let name_it = |why: String| {
        UsageError(format!(
            "{}: a training step, not a model to export ({why}); name the forward model it was made from (or the artifacts' eval_model.onnx): `onnx-ga export MODEL.onnx --state S --step {} -o TRAINED.onnx`",
            path.display(),
            onnx_ga::inspect::shell_word(&path.display().to_string())
        ))
    };
    let record = match onnx_ga::eval_model::RecordedEvalModel::read(model) {
        None => return Err(name_it("it records no model it was made from".into())),
        Some(record) => record.map_err(name_it)?,
    };
    record.check().map_err(name_it)?;
    Ok(Some(record.path))
}

/// `--eval-data` without `--eval-model`: the eval model `step` records (the model
/// `rewrite` read, by path and SHA-256: [`onnx_ga::eval_model`]), if it is still the file
/// that was read; else an error saying to name one. Called where the step is loaded, before
/// the outputs are checked against it (on `--distributed`, by the rank that validates).
fn take_recorded_eval_model(
    args: &mut TrainArgs,
    step: &onnx_ga::proto::ModelProto,
) -> Result<(), UsageError> {
    if args.eval_data.is_none() || args.eval_model.is_some() {
        return Ok(());
    }
    let name = |message: String| {
        UsageError(format!(
            "--eval-data without --eval-model: {message}; name the model to validate with --eval-model MODEL.onnx"
        ))
    };
    let record = match onnx_ga::eval_model::RecordedEvalModel::read(step) {
        None => {
            return Err(name(format!(
                "{} records no eval model (it was not made from a forward model or artifacts with one, or by an onnx-ga before 2026-12-05)",
                args.model.display()
            )))
        }
        Some(record) => record.map_err(|e| name(format!("{}: {e}", args.model.display())))?,
    };
    record.check().map_err(name)?;
    args.eval_model = Some(record.path);
    args.eval_model_recorded = true;
    Ok(())
}

/// `train`'s outputs against its inputs and each other, and each writable.
fn check_train_outputs(args: &TrainArgs, model_files: &[PathBuf]) -> Result<(), UsageError> {
    let mut inputs: Vec<(&str, &Path)> = model_files
        .iter()
        .enumerate()
        .map(|(i, p)| match i {
            0 => ("the model", p.as_path()),
            _ => ("the model's external data", p.as_path()),
        })
        .collect();
    inputs.push(("the data", &args.data));
    if let Some(path) = &args.eval_data {
        inputs.push(("the validation data", path));
    }
    let eval_files = eval_model_inputs(args);
    inputs.extend(eval_files.iter().map(|(what, p)| (*what, p.as_path())));
    let init_progress = args.init_state.as_deref().map(progress_path);
    let save_progress = args.save_state.as_deref().map(progress_path);
    if let Some(path) = &args.metrics {
        let mut all = inputs.clone();
        if let Some(init) = &args.init_state {
            all.push(("the initial state", init));
        }
        if let Some(p) = &init_progress {
            all.push(("the initial state's progress file", p));
        }
        if let Some(state) = &args.save_state {
            all.push(("the --save-state file", state));
        }
        if let Some(p) = &save_progress {
            all.push(("the --save-state progress file", p));
        }
        refuse_overwrite("--metrics", path, &all)?;
        check_writable("--metrics", path)?;
    }
    // --init-state S --save-state S is a resume: the one output an input may be.
    if let (Some(path), Some(progress)) = (&args.save_state, &save_progress) {
        refuse_overwrite("--save-state", path, &inputs)?;
        refuse_overwrite("--save-state", progress, &inputs)?;
        check_writable("--save-state", path)?;
    }
    if let Some(path) = &args.save_best {
        onnx_ga::data::StateFormat::of(path)
            .map_err(|e| UsageError(format!("--save-best: {e}")))?;
        let progress = progress_path(path);
        let mut taken = inputs.clone();
        if let Some(init) = &args.init_state {
            taken.push(("the initial state", init));
        }
        if let Some(state) = &args.save_state {
            taken.push(("the --save-state file", state));
        }
        if let Some(p) = &save_progress {
            taken.push(("the --save-state progress file", p));
        }
        if let Some(m) = &args.metrics {
            taken.push(("the --metrics file", m));
        }
        refuse_overwrite("--save-best", path, &taken)?;
        refuse_overwrite("--save-best", &progress, &taken)?;
        check_writable("--save-best", path)?;
    }
    Ok(())
}

/// Where the micro-step a state file was saved after is recorded: `S.progress.json`.
fn progress_path(state: &Path) -> PathBuf {
    let mut name = state.file_name().unwrap_or_default().to_os_string();
    name.push(".progress.json");
    state.with_file_name(name)
}

/// What `S.progress.json` records about state file S: the micro-step it was saved after,
/// recognised by a digest of the state's contents. The last two saves are kept, and the
/// record is written before the state: whichever of the two the file holds after an
/// interruption, its entry is there.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Progress {
    /// The state file's name.
    state: String,
    checkpoints: Vec<Checkpoint>,
}

#[derive(Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Checkpoint {
    /// Micro-steps taken when the state was saved: the next run's `--start-step`.
    micro_steps: u64,
    /// A digest of every state tensor (name, element type, shape, bytes): see [`Digest`].
    state_digest: String,
    /// `train --shuffle`'s seed, when the run that saved the state shuffled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shuffle: Option<u64>,
    /// The validation loss of the state, when `--save-best` wrote it for that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    eval_loss: Option<f64>,
}

/// What a [`Checkpoint`] recognises its state by: FNV-1a over the state's bytes taken as
/// 64-bit little-endian words (zero-padded at the end), written `w:` and 16 hex digits.
/// Records written before 2026-12-05 hold FNV-1a over single bytes, without the prefix
/// ([`Digest::bytewise`]); a byte at a time it took 2 s over a 124M-parameter model's state.
struct Digest {
    hash: u64,
    bytewise: bool,
    pending: Vec<u8>,
}

impl Digest {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;

    fn new(bytewise: bool) -> Digest {
        Digest {
            hash: Self::OFFSET,
            bytewise,
            pending: Vec::with_capacity(8),
        }
    }

    fn word(&mut self, w: u64) {
        self.hash ^= w;
        self.hash = self.hash.wrapping_mul(Self::PRIME);
    }

    fn finish(mut self) -> String {
        if self.bytewise {
            return format!("{:016x}", self.hash);
        }
        if !self.pending.is_empty() {
            self.pending.resize(8, 0);
            let w = u64::from_le_bytes(self.pending[..8].try_into().expect("eight bytes"));
            self.word(w);
        }
        format!("w:{:016x}", self.hash)
    }

    /// The digest of `trainer`'s state, read one tensor at a time.
    fn of_state(trainer: &onnx_ga::train::Trainer, bytewise: bool) -> Result<String, Failure> {
        use std::io::Write;
        let mut d = Digest::new(bytewise);
        for name in trainer.state_names() {
            let t = trainer.host_value(name)?;
            d.write_all(name.as_bytes())?;
            d.write_all(&t.elem_type().to_le_bytes())?;
            for dim in t.shape() {
                d.write_all(&(*dim as u64).to_le_bytes())?;
            }
            onnx_ga::data::write_le(&mut d, &t)?;
        }
        Ok(d.finish())
    }
}

impl std::io::Write for Digest {
    fn write(&mut self, mut bytes: &[u8]) -> std::io::Result<usize> {
        let n = bytes.len();
        if self.bytewise {
            for b in bytes {
                self.word(u64::from(*b));
            }
            return Ok(n);
        }
        if !self.pending.is_empty() {
            let take = (8 - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() < 8 {
                return Ok(n);
            }
            let w = u64::from_le_bytes(self.pending[..8].try_into().expect("eight bytes"));
            self.pending.clear();
            self.word(w);
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.word(u64::from_le_bytes(w.try_into().expect("eight bytes")));
        }
        self.pending.extend_from_slice(words.remainder());
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn read_progress(path: &Path) -> Result<Option<Progress>, UsageError> {
    match onnx_ga::input::read_regular_to_string(path) {
        Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| {
            UsageError(format!(
                "{}: not a progress record: {e}; pass --start-step",
                path.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(UsageError(format!("{}: cannot read: {e}", path.display()))),
    }
}

/// What `train` says of the step's random draws (`--draw-seed`), when it has any.
fn draw_note(model: &onnx_ga::proto::ModelProto, seed: Option<u64>) -> Option<String> {
    if !onnx_ga::train::draw_seed::draws(model) {
        return None;
    }
    Some(match seed {
        Some(seed) => format!("random draws (dropout): seeded from --draw-seed {seed}"),
        None => "random draws (dropout): seeded by the engine, so runs differ; --draw-seed SEED makes them repeat".into(),
    })
}

/// Where training starts: `--start-step`, else the micro-step `--init-state`'s progress
/// record gives, else 0; with the notes to print about it.
fn start_step(
    trainer: &onnx_ga::train::Trainer,
    args: &TrainArgs,
) -> Result<(u64, Vec<String>), Failure> {
    let (Some(path), None) = (&args.init_state, args.start_step) else {
        return Ok((args.start_step.unwrap_or(0), Vec::new()));
    };
    let Some(saved) = recorded_progress(trainer, path)? else {
        return Ok((0, Vec::new()));
    };
    let mut notes = vec![format!(
        "resuming at micro-step {} (recorded in {})",
        saved.micro_steps,
        progress_path(path).display()
    )];
    if saved.shuffle != args.shuffle {
        let order = |seed: Option<u64>| match seed {
            Some(seed) => format!("shuffled with --shuffle {seed}"),
            None => "in order".to_string(),
        };
        notes.push(format!(
            "note: {} was saved by a run taking the data's rows {}; this run takes them {}, so its micro-batches differ from those the first run would have gone on with",
            path.display(),
            order(saved.shuffle),
            order(args.shuffle)
        ));
    }
    Ok((saved.micro_steps, notes))
}

/// The checkpoint `S.progress.json` records for the state the trainer holds (loaded from
/// `state`), if it has a record.
fn recorded_progress(
    trainer: &onnx_ga::train::Trainer,
    state: &Path,
) -> Result<Option<Checkpoint>, Failure> {
    let path = progress_path(state);
    let Some(progress) = read_progress(&path)? else {
        return Ok(None);
    };
    let digest = Digest::of_state(trainer, false)?;
    let mut found = progress
        .checkpoints
        .iter()
        .find(|c| c.state_digest == digest);
    // A record from before the word-wise digest: compared by the digest it holds.
    if found.is_none()
        && progress
            .checkpoints
            .iter()
            .any(|c| !c.state_digest.starts_with("w:"))
    {
        let bytewise = Digest::of_state(trainer, true)?;
        found = progress
            .checkpoints
            .iter()
            .find(|c| c.state_digest == bytewise);
    }
    match found {
        Some(c) => Ok(Some(c.clone())),
        None => Err(UsageError(format!(
            "{}: records no save of the state {} holds (micro-steps recorded: {}); pass --start-step",
            path.display(),
            state.display(),
            progress
                .checkpoints
                .iter()
                .map(|c| c.micro_steps.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .into()),
    }
}

/// `--init-state PATH` into `trainer`, refused when a parameter, moment or running
/// statistic in it is NaN or infinite: `train` never saves such a state, and training from
/// one stopped at its first micro-step blaming the data or the learning rate.
fn load_initial_state(trainer: &mut onnx_ga::train::Trainer, path: &Path) -> Result<(), Failure> {
    trainer.load_state(path)?;
    match trainer.nonfinite_state()? {
        Some(name) => Err(UsageError(format!(
            "--init-state {}: state '{name}' is not finite (NaN or inf): training from it computes NaN; start from a state saved before training diverged",
            path.display()
        ))
        .into()),
        None => Ok(()),
    }
}

/// Saves the state atomically after its progress record; the metrics so far are made
/// durable with it. Refuses a state that is not finite (the file keeps what it held).
fn save_checkpoint(
    trainer: &onnx_ga::train::Trainer,
    path: &Path,
    micro_steps: u64,
    shuffle: Option<u64>,
    metrics: Option<&mut MetricsFile>,
) -> Result<(), Failure> {
    write_checkpoint(trainer, path, micro_steps, shuffle, metrics, None)
}

/// [`save_checkpoint`], its record also holding the state's validation loss
/// (`--save-best`).
fn write_checkpoint(
    trainer: &onnx_ga::train::Trainer,
    path: &Path,
    micro_steps: u64,
    shuffle: Option<u64>,
    metrics: Option<&mut MetricsFile>,
    eval_loss: Option<f64>,
) -> Result<(), Failure> {
    if let Some(name) = trainer.nonfinite_state()? {
        return Err(UsageError(format!(
            "{}: not written: state '{name}' is not finite after micro-step {micro_steps} (the data or the learning rate made training diverge); the file keeps what it held",
            path.display()
        ))
        .into());
    }
    let progress_file = progress_path(path);
    let entry = Checkpoint {
        micro_steps,
        state_digest: Digest::of_state(trainer, false)?,
        shuffle,
        eval_loss,
    };
    // The previous save stays recorded until this one is complete.
    let previous = read_progress(&progress_file)
        .ok()
        .flatten()
        .and_then(|p| p.checkpoints.last().cloned())
        .filter(|c| *c != entry);
    let record = Progress {
        state: path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned(),
        checkpoints: previous.into_iter().chain([entry]).collect(),
    };
    let mut text = serde_json::to_string(&record)?;
    text.push('\n');
    onnx_ga::atomic::write(&progress_file, text.as_bytes()).map_err(|source| {
        onnx_ga::model::ModelError::Write {
            path: progress_file.clone(),
            source,
        }
    })?;
    trainer.save_state(path)?;
    if let Some(m) = metrics {
        m.sync()?;
    }
    Ok(())
}

/// The metrics file, one line per micro-step, appended and flushed as they happen.
struct MetricsFile {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
}

impl MetricsFile {
    /// Creates (or empties) `path`; when resuming (`start_step` > 0) an existing file keeps
    /// its lines up to `start_step` and the run's lines follow them.
    fn open(path: &Path, start_step: u64) -> Result<MetricsFile, Failure> {
        let err = |e: std::io::Error| UsageError(format!("{}: cannot write: {e}", path.display()));
        let kept: String = match (start_step, onnx_ga::input::read_regular_to_string(path)) {
            (1.., Ok(text)) => text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v["step"].as_u64())
                        .is_some_and(|s| s <= start_step)
                })
                .flat_map(|l| [l, "\n"])
                .collect(),
            _ => String::new(),
        };
        onnx_ga::atomic::write(path, kept.as_bytes()).map_err(err)?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(err)?;
        Ok(MetricsFile {
            path: path.to_path_buf(),
            file: std::io::BufWriter::new(file),
        })
    }

    fn line(&mut self, line: &str) -> Result<(), Failure> {
        use std::io::Write;
        let err =
            |e: std::io::Error| UsageError(format!("{}: cannot write: {e}", self.path.display()));
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.write_all(b"\n"))
            .and_then(|()| self.file.flush())
            .map_err(err)?;
        Ok(())
    }

    /// Makes what was written durable (at checkpoints and at the end).
    fn sync(&mut self) -> Result<(), Failure> {
        use std::io::Write;
        self.file
            .flush()
            .and_then(|()| self.file.get_ref().sync_data())
            .map_err(|e| UsageError(format!("{}: cannot write: {e}", self.path.display())))?;
        Ok(())
    }
}

/// A micro-step whose loss was not finite, for the error that stops the run.
struct NonFiniteStep<'a> {
    /// 1-based, as in the metrics.
    step: u64,
    loss: f32,
    rows: Vec<usize>,
    data: &'a Path,
}

impl NonFiniteStep<'_> {
    /// What happened and where the non-finite values of the micro-batch are, if any.
    fn describe(
        &self,
        trainer: &onnx_ga::train::Trainer,
        batch: &std::collections::BTreeMap<String, onnx_ga::data::Tensor>,
    ) -> String {
        let mut found = Vec::new();
        for name in &trainer.manifest.data_inputs {
            let bad_rows: Vec<usize> = match batch.get(name) {
                Some(t) => t.non_finite_rows().iter().map(|&j| self.rows[j]).collect(),
                None => Vec::new(),
            };
            if !bad_rows.is_empty() {
                let mut bad_rows = bad_rows;
                bad_rows.sort_unstable();
                bad_rows.dedup();
                found.push(format!("'{name}' at data rows {}", row_ranges(&bad_rows)));
            }
        }
        let cause = match found.is_empty() {
            true => "this micro-batch's data is finite: training diverged (try a smaller --lr)"
                .to_string(),
            false => format!("the data holds NaN or inf: {}", found.join(", ")),
        };
        format!(
            "micro-step {} (data rows {} of {}): the loss is {}; {cause}",
            self.step,
            row_ranges(&self.rows),
            self.data.display(),
            self.loss
        )
    }
}

/// Rows as ranges in their order: `8-15`, or `60-63, 0-3` where a micro-batch wraps; a
/// shuffled micro-batch's scattered rows, the first dozen and how many more.
fn row_ranges(rows: &[usize]) -> String {
    const SHOWN: usize = 12;
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let mut j = i;
        while j + 1 < rows.len() && rows[j + 1] == rows[j] + 1 {
            j += 1;
        }
        parts.push(match j > i {
            true => format!("{}-{}", rows[i], rows[j]),
            false => rows[i].to_string(),
        });
        i = j + 1;
        if parts.len() == SHOWN && i < rows.len() {
            parts.push(format!("and {} more", rows.len() - i));
            break;
        }
    }
    parts.join(", ")
}
