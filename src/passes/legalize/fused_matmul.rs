//! (lowering not written yet)

use super::{node_error, Lowering};
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    Err(node_error(
        l.model(),
        node,
        "lowering not implemented yet".into(),
    ))
}
