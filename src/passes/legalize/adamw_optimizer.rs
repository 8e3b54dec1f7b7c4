//! `com.microsoft::AdamWOptimizer(lr, step, params, grads, m, v [, update]) ->
//! (updated_flag [, params', m', v'])`: one AdamW step over sequences of tensors, updating
//! them in place. Measured and read from ONNX Runtime's kernel (`adamw.cc`), with
//! `α = alpha` (β1), `β = beta` (β2) and `t = step` as given:
//!
//! ```text
//! m ← α m + (1-α) g            v ← β v + (1-β) g²
//! correct_bias: a = 1 - α^t, c = 1 - β^t        (else a = c = 1)
//! adam_mode 1 (Hugging Face): p ← p - (lr·√c/a) · m / (√v + ε);  then p ← p - lr·wd · p
//! adam_mode 0 (PyTorch):      p ← p - lr·wd · p;  then p ← p - lr · m / (a · (√(v/c) + ε))
//! ```
//!
//! (ONNX Runtime rejects `adam_mode 0` with `correct_bias 0`; so does this lowering.) The
//! scalars `a`, `c` and `lr·√c/a` are computed once per step, not per parameter.
//!
//! The sequences are expanded per parameter: each must be built by a `SequenceConstruct`
//! in this graph. ONNX Runtime's `optimizer_model.onnx` takes them as sequence graph
//! inputs, whose elements that graph cannot name; the optimizer pass lowers that case with
//! [`lower_adamw_for_params`], given the per-parameter tensors of the training graph.
//!
//! The in-place updates become values: where a parameter or moment is a graph input, its
//! next value is a graph output `<input>.next`, recorded as state (`param` / `moment`).
//! With the optional `update` flag false, nothing changes: every next value is a
//! `Where(update, new, old)`.

use super::{node_error, Lowering};
use crate::ir::builder::{tensor_bool, tensor_i64, Builder};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, NodeId, Use, ValueDef, ValueId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;
use crate::state::{Role, StateEntry};

/// The hyperparameters: ORT's attributes and defaults are declared in [`crate::adamw`].
pub use crate::adamw::AdamW;

/// One parameter's tensors going into an AdamW step.
#[derive(Clone, Copy, Debug)]
pub struct AdamWSlots {
    pub param: ValueId,
    pub grad: ValueId,
    pub m: ValueId,
    pub v: ValueId,
}

/// One parameter's tensors after the step.
#[derive(Clone, Copy, Debug)]
pub struct AdamWNext {
    pub param: ValueId,
    pub m: ValueId,
    pub v: ValueId,
}

/// Emits one AdamW step for `params` into `b`'s body: `lr` (float, `[]` or `[1]`) and `step`
/// (int64, `[]` or `[1]`, `t` of the bias correction) as ONNX Runtime's AdamWOptimizer reads
/// them; with `update`, a bool that when false leaves every tensor as it was. The next
/// values are named `<name>.next` after the tensors they replace. Errors name an attribute
/// value outside what is implemented (see [`AdamW::unsupported`]).
pub fn lower_adamw_for_params(
    b: &mut Builder<'_>,
    adamw: &AdamW,
    lr: ValueId,
    step: ValueId,
    update: Option<ValueId>,
    params: &[AdamWSlots],
) -> Result<Vec<AdamWNext>, (&'static str, String)> {
    if let Some(unsupported) = adamw.unsupported() {
        return Err(unsupported);
    }
    let mut rank0 = None;
    let lr = scalar_of(b, &mut rank0, lr, "lr");
    let update = update.map(|u| scalar_of(b, &mut rank0, u, "update"));
    let alpha = b.scalar_f32("alpha", adamw.beta1);
    let complement = |beta: f32| match adamw.decimal_complements {
        // The shortest decimal that rounds to `beta` is the one the user wrote.
        true => (1.0 - beta.to_string().parse::<f64>().unwrap_or(beta as f64)) as f32,
        false => 1.0 - beta,
    };
    let one_minus_alpha = b.scalar_f32("one_minus_alpha", complement(adamw.beta1));
    let beta = b.scalar_f32("beta", adamw.beta2);
    let one_minus_beta = b.scalar_f32("one_minus_beta", complement(adamw.beta2));
    let epsilon = b.scalar_f32("epsilon", adamw.epsilon);

    // Bias corrections a = 1 - α^t, c = 1 - β^t (float, as the kernel rounds them).
    let corrections = adamw.correct_bias.then(|| {
        let step = scalar_of(b, &mut rank0, step, "step");
        let t = b.cast_to(step, DataType::Float as i32, "t");
        let one = b.scalar_f32("one", 1.0);
        let alpha_t = b.pow(alpha, t, "alpha_t");
        let beta_t = b.pow(beta, t, "beta_t");
        let a = b.sub(one, alpha_t, "alpha_correction");
        let c = b.sub(one, beta_t, "beta_correction");
        (a, c)
    });
    // Mode 1 folds the corrections into the learning rate: lr·√c/a.
    let lr_corrected = match corrections {
        Some((a, c)) if adamw.adam_mode == 1 => {
            let root = b.sqrt(c, "beta_correction_sqrt");
            let ratio = b.div(root, a, "correction");
            b.mul(lr, ratio, "lr_corrected")
        }
        _ => lr,
    };
    let lr_wd = (adamw.weight_decay != 0.0).then(|| {
        let wd = b.scalar_f32("weight_decay", adamw.weight_decay);
        b.mul(lr, wd, "lr_weight_decay")
    });

    let mut next = Vec::with_capacity(params.len());
    for s in params {
        // Intermediate values are named `<tensor>.update`, the next value `<tensor>.next`
        // (`.staged` before the `Where` of an update flag).
        let [p_name, m_name, v_name] = [s.param, s.m, s.v].map(|v| b.model.name(v).to_string());
        let [p_tmp, m_tmp, v_tmp] = [&p_name, &m_name, &v_name].map(|n| format!("{n}.update"));
        let [p_next, m_next, v_next] = [&p_name, &m_name, &v_name].map(|n| format!("{n}.next"));
        let last = |hint: &str| {
            if update.is_some() {
                format!("{hint}.staged")
            } else {
                hint.to_string()
            }
        };
        let g = s.grad;

        // m ← α m + (1-α) g;  v ← β v + (1-β) g · g
        let m_old = b.mul(s.m, alpha, &m_tmp);
        let m_new = b.mul(g, one_minus_alpha, &m_tmp);
        let m = b.add(m_old, m_new, &last(&m_next));
        let v_old = b.mul(s.v, beta, &v_tmp);
        let v_new = b.mul(g, one_minus_beta, &v_tmp);
        let v_new = b.mul(v_new, g, &v_tmp);
        let v = b.add(v_old, v_new, &last(&v_next));

        let p = if adamw.adam_mode == 1 {
            // p ← p - (lr·√c/a) · m / (√v + ε);  then p ← p - lr·wd · p
            let root = b.sqrt(v, &p_tmp);
            let denom = b.add(root, epsilon, &p_tmp);
            let num = b.mul(m, lr_corrected, &p_tmp);
            let delta = b.div(num, denom, &p_tmp);
            match lr_wd {
                Some(k) => {
                    let stepped = b.sub(s.param, delta, &p_tmp);
                    let decay = b.mul(stepped, k, &p_tmp);
                    b.sub(stepped, decay, &last(&p_next))
                }
                None => b.sub(s.param, delta, &last(&p_next)),
            }
        } else {
            // p ← p - lr·wd · p;  then p ← p - lr · m / (a · (√(v/c) + ε))
            let decayed = match lr_wd {
                Some(k) => {
                    let decay = b.mul(s.param, k, &p_tmp);
                    b.sub(s.param, decay, &p_tmp)
                }
                None => s.param,
            };
            let scaled_v = match corrections {
                Some((_, c)) => b.div(v, c, &p_tmp),
                None => v,
            };
            let root = b.sqrt(scaled_v, &p_tmp);
            let mut denom = b.add(root, epsilon, &p_tmp);
            if let Some((a, _)) = corrections {
                denom = b.mul(denom, a, &p_tmp);
            }
            let num = b.mul(m, lr, &p_tmp);
            let delta = b.div(num, denom, &p_tmp);
            b.sub(decayed, delta, &last(&p_next))
        };
        next.push(match update {
            None => AdamWNext { param: p, m, v },
            Some(u) => AdamWNext {
                param: b.select(u, p, s.param, &p_next),
                m: b.select(u, m, s.m, &m_next),
                v: b.select(u, v, s.v, &v_next),
            },
        });
    }
    Ok(next)
}

/// `v` as a rank-0 tensor (ORT's optimizers take `[1]`; a rank-0 operand never changes the
/// shape of the tensors it broadcasts against). `shape` caches the empty shape constant.
pub(super) fn scalar_of(
    b: &mut Builder<'_>,
    shape: &mut Option<ValueId>,
    v: ValueId,
    hint: &str,
) -> ValueId {
    if super::util::dims(b.model, v).is_some_and(|d| d.is_empty()) {
        return v;
    }
    let body = b.body;
    let shape = *shape.get_or_insert_with(|| {
        b.model
            .add_initializer(body, "rank0", tensor_i64(&[0], &[]))
    });
    b.op("Reshape", &[v, shape], vec![], hint)
}

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let lr = l.input(node, 0)?;
    let step = l.input(node, 1)?;
    let update = l.optional_input(node, 6);
    let adamw = AdamW::from_ort_attributes(
        |name| l.float_attr_given(node, name),
        |name| l.int_attr_given(node, name),
        |correct_bias| match correct_bias {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(l.unsupported(node, "correct_bias", format!("{other}"))),
        },
    )?;
    if let Some((attribute, detail)) = adamw.unsupported() {
        return Err(l.unsupported(node, attribute, detail));
    }
    let [params, grads, ms, vs] = [2, 3, 4, 5].map(|slot| sequence_elements(l, node, slot));
    let (params, grads, ms, vs) = (params?, grads?, ms?, vs?);
    same_lengths(l, node, &[&params, &grads, &ms, &vs])?;
    let slots: Vec<AdamWSlots> = (0..params.len())
        .map(|i| AdamWSlots {
            param: params[i],
            grad: grads[i],
            m: ms[i],
            v: vs[i],
        })
        .collect();
    let next = lower_adamw_for_params(&mut l.b, &adamw, lr, step, update, &slots)
        .map_err(|(attribute, detail)| l.unsupported(node, attribute, detail))?;

    updated_flag(l, node, step, update);
    let next_params: Vec<ValueId> = next.iter().map(|n| n.param).collect();
    let next_ms: Vec<ValueId> = next.iter().map(|n| n.m).collect();
    let next_vs: Vec<ValueId> = next.iter().map(|n| n.v).collect();
    for (slot, values) in [(1, &next_params), (2, &next_ms), (3, &next_vs)] {
        updated_sequence(l, node, slot, values);
    }
    for (s, n) in slots.iter().zip(&next) {
        let param = l.model().name(s.param).to_string();
        expose_state(l, node, s.param, n.param, Role::Param, None);
        expose_state(l, node, s.m, n.m, Role::Moment, Some(&param));
        expose_state(l, node, s.v, n.v, Role::Moment, Some(&param));
    }
    Ok(())
}

/// The tensors of sequence input `slot`: the inputs of the `SequenceConstruct` building it.
pub(super) fn sequence_elements(
    l: &Lowering<'_, '_>,
    node: NodeId,
    slot: usize,
) -> Result<Vec<ValueId>, PassError> {
    let seq = l.input(node, slot)?;
    let model = l.model();
    let name = model.name(seq);
    let Some((producer, _)) = model.producer(seq) else {
        let what = match model.value(seq).def {
            ValueDef::Input { .. } => "a graph input",
            _ => "not produced by a node",
        };
        return Err(node_error(
            model,
            node,
            format!(
                "sequence input {slot} ('{name}') is {what}: its tensors cannot be named in this graph. \
                 Build it with SequenceConstruct, or lower the update with \
                 passes::legalize::lower_adamw_for_params / lower_sgd_for_params given the per-parameter \
                 tensors (the optimizer pass does so for ONNX Runtime's optimizer_model.onnx)"
            ),
        ));
    };
    let p = &model.node(producer).proto;
    if p.op_type() != "SequenceConstruct" || !crate::ir::normalize_domain(p.domain()).is_empty() {
        return Err(node_error(
            model,
            node,
            format!(
                "sequence input {slot} ('{name}') comes from {} '{}', not from SequenceConstruct",
                p.op_type(),
                p.name()
            ),
        ));
    }
    Ok(model
        .node(producer)
        .inputs
        .iter()
        .flatten()
        .copied()
        .collect())
}

pub(super) fn same_lengths(
    l: &Lowering<'_, '_>,
    node: NodeId,
    sequences: &[&Vec<ValueId>],
) -> Result<(), PassError> {
    let lengths: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
    if lengths.iter().any(|n| *n != lengths[0]) || lengths[0] == 0 {
        return Err(node_error(
            l.model(),
            node,
            format!("its sequences hold {lengths:?} tensors; they must match and not be empty"),
        ));
    }
    Ok(())
}

/// Output 0, the "updated" flag: the update signal when given, else true (shaped like
/// `like`, as the kernel shapes it).
pub(super) fn updated_flag(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    like: ValueId,
    update: Option<ValueId>,
) {
    if l.used_output(node, 0).is_none() {
        return;
    }
    let flag = match update {
        Some(u) => l.op("Identity", &[u], vec![], "updated_flag"),
        None => {
            let dims: Vec<i64> = match super::util::dims(l.model(), like) {
                Some(d) if d.is_empty() => vec![],
                _ => vec![1],
            };
            let t = tensor_bool(&dims, &[true]);
            let body = l.b.body;
            l.b.model.add_initializer(body, "updated_flag", t)
        }
    };
    l.replace(node, 0, flag);
}

/// A used sequence output `slot` becomes a SequenceConstruct of the next values.
pub(super) fn updated_sequence(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    slot: usize,
    values: &[ValueId],
) {
    if l.used_output(node, slot).is_some() {
        let seq = l.op("SequenceConstruct", values, vec![], "updated");
        l.replace(node, slot, seq);
    }
}

/// Where `input` is a main-graph input (state the kernel updated in place), makes `next`
/// the graph output `<input>.next` and records the pair.
pub(super) fn expose_state(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    input: ValueId,
    next: ValueId,
    role: Role,
    param: Option<&str>,
) {
    let m = &mut *l.b.model;
    if m.value(input).def != (ValueDef::Input { body: BodyId::MAIN })
        || m.node(node).body != BodyId::MAIN
    {
        return;
    }
    if !m.uses(next).iter().any(|u| {
        matches!(
            u,
            Use::Output {
                body: BodyId::MAIN,
                ..
            }
        )
    }) {
        let ty = m.value_type(input);
        m.add_output(BodyId::MAIN, next, ty);
    }
    l.state.push(StateEntry {
        input: m.name(input).to_string(),
        output: m.name(next).to_string(),
        role,
        param: param.map(str::to_string),
    });
}
