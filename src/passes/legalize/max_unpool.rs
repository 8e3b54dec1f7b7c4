//! `MaxUnpool(X, I, output_shape)` (standard ONNX, opset 11) for engines that lack it
//! (tract 0.23): every element of X goes to the flat position its index names in a zero
//! tensor of `output_shape`. `I` holds flat positions over the whole output (`N·C·H·W`), as
//! MaxPool's `Indices` do, so the op is one scatter over the flattened output:
//!
//! ```text
//! Y = Reshape(ScatterElements(zeros[prod(output_shape)], Reshape(I, [-1]), Reshape(X, [-1]),
//!                             axis = 0), output_shape)
//! ```
//!
//! `legalize-ort` emits MaxUnpool for MaxPoolGrad only when no two pooling windows overlap,
//! so the indices are distinct and the plain (non-adding) scatter is exact. Without
//! `output_shape` the output shape follows from the kernel, strides and pads; that form is
//! an error naming the node (none of our lowerings emits it).

use super::util::{scatter_flat, ScatterNames};
use super::{node_error, Lowering};
use crate::ir::builder::attr_int;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let x = l.input(node, 0)?;
    let indices = l.input(node, 1)?;
    let Some(shape) = l.optional_input(node, 2) else {
        return Err(node_error(
            l.model(),
            node,
            "MaxUnpool without its output_shape input cannot be lowered (the shape is needed for the scatter)".into(),
        ));
    };
    if l.used_output(node, 0).is_none() {
        return Ok(());
    }
    let elem = l.float_type(node, x)?;
    let flat = l.int64s("flat", &[-1]);
    let size = l.op(
        "ReduceProd",
        &[shape],
        vec![attr_int("keepdims", 1)],
        "unpool_size",
    );
    let names = ScatterNames {
        zeros: "unpool_zeros",
        indices: "unpool_indices_flat",
        values: "unpool_x_flat",
        result: "unpool_flat",
    };
    let scattered = scatter_flat(l, elem, flat, size, indices, x, false, names);
    let y = l.op("Reshape", &[scattered, shape], vec![], "unpool");
    l.replace(node, 0, y);
    Ok(())
}
