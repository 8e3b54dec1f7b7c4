//! A fused kernel's tensors, read straight through ONNX Runtime's C API.
//!
//! ort's `ComputeContext::input` and `output` wrap every tensor in a `Value`: an `Arc`, its
//! memory info and type read back through three more C calls, a shape vector, and
//! `try_extract_tensor` checks them all again. For a kernel with a few large operands that
//! is nothing; the grouped AdamW of a small model has 30-odd small operands, and at 8K
//! parameters the wrapping took most of the kernel's time (the ORT profile: 42 µs per apply
//! for 8 µs of arithmetic; benches/README.md, "Scaling with model size"). Here a tensor is
//! its element type, shape and data pointer, borrowed for the one compute call.
//!
//! The kernels are registered for the CPU execution provider only, so every tensor they
//! see is in host memory.

use std::ffi::{c_void, CStr};
use std::marker::PhantomData;

use ::ort::operator::ComputeContext;
use ::ort::sys::{ONNXTensorElementDataType, OrtStatusPtr, OrtValue};
use ::ort::AsPointer;

/// One input tensor of the running kernel.
pub(super) struct Input<'c> {
    pub shape: &'c [i64],
    value: *const OrtValue,
    element: ONNXTensorElementDataType,
    data: *const c_void,
    len: usize,
}

/// One output tensor the running kernel allocated: where it writes.
pub(super) struct Output<'c> {
    value: *mut OrtValue,
    data: *mut f32,
    len: usize,
    _kernel: PhantomData<&'c ComputeContext>,
}

/// ONNX Runtime's message when `status` is an error, which it then frees; `None` for success.
pub(super) fn status_message(status: OrtStatusPtr) -> Option<String> {
    if status.0.is_null() {
        return None;
    }
    let api = ::ort::api();
    // SAFETY: a non-null status returned by the API, read and released once.
    Some(unsafe {
        let message = CStr::from_ptr((api.GetErrorMessage)(status.0))
            .to_string_lossy()
            .into_owned();
        (api.ReleaseStatus)(status.0);
        message
    })
}

/// `Err` with ONNX Runtime's message when `status` is an error (and frees it).
pub(super) fn check(status: OrtStatusPtr, what: impl FnOnce() -> String) -> ::ort::Result<()> {
    match status_message(status) {
        None => Ok(()),
        Some(message) => Err(::ort::Error::new(format!("{}: {message}", what()))),
    }
}

/// The element type, shape and element count of a tensor value.
///
/// # Safety
/// `value` is a live tensor value of the running kernel.
unsafe fn describe<'c>(
    value: *const OrtValue,
    op: &str,
    what: impl Fn() -> String,
) -> ::ort::Result<(ONNXTensorElementDataType, &'c [i64], usize)> {
    let api = ::ort::api();
    let mut element = ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    let (mut dims, mut rank): (*const i64, usize) = (std::ptr::null(), 0);
    check(
        (api.GetTensorElementTypeAndShapeDataReference)(value, &mut element, &mut dims, &mut rank),
        || format!("{op}: the shape of {}", what()),
    )?;
    let shape: &'c [i64] = match rank {
        0 => &[],
        _ => std::slice::from_raw_parts(dims, rank),
    };
    let len = shape.iter().try_fold(1usize, |n, &d| {
        usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
    });
    let len =
        len.ok_or_else(|| ::ort::Error::new(format!("{op}: {} has shape {shape:?}", what())))?;
    Ok((element, shape, len))
}

/// The data pointer of a tensor value (null for no elements).
///
/// # Safety
/// `value` is a live tensor value of the running kernel.
unsafe fn data_of(
    value: *const OrtValue,
    op: &str,
    what: impl Fn() -> String,
) -> ::ort::Result<*mut c_void> {
    let mut data = std::ptr::null_mut();
    check(
        (::ort::api().GetTensorMutableData)(value.cast_mut(), &mut data),
        || format!("{op}: the data of {}", what()),
    )?;
    Ok(data)
}

/// Input `slot` of the running kernel `op`; `None` when the optional input is absent.
pub(super) fn input<'c>(
    ctx: &'c ComputeContext,
    op: &str,
    slot: usize,
) -> ::ort::Result<Option<Input<'c>>> {
    let mut value: *const OrtValue = std::ptr::null();
    // SAFETY: the context is the running kernel's; ONNX Runtime keeps its inputs alive for
    // the compute call, which `'c` (the context's borrow) does not outlive.
    unsafe {
        check(
            (::ort::api().KernelContext_GetInput)(ctx.ptr(), slot, &mut value),
            || format!("{op}: input {slot}"),
        )?;
        if value.is_null() {
            return Ok(None);
        }
        let what = || format!("input {slot}");
        let (element, shape, len) = describe(value, op, what)?;
        let data = data_of(value, op, what)?;
        Ok(Some(Input {
            shape,
            value,
            element,
            data,
            len,
        }))
    }
}

/// Input `slot`, which `op` requires.
pub(super) fn required<'c>(
    ctx: &'c ComputeContext,
    op: &str,
    slot: usize,
) -> ::ort::Result<Input<'c>> {
    input(ctx, op, slot)?.ok_or_else(|| ::ort::Error::new(format!("{op}: input {slot} is missing")))
}

impl<'c> Input<'c> {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Where the data starts: to tell whether an output shares this input's buffer.
    pub fn address(&self) -> *const c_void {
        self.data
    }

    /// The value itself, to hand to an operator the kernel invokes.
    pub fn value(&self) -> *const OrtValue {
        self.value
    }

    /// The elements as float32; an error naming `op` and `slot` for another type.
    pub fn f32s(&self, op: &str, slot: usize) -> ::ort::Result<&'c [f32]> {
        self.typed(
            ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
            op,
            slot,
        )
    }

    /// The elements as booleans; an error naming `op` and `slot` for another type.
    pub fn bools(&self, op: &str, slot: usize) -> ::ort::Result<&'c [bool]> {
        self.typed(
            ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL,
            op,
            slot,
        )
    }

    fn typed<T>(
        &self,
        want: ONNXTensorElementDataType,
        op: &str,
        slot: usize,
    ) -> ::ort::Result<&'c [T]> {
        if self.element != want {
            return Err(::ort::Error::new(format!(
                "{op}: input {slot} is {:?}, not {want:?}",
                self.element
            )));
        }
        if self.len == 0 || self.data.is_null() {
            return Ok(&[]);
        }
        // SAFETY: a tensor of `len` elements of type T (checked above), alive for 'c. A
        // kernel only writes to it when an output is bound to the same buffer, and the
        // kernels read such an input through its output alone (`run_update`).
        Ok(unsafe { std::slice::from_raw_parts(self.data.cast::<T>(), self.len) })
    }
}

/// Output `slot` of the running kernel `op`, allocated by ONNX Runtime as a float32 tensor
/// of `shape` (or the buffer the session bound to it, when it bound one).
pub(super) fn output<'c>(
    ctx: &'c ComputeContext,
    op: &str,
    slot: usize,
    shape: &[i64],
) -> ::ort::Result<Output<'c>> {
    let mut value: *mut OrtValue = std::ptr::null_mut();
    // SAFETY: as for `input`; the output lives until the compute call returns.
    unsafe {
        check(
            (::ort::api().KernelContext_GetOutput)(
                ctx.ptr().cast_mut(),
                slot,
                shape.as_ptr(),
                shape.len(),
                &mut value,
            ),
            || format!("{op}: output {slot}"),
        )?;
        if value.is_null() {
            return Err(::ort::Error::new(format!("{op}: output {slot} missing")));
        }
        let what = || format!("output {slot}");
        let (element, _, len) = describe(value, op, what)?;
        if element != ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT {
            return Err(::ort::Error::new(format!(
                "{op}: output {slot} is {element:?}, not float32"
            )));
        }
        let data = data_of(value, op, what)?.cast::<f32>();
        Ok(Output {
            value,
            data,
            len,
            _kernel: PhantomData,
        })
    }
}

impl<'c> Output<'c> {
    /// Where the data starts: to tell whether the session bound this output to an input.
    pub fn address(&self) -> *const c_void {
        self.data.cast()
    }

    /// The value itself, for an operator the kernel invokes to write.
    pub fn value(&self) -> *mut OrtValue {
        self.value
    }

    /// The elements to write.
    pub fn into_slice(self) -> &'c mut [f32] {
        if self.len == 0 || self.data.is_null() {
            return &mut [];
        }
        // SAFETY: the output's own `len` float32 elements, alive for 'c; each output is
        // turned into a slice once (`self` is consumed), and outputs do not share buffers.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
}
