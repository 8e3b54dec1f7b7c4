//! The state manifest: which graph inputs are state, which output carries each one's next
//! value, and what role it plays. Recorded in the model's metadata (`onnx_ga.state`) so any
//! host can drive the training loop without knowing our naming.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::proto::{ModelProto, StringStringEntryProto};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Param,
    Frozen,
    Accumulator,
    Moment,
    MicroStep,
    OptStep,
    WeightSum,
    LossScale,
    GrowthTracker,
    BnStat,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateEntry {
    pub input: String,
    pub output: String,
    pub role: Role,
    /// The parameter an accumulator, moment or bn_stat belongs to.
    pub param: Option<String>,
}

/// How a state starts when the step stores no initial value for it (recorded per entry of
/// `onnx_ga.state` as `"init": "zeros"`). A state without one starts at the initializer of
/// its input, as in every step written before the field existed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateInit {
    /// All zeros, of the graph input's declared element type and shape (fully static; the
    /// input has no initializer). Accumulators, optimizer moments, counters, the window's
    /// sums: the file stores nothing for them.
    Zeros,
}

/// One entry of `onnx_ga.state` as written: a [`StateEntry`] and, for a state whose
/// initial value is not stored, how it starts.
#[derive(Serialize, Deserialize)]
struct EntryJson {
    #[serde(flatten)]
    entry: StateEntry,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    init: Option<StateInit>,
}

/// The bool output saying whether a micro-step updated the parameters (the `applied`
/// metric): the window ended and, with loss scaling, its gradients were finite.
pub const APPLIED_OUTPUT: &str = "ga.applied";

/// Every metadata key of ours starts with it.
pub const KEY_PREFIX: &str = "onnx_ga.";
pub const STATE_KEY: &str = "onnx_ga.state";
pub const DATA_INPUTS_KEY: &str = "onnx_ga.data_inputs";
pub const LOSS_KEY: &str = "onnx_ga.loss";
pub const PIPELINE_KEY: &str = "onnx_ga.pipeline";
pub const VERSION_KEY: &str = "onnx_ga.version";
pub const APPLY_KEY: &str = "onnx_ga.apply";

/// What decides whether a micro-step applies the window, for steps whose apply region is
/// an `If`: `apply = micro_step + 1 >= steps or flush`, where `micro_step` is the state of
/// role `micro_step`. A host that knows this can run a specialised graph per branch
/// ([`crate::split`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApplyTrigger {
    /// The main-graph `If` node of the apply region.
    pub node: String,
    /// The int64 input holding K.
    pub steps: String,
    /// The bool input forcing the apply.
    pub flush: String,
}

pub const LEARNING_RATE_KEY: &str = "onnx_ga.learning_rate";

/// In a specialisation written by `rewrite --split` ([`crate::split::standalone`]): which
/// branch it is (`accumulate` or `apply`), and the state inputs it leaves unchanged (JSON
/// list; it has no output for them).
pub const SPECIALISATION_KEY: &str = "onnx_ga.specialisation";
pub const UNCHANGED_KEY: &str = "onnx_ga.unchanged";

/// A model that is not a step `onnx-ga rewrite` wrote, or whose manifest does not fit its
/// graph: what is wrong, in words.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotAStep(pub String);

/// What a host needs to drive a rewritten step, read from (and written to) its metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub state: Vec<StateEntry>,
    pub data_inputs: Vec<String>,
    pub loss: String,
    pub pipeline: String,
    pub version: String,
    /// When the step's apply region is an `If`: what decides its branch.
    pub apply: Option<ApplyTrigger>,
    /// The float scalar input holding the learning rate (a host may schedule it).
    pub learning_rate: Option<String>,
    /// State inputs whose initial value the step does not store, and how each starts
    /// (`"init"` in their `onnx_ga.state` entry). Every other state starts at its input's
    /// initializer. Empty for steps written before the field existed.
    pub init: BTreeMap<String, StateInit>,
}

impl Manifest {
    /// Reads the manifest of a rewritten step model.
    pub fn from_model(model: &ModelProto) -> Result<Manifest, NotAStep> {
        let get = |key: &str| {
            model
                .metadata_props
                .iter()
                .find(|p| p.key() == key)
                .map(|p| p.value().to_string())
                .ok_or_else(|| NotAStep(format!("metadata '{key}' is missing: not a step graph written by `onnx-ga rewrite`")))
        };
        let json =
            |key: &str, text: String| NotAStep(format!("metadata '{key}' is not valid: {text}"));
        if let Ok(branch) = get(SPECIALISATION_KEY) {
            return Err(NotAStep(format!(
                "this is the '{branch}' specialisation of a step (written by `rewrite --split` \
                 for hosts of their own); train or inspect the step itself"
            )));
        }
        let state_text = get(STATE_KEY)?;
        let data_text = get(DATA_INPUTS_KEY)?;
        let entries: Vec<EntryJson> =
            serde_json::from_str(&state_text).map_err(|e| json(STATE_KEY, e.to_string()))?;
        let init = entries
            .iter()
            .filter_map(|e| Some((e.entry.input.clone(), e.init?)))
            .collect();
        let manifest = Manifest {
            state: entries.into_iter().map(|e| e.entry).collect(),
            init,
            data_inputs: serde_json::from_str(&data_text)
                .map_err(|e| json(DATA_INPUTS_KEY, e.to_string()))?,
            loss: get(LOSS_KEY)?,
            pipeline: get(PIPELINE_KEY).unwrap_or_default(),
            version: get(VERSION_KEY).unwrap_or_default(),
            apply: match get(APPLY_KEY) {
                Ok(text) => {
                    Some(serde_json::from_str(&text).map_err(|e| json(APPLY_KEY, e.to_string()))?)
                }
                Err(_) => None,
            },
            learning_rate: get(LEARNING_RATE_KEY).ok(),
        };
        if manifest.state.is_empty() {
            return Err(NotAStep(format!(
                "metadata '{}' lists no state (no parameters, no counters): there is nothing \
                 to train",
                STATE_KEY
            )));
        }
        // Every name the manifest gives is the graph's: a host feeds and reads them. (A
        // header without its graph, e.g. `ir::Model::header`, has nothing to check.)
        if let Some(graph) = model.graph.as_ref() {
            let inputs: std::collections::HashSet<&str> =
                graph.input.iter().map(|i| i.name()).collect();
            let outputs: std::collections::HashSet<&str> =
                graph.output.iter().map(|o| o.name()).collect();
            let missing = |what: &str, name: &str, side: &str| {
                NotAStep(format!(
                    "metadata '{}': {what} '{name}' is not a graph {side} of the step",
                    STATE_KEY
                ))
            };
            for e in &manifest.state {
                if !inputs.contains(e.input.as_str()) {
                    return Err(missing("state input", &e.input, "input"));
                }
                if !outputs.contains(e.output.as_str()) {
                    return Err(missing("state output", &e.output, "output"));
                }
            }
            for d in &manifest.data_inputs {
                if !inputs.contains(d.as_str()) {
                    return Err(missing("data input", d, "input"));
                }
            }
        }
        Ok(manifest)
    }

    /// The manifest as metadata entries (key, value), in a fixed order.
    pub fn metadata(&self) -> Vec<StringStringEntryProto> {
        let mut entries = vec![
            (STATE_KEY, self.state_json()),
            (
                DATA_INPUTS_KEY,
                serde_json::to_string(&self.data_inputs).expect("names serialize"),
            ),
            (LOSS_KEY, self.loss.clone()),
            (PIPELINE_KEY, self.pipeline.clone()),
            (VERSION_KEY, self.version.clone()),
        ];
        if let Some(trigger) = &self.apply {
            let trigger = serde_json::to_string(trigger).expect("trigger serializes");
            entries.push((APPLY_KEY, trigger));
        }
        if let Some(name) = &self.learning_rate {
            entries.push((LEARNING_RATE_KEY, name.clone()));
        }
        entries
            .into_iter()
            .map(|(key, value)| StringStringEntryProto {
                key: Some(key.into()),
                value: Some(value),
            })
            .collect()
    }

    /// The `onnx_ga.state` value: the entries, each with its `init` where it has one.
    fn state_json(&self) -> String {
        let entries: Vec<EntryJson> = self
            .state
            .iter()
            .map(|e| EntryJson {
                entry: e.clone(),
                init: self.init.get(&e.input).copied(),
            })
            .collect();
        serde_json::to_string(&entries).expect("state serializes")
    }

    /// How state `input` starts: `Some` where the step stores no initial value for it.
    pub fn init_of(&self, input: &str) -> Option<StateInit> {
        self.init.get(input).copied()
    }

    /// Replaces the `onnx_ga.*` entries of a model's metadata with this manifest.
    pub fn write_into(&self, props: &mut Vec<StringStringEntryProto>) {
        props.retain(|p| !p.key().starts_with(KEY_PREFIX));
        props.extend(self.metadata());
    }
}

/// The verifier's invariants ([`crate::ir::verify::verify`]) and the state manifest's,
/// every violation collected: when the model records training state (`onnx_ga.state`),
/// each state input is a graph input, appears once, and has its own next value, a graph
/// output.
pub fn verify_step(model: &crate::ir::Model) -> Result<(), crate::ir::verify::VerifyErrors> {
    use crate::ir::verify::{verify, VerifyError, VerifyErrors};
    use std::collections::HashSet;
    let mut errors = match verify(model) {
        Ok(()) => Vec::new(),
        Err(VerifyErrors(errors)) => errors,
    };
    let entry = model
        .header
        .metadata_props
        .iter()
        .find(|p| p.key() == STATE_KEY);
    if let Some(entry) = entry {
        match serde_json::from_str::<Vec<serde_json::Value>>(entry.value()) {
            Err(e) => errors.push(VerifyError {
                location: format!("metadata '{STATE_KEY}'"),
                message: format!("is not a JSON array: {e}"),
            }),
            Ok(entries) => {
                let main = model.main();
                let inputs: HashSet<&str> =
                    main.inputs.iter().map(|(v, _)| model.name(*v)).collect();
                let outputs: HashSet<&str> =
                    main.outputs.iter().map(|(v, _)| model.name(*v)).collect();
                let mut seen_in = HashSet::new();
                let mut seen_out = HashSet::new();
                for e in &entries {
                    let input = e.get("input").and_then(|x| x.as_str()).unwrap_or("");
                    let output = e.get("output").and_then(|x| x.as_str()).unwrap_or("");
                    let location = format!("state '{input}'");
                    let mut fail = |message: String| {
                        errors.push(VerifyError {
                            location: location.clone(),
                            message,
                        })
                    };
                    if !inputs.contains(input) {
                        fail("is not a graph input".into());
                    }
                    if !outputs.contains(output) {
                        fail(format!("its next value '{output}' is not a graph output"));
                    }
                    if !seen_in.insert(input.to_string()) {
                        fail("appears twice in the state manifest".into());
                    }
                    if !seen_out.insert(output.to_string()) {
                        fail(format!("output '{output}' is the next value of two states"));
                    }
                    if let Some(init) = e.get("init") {
                        let value = model.lookup(crate::ir::BodyId::MAIN, input);
                        match serde_json::from_value::<StateInit>(init.clone()) {
                            Err(e) => fail(format!("its init {init} is not valid: {e}")),
                            Ok(StateInit::Zeros) => {
                                if value.is_some_and(|v| model.initializer(v).is_some()) {
                                    fail("starts at zeros (init) but has an initializer".into());
                                }
                                let ty = value.and_then(|v| model.value_type(v));
                                if ty.as_ref().and_then(static_tensor_type).is_none() {
                                    fail("starts at zeros (init) but its declared type is not a tensor of static shape".into());
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(VerifyErrors(errors))
    }
}

/// The element type and dims of a tensor type whose every dimension is a known size.
pub fn static_tensor_type(ty: &crate::proto::TypeProto) -> Option<(i32, Vec<i64>)> {
    use crate::proto::tensor_shape_proto::dimension::Value as Dim;
    use crate::proto::type_proto::Value;
    let Some(Value::TensorType(t)) = ty.value.as_ref() else {
        return None;
    };
    let dims = t
        .shape
        .as_ref()?
        .dim
        .iter()
        .map(|d| match d.value {
            Some(Dim::DimValue(v)) if v >= 0 => Some(v),
            _ => None,
        })
        .collect::<Option<Vec<i64>>>()?;
    (t.elem_type() != 0).then_some((t.elem_type(), dims))
}
