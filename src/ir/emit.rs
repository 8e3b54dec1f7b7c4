//! What every pass that emits ops shares, whatever it keeps beside the builder: scalar
//! constants as bytes, the value of a one-element constant, and the ops whose signature
//! changed across opsets (`ReduceSum`, `Squeeze` and `Unsqueeze` take their axes as an input
//! from opset 13, the other reductions from 18).
//!
//! [`Emit`] is the one way passes build default-domain ops: typed constructors (`mul`,
//! `sqrt`, `select`, ...), so an update reads like its formula, and the opset-aware forms.
//! The plain [`Builder`] implements it (the optimizer, AGC, loss scaling; its constants are
//! reused per body, pass and hint: [`crate::ir::Model::shared_constant`]), and so do the
//! legalize lowerings and the autodiff rules, which name their constants in their own way
//! and keep their own facts.

use super::builder::{attr_int, attr_ints, Builder};
use super::ValueId;
use crate::proto::{AttributeProto, TensorProto};

use crate::proto::elem::{BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64};

/// Little-endian bytes of `value` as ONNX element type `elem`: the float types, int64 and
/// int32.
pub fn scalar_bytes(elem: i32, value: f64) -> Option<Vec<u8>> {
    Some(match elem {
        FLOAT => (value as f32).to_le_bytes().to_vec(),
        DOUBLE => value.to_le_bytes().to_vec(),
        FLOAT16 => half::f16::from_f64(value).to_le_bytes().to_vec(),
        BFLOAT16 => half::bf16::from_f64(value).to_le_bytes().to_vec(),
        INT64 => (value as i64).to_le_bytes().to_vec(),
        INT32 => (value as i32).to_le_bytes().to_vec(),
        _ => return None,
    })
}

/// A rank-0 tensor of element type `elem` holding `value` (float32 bytes for a type
/// [`scalar_bytes`] does not write).
pub fn scalar_tensor(elem: i32, value: f64) -> TensorProto {
    let bytes = scalar_bytes(elem, value).unwrap_or_else(|| (value as f32).to_le_bytes().to_vec());
    TensorProto {
        data_type: Some(elem),
        raw_data: Some(bytes),
        ..Default::default()
    }
}

/// The single element of a one-element float, integer or bool tensor, as f64.
pub fn tensor_scalar(t: &TensorProto) -> Option<f64> {
    if t.dims.iter().product::<i64>() != 1 {
        return None;
    }
    let raw = t.raw_data.as_deref();
    let le = |n: usize| raw.and_then(|r| r.get(..n));
    match t.data_type() {
        FLOAT => le(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .or_else(|| t.float_data.first().map(|x| *x as f64)),
        DOUBLE => le(8)
            .map(|b| f64::from_le_bytes(std::array::from_fn(|i| b[i])))
            .or_else(|| t.double_data.first().copied()),
        FLOAT16 => le(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
            .or_else(|| {
                t.int32_data
                    .first()
                    .map(|x| half::f16::from_bits(*x as u16).to_f64())
            }),
        BFLOAT16 => le(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
            .or_else(|| {
                t.int32_data
                    .first()
                    .map(|x| half::bf16::from_bits(*x as u16).to_f64())
            }),
        INT64 => le(8)
            .map(|b| i64::from_le_bytes(std::array::from_fn(|i| b[i])) as f64)
            .or_else(|| t.int64_data.first().map(|x| *x as f64)),
        INT32 => le(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .or_else(|| t.int32_data.first().map(|x| *x as f64)),
        BOOL => le(1)
            .map(|b| (b[0] != 0) as u8 as f64)
            .or_else(|| t.int32_data.first().map(|x| (*x != 0) as u8 as f64)),
        _ => None,
    }
}

/// Whether `op` takes its axes as an input (else as an attribute) at default-domain
/// opset `opset`.
pub fn axes_as_input(op: &str, opset: i64) -> bool {
    match op {
        "ReduceSum" | "Squeeze" | "Unsqueeze" => opset >= 13,
        _ => opset >= 18,
    }
}

/// Typed constructors of two-input ops: `fn name(&mut self, a, b, hint)`.
macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $op:literal,)*) => {
        $(
            $(#[$doc])*
            fn $name(&mut self, a: ValueId, b: ValueId, hint: &str) -> ValueId {
                self.op($op, &[a, b], vec![], hint)
            }
        )*
    };
}

/// Typed constructors of one-input ops: `fn name(&mut self, x, hint)`.
macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident => $op:literal,)*) => {
        $(
            $(#[$doc])*
            fn $name(&mut self, x: ValueId, hint: &str) -> ValueId {
                self.op($op, &[x], vec![], hint)
            }
        )*
    };
}

/// An emitter of default-domain ops: what a pass provides (its opset, its node builder,
/// its shared int64 constants) and the ops whose form depends on the opset.
pub trait Emit {
    /// The default-domain opset the model imports.
    fn opset(&self) -> i64;

    /// A node of the default domain with one output.
    fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId;

    /// A 1-D int64 constant holding `axes` (shared per body by the implementation).
    fn axes(&mut self, axes: &[i64]) -> ValueId;

    /// `ReduceSum`/`ReduceMean`/... over `axes` (all axes when empty), in the opset's form.
    fn reduce(
        &mut self,
        op: &str,
        x: ValueId,
        axes: &[i64],
        keepdims: bool,
        hint: &str,
    ) -> ValueId {
        let keep = attr_int("keepdims", keepdims as i64);
        if axes.is_empty() {
            return self.op(op, &[x], vec![keep], hint);
        }
        if axes_as_input(op, self.opset()) {
            let a = self.axes(axes);
            self.op(op, &[x, a], vec![keep], hint)
        } else {
            self.op(op, &[x], vec![attr_ints("axes", axes), keep], hint)
        }
    }

    /// `Unsqueeze(x, axes)` in the opset's form.
    fn unsqueeze(&mut self, x: ValueId, axes: &[i64], hint: &str) -> ValueId {
        if axes_as_input("Unsqueeze", self.opset()) {
            let a = self.axes(axes);
            self.op("Unsqueeze", &[x, a], vec![], hint)
        } else {
            self.op("Unsqueeze", &[x], vec![attr_ints("axes", axes)], hint)
        }
    }

    binary_ops! {
        /// `a + b`
        add => "Add",
        /// `a - b`
        sub => "Sub",
        /// `a · b`
        mul => "Mul",
        /// `a / b`
        div => "Div",
        /// `a ^ b`
        pow => "Pow",
        /// `max(a, b)`, elementwise
        max => "Max",
        /// `min(a, b)`, elementwise
        min => "Min",
        /// `a == b`
        equal => "Equal",
        /// `a < b`
        less => "Less",
        /// `a > b`
        greater => "Greater",
        /// `a >= b`
        greater_or_equal => "GreaterOrEqual",
        /// `a ∨ b`
        or => "Or",
        /// `a ∧ b`
        and => "And",
    }

    unary_ops! {
        /// `√x`
        sqrt => "Sqrt",
        /// `-x`
        neg => "Neg",
        /// `|x|`
        abs => "Abs",
        /// `¬x`
        not => "Not",
        /// `x` unchanged (a named copy)
        identity => "Identity",
    }

    /// `cond ? a : b`, elementwise (`Where`).
    fn select(&mut self, cond: ValueId, a: ValueId, b: ValueId, hint: &str) -> ValueId {
        self.op("Where", &[cond, a, b], vec![], hint)
    }

    /// `x` as ONNX element type `to` (`Cast`).
    fn cast_to(&mut self, x: ValueId, to: i32, hint: &str) -> ValueId {
        self.op("Cast", &[x], vec![attr_int("to", to as i64)], hint)
    }
}

impl Emit for Builder<'_> {
    fn opset(&self) -> i64 {
        self.model.opset("").unwrap_or(1)
    }

    fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId {
        Builder::op(self, op_type, inputs, attributes, hint)
    }

    fn axes(&mut self, axes: &[i64]) -> ValueId {
        self.ints("axes", axes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::builder::{tensor_f32, tensor_i64};

    #[test]
    fn scalars_round_trip() {
        for (elem, v) in [
            (FLOAT, 0.5),
            (DOUBLE, -1e-300),
            (FLOAT16, 0.25),
            (INT64, -7.0),
        ] {
            let t = TensorProto {
                data_type: Some(elem),
                raw_data: scalar_bytes(elem, v),
                ..Default::default()
            };
            assert_eq!(tensor_scalar(&t), Some(v), "{elem}");
        }
        assert_eq!(tensor_scalar(&tensor_f32(&[1], &[3.5])), Some(3.5));
        assert_eq!(tensor_scalar(&tensor_i64(&[2], &[1, 2])), None);
    }

    #[test]
    fn axes_forms_by_opset() {
        assert!(!axes_as_input("ReduceSum", 12) && axes_as_input("ReduceSum", 13));
        assert!(!axes_as_input("ReduceMean", 17) && axes_as_input("ReduceMean", 18));
        assert!(axes_as_input("Unsqueeze", 13) && !axes_as_input("Unsqueeze", 11));
    }
}
