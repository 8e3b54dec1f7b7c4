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
//! - every other output is bound to the CPU again before each run: ONNX Runtime would
//!   otherwise write the next run into the buffer the last run returned, which the caller
//!   now holds.
//!
//! A run whose inputs are not the names of the last run (a flush flag fed only sometimes)
//! starts a fresh binding: an input left bound would be read with its old value.
//!
//! Everything goes through ONNX Runtime's C API: ort's `IoBinding` methods copy lent
//! inputs and wrap every output in more calls than the run's own work at this size.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::ptr::{self, NonNull};

use ::ort::memory::{Allocator, MemoryInfo};
use ::ort::session::Session;
use ::ort::sys::{OrtIoBinding, OrtStatusPtr, OrtValue};
use ::ort::value::DynValue;
use ::ort::AsPointer;

use super::ort::{take_by_name, to_owned_ort};
use super::EngineError;
use crate::data::Tensor;

/// A session's binding, and what is bound to it.
pub(super) struct KeptBinding {
    binding: ::ort::session::IoBinding,
    cpu: MemoryInfo<'static>,
    /// The inputs of the runs this binding serves, in the order the runs give them: host
    /// ones first, then held ones.
    input_names: Vec<String>,
    /// The host inputs' own values (bound once), by name.
    host_values: HashMap<String, DynValue>,
    /// The address of the buffer bound to each held input and in-place output, by name
    /// (compared, never dereferenced).
    bound: HashMap<String, usize>,
    /// The outputs in the order the binding returns them (the order first bound), and
    /// whether each is an in-place state's (not returned to the caller).
    outputs: Vec<(String, bool)>,
    names: HashMap<String, CString>,
}

fn check(status: OrtStatusPtr, what: impl FnOnce() -> String) -> Result<(), EngineError> {
    if status.0.is_null() {
        return Ok(());
    }
    let api = ::ort::api();
    // SAFETY: a non-null status the API returned, read and released once.
    let message = unsafe {
        let message = std::ffi::CStr::from_ptr((api.GetErrorMessage)(status.0))
            .to_string_lossy()
            .into_owned();
        (api.ReleaseStatus)(status.0);
        message
    };
    Err(EngineError::Ort {
        context: what(),
        message,
    })
}

/// The data pointer of a tensor value.
fn data_of(value: &DynValue, name: &str) -> Result<*mut c_void, EngineError> {
    let mut data = ptr::null_mut();
    // SAFETY: a live tensor value; ONNX Runtime only reads it.
    let status = unsafe { (::ort::api().GetTensorMutableData)(value.ptr() as *mut _, &mut data) };
    check(status, || format!("reading the buffer of '{name}'"))?;
    Ok(data)
}

/// Copies `tensor` into `value`, which has its element type and shape.
fn copy_into(value: &DynValue, tensor: &Tensor, name: &str) -> Result<(), EngineError> {
    let data = data_of(value, name)?;
    macro_rules! copy {
        ($a:expr, $t:ty) => {{
            // SAFETY: `value` holds as many elements of this type as `$a` (checked by the
            // caller: same element type, same shape), and nothing else writes it now.
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
    Ok(())
}

/// The element type and shape a host value was made for.
fn same_layout(value: &DynValue, tensor: &Tensor) -> bool {
    let Some(shape) = value.dtype().tensor_shape() else {
        return false;
    };
    let dtype = match tensor {
        Tensor::F32(_) => ::ort::value::TensorElementType::Float32,
        Tensor::F64(_) => ::ort::value::TensorElementType::Float64,
        Tensor::I64(_) => ::ort::value::TensorElementType::Int64,
        Tensor::I32(_) => ::ort::value::TensorElementType::Int32,
        Tensor::Bool(_) => ::ort::value::TensorElementType::Bool,
    };
    value.dtype().tensor_type() == Some(dtype)
        && shape.len() == tensor.shape().len()
        && shape
            .iter()
            .zip(tensor.shape())
            .all(|(a, b)| *a == *b as i64)
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
            input_names: Vec::new(),
            host_values: HashMap::new(),
            bound: HashMap::new(),
            outputs: Vec::new(),
            names: HashMap::new(),
        })
    }

    /// Whether this binding serves a run of these inputs (the same names, in order).
    pub(super) fn serves(&self, host: &[(&str, &Tensor)], held: &[(&str, &DynValue)]) -> bool {
        self.input_names.len() == host.len() + held.len()
            && host
                .iter()
                .map(|(n, _)| *n)
                .chain(held.iter().map(|(n, _)| *n))
                .zip(&self.input_names)
                .all(|(a, b)| a == b)
    }

    fn binding_ptr(&self) -> *mut OrtIoBinding {
        self.binding.ptr() as *mut _
    }

    fn c_name(&mut self, name: &str) -> Result<*const std::ffi::c_char, EngineError> {
        if !self.names.contains_key(name) {
            let c = CString::new(name).map_err(|_| EngineError::Input {
                name: name.to_string(),
                message: "has a NUL byte in its name".into(),
            })?;
            self.names.insert(name.to_string(), c);
        }
        Ok(self.names[name].as_ptr())
    }

    fn bind_input(&mut self, name: &str, value: *const OrtValue) -> Result<(), EngineError> {
        let c = self.c_name(name)?;
        // SAFETY: a live binding and value; ONNX Runtime keeps its own reference.
        let status = unsafe { (::ort::api().BindInput)(self.binding_ptr(), c, value) };
        check(status, || format!("binding input '{name}'"))
    }

    /// Runs `session` with `host` and `held` inputs and the `in_place` states (input name,
    /// output name, value) read from and written into their own buffers; returns the other
    /// outputs in `output_names`' order. Runs must come with the same inputs
    /// ([`serves`](Self::serves)) and the same in-place states each time.
    pub(super) fn run(
        &mut self,
        session: &mut Session,
        output_names: &[String],
        host: &[(&str, &Tensor)],
        held: &[(&str, &DynValue)],
        in_place: &mut [(&str, &str, bool, &mut DynValue)],
    ) -> Result<Vec<(String, DynValue)>, EngineError> {
        let first = self.input_names.is_empty() && self.outputs.is_empty();
        for (name, tensor) in host {
            match self.host_values.get(*name) {
                Some(value) if same_layout(value, tensor) => copy_into(value, tensor, name)?,
                _ => {
                    let value = to_owned_ort(name, tensor)?;
                    self.bind_input(name, value.ptr())?;
                    self.host_values.insert(name.to_string(), value);
                }
            }
        }
        for (name, value) in held {
            let data = data_of(value, name)? as usize;
            if self.bound.get(*name) != Some(&data) {
                self.bind_input(name, value.ptr())?;
                self.bound.insert(name.to_string(), data);
            }
        }
        for (input, output, read, value) in in_place.iter_mut() {
            let data = data_of(value, input)? as usize;
            if *read && self.bound.get(*input) != Some(&data) {
                self.bind_input(input, value.ptr())?;
                self.bound.insert(input.to_string(), data);
            }
            if self.bound.get(*output) != Some(&data) {
                let c = self.c_name(output)?;
                // SAFETY: a live binding and value (ONNX Runtime's own memory).
                let status =
                    unsafe { (::ort::api().BindOutput)(self.binding_ptr(), c, value.ptr()) };
                check(status, || format!("binding output '{output}' to '{input}'"))?;
                self.bound.insert(output.to_string(), data);
            }
        }
        let in_place_output = |name: &str| in_place.iter().any(|(_, o, _, _)| *o == name);
        if first {
            // The binding returns outputs in the order they were first bound: the in-place
            // ones (above), then the rest in the model's order (below).
            self.outputs = in_place
                .iter()
                .map(|(_, output, _, _)| (output.to_string(), true))
                .collect();
        }
        for name in output_names {
            if in_place_output(name) {
                continue;
            }
            let c = self.c_name(name)?;
            // SAFETY: a live binding and memory info.
            let status =
                unsafe { (::ort::api().BindOutputToDevice)(self.binding_ptr(), c, self.cpu.ptr()) };
            check(status, || format!("binding output '{name}'"))?;
            if first {
                self.outputs.push((name.clone(), false));
            }
        }
        if first {
            self.input_names = host
                .iter()
                .map(|(n, _)| n.to_string())
                .chain(held.iter().map(|(n, _)| n.to_string()))
                .collect();
        }
        let api = ::ort::api();
        // SAFETY: a live session and binding; runs of one session are not concurrent
        // (`&mut Session`).
        let status = unsafe {
            (api.RunWithBinding)(session.ptr() as *mut _, ptr::null(), self.binding.ptr())
        };
        check(status, || "run".into())?;
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
        if count != self.outputs.len() || values.is_null() {
            // SAFETY: as above; nothing else holds them.
            unsafe {
                for i in 0..count {
                    (api.ReleaseValue)(*values.add(i));
                }
                if !values.is_null() {
                    let status =
                        (api.AllocatorFree)(allocator.ptr() as *mut _, values as *mut c_void);
                    let _ = check(status, String::new);
                }
            }
            return Err(EngineError::Ort {
                context: "reading the bound outputs".into(),
                message: format!("{count} values for {} outputs", self.outputs.len()),
            });
        }
        let mut returned: HashMap<&str, DynValue> = HashMap::new();
        for (i, (name, in_place)) in self.outputs.iter().enumerate() {
            // SAFETY: `count` values, each ours to keep or release once.
            let value = unsafe { *values.add(i) };
            match (*in_place, NonNull::new(value)) {
                (true, _) | (false, None) => unsafe { (api.ReleaseValue)(value) },
                (false, Some(value)) => {
                    // SAFETY: a tensor the run made, with the session's allocator.
                    let value = unsafe { DynValue::from_ptr(value, Some(allocator)) };
                    returned.insert(name.as_str(), value);
                }
            }
        }
        // SAFETY: the array GetBoundOutputValues allocated with this allocator.
        let status =
            unsafe { (api.AllocatorFree)(allocator.ptr() as *mut _, values as *mut c_void) };
        check(status, || "freeing the bound outputs' array".into())?;
        take_by_name(
            output_names.iter().filter(|n| !in_place_output(n)),
            returned,
        )
    }
}
