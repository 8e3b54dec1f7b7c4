//! The training loop over a rewritten step: one engine run per micro-batch, the state
//! outputs fed back as the next run's state inputs.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

pub mod distributed;
pub mod draw_seed;
mod host_counter;
mod window_start;
mod zero_after_apply;

use crate::data::Tensor;
use crate::engine::deferred_products::DeferredProducts;
use crate::engine::ort::SessionOptions;
use crate::engine::{Engine, EngineError, EngineKind, Held};
use crate::proto::{type_proto, ModelProto};
use crate::state::APPLIED_OUTPUT as APPLIED;

/// The output loss scaling adds: true where a window ended and its update was dropped.
pub const SKIPPED_OUTPUT: &str = "ga.skipped";
const SKIPPED: &str = SKIPPED_OUTPUT;
use crate::state::Manifest;
use crate::step::StepError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error("{}: {message}", file.display())]
    BadData {
        file: std::path::PathBuf,
        message: String,
    },
    #[error("{}: {message}", file.display())]
    BadState {
        file: std::path::PathBuf,
        message: String,
    },
    #[error("{0}")]
    Model(String),
    /// A micro-step's loss was NaN or infinite under [`OnNonFinite::Stop`]; the trainer's
    /// state is the one before that micro-step.
    #[error("micro-step {step}: the loss is {loss}")]
    NonFinite { step: u64, loss: f32 },
    /// Data-parallel training: the collective failed.
    #[error("{0}")]
    Collective(#[from] crate::train::distributed::CollectiveError),
    /// Data-parallel training: another rank failed (its own error names the cause); every
    /// rank stops at the same window.
    #[error("rank {rank} of {size}: stopped at micro-steps {first}-{last} because rank(s) {failed} failed there (see their errors)")]
    PeerFailed {
        rank: usize,
        size: usize,
        failed: String,
        first: u64,
        last: u64,
        /// Whether a failed rank's error was one of the input (exit code 2).
        input_error: bool,
    },
    /// Data-parallel training: the ranks' replicated state differs.
    #[error("{0}")]
    Diverged(String),
}

/// What a [`Trainer`] does when a micro-step's loss is NaN or infinite, on a step without
/// loss scaling (a loss-scaled step skips such windows in the graph: the loss is not
/// checked on the host there, and [`StepMetrics::skipped`] reports the skipped windows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnNonFinite {
    /// Keep the micro-step's state update like any other (the library's default).
    #[default]
    Keep,
    /// Discard the micro-step's state update and return [`TrainError::NonFinite`].
    Stop,
    /// Discard the micro-step's state update (the window goes on as if the micro-step had
    /// not run) and report it in [`StepMetrics::discarded`].
    Skip,
}

impl OnNonFinite {
    /// The word of `train --on-nonfinite`.
    pub fn as_str(self) -> &'static str {
        match self {
            OnNonFinite::Keep => "keep",
            OnNonFinite::Stop => "stop",
            OnNonFinite::Skip => "skip",
        }
    }
}

// The CLI offers stop and skip; keep is the library's default for hosts of their own.
value_enum!(OnNonFinite: OnNonFinite::Stop, OnNonFinite::Skip);

impl std::str::FromStr for OnNonFinite {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(OnNonFinite::Keep),
            "stop" => Ok(OnNonFinite::Stop),
            "skip" => Ok(OnNonFinite::Skip),
            other => Err(format!("'{other}': expected stop, skip or keep")),
        }
    }
}

/// Metrics of one micro-step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f32,
    pub applied: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale: Option<f32>,
    /// The window ended here but loss scaling dropped its update (non-finite gradients or
    /// loss).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// The loss was not finite and the host discarded this micro-step's state update
    /// ([`OnNonFinite::Skip`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub discarded: bool,
    /// The learning rate the micro-step ran with, when a schedule sets it
    /// ([`crate::lr_schedule`]; the host fills it in).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f32>,
}

/// A data input's declared element type and shape (for checking the data file).
#[derive(Clone, Debug)]
struct InputDecl {
    elem_type: i32,
    /// `None` for a symbolic dimension.
    dims: Vec<Option<i64>>,
}

/// How a [`Trainer`] runs its step.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub engine: EngineKind,
    pub session: SessionOptions,
    /// Run a step with an `If` apply region as two specialised graphs, one per branch
    /// ([`crate::split`]): no `If` and no copies of unchanged state per micro-step. Off runs
    /// the exported graph as is (same results).
    pub split: bool,
    /// Seeds every random draw of the sessions (Dropout masks, random ops) from this
    /// ([`draw_seed`]), so that runs repeat; `None` leaves them to the engine's own seeding.
    pub draw_seed: Option<u64>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            engine: EngineKind::Ort,
            session: SessionOptions::default(),
            split: true,
            draw_seed: None,
        }
    }
}

/// The sessions that run the step.
/// Which of the runner's sessions ran a micro-step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Session {
    Whole,
    Accumulate,
    WindowStart,
    Apply,
}

pub(crate) enum Runner {
    /// The exported step graph as is.
    Whole(Box<Engine>),
    /// One session per branch of the apply `If`; the host picks by the recorded trigger.
    Split {
        accumulate: Box<Engine>,
        /// The accumulate specialisation for the first micro-step of a window: it writes
        /// the gradients as the accumulators instead of adding them to zeros
        /// ([`window_start`]); `None` when the step has nothing to drop.
        start: Option<Box<Engine>>,
        apply: Box<Engine>,
        /// State inputs each specialisation leaves unchanged (it has no output for them).
        unchanged_on_accumulate: BTreeSet<String>,
        unchanged_on_apply: BTreeSet<String>,
        /// Accumulators the apply leaves holding the window's sums, which count as zero
        /// until the window start overwrites them ([`zero_after_apply`]); and whether they
        /// hold such stale sums now.
        zero_after_apply: BTreeSet<String>,
        stale_sums: bool,
        /// K: the step's initializer, or what [`Trainer::set_accum_steps`] set.
        window_size: i64,
        /// The micro-step counter the graph holds, mirrored on the host so that no state
        /// is read back to decide the branch.
        micro_step: i64,
        micro_step_input: String,
        /// The counter's output, when the accumulate and window-start sessions leave the
        /// counting to the host ([`host_counter`]).
        host_counted: Option<String>,
    },
}

impl Runner {
    /// The session that runs `which` micro-step (the whole graph's one for any of them).
    fn session(&self, which: Session) -> &Engine {
        match (self, which) {
            (Runner::Whole(engine), _) => engine,
            (Runner::Split { apply, .. }, Session::Apply) => apply,
            (
                Runner::Split {
                    start: Some(start), ..
                },
                Session::WindowStart,
            ) => start,
            (Runner::Split { accumulate, .. }, _) => accumulate,
        }
    }
}

pub struct Trainer {
    pub(crate) runner: Runner,
    kind: EngineKind,
    pub manifest: Manifest,
    /// Current value of every state input, by input name, where the engine computed it.
    pub(crate) state: BTreeMap<String, Held>,
    /// The state on the host, made when asked for and dropped at the next step.
    pub(crate) host_state: OnceCell<BTreeMap<String, Tensor>>,
    data_decls: BTreeMap<String, InputDecl>,
    /// Control inputs the host set (learning rate, K), fed on every run from then on.
    pub(crate) controls: BTreeMap<String, Tensor>,
    /// Every graph input of the step, to check a control's name against.
    inputs: BTreeSet<String>,
    /// Micro-steps run so far.
    pub steps_done: u64,
    /// The flags the host feeds (flush, keep), `false` then `true`: made once, not per run.
    flags: [Tensor; 2],
    on_nonfinite: OnNonFinite,
    /// Whether the step skips non-finite windows itself (loss scaling: `ga.skipped`).
    pub(crate) graph_skips: bool,
    /// Data-parallel training: the collective and what its window all-reduce carries
    /// ([`Trainer::with_collective`]); the split runner's `apply` is then the apply-only
    /// specialisation.
    pub(crate) replica: Option<crate::train::distributed::window::Replica>,
    /// Optimizer updates the sessions run fused (`passes::fuse`), summed over them.
    fused_updates: usize,
    /// See [`Self::grouped_updates`].
    grouped_updates: usize,
    /// See [`Self::accumulated_products`].
    accumulated_products: usize,
    /// See [`Self::apply_products`].
    apply_products: usize,
    /// For each session, by [`Session::index`], and each entry of the manifest's state,
    /// whether a run leaves the state where it is when it returns no output for it
    /// ([`left_alone`]).
    left_alone: [Vec<bool>; 4],
    /// For each session, by [`Session::index`], and each state in the state map's order,
    /// whether the session updates it in place ([`in_place_masks`]).
    in_place: [Vec<bool>; 4],
    /// The weight gradients the window's sessions keep until the window needs their sum
    /// (`engine::deferred_products`): held accumulators are behind by these.
    deferred: Option<Arc<DeferredProducts>>,
}

/// For each session, by [`Session::index`], and each key of `state` in order: whether the
/// session updates that state in place. Fixed for a key set; looked up by name (hashed) in
/// every run, it cost 0.3 µs of a micro-step's host work at 8K parameters.
fn in_place_masks(runner: &Runner, state: &BTreeMap<String, Held>) -> [Vec<bool>; 4] {
    let of = |which: Session| {
        let engine = runner.session(which);
        state.keys().map(|k| engine.updates_in_place(k)).collect()
    };
    [
        of(Session::Whole),
        of(Session::Accumulate),
        of(Session::WindowStart),
        of(Session::Apply),
    ]
}

/// For each session, by [`Session::index`], and each state of `manifest`: whether a run of
/// it leaves the state where it is when it returns no output for it, having no output for
/// it (the runner's `unchanged` sets) or updating it in place. Fixed once the sessions are
/// built; looked up by name in every run it cost a tenth of a micro-step's host work at 8K
/// parameters.
fn left_alone(runner: &Runner, manifest: &Manifest) -> [Vec<bool>; 4] {
    let of = |which: Session| {
        let unchanged = match (runner, which) {
            (
                Runner::Split {
                    unchanged_on_apply, ..
                },
                Session::Apply,
            ) => Some(unchanged_on_apply),
            (
                Runner::Split {
                    unchanged_on_accumulate,
                    ..
                },
                _,
            ) => Some(unchanged_on_accumulate),
            (Runner::Whole(_), _) => None,
        };
        let engine = runner.session(which);
        manifest
            .state
            .iter()
            .map(|e| {
                unchanged.is_some_and(|u| u.contains(&e.input)) || engine.updates_in_place(&e.input)
            })
            .collect()
    };
    [
        of(Session::Whole),
        of(Session::Accumulate),
        of(Session::WindowStart),
        of(Session::Apply),
    ]
}

impl Session {
    /// The session's place in [`Trainer`]'s per-session tables.
    fn index(self) -> usize {
        match self {
            Session::Whole => 0,
            Session::Accumulate => 1,
            Session::WindowStart => 2,
            Session::Apply => 3,
        }
    }
}

impl Trainer {
    /// A trainer on ONNX Runtime.
    pub fn new(model: &ModelProto, options: &SessionOptions) -> Result<Trainer, TrainError> {
        Self::with_engine(model, EngineKind::Ort, options)
    }

    /// A trainer on the given engine (`Auto` is resolved by [`EngineKind::resolve`]). The
    /// state loop, metrics and state files are the same on every engine.
    pub fn with_engine(
        model: &ModelProto,
        engine: EngineKind,
        options: &SessionOptions,
    ) -> Result<Trainer, TrainError> {
        Self::with_options(
            model,
            &TrainOptions {
                engine,
                session: options.clone(),
                ..TrainOptions::default()
            },
        )
    }

    /// A trainer with every option: engine, session options, and whether an `If` step runs
    /// as its two specialisations (the default) or whole.
    pub fn with_options(model: &ModelProto, options: &TrainOptions) -> Result<Trainer, TrainError> {
        Self::build(model, options, None)
    }

    /// A trainer that is one rank of data-parallel training over `collective` (see
    /// [`crate::train::distributed`]): micro-steps run with the accumulate specialisation only, and
    /// [`run_window`](Self::run_window) ends windows with one all-reduce and the apply-only
    /// specialisation. Needs a step with an `If` apply region, run split.
    pub fn with_collective(
        model: &ModelProto,
        options: &TrainOptions,
        collective: Box<dyn crate::train::distributed::Collective>,
    ) -> Result<Trainer, TrainError> {
        Self::build(model, options, Some(collective))
    }

    fn build(
        model: &ModelProto,
        options: &TrainOptions,
        collective: Option<Box<dyn crate::train::distributed::Collective>>,
    ) -> Result<Trainer, TrainError> {
        let manifest = Manifest::from_model(model).map_err(StepError::from)?;
        // Each rank of data-parallel training draws its own masks (`draw_seed::for_rank`).
        let rank = collective.as_ref().map_or(0, |c| c.rank());
        let seed = options.draw_seed;
        // Split or whole, a step trains only when its apply If is the region its manifest
        // describes: with swapped branches the two modes would train differently.
        crate::split::check_apply_region(model, &manifest)
            .map_err(|e| StepError::from(crate::state::NotAStep(e)))?;
        let graph = model
            .graph
            .as_ref()
            .ok_or_else(|| TrainError::Model("the model has no graph".into()))?;
        let initial = |name: &str| -> Result<Tensor, TrainError> {
            if let Some(crate::state::StateInit::Zeros) = manifest.init_of(name) {
                return zeros_of_input(graph, name);
            }
            let init = graph
                .initializer
                .iter()
                .find(|t| t.name() == name)
                .ok_or_else(|| {
                    TrainError::Model(format!(
                        "input '{name}' has no initializer holding its initial value"
                    ))
                })?;
            Tensor::from_tensor_proto(init)
                .map_err(|m| TrainError::Model(format!("initializer '{name}': {m}")))
        };
        let mut state = BTreeMap::new();
        for entry in &manifest.state {
            state.insert(entry.input.clone(), initial(&entry.input)?);
        }
        let mut data_decls = BTreeMap::new();
        for name in &manifest.data_inputs {
            let info = graph
                .input
                .iter()
                .find(|i| i.name() == name)
                .ok_or_else(|| {
                    TrainError::Model(format!("data input '{name}' is not a graph input"))
                })?;
            data_decls.insert(name.clone(), decl(info.r#type.as_ref()));
        }
        let kind = options.engine.resolve().0;
        if collective.is_some() && !options.split {
            return Err(TrainError::Model(
                "data-parallel training runs the step split (accumulate / apply-only); drop --no-split".into(),
            ));
        }
        // Data parallel: the apply specialisation is replaced by the apply-only one.
        let apply_only = match &collective {
            Some(_) => Some(
                crate::train::distributed::apply_only(model, &manifest)
                    .map_err(|e| TrainError::Model(format!("data-parallel training: {e}")))?,
            ),
            None => None,
        };
        let split = match options.split {
            true => crate::split::split_step(model, &manifest)
                .map_err(|e| TrainError::Model(format!("splitting the step: {e}")))?,
            false => None,
        };
        let micro_step_input = crate::split::micro_step_input(&manifest).map(str::to_string);
        // Parameter updates the sessions run as one fused kernel each (`fuse-adamw`).
        let mut fused = FusedCounts::default();
        let mut deferred = None;
        let mut runner = match (split, micro_step_input) {
            (Some(mut split), Some(micro_step_input)) => {
                let window_size = scalar_i64(&initial(&split.trigger.steps)?).ok_or_else(|| {
                    TrainError::Model(format!("'{}' is not an int64 scalar", split.trigger.steps))
                })?;
                let micro_step = scalar_i64(&state[&micro_step_input]).ok_or_else(|| {
                    TrainError::Model(format!("'{micro_step_input}' is not an int64 scalar"))
                })?;
                // The sessions run one after the other: one CPU arena serves them all, and
                // so does one spinning thread pool when the environment's has their thread
                // count; a pool of their own must not spin while another session runs. No
                // memory pattern: each session's planned block would stay reserved in the
                // shared arena beside the others' (peak RSS, benches/README.md "Run I").
                let session = SessionOptions {
                    memory_pattern: false,
                    shared_arena: true,
                    spin: false,
                    shared_pool: true,
                    // Only the window's sessions keep products, in this trainer's table.
                    deferred_products: None,
                    ..options.session.clone()
                };
                let apply = match &apply_only {
                    Some((s, _)) => s,
                    None => &split.apply,
                };
                let host_counted = match host_counter::without_counter(&split.accumulate, &manifest)
                {
                    Some(accumulate) => {
                        split.accumulate = accumulate;
                        manifest
                            .state
                            .iter()
                            .find(|e| e.role == crate::state::Role::MicroStep)
                            .map(|e| e.output.clone())
                    }
                    None => None,
                };
                let start_model = window_start::window_start(&split.accumulate, &manifest);
                // Zeros the next micro-step overwrites unread need not be written (not for
                // data parallel, whose window ends apart; on ONNX Runtime's CPU, where the
                // host zeroes a buffer in place when it must).
                let (apply, zero_after_apply) = match (&start_model, &apply_only) {
                    (Some(start), None)
                        if kind.resolve().0 == EngineKind::Ort
                            && session.device == crate::engine::ort::Device::Cpu =>
                    {
                        let unread = zero_after_apply::written_unread(start, &manifest);
                        let (apply, dropped) =
                            zero_after_apply::drop_zeroing(apply, &manifest, &unread);
                        (std::borrow::Cow::Owned(apply), dropped)
                    }
                    _ => (std::borrow::Cow::Borrowed(apply), BTreeSet::new()),
                };
                // In place only here: the whole graph's states leave through its If.
                let in_place = |window_start| crate::passes::fuse::FuseOptions {
                    in_place: true,
                    window_start,
                    min_in_place_total: session.in_place_min_total,
                    products: session.fused_weight_grads,
                    apply_products: session.apply_products,
                    host_updates: session
                        .host_updates
                        .then_some(crate::passes::fuse::host::MAX_ELEMENTS),
                };
                // The window's weight gradients (its first micro-step's and the accumulating
                // ones') may wait for the window's sum (not for data parallel, whose window
                // ends in the collective's reduction).
                deferred = (kind == EngineKind::Ort
                    && session.device == crate::engine::ort::Device::Cpu
                    && session.fused_kernels
                    && session.in_place_updates
                    && session.fused_weight_grads
                    && session.defer_weight_grads
                    && apply_only.is_none())
                .then(Arc::<DeferredProducts>::default);
                let accumulating = SessionOptions {
                    deferred_products: deferred.clone(),
                    ..session.clone()
                };
                let start = match start_model {
                    Some(s) => Some(Box::new(open_engine(
                        kind,
                        &seeded_draws(&s.model, seed, rank, Session::WindowStart),
                        &accumulating,
                        &manifest,
                        &mut fused,
                        in_place(true),
                    )?)),
                    None => None,
                };
                Runner::Split {
                    accumulate: Box::new(open_engine(
                        kind,
                        &seeded_draws(&split.accumulate.model, seed, rank, Session::Accumulate),
                        &accumulating,
                        &manifest,
                        &mut fused,
                        in_place(false),
                    )?),
                    start,
                    // The apply's updates may add the products kept for their accumulators
                    // (`passes::fuse::apply_kept_sum`).
                    apply: Box::new(open_engine(
                        kind,
                        &seeded_draws(&apply.model, seed, rank, Session::Apply),
                        &accumulating,
                        &manifest,
                        &mut fused,
                        in_place(false),
                    )?),
                    unchanged_on_accumulate: split.accumulate.unchanged,
                    unchanged_on_apply: apply.unchanged.clone(),
                    zero_after_apply,
                    stale_sums: false,
                    window_size,
                    micro_step,
                    micro_step_input,
                    host_counted,
                }
            }
            _ if collective.is_some() => return Err(TrainError::Model(
                "data-parallel training needs a step with an If apply region (rewrite --apply if)"
                    .into(),
            )),
            _ => Runner::Whole(Box::new(open_engine(
                kind,
                &seeded_draws(model, seed, rank, Session::Whole),
                &options.session,
                &manifest,
                &mut fused,
                crate::passes::fuse::FuseOptions::default(),
            )?)),
        };
        let replica = match (collective, &apply_only, &runner) {
            (
                Some(collective),
                Some((_, accumulating)),
                Runner::Split {
                    unchanged_on_accumulate,
                    ..
                },
            ) => Some(crate::train::distributed::window::Replica::new(
                collective,
                &manifest,
                &state,
                accumulating,
                unchanged_on_accumulate,
            )?),
            _ => None,
        };
        let host_outputs = [manifest.loss.as_str(), APPLIED];
        match &mut runner {
            Runner::Whole(engine) => engine.set_host_outputs(&host_outputs),
            Runner::Split {
                accumulate,
                start,
                apply,
                ..
            } => {
                accumulate.set_host_outputs(&host_outputs);
                if let Some(start) = start {
                    start.set_host_outputs(&host_outputs);
                }
                apply.set_host_outputs(&host_outputs);
            }
        }
        let left_alone = left_alone(&runner, &manifest);
        let state: BTreeMap<String, Held> =
            state.into_iter().map(|(k, v)| (k, Held::Host(v))).collect();
        let in_place = in_place_masks(&runner, &state);
        Ok(Trainer {
            runner,
            left_alone,
            in_place,
            kind,
            manifest,
            // Made from `state` when first asked for: one copy of the state, not two.
            host_state: OnceCell::new(),
            state,
            data_decls,
            controls: BTreeMap::new(),
            inputs: graph.input.iter().map(|i| i.name().to_string()).collect(),
            steps_done: 0,
            flags: [false, true].map(|f| Tensor::Bool(ndarray::arr0(f).into_dyn())),
            on_nonfinite: OnNonFinite::default(),
            graph_skips: graph.output.iter().any(|o| o.name() == SKIPPED),
            replica,
            fused_updates: fused.updates,
            grouped_updates: fused.grouped,
            accumulated_products: fused.products,
            apply_products: fused.apply_products,
            deferred,
        })
    }

    /// The engine that runs the steps.
    pub fn engine(&self) -> EngineKind {
        self.kind
    }

    /// How many parameter updates the sessions run as one fused kernel each, summed over
    /// the sessions (0: the step runs as written; see `SessionOptions::fused_kernels`).
    pub fn fused_updates(&self) -> usize {
        self.fused_updates
    }

    /// How many parameters' AdamW updates run together in one `AdamWUpdates` kernel per
    /// session, summed over the sessions (`passes::fuse::adamw_group`: sessions that update
    /// nothing in place).
    pub fn grouped_updates(&self) -> usize {
        self.grouped_updates
    }

    /// How many weight gradients the sessions make inside their accumulators
    /// (`SessionOptions::fused_weight_grads`, `passes::fuse::accumulate_product`), summed
    /// over the sessions.
    pub fn accumulated_products(&self) -> usize {
        self.accumulated_products
    }

    /// How many weight gradients the apply's optimizer updates make themselves, unwritten
    /// (`passes::fuse::apply_product`), summed over the sessions.
    pub fn apply_products(&self) -> usize {
        self.apply_products
    }

    /// Whether the host counts the micro-steps that continue a window, instead of the
    /// sessions that run them ([`host_counter`]).
    pub fn micro_steps_counted_by_host(&self) -> bool {
        matches!(
            &self.runner,
            Runner::Split {
                host_counted: Some(_),
                ..
            }
        )
    }

    /// How many accumulators the apply leaves holding the window's sums for the next window
    /// start to overwrite, instead of writing zeros into them ([`zero_after_apply`]).
    pub fn zeros_left_to_the_window_start(&self) -> usize {
        match &self.runner {
            Runner::Split {
                zero_after_apply, ..
            } => zero_after_apply.len(),
            Runner::Whole(_) => 0,
        }
    }

    /// How many states the sessions update in place (`SessionOptions::in_place_updates`),
    /// summed over the split step's sessions (0: every run writes fresh buffers).
    pub fn in_place_updates(&self) -> usize {
        self.sum_over_sessions(|e| e.in_place().len())
    }

    /// How many states the window-start session writes in place: its accumulators, which it
    /// writes and does not read, bound at any size (0 without that session).
    pub fn window_start_in_place(&self) -> usize {
        match &self.runner {
            Runner::Split {
                start: Some(start), ..
            } => start.in_place().len(),
            _ => 0,
        }
    }

    /// How many optimizer updates the host runs after the sessions, in place on the state
    /// (`SessionOptions::host_updates`), summed over the split step's sessions.
    pub fn host_updates(&self) -> usize {
        self.sum_over_sessions(Engine::host_updates)
    }

    /// How many convolutions the sessions run on ONNX Runtime's blocked kernels
    /// (`SessionOptions::nchwc_convs`), summed over the split step's sessions.
    pub fn nchwc_convs(&self) -> usize {
        self.sum_over_sessions(Engine::nchwc_convs)
    }

    /// BatchNorm forwards and backwards on onnx-ga's fused kernels
    /// (`SessionOptions::fused_batch_norm`), summed over the split step's sessions.
    pub fn fused_batch_norms(&self) -> usize {
        self.sum_over_sessions(Engine::fused_batch_norms)
    }

    /// Exact-GELU gradients on onnx-ga's fused kernel (`SessionOptions::fused_gelu_grad`),
    /// summed over the split step's sessions.
    pub fn fused_gelu_grads(&self) -> usize {
        self.sum_over_sessions(Engine::fused_gelu_grads)
    }

    /// Exact-GELU forwards on onnx-ga's fused kernel (`SessionOptions::fused_gelu`), summed
    /// over the split step's sessions.
    pub fn fused_gelus(&self) -> usize {
        self.sum_over_sessions(Engine::fused_gelus)
    }

    /// Layer-norm gradients on onnx-ga's fused kernel
    /// (`SessionOptions::fused_layer_norm_grad`), summed over the split step's sessions.
    pub fn fused_layer_norm_grads(&self) -> usize {
        self.sum_over_sessions(Engine::fused_layer_norm_grads)
    }

    /// Linear layers whose bias is added inside their `Gemm`
    /// (`SessionOptions::bias_in_gemm`), summed over the split step's sessions.
    pub fn biases_in_gemm(&self) -> usize {
        self.sum_over_sessions(Engine::biases_in_gemm)
    }

    /// Sums over leading axes on onnx-ga's fused kernel
    /// (`SessionOptions::fused_leading_sum`), summed over the split step's sessions.
    pub fn fused_leading_sums(&self) -> usize {
        self.sum_over_sessions(Engine::fused_leading_sums)
    }

    /// Transposed convolutions as a product and onnx-ga's `Col2Im`
    /// (`SessionOptions::fused_col2im`), summed over the split step's sessions.
    pub fn fused_foldings(&self) -> usize {
        self.sum_over_sessions(Engine::fused_foldings)
    }

    /// Convolutions' weight gradients on onnx-ga's `ConvWeightGrad`
    /// (`SessionOptions::fused_conv_weight_grad`), summed over the split step's sessions.
    pub fn fused_conv_weight_grads(&self) -> usize {
        self.sum_over_sessions(Engine::fused_conv_weight_grads)
    }

    /// Transposes on onnx-ga's `RowTranspose` (`SessionOptions::fused_transpose`), summed
    /// over the split step's sessions.
    pub fn fused_transposes(&self) -> usize {
        self.sum_over_sessions(Engine::fused_transposes)
    }

    /// Scalar nodes the host computes instead of the sessions (`engine::host_scalars`),
    /// summed over them.
    pub fn host_scalar_nodes(&self) -> usize {
        self.sum_over_sessions(Engine::host_scalar_nodes)
    }

    fn sum_over_sessions(&self, count: impl Fn(&Engine) -> usize) -> usize {
        match &self.runner {
            Runner::Whole(e) => count(e),
            Runner::Split {
                accumulate,
                start,
                apply,
                ..
            } => count(accumulate) + start.as_deref().map_or(0, &count) + count(apply),
        }
    }

    /// What to do with a micro-step whose loss is not finite (see [`OnNonFinite`]).
    pub fn set_on_nonfinite(&mut self, policy: OnNonFinite) {
        self.on_nonfinite = policy;
    }

    /// Whether the step skips non-finite windows itself (it has loss scaling); the host
    /// then leaves non-finite losses to it.
    pub fn skips_nonfinite_windows(&self) -> bool {
        self.graph_skips
    }

    /// The first parameter, optimizer moment, frozen tensor or BatchNorm running statistic
    /// holding a NaN or an infinity, if any: state that must not be saved as a result.
    /// (Accumulators may hold non-finite values within a window that loss scaling will
    /// skip, so they are not checked.)
    pub fn nonfinite_state(&self) -> Result<Option<String>, TrainError> {
        use crate::state::Role;
        for e in &self.manifest.state {
            let checked = match e.role {
                Role::Param | Role::Moment | Role::Frozen | Role::LossScale => true,
                Role::BnStat => e.param.as_deref().is_none_or(|p| p == e.input),
                _ => false,
            };
            if !checked || !self.state.contains_key(&e.input) {
                continue;
            }
            if self.host_value(&e.input)?.non_finite_count() > 0 {
                return Ok(Some(e.input.clone()));
            }
        }
        Ok(None)
    }

    /// The state's input names, in order.
    pub fn state_names(&self) -> impl Iterator<Item = &str> {
        self.state.keys().map(String::as_str)
    }

    /// State `name` on the host for the moment, as [`state`](Self::state) would give it:
    /// lent where the host holds it, else copied from the engine (or zeros, for sums the
    /// apply left that count as zero). One tensor's copy at most, where `state` copies the
    /// whole state: what reading a large model's state one tensor at a time needs.
    pub fn host_value(&self, name: &str) -> Result<Cow<'_, Tensor>, TrainError> {
        if let Some(host) = self.host_state.get() {
            if let Some(t) = host.get(name) {
                return Ok(Cow::Borrowed(t));
            }
        }
        let held = self
            .state
            .get(name)
            .ok_or_else(|| TrainError::Model(format!("'{name}' is not a state of this step")))?;
        let stale = matches!(
            &self.runner,
            Runner::Split { zero_after_apply, stale_sums: true, .. } if zero_after_apply.contains(name)
        );
        let behind = self.is_behind(name);
        match held {
            Held::Host(t) if !stale && !behind => Ok(Cow::Borrowed(t)),
            held => {
                let mut t = held.to_host(name)?;
                if stale {
                    zero_after_apply::zero_fill(&mut t);
                }
                self.add_kept_to_copy(name, &mut t);
                Ok(Cow::Owned(t))
            }
        }
    }

    /// Sets the learning rate from the next micro-step on: the step's learning-rate input
    /// (recorded in the manifest), whose initializer is only its default. For schedules.
    pub fn set_learning_rate(&mut self, lr: f32) -> Result<(), TrainError> {
        let name = self.manifest.learning_rate.clone().ok_or_else(|| {
            TrainError::Model(
                "the step records no learning-rate input (onnx_ga.learning_rate)".into(),
            )
        })?;
        if !lr.is_finite() || lr < 0.0 {
            return Err(TrainError::Model(format!(
                "learning rate {lr}: must be finite and not negative"
            )));
        }
        self.set_control(name, Tensor::F32(ndarray::arr0(lr).into_dyn()))
    }

    /// Sets K, the micro-steps per window, from the next micro-step on. The current window
    /// applies as soon as it holds K micro-steps (`micro_step + 1 >= K`): setting K between
    /// windows starts windows of the new size; setting it below the micro-steps already
    /// accumulated applies at the next micro-step.
    pub fn set_accum_steps(&mut self, k: i64) -> Result<(), TrainError> {
        if k < 1 {
            return Err(TrainError::Model(format!("K = {k}: must be at least 1")));
        }
        let name = self
            .manifest
            .apply
            .as_ref()
            .map_or("ga.accum_steps", |t| t.steps.as_str())
            .to_string();
        self.set_control(name, Tensor::I64(ndarray::arr0(k).into_dyn()))?;
        if let Runner::Split { window_size, .. } = &mut self.runner {
            *window_size = k;
        }
        Ok(())
    }

    fn set_control(&mut self, name: String, value: Tensor) -> Result<(), TrainError> {
        if !self.inputs.contains(&name) {
            return Err(TrainError::Model(format!("the step has no input '{name}'")));
        }
        self.controls.insert(name, value);
        Ok(())
    }

    /// The accumulators whose held value is behind by weight gradients kept for the
    /// window's sum (`engine::deferred_products`), at the moment; `state` and `host_value`
    /// give them whole.
    pub fn accumulators_behind(&self) -> Vec<String> {
        self.deferred
            .as_ref()
            .map(|d| d.kept_names())
            .unwrap_or_default()
    }

    /// After a discarded window start: zeros in the accumulators that session writes in
    /// place. It writes them without reading them, and no gate stops ONNX Runtime's own
    /// nodes (a bias gradient's sum, a product bound to the accumulator's buffer) from
    /// writing: they hold the discarded micro-step's gradients, NaN for a NaN input. The
    /// window's first micro-step runs again and overwrites them, unless an apply reads them
    /// first (a flush, K lowered to 1), or the state is read or saved: an apply after a
    /// discarded window start trained every parameter into NaN.
    fn zero_window_start_writes(&mut self) -> Result<(), TrainError> {
        let Runner::Split {
            start: Some(start), ..
        } = &self.runner
        else {
            return Ok(());
        };
        let accumulators: BTreeSet<String> = self
            .manifest
            .state
            .iter()
            .filter(|e| e.role == crate::state::Role::Accumulator)
            .filter(|e| start.updates_in_place(&e.input))
            .map(|e| e.input.clone())
            .collect();
        self.host_state = OnceCell::new();
        zero_stale_sums(&mut self.state, &accumulators)
    }

    fn is_behind(&self, name: &str) -> bool {
        self.deferred.as_ref().is_some_and(|d| d.is_behind(name))
    }

    /// Adds the products kept for accumulator `name` to `copy`, a host copy of its held
    /// value: what it is.
    fn add_kept_to_copy(&self, name: &str, copy: &mut Tensor) {
        if let (Some(deferred), Tensor::F32(values)) = (&self.deferred, copy) {
            if let Some(values) = values.as_slice_mut() {
                deferred.add_kept(name, values, false);
            }
        }
    }

    /// Whether the step runs as two specialised graphs ([`crate::split`]).
    pub fn is_split(&self) -> bool {
        matches!(self.runner, Runner::Split { .. })
    }

    /// The current state, by state input name, copied to the host (once per step, on the
    /// first call after it).
    pub fn state(&self) -> Result<&BTreeMap<String, Tensor>, TrainError> {
        if let Some(state) = self.host_state.get() {
            return Ok(state);
        }
        let stale = match &self.runner {
            Runner::Split {
                zero_after_apply,
                stale_sums: true,
                ..
            } => Some(zero_after_apply),
            _ => None,
        };
        let mut host = BTreeMap::new();
        for (name, value) in &self.state {
            let mut t = value.to_host(name)?;
            if stale.is_some_and(|s| s.contains(name)) {
                zero_after_apply::zero_fill(&mut t);
            }
            self.add_kept_to_copy(name, &mut t);
            host.insert(name.clone(), t);
        }
        Ok(self.host_state.get_or_init(|| host))
    }

    /// Replaces the state with values read from a state file written by
    /// [`save_state`](Self::save_state): `.npz` or `.safetensors`, by extension.
    pub fn load_state(&mut self, path: &Path) -> Result<(), TrainError> {
        let loaded = crate::data::read_state(path)?;
        let bad = |message: String| TrainError::BadState {
            file: path.to_path_buf(),
            message,
        };
        // Training state this step and the file's disagree on (`ga.` moments, counters,
        // sums): the file was saved by a step rewritten otherwise. Its parameters can
        // still start this step, through the model.
        let way_on = format!(
            "the file was saved by a step made otherwise (another optimizer, normalisation, loss scaling or model); to start this step from its parameters, write them into the model (`onnx-ga export MODEL.onnx --state {} -o TRAINED.onnx`) and rewrite that",
            path.display()
        );
        let made_otherwise = |name: &str, message: String| match name.starts_with("ga.") {
            true => bad(format!("{message}: {way_on}")),
            false => bad(message),
        };
        // Checked against the values held (no host copy of the whole state for it).
        for (name, held) in &self.state {
            let copy;
            let current = match (self.host_state.get(), held) {
                (Some(host), _) => &host[name],
                (None, Held::Host(t)) => t,
                (None, held) => {
                    copy = held.to_host(name)?;
                    &copy
                }
            };
            let value = loaded
                .get(name)
                .ok_or_else(|| made_otherwise(name, format!("state '{name}' is missing")))?;
            if value.elem_type() != current.elem_type() || value.shape() != current.shape() {
                return Err(bad(format!(
                    "state '{name}' is {} {:?} in the file but the model wants {} {:?}",
                    crate::ir::print::elem_type_name(value.elem_type()),
                    value.shape(),
                    crate::ir::print::elem_type_name(current.elem_type()),
                    current.shape()
                )));
            }
        }
        if let Some(extra) = loaded.keys().find(|k| !self.state.contains_key(*k)) {
            return Err(made_otherwise(
                extra,
                format!("'{extra}' is not a state of this model"),
            ));
        }
        if let Runner::Split {
            micro_step,
            micro_step_input,
            start,
            stale_sums,
            ..
        } = &mut self.runner
        {
            *stale_sums = false;
            *micro_step = scalar_i64(&loaded[micro_step_input.as_str()])
                .ok_or_else(|| bad(format!("'{micro_step_input}' is not an int64 scalar")))?;
            // A file whose window is empty but whose sums are not (not one this trainer
            // wrote) must still be added to: no first-micro-step shortcut then.
            let nonzero = |e: &crate::state::StateEntry| !matches!(&loaded[&e.input], Tensor::F32(a) if a.iter().all(|v| *v == 0.0));
            if *micro_step == 0
                && self
                    .manifest
                    .state
                    .iter()
                    .any(|e| e.role == crate::state::Role::Accumulator && nonzero(e))
            {
                *start = None;
            }
        }
        if let Some(deferred) = &self.deferred {
            deferred.forget();
        }
        // The loaded values become the state itself (no second copy on the host).
        self.state = loaded
            .into_iter()
            .map(|(k, v)| (k, Held::Host(v)))
            .collect();
        self.in_place = in_place_masks(&self.runner, &self.state);
        self.host_state = OnceCell::new();
        Ok(())
    }

    /// Writes every state tensor under its state input name, atomically: `.npz` or
    /// `.safetensors`, by extension.
    ///
    /// The state goes out one tensor at a time ([`host_value`](Self::host_value)): saving
    /// holds at most one tensor's copy beside the state, not a second state.
    pub fn save_state(&self, path: &Path) -> Result<(), TrainError> {
        let layouts = self
            .state
            .iter()
            .map(|(name, held)| {
                let (elem_type, shape) = held.layout(name)?;
                Ok(crate::data::TensorLayout {
                    name: name.clone(),
                    elem_type,
                    shape,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        crate::data::write_state_lazily(path, &layouts, |name| {
            self.host_value(name).map_err(|e| e.to_string())
        })?;
        Ok(())
    }

    /// Checks a data file against the model's data inputs: every input present, element
    /// types equal, trailing dimensions equal, the same number of samples in each.
    pub fn check_data(
        &self,
        data: &impl crate::dataset::DataLayouts,
        file: &Path,
    ) -> Result<usize, TrainError> {
        let bad = |message: String| TrainError::BadData {
            file: file.to_path_buf(),
            message,
        };
        let mut samples = None;
        for (name, decl) in &self.data_decls {
            let (elem_type, shape) = data.layout(name).ok_or_else(|| {
                bad(format!(
                    "no array named '{name}' (the model's data inputs: {})",
                    self.manifest.data_inputs.join(", ")
                ))
            })?;
            if elem_type != decl.elem_type {
                return Err(bad(format!(
                    "array '{name}' is {} but the model's input is {}",
                    crate::ir::print::elem_type_name(elem_type),
                    crate::ir::print::elem_type_name(decl.elem_type)
                )));
            }
            if shape.len() != decl.dims.len() || shape.is_empty() {
                return Err(bad(format!(
                    "array '{name}' has shape {shape:?}; the model's input has rank {}",
                    decl.dims.len()
                )));
            }
            for (axis, (have, want)) in shape.iter().zip(&decl.dims).enumerate().skip(1) {
                if let Some(want) = want {
                    if *have as i64 != *want {
                        return Err(bad(format!(
                            "array '{name}' has shape {shape:?}; axis {axis} must be {want}"
                        )));
                    }
                }
            }
            match samples {
                None => samples = Some(shape[0]),
                Some(n) if n != shape[0] => {
                    return Err(bad(format!(
                        "array '{name}' has {} samples, others have {n}",
                        shape[0]
                    )));
                }
                _ => {}
            }
        }
        let n = samples.unwrap_or(0);
        if n == 0 {
            return Err(bad("the data holds no samples".into()));
        }
        Ok(n)
    }

    /// Runs one micro-step on `batch` (one tensor per data input). `flush` forces the
    /// window to apply now.
    pub fn step(
        &mut self,
        batch: &BTreeMap<String, Tensor>,
        flush: bool,
    ) -> Result<StepMetrics, TrainError> {
        if self.replica.is_some() {
            return Err(TrainError::Model(
                "a data-parallel trainer ends windows with run_window, not step".into(),
            ));
        }
        self.step_inner(batch, flush)
    }

    /// [`step`](Self::step) without the check; a data-parallel trainer's micro-steps always
    /// accumulate (the window ends in [`run_window`](Self::run_window)).
    pub(crate) fn step_inner(
        &mut self,
        batch: &BTreeMap<String, Tensor>,
        flush: bool,
    ) -> Result<StepMetrics, TrainError> {
        let mut host: Vec<(&str, &Tensor)> =
            Vec::with_capacity(batch.len() + self.controls.len() + 1);
        for name in &self.manifest.data_inputs {
            let t = batch
                .get(name)
                .ok_or_else(|| TrainError::Model(format!("batch lacks data input '{name}'")))?;
            host.push((name, t));
        }
        for (name, value) in &self.controls {
            host.push((name, value));
        }
        if flush {
            // Both runners: the apply specialisation still computes its `applied` flag
            // from it.
            let name = self
                .manifest
                .apply
                .as_ref()
                .map_or("ga.flush", |t| &t.flush);
            host.push((name, &self.flags[1]));
        }
        let keep_nonfinite = self.graph_skips || self.on_nonfinite == OnNonFinite::Keep;
        let keep_nonfinite = &self.flags[keep_nonfinite as usize];
        // Which specialisation ran: `Some(applies)`, or `None` for the whole graph.
        let mut micro_step_before = None;
        let mut stale_before = false;
        let mut ran = Session::Whole;
        let (outputs, branch) = match &mut self.runner {
            Runner::Whole(engine) => {
                let in_place = &self.in_place[Session::Whole.index()];
                (
                    run_on_state(engine, &host, &mut self.state, in_place)?,
                    None,
                )
            }
            Runner::Split {
                accumulate,
                start,
                apply,
                window_size,
                micro_step,
                zero_after_apply,
                stale_sums,
                host_counted,
                ..
            } => {
                let applies = self.replica.is_none()
                    && crate::split::applies(*micro_step, *window_size, flush);
                // A window's first micro-step finds every accumulator zero (the apply
                // zeroed it, or training starts): it need not read them.
                let engine = match (applies, start) {
                    (true, _) => {
                        ran = Session::Apply;
                        apply
                    }
                    (false, Some(start)) if *micro_step == 0 => {
                        ran = Session::WindowStart;
                        start
                    }
                    (false, _) => {
                        ran = Session::Accumulate;
                        accumulate
                    }
                };
                // The fused kernels' gate: false when the host will discard a micro-step
                // whose loss is not finite, so that they leave what they update in place as
                // it was.
                let keep_input = engine.keep_input().map(str::to_string);
                if let Some(k) = &keep_input {
                    host.push((k, keep_nonfinite));
                }
                if let Some(deferred) = &self.deferred {
                    // A window ended before its last accumulating micro-step made the sums
                    // (a flush, K lowered), or what the apply's updates do not sum: made
                    // here, before another session reads them.
                    if ran != Session::Accumulate {
                        add_kept_products(deferred, &mut self.state, ran == Session::Apply)?;
                    }
                    // The window's kernels keep their products unless the next micro-step
                    // applies (and the apply's update does not add them), or this one does.
                    deferred.set_sum_now(
                        ran == Session::Apply
                            || crate::split::applies(*micro_step + 1, *window_size, false),
                    );
                }
                // Only the window start may see the last window's sums (it reads none).
                stale_before = *stale_sums;
                if *stale_sums && ran != Session::WindowStart {
                    zero_stale_sums(&mut self.state, zero_after_apply)?;
                    *stale_sums = false;
                }
                let in_place = &self.in_place[ran.index()];
                let mut outputs = run_on_state(engine, &host, &mut self.state, in_place)?;
                if let (false, Some(counter)) = (applies, host_counted.as_ref()) {
                    let next = Tensor::I64(ndarray::arr0(*micro_step + 1).into_dyn());
                    outputs.push((counter.clone(), Held::Host(next)));
                }
                micro_step_before = Some(*micro_step);
                *micro_step = if applies { 0 } else { *micro_step + 1 };
                *stale_sums = match ran {
                    Session::Apply => !zero_after_apply.is_empty(),
                    Session::WindowStart => false,
                    _ => *stale_sums,
                };
                (outputs, Some(applies))
            }
        };
        // A handful of outputs, in the session's order: found by name, not through a map
        // built per run (at 8K parameters the host's work around a run is a fifth of it).
        let mut outputs = outputs;
        // When the window ended, whether it updated (loss scaling may skip it) the graph says.
        let applied = match branch {
            None => applied_flag(named(&outputs, APPLIED))?.unwrap_or(false),
            Some(applies) => applies && applied_flag(named(&outputs, APPLIED))?.unwrap_or(true),
        };
        let left_alone = &self.left_alone[ran.index()];
        // The values replaced, to put back if the host discards this micro-step.
        let mut replaced: Vec<(&str, Held)> = Vec::new();
        for (entry, &left_alone) in self.manifest.state.iter().zip(left_alone) {
            match take_named(&mut outputs, &entry.output) {
                Some(next) => match self.state.get_mut(&entry.input) {
                    Some(held) => replaced.push((&entry.input, std::mem::replace(held, next))),
                    None => {
                        self.state.insert(entry.input.clone(), next);
                    }
                },
                // Unchanged, or updated in place: the value held is already the next one.
                None if left_alone => {}
                None => {
                    return Err(TrainError::Model(format!(
                        "the run did not produce state output '{}'",
                        entry.output
                    )))
                }
            }
        }
        let host_before = std::mem::take(&mut self.host_state);
        let loss_missing = || {
            TrainError::Model(format!(
                "loss output '{}' missing or not a float scalar",
                self.manifest.loss
            ))
        };
        let loss = named(&outputs, &self.manifest.loss)
            .ok_or_else(loss_missing)?
            .read_host(&self.manifest.loss, |t| scalar_f32(Some(t)))?
            .ok_or_else(loss_missing)?;
        let discard = !loss.is_finite()
            && !self.graph_skips
            && matches!(self.on_nonfinite, OnNonFinite::Stop | OnNonFinite::Skip);
        if discard {
            for (name, old) in replaced {
                if let Some(held) = self.state.get_mut(name) {
                    *held = old;
                }
            }
            self.host_state = host_before;
            if let (
                Runner::Split {
                    micro_step,
                    stale_sums,
                    ..
                },
                Some(before),
            ) = (&mut self.runner, micro_step_before)
            {
                *micro_step = before;
                *stale_sums = stale_before;
            }
            if ran == Session::WindowStart {
                self.zero_window_start_writes()?;
            }
            if self.on_nonfinite == OnNonFinite::Stop {
                return Err(TrainError::NonFinite {
                    step: self.steps_done + 1,
                    loss,
                });
            }
        }
        let skipped = match (branch, named(&outputs, SKIPPED)) {
            (Some(applies), _) => applies && !applied && self.graph_skips,
            (None, Some(flag)) => matches!(
                flag.to_host(SKIPPED)?,
                Tensor::Bool(a) if a.iter().next() == Some(&true)
            ),
            (None, None) => false,
        };
        let scale = match self
            .manifest
            .state
            .iter()
            .find(|e| e.role == crate::state::Role::LossScale)
        {
            Some(e) => scalar_f32(Some(&self.state[&e.input].to_host(&e.input)?)),
            None => None,
        };
        self.steps_done += 1;
        Ok(StepMetrics {
            step: self.steps_done,
            loss,
            applied: applied && !discard,
            scale,
            skipped,
            discarded: discard,
            lr: None,
        })
    }
}

/// The output `name` of a run's outputs.
fn named<'a>(outputs: &'a [(String, Held)], name: &str) -> Option<&'a Held> {
    outputs.iter().find(|(n, _)| n == name).map(|(_, v)| v)
}

/// The output `name` of a run's outputs, taken out of them.
fn take_named(outputs: &mut Vec<(String, Held)>, name: &str) -> Option<Held> {
    let at = outputs.iter().position(|(n, _)| n == name)?;
    Some(outputs.swap_remove(at).1)
}

/// Whether the run's `applied` output (`value`), when it has one, says the update applied.
pub(crate) fn applied_flag(value: Option<&Held>) -> Result<Option<bool>, TrainError> {
    Ok(match value {
        Some(v) => Some(v.read_host(
            APPLIED,
            |t| matches!(t, Tensor::Bool(a) if a.iter().next() == Some(&true)),
        )?),
        None => None,
    })
}

pub(crate) fn scalar_i64(t: &Tensor) -> Option<i64> {
    match t {
        Tensor::I64(a) if a.len() == 1 => a.iter().next().copied(),
        _ => None,
    }
}

pub(crate) fn scalar_f32(t: Option<&Tensor>) -> Option<f32> {
    match t? {
        Tensor::F32(a) if a.len() == 1 => a.iter().next().copied(),
        _ => None,
    }
}

fn decl(ty: Option<&crate::proto::TypeProto>) -> InputDecl {
    use crate::proto::tensor_shape_proto::dimension::Value as Dim;
    match ty.and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => InputDecl {
            elem_type: t.elem_type(),
            dims: t
                .shape
                .as_ref()
                .map(|s| {
                    s.dim
                        .iter()
                        .map(|d| match d.value {
                            Some(Dim::DimValue(v)) => Some(v),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default(),
        },
        _ => InputDecl {
            elem_type: 0,
            dims: Vec::new(),
        },
    }
}

/// The zeros a state that starts at zeros (`"init": "zeros"`) holds first: of its graph
/// input's declared element type and static shape, made once (zeroed memory, which the
/// system maps lazily: pages untouched until written cost no resident memory).
pub fn zeros_of_input(graph: &crate::proto::GraphProto, name: &str) -> Result<Tensor, TrainError> {
    use crate::proto::tensor_proto::DataType as D;
    let bad = |what: String| TrainError::Model(format!("state '{name}' starts at zeros: {what}"));
    let input = graph
        .input
        .iter()
        .find(|i| i.name() == name)
        .ok_or_else(|| bad("it is not a graph input".into()))?;
    let (elem_type, dims) = input
        .r#type
        .as_ref()
        .and_then(crate::state::static_tensor_type)
        .ok_or_else(|| bad("its declared type is not a tensor of static shape".into()))?;
    let shape = ndarray::IxDyn(&dims.iter().map(|d| *d as usize).collect::<Vec<_>>());
    Ok(match D::try_from(elem_type) {
        Ok(D::Float) => Tensor::F32(ndarray::ArrayD::zeros(shape)),
        Ok(D::Double) => Tensor::F64(ndarray::ArrayD::zeros(shape)),
        Ok(D::Int64) => Tensor::I64(ndarray::ArrayD::zeros(shape)),
        Ok(D::Int32) => Tensor::I32(ndarray::ArrayD::zeros(shape)),
        Ok(D::Bool) => Tensor::Bool(ndarray::ArrayD::from_elem(shape, false)),
        _ => {
            return Err(bad(format!(
                "element type {} is not supported on the host",
                crate::ir::print::elem_type_name(elem_type)
            )))
        }
    })
}

/// Micro-step `i` takes samples `[i*B, (i+1)*B)` of the data, wrapping around.
pub fn micro_batch(
    data: &BTreeMap<String, Tensor>,
    samples: usize,
    batch: usize,
    step: u64,
) -> BTreeMap<String, Tensor> {
    let rows = micro_batch_rows(samples, batch, step);
    data.iter()
        .map(|(k, v)| (k.clone(), v.rows(&rows)))
        .collect()
}

/// The data rows micro-step `step` takes (see [`micro_batch`]), in order.
pub fn micro_batch_rows(samples: usize, batch: usize, step: u64) -> Vec<usize> {
    crate::sample_order::SampleOrder::InOrder.rows(samples, batch, step)
}

/// `model` with its draws seeded as session `role` of rank `rank` of a run seeded `seed`
/// ([`draw_seed`]); the model itself when that changes nothing.
fn seeded_draws(
    model: &ModelProto,
    seed: Option<u64>,
    rank: usize,
    role: Session,
) -> Cow<'_, ModelProto> {
    match draw_seed::would_seed(model, seed, role) {
        true => {
            let mut model = model.clone();
            draw_seed::seed_draws(&mut model, seed, rank, role);
            Cow::Owned(model)
        }
        false => Cow::Borrowed(model),
    }
}

/// What [`open_engine`] fused, summed over the sessions.
#[derive(Default)]
struct FusedCounts {
    updates: usize,
    grouped: usize,
    products: usize,
    apply_products: usize,
}

/// A session of `kind` for `model`, prepared for the engine first: tract gets the ops it
/// lacks lowered in memory (`lower-for-tract`), so one step file serves both engines; ONNX
/// Runtime on the CPU gets the fused kernels (`fuse`), and with `fuse.in_place` the plan of
/// its in-place updates.
fn open_engine(
    kind: EngineKind,
    model: &ModelProto,
    options: &SessionOptions,
    manifest: &Manifest,
    fused: &mut FusedCounts,
    fuse: crate::passes::fuse::FuseOptions,
) -> Result<Engine, TrainError> {
    if kind.resolve().0 == EngineKind::Tract {
        let prepared = crate::passes::lower_for_tract::prepare(model).map_err(|e| {
            TrainError::Engine(EngineError::Tract {
                context: "lowering the ops tract lacks".into(),
                message: e.to_string(),
            })
        })?;
        return Ok(Engine::new(kind, &prepared, options)?);
    }
    if options.fused_kernels && options.device == crate::engine::ort::Device::Cpu {
        let fuse = crate::passes::fuse::FuseOptions {
            in_place: fuse.in_place && options.in_place_updates,
            ..fuse
        };
        let prepared = crate::passes::fuse::prepare(model, manifest, fuse).map_err(|e| {
            TrainError::Engine(EngineError::Ort {
                context: "fusing the optimizer".into(),
                message: e.to_string(),
            })
        })?;
        fused.updates += prepared.fused;
        fused.grouped += prepared.grouped;
        fused.products += prepared.products;
        fused.apply_products += prepared.apply_products;
        let mut engine = with_host_scalars(kind, &prepared.model, options)?;
        engine.set_in_place(prepared.in_place.pairs, prepared.in_place.keep_input);
        if let Some(updates) = prepared.host_updates {
            engine.set_host_updates(updates);
        }
        return Ok(engine);
    }
    with_host_scalars(kind, model, options)
}

/// An ONNX Runtime session of `model`, its scalar nodes the host can compute split off
/// and given to the host (`engine::host_scalars`) when `options` allow.
fn with_host_scalars(
    kind: EngineKind,
    model: &ModelProto,
    options: &SessionOptions,
) -> Result<Engine, TrainError> {
    let split = match options.host_scalars {
        true => crate::engine::host_scalars::split_off(model),
        false => None,
    };
    let Some((model, scalars)) = split else {
        dump_session(model);
        return Ok(Engine::new(kind, model, options)?);
    };
    dump_session(&model);
    let mut engine = Engine::new(kind, &model, options)?;
    engine.set_host_scalars(scalars);
    Ok(engine)
}

/// With `ONNX_GA_DUMP_SESSIONS=DIR` set, writes each session's model as ONNX Runtime gets
/// it (specialised, fused: what no file holds) to `DIR/session<N>.onnx`, numbered in the
/// order opened (split: window start, accumulate, apply). For profiling; errors ignored.
fn dump_session(model: &ModelProto) {
    if let Some(dir) = std::env::var_os("ONNX_GA_DUMP_SESSIONS") {
        use prost::Message;
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let _ = std::fs::write(
            std::path::Path::new(&dir).join(format!("session{n}.onnx")),
            model.encode_to_vec(),
        );
    }
}

/// Replaces the accumulators `names` of `state` (the last window's sums, which count as
/// zero: [`zero_after_apply`]) with zeros. Fresh ones, not written in place: a value a run
/// returned may share its buffer with another (ONNX Runtime may alias an `Identity`), and
/// this runs only when an apply follows an apply (a flush, K = 1).
fn zero_stale_sums(
    state: &mut BTreeMap<String, Held>,
    names: &BTreeSet<String>,
) -> Result<(), TrainError> {
    for name in names {
        let Some(held) = state.get_mut(name) else {
            continue;
        };
        let mut zeros = held.to_host(name)?;
        if !zero_after_apply::zero_fill(&mut zeros) {
            return Err(TrainError::Model(format!(
                "accumulator '{name}' is not a float tensor"
            )));
        }
        *held = Held::Host(zeros);
    }
    Ok(())
}

/// Adds every kept product (`engine::deferred_products`) into its accumulator's held
/// value, which then holds the sum, on the host; forgets them. Before the apply
/// (`at_apply`), those the apply's own updates add are left to them.
fn add_kept_products(
    deferred: &DeferredProducts,
    state: &mut BTreeMap<String, Held>,
    at_apply: bool,
) -> Result<(), TrainError> {
    for name in deferred.kept_names() {
        if at_apply && deferred.summed_at_apply(&name) {
            continue;
        }
        let Some(held) = state.get_mut(&name) else {
            continue;
        };
        let mut whole = held.to_host(&name)?;
        let Some(values) = (match &mut whole {
            Tensor::F32(values) => values.as_slice_mut(),
            _ => None,
        }) else {
            return Err(TrainError::Model(format!(
                "accumulator '{name}' is not a contiguous float32 tensor"
            )));
        };
        deferred.add_kept(&name, values, true);
        *held = Held::Host(whole);
    }
    Ok(())
}

/// Runs `engine` once on `host` inputs and the trainer's `state`, the states the session
/// updates in place given apart (their outputs are not returned: `state` holds their next
/// values after the run).
fn run_on_state(
    engine: &mut Engine,
    host: &[(&str, &Tensor)],
    state: &mut BTreeMap<String, Held>,
    in_place: &[bool],
) -> Result<Vec<(String, Held)>, EngineError> {
    if engine.in_place().is_empty() {
        let held: Vec<(&str, &Held)> = state.iter().map(|(k, v)| (k.as_str(), v)).collect();
        return engine.run_held(host, &held);
    }
    // `in_place` follows the state's keys (a state added since: looked up by name).
    let known = in_place.len() == state.len();
    let mut held = Vec::with_capacity(state.len());
    let mut updated = Vec::with_capacity(state.len());
    for (i, (name, value)) in state.iter_mut().enumerate() {
        // Float state still on the host (parameters before their first update, loaded
        // state) becomes ONNX Runtime's once: a binding would copy lent memory every run.
        if let Held::Host(t @ Tensor::F32(_)) = value {
            let allocated = crate::engine::ort::to_ort_allocated(name, t)?;
            *value = Held::Ort(allocated);
        }
        match (known && in_place[i]) || (!known && engine.updates_in_place(name)) {
            true => updated.push((name.as_str(), value)),
            false => held.push((name.as_str(), &*value)),
        }
    }
    engine.run_held_in_place(host, &held, &mut updated)
}
