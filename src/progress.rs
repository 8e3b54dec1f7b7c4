//! What `train` shows while it runs, and its summary at the end.
//!
//! On a terminal (stderr) a bar; anywhere else (CI logs, `nohup`, a notebook) one plain line
//! at the first micro-step, then every [`LINE_EVERY`] and at the last; `quiet` shows
//! nothing. Both carry the same fields: micro-step, window, smoothed loss, loss scale when
//! the step has one, rate (micro-steps/s and samples/s) and the time left. Notes (engine,
//! checkpoints, discarded micro-steps) go above the bar, and are silent under `quiet` too.

use std::fmt;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use crate::train::StepMetrics;

/// How often a plain progress line is written off a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(5);

/// How often the bar's text is refreshed (it is cheap, formatting it every micro-step is
/// not: a micro-step can take 20 µs).
const BAR_EVERY: Duration = Duration::from_millis(100);

/// The weight of the past in the smoothed loss (an exponential moving average, corrected
/// for its start as Adam's moments are, so the first values are not pulled toward 0).
const SMOOTHING: f64 = 0.9;

/// Where progress goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Display {
    /// An indicatif bar on stderr.
    Bar,
    /// Plain lines on stderr every `every`.
    Lines { every: Duration },
    /// Nothing, notes and summary included.
    Quiet,
}

impl Display {
    /// The bar on a terminal, lines elsewhere, nothing when `quiet`.
    pub fn for_stderr(quiet: bool) -> Display {
        match (quiet, std::io::stderr().is_terminal()) {
            (true, _) => Display::Quiet,
            (false, true) => Display::Bar,
            (false, false) => Display::Lines { every: LINE_EVERY },
        }
    }
}

/// Counts of a run and its loss, for the progress fields and the summary.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunStats {
    /// Micro-steps run.
    pub micro_steps: u64,
    /// Windows whose update was applied.
    pub optimizer_steps: u64,
    /// Micro-steps ending a window that loss scaling skipped.
    pub skipped: Vec<u64>,
    /// Micro-steps whose update was discarded for a non-finite loss.
    pub discarded: Vec<u64>,
    /// (micro-step, loss) of the first, the last and the lowest finite loss.
    pub first: Option<(u64, f32)>,
    pub last: Option<(u64, f32)>,
    pub best: Option<(u64, f32)>,
    /// The latest loss scale, when the step has loss scaling.
    pub scale: Option<f32>,
    smoothed: f64,
    smoothed_count: i32,
}

impl RunStats {
    pub fn record(&mut self, m: &StepMetrics) {
        self.micro_steps += 1;
        self.optimizer_steps += u64::from(m.applied);
        if m.skipped {
            self.skipped.push(m.step);
        }
        if m.discarded {
            self.discarded.push(m.step);
        }
        if m.scale.is_some() {
            self.scale = m.scale;
        }
        if m.loss.is_finite() {
            let now = Some((m.step, m.loss));
            self.first = self.first.or(now);
            self.last = now;
            if self.best.is_none_or(|(_, b)| m.loss < b) {
                self.best = now;
            }
            self.smoothed = SMOOTHING * self.smoothed + (1.0 - SMOOTHING) * f64::from(m.loss);
            self.smoothed_count = self.smoothed_count.saturating_add(1);
        }
    }

    /// The smoothed finite loss so far.
    pub fn smoothed_loss(&self) -> Option<f64> {
        (self.smoothed_count > 0)
            .then(|| self.smoothed / (1.0 - SMOOTHING.powi(self.smoothed_count)))
    }

    /// Windows ended so far, applied or skipped.
    pub fn windows(&self) -> u64 {
        self.optimizer_steps + self.skipped.len() as u64
    }
}

/// What a run did, printed at its end.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub stats: RunStats,
    pub wall: Duration,
    pub micro_batch: usize,
}

impl Summary {
    pub fn micro_steps_per_second(&self) -> f64 {
        rate(self.stats.micro_steps, self.wall)
    }

    pub fn samples_per_second(&self) -> f64 {
        self.micro_steps_per_second() * self.micro_batch as f64
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stats;
        write!(
            f,
            "trained {} micro-steps, {} optimizer steps, {} skipped windows",
            s.micro_steps,
            s.optimizer_steps,
            s.skipped.len()
        )?;
        if !s.skipped.is_empty() {
            write!(
                f,
                "; loss scaling skipped {} windows with non-finite values (ending at micro-steps {})",
                s.skipped.len(),
                list_steps(&s.skipped)
            )?;
        }
        if !s.discarded.is_empty() {
            write!(
                f,
                "; discarded {} micro-steps with a non-finite loss ({})",
                s.discarded.len(),
                list_steps(&s.discarded)
            )?;
        }
        writeln!(f)?;
        let at = |v: Option<(u64, f32)>| match v {
            Some((step, loss)) => format!("{loss:.6} (micro-step {step})"),
            None => "none finite".to_string(),
        };
        writeln!(
            f,
            "loss: first {}, last {}, best {}",
            at(s.first),
            at(s.last),
            at(s.best)
        )?;
        write!(
            f,
            "time: {} wall, {} micro-steps/s, {} samples/s (micro-batch {})",
            duration(self.wall),
            number(self.micro_steps_per_second()),
            number(self.samples_per_second()),
            self.micro_batch
        )?;
        if let Some(scale) = s.scale {
            write!(f, "; final loss scale {scale}")?;
        }
        Ok(())
    }
}

/// The progress of one `train` run.
pub struct Progress {
    display: Display,
    bar: indicatif::ProgressBar,
    total: u64,
    micro_batch: usize,
    start: Instant,
    last_shown: Option<Instant>,
    stats: RunStats,
}

impl Progress {
    /// A run of `total` micro-steps of `micro_batch` samples each.
    pub fn new(display: Display, total: u64, micro_batch: usize) -> Progress {
        // Two lines, so that an 80-column terminal shows every field. Hidden until the
        // first micro-step (notes before it print without an empty bar).
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(total),
            indicatif::ProgressDrawTarget::hidden(),
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:24} {pos}/{len} micro-steps {prefix}\n  {wide_msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Progress {
            display,
            bar,
            total,
            micro_batch,
            start: Instant::now(),
            last_shown: None,
            stats: RunStats::default(),
        }
    }

    pub fn stats(&self) -> &RunStats {
        &self.stats
    }

    /// Restarts the clock: the rate counts from the first micro-step, not from loading.
    pub fn start_clock(&mut self) {
        self.start = Instant::now();
        if self.display == Display::Bar {
            self.bar
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
    }

    /// An informational line (not under `quiet`), printed above the bar.
    pub fn note(&self, text: impl fmt::Display) {
        match self.display {
            Display::Quiet => {}
            Display::Bar => self.bar.suspend(|| eprintln!("{text}")),
            Display::Lines { .. } => eprintln!("{text}"),
        }
    }

    /// After each micro-step, with its metrics (`step` 1-based over all runs).
    pub fn record(&mut self, m: &StepMetrics) {
        self.stats.record(m);
        let now = Instant::now();
        let last = self.stats.micro_steps == self.total;
        match self.display {
            Display::Quiet => {}
            Display::Bar => {
                self.bar.inc(1);
                if last || self.last_shown.is_none_or(|t| now - t >= BAR_EVERY) {
                    self.last_shown = Some(now);
                    let (state, rate) = self.fields(m, now);
                    self.bar.set_prefix(rate);
                    self.bar.set_message(state);
                }
            }
            Display::Lines { every } => {
                if last || self.last_shown.is_none_or(|t| now - t >= every) {
                    self.last_shown = Some(now);
                    let s = &self.stats;
                    let percent = 100.0 * s.micro_steps as f64 / self.total.max(1) as f64;
                    let (state, rate) = self.fields(m, now);
                    eprintln!(
                        "micro-step {} ({}/{}, {percent:.0}%) {state} {rate}",
                        m.step, s.micro_steps, self.total
                    );
                }
            }
        }
    }

    /// The fields shown besides the position: (window, loss, scale; rate and time left).
    fn fields(&self, m: &StepMetrics, now: Instant) -> (String, String) {
        let s = &self.stats;
        let mut text = String::new();
        // The window the latest micro-step belongs to.
        let window = s.windows() + u64::from(!(m.applied || m.skipped));
        text.push_str(&format!("window {window}"));
        match s.smoothed_loss() {
            Some(l) => text.push_str(&format!(" loss {l:.5} (smoothed)")),
            None => text.push_str(" loss none finite yet"),
        }
        if let Some(scale) = s.scale {
            text.push_str(&format!(" scale {scale}"));
        }
        if !s.skipped.is_empty() {
            text.push_str(&format!(" skipped {}", s.skipped.len()));
        }
        let elapsed = now - self.start;
        let per_second = rate(s.micro_steps, elapsed);
        let mut speed = format!(
            "{} micro-steps/s {} samples/s",
            number(per_second),
            number(per_second * self.micro_batch as f64)
        );
        let left = self.total.saturating_sub(s.micro_steps);
        if per_second > 0.0 {
            let eta = Duration::from_secs_f64(left as f64 / per_second);
            speed.push_str(&format!(" ETA {}", duration(eta)));
        }
        (text, speed)
    }

    /// The run stopped on an error: the bar stays where it was.
    pub fn abandon(&self) {
        self.bar.abandon();
    }

    /// Clears the bar and prints the summary (not under `quiet`); returns it.
    pub fn finish(&mut self) -> Summary {
        self.bar.finish_and_clear();
        let summary = Summary {
            stats: self.stats.clone(),
            wall: self.start.elapsed(),
            micro_batch: self.micro_batch,
        };
        self.note(&summary);
        summary
    }
}

fn rate(count: u64, elapsed: Duration) -> f64 {
    match elapsed.as_secs_f64() {
        s if s > 0.0 => count as f64 / s,
        _ => 0.0,
    }
}

/// Three significant digits, without exponent: 0.123, 12.3, 1230.
fn number(v: f64) -> String {
    match v {
        v if v >= 100.0 => format!("{v:.0}"),
        v if v >= 10.0 => format!("{v:.1}"),
        v if v >= 1.0 => format!("{v:.2}"),
        v => format!("{v:.3}"),
    }
}

/// `0.42s`, `12.3s`, `4m05s`, `2h03m`.
fn duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    match s {
        s if s < 10.0 => format!("{s:.2}s"),
        s if s < 60.0 => format!("{s:.1}s"),
        s if s < 3600.0 => format!("{}m{:02}s", s as u64 / 60, s as u64 % 60),
        s => format!("{}h{:02}m", s as u64 / 3600, s as u64 % 3600 / 60),
    }
}

/// At most 10 micro-steps, then how many more.
pub fn list_steps(steps: &[u64]) -> String {
    let mut text = steps
        .iter()
        .take(10)
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if steps.len() > 10 {
        text.push_str(&format!(", ... ({} more)", steps.len() - 10));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, loss: f32, applied: bool) -> StepMetrics {
        StepMetrics {
            step,
            loss,
            applied,
            scale: None,
            skipped: false,
            discarded: false,
            lr: None,
        }
    }

    #[test]
    fn stats_skip_non_finite_losses() {
        let mut s = RunStats::default();
        s.record(&step(1, f32::NAN, false));
        assert_eq!(s.smoothed_loss(), None);
        s.record(&step(2, 2.0, false));
        // Corrected for its start: the first finite value itself.
        assert!((s.smoothed_loss().unwrap() - 2.0).abs() < 1e-12);
        s.record(&step(3, 1.0, true));
        s.record(&step(4, f32::INFINITY, false));
        s.record(&step(5, 3.0, false));
        assert_eq!(s.first, Some((2, 2.0)));
        assert_eq!(s.last, Some((5, 3.0)));
        assert_eq!(s.best, Some((3, 1.0)));
        assert_eq!(s.micro_steps, 5);
        assert_eq!(s.optimizer_steps, 1);
        // (0.9 * 0.1 * 2 + 0.1 * 1) * 0.9 + 0.1 * 3, over 1 - 0.9^3.
        let expected = ((0.9 * 0.1 * 2.0 + 0.1) * 0.9 + 0.3) / (1.0 - 0.729);
        assert!((s.smoothed_loss().unwrap() - expected).abs() < 1e-12);
    }

    #[test]
    fn summary_names_every_count() {
        let mut stats = RunStats::default();
        for i in 1..=8 {
            let mut m = step(i, 1.0 / i as f32, i % 4 == 0);
            if i == 4 {
                m.applied = false;
                m.skipped = true;
                m.scale = Some(32768.0);
            }
            stats.record(&m);
        }
        let summary = Summary {
            stats,
            wall: Duration::from_secs(2),
            micro_batch: 8,
        };
        let text = summary.to_string();
        assert!(
            text.starts_with("trained 8 micro-steps, 1 optimizer steps, 1 skipped windows"),
            "{text}"
        );
        assert!(
            text.contains(
                "; loss scaling skipped 1 windows with non-finite values (ending at micro-steps 4)"
            ),
            "{text}"
        );
        assert!(
            text.contains("loss: first 1.000000 (micro-step 1), last 0.125000 (micro-step 8), best 0.125000 (micro-step 8)"),
            "{text}"
        );
        assert!(
            text.contains("2.00s wall, 4.00 micro-steps/s, 32.0 samples/s"),
            "{text}"
        );
        assert!(text.ends_with("final loss scale 32768"), "{text}");
    }

    #[test]
    fn durations_and_numbers() {
        assert_eq!(duration(Duration::from_millis(420)), "0.42s");
        assert_eq!(duration(Duration::from_secs(245)), "4m05s");
        assert_eq!(duration(Duration::from_secs(7380)), "2h03m");
        assert_eq!(number(1234.4), "1234");
        assert_eq!(number(0.1234), "0.123");
        assert_eq!(
            list_steps(&(1..=12).collect::<Vec<_>>()),
            "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ... (2 more)"
        );
    }
}
