//! One rank's side of a data-parallel window: the local micro-steps, the one all-reduce,
//! the apply-only run (see [`crate::train::distributed`]).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use super::{gather_u64, Collective};
use crate::data::Tensor;
use crate::engine::Held;
use crate::state::Manifest;
use crate::state::Role;
use crate::train::{Runner, StepMetrics, TrainError, Trainer};

/// A state summed over the ranks at a window's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReducedState {
    pub input: String,
    pub role: Role,
    pub elements: usize,
}

/// What the window's all-reduce carries, and where.
#[derive(Clone, Debug)]
pub struct ReducePlan {
    /// The states that accumulate within a window, in manifest order.
    pub reduced: Vec<ReducedState>,
    /// The states every rank holds identically (parameters, moments, counters, running
    /// statistics, the loss scale), checked by digest.
    pub replicated: Vec<String>,
}

/// The window buffer: slot 0 counts the ranks whose accumulators hold a NaN or an
/// infinity (loss scaling then skips the window on every rank: the sum is non-finite too,
/// and the flag says so without relying on it); then one failure slot per rank (1: an
/// input error, 2: another failure); then each micro-step's loss and discarded flag; then
/// the states, flattened in plan order.
const NONFINITE: usize = 0;
const FAILURES: usize = 1;

impl ReducePlan {
    /// Floats one window's all-reduce moves per rank, for a window of `micro_steps` on
    /// `ranks` ranks.
    pub fn floats(&self, micro_steps: usize, ranks: usize) -> usize {
        FAILURES + ranks + 2 * micro_steps + self.state_floats()
    }

    /// Floats of the states alone: one parameter-sized sum and the counters.
    pub fn state_floats(&self) -> usize {
        self.reduced.iter().map(|r| r.elements).sum()
    }
}

pub(crate) struct Replica {
    pub collective: Box<dyn Collective>,
    pub plan: ReducePlan,
    /// Seconds spent in the window all-reduce (packing included), for benchmarks.
    pub reduce_seconds: f64,
    pub windows: u64,
}

impl Replica {
    pub fn new(
        collective: Box<dyn Collective>,
        manifest: &Manifest,
        initial: &BTreeMap<String, Tensor>,
        accumulating: &BTreeMap<String, Role>,
        unchanged_on_accumulate: &BTreeSet<String>,
    ) -> Result<Replica, TrainError> {
        let mut reduced = Vec::new();
        let mut replicated = Vec::new();
        for e in &manifest.state {
            // By role: what a window sums. The graph's structure (`accumulating`) must agree.
            let sums = match e.role {
                Role::Accumulator | Role::WeightSum | Role::MicroStep => true,
                Role::BnStat => e.param.as_deref().is_some_and(|p| p != e.input),
                _ => false,
            };
            if sums != accumulating.contains_key(&e.input) {
                return Err(TrainError::Model(format!(
                    "data-parallel training: state '{}' has role {:?} but the step {} it within a window",
                    e.input,
                    e.role,
                    if sums { "does not accumulate" } else { "accumulates" }
                )));
            }
            if sums {
                let t = &initial[&e.input];
                if !matches!(t, Tensor::F32(_) | Tensor::I64(_)) {
                    return Err(TrainError::Model(format!(
                        "data-parallel training: state '{}' is {}; the window's sums are float32 (counters int64)",
                        e.input,
                        crate::ir::print::elem_type_name(t.elem_type())
                    )));
                }
                reduced.push(ReducedState {
                    input: e.input.clone(),
                    role: e.role,
                    elements: t.shape().iter().product(),
                });
            } else {
                if !unchanged_on_accumulate.contains(&e.input) && e.role != Role::Frozen {
                    return Err(TrainError::Model(format!(
                        "data-parallel training: state '{}' changes at every micro-step",
                        e.input
                    )));
                }
                replicated.push(e.input.clone());
            }
        }
        Ok(Replica {
            collective,
            plan: ReducePlan {
                reduced,
                replicated,
            },
            reduce_seconds: 0.0,
            windows: 0,
        })
    }
}

fn replica(t: &Trainer) -> Result<&Replica, TrainError> {
    t.replica.as_ref().ok_or_else(|| {
        TrainError::Model("not a data-parallel trainer (Trainer::with_collective)".into())
    })
}

impl Trainer {
    /// This rank and the number of ranks (0 and 1 for a trainer that is not data parallel).
    pub fn rank_and_size(&self) -> (usize, usize) {
        match &self.replica {
            Some(r) => (r.collective.rank(), r.collective.size()),
            None => (0, 1),
        }
    }

    /// What the window all-reduce carries (data-parallel trainers).
    pub fn reduce_plan(&self) -> Option<&ReducePlan> {
        self.replica.as_ref().map(|r| &r.plan)
    }

    /// Seconds spent in window all-reduces so far and the windows reduced.
    pub fn reduce_time(&self) -> Option<(f64, u64)> {
        self.replica.as_ref().map(|r| (r.reduce_seconds, r.windows))
    }

    /// K, the micro-steps per window (the step's, or what `set_accum_steps` set).
    pub fn accum_steps(&self) -> Option<i64> {
        match &self.runner {
            Runner::Split { window_size, .. } => Some(*window_size),
            Runner::Whole(_) => None,
        }
    }

    /// Makes the state this trainer holds (the step's initial values or a loaded state
    /// file, the same on every rank) the start of a data-parallel run: the states a window
    /// sums stay on rank 0 and are zeroed elsewhere, so that their sum over the ranks is the
    /// one-process state (a state file saved mid-window resumes on any number of ranks).
    /// Then checks that every rank holds the same replicated state. Returns the micro-steps
    /// the current window already holds.
    pub fn start_replicas(&mut self, what: &str) -> Result<i64, TrainError> {
        let rank = replica(self)?.collective.rank();
        let micro_step = self.micro_step_mirror();
        if rank != 0 {
            let reduced = replica(self)?.plan.reduced.clone();
            // Only the zeros are made: the state is not copied for it.
            let state = self.state()?;
            let zeros: Vec<(String, Tensor)> = reduced
                .iter()
                .map(|r| {
                    let zero = match &state[&r.input] {
                        Tensor::F32(a) => Tensor::F32(ndarray::ArrayD::zeros(a.raw_dim())),
                        Tensor::I64(a) => Tensor::I64(ndarray::ArrayD::zeros(a.raw_dim())),
                        other => other.clone(),
                    };
                    (r.input.clone(), zero)
                })
                .collect();
            for (input, zero) in zeros {
                self.replace_state(&input, zero);
            }
            self.set_micro_step_mirror(0);
        }
        // Ranks need not all have started equally: a peer still loading must not be told it
        // diverged, so the digests are exchanged only now, by every rank.
        self.check_replicas(what)?;
        Ok(micro_step)
    }

    /// Checks that every rank holds the same parameters, moments, counters and running
    /// statistics (a digest per rank, exchanged by all-reduce); `what` names the moment
    /// ("after --init-state", "at the end").
    pub fn check_replicas(&self, what: &str) -> Result<(), TrainError> {
        let r = replica(self)?;
        let state = self.state()?;
        let mut h = Fnv::new();
        for name in &r.plan.replicated {
            h.eat(name.as_bytes());
            h.tensor(&state[name]);
        }
        let digests = gather_u64(r.collective.as_ref(), h.0)?;
        if digests.iter().any(|d| *d != digests[0]) {
            let list = digests
                .iter()
                .enumerate()
                .map(|(i, d)| format!("rank {i}: {d:016x}"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(TrainError::Diverged(format!(
                "{what}: the ranks hold different parameters ({list}); every rank must train the same step file from the same state"
            )));
        }
        Ok(())
    }

    /// Runs the global micro-steps `steps` (0-based, within one window) as one rank: the
    /// ones with `i % size == rank` locally with the accumulate specialisation, on
    /// `batch(i)`; then one all-reduce; then, when `apply`, the apply-only specialisation on
    /// every rank. Without `apply` (a run ending mid-window) the window's sums so far end on
    /// rank 0 (the state it saves is the one-process state) and are zeroed on the others.
    ///
    /// Returns the metrics of every micro-step of the range (global loss, `applied` on the
    /// last one), the same on every rank. A rank that fails (its data, a non-finite loss
    /// under [`crate::train::OnNonFinite::Stop`], its engine) stops its micro-steps, still
    /// joins the all-reduce with its failure flag, and returns its error; every other rank
    /// returns [`TrainError::PeerFailed`]. No rank applies such a window.
    pub fn run_window(
        &mut self,
        steps: Range<u64>,
        apply: bool,
        mut batch: impl FnMut(u64) -> Result<BTreeMap<String, Tensor>, TrainError>,
    ) -> Result<Vec<StepMetrics>, TrainError> {
        let (rank, size) = {
            let r = replica(self)?;
            (r.collective.rank(), r.collective.size())
        };
        let n = (steps.end - steps.start) as usize;
        let plan = replica(self)?.plan.clone();
        let losses_at = FAILURES + size;
        let discarded_at = losses_at + n;
        let states_at = discarded_at + n;
        let mut buf = vec![0f32; plan.floats(n, size)];
        let mut failure: Option<TrainError> = None;
        let mut local = 0u64;
        for i in steps.clone() {
            if i % size as u64 != rank as u64 {
                continue;
            }
            let result = batch(i).and_then(|b| self.step_inner(&b, false));
            match result {
                Ok(m) => {
                    local += 1;
                    let j = (i - steps.start) as usize;
                    buf[losses_at + j] = m.loss;
                    buf[discarded_at + j] = m.discarded as u8 as f32;
                }
                Err(e) => {
                    // The error names the global micro-step, as one process would.
                    failure = Some(match e {
                        TrainError::NonFinite { loss, .. } => {
                            TrainError::NonFinite { step: i + 1, loss }
                        }
                        other => other,
                    });
                    break;
                }
            }
        }
        if let Some(e) = &failure {
            buf[FAILURES + rank] = if is_input_error(e) { 1.0 } else { 2.0 };
        }

        let started = std::time::Instant::now();
        // Pack the window's sums after the header and the per-micro-step slots.
        let mut at = states_at;
        let mut nonfinite = false;
        {
            let state = self.state()?;
            for r in &plan.reduced {
                let dst = &mut buf[at..at + r.elements];
                match &state[&r.input] {
                    Tensor::F32(a) => {
                        for (d, v) in dst.iter_mut().zip(a.iter()) {
                            *d = *v;
                        }
                        if r.role == Role::Accumulator {
                            nonfinite |= a.iter().any(|v| !v.is_finite());
                        }
                    }
                    // Counters: small integers, exact in float32.
                    Tensor::I64(a) => {
                        for (d, v) in dst.iter_mut().zip(a.iter()) {
                            *d = *v as f32;
                        }
                    }
                    _ => {}
                }
                at += r.elements;
            }
        }
        buf[NONFINITE] = nonfinite as u8 as f32;
        replica(self)?.collective.all_reduce_sum_f32(&mut buf)?;
        if let Some(r) = self.replica.as_mut() {
            r.reduce_seconds += started.elapsed().as_secs_f64();
            r.windows += 1;
        }

        let failures = &buf[FAILURES..FAILURES + size];
        if failures.iter().any(|f| *f != 0.0) {
            if let Some(e) = failure {
                return Err(e);
            }
            let failed: Vec<String> = (0..size)
                .filter(|r| failures[*r] != 0.0)
                .map(|r| r.to_string())
                .collect();
            return Err(TrainError::PeerFailed {
                rank,
                size,
                failed: failed.join(", "),
                first: steps.start + 1,
                last: steps.end,
                input_error: failures.contains(&1.0),
            });
        }

        // Unpack: every rank takes the sums when the window applies; otherwise rank 0 keeps
        // them and the others restart from zero (the sum over ranks stays the window's).
        let keep = apply || rank == 0;
        let mut at = states_at;
        // The window's micro-step count, where the step keeps one.
        let mut count: Option<i64> = None;
        {
            // The reduced states only, made from the host state before any is replaced (no
            // copy of the whole state).
            let state = self.state()?;
            let mut values = Vec::with_capacity(plan.reduced.len());
            for r in &plan.reduced {
                let src = &buf[at..at + r.elements];
                let value = match &state[&r.input] {
                    Tensor::F32(a) => {
                        let mut a = a.clone();
                        for (d, v) in a.iter_mut().zip(src) {
                            *d = if keep { *v } else { 0.0 };
                        }
                        Tensor::F32(a)
                    }
                    Tensor::I64(a) => {
                        let mut a = a.clone();
                        for (d, v) in a.iter_mut().zip(src) {
                            *d = if keep { v.round() as i64 } else { 0 };
                        }
                        if r.role == Role::MicroStep {
                            count = Some(a.iter().next().copied().unwrap_or(0));
                        }
                        Tensor::I64(a)
                    }
                    other => other.clone(),
                };
                values.push((r.input.clone(), value));
                at += r.elements;
            }
            for (input, value) in values {
                self.replace_state(&input, value);
            }
        }
        self.set_micro_step_mirror(if keep { count.unwrap_or(0) } else { 0 });
        if apply && buf[NONFINITE] > 0.0 {
            // A rank saw non-finite gradients: the sum carries them (NaN and inf survive a
            // sum), but the flag decides, so every rank skips even if the sum came out finite.
            if let Some(r) = plan.reduced.iter().find(|r| r.role == Role::Accumulator) {
                if let Ok(Tensor::F32(a)) = self.state[&r.input].to_host(&r.input) {
                    if a.iter().all(|v| v.is_finite()) {
                        let mut a = a;
                        if let Some(v) = a.iter_mut().next() {
                            *v = f32::NAN;
                        }
                        self.replace_state(&r.input, Tensor::F32(a));
                    }
                }
            }
        }

        // Every micro-step of the window discarded, on every rank (`OnNonFinite::Skip`):
        // there is no gradient to apply, and the apply would divide the empty sums by a
        // count of zero (NaN in every parameter). The window ends without an update; the
        // accumulators and the counter are zero already.
        let apply = apply && count != Some(0);
        let scale_before = self.loss_scale()?;
        let (applied, skipped) = match apply {
            true => {
                let applied = self.run_apply_only()?;
                (applied, !applied && self.graph_skips)
            }
            false => (false, false),
        };
        let scale_after = self.loss_scale()?;
        self.steps_done += n as u64 - local;
        Ok((0..n)
            .map(|j| {
                let last = j + 1 == n;
                StepMetrics {
                    step: steps.start + j as u64 + 1,
                    loss: buf[losses_at + j],
                    applied: last && applied,
                    scale: if last { scale_after } else { scale_before },
                    skipped: last && skipped,
                    discarded: buf[discarded_at + j] > 0.0,
                    lr: None,
                }
            })
            .collect())
    }

    /// Runs the apply-only specialisation on the state (the window's sums reduced); returns
    /// whether the update applied (loss scaling may skip it).
    fn run_apply_only(&mut self) -> Result<bool, TrainError> {
        let mut host: Vec<(&str, &Tensor)> =
            self.controls.iter().map(|(k, v)| (k.as_str(), v)).collect();
        // The run applies whatever the window's count: a window the run ends early
        // (`--flush`), or one short of K after discarded micro-steps, applies as a flushed
        // one. Fed as a flush, so that the `applied` flag (`count >= K or flush`, narrowed
        // by loss scaling) says what the run did.
        if let Some(apply) = &self.manifest.apply {
            host.push((apply.flush.as_str(), &self.flags[1]));
        }
        let held: Vec<(&str, &Held)> = self.state.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let (outputs, unchanged) = match &mut self.runner {
            Runner::Split {
                apply,
                unchanged_on_apply,
                ..
            } => (apply.run_held(&host, &held)?, unchanged_on_apply.clone()),
            Runner::Whole(_) => {
                return Err(TrainError::Model(
                    "data-parallel training runs the step split".into(),
                ))
            }
        };
        drop(held);
        let mut outputs: BTreeMap<String, Held> = outputs.into_iter().collect();
        let applied =
            crate::train::applied_flag(outputs.get(crate::state::APPLIED_OUTPUT))?.unwrap_or(true);
        for entry in self.manifest.state.clone() {
            match outputs.remove(&entry.output) {
                Some(next) => {
                    self.state.insert(entry.input.clone(), next);
                }
                None if unchanged.contains(&entry.input) => {}
                None => {
                    return Err(TrainError::Model(format!(
                        "the apply-only run did not produce state output '{}'",
                        entry.output
                    )))
                }
            }
        }
        self.host_state = Default::default();
        self.set_micro_step_mirror(0);
        Ok(applied)
    }

    fn loss_scale(&self) -> Result<Option<f32>, TrainError> {
        match self
            .manifest
            .state
            .iter()
            .find(|e| e.role == Role::LossScale)
        {
            Some(e) => Ok(crate::train::scalar_f32(Some(
                &self.state[&e.input].to_host(&e.input)?,
            ))),
            None => Ok(None),
        }
    }

    fn replace_state(&mut self, name: &str, value: Tensor) {
        self.state.insert(name.to_string(), Held::Host(value));
        self.host_state = Default::default();
    }

    fn micro_step_mirror(&self) -> i64 {
        match &self.runner {
            Runner::Split { micro_step, .. } => *micro_step,
            Runner::Whole(_) => 0,
        }
    }

    fn set_micro_step_mirror(&mut self, value: i64) {
        if let Runner::Split { micro_step, .. } = &mut self.runner {
            *micro_step = value;
        }
    }
}

/// Errors of the input (exit code 2 in the CLI), as opposed to failures of the machinery.
pub fn is_input_error(e: &TrainError) -> bool {
    matches!(
        e,
        TrainError::BadData { .. }
            | TrainError::BadState { .. }
            | TrainError::Step(_)
            | TrainError::Data(_)
            | TrainError::NonFinite { .. }
            | TrainError::Diverged(_)
            | TrainError::PeerFailed {
                input_error: true,
                ..
            }
    )
}

/// FNV-1a, 64 bits: a digest of the replicated state (equality, not security).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn eat(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn tensor(&mut self, t: &Tensor) {
        for d in t.shape() {
            self.eat(&(*d as u64).to_le_bytes());
        }
        match t {
            Tensor::F32(a) => a.iter().for_each(|v| self.eat(&v.to_bits().to_le_bytes())),
            Tensor::F64(a) => a.iter().for_each(|v| self.eat(&v.to_bits().to_le_bytes())),
            Tensor::I64(a) => a.iter().for_each(|v| self.eat(&v.to_le_bytes())),
            Tensor::I32(a) => a.iter().for_each(|v| self.eat(&v.to_le_bytes())),
            Tensor::Bool(a) => a.iter().for_each(|v| self.eat(&[*v as u8])),
        }
    }
}
