//! The recipe a step was built with: every pass of its pipeline with each setting's
//! resolved value and where it came from (given on the command line or in `--pipeline`,
//! taken from the artifacts' optimizer, or a default). `rewrite` prints it before writing
//! and records it in the step's metadata (`onnx_ga.recipe`), so `inspect STEP.onnx` shows
//! what a step does without the command that made it: K, normalisation, optimizer and
//! every hyperparameter, AGC, loss scaling, precision, BatchNorm statistics. Also here:
//! what `inspect` shows of a step besides its recipe ([`StepView`]): the state by role
//! with sizes, the control inputs' values and the engines that can run it.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::ir::{BodyId, Model};
use crate::passes::PassOptions;
use crate::state::Role;

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
    fn merge_given(&mut self, options: &PassOptions) {
        for (key, value) in options.iter() {
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
    pub fn from_run(sections: Vec<Section>, given: &[PassOptions]) -> Recipe {
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
            optimizer,
            learning_rate: self.value("optimizer", "lr"),
            agc: agc.unwrap_or_else(|| "off".into()),
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
    pub optimizer: Option<String>,
    pub learning_rate: Option<String>,
    pub agc: String,
    pub loss_scale: String,
    pub precision: String,
}

/// The state tensors of one role.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoleGroup {
    pub role: Role,
    pub tensors: usize,
    pub elements: u64,
    pub bytes: u64,
    /// Every tensor's state input name.
    pub names: Vec<String>,
}

/// A control input of the step (K, learning rate, flush) with its built-in value.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Control {
    pub input: String,
    pub what: &'static str,
    pub value: Option<String>,
}

/// Whether an engine runs the step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineFit {
    pub engine: &'static str,
    pub runs: bool,
    pub note: String,
}

/// What `inspect` shows of a rewritten step besides the signature.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepView {
    /// `None` for a step written before steps recorded their recipe.
    pub recipe: Option<Recipe>,
    pub headline: Option<Headline>,
    pub pipeline: String,
    pub version: String,
    pub state: Vec<RoleGroup>,
    pub state_bytes: u64,
    pub controls: Vec<Control>,
    pub engines: Vec<EngineFit>,
}

/// The ops of `model` (subgraphs included) that only ONNX Runtime's training build has:
/// what every standard engine lacks. Sorted, each once, as `domain::Op`.
pub fn training_only_ops(model: &Model) -> Vec<String> {
    let mut ops: Vec<String> = model
        .all_nodes()
        .map(|n| &model.node(n).proto)
        .filter(|p| crate::ops::is_training_only(p.domain(), p.op_type()))
        .map(|p| match crate::ir::normalize_domain(p.domain()) {
            "" => p.op_type().to_string(),
            d => format!("{d}::{}", p.op_type()),
        })
        .collect();
    ops.sort();
    ops.dedup();
    ops
}

/// Bytes of one element of an ONNX element type (0 when unknown).
fn elem_bytes(elem: i32) -> u64 {
    use crate::proto::tensor_proto::DataType as D;
    match D::try_from(elem) {
        Ok(D::Float | D::Int32 | D::Uint32) => 4,
        Ok(D::Double | D::Int64 | D::Uint64) => 8,
        Ok(D::Float16 | D::Bfloat16 | D::Int16 | D::Uint16) => 2,
        Ok(D::Bool | D::Int8 | D::Uint8) => 1,
        _ => 0,
    }
}

impl StepView {
    /// The view of a step model (its manifest already read into `manifest`).
    pub fn of(
        model: &Model,
        manifest: &crate::step::Manifest,
        training_only_ops: &[String],
    ) -> Result<StepView, String> {
        let recipe = Recipe::of_model(&model.header)?;
        let mut groups: Vec<RoleGroup> = Vec::new();
        for entry in &manifest.state {
            let (elements, bytes) = model
                .lookup(BodyId::MAIN, &entry.input)
                .and_then(|v| model.initializer(v))
                .map(|t| {
                    let n = t
                        .dims
                        .iter()
                        .map(|d| (*d).max(0) as u64)
                        .fold(1u64, u64::saturating_mul);
                    (n, n.saturating_mul(elem_bytes(t.data_type())))
                })
                .unwrap_or((0, 0));
            let group = match groups.iter_mut().position(|g| g.role == entry.role) {
                Some(i) => &mut groups[i],
                None => {
                    groups.push(RoleGroup {
                        role: entry.role,
                        tensors: 0,
                        elements: 0,
                        bytes: 0,
                        names: Vec::new(),
                    });
                    groups.last_mut().expect("just pushed")
                }
            };
            group.tensors += 1;
            group.elements = group.elements.saturating_add(elements);
            group.bytes = group.bytes.saturating_add(bytes);
            group.names.push(entry.input.clone());
        }
        let state_bytes = groups.iter().map(|g| g.bytes).fold(0, u64::saturating_add);
        let value_of = |name: &str| -> Option<String> {
            let v = model.lookup(BodyId::MAIN, name)?;
            let t = crate::data::Tensor::from_tensor_proto(model.initializer(v)?).ok()?;
            Some(match t {
                crate::data::Tensor::F32(a) => a.iter().next().map(|x| format!("{x}"))?,
                crate::data::Tensor::I64(a) => a.iter().next().map(|x| format!("{x}"))?,
                crate::data::Tensor::Bool(a) => a.iter().next().map(|x| format!("{x}"))?,
                _ => return None,
            })
        };
        let mut controls = Vec::new();
        if let Some(apply) = &manifest.apply {
            controls.push(Control {
                input: apply.steps.clone(),
                what: "micro-steps per window (K; train --accum-steps)",
                value: value_of(&apply.steps),
            });
        }
        if let Some(lr) = &manifest.learning_rate {
            controls.push(Control {
                input: lr.clone(),
                what: "learning rate (train --lr)",
                value: value_of(lr),
            });
        }
        if let Some(apply) = &manifest.apply {
            controls.push(Control {
                input: apply.flush.clone(),
                what: "apply a partial window now (train --flush)",
                value: value_of(&apply.flush),
            });
        }
        let headline = recipe.as_ref().map(Recipe::headline);
        let precision = headline
            .as_ref()
            .map(|h| h.precision.clone())
            .unwrap_or_else(|| "fp32".into());
        let mut engines = Vec::new();
        engines.push(match (training_only_ops.is_empty(), precision.as_str()) {
            (false, _) => EngineFit {
                engine: "ort",
                runs: false,
                note: format!(
                    "standard ONNX Runtime lacks {}",
                    training_only_ops.join(", ")
                ),
            },
            (true, "bf16") => EngineFit {
                engine: "ort",
                runs: true,
                note: "ONNX Runtime 1.31 standard ops; bf16 kernels on CUDA only (the CPU provider does not load bf16 steps)".into(),
            },
            (true, _) => EngineFit {
                engine: "ort",
                runs: true,
                note: "ONNX Runtime 1.31, standard ops only (--device cpu or cuda)".into(),
            },
        });
        let lowered = crate::passes::lower_for_tract::needs_lowering(&model.to_proto());
        let bf16 = precision == "bf16";
        engines.push(EngineFit {
            engine: "tract",
            runs: cfg!(feature = "tract") && training_only_ops.is_empty() && !bf16,
            note: match (cfg!(feature = "tract"), lowered) {
                (false, _) => "this build has no tract (feature `tract`)".into(),
                _ if !training_only_ops.is_empty() => {
                    format!("tract lacks {}", training_only_ops.join(", "))
                }
                _ if bf16 => "tract has no bfloat16".into(),
                (true, true) => "pure Rust, one thread; the ops tract lacks are lowered in memory at load (rewrite --engine tract writes them lowered)".into(),
                (true, false) => "pure Rust, one thread; no op needs lowering".into(),
            },
        });
        Ok(StepView {
            recipe,
            headline,
            pipeline: manifest.pipeline.clone(),
            version: manifest.version.clone(),
            state: groups,
            state_bytes,
            controls,
            engines,
        })
    }

    /// What to warn about when the step is written for `target` (`ort` or `tract`): the
    /// engine cannot load it (ops it lacks, or bfloat16 where it has no kernels).
    pub fn engine_warnings(&self, target: &str) -> Vec<String> {
        let bf16 = self
            .headline
            .as_ref()
            .is_some_and(|h| h.precision == "bf16");
        let mut out = Vec::new();
        for fit in self.engines.iter().filter(|f| f.engine == target) {
            if !fit.runs {
                out.push(format!(
                    "{} cannot load this step: {}",
                    fit.engine, fit.note
                ));
            } else if fit.engine == "ort" && bf16 {
                out.push(
                    "ort loads this bf16 step only with --device cuda: the CPU provider has no bfloat16 kernels for it (nor has tract)"
                        .into(),
                );
            }
        }
        out
    }

    /// The text `inspect` prints after the signature.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "step: written by onnx-ga {}", self.version);
        match &self.headline {
            None => {
                let _ = writeln!(
                    out,
                    "recipe: not recorded (a step written before onnx-ga recorded recipes); pipeline {}",
                    self.pipeline
                );
            }
            Some(h) => {
                let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "?".into());
                let _ = writeln!(out, "  K (micro-steps per window): {}", opt(&h.accum_steps));
                let _ = writeln!(out, "  normalisation: {}", opt(&h.normalize));
                let _ = writeln!(out, "  optimizer: {}", opt(&h.optimizer));
                let _ = writeln!(out, "  learning rate: {}", opt(&h.learning_rate));
                let _ = writeln!(out, "  AGC: {}", h.agc);
                let _ = writeln!(out, "  loss scale: {}", h.loss_scale);
                let _ = writeln!(out, "  precision: {}", h.precision);
                let _ = writeln!(out, "  BatchNorm statistics: {}", opt(&h.bn_stats));
                let _ = writeln!(out, "  apply region: {}", opt(&h.apply));
            }
        }
        if let Some(recipe) = &self.recipe {
            let _ = writeln!(
                out,
                "recipe (every setting; given, from the artifacts, or default):"
            );
            out.push_str(&recipe.render_text());
        }
        let _ = writeln!(
            out,
            "state: {} tensors, {} bytes",
            self.state.iter().map(|g| g.tensors).sum::<usize>(),
            self.state_bytes
        );
        let width = self
            .state
            .iter()
            .map(|g| role_name(g.role).len())
            .max()
            .unwrap_or(0);
        for g in &self.state {
            let names: Vec<&str> = g.names.iter().take(4).map(String::as_str).collect();
            let more = match g.names.len().saturating_sub(4) {
                0 => String::new(),
                n => format!(", ... ({n} more)"),
            };
            let _ = writeln!(
                out,
                "  {:width$}  {:>3} tensors {:>9} elements {:>10} bytes  {}{more}",
                role_name(g.role),
                g.tensors,
                g.elements,
                g.bytes,
                names.join(", ")
            );
        }
        if !self.controls.is_empty() {
            let _ = writeln!(out, "controls:");
            for c in &self.controls {
                let _ = writeln!(
                    out,
                    "  {} = {}  {}",
                    c.input,
                    c.value.as_deref().unwrap_or("?"),
                    c.what
                );
            }
        }
        let _ = writeln!(out, "engines:");
        for e in &self.engines {
            let _ = writeln!(
                out,
                "  {}: {}; {}",
                e.engine,
                if e.runs { "runs it" } else { "cannot run it" },
                e.note
            );
        }
        out
    }
}

fn role_name(role: Role) -> String {
    serde_json::to_value(role)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}
