//! The micro-step counter of the micro-steps that continue a window, counted by the host.
//!
//! The trainer knows which micro-step of the window it runs (it picks the specialisation by
//! it: `crate::split::applies`), and in the accumulate specialisation the counter's next
//! value is `Add(micro_step, 1)`. Counting it in the session costs a node, an input and an
//! output per run, a few µs where the step is small: at 8K parameters the floor is ~20
//! nodes (benches/README.md, "Scaling with model size"). So the accumulate specialisation
//! (and the window start made from it) returns no counter; the host writes `micro_step + 1`
//! as the state's next value, the same number. The apply still computes its counter, and
//! the exported step is unchanged.

use crate::ir::{BodyId, Model, Use, ValueDef};
use crate::split::Specialised;
use crate::state::{Manifest, Role};

/// `accumulate` without its micro-step counter output, when that output is
/// `Add(micro_step, 1)` of the counter's own input; `None` otherwise (then the session
/// counts, as before).
pub fn without_counter(accumulate: &Specialised, manifest: &Manifest) -> Option<Specialised> {
    let entry = manifest.state.iter().find(|e| e.role == Role::MicroStep)?;
    let mut model = Model::from_proto(accumulate.model.clone());
    let input = model.lookup(BodyId::MAIN, &entry.input)?;
    let outputs = model.graph_outputs();
    let index = outputs
        .iter()
        .position(|&v| model.name(v) == entry.output)?;
    let ValueDef::Node { node, slot: 0 } = model.value(outputs[index]).def else {
        return None;
    };
    let add = model.node(node);
    let plus_one = add.proto.op_type() == "Add"
        && crate::ir::normalize_domain(add.proto.domain()).is_empty()
        && add.proto.attribute.is_empty()
        && add.body == BodyId::MAIN
        && add.inputs.len() == 2
        && add.inputs[0] == Some(input)
        && add.inputs[1]
            .and_then(|one| crate::passes::autodiff::shapes::constant_ints(&model, one))
            .is_some_and(|one| one == [1]);
    // The output must be the counter's only way out of the graph.
    let once = model
        .uses(outputs[index])
        .iter()
        .filter(|u| matches!(u, Use::Output { .. }))
        .count()
        == 1;
    if !plus_one || !once {
        return None;
    }
    model.remove_output(BodyId::MAIN, index);
    crate::passes::dce::eliminate_dead_code(&mut model);
    Some(Specialised {
        model: model.to_proto(),
        unchanged: accumulate.unchanged.clone(),
    })
}
