//! ONNX's `Attention` (opset 23: what torch's exporter writes for
//! `scaled_dot_product_attention` from opset 23 on) written out as the ops it is made of, so
//! that the autodiff differentiates it with the rules it has (MatMul, Softmax, Mul, Add,
//! Tanh, Reshape, Transpose, Expand, Where) and no attention backward op is needed.
//!
//! In ONNX's words (its reference implementation and function body), per batch and head,
//! with K and V repeated per head group first (grouped-query attention: KV head `g` serves
//! query heads `g·r .. g·r + r - 1`, r = q_heads / kv_heads):
//!
//! ```text
//! s      = sqrt(scale)                       scale default 1/sqrt(head_size), cast to T
//! S      = (Q·s) (K·s)ᵀ
//! S      = c · tanh(S / c)                   softcap c > 0 only
//! bias   = mask ? 0 : -inf (bool mask)  or  mask (float), plus (is_causal) j <= i ? 0 : -inf
//! P      = softmax(S + bias) over the keys   in `softmax_precision` when given
//! P      = 0 on a row whose bias is -inf everywhere (no key to attend; with a mask only;
//!          its scores are zeroed before the softmax, so no NaN reaches the backward)
//! Y      = P V
//! ```
//!
//! 3-D inputs `[B, S, heads·D]` are viewed as `[B, heads, S, D]` (`q_num_heads`,
//! `kv_num_heads`) and Y goes back to `[B, S, heads·Dv]`. `present_key` and
//! `present_value` are K and V themselves (there is no cache).
//!
//! Not supported, each an error naming the node: `past_key`/`past_value` and
//! `nonpad_kv_seqlen` (a cache: inference, not training), a used `qk_matmul_output`, the
//! sliding window of opset 25 (`left_window_size`/`right_window_size` set), a mask shorter
//! than the keys, head counts that are not known.

use crate::ir::builder::{attr_int, attr_ints, Builder, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

use super::rules::node_error;
use super::shapes::{Dim, Shapes};

pub fn is_attention(op: &str) -> bool {
    op == "Attention"
}

/// A scalar of element type `elem` holding `value` (shared per hint, see `Builder`).
fn scalar(b: &mut Builder<'_>, elem: i32, value: f64, hint: &str) -> ValueId {
    b.constant(hint, crate::ir::emit::scalar_tensor(elem, value))
}

/// The node's dims of `v` as far as the shape facts know them.
fn dims(shapes: &Shapes, v: ValueId) -> Option<Vec<Dim>> {
    shapes.get(v).dims
}

pub fn expand(
    model: &mut Model,
    node: NodeId,
    shapes: &Shapes,
    pass: &'static str,
) -> Result<(), PassError> {
    let err = |model: &Model, m: String| node_error(model, node, m);
    let n = model.node(node).clone();
    let p = &n.proto;
    let int = |name: &str| p.attr_int(name);
    let input = |i: usize| n.inputs.get(i).copied().flatten();
    let output_used = |model: &Model, slot: usize| {
        n.outputs
            .get(slot)
            .copied()
            .flatten()
            .is_some_and(|v| !model.uses(v).is_empty() || model.graph_outputs().contains(&v))
    };
    for (slot, what) in [
        (4, "past_key (a cache: inference, not training)"),
        (5, "past_value (a cache: inference, not training)"),
        (6, "nonpad_kv_seqlen (an external cache)"),
    ] {
        if input(slot).is_some() {
            return Err(err(model, format!("input {what} is not supported")));
        }
    }
    if output_used(model, 3) {
        return Err(err(
            model,
            "output qk_matmul_output is used: not supported".into(),
        ));
    }
    for window in ["left_window_size", "right_window_size"] {
        let w = p.attr_int(window).map_err(|e| err(model, e))?;
        if w.is_some_and(|w| w >= 0) {
            return Err(err(
                model,
                format!("attribute '{window}' (a sliding window) is not supported"),
            ));
        }
    }
    let (Some(q), Some(k), Some(v)) = (input(0), input(1), input(2)) else {
        return Err(err(model, "inputs Q, K and V are required".into()));
    };
    let mask = input(3);
    let elem = shapes
        .get(q)
        .elem
        .ok_or_else(|| err(model, "the element type of Q is not known".into()))?;
    let rank = dims(shapes, q).map(|d| d.len());
    let three_d = match rank {
        Some(3) => true,
        Some(4) => false,
        _ => return Err(err(model, "Q must have a known rank of 3 or 4".into())),
    };
    let attr = |model: &Model, name: &str| int(name).map_err(|e| err(model, e));
    let is_causal = attr(model, "is_causal")?.unwrap_or(0) != 0;
    let softcap = p
        .attr_float("softcap")
        .map_err(|e| err(model, e))?
        .unwrap_or(0.0);
    let softmax_precision = attr(model, "softmax_precision")?.map(|t| t as i32);
    let known =
        |d: &Option<Vec<Dim>>, i: usize| d.as_ref().and_then(|d| d.get(i)).and_then(Dim::known);
    let (q_heads, kv_heads, head_size) = if three_d {
        let (Some(qh), Some(kvh)) = (attr(model, "q_num_heads")?, attr(model, "kv_num_heads")?)
        else {
            return Err(err(
                model,
                "3-D inputs need attributes q_num_heads and kv_num_heads".into(),
            ));
        };
        let hidden = known(&dims(shapes, q), 2);
        (qh, kvh, hidden.filter(|_| qh > 0).map(|h| h / qh))
    } else {
        let (qh, kvh) = (known(&dims(shapes, q), 1), known(&dims(shapes, k), 1));
        let (Some(qh), Some(kvh)) = (qh, kvh) else {
            return Err(err(
                model,
                "the head counts (axis 1 of Q and K) are not known".into(),
            ));
        };
        (qh, kvh, known(&dims(shapes, q), 3))
    };
    if q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads != 0 {
        return Err(err(
            model,
            format!("{q_heads} query heads cannot share {kv_heads} key/value heads"),
        ));
    }
    // In float32, then cast to T, as ONNX's function body computes it (the attribute is a
    // float32, and so is the default's arithmetic).
    let scale: f32 = match p.attr_float("scale").map_err(|e| err(model, e))? {
        Some(s) => s,
        None => {
            let d = head_size.filter(|d| *d > 0).ok_or_else(|| {
                err(
                    model,
                    "the head size is not known (needed for the default scale)".into(),
                )
            })?;
            1.0 / (d as f32).sqrt()
        }
    };
    if let (Some(m), Some(kd)) = (mask, dims(shapes, k)) {
        let keys = kd.get(if three_d { 1 } else { 2 }).and_then(Dim::known);
        let mask_keys = dims(shapes, m).and_then(|d| d.last().and_then(Dim::known));
        if let (Some(keys), Some(mask_keys)) = (keys, mask_keys) {
            if mask_keys < keys {
                return Err(err(
                    model,
                    format!("attn_mask covers {mask_keys} of {keys} keys (a padded mask): not supported"),
                ));
            }
        }
    }
    let mask_elem = mask.and_then(|m| shapes.get(m).elem);
    if mask.is_some() && mask_elem.is_none() {
        return Err(err(
            model,
            "the element type of attn_mask is not known".into(),
        ));
    }

    let y_name = n
        .outputs
        .first()
        .copied()
        .flatten()
        .map(|y| model.name(y).to_string())
        .unwrap_or_else(|| "attention".into());
    let h = y_name.as_str();
    let mut b = Builder::new(model, BodyId::MAIN, pass);
    // [B, S, heads·D] viewed as [B, heads, S, D].
    let heads_first = |b: &mut Builder<'_>, x: ValueId, heads: i64| {
        if !three_d {
            return x;
        }
        let shape = b.ints("attention_split_heads", &[0, 0, heads, -1]);
        let split = b.op("Reshape", &[x, shape], vec![], h);
        b.op(
            "Transpose",
            &[split],
            vec![attr_ints("perm", &[0, 2, 1, 3])],
            h,
        )
    };
    let q4 = heads_first(&mut b, q, q_heads);
    let k4 = heads_first(&mut b, k, kv_heads);
    let v4 = heads_first(&mut b, v, kv_heads);
    // Each KV head repeated for its group of query heads: [B, kv, S, D] -> [B, kv, r, S, D]
    // -> [B, kv·r, S, D].
    let repeat = |b: &mut Builder<'_>, x: ValueId| {
        let groups = q_heads / kv_heads;
        if groups == 1 {
            return x;
        }
        let wide = b.unsqueeze(x, &[2], h);
        let shape = b.op("Shape", &[x], vec![], h);
        let (lead, tail) = (
            b.ints("attention_lead", &[0]),
            b.ints("attention_two", &[2]),
        );
        let batch_heads = b.op("Slice", &[shape, lead, tail], vec![], h);
        let end = b.ints("attention_end", &[4]);
        let seq_dim = b.op("Slice", &[shape, tail, end], vec![], h);
        let reps = b.ints("attention_groups", &[groups]);
        let expanded_shape = b.op(
            "Concat",
            &[batch_heads, reps, seq_dim],
            vec![attr_int("axis", 0)],
            h,
        );
        let expanded = b.op("Expand", &[wide, expanded_shape], vec![], h);
        let heads = b.ints("attention_heads", &[0, q_heads]);
        let merged_shape = b.op("Concat", &[heads, seq_dim], vec![attr_int("axis", 0)], h);
        b.op("Reshape", &[expanded, merged_shape], vec![], h)
    };
    let k_rep = repeat(&mut b, k4);
    let v_rep = repeat(&mut b, v4);
    let s = scalar(&mut b, elem, scale.sqrt() as f64, "attention_sqrt_scale");
    let qs = b.mul(q4, s, h);
    let ks = b.mul(k_rep, s, h);
    let kt = b.op(
        "Transpose",
        &[ks],
        vec![attr_ints("perm", &[0, 1, 3, 2])],
        h,
    );
    let mut scores = b.op("MatMul", &[qs, kt], vec![], h);
    if softcap > 0.0 {
        let c = scalar(&mut b, elem, softcap as f64, "attention_softcap");
        let scaled = b.div(scores, c, h);
        let squashed = b.op("Tanh", &[scaled], vec![], h);
        scores = b.mul(squashed, c, h);
    }
    // The additive bias: the mask (a boolean one as 0 / -inf) and the causal frontier.
    let zero = scalar(&mut b, elem, 0.0, "attention_zero");
    let minus_inf = scalar(&mut b, elem, f64::NEG_INFINITY, "attention_minus_inf");
    let causal = is_causal.then(|| {
        let position = |b: &mut Builder<'_>, x: ValueId| {
            let shape = b.op("Shape", &[x], vec![], h);
            let axis = b.scalar_i64("attention_seq_axis", 2);
            let length = b.op("Gather", &[shape, axis], vec![attr_int("axis", 0)], h);
            let (start, step) = (
                b.scalar_i64("attention_zero_i64", 0),
                b.scalar_i64("attention_one_i64", 1),
            );
            b.op("Range", &[start, length, step], vec![], h)
        };
        let queries = position(&mut b, q4);
        let keys = position(&mut b, k4);
        let column = b.unsqueeze(queries, &[1], h);
        let after = b.greater(keys, column, h);
        b.not(after, h)
    });
    let bias = match (mask, mask_elem, causal) {
        (None, _, None) => None,
        (None, _, Some(allowed)) => Some(b.select(allowed, zero, minus_inf, h)),
        (Some(m), Some(t), allowed) if t == DataType::Bool as i32 => {
            let allowed = match allowed {
                Some(c) => b.and(m, c, h),
                None => m,
            };
            Some(b.select(allowed, zero, minus_inf, h))
        }
        (Some(m), _, allowed) => Some(match allowed {
            Some(c) => {
                let frontier = b.select(c, zero, minus_inf, h);
                b.add(m, frontier, h)
            }
            None => m,
        }),
    };
    if let Some(bias) = bias {
        scores = b.add(scores, bias, h);
    }
    // A row no key may be attended from is zero, not NaN (only a mask can empty a row: the
    // causal frontier alone always keeps key 0). Its scores are replaced before the
    // softmax too, so that no NaN reaches the backward (NaN · 0 is NaN).
    let empty = match (bias, mask) {
        (Some(bias), Some(_)) => {
            let most = b.reduce("ReduceMax", bias, &[-1], true, h);
            let empty = b.op("IsInf", &[most], vec![attr_int("detect_positive", 0)], h);
            scores = b.select(empty, zero, scores, h);
            Some(empty)
        }
        _ => None,
    };
    let work = softmax_precision.filter(|t| *t != elem);
    if let Some(t) = work {
        scores = b.cast_to(scores, t, h);
    }
    let mut probabilities = b.op("Softmax", &[scores], vec![attr_int("axis", -1)], h);
    if work.is_some() {
        probabilities = b.cast_to(probabilities, elem, h);
    }
    if let Some(empty) = empty {
        probabilities = b.select(empty, zero, probabilities, h);
    }
    let mut y = b.op("MatMul", &[probabilities, v_rep], vec![], h);
    if three_d {
        let back = b.op("Transpose", &[y], vec![attr_ints("perm", &[0, 2, 1, 3])], h);
        let shape = b.ints("attention_merge_heads", &[0, 0, -1]);
        y = b.op("Reshape", &[back, shape], vec![], h);
    }
    // Y, and the "present" key and value, which are K and V themselves without a cache.
    let replacements = [y, k4, v4];
    for (slot, new) in replacements.into_iter().enumerate() {
        if output_used(model, slot) {
            if let Some(old) = n.outputs[slot] {
                model.replace_value(old, new);
            }
        }
    }
    model
        .remove_node(node)
        .map_err(|e| node_error(model, node, format!("could not replace the node: {e}")))
}
