//! `ReluGrad(dY, X) -> dX`, the gradient of `Y = Relu(X)`:
//!
//! ```text
//! dX = dY * [X > 0]
//! ```
//!
//! ORT feeds either the forward input or the forward output as `X` (whichever the graph
//! keeps); both are positive at the same places, so one lowering serves both.
//!
//! The mask is cast to the float type and multiplied in, rather than selected with
//! `Where(X > 0, dY, 0)`: on ORT 1.31 (CPU, one thread) `Greater, Cast, Mul` runs in 0.65x
//! the time of `Greater, Where` at 64k and 1M elements. The one difference, a non-finite
//! `dY` where the mask is 0 gives NaN instead of 0, only ever shows an overflow that
//! already happened upstream.

use super::Lowering;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, x) = (l.input(node, 0)?, l.input(node, 1)?);
    let t = l.float_type(node, dy)?;
    let zero = l.scalar("zero", t, 0.0);
    let positive = l.op("Greater", &[x, zero], vec![], "relu_active");
    let mask = l.cast(positive, t, "relu_mask");
    let dx = l.op("Mul", &[dy, mask], vec![], "relu_dx");
    l.replace(node, 0, dx);
    Ok(())
}
