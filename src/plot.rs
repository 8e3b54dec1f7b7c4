//! `onnx-ga plot`: a picture of a training run from its metrics file (`train --metrics`).
//!
//! The loss of every micro-step and its moving average, the validation loss where `train
//! --eval-data` measured it, window boundaries (when there are few enough to see), windows
//! loss scaling skipped and micro-steps whose loss was not finite marked in red, and the
//! loss scale on a second, logarithmic axis when the step has one. PNG or SVG by the output's extension, drawn with plotters; text uses a font
//! embedded in the binary (assets/), so no system font library is needed. Files are
//! written atomically.

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

/// The font the plots' text is drawn with (DejaVu Sans, printable ASCII; assets/README.md).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");
const FAMILY: &str = "sans-serif";

/// Default picture size in pixels (SVG: user units).
pub const DEFAULT_SIZE: (u32, u32) = (960, 540);

/// Above this many windows their boundaries are not drawn (they would fill the plot).
const MAX_BOUNDARIES: usize = 150;

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a metrics line ({message}); expected one JSON object per line as `train --metrics` writes, e.g. {{\"step\":1,\"loss\":0.69,\"applied\":false}}")]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: no micro-steps in the metrics file")]
    Empty { path: PathBuf },
    #[error("{path}: the plot is PNG or SVG, by the extension .png or .svg")]
    Format { path: PathBuf },
    #[error("{path}: size {width}x{height}: each side must be 100 to 10000 pixels")]
    Size {
        path: PathBuf,
        width: u32,
        height: u32,
    },
    #[error("{path}: drawing failed: {message}")]
    Draw { path: PathBuf, message: String },
    #[error("{path}: cannot write: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One micro-step of a metrics file.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub step: u64,
    /// NaN where the loss was not finite (JSON `null`, or a string such as "NaN").
    pub loss: f64,
    pub applied: bool,
    pub skipped: bool,
    pub discarded: bool,
    pub scale: Option<f64>,
}

/// A validation loss of a metrics file (`train --eval-data`), after micro-step `step`.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalPoint {
    pub step: u64,
    /// NaN where it was not finite.
    pub loss: f64,
}

/// A metrics file: its micro-steps and its validation losses, each in file order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    pub points: Vec<Point>,
    pub evals: Vec<EvalPoint>,
}

/// The image format, from the file's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Png,
    Svg,
}

impl Format {
    pub fn of(path: &Path) -> Result<Format, PlotError> {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match ext.as_deref() {
            Some("png") => Ok(Format::Png),
            Some("svg") => Ok(Format::Svg),
            _ => Err(PlotError::Format {
                path: path.to_path_buf(),
            }),
        }
    }
}

/// A loss-like JSON value: a number, or NaN for `null` and the strings of non-finite values.
fn loss_value(key: &str, value: &serde_json::Value) -> Result<f64, String> {
    match value {
        serde_json::Value::Null => Ok(f64::NAN),
        serde_json::Value::Number(n) => Ok(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "nan" | "inf" | "+inf" | "-inf" | "infinity" | "-infinity" => Ok(f64::NAN),
            _ => Err(format!("\"{key}\" is the string {s:?}")),
        },
        other => Err(format!("\"{key}\" is {other}")),
    }
}

/// Reads a metrics file: one JSON object per non-empty line with `step` and `loss`
/// (`applied`, `skipped`, `discarded`, `scale` optional), or `step` and `eval_loss` (a
/// validation loss).
pub fn read_metrics(path: &Path) -> Result<Metrics, PlotError> {
    let text = crate::input::read_regular_to_string(path).map_err(|source| PlotError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut metrics = Metrics::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| PlotError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let object = value
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        let step = object
            .get("step")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| bad("no \"step\" (a whole number)".into()))?;
        let loss = match (object.get("loss"), object.get("eval_loss")) {
            (Some(v), _) => loss_value("loss", v).map_err(bad)?,
            (None, Some(v)) => {
                let loss = loss_value("eval_loss", v).map_err(bad)?;
                metrics.evals.push(EvalPoint {
                    step,
                    loss: if loss.is_finite() { loss } else { f64::NAN },
                });
                continue;
            }
            (None, None) => return Err(bad("no \"loss\" (or \"eval_loss\")".into())),
        };
        let flag = |key: &str| -> Result<bool, PlotError> {
            match object.get(key) {
                None | Some(serde_json::Value::Null) => Ok(false),
                Some(serde_json::Value::Bool(b)) => Ok(*b),
                Some(other) => Err(bad(format!("\"{key}\" is {other}, not true or false"))),
            }
        };
        let scale = match object.get("scale") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(
                v.as_f64()
                    .ok_or_else(|| bad(format!("\"scale\" is {v}, not a number")))?,
            ),
        };
        metrics.points.push(Point {
            step,
            loss: if loss.is_finite() { loss } else { f64::NAN },
            applied: flag("applied")?,
            skipped: flag("skipped")?,
            discarded: flag("discarded")?,
            scale: scale.filter(|s| s.is_finite() && *s > 0.0),
        });
    }
    if metrics.points.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(metrics)
}

/// What a plot shows, for the message after writing it.
#[derive(Clone, Debug, PartialEq)]
pub struct Drawn {
    pub micro_steps: usize,
    pub windows: usize,
    pub skipped: usize,
    pub non_finite: usize,
    /// Micro-steps in the moving average.
    pub average_of: usize,
    pub scale: bool,
    /// Validation losses drawn.
    pub evaluations: usize,
}

/// Reads `metrics` and writes its plot to `out` (atomically), PNG or SVG by extension.
pub fn plot_file(metrics: &Path, out: &Path, size: (u32, u32)) -> Result<Drawn, PlotError> {
    let format = Format::of(out)?;
    check_size(out, size)?;
    let metrics_read = read_metrics(metrics)?;
    let title = metrics
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (bytes, drawn) =
        render(&metrics_read, format, size, &title).map_err(|message| PlotError::Draw {
            path: out.to_path_buf(),
            message,
        })?;
    crate::atomic::write(out, &bytes).map_err(|source| PlotError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    Ok(drawn)
}

fn check_size(path: &Path, (width, height): (u32, u32)) -> Result<(), PlotError> {
    let ok = |v: u32| (100..=10_000).contains(&v);
    match ok(width) && ok(height) {
        true => Ok(()),
        false => Err(PlotError::Size {
            path: path.to_path_buf(),
            width,
            height,
        }),
    }
}

/// The file's bytes.
pub fn render(
    metrics: &Metrics,
    format: Format,
    (width, height): (u32, u32),
    title: &str,
) -> Result<(Vec<u8>, Drawn), String> {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // The font is ours and valid (a unit test draws with it).
        let _ = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT);
    });
    match format {
        Format::Svg => {
            let mut svg = String::new();
            let drawn = {
                let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
                let drawn = draw(&root, metrics, title).map_err(|e| e.to_string())?;
                root.present().map_err(|e| e.to_string())?;
                drawn
            };
            Ok((svg.into_bytes(), drawn))
        }
        Format::Png => {
            let mut rgb = vec![0u8; width as usize * height as usize * 3];
            let drawn = {
                let root =
                    BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
                let drawn = draw(&root, metrics, title).map_err(|e| e.to_string())?;
                root.present().map_err(|e| e.to_string())?;
                drawn
            };
            let mut png_bytes = Vec::new();
            {
                let mut encoder = png::Encoder::new(&mut png_bytes, width, height);
                encoder.set_color(png::ColorType::Rgb);
                encoder.set_depth(png::BitDepth::Eight);
                let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
                writer.write_image_data(&rgb).map_err(|e| e.to_string())?;
                writer.finish().map_err(|e| e.to_string())?;
            }
            Ok((png_bytes, drawn))
        }
    }
}

/// Window length K: the most common distance between window ends (applied or skipped).
fn window_length(points: &[Point]) -> Option<usize> {
    let ends: Vec<u64> = points
        .iter()
        .filter(|p| p.applied || p.skipped)
        .map(|p| p.step)
        .collect();
    let mut counts = std::collections::BTreeMap::<u64, usize>::new();
    for pair in ends.windows(2) {
        if pair[1] > pair[0] {
            *counts.entry(pair[1] - pair[0]).or_default() += 1;
        }
    }
    match counts.into_iter().max_by_key(|(gap, n)| (*n, *gap)) {
        Some((gap, _)) => usize::try_from(gap).ok(),
        // One window: it ended at its K-th micro-step.
        None => ends
            .first()
            .and_then(|end| points.first().map(|p| end + 1 - p.step.min(*end)))
            .and_then(|k| usize::try_from(k).ok()),
    }
}

/// The trailing mean of the last `w` finite losses at each point (NaN before the first).
fn moving_average(points: &[Point], w: usize) -> Vec<f64> {
    let mut window = std::collections::VecDeque::with_capacity(w);
    let mut sum = 0.0;
    points
        .iter()
        .map(|p| {
            if p.loss.is_finite() {
                window.push_back(p.loss);
                sum += p.loss;
                if window.len() > w {
                    sum -= window.pop_front().unwrap_or(0.0);
                }
            }
            match window.len() {
                0 => f64::NAN,
                n => sum / n as f64,
            }
        })
        .collect()
}

/// Runs of consecutive finite (x, y), for lines broken where a value is not finite.
fn finite_runs(xs: impl Iterator<Item = (f64, f64)>) -> Vec<Vec<(f64, f64)>> {
    let mut runs = vec![Vec::new()];
    for (x, y) in xs {
        if y.is_finite() {
            runs.last_mut().expect("one run").push((x, y));
        } else if !runs.last().expect("one run").is_empty() {
            runs.push(Vec::new());
        }
    }
    runs.retain(|r| !r.is_empty());
    runs
}

fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if !(lo.is_finite() && hi.is_finite()) {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    if span <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = (hi.abs() * 0.1).max(0.5);
        return (lo - pad, hi + pad);
    }
    (lo - 0.05 * span, hi + 0.05 * span)
}

const LOSS: RGBColor = RGBColor(120, 160, 210);
const AVERAGE: RGBColor = RGBColor(20, 60, 150);
const BOUNDARY: RGBColor = RGBColor(215, 215, 215);
const BAD: RGBColor = RGBColor(205, 30, 30);
const SCALE: RGBColor = RGBColor(30, 140, 60);
const VALIDATION: RGBColor = RGBColor(230, 120, 20);

type DrawResult<T, DB> = Result<T, DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    metrics: &Metrics,
    title: &str,
) -> DrawResult<Drawn, DB> {
    root.fill(&WHITE)?;
    let (points, evals) = (&metrics.points, &metrics.evals);
    let n = points.len();
    let first = points.first().map_or(0, |p| p.step) as f64;
    let last = points.last().map_or(0, |p| p.step) as f64;
    let (x0, x1) = match last > first {
        true => (first - 0.5, last + 0.5),
        false => (first - 1.0, first + 1.0),
    };
    let finite = points
        .iter()
        .map(|p| p.loss)
        .chain(evals.iter().map(|e| e.loss))
        .filter(|l| l.is_finite());
    let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), l| {
        (lo.min(l), hi.max(l))
    });
    let (y0, y1) = padded(lo, hi);
    let scales: Vec<f64> = points.iter().filter_map(|p| p.scale).collect();
    let has_scale = !scales.is_empty();
    let (s0, s1) = scales
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
            (lo.min(*s), hi.max(*s))
        });
    let (s0, s1) = match has_scale {
        true => (s0 / 2.0, s1 * 2.0),
        false => (0.5, 2.0),
    };
    let average_of = window_length(points)
        .unwrap_or(1)
        .max(n.div_ceil(50))
        .max(1);
    let windows: Vec<f64> = points
        .iter()
        .filter(|p| p.applied || p.skipped)
        .map(|p| p.step as f64 + 0.5)
        .collect();
    let skipped: Vec<f64> = points
        .iter()
        .filter(|p| p.skipped)
        .map(|p| p.step as f64)
        .collect();
    let non_finite: Vec<f64> = points
        .iter()
        .filter(|p| !p.loss.is_finite() || p.discarded)
        .map(|p| p.step as f64)
        .collect();

    let caption = format!(
        "{title}: {n} micro-steps, {} windows{}",
        windows.len(),
        match skipped.len() {
            0 => String::new(),
            s => format!(", {s} skipped"),
        }
    );
    let mut chart = ChartBuilder::on(root)
        .margin(12)
        .caption(caption, (FAMILY, 20))
        .x_label_area_size(40)
        .y_label_area_size(70)
        .right_y_label_area_size(if has_scale { 70 } else { 12 })
        .build_cartesian_2d(x0..x1, y0..y1)?
        .set_secondary_coord(x0..x1, (s0..s1).log_scale());
    chart
        .configure_mesh()
        .disable_x_mesh()
        .bold_line_style(RGBColor(235, 235, 235))
        .light_line_style(WHITE)
        .x_desc("micro-step")
        .y_desc("loss")
        .label_style((FAMILY, 13))
        .axis_desc_style((FAMILY, 15))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| short(*y))
        .draw()?;
    if has_scale {
        chart
            .configure_secondary_axes()
            .y_desc("loss scale")
            .label_style((FAMILY, 13))
            .axis_desc_style((FAMILY, 15))
            .y_label_formatter(&|s| short(*s))
            .draw()?;
    }

    let boundaries = windows.len() <= MAX_BOUNDARIES && !windows.is_empty();
    if boundaries {
        chart
            .draw_series(
                windows
                    .iter()
                    .map(|x| PathElement::new(vec![(*x, y0), (*x, y1)], BOUNDARY)),
            )?
            .label("window end")
            .legend(|(x, y)| PathElement::new(vec![(x, y - 6), (x, y + 6)], BOUNDARY));
    }
    if !skipped.is_empty() {
        chart
            .draw_series(
                skipped
                    .iter()
                    .map(|x| PathElement::new(vec![(*x, y0), (*x, y1)], BAD.stroke_width(2))),
            )?
            .label("window skipped (loss scaling)")
            .legend(|(x, y)| PathElement::new(vec![(x, y - 6), (x, y + 6)], BAD.stroke_width(2)));
    }
    let xy = |f: &dyn Fn(usize, &Point) -> f64| {
        points
            .iter()
            .enumerate()
            .map(|(i, p)| (p.step as f64, f(i, p)))
            .collect::<Vec<_>>()
    };
    let mut labelled = false;
    for run in finite_runs(xy(&|_, p| p.loss).into_iter()) {
        let series = chart.draw_series(LineSeries::new(run, LOSS.stroke_width(1)))?;
        if !labelled {
            series
                .label("loss")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], LOSS));
            labelled = true;
        }
    }
    let average = moving_average(points, average_of);
    let mut labelled = false;
    for run in finite_runs(xy(&|i, _| average[i]).into_iter()) {
        let series = chart.draw_series(LineSeries::new(run, AVERAGE.stroke_width(2)))?;
        if !labelled {
            series
                .label(format!("mean of the last {average_of} micro-steps"))
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], AVERAGE.stroke_width(2))
                });
            labelled = true;
        }
    }
    let evaluated: Vec<(f64, f64)> = evals
        .iter()
        .filter(|e| e.loss.is_finite())
        .map(|e| (e.step as f64, e.loss))
        .collect();
    if !evaluated.is_empty() {
        chart.draw_series(LineSeries::new(
            evaluated.clone(),
            VALIDATION.stroke_width(2),
        ))?;
        chart
            .draw_series(
                evaluated
                    .iter()
                    .map(|p| Circle::new(*p, 4, VALIDATION.filled())),
            )?
            .label("validation loss")
            .legend(|(x, y)| Circle::new((x + 9, y), 4, VALIDATION.filled()));
    }
    if !non_finite.is_empty() {
        let at = y0 + 0.03 * (y1 - y0);
        chart
            .draw_series(
                non_finite
                    .iter()
                    .map(|x| Cross::new((*x, at), 4, BAD.stroke_width(2))),
            )?
            .label("loss not finite (or discarded)")
            .legend(|(x, y)| Cross::new((x + 9, y), 4, BAD.stroke_width(2)));
    }
    if has_scale {
        // A step line: the scale holds until the next micro-step's value.
        let mut line = Vec::new();
        for p in points {
            if let Some(s) = p.scale {
                if let Some(&(_, prev)) = line.last() {
                    line.push((p.step as f64 - 0.5, prev));
                }
                line.push((p.step as f64 - 0.5, s));
            }
        }
        if let (Some(&(_, s)), Some(p)) = (line.last(), points.last()) {
            line.push((p.step as f64 + 0.5, s));
        }
        chart
            .draw_secondary_series(LineSeries::new(line, SCALE.stroke_width(2)))?
            .label("loss scale (right axis)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], SCALE.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FAMILY, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(190, 190, 190))
        .draw()?;
    Ok(Drawn {
        micro_steps: n,
        windows: windows.len(),
        skipped: skipped.len(),
        non_finite: non_finite.len(),
        average_of,
        scale: has_scale,
        evaluations: evaluated.len(),
    })
}

/// An axis label: up to 4 significant digits, exponent form for large or tiny values.
fn short(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".to_string()
    } else if v.fract() == 0.0 && a < 1e7 {
        format!("{v:.0}")
    } else if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else {
        let text = format!("{v:.4}");
        let text = text.trim_end_matches('0').trim_end_matches('.');
        match text {
            "-0" | "" => "0".to_string(),
            t => t.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: u64, loss: f64, applied: bool) -> Point {
        Point {
            step,
            loss,
            applied,
            skipped: false,
            discarded: false,
            scale: None,
        }
    }

    #[test]
    fn window_length_is_the_common_gap() {
        let points: Vec<Point> = (1..=12).map(|s| point(s, 1.0, s % 4 == 0)).collect();
        assert_eq!(window_length(&points), Some(4));
        let one: Vec<Point> = (1..=3).map(|s| point(s, 1.0, s == 3)).collect();
        assert_eq!(window_length(&one), Some(3));
        let none: Vec<Point> = (1..=3).map(|s| point(s, 1.0, false)).collect();
        assert_eq!(window_length(&none), None);
    }

    #[test]
    fn moving_average_skips_non_finite() {
        let losses = [1.0, f64::NAN, 3.0, 5.0];
        let points: Vec<Point> = losses
            .iter()
            .enumerate()
            .map(|(i, l)| point(i as u64 + 1, *l, false))
            .collect();
        let avg = moving_average(&points, 2);
        assert_eq!(avg, vec![1.0, 1.0, 2.0, 4.0]);
        let runs = finite_runs(points.iter().map(|p| (p.step as f64, p.loss)));
        assert_eq!(runs, vec![vec![(1.0, 1.0)], vec![(3.0, 3.0), (4.0, 5.0)]]);
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(short(0.5), "0.5");
        assert_eq!(short(2.0), "2");
        assert_eq!(short(65536.0), "65536");
        assert_eq!(short(131072.0), "131072");
        assert_eq!(short(123456.5), "1.2e5");
        assert_eq!(short(-0.0), "0");
    }

    #[test]
    fn the_embedded_font_draws() {
        let points: Vec<Point> = (1..=8)
            .map(|s| point(s, 1.0 / s as f64, s % 4 == 0))
            .collect();
        let metrics = Metrics {
            points,
            evals: vec![],
        };
        let (svg, drawn) = render(&metrics, Format::Svg, (300, 200), "t").unwrap();
        let svg = String::from_utf8(svg).unwrap();
        assert!(svg.contains(">\nmicro-step\n</text>"), "{svg}");
        assert!(!svg.contains("validation loss"));
        assert_eq!(drawn.evaluations, 0);
    }

    /// Validation losses are read from their own lines and drawn as their own series; a
    /// non-finite one is not drawn.
    #[test]
    fn validation_losses_are_drawn_apart_from_the_micro_steps() {
        let dir = std::env::temp_dir().join(format!("onnx-ga-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.jsonl");
        let lines = [
            r#"{"step":1,"loss":2.0,"applied":false}"#,
            r#"{"step":2,"loss":1.5,"applied":true}"#,
            r#"{"step":2,"eval_loss":1.75,"eval_rows":20}"#,
            r#"{"step":3,"loss":1.25,"applied":false}"#,
            r#"{"step":4,"loss":1.0,"applied":true}"#,
            r#"{"step":4,"eval_loss":null,"eval_rows":20}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let metrics = read_metrics(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(metrics.points.len(), 4);
        assert_eq!(
            metrics.evals[0],
            EvalPoint {
                step: 2,
                loss: 1.75
            }
        );
        assert!(metrics.evals[1].loss.is_nan());
        let (svg, drawn) = render(&metrics, Format::Svg, (400, 300), "t").unwrap();
        assert_eq!(drawn.evaluations, 1);
        assert!(String::from_utf8(svg).unwrap().contains("validation loss"));
    }
}
