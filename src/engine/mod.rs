//! Engines that run ONNX graphs: ONNX Runtime through the `ort` crate, and tract (pure Rust,
//! the `tract` cargo feature, on by default). [`Engine`] is either, behind one `run`.

pub mod deferred_products;
pub mod host_scalars;
mod host_updates;
mod kept_binding;
mod kernel_io;
pub mod ort;
mod ort_ops;
#[cfg(feature = "tract")]
pub mod tract;
mod tract_ifs;

use crate::data::Tensor;
use crate::proto::ModelProto;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    #[error("ONNX Runtime: {context}: {message}")]
    Ort { context: String, message: String },
    #[error("tract: {context}: {message}")]
    Tract { context: String, message: String },
    #[error("input '{name}': {message}")]
    Input { name: String, message: String },
    #[error("output '{name}': {message}")]
    Output { name: String, message: String },
    #[error("{0}")]
    Unavailable(String),
}

/// Which engine runs a model. `Auto` is resolved by [`EngineKind::resolve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    Auto,
    Ort,
    Tract,
}

impl std::str::FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(EngineKind::Auto),
            "ort" => Ok(EngineKind::Ort),
            "tract" => Ok(EngineKind::Tract),
            other => Err(format!("unknown engine '{other}' (auto, ort, tract)")),
        }
    }
}

impl EngineKind {
    /// The word of `train --engine`.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Auto => "auto",
            EngineKind::Ort => "ort",
            EngineKind::Tract => "tract",
        }
    }
}

value_enum!(EngineKind: EngineKind::Auto, EngineKind::Ort, EngineKind::Tract);

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EngineKind {
    /// `Auto` becomes ONNX Runtime when its library is found and loads, tract otherwise
    /// (ONNX Runtime when this build has no tract, so its error says how to install it).
    /// Returns the engine and why it was chosen, for the user.
    pub fn resolve(self) -> (EngineKind, String) {
        match self {
            EngineKind::Auto => match crate::runtime::init_onnxruntime() {
                Ok(path) => (
                    EngineKind::Ort,
                    format!("ONNX Runtime found at {}", path.display()),
                ),
                // An explicit ORT_DYLIB_PATH that fails is the user's mistake, not a reason
                // to train on another engine: ONNX Runtime it is, and its error stands.
                Err(e) if explicit_dylib_path() => (
                    EngineKind::Ort,
                    format!(
                        "{} is set, so no fallback: {}",
                        crate::runtime::DYLIB_ENV,
                        summary(&e)
                    ),
                ),
                Err(e) if cfg!(feature = "tract") => (
                    EngineKind::Tract,
                    format!("ONNX Runtime not available: {}", summary(&e)),
                ),
                Err(_) => (
                    EngineKind::Ort,
                    "this build has no tract (cargo feature `tract`)".into(),
                ),
            },
            other => (other, "asked for".into()),
        }
    }
}

/// Whether `ORT_DYLIB_PATH` names a library (empty counts as unset, as in ort).
fn explicit_dylib_path() -> bool {
    std::env::var_os(crate::runtime::DYLIB_ENV).is_some_and(|v| !v.is_empty())
}

/// `e` on one line: every place searched, not only the heading (the error's own text
/// lists them one per line, and ends with how to install ONNX Runtime).
fn summary(e: &crate::runtime::RuntimeError) -> String {
    use crate::runtime::RuntimeError;
    match e {
        RuntimeError::NotFound { searched } => {
            format!(
                "its shared library was not found (searched: {})",
                searched.join("; ")
            )
        }
        other => other
            .to_string()
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
    }
}

/// A value an engine keeps between runs (the training state): in ONNX Runtime's memory, on
/// its device, or on the host (tract; and any value before its first run).
pub enum Held {
    Ort(::ort::value::DynValue),
    Host(Tensor),
}

impl Held {
    /// The value on the host (a copy).
    pub fn to_host(&self, name: &str) -> Result<Tensor, EngineError> {
        match self {
            Held::Ort(v) => ort::held_to_host(name, v),
            Held::Host(t) => Ok(t.clone()),
        }
    }

    /// The value's ONNX element type and shape, without copying its data.
    pub fn layout(&self, name: &str) -> Result<(i32, Vec<usize>), EngineError> {
        match self {
            Held::Ort(v) => ort::held_layout(name, v),
            Held::Host(t) => Ok((t.elem_type(), t.shape().to_vec())),
        }
    }

    /// `f` of the value as a host tensor: read where it is on the host, else copied there
    /// first (a run's loss and flags, read every run: no copy of a host one).
    pub fn read_host<R>(&self, name: &str, f: impl FnOnce(&Tensor) -> R) -> Result<R, EngineError> {
        match self {
            Held::Ort(v) => Ok(f(&ort::held_to_host(name, v)?)),
            Held::Host(t) => Ok(f(t)),
        }
    }
}

/// ONNX Runtime's feeds: host tensors (the `host` inputs and held ones on the host) and
/// values it holds.
#[allow(clippy::type_complexity)]
fn ort_feeds<'a>(
    host: &[(&'a str, &'a Tensor)],
    held: &[(&'a str, &'a Held)],
) -> (
    Vec<(&'a str, &'a Tensor)>,
    Vec<(&'a str, &'a ::ort::value::DynValue)>,
) {
    let mut host_feeds = host.to_vec();
    let mut ort_feeds = Vec::with_capacity(held.len());
    for (name, value) in held {
        match value {
            Held::Ort(v) => ort_feeds.push((*name, v)),
            Held::Host(t) => host_feeds.push((*name, t)),
        }
    }
    (host_feeds, ort_feeds)
}

/// `outputs` with copies of the small outputs the session's kept binding wrote into its own
/// buffers ([`ort::OrtSession::add_transient`]).
fn with_small_copies(
    s: &ort::OrtSession,
    mut outputs: Vec<(String, Held)>,
) -> Result<Vec<(String, Held)>, EngineError> {
    for (name, value) in s.transient_outputs() {
        if s.small_outputs().contains(name) {
            let copy = ort::held_to_host(name, value)?;
            outputs.push((name.clone(), Held::Host(copy)));
        }
    }
    Ok(outputs)
}

/// The part of an ONNX Runtime run the host computes ([`host_scalars`]), when the session
/// has one.
struct HostPart<'s>(Option<host_scalars::Computed<'s>>);

impl<'s> HostPart<'s> {
    fn compute(
        scalars: Option<&'s host_scalars::HostScalars>,
        host: &[(&str, &Tensor)],
        held: &[(&str, &Held)],
    ) -> Result<Self, EngineError> {
        Ok(HostPart(match scalars {
            Some(h) => Some(h.evaluate(host, held)?),
            None => None,
        }))
    }

    /// Adds what the session reads of it to the host feeds.
    fn feed<'f>(&'f self, feeds: &mut Vec<(&'f str, &'f Tensor)>) {
        if let Some(c) = &self.0 {
            feeds.extend(c.feeds.iter().map(|(n, t)| (*n, t)));
        }
    }

    /// The session's outputs, then the graph outputs the host made.
    /// The graph outputs the host computed, to read before [`Self::outputs_after`].
    fn computed_outputs(&self) -> &[(&'s str, Tensor)] {
        self.0.as_ref().map_or(&[], |c| &c.outputs)
    }

    fn outputs_after(self, session: Vec<(String, ::ort::value::DynValue)>) -> Vec<(String, Held)> {
        let mut outputs: Vec<(String, Held)> = session
            .into_iter()
            .map(|(name, v)| (name, Held::Ort(v)))
            .collect();
        if let Some(c) = self.0 {
            outputs.extend(
                c.outputs
                    .into_iter()
                    .map(|(n, t)| (n.to_string(), Held::Host(t))),
            );
        }
        outputs
    }
}

/// A session of either engine over one model.
// A trainer holds three engines at most, never a collection of them: their size is no cost.
#[allow(clippy::large_enum_variant)]
pub enum Engine {
    Ort(ort::OrtSession),
    #[cfg(feature = "tract")]
    Tract(tract::TractSession),
}

impl Engine {
    /// A session of `kind` (`Auto` resolved first) for `model`, which must be prepared for
    /// it: for tract, the ops it lacks lowered first (`passes::lower_for_tract::prepare`;
    /// the trainer does it).
    pub fn new(
        kind: EngineKind,
        model: &ModelProto,
        options: &ort::SessionOptions,
    ) -> Result<Engine, EngineError> {
        match kind.resolve().0 {
            EngineKind::Ort | EngineKind::Auto => {
                Ok(Engine::Ort(ort::OrtSession::new(model, options)?))
            }
            #[cfg(feature = "tract")]
            EngineKind::Tract => Ok(Engine::Tract(tract::TractSession::new(model, options)?)),
            #[cfg(not(feature = "tract"))]
            EngineKind::Tract => Err(EngineError::Unavailable(
                "this build has no tract engine (build with the cargo feature `tract`)".into(),
            )),
        }
    }

    pub fn kind(&self) -> EngineKind {
        match self {
            Engine::Ort(_) => EngineKind::Ort,
            #[cfg(feature = "tract")]
            Engine::Tract(_) => EngineKind::Tract,
        }
    }

    /// Names outputs the host reads every run (ONNX Runtime then returns them in CPU memory
    /// even when the session runs on a GPU).
    pub fn set_host_outputs(&mut self, names: &[&str]) {
        match self {
            Engine::Ort(s) => s.set_host_outputs(names),
            // tract returns every output on the host.
            #[cfg(feature = "tract")]
            Engine::Tract(_) => {}
        }
    }

    /// Declares the states this session updates in place and the gate input the host
    /// feeds (`passes::fuse::in_place`; ONNX Runtime only, a no-op elsewhere).
    pub fn set_in_place(&mut self, pairs: Vec<(String, String)>, keep_input: Option<String>) {
        if let Engine::Ort(s) = self {
            s.set_in_place(pairs);
            s.keep_input = keep_input;
        }
    }

    /// Optimizer updates taken out of the model, which the host runs after each run, in
    /// place on states of [`in_place`](Self::in_place) (`passes::fuse::host`; ONNX Runtime
    /// only, a no-op elsewhere).
    pub fn set_host_updates(&mut self, updates: crate::passes::fuse::host::HostUpdates) {
        if let Engine::Ort(s) = self {
            // The session's runs keep the gradients the updates read.
            s.add_transient(&updates.added_outputs);
            s.host_updates = Some(Box::new(host_updates::Prepared::new(updates)));
        }
    }

    /// How many optimizer updates the host runs after each run of this session.
    pub fn host_updates(&self) -> usize {
        match self {
            Engine::Ort(s) => s
                .host_updates
                .as_ref()
                .map_or(0, |u| u.updates.updates.len()),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Nodes of the model the session was made from that the host computes before each run
    /// ([`host_scalars::split_off`]; ONNX Runtime only, a no-op elsewhere).
    pub fn set_host_scalars(&mut self, scalars: host_scalars::HostScalars) {
        if let Engine::Ort(s) = self {
            s.set_host_scalars(scalars);
        }
    }

    /// How many nodes the host computes for this session.
    pub fn host_scalar_nodes(&self) -> usize {
        match self {
            Engine::Ort(s) => s.host_scalars().map_or(0, |h| h.node_count()),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Convolutions on ONNX Runtime's blocked kernels (`SessionOptions::nchwc_convs`).
    pub fn nchwc_convs(&self) -> usize {
        match self {
            Engine::Ort(s) => s.nchwc_convs(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// BatchNorm layers on onnx-ga's fused kernels, forward and backward counted apart
    /// (`SessionOptions::fused_batch_norm`).
    pub fn fused_batch_norms(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_batch_norms(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Exact-GELU gradients on onnx-ga's fused kernel (`SessionOptions::fused_gelu_grad`).
    pub fn fused_gelu_grads(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_gelu_grads(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Exact-GELU forwards on onnx-ga's fused kernel (`SessionOptions::fused_gelu`).
    pub fn fused_gelus(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_gelus(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Layer-norm gradients on onnx-ga's fused kernel
    /// (`SessionOptions::fused_layer_norm_grad`).
    pub fn fused_layer_norm_grads(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_layer_norm_grads(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Linear layers whose bias is added inside their `Gemm` (`SessionOptions::bias_in_gemm`).
    pub fn biases_in_gemm(&self) -> usize {
        match self {
            Engine::Ort(s) => s.biases_in_gemm(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Sums over leading axes on onnx-ga's fused kernel (`SessionOptions::fused_leading_sum`).
    pub fn fused_leading_sums(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_leading_sums(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Transposed convolutions as a product and onnx-ga's `Col2Im`
    /// (`SessionOptions::fused_col2im`).
    pub fn fused_foldings(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_foldings(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Convolutions' weight gradients on onnx-ga's `ConvWeightGrad`
    /// (`SessionOptions::fused_conv_weight_grad`).
    pub fn fused_conv_weight_grads(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_conv_weight_grads(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// Transposes on onnx-ga's `RowTranspose` (`SessionOptions::fused_transpose`).
    pub fn fused_transposes(&self) -> usize {
        match self {
            Engine::Ort(s) => s.fused_transposes(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => 0,
        }
    }

    /// The (state input, next value) pairs this session updates in place.
    pub fn in_place(&self) -> &[(String, String)] {
        match self {
            Engine::Ort(s) => s.in_place(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => &[],
        }
    }

    /// Whether the state input `name` is one of [`in_place`](Self::in_place)'s.
    pub fn updates_in_place(&self, name: &str) -> bool {
        match self {
            Engine::Ort(s) => s.updates_in_place(name),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => false,
        }
    }

    /// The gate's input ([`crate::fused_ops::KEEP_NONFINITE`]) when the session has one.
    pub fn keep_input(&self) -> Option<&str> {
        match self {
            Engine::Ort(s) => s.keep_input.as_deref(),
            #[cfg(feature = "tract")]
            Engine::Tract(_) => None,
        }
    }

    /// [`run_held`](Self::run_held) with the states of [`in_place`](Self::in_place)
    /// given apart, updated in their own buffers (made ONNX Runtime's first when they are
    /// host tensors); their outputs are not returned.
    pub fn run_held_in_place(
        &mut self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &Held)],
        in_place: &mut [(&str, &mut Held)],
    ) -> Result<Vec<(String, Held)>, EngineError> {
        if in_place.is_empty() {
            return self.run_held(host, held);
        }
        let Engine::Ort(s) = self else {
            return Err(EngineError::Input {
                name: in_place[0].0.to_string(),
                message: "in-place updates need ONNX Runtime".into(),
            });
        };
        let scalars = s.host_scalars();
        let computed = HostPart::compute(scalars.as_deref(), host, held)?;
        // Held host tensors are copied into the binding each run (the trainer makes its
        // large ones ONNX Runtime's first); the in-place ones become ONNX Runtime's here.
        let (mut host_feeds, ort_feeds) = ort_feeds(host, held);
        computed.feed(&mut host_feeds);
        let mut targets: Vec<(&str, &mut ::ort::value::DynValue)> =
            Vec::with_capacity(in_place.len());
        for (name, value) in in_place.iter_mut() {
            if let Held::Host(t) = &**value {
                let allocated = ort::to_ort_allocated(name, t)?;
                **value = Held::Ort(allocated);
            }
            if let Held::Ort(v) = &mut **value {
                targets.push((*name, v));
            }
        }
        if let Some(mut updates) = s.host_updates.take() {
            // The session reads the states as any input; the host then updates them.
            let mut feeds = ort_feeds.clone();
            feeds.extend(targets.iter().map(|(name, value)| (*name, &**value)));
            // What the session computes for the host alone (the gradients) stays in buffers
            // the session keeps, read here before the next run.
            let ran = s.run_held_transient(&host_feeds, &feeds);
            let result = ran.and_then(|mut outputs| {
                let operands = host_updates::Operands {
                    host: &host_feeds,
                    computed: computed.computed_outputs(),
                    held: &ort_feeds,
                    outputs: &outputs,
                    transient: s.transient_outputs(),
                };
                host_updates::run(&mut updates, &operands, &mut targets)?;
                // On a device the run returned them.
                outputs.retain(|(name, _)| !updates.updates.added_outputs.contains(name));
                Ok(outputs)
            });
            s.host_updates = Some(updates);
            return with_small_copies(s, computed.outputs_after(result?));
        }
        let outputs = s.run_held_in_place(&host_feeds, &ort_feeds, &mut targets)?;
        with_small_copies(s, computed.outputs_after(outputs))
    }

    /// Runs the model once on `host` inputs and `held` ones (outputs of earlier runs, kept
    /// where the engine computed them); returns every output, held, in the model's output
    /// order. Feeding outputs back this way never copies state through the host.
    pub fn run_held(
        &mut self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &Held)],
    ) -> Result<Vec<(String, Held)>, EngineError> {
        match self {
            Engine::Ort(s) => {
                let scalars = s.host_scalars();
                let computed = HostPart::compute(scalars.as_deref(), host, held)?;
                let (mut host_feeds, ort_feeds) = ort_feeds(host, held);
                computed.feed(&mut host_feeds);
                let outputs = s.run_held(&host_feeds, &ort_feeds)?;
                Ok(computed.outputs_after(outputs))
            }
            #[cfg(feature = "tract")]
            Engine::Tract(s) => {
                let mut feeds: Vec<(&str, &Tensor)> = host.to_vec();
                for (name, value) in held {
                    match value {
                        Held::Host(t) => feeds.push((*name, t)),
                        Held::Ort(_) => {
                            return Err(EngineError::Input {
                                name: name.to_string(),
                                message: "is an ONNX Runtime value; tract takes host tensors"
                                    .into(),
                            })
                        }
                    }
                }
                Ok(s.run(&feeds)?
                    .into_iter()
                    .map(|(name, t)| (name, Held::Host(t)))
                    .collect())
            }
        }
    }

    /// Runs the model once; returns every output by name, in the model's output order.
    pub fn run(
        &mut self,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, EngineError> {
        match self {
            Engine::Ort(s) => {
                let scalars = s.host_scalars();
                let computed = HostPart::compute(scalars.as_deref(), inputs, &[])?;
                let mut feeds = inputs.to_vec();
                computed.feed(&mut feeds);
                let mut outputs = s.run(&feeds)?;
                if let Some(c) = computed.0 {
                    outputs.extend(c.outputs.into_iter().map(|(n, t)| (n.to_string(), t)));
                }
                Ok(outputs)
            }
            #[cfg(feature = "tract")]
            Engine::Tract(s) => s.run(inputs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session may move to another thread (a kept binding holds buffer addresses as
    /// numbers, not pointers, for that): this fails to compile otherwise.
    #[test]
    fn an_engine_can_move_between_threads() {
        fn movable<T: Send>() {}
        movable::<Engine>();
    }

    /// The fallback note of `--engine auto` lists every place searched on its one line
    /// (it once stopped at "Searched:").
    #[test]
    fn the_fallback_note_lists_what_was_searched() {
        let e = crate::runtime::RuntimeError::NotFound {
            searched: vec![
                "ORT_DYLIB_PATH: not set".into(),
                "/x/.venv-ort: no such directory".into(),
            ],
        };
        let s = summary(&e);
        assert_eq!(
            s,
            "its shared library was not found (searched: ORT_DYLIB_PATH: not set; /x/.venv-ort: no such directory)"
        );
        assert!(!s.contains('\n'));
    }
}
