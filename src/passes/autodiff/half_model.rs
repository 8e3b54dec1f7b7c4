//! A model stored in half precision (`model.half()` or `.bfloat16()` before the export, a
//! checkpoint kept in bfloat16) trains with float32 master parameters behind a float32
//! interface, and computes as the file does:
//!
//! ```text
//! p: float16 initializer          ->  p: float32 initializer (the same values, widened
//!                                        exactly), read as Cast(p, to = float16)
//! x: float16 graph input          ->  x: float32 graph input, read as Cast(x, to = float16)
//! loss_fn(Y: float16)             ->  loss_fn(Cast(Y, to = float32))        (loss_fn.rs)
//! ```
//!
//! The forward runs the file's own half arithmetic; each parameter's gradient comes back
//! through its Cast as float32, so accumulation, loss scaling, clipping and the optimizer
//! hold and update float32 values, as with `--precision` on a float32 model (DESIGN.md
//! section 5: what half precision can hold is too coarse for small updates: 1 + 1e-4 is 1 in
//! float16). The host exchanges float32 (it has no half tensors): data and the saved state
//! are float32, and `export` rounds the trained values back to the file's type. Half
//! initializers that do not train stay half constants.

use crate::ir::builder::{attr_int, Builder};
use crate::ir::{BodyId, Model, Use, ValueId};
use crate::proto::elem::{BFLOAT16, FLOAT, FLOAT16};
use crate::proto::TensorProto;

/// Whether `elem` is a half-precision float type.
pub fn is_half(elem: i32) -> bool {
    matches!(elem, FLOAT16 | BFLOAT16)
}

/// Whether a forward model is stored in float16: it has float16 initializers and no float32
/// or float64 ones (`model.half()` before the export). `rewrite` then scales the loss
/// dynamically by default, as with `--precision fp16`.
pub fn stored_in_float16(model: &crate::proto::ModelProto) -> bool {
    use crate::proto::elem::DOUBLE;
    let types: Vec<i32> = model
        .graph
        .iter()
        .flat_map(|g| &g.initializer)
        .map(|t| t.data_type())
        .collect();
    types.contains(&FLOAT16) && !types.iter().any(|t| matches!(*t, FLOAT | DOUBLE))
}

/// The float32 values of a float16 or bfloat16 tensor (raw little-endian bytes, or one value
/// per `int32_data` entry as ONNX stores them otherwise).
pub fn half_values(t: &TensorProto) -> Option<Vec<f32>> {
    let widen = |bits: u16| match t.data_type() {
        FLOAT16 => half::f16::from_bits(bits).to_f32(),
        _ => half::bf16::from_bits(bits).to_f32(),
    };
    if !is_half(t.data_type()) {
        return None;
    }
    let count: i64 = t.dims.iter().product();
    let values: Vec<f32> = match &t.raw_data {
        Some(raw) => raw
            .chunks_exact(2)
            .map(|c| widen(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        None => t.int32_data.iter().map(|x| widen(*x as u16)).collect(),
    };
    (values.len() as i64 == count).then_some(values)
}

/// Makes each half parameter of `params` a float32 initializer read through a Cast to its
/// type; returns how many.
pub fn float32_masters(model: &mut Model, params: &[ValueId], pass: &'static str) -> usize {
    let mut count = 0;
    for &p in params {
        let Some(t) = model.initializer(p) else {
            continue;
        };
        let elem = t.data_type();
        let Some(values) = half_values(t) else {
            continue;
        };
        let master = TensorProto {
            dims: t.dims.clone(),
            data_type: Some(FLOAT),
            raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            doc_string: t.doc_string.clone(),
            ..Default::default()
        };
        model.set_initializer(p, master);
        declare_float32(model, p);
        read_as(model, p, elem, pass);
        count += 1;
    }
    count
}

/// Makes each half data input of the main graph float32, cast to its type at entry; returns
/// their names.
pub fn float32_inputs(model: &mut Model, pass: &'static str) -> Vec<String> {
    let half_inputs: Vec<(ValueId, i32)> = model
        .main()
        .inputs
        .iter()
        .filter(|(v, _)| model.initializer(*v).is_none())
        .filter_map(|(v, info)| {
            let elem = info.r#type.as_ref()?.tensor_elem()?;
            is_half(elem).then_some((*v, elem))
        })
        .collect();
    let mut names = Vec::new();
    for (x, elem) in half_inputs {
        declare_float32(model, x);
        read_as(model, x, elem, pass);
        names.push(model.name(x).to_string());
    }
    names
}

/// Declares `v` float32 wherever the main graph declares its type (a graph input, a
/// value_info entry: exporters declare their initializers' types there too).
fn declare_float32(model: &mut Model, v: ValueId) {
    let main = model.body_mut(BodyId::MAIN);
    let declared = main.inputs.iter_mut().chain(main.value_info.iter_mut());
    for (_, info) in declared.filter(|(x, _)| *x == v) {
        if let Some(crate::proto::type_proto::Value::TensorType(t)) =
            info.r#type.as_mut().and_then(|t| t.value.as_mut())
        {
            t.elem_type = Some(FLOAT);
        }
    }
}

/// Points every node that reads `v` at `Cast(v, to = elem)` instead.
fn read_as(model: &mut Model, v: ValueId, elem: i32, pass: &'static str) {
    let readers: Vec<Use> = model.uses(v).to_vec();
    let hint = format!(
        "{}_{}",
        model.name(v),
        crate::ir::print::elem_type_name(elem)
    );
    let mut b = Builder::new(model, BodyId::MAIN, pass);
    let cast = b.op("Cast", &[v], vec![attr_int("to", elem as i64)], &hint);
    for u in readers {
        if let Use::Node { node, slot } = u {
            model.set_input(node, slot, Some(cast));
        }
    }
}
