//! The recipe a step was built with: every pass of its pipeline with each setting's
//! resolved value and where it came from (given on the command line or in `--pipeline`,
//! taken from the artifacts' optimizer, or a default). `rewrite` prints it before writing
//! and records it in the step's metadata (`onnx_ga.recipe`), so `inspect STEP.onnx` shows
//! what a step does without the command that made it: K, normalisation, optimizer and
//! every hyperparameter, AGC, loss scaling, precision, BatchNorm statistics. A leaf of the
//! module graph: passes describe their settings in its terms, the pipeline assembles them,
//! and `inspect` renders them ([`crate::inspect::StepView`]).

use std::fmt::Write;

use serde::{Deserialize, Serialize};

pub const RECIPE_KEY: &str = "onnx_ga.recipe";

/// Where a setting's value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// On the command line (or in the `--pipeline` spec).
    Given,
    /// From the producer's optimizer: ONNX Runtime's optimizer_model.onnx and checkpoint.
    Artifacts,
    /// The pass's default (the note says whose, where it depends on the formula).
    Default,
}

impl Origin {
    fn describe(self) -> &'static str {
        match self {
            Origin::Given => "given",
            Origin::Artifacts => "from the artifacts",
            Origin::Default => "default",
        }
    }
}

/// One resolved setting of a pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Setting {
    pub name: String,
    pub value: serde_json::Value,
    pub from: Origin,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The settings of one pass of the pipeline, in pipeline order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub pass: String,
    pub settings: Vec<Setting>,
}

impl Section {
    pub fn new(pass: &str) -> Section {
        Section {
            pass: pass.to_string(),
            settings: Vec::new(),
        }
    }

    /// Adds a setting (a later one of the same name replaces it).
    pub fn set(&mut self, name: &str, value: impl Into<serde_json::Value>, from: Origin) {
        let setting = Setting {
            name: name.to_string(),
            value: value.into(),
            from,
            note: None,
        };
        match self.settings.iter_mut().find(|s| s.name == name) {
            Some(s) => *s = setting,
            None => self.settings.push(setting),
        }
    }

    /// A float setting: JSON numbers of f32 values are written as their shortest decimal
    /// (0.01, not 0.009999999776482582).
    pub fn set_f32(&mut self, name: &str, value: f32, from: Origin) {
        let number = match value {
            v if v.fract() == 0.0 && v.abs() < 1e15 => serde_json::Value::from(v as i64),
            v => format!("{v}")
                .parse::<f64>()
                .ok()
                .and_then(serde_json::Number::from_f64)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null),
        };
        self.set(name, number, from);
    }

    /// Notes the setting `name` (which must have been set).
    pub fn note(&mut self, name: &str, note: impl Into<String>) {
        if let Some(s) = self.settings.iter_mut().find(|s| s.name == name) {
            s.note = Some(note.into());
        }
    }

    pub fn get(&self, name: &str) -> Option<&Setting> {
        self.settings.iter().find(|s| s.name == name)
    }

    /// Marks the options the spec gave as given, and adds those the pass did not report.
    fn merge_given<'a>(&mut self, options: impl IntoIterator<Item = (&'a str, &'a str)>) {
        for (key, value) in options {
            match self.settings.iter_mut().find(|s| s.name == key) {
                Some(s) => s.from = Origin::Given,
                None => self.settings.push(Setting {
                    name: key.to_string(),
                    value: serde_json::Value::String(value.to_string()),
                    from: Origin::Given,
                    note: None,
                }),
            }
        }
    }
}

/// The recipe of a step: one section per pass, in pipeline order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Recipe {
    pub passes: Vec<Section>,
}

impl Recipe {
    /// The recipe of a pipeline run: `sections` (one per pass, as the passes reported
    /// them) with the options of `spec` (the pipeline as given) marked given.
    pub fn from_run<'a, Options>(
        sections: Vec<Section>,
        given: impl IntoIterator<Item = Options>,
    ) -> Recipe
    where
        Options: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let mut passes = sections;
        for (section, options) in passes.iter_mut().zip(given) {
            section.merge_given(options);
        }
        Recipe { passes }
    }

    pub fn pass(&self, name: &str) -> Option<&Section> {
        self.passes.iter().find(|s| s.pass == name)
    }

    /// The value of `pass`'s setting `name`, as text.
    pub fn value(&self, pass: &str, name: &str) -> Option<String> {
        self.pass(pass)
            .and_then(|s| s.get(name))
            .map(|s| value_text(&s.value))
    }

    /// Reads the recipe a step records; `None` for steps written before recipes were.
    pub fn of_model(header: &crate::proto::ModelProto) -> Result<Option<Recipe>, String> {
        match header.metadata_props.iter().find(|p| p.key() == RECIPE_KEY) {
            None => Ok(None),
            Some(p) => serde_json::from_str(p.value())
                .map(Some)
                .map_err(|e| format!("metadata '{RECIPE_KEY}' is not valid: {e}")),
        }
    }

    /// The recipe as text: a line per setting, `name value (where from; note)`.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let width = self
            .passes
            .iter()
            .flat_map(|p| p.settings.iter().map(|s| s.name.len()))
            .max()
            .unwrap_or(0);
        for section in &self.passes {
            if section.settings.is_empty() {
                let _ = writeln!(out, "  {}", section.pass);
                continue;
            }
            let _ = writeln!(out, "  {}:", section.pass);
            for s in &section.settings {
                let note = s
                    .note
                    .as_deref()
                    .map(|n| format!("; {n}"))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "    {:width$}  {}  ({}{note})",
                    s.name,
                    value_text(&s.value),
                    s.from.describe()
                );
            }
        }
        out
    }

    /// The headline of the recipe: what a user asks first, derived from the sections.
    pub fn headline(&self) -> Headline {
        let optimizer = self.pass("optimizer").map(|o| {
            let mut text = o
                .get("kind")
                .map(|k| value_text(&k.value))
                .unwrap_or_default();
            let others: Vec<String> = o
                .settings
                .iter()
                .filter(|s| !matches!(s.name.as_str(), "kind" | "lr" | "fuse_small"))
                .map(|s| format!("{} {}", s.name, value_text(&s.value)))
                .collect();
            if !others.is_empty() {
                text.push_str(&format!(" ({})", others.join(", ")));
            }
            text
        });
        let agc = self.pass("agc").map(|a| {
            let get = |k: &str| {
                a.get(k)
                    .map(|s| value_text(&s.value))
                    .unwrap_or_else(|| "?".into())
            };
            format!("clip {}, eps {}", get("clip"), get("eps"))
        });
        let loss_scale = self.pass("loss-scale").map(|l| match l.get("static") {
            Some(s) => format!("static {}", value_text(&s.value)),
            None => {
                let get = |k: &str| {
                    l.get(k)
                        .map(|s| value_text(&s.value))
                        .unwrap_or_else(|| "?".into())
                };
                format!(
                    "dynamic (init {}, growth {}, backoff {}, interval {}, hysteresis {})",
                    get("init"),
                    get("growth"),
                    get("backoff"),
                    get("interval"),
                    get("hysteresis")
                )
            }
        });
        Headline {
            accum_steps: self.value("grad-accum", "steps"),
            normalize: self.value("grad-accum", "normalize"),
            apply: self.value("grad-accum", "apply"),
            bn_stats: self.value("grad-accum", "bn_stats"),
            bn_var: self.value("autodiff", "bn_var"),
            optimizer,
            learning_rate: self.value("optimizer", "lr"),
            agc: agc.unwrap_or_else(|| "off".into()),
            clip_norm: self.value("clip-norm", "max_norm"),
            loss_scale: loss_scale.unwrap_or_else(|| "none".into()),
            precision: self
                .value("precision", "dtype")
                .unwrap_or_else(|| "fp32".into()),
        }
    }
}

/// A JSON value as plain text: strings without quotes.
fn value_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(items) if items.is_empty() => "none".to_string(),
        serde_json::Value::Array(items) => {
            items.iter().map(value_text).collect::<Vec<_>>().join(";")
        }
        other => other.to_string(),
    }
}

/// The recipe's first answers, one line each in `inspect`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Headline {
    pub accum_steps: Option<String>,
    pub normalize: Option<String>,
    pub apply: Option<String>,
    pub bn_stats: Option<String>,
    /// The variance running variances move with, when the autodiff trained BatchNorm
    /// layers (`bn_var`); `None` (and not printed) otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bn_var: Option<String>,
    pub optimizer: Option<String>,
    pub learning_rate: Option<String>,
    pub agc: String,
    /// `clip-norm`'s max_norm; `None` (and not printed) without the pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_norm: Option<String>,
    pub loss_scale: String,
    pub precision: String,
}
