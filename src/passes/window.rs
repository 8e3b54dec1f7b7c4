//! The window: where the once-per-window work (normalised gradients, clipping, the
//! optimizer update, zeroing accumulators) lives, and how state leaves it.
//!
//! `grad-accum` opens the window; `optimizer`, `agc`, `loss-scale` and the BatchNorm
//! lowering add to it through this contract only. Two forms:
//!
//! - `If` (default): `If(apply)` with a then-branch holding the update math; the
//!   else-branch passes every state through unchanged. Nothing of the optimizer runs on
//!   micro-steps that do not apply.
//! - `Where`: the update math runs in the main graph every micro-step and each state's
//!   next value is `Where(apply, updated, otherwise)`. Kept for comparison.
//!
//! Every piece of state the window updates is declared through it in one call
//! ([`Window::declare`], [`Window::declare_running`]): the state input with its initial
//! value, its routing and its manifest entry. The window keeps each slot it hands out, so
//! that a gate set later ([`Window::set_gate`]) reaches the states already set, and a slot
//! cannot be set twice. Routing: a main-graph output carries the state's next value, which
//! is the value given to [`Window::set_next`] when the window applies and `otherwise` (the
//! unchanged value, or the running accumulation) when not.
//!
//! The window also owns its trigger (the micro-step and optimizer-step counters, the
//! `ga.accum_steps` and `ga.flush` inputs: [`Trigger`]) and the `ga.applied` metric.

use crate::ir::{builder::Builder, tensor_type, BodyId, IrError, Model, NodeId, ValueId};
use crate::proto::tensor_proto::DataType;
use crate::proto::{TensorProto, TypeProto};
use crate::state::{Role, StateEntry};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyMode {
    If,
    Where,
}

impl ApplyMode {
    /// The word in grad-accum's `apply=` option and `--apply`.
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyMode::If => "if",
            ApplyMode::Where => "where",
        }
    }
}

impl std::str::FromStr for ApplyMode {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "if" => Ok(ApplyMode::If),
            "where" => Ok(ApplyMode::Where),
            other => Err(format!("apply={other}: expected if or where")),
        }
    }
}

value_enum!(ApplyMode: ApplyMode::If, ApplyMode::Where);

/// The provenance of the nodes the window itself makes.
pub const PASS: &str = "grad-accum";

/// A misuse of the window by a pass (a bug in that pass, not the user's mistake); the
/// pass turns it into its own error with [`WindowError::in_pass`].
#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    #[error("state '{0}' already has its next value")]
    AlreadySet(String),
    #[error("state '{0}' is deferred: its next value is set with set_deferred")]
    NotRouted(String),
    #[error("the window is already gated")]
    AlreadyGated,
    #[error("the window is already optimized: gate it before the optimizer fills it")]
    GateAfterOptimizer,
    #[error("the window has no ga.applied output (grad-accum publishes it)")]
    NoAppliedOutput,
    #[error("the placeholder of state '{state}': {error}")]
    Placeholder { state: String, error: IrError },
}

impl WindowError {
    pub fn in_pass(self, pass: &str) -> super::PassError {
        super::PassError::Other {
            pass: pass.into(),
            message: self.to_string(),
        }
    }
}

/// The window's trigger, in the main graph: the control inputs `ga.accum_steps` (K) and
/// `ga.flush`, the counters `ga.micro_step` and `ga.opt_step`, and
/// `apply = micro_step + 1 >= K or flush`. Made before the [`Window`] (which routes the
/// counters) so that grad-accum can compute its per-micro-step weight in between, where it
/// always was (the step's node order, and so its bytes, depend on it).
pub struct Trigger {
    window_size: ValueId,
    flush: ValueId,
    micro_step: ValueId,
    opt_step: ValueId,
    count: ValueId,
    apply: ValueId,
}

impl Trigger {
    /// The control inputs (K defaults to `steps`), the counters, starting at 0, and the
    /// apply flag.
    pub fn new(model: &mut Model, steps: i64) -> Trigger {
        use crate::ir::builder::{tensor_bool, tensor_i64};
        let main = BodyId::MAIN;
        let window_size = model.add_input(
            main,
            "ga.accum_steps",
            tensor_type(DataType::Int64 as i32, &[]),
            Some(tensor_i64(&[], &[steps])),
        );
        let flush = model.add_input(
            main,
            "ga.flush",
            tensor_type(DataType::Bool as i32, &[]),
            Some(tensor_bool(&[], &[false])),
        );
        let micro_step = state_input(model, "ga.micro_step", tensor_i64(&[], &[0]));
        let opt_step = state_input(model, "ga.opt_step", tensor_i64(&[], &[0]));
        let mut b = Builder::new(model, main, PASS);
        let one = b.scalar_i64("ga.one", 1);
        let count = b.op("Add", &[micro_step, one], vec![], "ga.count");
        let full = b.op(
            "GreaterOrEqual",
            &[count, window_size],
            vec![],
            "ga.window_full",
        );
        let apply = b.op("Or", &[full, flush], vec![], "ga.apply");
        Trigger {
            window_size,
            flush,
            micro_step,
            opt_step,
            count,
            apply,
        }
    }

    /// Micro-steps accumulated in this window, this one included (int64 scalar).
    pub fn count(&self) -> ValueId {
        self.count
    }

    /// True on the micro-step that completes a window (or is flushed).
    pub fn apply(&self) -> ValueId {
        self.apply
    }
}

/// A new main-graph input named after `name` with `init` as its default value.
fn state_input(model: &mut Model, name: &str, init: TensorProto) -> ValueId {
    let ty = tensor_type(init.data_type(), &init.dims);
    model.add_input(BodyId::MAIN, name, ty, Some(init))
}

/// A piece of state to declare: its input, its role, and the parameter it belongs to.
pub struct StateDecl<'a> {
    input: DeclInput<'a>,
    role: Role,
    param: Option<&'a str>,
}

enum DeclInput<'a> {
    New {
        name: &'a str,
        init: Box<TensorProto>,
    },
    Existing(ValueId),
}

impl<'a> StateDecl<'a> {
    /// A new main-graph input named after `name`, starting at `init`.
    pub fn new(name: &'a str, init: TensorProto, role: Role) -> Self {
        StateDecl {
            input: DeclInput::New {
                name,
                init: Box::new(init),
            },
            role,
            param: None,
        }
    }

    /// An input the graph already has (a parameter, a running statistic), starting at the
    /// model's value.
    pub fn existing(input: ValueId, role: Role) -> Self {
        StateDecl {
            input: DeclInput::Existing(input),
            role,
            param: None,
        }
    }

    /// The parameter (or running statistic) the state belongs to, for the manifest.
    pub fn of(mut self, param: &'a str) -> Self {
        self.param = Some(param);
        self
    }
}

/// A state the window routes: a handle to the slot the window keeps.
#[derive(Clone, Copy, Debug)]
pub struct StateSlot {
    index: usize,
    input: ValueId,
}

impl StateSlot {
    /// The state's input (its current value, in the main graph).
    pub fn input(&self) -> ValueId {
        self.input
    }
}

/// A state declared with [`Window::declare_deferred`], to be routed and set once with
/// [`Window::set_deferred`].
#[derive(Debug)]
pub struct DeferredSlot {
    index: usize,
    input: ValueId,
    role: Role,
    param: Option<String>,
}

impl DeferredSlot {
    /// The state's input (its current value, in the main graph).
    pub fn input(&self) -> ValueId {
        self.input
    }
}

#[derive(Clone, Debug)]
struct Slot {
    input: ValueId,
    /// `None` until a deferred state is routed ([`Window::set_deferred`]).
    target: Option<SlotTarget>,
    /// Whether a gate holds this state back: `Param`, `Moment`, `OptStep` and the running
    /// statistics of `BnStat` (not the window's sums of batch statistics, which reset like
    /// accumulators).
    held_back: bool,
    /// Whether [`Window::set_next`] has given it its next value.
    set: bool,
}

#[derive(Clone, Copy, Debug)]
enum SlotTarget {
    /// Output `index` of the then-branch.
    ThenOutput(usize),
    /// Input 1 of this `Where` node.
    WhereInput(NodeId),
}

#[derive(Clone, Copy, Debug)]
enum Form {
    If { node: NodeId, else_body: BodyId },
    Where,
}

/// One trainable parameter as the window sees it.
#[derive(Clone, Debug)]
pub struct Param {
    name: String,
    value: ValueId,
    grad: ValueId,
    slot: StateSlot,
    elem_type: i32,
    dims: Vec<i64>,
}

impl Param {
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The parameter's current value (a main-graph input).
    pub fn value(&self) -> ValueId {
        self.value
    }
    /// The window's normalised gradient, inside [`Window::body`].
    pub fn grad(&self) -> ValueId {
        self.grad
    }
    /// Passes that transform the gradient (AGC, unscaling) replace it; the optimizer reads
    /// the last one.
    pub fn set_grad(&mut self, grad: ValueId) {
        self.grad = grad;
    }
    /// Where the parameter's next value goes.
    pub fn slot(&self) -> StateSlot {
        self.slot
    }
    pub fn elem_type(&self) -> i32 {
        self.elem_type
    }
    pub fn dims(&self) -> &[i64] {
        &self.dims
    }
}

#[derive(Debug)]
pub struct Window {
    form: Form,
    /// True on the micro-step that completes a window (or is flushed).
    apply: ValueId,
    /// Where update math goes: the then-branch, or the main graph for `Where`.
    body: BodyId,
    params: Vec<Param>,
    /// `opt_step + 1`, the step being taken, inside `body`: bias correction counts it.
    step: ValueId,
    /// Micro-steps accumulated in this window, this one included (int64 scalar, main graph).
    count: ValueId,
    /// K (int64) and the flush flag (bool): with the micro-step counter they decide
    /// `apply`; recorded in the manifest so that a host can tell, before a run, which
    /// branch it takes (see [`crate::split`]).
    window_size: ValueId,
    flush: ValueId,
    slots: Vec<Slot>,
    /// Whether the window's update may happen (bool scalar in `body`), set by `loss-scale`
    /// through [`set_gate`](Self::set_gate). `None`: no gating, graphs unchanged.
    gate: Option<ValueId>,
    /// The `Identity` that produces the `ga.applied` output, once published.
    applied: Option<NodeId>,
    /// Set by `agc` once it has clipped gradients: loss scaling must unscale before that,
    /// or AGC would clip scaled gradients.
    clipped: bool,
    /// The float scalar input holding the learning rate, set by the optimizer (a window
    /// nobody optimised would train nothing): recorded in the manifest so that a host can
    /// schedule it.
    learning_rate: Option<ValueId>,
}

impl Window {
    /// Opens the window on `trigger`: an `If(apply)` (or nothing yet for `Where`), the step
    /// counter `opt_step + 1`, and the counters routed: the micro-step counter restarts at 0
    /// and the optimizer-step counter advances when the window applies.
    pub fn open(
        model: &mut Model,
        mode: ApplyMode,
        trigger: Trigger,
        state: &mut Vec<StateEntry>,
    ) -> Result<Window, WindowError> {
        let main = BodyId::MAIN;
        let apply = trigger.apply;
        let (body, form) = match mode {
            ApplyMode::If => {
                let mut b = Builder::new(model, main, PASS);
                let node = b.node("If", "", &[Some(apply)], &[], Vec::new());
                model.node_mut(node).proto.name = Some(model.names.fresh("ga.apply_window"));
                let then_body = model.add_subgraph(node, "then_branch");
                let else_body = model.add_subgraph(node, "else_branch");
                (then_body, Form::If { node, else_body })
            }
            ApplyMode::Where => (main, Form::Where),
        };
        let mut b = Builder::new(model, body, PASS);
        let one = b.scalar_i64("ga.one", 1);
        let step = b.op("Add", &[trigger.opt_step, one], vec![], "ga.step");
        let mut window = Window {
            form,
            apply,
            body,
            params: Vec::new(),
            step,
            count: trigger.count,
            window_size: trigger.window_size,
            flush: trigger.flush,
            slots: Vec::new(),
            gate: None,
            applied: None,
            clipped: false,
            learning_rate: None,
        };
        let micro = window.route(
            model,
            trigger.micro_step,
            trigger.count,
            Role::MicroStep,
            None,
            state,
            None,
        );
        let zero = window.builder(model, PASS).scalar_i64("ga.zero_steps", 0);
        window.set_next(model, micro, zero)?;
        let opt = window.route(
            model,
            trigger.opt_step,
            trigger.opt_step,
            Role::OptStep,
            None,
            state,
            None,
        );
        window.set_next(model, opt, step)?;
        Ok(window)
    }

    /// Declares a state that keeps its value when the window does not apply (parameters,
    /// optimizer moments, running statistics): its input (new, or one the graph has), its
    /// routing and its manifest entry in `state`. Its next value comes from
    /// [`set_next`](Self::set_next).
    pub fn declare(
        &mut self,
        model: &mut Model,
        state: &mut Vec<StateEntry>,
        decl: StateDecl<'_>,
    ) -> StateSlot {
        let (input, role, param) = decl.materialise(model);
        self.route(model, input, input, role, param, state, None)
    }

    /// Declares a state that keeps its value when the window does not apply, like
    /// [`declare`](Self::declare), but routes it (output and manifest entry) only when its
    /// next value is set ([`set_deferred`](Self::set_deferred)). For a state read before
    /// the math that computes its next value (the loss scale: the seed is scaled by it at
    /// every micro-step): routed at once, its `Where` (apply=where) would be made before
    /// that math, and as the export orders nodes by when they were made wherever the
    /// dependencies allow, the step would no longer be the same bytes as before.
    pub fn declare_deferred(&mut self, model: &mut Model, decl: StateDecl<'_>) -> DeferredSlot {
        let (input, role, param) = decl.materialise(model);
        self.slots.push(Slot {
            input,
            target: None,
            held_back: false,
            set: false,
        });
        DeferredSlot {
            index: self.slots.len() - 1,
            input,
            role,
            param: param.map(str::to_string),
        }
    }

    /// Routes a deferred state (its manifest entry in `state`) and sets its next value
    /// (as [`set_next`](Self::set_next)).
    pub fn set_deferred(
        &mut self,
        model: &mut Model,
        state: &mut Vec<StateEntry>,
        slot: DeferredSlot,
        next: ValueId,
    ) -> Result<(), WindowError> {
        let DeferredSlot {
            index,
            input,
            role,
            param,
        } = slot;
        let routed = self.route(
            model,
            input,
            input,
            role,
            param.as_deref(),
            state,
            Some(index),
        );
        self.set_next(model, routed, next)
    }

    /// The first state declared but never given its next value, if any (a pass's bug: its
    /// output would carry a placeholder, or a deferred one would not be state at all).
    pub fn unset_state(&self, model: &Model) -> Option<String> {
        self.slots
            .iter()
            .find(|s| !s.set)
            .map(|s| model.name(s.input).to_string())
    }

    /// Declares a state that runs on every micro-step (accumulators, the window's sums):
    /// as [`declare`](Self::declare), with `running(model, input)` (main graph) as the
    /// value it carries when the window does not apply. Returns the slot and that value.
    pub fn declare_running(
        &mut self,
        model: &mut Model,
        state: &mut Vec<StateEntry>,
        decl: StateDecl<'_>,
        running: impl FnOnce(&mut Model, ValueId) -> ValueId,
    ) -> (StateSlot, ValueId) {
        let (input, role, param) = decl.materialise(model);
        let otherwise = running(model, input);
        let slot = self.route(model, input, otherwise, role, param, state, None);
        (slot, otherwise)
    }

    /// A main-graph output named `<input>.next` that carries `otherwise` when the window
    /// does not apply, and the value given to [`set_next`](Self::set_next) (until then
    /// `otherwise` too) when it does; the state pair recorded in `state`.
    #[allow(clippy::too_many_arguments)]
    fn route(
        &mut self,
        model: &mut Model,
        input: ValueId,
        otherwise: ValueId,
        role: Role,
        param: Option<&str>,
        state: &mut Vec<StateEntry>,
        into: Option<usize>,
    ) -> StateSlot {
        let ty: Option<TypeProto> = model.value_type(input);
        let name = model.name(input).to_string();
        let hint = format!("{name}.next");
        let (output, target) = match self.form {
            Form::If { node, else_body } => {
                let out = model.add_node_output(node, &hint);
                let passthrough = Builder::new(model, else_body, PASS).op(
                    "Identity",
                    &[otherwise],
                    vec![],
                    &format!("{name}.kept"),
                );
                model.add_output(else_body, passthrough, ty.clone());
                let placeholder = Builder::new(model, self.body, PASS).op(
                    "Identity",
                    &[otherwise],
                    vec![],
                    &format!("{name}.pending"),
                );
                let index = model.body(self.body).outputs.len();
                model.add_output(self.body, placeholder, ty.clone());
                (out, SlotTarget::ThenOutput(index))
            }
            Form::Where => {
                let mut b = Builder::new(model, BodyId::MAIN, PASS);
                let node = b.node(
                    "Where",
                    "",
                    &[Some(self.apply), Some(otherwise), Some(otherwise)],
                    &[&hint],
                    Vec::new(),
                );
                (model.output(node, 0), SlotTarget::WhereInput(node))
            }
        };
        model.add_output(BodyId::MAIN, output, ty);
        state.push(StateEntry {
            input: name.clone(),
            output: model.name(output).to_string(),
            role,
            param: param.map(str::to_string),
        });
        // A running statistic is its own parameter; the window's sums name the statistic.
        let held_back = matches!(role, Role::Param | Role::Moment | Role::OptStep)
            || (role == Role::BnStat && param == Some(name.as_str()));
        let slot = Slot {
            input,
            target: Some(target),
            held_back,
            set: false,
        };
        let index = match into {
            Some(index) => {
                self.slots[index] = slot;
                index
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        };
        StateSlot { index, input }
    }

    /// Sets the value a routed state takes when the window applies (`next` lives in
    /// [`body`](Self::body)); once per state. Under a [`gate`](Self::set_gate), a state it
    /// holds back gets `Where(gate, next, input)` instead.
    pub fn set_next(
        &mut self,
        model: &mut Model,
        slot: StateSlot,
        next: ValueId,
    ) -> Result<(), WindowError> {
        let s = &self.slots[slot.index];
        if s.set {
            return Err(WindowError::AlreadySet(model.name(s.input).to_string()));
        }
        let (Some(target), input, held_back) = (s.target, s.input, s.held_back) else {
            return Err(WindowError::NotRouted(model.name(s.input).to_string()));
        };
        let next = self.gate_value(model, input, held_back, next);
        match target {
            SlotTarget::ThenOutput(index) => {
                let placeholder = model.body(self.body).outputs[index].0;
                model.set_output(self.body, index, next);
                if let Some((node, _)) = model.producer(placeholder) {
                    model
                        .remove_node(node)
                        .map_err(|error| WindowError::Placeholder {
                            state: model.name(input).to_string(),
                            error,
                        })?;
                }
            }
            SlotTarget::WhereInput(node) => model.set_input(node, 1, Some(next)),
        }
        self.slots[slot.index].set = true;
        Ok(())
    }

    /// `next`, or `Where(gate, next, input)` for a held-back state under a gate.
    fn gate_value(
        &self,
        model: &mut Model,
        input: ValueId,
        held_back: bool,
        next: ValueId,
    ) -> ValueId {
        match self.gate {
            Some(gate) if held_back => {
                let hint = format!("{}.if_finite", model.name(input));
                Builder::new(model, self.body, "loss-scale").op(
                    "Where",
                    &[gate, next, input],
                    vec![],
                    &hint,
                )
            }
            _ => next,
        }
    }

    /// Gates the window's update on `gate` (bool scalar in `body`), once, before the
    /// optimizer fills the window. Parameters, optimizer moments, the optimizer-step
    /// counter and the BatchNorm statistics the window moves (`bn_stats=window`) then take
    /// their next value only if it is true, else keep their old one bit for bit (a poisoned
    /// window must not reach the running statistics either); accumulators, micro-step
    /// counter and weight sum reset as on any window. (With `bn_stats=micro` the statistics
    /// move at every micro-step, outside the window, and are not gated.) The held-back
    /// states already set (the optimizer-step counter) are gated here, those set later by
    /// [`set_next`](Self::set_next).
    pub fn set_gate(&mut self, model: &mut Model, gate: ValueId) -> Result<(), WindowError> {
        if self.gate.is_some() {
            return Err(WindowError::AlreadyGated);
        }
        if self.optimized() {
            return Err(WindowError::GateAfterOptimizer);
        }
        self.gate = Some(gate);
        for i in 0..self.slots.len() {
            let s = &self.slots[i];
            let (Some(target), true, true) = (s.target, s.held_back, s.set) else {
                continue;
            };
            let input = s.input;
            let current = match target {
                SlotTarget::ThenOutput(index) => model.body(self.body).outputs[index].0,
                SlotTarget::WhereInput(node) => {
                    match model.node(node).inputs.get(1).copied().flatten() {
                        Some(current) => current,
                        None => continue,
                    }
                }
            };
            let next = self.gate_value(model, input, true, current);
            match target {
                SlotTarget::ThenOutput(index) => model.set_output(self.body, index, next),
                SlotTarget::WhereInput(node) => model.set_input(node, 1, Some(next)),
            }
        }
        Ok(())
    }

    /// Adds a trainable parameter: `value` routed as `Param` state, with the window's
    /// normalised gradient `grad` (in `body`).
    #[allow(clippy::too_many_arguments)]
    pub fn add_param(
        &mut self,
        model: &mut Model,
        state: &mut Vec<StateEntry>,
        name: String,
        value: ValueId,
        grad: ValueId,
        elem_type: i32,
        dims: Vec<i64>,
    ) {
        let slot = self.declare(
            model,
            state,
            StateDecl::existing(value, Role::Param).of(&name),
        );
        self.params.push(Param {
            name,
            value,
            grad,
            slot,
            elem_type,
            dims,
        });
    }

    /// The `ga.applied` metric: the apply flag, a main-graph output (grad-accum publishes it
    /// last, after the state outputs; loss-scale narrows it with [`gate_applied`]).
    ///
    /// [`gate_applied`]: Self::gate_applied
    pub fn publish_applied(&mut self, model: &mut Model) {
        let main = BodyId::MAIN;
        let out = Builder::new(model, main, PASS).op(
            "Identity",
            &[self.apply],
            vec![],
            crate::state::APPLIED_OUTPUT,
        );
        model.add_output(main, out, Some(tensor_type(DataType::Bool as i32, &[])));
        self.applied = model.producer(out).map(|(node, _)| node);
    }

    /// Makes `ga.applied` true only where the window applies and `flag` (bool scalar of
    /// `body`) holds; returns that value (main graph). The flag leaves the window as
    /// `hint`: an output of the `If` (false on micro-steps that do not apply), or
    /// `And(apply, flag)`.
    pub fn gate_applied(
        &mut self,
        model: &mut Model,
        flag: ValueId,
        hint: &str,
    ) -> Result<ValueId, WindowError> {
        let node = self.applied.ok_or(WindowError::NoAppliedOutput)?;
        let applied = match self.form {
            Form::If {
                node: if_node,
                else_body,
            } => {
                let ty = Some(tensor_type(DataType::Bool as i32, &[]));
                let out = model.add_node_output(if_node, hint);
                let kept = Builder::new(model, else_body, PASS).op(
                    "Identity",
                    &[self.apply],
                    vec![],
                    &format!("{hint}.kept"),
                );
                model.add_output(else_body, kept, ty.clone());
                model.add_output(self.body, flag, ty);
                out
            }
            Form::Where => {
                Builder::new(model, BodyId::MAIN, PASS).op("And", &[self.apply, flag], vec![], hint)
            }
        };
        model.set_input(node, 0, Some(applied));
        Ok(applied)
    }

    /// A builder emitting into the window's body.
    pub fn builder<'m>(&self, model: &'m mut Model, pass: &'static str) -> Builder<'m> {
        Builder::new(model, self.body, pass)
    }

    /// Where update math goes: the then-branch, or the main graph for `Where`.
    pub fn body(&self) -> BodyId {
        self.body
    }

    /// True on the micro-step that completes a window (or is flushed); main graph.
    pub fn apply(&self) -> ValueId {
        self.apply
    }

    /// Micro-steps accumulated in this window, this one included (int64 scalar, main graph).
    pub fn count(&self) -> ValueId {
        self.count
    }

    /// `opt_step + 1`, the optimizer step being taken (int64 scalar in `body`).
    pub fn step(&self) -> ValueId {
        self.step
    }

    /// The trainable parameters, in the signature's order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The parameters, to replace their gradients ([`Param::set_grad`]).
    pub fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }

    /// Whether an optimizer filled the window.
    pub fn optimized(&self) -> bool {
        self.learning_rate.is_some()
    }

    /// Records that the optimizer filled the window, reading its learning rate from `lr`.
    pub fn mark_optimized(&mut self, lr: ValueId) {
        self.learning_rate = Some(lr);
    }

    /// The learning-rate input, once optimized.
    pub fn learning_rate(&self) -> Option<ValueId> {
        self.learning_rate
    }

    /// Whether AGC clipped the gradients.
    pub fn clipped(&self) -> bool {
        self.clipped
    }

    pub fn mark_clipped(&mut self) {
        self.clipped = true;
    }

    /// Whether loss-scale gated the update.
    pub fn gated(&self) -> bool {
        self.gate.is_some()
    }

    /// What decides whether a micro-step applies, for the manifest: only for the `If`
    /// form (a host can then run a specialised graph per branch).
    pub fn trigger(&self, model: &Model) -> Option<crate::state::ApplyTrigger> {
        match self.form {
            Form::If { node, .. } => Some(crate::state::ApplyTrigger {
                node: model.node(node).proto.name().to_string(),
                steps: model.name(self.window_size).to_string(),
                flush: model.name(self.flush).to_string(),
            }),
            Form::Where => None,
        }
    }
}

impl<'a> StateDecl<'a> {
    /// The input (made now when new), the role and the parameter.
    fn materialise(self, model: &mut Model) -> (ValueId, Role, Option<&'a str>) {
        let input = match self.input {
            DeclInput::New { name, init } => state_input(model, name, *init),
            DeclInput::Existing(v) => v,
        };
        (input, self.role, self.param)
    }
}
