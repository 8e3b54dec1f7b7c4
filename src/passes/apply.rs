//! The apply region: where the once-per-window work (normalised gradients, clipping, the
//! optimizer update, zeroing accumulators) lives, and how state leaves it.
//!
//! `grad-accum` creates the region; `optimizer`, `agc` and `loss-scale` add to it through
//! this contract only. Two forms:
//!
//! - `If` (default): `If(apply)` with a then-branch holding the update math; the
//!   else-branch passes every state through unchanged. Nothing of the optimizer runs on
//!   micro-steps that do not apply.
//! - `Where`: the update math runs in the main graph every micro-step and each state's
//!   next value is `Where(apply, updated, otherwise)`. Kept for comparison.
//!
//! Every piece of state that the region updates is *routed*: a main-graph output carries
//! its next value, which is `next` (set by [`ApplyRegion::set_next`]) when the window
//! applies and `otherwise` (the unchanged value, or the running accumulation) when not.

use crate::ir::{builder::Builder, tensor_type, BodyId, Model, NodeId, ValueId};
use crate::proto::{TensorProto, TypeProto};
use crate::state::{Role, StateEntry};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyMode {
    If,
    Where,
}

/// When BatchNorm running statistics move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BnStats {
    /// Once per window, from the window's pooled batch statistics (mean of means; mean of
    /// variances plus variance of means): for equal micro-batches exactly the statistics of
    /// the window as one batch.
    Window,
    /// At every micro-step from that micro-batch's statistics, as ONNX Runtime's training
    /// build does (in place at each train_step).
    Micro,
}

/// One trainable parameter as the region sees it.
#[derive(Clone, Debug)]
pub struct ApplyParam {
    pub name: String,
    /// The parameter's current value (a main-graph input).
    pub value: ValueId,
    /// The window's normalised gradient, inside [`ApplyRegion::body`]. Passes that
    /// transform the gradient (AGC, unscaling) replace it.
    pub grad: ValueId,
    /// Where the parameter's next value goes.
    pub slot: StateSlot,
    pub elem_type: i32,
    pub dims: Vec<i64>,
}

/// A routed state: its input and how its next value is set.
#[derive(Clone, Debug)]
pub struct StateSlot {
    pub input: ValueId,
    /// The state's role: [`ApplyRegion::gate`] holds back `Param`, `Moment`, `OptStep` and
    /// the running statistics of `BnStat` (not the window's sums of batch statistics, which
    /// reset like accumulators).
    pub role: Role,
    target: SlotTarget,
    /// Whether a gate holds this state back (see `role`).
    held_back: bool,
}

#[derive(Clone, Debug)]
enum SlotTarget {
    /// Output `index` of the then-branch.
    ThenOutput(usize),
    /// Input 1 of this `Where` node.
    WhereInput(NodeId),
}

#[derive(Clone, Debug)]
pub struct ApplyRegion {
    pub mode: ApplyMode,
    /// True on the micro-step that completes a window (or is flushed).
    pub apply: ValueId,
    /// Where update math goes: the then-branch, or the main graph for `Where`.
    pub body: BodyId,
    pub if_node: Option<NodeId>,
    pub else_body: Option<BodyId>,
    pub params: Vec<ApplyParam>,
    /// Optimizer steps taken before this one (int64 scalar, main graph).
    pub opt_step: ValueId,
    /// `opt_step + 1`, the step being taken, inside `body`: bias correction counts it.
    pub step: ValueId,
    /// Set by the optimizer pass; a region nobody optimised would train nothing.
    pub optimized: bool,
    /// Micro-steps accumulated in this window, this one included (int64 scalar, main graph).
    pub count: ValueId,
    pub bn_stats: BnStats,
    /// Whether the window's update may happen (bool scalar in `body`), set by `loss-scale`
    /// through [`set_gate`](Self::set_gate). When set, parameters, optimizer moments, the
    /// optimizer-step counter and the BatchNorm statistics the window moves
    /// (`bn_stats=window`) take their next value only if it is true, else keep their old
    /// one bit for bit (a poisoned window must not reach the running statistics either);
    /// accumulators, micro-step counter and weight sum reset as on any window. With
    /// `bn_stats=micro` the statistics move at every micro-step, outside the region, and
    /// are not gated. `None`: no gating, graphs unchanged.
    pub gate: Option<ValueId>,
    /// Set by `agc` once it has clipped gradients: loss scaling must unscale before that,
    /// or AGC would clip scaled gradients.
    pub clipped: bool,
    /// The inputs that decide `apply` together with the micro-step counter: K (int64) and
    /// the flush flag (bool). Recorded in the manifest so that a host can tell, before a
    /// run, which branch it takes (see [`crate::split`]).
    pub window_size: Option<ValueId>,
    pub flush: Option<ValueId>,
    /// The float scalar input holding the learning rate, set by `optimizer`: recorded in the
    /// manifest so that a host can schedule it.
    pub learning_rate: Option<ValueId>,
}

pub const PASS: &str = "grad-accum";

impl ApplyRegion {
    /// Creates the region in the main graph: an `If(apply)` with empty branches, or nothing
    /// yet for `Where`.
    pub fn create(
        model: &mut Model,
        mode: ApplyMode,
        apply: ValueId,
        opt_step: ValueId,
        count: ValueId,
        bn_stats: BnStats,
    ) -> ApplyRegion {
        let main = BodyId::MAIN;
        let (body, if_node, else_body) = match mode {
            ApplyMode::If => {
                let mut b = Builder::new(model, main, PASS);
                let node = b.node("If", "", &[Some(apply)], &[], Vec::new());
                model.node_mut(node).proto.name = Some(model.names.fresh("ga.apply_window"));
                let then_body = model.add_subgraph(node, "then_branch");
                let else_body = model.add_subgraph(node, "else_branch");
                (then_body, Some(node), Some(else_body))
            }
            ApplyMode::Where => (main, None, None),
        };
        let mut b = Builder::new(model, body, PASS);
        let one = b.scalar_i64("ga.one", 1);
        let step = b.op("Add", &[opt_step, one], vec![], "ga.step");
        ApplyRegion {
            mode,
            apply,
            body,
            if_node,
            else_body,
            params: Vec::new(),
            opt_step,
            step,
            optimized: false,
            clipped: false,
            count,
            bn_stats,
            gate: None,
            window_size: None,
            flush: None,
            learning_rate: None,
        }
    }

    /// Adds a state input to the main graph, with `init` as its default value.
    pub fn state_input(model: &mut Model, name: &str, init: TensorProto) -> ValueId {
        let ty = tensor_type(init.data_type(), &init.dims);
        model.add_input(BodyId::MAIN, name, ty, Some(init))
    }

    /// Routes a state: a main-graph output named `hint` that carries `otherwise` when the
    /// window does not apply, and the value given to [`set_next`](Self::set_next) (until
    /// then `otherwise` too) when it does. Records the state pair in `state`.
    pub fn route(
        &self,
        model: &mut Model,
        input: ValueId,
        otherwise: ValueId,
        role: Role,
        param: Option<&str>,
        state: &mut Vec<StateEntry>,
    ) -> StateSlot {
        let ty: Option<TypeProto> = model.value_type(input);
        let name = model.name(input).to_string();
        let hint = format!("{name}.next");
        let (output, target) = match self.mode {
            ApplyMode::If => {
                let (if_node, else_body) = (
                    self.if_node.expect("If region"),
                    self.else_body.expect("If region"),
                );
                let out = model.add_node_output(if_node, &hint);
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
            ApplyMode::Where => {
                let mut b = Builder::new(model, BodyId::MAIN, PASS);
                let out = b.op("Where", &[self.apply, otherwise, otherwise], vec![], &hint);
                let (node, _) = model.producer(out).expect("Where node");
                (out, SlotTarget::WhereInput(node))
            }
        };
        model.add_output(BodyId::MAIN, output, ty);
        state.push(StateEntry {
            input: model.name(input).to_string(),
            output: model.name(output).to_string(),
            role,
            param: param.map(str::to_string),
        });
        // A running statistic is its own parameter; the window's sums name the statistic.
        let held_back = matches!(role, Role::Param | Role::Moment | Role::OptStep)
            || (role == Role::BnStat && param == Some(name.as_str()));
        StateSlot {
            input,
            role,
            target,
            held_back,
        }
    }

    /// Sets the value a routed state takes when the window applies (`next` lives in
    /// [`body`](Self::body)).
    /// Under a [`gate`](Self::gate), a `Param`, `Moment`, `OptStep` or running-statistic
    /// slot gets `Where(gate, next, input)` instead.
    pub fn set_next(&self, model: &mut Model, slot: &StateSlot, next: ValueId) {
        let next = self.gated(model, slot, next);
        match slot.target {
            SlotTarget::ThenOutput(index) => {
                let placeholder = model.body(self.body).outputs[index].0;
                model.set_output(self.body, index, next);
                if let Some((node, _)) = model.producer(placeholder) {
                    let _ = model.remove_node(node);
                }
            }
            SlotTarget::WhereInput(node) => model.set_input(node, 1, Some(next)),
        }
    }

    /// `next`, or `Where(gate, next, input)` for a gated role under a gate.
    fn gated(&self, model: &mut Model, slot: &StateSlot, next: ValueId) -> ValueId {
        match self.gate {
            Some(gate) if slot.held_back => {
                let hint = format!("{}.if_finite", model.name(slot.input));
                Builder::new(model, self.body, "loss-scale").op(
                    "Where",
                    &[gate, next, slot.input],
                    vec![],
                    &hint,
                )
            }
            _ => next,
        }
    }

    /// Gates the window's update on `gate` (bool scalar in `body`); see
    /// [`gate`](Self::gate). Call it before the optimizer fills the region: states routed
    /// and set after it are gated by [`set_next`](Self::set_next); of those set before, the
    /// optimizer-step counter (recorded in `state`) is gated here.
    pub fn set_gate(&mut self, model: &mut Model, gate: ValueId, state: &[StateEntry]) {
        assert!(
            self.gate.is_none() && !self.optimized,
            "set_gate: once, before the optimizer"
        );
        self.gate = Some(gate);
        for entry in state.iter().filter(|e| e.role == Role::OptStep) {
            let (Some(input), Some(output)) = (
                model.lookup(BodyId::MAIN, &entry.input),
                model.lookup(BodyId::MAIN, &entry.output),
            ) else {
                continue;
            };
            let Some((node, index)) = model.producer(output) else {
                continue;
            };
            let (target, current) = match self.mode {
                ApplyMode::If if Some(node) == self.if_node => (
                    SlotTarget::ThenOutput(index),
                    model.body(self.body).outputs[index].0,
                ),
                ApplyMode::Where => match model.node(node).inputs.get(1).copied().flatten() {
                    Some(current) => (SlotTarget::WhereInput(node), current),
                    None => continue,
                },
                _ => continue,
            };
            let slot = StateSlot {
                input,
                role: entry.role,
                target,
                held_back: true,
            };
            let next = self.gated(model, &slot, current);
            match slot.target {
                SlotTarget::ThenOutput(index) => model.set_output(self.body, index, next),
                SlotTarget::WhereInput(node) => model.set_input(node, 1, Some(next)),
            }
        }
    }

    /// Brings a bool `flag` of `body` out to the main graph as `apply and flag` (false on
    /// micro-steps that do not apply). Not state; for metrics such as `ga.applied`.
    pub fn export_flag(&self, model: &mut Model, flag: ValueId, hint: &str) -> ValueId {
        match self.mode {
            ApplyMode::If => {
                let (if_node, else_body) = (
                    self.if_node.expect("If region"),
                    self.else_body.expect("If region"),
                );
                let ty = Some(tensor_type(
                    crate::proto::tensor_proto::DataType::Bool as i32,
                    &[],
                ));
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
            ApplyMode::Where => {
                Builder::new(model, BodyId::MAIN, PASS).op("And", &[self.apply, flag], vec![], hint)
            }
        }
    }

    /// A builder emitting into the region's body.
    pub fn builder<'m>(&self, model: &'m mut Model, pass: &'static str) -> Builder<'m> {
        Builder::new(model, self.body, pass)
    }
}
