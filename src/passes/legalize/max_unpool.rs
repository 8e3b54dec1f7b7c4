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

use super::{node_error, Lowering};
use crate::ir::builder::{attr_int, attr_tensor};
use crate::ir::NodeId;
use crate::passes::PassError;
use crate::proto::TensorProto;

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
    let zero = TensorProto {
        dims: vec![1],
        data_type: Some(elem),
        raw_data: Some(vec![0; super::util::elem_size(elem)]),
        ..Default::default()
    };
    let zeros = l.op(
        "ConstantOfShape",
        &[size],
        vec![attr_tensor("value", zero)],
        "unpool_zeros",
    );
    let flat_indices = l.op("Reshape", &[indices, flat], vec![], "unpool_indices_flat");
    let flat_x = l.op("Reshape", &[x, flat], vec![], "unpool_x_flat");
    let scattered = l.op(
        "ScatterElements",
        &[zeros, flat_indices, flat_x],
        vec![attr_int("axis", 0)],
        "unpool_flat",
    );
    let y = l.op("Reshape", &[scattered, shape], vec![], "unpool");
    l.replace(node, 0, y);
    Ok(())
}
