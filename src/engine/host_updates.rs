//! The host's side of `passes::fuse::host`: after a run, the optimizer updates and
//! accumulations the pass took out of the session, computed by the same kernels as ONNX
//! Runtime's fused nodes ([`crate::fused_ops`]), in place on the states' own buffers.

use std::ops::Range;

use ::ort::value::DynValue;

use super::EngineError;
use crate::data::Tensor;
use crate::fused_ops::{
    accumulate_grad, accumulate_slot, adamw_group_slot, adamw_slot, adamw_update, sgd_slot,
    sgd_update, AdamWScalars, Io, SgdIo, SgdScalars,
};
use crate::passes::fuse::host::{HostOp, HostUpdate, HostUpdates, Operand};

/// What one run offers the updates to read: the host's feeds, the outputs the host computed
/// (`engine::host_scalars`), the held feeds, the session's outputs returned and those it
/// kept for the host (`OrtSession::transient_outputs`).
pub(super) struct Operands<'a> {
    pub host: &'a [(&'a str, &'a Tensor)],
    pub computed: &'a [(&'a str, Tensor)],
    pub held: &'a [(&'a str, &'a DynValue)],
    pub outputs: &'a [(String, DynValue)],
    pub transient: &'a [(String, DynValue)],
}

/// One operand's data.
enum Data<'a> {
    F32(&'a [f32]),
    Bool(&'a [bool]),
}

impl<'a> Operands<'a> {
    /// The session's output `name`, kept or returned.
    fn output(&self, name: &str) -> Option<&'a DynValue> {
        let mut outputs = self.transient.iter().chain(self.outputs);
        outputs.find(|(n, _)| n == name).map(|(_, v)| v)
    }

    fn find(&self, update: &'a HostUpdate, slot: usize) -> Result<Option<Data<'a>>, EngineError> {
        let Some(Some(operand)) = update.operands.get(slot) else {
            return Ok(None);
        };
        let (name, default) = match operand {
            Operand::Constant(t) => return tensor_data(t, "a constant").map(Some),
            Operand::Input { name, default } => (name.as_str(), default.as_ref()),
            Operand::Output(name) => (name.as_str(), None),
        };
        // A gradient, the usual operand, is among the few kept outputs: looked for there
        // first, before the feeds.
        let kept = match operand {
            Operand::Output(_) => self.output(name),
            _ => None,
        };
        if kept.is_none() {
            let on_host = self.host.iter().map(|(n, t)| (*n, *t));
            let computed = self.computed.iter().map(|(n, t)| (*n, t));
            if let Some((_, t)) = on_host.chain(computed).find(|(n, _)| *n == name) {
                return tensor_data(t, name).map(Some);
            }
        }
        let value = kept.or_else(|| {
            let held = self.held.iter().find(|(n, _)| *n == name);
            held.map(|(_, v)| *v).or_else(|| self.output(name))
        });
        let Some(value) = value else {
            return match default {
                Some(t) => tensor_data(t, name).map(Some),
                None => Err(missing(name)),
            };
        };
        if let Ok((_, data)) = value.try_extract_tensor::<f32>() {
            return Ok(Some(Data::F32(data)));
        }
        match value.try_extract_tensor::<bool>() {
            Ok((_, data)) => Ok(Some(Data::Bool(data))),
            Err(e) => Err(EngineError::Input {
                name: name.to_string(),
                message: format!("a host update reads it: {e}"),
            }),
        }
    }

    fn f32s(&self, update: &'a HostUpdate, slot: usize) -> Result<Option<&'a [f32]>, EngineError> {
        match self.find(update, slot)? {
            None => Ok(None),
            Some(Data::F32(data)) => Ok(Some(data)),
            Some(Data::Bool(_)) => Err(wrong(update, slot, "float32")),
        }
    }

    fn scalar(&self, update: &'a HostUpdate, slot: usize) -> Result<Option<f32>, EngineError> {
        match self.f32s(update, slot)? {
            None => Ok(None),
            Some([x]) => Ok(Some(*x)),
            Some(_) => Err(wrong(update, slot, "one element")),
        }
    }

    /// The gate ([`crate::fused_ops::keeps`]) from its `keep` slot and the `loss` slot after
    /// it.
    fn gate(&self, update: &'a HostUpdate, keep_slot: usize) -> Result<bool, EngineError> {
        let keep = match self.find(update, keep_slot)? {
            None => None,
            Some(Data::Bool([keep])) => Some(*keep),
            Some(_) => return Err(wrong(update, keep_slot, "one bool")),
        };
        let loss = self.scalar(update, crate::fused_ops::loss_slot(keep_slot))?;
        Ok(crate::fused_ops::keeps(keep, loss))
    }
}

fn tensor_data<'a>(t: &'a Tensor, name: &str) -> Result<Data<'a>, EngineError> {
    let not_contiguous = || EngineError::Input {
        name: name.to_string(),
        message: "not contiguous".into(),
    };
    match t {
        Tensor::F32(a) => Ok(Data::F32(a.as_slice().ok_or_else(not_contiguous)?)),
        Tensor::Bool(a) => Ok(Data::Bool(a.as_slice().ok_or_else(not_contiguous)?)),
        _ => Err(EngineError::Input {
            name: name.to_string(),
            message: "a host update reads it, and it is neither float32 nor bool".into(),
        }),
    }
}

fn missing(name: &str) -> EngineError {
    EngineError::Input {
        name: name.to_string(),
        message: "a host update reads it, and the run neither had nor made it".into(),
    }
}

fn wrong(update: &HostUpdate, slot: usize, what: &str) -> EngineError {
    EngineError::Input {
        name: update.writes.first().cloned().unwrap_or_default(),
        message: format!("the host update's input {slot} is not {what}"),
    }
}

/// What one run's updates share, read once: the updates of one optimizer read the same
/// scalars (learning rate, betas, bias corrections) and the one gate, and at small sizes
/// finding them again for every tensor cost more than the arithmetic (8K parameters: 1.4
/// µs a parameter's AdamW update against 0.4 of arithmetic).
type GateOperands<'a> = (Option<&'a Operand>, Option<&'a Operand>);

#[derive(Default)]
struct Shared<'a> {
    /// The gate's operands (keep, loss) and its value.
    gate: Option<(GateOperands<'a>, bool)>,
    /// The AdamW update whose scalars were read last, and them.
    adamw: Option<(&'a HostUpdate, AdamWScalars)>,
    sgd: Option<(&'a HostUpdate, SgdScalars)>,
}

/// Whether `a` and `b` read the same operands at `slots`.
fn same_operands(a: &HostUpdate, b: &HostUpdate, slots: &[usize]) -> bool {
    slots
        .iter()
        .all(|&s| a.operands.get(s) == b.operands.get(s))
}

impl<'a> Shared<'a> {
    fn keep(
        &mut self,
        operands: &Operands<'a>,
        update: &'a HostUpdate,
        keep_slot: usize,
    ) -> Result<bool, EngineError> {
        let operand = |slot: usize| update.operands.get(slot).and_then(Option::as_ref);
        let gate = (
            operand(keep_slot),
            operand(crate::fused_ops::loss_slot(keep_slot)),
        );
        if let Some((seen, keep)) = self.gate {
            if seen == gate {
                return Ok(keep);
            }
        }
        let keep = operands.gate(update, keep_slot)?;
        self.gate = Some((gate, keep));
        Ok(keep)
    }
}

/// Runs every update of `updates` on `operands`, writing into `states` (those the updates
/// write, by their inputs' names), on the calling thread (`passes::fuse::host::MAX_ELEMENTS`
/// says why one).
pub(super) fn run(
    updates: &HostUpdates,
    operands: &Operands<'_>,
    states: &mut [(&str, &mut DynValue)],
) -> Result<(), EngineError> {
    let mut buffers: Vec<(&str, &mut [f32])> = Vec::with_capacity(states.len());
    for (name, value) in states.iter_mut() {
        let (_, data) = value
            .try_extract_tensor_mut::<f32>()
            .map_err(|e| EngineError::Input {
                name: name.to_string(),
                message: format!("a state the host updates in place: {e}"),
            })?;
        buffers.push((*name, data));
    }
    let mut shared = Shared::default();
    for update in &updates.updates {
        if !shared.keep(operands, update, keep_slot(update.op))? {
            continue;
        }
        // The states it writes, taken out of `buffers` for the update and put back after
        // (in arrays: a run allocates nothing per update).
        let writes = update.writes.len();
        if writes > MOST_WRITES {
            return Err(wrong(update, 0, "an update of at most three states"));
        }
        let mut at = [0usize; MOST_WRITES];
        let mut slices: [&mut [f32]; MOST_WRITES] = Default::default();
        for (k, write) in update.writes.iter().enumerate() {
            at[k] = buffers
                .iter()
                .position(|(n, _)| n == write)
                .ok_or_else(|| missing(write))?;
            slices[k] = std::mem::take(&mut buffers[at[k]].1);
        }
        let result = run_one(update, operands, &mut shared, &mut slices[..writes]);
        for (k, slice) in slices.into_iter().take(writes).enumerate() {
            buffers[at[k]].1 = slice;
        }
        result?;
    }
    Ok(())
}

/// The most states one update writes (AdamW: the parameter and its two moments).
const MOST_WRITES: usize = 3;

fn keep_slot(op: HostOp) -> usize {
    match op {
        HostOp::AdamW => adamw_slot::KEEP,
        HostOp::Sgd { .. } => sgd_slot::KEEP,
        HostOp::Accumulate => accumulate_slot::KEEP,
    }
}

fn run_one<'a>(
    update: &'a HostUpdate,
    operands: &Operands<'a>,
    shared: &mut Shared<'a>,
    states: &mut [&mut [f32]],
) -> Result<(), EngineError> {
    let len = states.first().map_or(0, |s| s.len());
    let (grad_slot, addend_slot) = match update.op {
        HostOp::AdamW => (adamw_slot::GRAD, Some(adamw_slot::GRAD_ADDEND)),
        HostOp::Sgd { .. } => (sgd_slot::GRAD, Some(sgd_slot::GRAD_ADDEND)),
        HostOp::Accumulate => (accumulate_slot::GRAD, None),
    };
    let g = operands
        .f32s(update, grad_slot)?
        .ok_or_else(|| wrong(update, grad_slot, "given"))?;
    let addend = match addend_slot {
        Some(slot) => operands.f32s(update, slot)?,
        None => None,
    };
    if states.iter().any(|s| s.len() != len)
        || g.len() != len
        || addend.is_some_and(|a| a.len() != len)
    {
        return Err(wrong(update, grad_slot, "of its state's size"));
    }
    let gradient = |r: &Range<usize>| (&g[r.clone()], addend.map(|a| &a[r.clone()]));
    let scalar = |slot: usize| operands.scalar(update, slot);
    let message = |m: String| EngineError::Input {
        name: update.writes.first().cloned().unwrap_or_default(),
        message: m,
    };
    match update.op {
        HostOp::Accumulate => {
            let [acc] = states else {
                return Err(wrong(update, accumulate_slot::ACC, "one state"));
            };
            accumulate_grad(g, Io::InPlace([&mut **acc]));
        }
        HostOp::AdamW => {
            let [p, m, v] = states else {
                return Err(wrong(update, adamw_slot::PARAM, "three states"));
            };
            let s = match shared.adamw {
                Some((last, s)) if same_operands(last, update, &adamw_group_slot::FROM_SINGLE) => s,
                _ => {
                    let s = AdamWScalars::read(adamw_group_slot::FROM_SINGLE, |slot| {
                        scalar(slot).map_err(|e| e.to_string())
                    })
                    .map_err(message)?;
                    shared.adamw = Some((update, s));
                    s
                }
            };
            adamw_update(
                &s,
                gradient(&(0..len)),
                Io::InPlace([&mut **p, &mut **m, &mut **v]),
            );
        }
        HostOp::Sgd { nesterov } => {
            const SCALARS: [usize; 4] = [
                sgd_slot::LR,
                sgd_slot::MU,
                sgd_slot::WD,
                sgd_slot::GRAD_DIVISOR,
            ];
            let s = match shared.sgd {
                Some((last, s))
                    if last.op == update.op
                        && last.writes.len() == update.writes.len()
                        && same_operands(last, update, &SCALARS) =>
                {
                    s
                }
                _ => {
                    let s = SgdScalars::read(nesterov, states.len() == 2, |slot| {
                        scalar(slot).map_err(|e| e.to_string())
                    })
                    .map_err(message)?;
                    shared.sgd = Some((update, s));
                    s
                }
            };
            match states {
                [p, b] => sgd_update(
                    &s,
                    gradient(&(0..len)),
                    SgdIo::Momentum(Io::InPlace([&mut **p, &mut **b])),
                ),
                [p] => sgd_update(
                    &s,
                    gradient(&(0..len)),
                    SgdIo::Plain(Io::InPlace([&mut **p])),
                ),
                _ => return Err(wrong(update, sgd_slot::PARAM, "one state or two")),
            }
        }
    }
    Ok(())
}
