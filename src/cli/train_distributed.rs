//! `train --distributed mpi`: one rank of a data-parallel job (see `onnx_ga::distributed`).
//!
//! The loop runs windows instead of micro-steps: each window's global micro-steps are spread
//! over the ranks and end in one all-reduce ([`Trainer::run_window`]). Every rank checks its
//! inputs; any rank's failure, at setup or in a window, stops every rank (no rank waits
//! forever in a collective its peer never joins). Rank 0 alone prints and writes the state,
//! its progress record and the metrics, with the helpers of the one-process `train`.

use std::rc::Rc;

use onnx_ga::data::Tensor;
use onnx_ga::dataset::Dataset;
use onnx_ga::distributed::{self, Collective};
use onnx_ga::train::{TrainError, Trainer};

use super::{
    check_plot_output, check_train_outputs, save_checkpoint, take_recorded_eval_model, train_plot,
    Failure, MetricsFile, NonFiniteStep, TrainArgs, UsageError,
};

/// What one rank set up before training.
struct Setup {
    trainer: Trainer,
    /// The learning-rate schedule and K ([`super::lr_schedule`]).
    schedule: Option<(onnx_ga::lr_schedule::LrSchedule, u64)>,
    data: Dataset,
    samples: usize,
    start_step: u64,
    /// `--eval-data`: on rank 0 only (every rank's parameters are equal after a window).
    validation: Option<super::validation::Validation>,
}

pub(super) fn train(args: TrainArgs) -> Result<(), Failure> {
    let backend = args.distributed.clone().unwrap_or_default();
    let collective: Rc<dyn Collective> = match distributed::open(&backend) {
        Ok(c) => Rc::from(c),
        Err(e) => return Err(UsageError(e.to_string()).into()),
    };
    let result = run_job(args, Rc::clone(&collective));
    // The error is printed while MPI is still up: once a rank has finalised and exited
    // with an error, mpirun ends the job and may kill a peer before it says why it stopped.
    // Finalising waits for every rank, so each rank's message is out before any exits.
    let result = result.map_err(super::Failure::report);
    drop(collective);
    result
}

/// The job on this rank, from the agreed set-up to the state rank 0 writes.
fn run_job(args: TrainArgs, collective: Rc<dyn Collective>) -> Result<(), Failure> {
    let (rank, size) = (collective.rank(), collective.size());
    let lead = rank == 0;
    // Every rank sets up, then all agree: a rank whose files are bad (another machine,
    // another copy) must not leave the others waiting in the first window.
    let mut args = args;
    let setup = set_up(&mut args, &collective);
    let codes = distributed::gather_u64(
        collective.as_ref(),
        match &setup {
            Ok(_) => 0,
            Err(f) => u64::from(f.code),
        },
    )
    .map_err(collective_failure)?;
    let mut setup = match setup {
        Err(f) => return Err(ranked(rank, size, f)),
        Ok(s) if codes.iter().all(|c| *c == 0) => s,
        Ok(_) => {
            return Err(peer_failure(
                rank,
                size,
                &codes,
                "setting up (before training)",
            ));
        }
    };
    let what = match &args.init_state {
        Some(p) => format!("after --init-state {}", p.display()),
        None => "at the start".to_string(),
    };
    let trainer = &mut setup.trainer;
    let mut position = trainer
        .start_replicas(&what)
        .map_err(|e| ranked(rank, size, train_failure(e)))?;
    let k = trainer.accum_steps().unwrap_or(1).max(1) as u64;
    let plan_floats = trainer
        .reduce_plan()
        .map(|p| p.floats(k as usize, size))
        .unwrap_or(0);
    if lead {
        eprintln!(
            "distributed: {size} ranks over {}; K = {k} micro-batches per optimizer step, {} per rank; one all-reduce of {} bytes per window",
            collective.name(),
            k / size as u64,
            plan_floats * 4
        );
    }

    let mut metrics_out = match (&args.metrics, lead) {
        (Some(path), true) => Some(MetricsFile::open(path, setup.start_step)?),
        _ => None,
    };
    // Rank 0 shows the job's progress (the global loss of every micro-step), as one-process
    // `train` does; the other ranks stay silent.
    let display = match lead {
        true => onnx_ga::progress::Display::for_stderr(args.quiet),
        false => onnx_ga::progress::Display::for_stderr(true),
    };
    let mut progress = onnx_ga::progress::Progress::new(display, args.steps, args.micro_batch);
    progress.start_clock();
    let started = std::time::Instant::now();
    // Where the run ends: after its --steps, or earlier by --patience.
    let mut end = setup.start_step + args.steps;
    let mut i = setup.start_step;
    let mut windows = 0u64;
    let mut saved_at: Option<u64> = None;
    while i < end {
        // The window the state is in (resumed mid-window: what it still lacks).
        let len = (k - (position as u64).min(k - 1)).min(end - i);
        let full = position as u64 + len >= k;
        let apply = full || (args.flush && i + len == end);
        let (data, samples, batch) = (&setup.data, setup.samples, args.micro_batch);
        let order = args.order();
        // Every micro-step of the run is in one window (resumed mid-window: its rest).
        let lr = match &setup.schedule {
            Some((schedule, k)) => {
                let lr = schedule.at(i / k);
                trainer
                    .set_learning_rate(lr)
                    .map_err(|e| ranked(rank, size, train_failure(e)))?;
                Some(lr)
            }
            None => None,
        };
        let result = trainer.run_window(i..i + len, apply, |g| {
            Ok(data.micro_batch(order, samples, batch, g)?)
        });
        let mut metrics = match result {
            Ok(m) => m,
            Err(e) => {
                progress.abandon();
                return Err(window_failure(
                    &args,
                    trainer,
                    &setup.data,
                    setup.samples,
                    e,
                    rank,
                    size,
                    saved_at,
                ));
            }
        };
        position = 0;
        i += len;
        for m in metrics.iter_mut() {
            m.lr = lr;
            if m.applied {
                windows += 1;
            }
            if let Some(out) = &mut metrics_out {
                out.line(&serde_json::to_string(m)?)?;
            }
            progress.record(m);
        }
        // Rank 0 evaluates; every rank knows when (the same windows), and waits to hear
        // that it went well.
        let applied = metrics.last().is_some_and(|m| m.applied);
        if super::validation::due(&args, applied, windows) {
            let place = (&collective, rank, size);
            validate_on_lead(
                setup.validation.as_mut(),
                trainer,
                i,
                metrics_out.as_mut(),
                &progress,
                place,
            )?;
            // --patience: rank 0 decides, every rank stops with it.
            if args.patience.is_some() {
                let exhausted = setup.validation.as_ref().is_some_and(|v| v.exhausted());
                let votes = distributed::gather_u64(collective.as_ref(), u64::from(exhausted))
                    .map_err(collective_failure)?;
                if votes.first().is_some_and(|v| *v != 0) {
                    if let Some(v) = &setup.validation {
                        progress.note(v.stop_note(i));
                    }
                    end = i;
                }
            }
        }
        if let (Some(every), Some(path)) = (args.save_every, &args.save_state) {
            if metrics.last().is_some_and(|m| m.applied) && windows.is_multiple_of(every) {
                let saved = match lead {
                    true => save_checkpoint(trainer, path, i, args.shuffle, metrics_out.as_mut()),
                    false => Ok(()),
                };
                agree_on(
                    &collective,
                    saved,
                    rank,
                    size,
                    "the checkpoint rank 0 writes",
                )?;
                saved_at = Some(i);
                progress.note(format!(
                    "checkpoint: {} after micro-step {i} ({windows} optimizer steps in this run)",
                    path.display()
                ));
                if lead {
                    train_plot(&args, &progress)?;
                }
            }
        }
    }
    // Before anything is saved: a state that differs between the ranks is no result.
    trainer
        .check_replicas("at the end")
        .map_err(|e| ranked(rank, size, train_failure(e)))?;
    if args.eval_data.is_some() {
        let place = (&collective, rank, size);
        validate_on_lead(
            setup.validation.as_mut(),
            trainer,
            end,
            metrics_out.as_mut(),
            &progress,
            place,
        )?;
        if let Some(n) = setup.validation.as_ref().and_then(|v| v.unwritten_best()) {
            progress.note(n);
        }
    }
    if let Some(path) = &args.save_state {
        if saved_at != Some(end) {
            let saved = match lead {
                true => save_checkpoint(trainer, path, end, args.shuffle, metrics_out.as_mut()),
                false => Ok(()),
            };
            agree_on(&collective, saved, rank, size, "the state rank 0 writes")?;
        }
    }
    if let Some(out) = &mut metrics_out {
        out.sync()?;
    }
    progress.finish();
    if let Some((seconds, reduced)) = trainer.reduce_time() {
        let wall = started.elapsed().as_secs_f64();
        progress.note(format!(
            "distributed: {size} ranks in {wall:.3} s; {reduced} all-reduces of {} bytes, {:.3} ms each ({:.1}% of the wall time)",
            plan_floats * 4,
            1e3 * seconds / reduced.max(1) as f64,
            100.0 * seconds / wall.max(1e-9)
        ));
    }
    if lead {
        train_plot(&args, &progress)?;
    }
    Ok(())
}

/// Everything `train` checks and loads before its first micro-step, on this rank.
fn set_up(args: &mut TrainArgs, collective: &Rc<dyn Collective>) -> Result<Setup, Failure> {
    let (rank, size) = (collective.rank(), collective.size());
    let lead = rank == 0;
    if args.micro_batch == 0 {
        return Err(UsageError("--micro-batch must be at least 1".into()).into());
    }
    if args.save_every == Some(0) {
        return Err(UsageError("--save-every 0: must be at least 1".into()).into());
    }
    if args.no_split {
        return Err(UsageError(
            "--distributed runs the step split (accumulate / apply-only); drop --no-split".into(),
        )
        .into());
    }
    let on_nonfinite = args.on_nonfinite;
    let (model, model_files) = super::load_step(&args.model)?;
    // Only rank 0 writes, so only its outputs are checked (the others may run where those
    // paths do not exist).
    if lead {
        take_recorded_eval_model(args, &model)?;
        check_train_outputs(args, &model_files)?;
        check_plot_output(args, &model_files)?;
        if let Some(path) = &args.save_state {
            onnx_ga::data::StateFormat::of(path)?;
        }
    }
    // K % R before anything runs: a window must split evenly over the ranks.
    let manifest = onnx_ga::state::Manifest::from_model(&model)
        .map_err(|e| anyhow::Error::new(e).context(format!("{}", args.model.display())))?;
    let k = match args.accum_steps {
        Some(k) => k,
        None => step_k(&model, &manifest).ok_or_else(|| {
            UsageError(format!(
                "{}: the step has no If apply region with an int64 K: data-parallel training needs one (rewrite with --apply if)",
                args.model.display()
            ))
        })?,
    };
    if k < 1 || !(k as usize).is_multiple_of(size) {
        return Err(UsageError(format!(
            "{}: K = {k} micro-batches per optimizer step{} cannot be spread evenly over {size} ranks (K % R must be 0): run on a divisor of {k} ranks, or pass --accum-steps with a multiple of {size}",
            args.model.display(),
            if args.accum_steps.is_some() { " (--accum-steps)" } else { " (the step's ga.accum_steps)" },
        ))
        .into());
    }
    let (device, requested) = crate::device_and_engine(&args.device, args.engine)?;
    let (engine, why) = requested.resolve();
    let threads_warning = super::check_threads(args.threads, engine)?;
    if lead {
        match requested {
            onnx_ga::engine::EngineKind::Auto => eprintln!("engine: {engine} ({why})"),
            _ => eprintln!("engine: {engine} on {device}"),
        }
        if let Some(warning) = threads_warning {
            eprintln!("{warning}");
        }
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
        split: true,
        // The trainer mixes its rank in: each rank draws its own masks.
        draw_seed: args.draw_seed,
    };
    let shared: Box<dyn Collective> = Box::new(collective.clone());
    let mut trainer = Trainer::with_collective(&model, &options, shared)
        .map_err(|e| crate::step_context(e, &args.model))?;
    // Not read again: its initial values live in the trainer's state now (as in `train`).
    let limits = onnx_ga::index_check::index_limits(&model, &trainer.manifest.data_inputs);
    let schedule = super::lr_schedule(args, &model, &trainer.manifest)?;
    if lead {
        if let Some(note) = super::draw_note(&model, args.draw_seed) {
            eprintln!("{note}");
        }
    }
    drop(model);
    trainer.set_on_nonfinite(on_nonfinite);
    crate::host_controls(&mut trainer, args.lr, args.accum_steps)?;
    let data = onnx_ga::dataset::Dataset::open(&args.data, &trainer.manifest.data_inputs)?;
    if let Some(note) = onnx_ga::data::ignored_note(&args.data, &data.ignored) {
        if lead {
            eprintln!("{note}");
        }
    }
    let data = data.dataset;
    if let Some(note) = super::held_data_note(&data, &args.data).filter(|_| lead) {
        eprintln!("{note}");
    }
    let samples = trainer.check_data(&data, &args.data)?;
    super::check_micro_batch(args.micro_batch, samples, &args.data)?;
    onnx_ga::index_check::check_data(&data, &limits)
        .map_err(|m| UsageError(format!("{}: {m}", args.data.display())))?;
    if let Some(path) = &args.init_state {
        super::load_initial_state(&mut trainer, path)?;
    }
    let (start_step, notes) = super::start_step(&trainer, args)?;
    for note in notes.iter().filter(|_| lead) {
        eprintln!("{note}");
    }
    let validation = match lead {
        true => super::validation::Validation::open(args, &trainer, &options, start_step, |n| {
            eprintln!("{n}")
        })?,
        false => None,
    };
    Ok(Setup {
        trainer,
        schedule,
        data,
        samples,
        start_step,
        validation,
    })
}

/// K as the step's initializer holds it.
fn step_k(model: &onnx_ga::proto::ModelProto, manifest: &onnx_ga::state::Manifest) -> Option<i64> {
    let name = &manifest.apply.as_ref()?.steps;
    let init = model
        .graph
        .as_ref()?
        .initializer
        .iter()
        .find(|t| t.name() == name)?;
    match Tensor::from_tensor_proto(init).ok()? {
        Tensor::I64(a) if a.len() == 1 => a.iter().next().copied(),
        _ => None,
    }
}

/// The validation after micro-step `step`: rank 0 (which holds `validation`) runs it, and
/// every rank hears whether it went well.
fn validate_on_lead(
    validation: Option<&mut super::validation::Validation>,
    trainer: &Trainer,
    step: u64,
    metrics: Option<&mut MetricsFile>,
    progress: &onnx_ga::progress::Progress,
    (collective, rank, size): (&Rc<dyn Collective>, usize, usize),
) -> Result<(), Failure> {
    let evaluated = match validation {
        Some(v) => v.run(trainer, step, metrics, |n| progress.note(n)),
        None => Ok(()),
    };
    agree_on(
        collective,
        evaluated,
        rank,
        size,
        "the validation rank 0 runs",
    )
}

/// Rank 0's result of writing a file, agreed on by every rank: when it failed, every rank
/// stops (rank 0 with its error).
fn agree_on(
    collective: &Rc<dyn Collective>,
    result: Result<(), Failure>,
    rank: usize,
    size: usize,
    what: &str,
) -> Result<(), Failure> {
    let code = match &result {
        Ok(()) => 0,
        Err(f) => u64::from(f.code),
    };
    let codes = distributed::gather_u64(collective.as_ref(), code).map_err(collective_failure)?;
    result.map_err(|f| ranked(rank, size, f))?;
    match codes.iter().all(|c| *c == 0) {
        true => Ok(()),
        false => Err(peer_failure(rank, size, &codes, what)),
    }
}

/// This rank's error, prefixed with its rank so that a job's interleaved messages tell
/// which process said what.
fn ranked(rank: usize, size: usize, f: Failure) -> Failure {
    if size == 1 {
        return f;
    }
    Failure {
        code: f.code,
        error: f.error.context(format!("rank {rank} of {size}")),
    }
}

/// The error of a rank whose peers failed: the exit code of theirs (2 if any was an input
/// error).
fn peer_failure(rank: usize, size: usize, codes: &[u64], what: &str) -> Failure {
    let failed: Vec<String> = codes
        .iter()
        .enumerate()
        .filter(|(_, c)| **c != 0)
        .map(|(r, _)| r.to_string())
        .collect();
    Failure {
        code: if codes.contains(&2) { 2 } else { 1 },
        error: anyhow::anyhow!(
            "rank {rank} of {size}: stopped: rank(s) {} failed {what} (see their errors)",
            failed.join(", ")
        ),
    }
}

fn collective_failure(e: distributed::CollectiveError) -> Failure {
    Failure {
        code: 1,
        error: anyhow::Error::new(e),
    }
}

/// A window's error as the CLI reports it: a non-finite loss with its micro-step and data
/// rows (as one process does), a peer's failure with its exit code, else the error itself.
#[allow(clippy::too_many_arguments)]
fn window_failure(
    args: &TrainArgs,
    trainer: &Trainer,
    data: &Dataset,
    samples: usize,
    e: TrainError,
    rank: usize,
    size: usize,
    saved_at: Option<u64>,
) -> Failure {
    let code = match onnx_ga::distributed::is_input_error(&e) {
        true => 2,
        false => 1,
    };
    let message = match &e {
        TrainError::NonFinite { step, loss } => {
            let rows = args.order().rows(samples, args.micro_batch, step - 1);
            // The rows were read for the step; should a second read fail, the report
            // goes without their values.
            let batch = data.rows(&rows).unwrap_or_default();
            let what = NonFiniteStep {
                step: *step,
                loss: *loss,
                rows,
                data: &args.data,
            };
            let mut message = what.describe(trainer, &batch);
            message.push_str(&saved_note(args, saved_at));
            message.push_str(". --on-nonfinite skip discards such micro-steps and goes on; loss scaling (rewrite --loss-scale) skips their windows");
            message
        }
        // Its message names this rank already.
        TrainError::PeerFailed { .. } => {
            return Failure {
                code,
                error: anyhow::anyhow!("{e}{}", saved_note(args, saved_at)),
            }
        }
        other => other.to_string(),
    };
    ranked(
        rank,
        size,
        Failure {
            code,
            error: anyhow::anyhow!(message),
        },
    )
}

/// What the state file holds after a failed run.
fn saved_note(args: &TrainArgs, saved_at: Option<u64>) -> String {
    match (&args.save_state, saved_at) {
        (Some(path), Some(at)) => format!(
            "; stopped without saving it: {} holds the state after micro-step {at} (resume with --init-state {})",
            path.display(),
            path.display()
        ),
        (Some(path), None) => format!("; stopped: {} was not written", path.display()),
        (None, _) => "; stopped".to_string(),
    }
}

/// A library error with the exit code it deserves.
fn train_failure(e: TrainError) -> Failure {
    Failure {
        code: if onnx_ga::distributed::is_input_error(&e) {
            2
        } else {
            1
        },
        error: anyhow::Error::new(e),
    }
}
