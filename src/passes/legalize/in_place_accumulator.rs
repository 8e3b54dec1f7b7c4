//! `InPlaceAccumulatorV2(buffer, grad, reset?) -> flag`: ORT's gradient accumulation, which
//! updates `buffer` in place and returns `true`:
//!
//! ```text
//! buffer <- reset ? grad : buffer + grad
//! ```
//!
//! A standard runtime has no in-place update, so the new buffer becomes an explicit value,
//! `<buffer>.next`, appended to the graph outputs and recorded as an accumulator state pair
//! (`buffer` -> `<buffer>.next`): the host, or a later pass, feeds it back. The flag becomes
//! the constant `true`, as ORT always outputs (measured).
//!
//! The select is an `If` on `reset`, so only the chosen branch runs: on ORT 1.31 (CPU, one
//! thread, 64k to 1M elements) it costs 1.0x to 1.2x a bare `Add`, where
//! `Where(reset, grad, buffer + grad)` costs 2.6x to 4.8x and `buffer * !reset + grad` 1.7x
//! to 1.8x. Without a reset input, or with a constant one, no `If` is needed.

use super::util::constant_scalar;
use super::{node_error, Lowering};
use crate::ir::builder::tensor_bool;
use crate::ir::{BodyId, NodeId, ValueId};
use crate::passes::PassError;
use crate::state::{Role, StateEntry};

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (buffer, grad) = (l.input(node, 0)?, l.input(node, 1)?);
    let reset = l.optional_input(node, 2);
    let model = l.model();
    if model.node(node).body != BodyId::MAIN || !model.graph_inputs().contains(&buffer) {
        return Err(node_error(
            model,
            node,
            format!(
                "the accumulation buffer '{}' must be an input of the main graph to become state",
                model.name(buffer)
            ),
        ));
    }
    let buffer_name = model.name(buffer).to_string();
    let buffer_type = model.value_type(buffer);
    let next_hint = format!("{buffer_name}.next");

    // The gradient in the buffer's element type (ORT allows e.g. an fp16 gradient into an
    // fp32 buffer).
    let grad = match l.elem_type(buffer) {
        Some(t) => l.cast(grad, t, "accumulated_grad"),
        None => grad,
    };
    let next = match reset.map(|r| (r, constant_scalar(l.model(), r))) {
        None => l.op("Add", &[buffer, grad], vec![], &next_hint),
        Some((_, Some(0.0))) => l.op("Add", &[buffer, grad], vec![], &next_hint),
        Some((_, Some(_))) => l.op("Identity", &[grad], vec![], &next_hint),
        Some((reset, None)) => {
            let if_node = l.b.node("If", "", &[Some(reset)], &[&next_hint], vec![]);
            let then_body = branch(l, if_node, "then_branch", "Identity", &[grad], &buffer_type);
            let else_body = branch(
                l,
                if_node,
                "else_branch",
                "Add",
                &[buffer, grad],
                &buffer_type,
            );
            debug_assert_ne!(then_body, else_body);
            l.model().output(if_node, 0)
        }
    };
    l.b.model
        .add_output(BodyId::MAIN, next, buffer_type.clone());
    let next_name = l.model().name(next).to_string();
    l.state.push(StateEntry {
        input: buffer_name.clone(),
        output: next_name,
        role: Role::Accumulator,
        param: crate::signature::ort_param_of_buffer(&buffer_name).map(str::to_string),
    });

    if let Some(flag) = l.used_output(node, 0) {
        // Not a shared constant: each flag may be a graph output with a name of its own.
        let name = l.model().name(flag).to_string();
        let t =
            l.b.model
                .add_initializer(l.b.body, &name, tensor_bool(&[1], &[true]));
        l.replace(node, 0, t);
    }
    Ok(())
}

/// Adds branch `attribute` to `if_node`: one `op` node over outer values `inputs`, whose
/// result is the branch output.
fn branch(
    l: &mut Lowering<'_, '_>,
    if_node: NodeId,
    attribute: &str,
    op: &str,
    inputs: &[ValueId],
    ty: &Option<crate::proto::TypeProto>,
) -> BodyId {
    let body = l.b.model.add_subgraph(if_node, attribute);
    let outer = std::mem::replace(&mut l.b.body, body);
    let out = l.op(op, inputs, vec![], &format!("{attribute}_out"));
    l.b.body = outer;
    l.b.model.add_output(body, out, ty.clone());
    body
}
