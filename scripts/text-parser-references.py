#!/usr/bin/env python3
"""Writes the references for onnx_ga::ir::text (the ONNX text parser): for each case below,
tests/data/text/<case>.onnxtxt (the source) and tests/data/text/<case>.onnx (what onnx's own
parser, onnx.parser.parse_model, makes of it). The Rust unit tests parse the .onnxtxt and
compare with the decoded .onnx field for field.

Run once when a case is added or changed, with the onnx of .venv-ort (1.23.2):
    .venv-ort/bin/python scripts/text-parser-references.py
Never run by the tests.
"""

import pathlib

import onnx
import onnx.parser

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "text"

CASES = {
    # Every model header key, two opsets, metadata.
    "header": """\
<
  ir_version: 8,
  opset_import: ["" : 17, "com.microsoft" : 1],
  producer_name: "onnx-ga tests",
  producer_version: "0.1",
  domain: "ai.onnx_ga.test",
  model_version: 3,
  doc_string: "a \\"quoted\\" doc",
  metadata_props: ["author" : "test", "purpose" : "header"]
>
header_graph (float[N,4] X) => (float[N,4] Y) {
  Y = Relu(X)
}
""",
    # Tensor types: scalar, unknown rank, unknown and symbolic dims; the other type kinds;
    # quoted names.
    "types": """\
<ir_version: 8, opset_import: ["" : 17]>
types (float scalar, float[] any_rank, float[?, N, 3] mixed, int64[batch] "quoted name",
       seq(float[2]) sequence, optional(int64[3]) maybe, map(int64, float) table,
       bool[1] flag, double[2,2] d, float16[4] h, bfloat16[4] b)
  => (float[N, 3] out, seq(float[2]) sequence_out) {
  out = Identity(mixed)
  sequence_out = Identity(sequence)
}
""",
    # Initializers of each supported element type, in the input list (also graph inputs) and
    # in the initializer list; a value info without value.
    "initializers": """\
<ir_version: 8, opset_import: ["" : 17]>
initializers (float[2] x, float[2] bias = {0.5, -1.25}) => (float[2] y)
<
  float[2,2] w = {1, 2.5, -3e-2, 4},
  float scale = {2},
  double[2] d = {1.5, -2},
  int64[3] shape = {-1, 0, 9000000000},
  int32[2] i32 = {-7, 7},
  int8[2] i8 = {-128, 127},
  uint8[2] u8 = {0, 255},
  bool[3] mask = {1, 0, 1},
  uint64[1] u64 = {42},
  string[2] names = {"a", "b c"},
  float[2] hidden
>
{
  y = Add(x, bias)
}
""",
    # Attributes of each kind, with and without a declared type, before and after the inputs.
    "attributes": """\
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
attributes (float[2,3] x, int64[2] idx) => (float[2,3] a, float[2,3] b, float[2,3] c) {
  a = LeakyRelu <alpha: float = 0.1> (x)
  b = com.microsoft.Foo <i = 3, f = -2.5e-3, big = 1e10, whole: float = 2, pos = inf, neg = -inf,
                         s = "text", ints = [1, -2, 3], floats = [0.5, 2], strings = ["p", "q"],
                         empty: ints = [], t = float[2] {1, 2}, named = int64[2] kept {4, 5},
                         scalar = float {7.5}> (x, idx)
  c = Softmax (x) <axis = 1>
}
""",
    # An If with both branches; the then-branch reads an outer value.
    "if_subgraph": """\
<ir_version: 8, opset_import: ["" : 17]>
if_subgraph (bool cond, float[2] x) => (float[2] y) {
  y = If (cond) <
    then_branch = then_graph () => (float[2] then_out) {
      then_out = Neg(x)
    },
    else_branch = else_graph () => (float[2] else_out)
      <float[2] k = {1, 2}>
    {
      else_out = Identity(k)
    }
  >
}
""",
    # Omitted optional inputs (a gap and ""), node names, several outputs, an op with no
    # outputs' names given, comments.
    "nodes": """\
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
nodes (float[4,6] x, int64[2] split) => (float[4,3] first, float[4,3] second, float[4,6] clipped) {
  # a comment line
  [split_node] first, second = Split <axis = 1> (x, split)   # a trailing comment
  clipped = Clip (x, , "")
  [gelu] g = com.microsoft.Gelu (x)
  unused_mask, = Dropout (g)
}
""",
}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, source in CASES.items():
        model = onnx.parser.parse_model(source)
        (OUT / f"{name}.onnxtxt").write_text(source)
        (OUT / f"{name}.onnx").write_bytes(model.SerializeToString())
        print(f"{name}: {len(model.graph.node)} nodes")


if __name__ == "__main__":
    main()
