#!/usr/bin/env python3
"""A forward MLP (Gemm + Relu layers, float32, He-initialised) and random data, for timings.

    make_mlp.py OUT_DIR WIDTHS SAMPLES     e.g. make_mlp.py /tmp/mlp 784,1024,1024,10 1024

writes OUT_DIR/model.onnx (input `x` [batch, WIDTHS[0]], output `logits`) and
OUT_DIR/data.npz (`x`, and `labels` int64 classes). Needs numpy and onnx only, so it runs
where torch does not (scripts/gpu-check.sh makes the GPU timing's model with it).
"""

import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def main() -> None:
    out, widths, samples = sys.argv[1], [int(w) for w in sys.argv[2].split(",")], int(sys.argv[3])
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i, (fan_in, fan_out) in enumerate(zip(widths, widths[1:])):
        w = (rng.standard_normal((fan_out, fan_in)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"),
                  numpy_helper.from_array(np.zeros(fan_out, np.float32), f"fc{i}.bias")]
        y = "logits" if i == len(widths) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [y + ("" if y == "logits" else ".pre")], transB=1))
        if y != "logits":
            nodes.append(helper.make_node("Relu", [y + ".pre"], [y]))
        x = y
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", widths[0]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", widths[-1]])],
        inits)
    # IR 10: what ONNX Runtime 1.31 loads (onnx 1.2x writes newer by default).
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    os.makedirs(out, exist_ok=True)
    onnx.save(model, os.path.join(out, "model.onnx"))
    np.savez(os.path.join(out, "data.npz"),
             x=rng.standard_normal((samples, widths[0])).astype(np.float32),
             labels=rng.integers(0, widths[-1], samples).astype(np.int64))


if __name__ == "__main__":
    main()
