//! The host's side of `passes::fuse::host`: after a run, the optimizer updates and
//! accumulations the pass took out of the session, computed by the same kernels as ONNX
//! Runtime's fused nodes ([`crate::fused_ops`]), in place on the states' own buffers.
//!
//! At small sizes the update costs its bookkeeping more than its arithmetic (8K
//! parameters: 1.4 µs a parameter's AdamW update against 0.4 of arithmetic before the
//! scalars were shared), so what every run of a session's updates has in common is worked
//! out once ([`Prepared`]): which updates read one gate and one optimizer's scalars, and
//! where the last run found each operand and state.

use std::cell::Cell;
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

/// Where a run found an operand: the list of [`Operands`] and the position in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Found {
    Host(usize),
    Computed(usize),
    Held(usize),
    Output(usize),
    Transient(usize),
}

/// One operand's data.
enum Data<'a> {
    F32(&'a [f32]),
    Bool(&'a [bool]),
}

/// The most operand slots of an update (AdamW's).
const MOST_SLOTS: usize = adamw_slot::COUNT;

/// [`HostUpdates`] with what all its runs share, worked out when the session gets them.
pub(super) struct Prepared {
    pub updates: HostUpdates,
    /// For each update, the first update reading the same gate (its keep and loss
    /// operands): a run decides each gate once.
    gate_group: Vec<usize>,
    /// For each update, the first update of the same kernel reading the same scalars
    /// (learning rate, betas, bias corrections): a run reads each group's once.
    scalar_group: Vec<usize>,
    /// Where the last run found each update's operands, by slot: the next run looks there
    /// first (checking the name), and searches only when it is not there.
    found: Vec<[Cell<Option<Found>>; MOST_SLOTS]>,
    /// Where the last run's states held each update's written states.
    write_at: Vec<[usize; MOST_WRITES]>,
}

impl Prepared {
    pub fn new(updates: HostUpdates) -> Prepared {
        let list = &updates.updates;
        let first_alike = |alike: &dyn Fn(&HostUpdate, &HostUpdate) -> bool| -> Vec<usize> {
            (0..list.len())
                .map(|i| (0..=i).find(|&j| alike(&list[j], &list[i])).unwrap_or(i))
                .collect()
        };
        let gate_group = first_alike(&|a, b| {
            let (ka, kb) = (keep_slot(a.op), keep_slot(b.op));
            a.operands.get(ka) == b.operands.get(kb)
                && a.operands.get(crate::fused_ops::loss_slot(ka))
                    == b.operands.get(crate::fused_ops::loss_slot(kb))
        });
        let scalar_group = first_alike(&|a, b| match (a.op, b.op) {
            (HostOp::AdamW, HostOp::AdamW) => same_operands(a, b, &adamw_group_slot::FROM_SINGLE),
            (HostOp::Sgd { .. }, HostOp::Sgd { .. }) => {
                a.op == b.op
                    && a.writes.len() == b.writes.len()
                    && same_operands(a, b, &SGD_SCALARS)
            }
            _ => false,
        });
        Prepared {
            found: (0..list.len())
                .map(|_| std::array::from_fn(|_| Cell::new(None)))
                .collect(),
            write_at: vec![[0; MOST_WRITES]; list.len()],
            gate_group,
            scalar_group,
            updates,
        }
    }
}

/// One update's operands as one run reads them, remembering where it found them.
struct Reader<'r, 'a> {
    operands: &'r Operands<'a>,
    update: &'a HostUpdate,
    found: &'r [Cell<Option<Found>>; MOST_SLOTS],
}

impl<'a> Operands<'a> {
    /// The session's output `name`, kept or returned, and where.
    fn output(&self, name: &str) -> Option<(Found, &'a DynValue)> {
        let kept = self.transient.iter().position(|(n, _)| n == name);
        if let Some(i) = kept {
            return Some((Found::Transient(i), &self.transient[i].1));
        }
        let returned = self.outputs.iter().position(|(n, _)| n == name);
        returned.map(|i| (Found::Output(i), &self.outputs[i].1))
    }

    /// The operand `name` where `at` says, if it is there.
    fn at(&self, at: Found, name: &str) -> Option<Result<Data<'a>, EngineError>> {
        fn named<'l, T>(list: &'l [(impl AsRef<str>, T)], i: usize, name: &str) -> Option<&'l T> {
            list.get(i)
                .filter(|(n, _)| n.as_ref() == name)
                .map(|(_, v)| v)
        }
        match at {
            Found::Host(i) => named(self.host, i, name).map(|t| tensor_data(t, name)),
            Found::Computed(i) => named(self.computed, i, name).map(|t| tensor_data(t, name)),
            Found::Held(i) => named(self.held, i, name).map(|v| value_data(v, name)),
            Found::Output(i) => named(self.outputs, i, name).map(|v| value_data(v, name)),
            Found::Transient(i) => named(self.transient, i, name).map(|v| value_data(v, name)),
        }
    }

    /// `operand`'s data: where `hint` says when it is there, else searched for (and `hint`
    /// set to where it was).
    fn find(
        &self,
        operand: Option<&'a Operand>,
        hint: &Cell<Option<Found>>,
    ) -> Result<Option<Data<'a>>, EngineError> {
        let Some(operand) = operand else {
            return Ok(None);
        };
        let (name, default) = match operand {
            Operand::Constant(t) => return tensor_data(t, "a constant").map(Some),
            Operand::Input { name, default } => (name.as_str(), default.as_ref()),
            Operand::Output(name) => (name.as_str(), None),
        };
        if let Some(data) = hint.get().and_then(|at| self.at(at, name)) {
            return data.map(Some);
        }
        // A gradient, the usual operand, is among the few kept outputs: looked for there
        // first, before the feeds.
        let kept = match operand {
            Operand::Output(_) => self.output(name),
            _ => None,
        };
        if kept.is_none() {
            if let Some(i) = self.host.iter().position(|(n, _)| *n == name) {
                hint.set(Some(Found::Host(i)));
                return tensor_data(self.host[i].1, name).map(Some);
            }
            if let Some(i) = self.computed.iter().position(|(n, _)| *n == name) {
                hint.set(Some(Found::Computed(i)));
                return tensor_data(&self.computed[i].1, name).map(Some);
            }
        }
        let value = kept.or_else(|| {
            let held = self.held.iter().position(|(n, _)| *n == name);
            held.map(|i| (Found::Held(i), self.held[i].1))
                .or_else(|| self.output(name))
        });
        let Some((found, value)) = value else {
            return match default {
                Some(t) => tensor_data(t, name).map(Some),
                None => Err(missing(name)),
            };
        };
        hint.set(Some(found));
        value_data(value, name).map(Some)
    }
}

impl<'a> Reader<'_, 'a> {
    fn find(&self, slot: usize) -> Result<Option<Data<'a>>, EngineError> {
        let operand = self.update.operands.get(slot).and_then(Option::as_ref);
        let unhinted = Cell::new(None);
        let hint = self.found.get(slot).unwrap_or(&unhinted);
        self.operands.find(operand, hint)
    }

    fn f32s(&self, slot: usize) -> Result<Option<&'a [f32]>, EngineError> {
        match self.find(slot)? {
            None => Ok(None),
            Some(Data::F32(data)) => Ok(Some(data)),
            Some(Data::Bool(_)) => Err(wrong(self.update, slot, "float32")),
        }
    }

    fn scalar(&self, slot: usize) -> Result<Option<f32>, EngineError> {
        match self.f32s(slot)? {
            None => Ok(None),
            Some([x]) => Ok(Some(*x)),
            Some(_) => Err(wrong(self.update, slot, "one element")),
        }
    }

    /// The gate ([`crate::fused_ops::keeps`]) from its `keep` slot and the `loss` slot after
    /// it.
    fn gate(&self, keep_slot: usize) -> Result<bool, EngineError> {
        let keep = match self.find(keep_slot)? {
            None => None,
            Some(Data::Bool([keep])) => Some(*keep),
            Some(_) => return Err(wrong(self.update, keep_slot, "one bool")),
        };
        let loss = self.scalar(crate::fused_ops::loss_slot(keep_slot))?;
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

fn value_data<'a>(value: &'a DynValue, name: &str) -> Result<Data<'a>, EngineError> {
    if let Ok((_, data)) = value.try_extract_tensor::<f32>() {
        return Ok(Data::F32(data));
    }
    match value.try_extract_tensor::<bool>() {
        Ok((_, data)) => Ok(Data::Bool(data)),
        Err(e) => Err(EngineError::Input {
            name: name.to_string(),
            message: format!("a host update reads it: {e}"),
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

/// Whether `a` and `b` read the same operands at `slots`.
fn same_operands(a: &HostUpdate, b: &HostUpdate, slots: &[usize]) -> bool {
    slots
        .iter()
        .all(|&s| a.operands.get(s) == b.operands.get(s))
}

/// The scalars of an SGD update.
const SGD_SCALARS: [usize; 4] = [
    sgd_slot::LR,
    sgd_slot::MU,
    sgd_slot::WD,
    sgd_slot::GRAD_DIVISOR,
];

/// What one run's updates share, read once: each gate's value and each group's scalars,
/// by the group's first update ([`Prepared`]).
#[derive(Default)]
struct Shared {
    gate: Option<(usize, bool)>,
    adamw: Option<(usize, AdamWScalars)>,
    sgd: Option<(usize, SgdScalars)>,
}

/// Runs every update of `prepared` on `operands`, writing into `states` (those the updates
/// write, by their inputs' names), on the calling thread (`passes::fuse::host::MAX_ELEMENTS`
/// says why one).
pub(super) fn run(
    prepared: &mut Prepared,
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
    let Prepared {
        updates,
        gate_group,
        scalar_group,
        found,
        write_at,
    } = prepared;
    let mut shared = Shared::default();
    for (i, update) in updates.updates.iter().enumerate() {
        let reader = Reader {
            operands,
            update,
            found: &found[i],
        };
        let keep = match shared.gate {
            Some((group, keep)) if group == gate_group[i] => keep,
            _ => {
                let keep = reader.gate(keep_slot(update.op))?;
                shared.gate = Some((gate_group[i], keep));
                keep
            }
        };
        if !keep {
            continue;
        }
        // The states it writes, taken out of `buffers` for the update and put back after
        // (in arrays: a run allocates nothing per update).
        let writes = update.writes.len();
        if writes > MOST_WRITES {
            return Err(wrong(update, 0, "an update of at most three states"));
        }
        let at = &mut write_at[i];
        let mut slices: [&mut [f32]; MOST_WRITES] = Default::default();
        for (k, write) in update.writes.iter().enumerate() {
            if buffers.get(at[k]).is_none_or(|(n, _)| n != write) {
                at[k] = buffers
                    .iter()
                    .position(|(n, _)| n == write)
                    .ok_or_else(|| missing(write))?;
            }
            slices[k] = std::mem::take(&mut buffers[at[k]].1);
        }
        let result = run_one(&reader, &mut shared, scalar_group[i], &mut slices[..writes]);
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

fn run_one(
    reader: &Reader<'_, '_>,
    shared: &mut Shared,
    scalar_group: usize,
    states: &mut [&mut [f32]],
) -> Result<(), EngineError> {
    let update = reader.update;
    let len = states.first().map_or(0, |s| s.len());
    let (grad_slot, addend_slot) = match update.op {
        HostOp::AdamW => (adamw_slot::GRAD, Some(adamw_slot::GRAD_ADDEND)),
        HostOp::Sgd { .. } => (sgd_slot::GRAD, Some(sgd_slot::GRAD_ADDEND)),
        HostOp::Accumulate => (accumulate_slot::GRAD, None),
    };
    let g = reader
        .f32s(grad_slot)?
        .ok_or_else(|| wrong(update, grad_slot, "given"))?;
    let addend = match addend_slot {
        Some(slot) => reader.f32s(slot)?,
        None => None,
    };
    if states.iter().any(|s| s.len() != len)
        || g.len() != len
        || addend.is_some_and(|a| a.len() != len)
    {
        return Err(wrong(update, grad_slot, "of its state's size"));
    }
    let gradient = |r: &Range<usize>| (&g[r.clone()], addend.map(|a| &a[r.clone()]));
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
                Some((group, s)) if group == scalar_group => s,
                _ => {
                    let s = AdamWScalars::read(adamw_group_slot::FROM_SINGLE, |slot| {
                        reader.scalar(slot).map_err(|e| e.to_string())
                    })
                    .map_err(message)?;
                    shared.adamw = Some((scalar_group, s));
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
            let s = match shared.sgd {
                Some((group, s)) if group == scalar_group => s,
                _ => {
                    let s = SgdScalars::read(nesterov, states.len() == 2, |slot| {
                        reader.scalar(slot).map_err(|e| e.to_string())
                    })
                    .map_err(message)?;
                    shared.sgd = Some((scalar_group, s));
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
