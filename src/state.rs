//! The state manifest: which graph inputs are state, which output carries each one's next
//! value, and what role it plays. Recorded in the model's metadata (`onnx_ga.state`) so any
//! host can drive the training loop without knowing our naming.

use serde::{Deserialize, Serialize};

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
