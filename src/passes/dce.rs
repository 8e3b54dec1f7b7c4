//! `dce`: removes nodes none of whose outputs is used, and initializers nothing reads
//! (graph inputs stay: they are the model's interface).

use super::{Pass, PassContext, PassError, PassReport};
use crate::ir::Model;

pub struct DeadCodeElimination;

impl Pass for DeadCodeElimination {
    fn name(&self) -> &'static str {
        "dce"
    }

    /// No node is left that nothing reads.
    fn ensures(&self, model: &Model, _cx: &PassContext<'_>) -> Result<(), PassError> {
        match model.all_nodes().find(|&n| is_dead(model, n)) {
            None => Ok(()),
            Some(n) => Err(super::broken(
                "dce",
                format!("node '{}' is dead", model.node(n).proto.name()),
            )),
        }
    }

    fn run(
        &mut self,
        model: &mut Model,
        _cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        let removed = eliminate_dead_code(model);
        Ok(PassReport {
            changed: removed > 0,
            removed,
            ..Default::default()
        })
    }
}

/// Removes dead nodes until none is left (a removal can make its producers dead), then
/// unused plain initializers. Returns the number of nodes removed.
pub fn eliminate_dead_code(model: &mut Model) -> usize {
    let mut removed = 0;
    loop {
        let dead: Vec<_> = model.all_nodes().filter(|&n| is_dead(model, n)).collect();
        if dead.is_empty() {
            break;
        }
        for n in dead {
            if model.remove_node(n).is_ok() {
                removed += 1;
            }
        }
    }
    for b in 0..model.bodies.len() {
        let body = crate::ir::BodyId(b as u32);
        let inputs: Vec<_> = model.body(body).inputs.iter().map(|(v, _)| *v).collect();
        let unused: Vec<_> = model
            .body(body)
            .initializers
            .iter()
            .map(|(v, _)| *v)
            .filter(|v| !inputs.contains(v) && model.uses(*v).is_empty())
            .collect();
        model
            .body_mut(body)
            .initializers
            .retain(|(v, _)| !unused.contains(v));
        model
            .body_mut(body)
            .value_info
            .retain(|(v, _)| !unused.contains(v));
    }
    removed
}

/// No output of `node` is read (by a node or as a graph output).
fn is_dead(model: &Model, node: crate::ir::NodeId) -> bool {
    model
        .node(node)
        .outputs
        .iter()
        .flatten()
        .all(|v| model.uses(*v).is_empty())
}
