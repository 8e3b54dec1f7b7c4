//! Convolution: `Y = Conv(X, W, B)` with any strides, pads, dilations and groups.
//!
//! ```text
//! dB = ReduceSum(dY, all axes but 1)
//! dX = ConvTranspose(dY, W)  with the forward geometry
//! dW = correlation of X with dY (stride and dilation swap roles)
//! ```
//!
//! All three come from one `ConvGrad(dY, X, W)` carrying the forward attributes, the op
//! ONNX Runtime's gradient builder emits; its lowering (`passes/legalize/conv_grad.rs`)
//! picks the standard-op formulation per case and computes only the outputs in use.

use super::{Grad, InputGrads};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

const CONV_ATTRS: &[&str] = &[
    "auto_pad",
    "dilations",
    "group",
    "kernel_shape",
    "pads",
    "strides",
];

pub fn conv(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = dys[0].expect("a gradient for the output");
    let (x, w) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let attrs = cx.attrs_of(node, CONV_ATTRS);
    let hints: Vec<String> = (0..3)
        .map(|i| match cx.opt_input(node, i) {
            Some(v) => format!("{}_grad", cx.model().name(v)),
            None => "conv_bias_grad".to_string(),
        })
        .collect();
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    let g = cx.ort_op("ConvGrad", &[Some(dy), Some(x), Some(w)], &hint_refs, attrs);
    let mut out = vec![None; wants.len()];
    for (slot, want) in wants.iter().enumerate() {
        if *want {
            let v = cx.output(g, slot);
            let like = cx.input(node, slot)?;
            let f = cx.facts(like);
            cx.shapes.set(v, f);
            out[slot] = Some(v);
        }
    }
    Ok(out)
}
