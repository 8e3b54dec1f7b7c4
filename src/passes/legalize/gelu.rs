//! `com.microsoft::Gelu(X) -> Y` (lowered only with `legalize-ort(gelu=true)`: standard ORT
//! has this op, other engines may not), the exact GELU:
//!
//! ```text
//! Y = 0.5 * X * (1 + erf(X / sqrt 2))
//! ```
//!
//! From opset 20 ONNX has `Gelu` itself. Before, the decomposition is written exactly in
//! the shape ORT's `GeluFusion` recognises (`Div` by sqrt 2, `Erf`, `Add` 1, `Mul` by X,
//! `Mul` by 0.5), so a standard runtime fuses it back into one kernel.

use std::f64::consts::SQRT_2;

use super::Lowering;
use crate::ir::builder::attr_string;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let x = l.input(node, 0)?;
    let y = if l.onnx_opset() >= 20 {
        l.op(
            "Gelu",
            &[x],
            vec![attr_string("approximate", "none")],
            "gelu",
        )
    } else {
        let t = l.float_type(node, x)?;
        let sqrt2 = l.scalar("sqrt2", t, SQRT_2);
        let one = l.scalar("one", t, 1.0);
        let half = l.scalar("half", t, 0.5);
        let scaled = l.op("Div", &[x, sqrt2], vec![], "gelu_erf_arg");
        let erf = l.op("Erf", &[scaled], vec![], "gelu_erf");
        let erf_1 = l.op("Add", &[erf, one], vec![], "gelu_erf_1");
        let x_erf_1 = l.op("Mul", &[x, erf_1], vec![], "gelu_x_erf_1");
        l.op("Mul", &[x_erf_1, half], vec![], "gelu")
    };
    l.replace(node, 0, y);
    Ok(())
}
