//! One `IoBinding` kept across the runs of a session that updates states in place, on the
//! CPU.
//!
//! A binding made afresh for every run (ort's `create_binding`, every input and output bound
//! again, the outputs wrapped back) cost more than running without one at small sizes: at
//! 8K parameters a step with every fused state in place ran 2.0x the floor against 1.65x
//! apart (benches/README.md, "Scaling with model size"). Yet the in-place states are the
//! same buffers run after run, and so are most inputs. Here the binding stays, and a run
//! binds again only what changed:
//!
//! - the host's inputs (the batch, controls, flags) are copied into values this binding
//!   owns, bound once: a copy of a micro-batch is a few KiB, a binding a C call and a name
//!   lookup in ONNX Runtime;
//! - a held input is bound again when its data pointer differs from the one bound. The
//!   binding holds a reference to every value bound to it, so a bound buffer stays
//!   allocated and no other tensor can take its address: the same pointer is the same
//!   buffer;
//! - an in-place state's output is bound to the state's own value, likewise again only
//!   when its buffer changed;
//! - an output the host only reads before the next run (a gradient the host's updates
//!   consume: `engine::host_updates`; a small output the engine copies out, the loss) is
//!   written into a buffer the binding keeps: the first run's value of it, bound as the
//!   output from then on, so that a run allocates, wraps and releases nothing for it, and
//!   when every output is such, nothing is collected after the run;
//! - every other output is bound to the CPU again before each run: ONNX Runtime would
//!   otherwise write the next run into the buffer the last run returned, which the caller
//!   now holds.
//!
//! What the first run bound is kept by position, so that a later run looks nothing up by
//! name: a run whose inputs or in-place states are not the first run's, in the same order
//! (a flush flag fed only sometimes), starts a fresh binding, since an input left bound
//! would be read with its old value.
//!
//! Everything goes through ONNX Runtime's C API: ort's `IoBinding` methods copy lent
//! inputs and wrap every output in more calls than the run's own work at this size.

use std::ffi::{c_void, CString};
use std::ptr::{self, NonNull};

use ::ort::memory::{Allocator, MemoryInfo};
use ::ort::session::Session;
use ::ort::sys::{OrtIoBinding, OrtStatusPtr, OrtValue};
use ::ort::value::DynValue;
use ::ort::AsPointer;

use super::kernel_io::status_message;
use super::ort::to_owned_ort;
use super::EngineError;
use crate::data::Tensor;

/// An in-place state's output, and whether the session reads the state (a window start
/// only writes its accumulators).
pub(super) type StateOf<'a> = dyn Fn(&str) -> Result<(String, bool), EngineError> + 'a;

/// An in-place state of the session, as bound.
struct InPlaceState {
    input: String,
    c_input: CString,
    output: String,
    c_output: CString,
    /// Whether the session reads it (a window start only writes its accumulators).
    read: bool,
    /// The address of the buffer bound (compared, never dereferenced).
    address: usize,
}

/// A session's binding, and what is bound to it, by the position of the runs' arguments.
pub(super) struct KeptBinding {
    binding: ::ort::session::IoBinding,
    cpu: MemoryInfo<'static>,
    /// Nothing bound yet: the first run binds everything and fixes the positions.
    fresh: bool,
    /// The host inputs, each bound once to a value this binding owns.
    host: Vec<HostInput>,
    /// The held inputs: name, C name, and the address of the buffer bound (compared, never
    /// dereferenced).
    held: Vec<(String, CString, usize)>,
    in_place: Vec<InPlaceState>,
    /// The outputs other than the in-place states', in the model's order: name, C name,
    /// and whether the binding keeps its buffer (a transient output). The binding returns
    /// the in-place ones first (bound first), then these.
    returned: Vec<(String, CString, bool)>,
    /// The transient outputs' values: bound as their outputs after the first run, the last
    /// run's values.
    transient: Vec<(String, DynValue)>,
}

fn check(status: OrtStatusPtr, what: impl FnOnce() -> String) -> Result<(), EngineError> {
    match status_message(status) {
        None => Ok(()),
        Some(message) => Err(EngineError::Ort {
            context: what(),
            message,
        }),
    }
}

fn c_name(name: &str) -> Result<CString, EngineError> {
    CString::new(name).map_err(|_| EngineError::Input {
        name: name.to_string(),
        message: "has a NUL byte in its name".into(),
    })
}

/// The address of a tensor value's buffer.
fn address_of(value: &DynValue, name: &str) -> Result<usize, EngineError> {
    let mut data = ptr::null_mut();
    // SAFETY: a live tensor value; ONNX Runtime only reads it.
    let status = unsafe { (::ort::api().GetTensorMutableData)(value.ptr() as *mut _, &mut data) };
    check(status, || format!("reading the buffer of '{name}'"))?;
    Ok(data as usize)
}

/// A host input as bound: the value this binding made from the first run's tensor and
/// owns, and what a later run's tensor must match to be copied into it (its element type
/// and shape) and where, read once: asking ONNX Runtime about the value every run cost
/// 0.4-0.5 µs an input (benches/README.md, "Run AK").
struct HostInput {
    name: String,
    c: CString,
    value: DynValue,
    kind: std::mem::Discriminant<Tensor>,
    shape: Vec<usize>,
    /// The address of `value`'s buffer, which moves only with a new value.
    data: usize,
}

impl HostInput {
    fn new(name: &str, tensor: &Tensor) -> Result<HostInput, EngineError> {
        let value = to_owned_ort(name, tensor)?;
        Ok(HostInput {
            name: name.to_string(),
            c: c_name(name)?,
            data: address_of(&value, name)?,
            value,
            kind: std::mem::discriminant(tensor),
            shape: tensor.shape().to_vec(),
        })
    }

    /// Whether `tensor` has the element type and shape of the value bound.
    fn fits(&self, tensor: &Tensor) -> bool {
        std::mem::discriminant(tensor) == self.kind && tensor.shape() == self.shape
    }

    /// Copies `tensor`, which [`fits`](Self::fits), into the value bound.
    fn copy_in(&self, tensor: &Tensor) {
        let data = self.data as *mut c_void;
        macro_rules! copy {
            ($a:expr, $t:ty) => {{
                // SAFETY: the value holds as many elements of this type as `$a` (`fits`:
                // the element type and shape it was made with), and nothing else writes it
                // now.
                let to = unsafe { std::slice::from_raw_parts_mut(data as *mut $t, $a.len()) };
                match $a.as_slice() {
                    Some(from) => to.copy_from_slice(from),
                    None => to.iter_mut().zip($a.iter()).for_each(|(t, f)| *t = *f),
                }
            }};
        }
        match tensor {
            Tensor::F32(a) => copy!(a, f32),
            Tensor::F64(a) => copy!(a, f64),
            Tensor::I64(a) => copy!(a, i64),
            Tensor::I32(a) => copy!(a, i32),
            Tensor::Bool(a) => copy!(a, bool),
        }
    }
}

impl KeptBinding {
    pub(super) fn new(session: &Session) -> Result<KeptBinding, EngineError> {
        let binding = session.create_binding().map_err(|e| EngineError::Ort {
            context: "IoBinding".into(),
            message: e.to_string(),
        })?;
        Ok(KeptBinding {
            binding,
            cpu: MemoryInfo::default(),
            fresh: true,
            host: Vec::new(),
            held: Vec::new(),
            in_place: Vec::new(),
            returned: Vec::new(),
            transient: Vec::new(),
        })
    }

    /// Whether this binding serves a run of these inputs and in-place states (the first
    /// run's names, in order).
    pub(super) fn serves(
        &self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
        in_place: &[(&str, &mut DynValue)],
    ) -> bool {
        self.fresh
            || (host.len() == self.host.len()
                && held.len() == self.held.len()
                && in_place.len() == self.in_place.len()
                && host.iter().zip(&self.host).all(|((a, _), b)| *a == b.name)
                && held.iter().zip(&self.held).all(|((a, _), (b, ..))| a == b)
                && in_place
                    .iter()
                    .zip(&self.in_place)
                    .all(|((a, _), b)| *a == b.input))
    }

    fn binding_ptr(&self) -> *mut OrtIoBinding {
        self.binding.ptr() as *mut _
    }

    fn bind_input(&self, c: &CString, name: &str, value: &DynValue) -> Result<(), EngineError> {
        // SAFETY: a live binding and value; ONNX Runtime keeps its own reference.
        let status =
            unsafe { (::ort::api().BindInput)(self.binding_ptr(), c.as_ptr(), value.ptr()) };
        check(status, || format!("binding input '{name}'"))
    }

    fn bind_output(&self, c: &CString, name: &str, value: &DynValue) -> Result<(), EngineError> {
        // SAFETY: a live binding and value (ONNX Runtime's own memory).
        let status =
            unsafe { (::ort::api().BindOutput)(self.binding_ptr(), c.as_ptr(), value.ptr()) };
        check(status, || format!("binding output '{name}'"))
    }

    /// The first run: binds everything and fixes the positions.
    fn bind_all(
        &mut self,
        output_names: &[String],
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
        in_place: &[(&str, &mut DynValue)],
        state_of: &StateOf,
        transient: &[String],
    ) -> Result<(), EngineError> {
        for (name, tensor) in host {
            let input = HostInput::new(name, tensor)?;
            self.bind_input(&input.c, name, &input.value)?;
            self.host.push(input);
        }
        for (name, value) in held {
            let c = c_name(name)?;
            self.bind_input(&c, name, value)?;
            self.held
                .push((name.to_string(), c, address_of(value, name)?));
        }
        // In-place outputs first: the binding returns outputs in the order first bound.
        let mut outputs = std::collections::HashSet::new();
        for (input, value) in in_place {
            let (output, read) = state_of(input)?;
            let state = InPlaceState {
                input: input.to_string(),
                c_input: c_name(input)?,
                c_output: c_name(&output)?,
                output: output.clone(),
                read,
                address: address_of(value, input)?,
            };
            if state.read {
                self.bind_input(&state.c_input, input, value)?;
            }
            self.bind_output(&state.c_output, &output, value)?;
            self.in_place.push(state);
            outputs.insert(output);
        }
        for name in output_names {
            if !outputs.contains(name) {
                let kept = transient.contains(name);
                self.returned.push((name.clone(), c_name(name)?, kept));
            }
        }
        self.fresh = false;
        Ok(())
    }

    /// A later run: binds again what changed.
    fn bind_changes(
        &mut self,
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
        in_place: &[(&str, &mut DynValue)],
    ) -> Result<(), EngineError> {
        for (i, (name, tensor)) in host.iter().enumerate() {
            if self.host[i].fits(tensor) {
                self.host[i].copy_in(tensor);
            } else {
                let input = HostInput::new(name, tensor)?;
                self.bind_input(&input.c, name, &input.value)?;
                self.host[i] = input;
            }
        }
        for (i, (name, value)) in held.iter().enumerate() {
            let address = address_of(value, name)?;
            if self.held[i].2 != address {
                self.bind_input(&self.held[i].1, name, value)?;
                self.held[i].2 = address;
            }
        }
        for (i, (input, value)) in in_place.iter().enumerate() {
            let address = address_of(value, input)?;
            let state = &self.in_place[i];
            if state.address != address {
                if state.read {
                    self.bind_input(&state.c_input, input, value)?;
                }
                self.bind_output(&state.c_output, &state.output, value)?;
                self.in_place[i].address = address;
            }
        }
        Ok(())
    }

    /// The last run's values of the transient outputs.
    pub(super) fn transient_outputs(&self) -> &[(String, DynValue)] {
        &self.transient
    }

    /// Runs `session` with `host` and `held` inputs and the `in_place` states read from and
    /// written into their own buffers; returns the other outputs in `output_names`' order,
    /// but for those named in `transient`, kept in [`transient_outputs`]
    /// (Self::transient_outputs). `state_of` gives an in-place state's output and whether
    /// the session reads it; it and `transient` are read on the first run only. The caller
    /// checks [`serves`](Self::serves) first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &mut self,
        session: &mut Session,
        output_names: &[String],
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
        in_place: &[(&str, &mut DynValue)],
        state_of: &StateOf,
        transient: &[String],
    ) -> Result<Vec<(String, DynValue)>, EngineError> {
        let first = self.fresh;
        match first {
            true => self.bind_all(output_names, host, held, in_place, state_of, transient)?,
            false => self.bind_changes(host, held, in_place)?,
        }
        let api = ::ort::api();
        for (name, c, kept) in &self.returned {
            // A transient output stays bound to its buffer after the first run.
            if *kept && !first {
                continue;
            }
            // SAFETY: a live binding and memory info.
            let status =
                unsafe { (api.BindOutputToDevice)(self.binding_ptr(), c.as_ptr(), self.cpu.ptr()) };
            check(status, || format!("binding output '{name}'"))?;
        }
        // SAFETY: a live session and binding; runs of one session are not concurrent
        // (`&mut Session`).
        let status = unsafe {
            (api.RunWithBinding)(session.ptr() as *mut _, ptr::null(), self.binding.ptr())
        };
        check(status, || "run".into())?;
        // Every output written into a buffer of ours: nothing to collect.
        if !first && self.returned.iter().all(|(.., kept)| *kept) {
            return Ok(Vec::new());
        }
        let allocator: &Allocator = session.allocator();
        let mut values: *mut *mut OrtValue = ptr::null_mut();
        let mut count = 0usize;
        // SAFETY: a live binding after a run; the array and the values it holds are ours.
        let status = unsafe {
            (api.GetBoundOutputValues)(
                self.binding.ptr(),
                allocator.ptr() as *mut _,
                &mut values,
                &mut count,
            )
        };
        check(status, || "reading the bound outputs".into())?;
        let expected = self.in_place.len() + self.returned.len();
        let mut returned = Vec::with_capacity(self.returned.len());
        let mut adopted = Vec::new();
        for i in 0..count {
            // SAFETY: `count` values, each ours to keep or release once.
            let value = unsafe { *values.add(i) };
            let name = i
                .checked_sub(self.in_place.len())
                .and_then(|k| self.returned.get(k));
            match (name, NonNull::new(value), count == expected) {
                // A transient output after the first run: the buffer already kept.
                (Some((_, _, true)), _, true) if !first => {
                    // SAFETY: as below; released once, the binding holds its own reference.
                    unsafe { (api.ReleaseValue)(value) }
                }
                (Some((name, c, kept)), Some(value), true) => {
                    // SAFETY: a tensor the run made, with the session's allocator.
                    let value = unsafe { DynValue::from_ptr(value, Some(allocator)) };
                    match kept {
                        true => adopted.push((name.clone(), c.clone(), value)),
                        false => returned.push((name.clone(), value)),
                    }
                }
                // SAFETY: as above; released once, nothing else holds it.
                _ => unsafe { (api.ReleaseValue)(value) },
            }
        }
        if !values.is_null() {
            // SAFETY: the array GetBoundOutputValues allocated with this allocator.
            let status =
                unsafe { (api.AllocatorFree)(allocator.ptr() as *mut _, values as *mut c_void) };
            check(status, || "freeing the bound outputs' array".into())?;
        }
        let kept = self.returned.iter().filter(|(.., kept)| *kept).count();
        if count != expected || returned.len() + kept != self.returned.len() {
            return Err(EngineError::Ort {
                context: "reading the bound outputs".into(),
                message: format!("{count} values for {expected} outputs"),
            });
        }
        // The first run's values of the transient outputs become their buffers.
        for (name, c, value) in adopted {
            self.bind_output(&c, &name, &value)?;
            self.transient.push((name, value));
        }
        Ok(returned)
    }
}
