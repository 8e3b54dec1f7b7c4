//! `train --eval-data V.npz --eval-model M.onnx [--eval-every N] [--eval-batch B]
//! [--save-best B] [--patience P]`: the validation loss during training
//! ([`onnx_ga::evaluate`]), reported in the progress notes, as a metrics line (`{"step",
//! "eval_loss", "eval_rows"}`) and in the plot; the state with the lowest one written to
//! `--save-best` (its progress record holds that loss, so a resume keeps it); training
//! stopped when `--patience` validations in a row have not lowered it.
//!
//! Everything is checked before the first micro-step: the eval model against the step (its
//! parameters, types and shapes), the validation data against the step's data inputs (as
//! `--data` is) and the indices it holds. The one-process and the distributed `train`
//! share it; on a data-parallel job rank 0 alone evaluates (the ranks' parameters are
//! equal after every window).

use std::path::PathBuf;

use onnx_ga::dataset::Dataset;
use onnx_ga::evaluate::{EvalGraph, Evaluator};
use onnx_ga::train::{TrainOptions, Trainer};

use super::{Failure, MetricsFile, TrainArgs, UsageError};

/// Whether `args` evaluate after a micro-step that brought the run's optimizer steps to
/// `windows` (`applied`: it ended a window); the end of the run evaluates anyway.
pub(crate) fn due(args: &TrainArgs, applied: bool, windows: u64) -> bool {
    args.eval_data.is_some()
        && applied
        && args.eval_every.is_some_and(|n| windows.is_multiple_of(n))
}

pub(crate) struct Validation {
    evaluator: Evaluator,
    data: Dataset,
    file: PathBuf,
    /// Rows evaluated: all of them, or as many whole batches as a fixed batch size allows.
    rows: usize,
    batch: usize,
    micro_batch: usize,
    /// The micro-step the last evaluation followed.
    last_at: Option<u64>,
    /// (micro-step, loss) of the lowest validation loss so far.
    best: Option<(u64, f64)>,
    /// `--save-best`: where the state of the lowest goes.
    save_best: Option<PathBuf>,
    shuffle: Option<u64>,
    /// `--patience`, and the validations since the lowest.
    patience: Option<u64>,
    since_best: u64,
    /// Whether a validation loss was NaN or infinite (said once, with its cause).
    told_nonfinite: bool,
}

/// One line of the metrics file.
#[derive(serde::Serialize)]
struct MetricsLine {
    step: u64,
    eval_loss: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    eval_accuracy: Option<f64>,
    eval_rows: usize,
}

impl Validation {
    /// The validation of `args` (`None` without --eval-data), checked and its session made;
    /// `notes` takes what it says about itself.
    pub(crate) fn open(
        args: &TrainArgs,
        trainer: &Trainer,
        options: &TrainOptions,
        start_step: u64,
        mut note: impl FnMut(String),
    ) -> Result<Option<Validation>, Failure> {
        let (Some(file), Some(model_file)) = (&args.eval_data, &args.eval_model) else {
            return Ok(None);
        };
        if args.eval_every == Some(0) {
            return Err(UsageError("--eval-every 0: must be at least 1".into()).into());
        }
        if args.eval_batch == Some(0) {
            return Err(UsageError("--eval-batch 0: must be at least 1".into()).into());
        }
        if args.patience == Some(0) {
            return Err(UsageError("--patience 0: must be at least 1".into()).into());
        }
        let model = onnx_ga::model::load_model_with_data(model_file)?;
        let graph = EvalGraph::new(model, model_file, trainer)?;
        let opened = Dataset::open(file, &trainer.manifest.data_inputs)?;
        if let Some(n) = onnx_ga::data::ignored_note(file, &opened.ignored) {
            note(n);
        }
        let data = opened.dataset;
        let samples = trainer.check_data(&data, file)?;
        let limits = onnx_ga::index_check::index_limits(graph.model(), graph.data_inputs());
        onnx_ga::index_check::check_data(&data, &limits)
            .map_err(|m| UsageError(format!("--eval-data {}: {m}", file.display())))?;
        let requested = args.eval_batch.unwrap_or(args.micro_batch);
        let (batch, rows) = match graph.fixed_batch() {
            Some(fixed) if args.eval_batch.is_some_and(|b| b != fixed) => {
                return Err(UsageError(format!(
                    "--eval-batch {requested}: the eval model {} declares a batch of {fixed} rows",
                    model_file.display()
                ))
                .into())
            }
            Some(fixed) if samples < fixed => {
                return Err(UsageError(format!(
                    "--eval-data {}: {samples} rows, fewer than the batch of {fixed} the eval model {} declares",
                    file.display(),
                    model_file.display()
                ))
                .into())
            }
            Some(fixed) => (fixed, samples - samples % fixed),
            None => (requested.min(samples), samples),
        };
        if rows < samples {
            note(format!(
                "validation: the eval model declares a batch of {batch} rows: the last {} of {samples} rows are left out",
                samples - rows
            ));
        }
        if args.eval_model_recorded {
            note(format!(
                "validation: with {}, the model `rewrite` read (unchanged since; --eval-model names another)",
                model_file.display()
            ));
        }
        note(format!(
            "validation: {} over {rows} rows of {}, {batch} at a time, {}",
            graph.describe(),
            file.display(),
            match args.eval_every {
                Some(n) => format!("after every {n} optimizer steps and at the end"),
                None => "at the end".into(),
            }
        ));
        let evaluator = Evaluator::new(graph, options.engine, &options.session)?;
        let best = match &args.save_best {
            Some(path) if start_step > 0 => recorded_best(path, start_step)?,
            _ => None,
        };
        if let (Some((at, loss)), Some(path)) = (best, &args.save_best) {
            note(format!(
                "validation: the lowest so far is {loss:.6} after micro-step {at} ({}'s progress file); --save-best writes a lower one only",
                path.display()
            ));
        }
        Ok(Some(Validation {
            evaluator,
            data,
            file: file.clone(),
            rows,
            batch,
            micro_batch: args.micro_batch,
            last_at: None,
            best,
            save_best: args.save_best.clone(),
            shuffle: args.shuffle,
            patience: args.patience,
            since_best: 0,
            told_nonfinite: false,
        }))
    }

    /// Why the validation loss is `loss` (NaN or infinite): the validation rows whose data
    /// holds NaN or inf, else the model's outputs; and what `--save-best` and `--patience`
    /// make of it. Without it a run asked to save its best state ended without one, and
    /// without a word on why.
    fn nonfinite_note(&self, trainer: &Trainer, loss: f64) -> Result<String, Failure> {
        let names = &trainer.manifest.data_inputs;
        // Per data input, its rows holding NaN or inf, the data read a batch at a time.
        let mut bad: Vec<Vec<usize>> = vec![Vec::new(); names.len()];
        for start in (0..self.rows).step_by(self.batch.max(1)) {
            let rows: Vec<usize> = (start..(start + self.batch).min(self.rows)).collect();
            let batch = self.data.rows(&rows)?;
            for (name, bad) in names.iter().zip(&mut bad) {
                if let Some(t) = batch.get(name) {
                    bad.extend(t.non_finite_rows().iter().map(|&r| rows[r]));
                }
            }
        }
        let found: Vec<String> = names
            .iter()
            .zip(&bad)
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(name, rows)| format!("'{name}' at rows {}", super::row_ranges(rows)))
            .collect();
        let cause = match found.is_empty() {
            true => "its data is finite: the model's outputs overflowed".to_string(),
            false => format!(
                "{} holds NaN or inf: {}",
                self.file.display(),
                found.join(", ")
            ),
        };
        let counted = match (&self.save_best, self.patience) {
            (Some(path), _) => format!(
                "; --save-best writes {} only after a finite validation loss",
                path.display()
            ),
            (None, Some(_)) => "; --patience counts it as no improvement".to_string(),
            (None, None) => String::new(),
        };
        Ok(format!("validation: the loss is {loss}: {cause}{counted}"))
    }

    /// At the end of the run: that `--save-best` was not written, when no validation loss
    /// (of this run, or recorded by the run it resumes) was finite.
    pub(crate) fn unwritten_best(&self) -> Option<String> {
        match (&self.save_best, self.best) {
            (Some(path), None) => Some(format!(
                "--save-best {}: not written: no validation loss was finite",
                path.display()
            )),
            _ => None,
        }
    }

    /// Whether `--patience` validations in a row have not lowered the lowest.
    pub(crate) fn exhausted(&self) -> bool {
        self.patience.is_some_and(|p| self.since_best >= p)
    }

    /// Why training stops early, for the note.
    pub(crate) fn stop_note(&self, step: u64) -> String {
        let lowest = match self.best {
            Some((at, loss)) => format!("the lowest, {loss:.6}, after micro-step {at}"),
            None => "no finite one yet".into(),
        };
        format!(
            "early stop after micro-step {step}: the last {} validation(s) did not lower the validation loss ({lowest}; --patience)",
            self.since_best
        )
    }

    /// Evaluates after micro-step `step` (once: a second call for the same step does
    /// nothing); reports it in `note` and `metrics`, and writes `--save-best` when the loss
    /// is the lowest yet.
    pub(crate) fn run(
        &mut self,
        trainer: &Trainer,
        step: u64,
        mut metrics: Option<&mut MetricsFile>,
        mut note: impl FnMut(String),
    ) -> Result<(), Failure> {
        if self.last_at == Some(step) {
            return Ok(());
        }
        let e = self.evaluator.evaluate(
            trainer,
            &self.data,
            &self.file,
            self.rows,
            self.batch,
            self.micro_batch,
        )?;
        self.last_at = Some(step);
        let improved = e.loss.is_finite() && self.best.is_none_or(|(_, b)| e.loss < b);
        match improved {
            true => {
                self.best = Some((step, e.loss));
                self.since_best = 0;
            }
            false => self.since_best += 1,
        }
        let best = match self.best {
            Some((at, loss)) if at != step => format!("; lowest {loss:.6} after micro-step {at}"),
            _ => String::new(),
        };
        let accuracy = match e.accuracy {
            Some(a) => format!(", accuracy {:.2}%", 100.0 * a),
            None => String::new(),
        };
        note(format!(
            "validation after micro-step {step}: loss {:.6}{accuracy} over {} rows ({:.2} s){best}",
            e.loss,
            e.rows,
            e.wall.as_secs_f64()
        ));
        if !e.loss.is_finite() && !self.told_nonfinite {
            self.told_nonfinite = true;
            note(self.nonfinite_note(trainer, e.loss)?);
        }
        if let Some(out) = metrics.as_deref_mut() {
            let line = MetricsLine {
                step,
                eval_loss: e.loss,
                eval_accuracy: e.accuracy,
                eval_rows: e.rows,
            };
            out.line(&serde_json::to_string(&line)?)?;
        }
        if let (true, Some(path)) = (improved, &self.save_best) {
            super::write_checkpoint(trainer, path, step, self.shuffle, metrics, Some(e.loss))?;
            note(format!(
                "best: {} after micro-step {step} (validation loss {:.6})",
                path.display(),
                e.loss
            ));
        }
        Ok(())
    }
}

/// The lowest validation loss `--save-best`'s progress file records at or before
/// `start_step` (a resume's).
fn recorded_best(path: &std::path::Path, start_step: u64) -> Result<Option<(u64, f64)>, Failure> {
    let record = super::read_progress(&super::progress_path(path))?;
    Ok(record.and_then(|r| {
        r.checkpoints
            .iter()
            .filter(|c| c.micro_steps <= start_step)
            .filter_map(|c| c.eval_loss.map(|l| (c.micro_steps, l)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }))
}
