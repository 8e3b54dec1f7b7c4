//! Transposes that keep the last axis last on onnx-ga's `RowTranspose` kernel
//! (src/passes/fused_transpose.rs, applied by every CPU session with
//! `SessionOptions::fused_transpose`): the result is ONNX Runtime's own `Transpose`'s bit for
//! bit on one thread and two, for a transformer's head split and merge and other
//! permutations, a symbolic batch included; what the pass must leave alone is left alone;
//! a small attention model trains bit-identically with the kernel and without. Every case
//! checks how many transposes were rewritten, so that none can pass by running `Transpose`.

use crate::common::{ort_available, pattern_tensor as tensor, Side};
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

/// `y = Transpose <perm> (x)`, x declared `x_type`.
fn transpose_graph(x_type: &str, perm: &[usize]) -> ModelProto {
    let perm = perm
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let elem = &x_type[..x_type.find('[').unwrap_or(x_type.len())];
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
t ({x_type} x) => ({elem} y)
{{
  y = Transpose <perm = [{perm}]> (x)
}}
"#
    );
    onnx_ga::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{e}"))
}

fn options(fused: bool, threads: usize) -> SessionOptions {
    SessionOptions {
        fused_transpose: fused,
        threads,
        ..SessionOptions::default()
    }
}

#[test]
fn row_transposes_give_transposes_bits() {
    if !ort_available() {
        return;
    }
    // (x's declared type, x's dims, perm, rewritten)
    type Case = (&'static str, [usize; 4], [usize; 4], usize);
    let cases: [Case; 8] = [
        // The GPT's head split and merge.
        ("float[4,64,4,64]", [4, 64, 4, 64], [0, 2, 1, 3], 1),
        ("float[4,4,64,64]", [4, 4, 64, 64], [0, 2, 1, 3], 1),
        // A symbolic batch, another permutation, rows of 16.
        ("float[N,5,3,16]", [3, 5, 3, 16], [2, 0, 1, 3], 1),
        ("float[2,3,70,17]", [2, 3, 70, 17], [1, 2, 0, 3], 1),
        // Rows of a size not known when the session is made (a head size computed at run
        // time), of 64 and of 3.
        ("float[N,T,H,D]", [2, 6, 4, 64], [0, 2, 1, 3], 1),
        ("float[N,T,H,D]", [2, 6, 4, 3], [0, 2, 1, 3], 1),
        // Left alone: rows shorter than 16, the last axis moved.
        ("float[2,3,4,8]", [2, 3, 4, 8], [0, 2, 1, 3], 0),
        ("float[2,3,4,32]", [2, 3, 4, 32], [0, 1, 3, 2], 0),
    ];
    for (x_type, dims, perm, rewritten) in cases {
        let graph = transpose_graph(x_type, &perm);
        let x = tensor(&dims, 3);
        let mut outputs = Vec::new();
        for (fused, threads) in [(false, 1), (true, 1), (true, 2)] {
            let mut s = OrtSession::new(&graph, &options(fused, threads)).unwrap();
            let expected = if fused { rewritten } else { 0 };
            assert_eq!(s.fused_transposes(), expected, "{x_type} by {perm:?}");
            let y = s.run(&[("x", &x)]).unwrap().into_iter().next().unwrap().1;
            outputs.push(y);
        }
        let want: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        assert_eq!(outputs[0].as_f32().unwrap().shape(), want.as_slice());
        assert_eq!(outputs[1], outputs[0], "{x_type} by {perm:?}, one thread");
        assert_eq!(outputs[2], outputs[0], "{x_type} by {perm:?}, two threads");
    }
}

#[test]
fn transposes_it_does_not_take_are_left_as_written() {
    if !ort_available() {
        return;
    }
    // int64 rows; a 2-D transpose; the identity.
    let graphs = [
        transpose_graph("int64[2,3,4,32]", &[0, 2, 1, 3]),
        transpose_graph("float[32,64]", &[1, 0]),
        transpose_graph("float[2,3,4,32]", &[0, 1, 2, 3]),
    ];
    for graph in &graphs {
        let s = OrtSession::new(graph, &options(true, 1)).unwrap();
        assert_eq!(s.fused_transposes(), 0);
    }
}

/// One head-split attention layer (2 heads of 16 over 4 tokens) and a linear classifier:
/// the step for `middle`.
fn attention_step(middle: &str) -> ModelProto {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
attention (float[N,4,32] x, int64[N] labels) => (float loss)
{
  heads = Constant <value = int64[4] {0, 4, 2, 16}> ()
  merged = Constant <value = int64[3] {0, 4, 32}> ()
  q0 = MatMul (x, wq)
  k0 = MatMul (x, wk)
  v0 = MatMul (x, wv)
  q1 = Reshape (q0, heads)
  k1 = Reshape (k0, heads)
  v1 = Reshape (v0, heads)
  q = Transpose <perm = [0, 2, 1, 3]> (q1)
  k = Transpose <perm = [0, 2, 3, 1]> (k1)
  v = Transpose <perm = [0, 2, 1, 3]> (v1)
  s = MatMul (q, k)
  p = Softmax <axis = -1> (s)
  o = MatMul (p, v)
  o1 = Transpose <perm = [0, 2, 1, 3]> (o)
  o2 = Reshape (o1, merged)
  pooled = ReduceMean <axes = [1], keepdims = 0> (o2)
  logits = MatMul (pooled, w3)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}
"#;
    let mut model = onnx_ga::ir::text::parse_model(text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    crate::common::push_parameters(
        graph,
        &[
            ("wq", &[32, 32], 41, 0.4),
            ("wk", &[32, 32], 42, 0.4),
            ("wv", &[32, 32], 43, 0.4),
            ("w3", &[32, 8], 44, 0.3),
        ],
    );
    crate::common::ort_step(model, "attention.onnx", middle)
}

/// The attention model trained 8 windows on two threads with its row transposes on the
/// kernel and on `Transpose`, for each optimizer with what surrounds it: the same losses
/// and states, bit for bit.
#[test]
fn an_attention_model_trains_bit_identically_with_its_transposes_on_the_kernel() {
    if !ort_available() {
        return;
    }
    let side = |fused: bool| Side {
        session: options(fused, 2),
        perturbed: false,
    };
    let (fused, plain) = (side(true), side(false));
    let data = crate::common::labelled_data(&[16, 4, 32], 5, 8);
    crate::common::trains_bit_identically(
        attention_step,
        (&data, 16),
        [&fused, &plain],
        |t| t.fused_transposes(),
        PER_TRAINER,
    );
}

/// Row transposes in the attention model's three differentiating sessions, six in each:
/// the forward's three that keep the last axis (q's, v's, the merge; k's moves it) and
/// their adjoints in the backward.
const PER_TRAINER: usize = 18;
