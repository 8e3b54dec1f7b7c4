#!/usr/bin/env python3
"""Would a window's weight gradient be cheaper made once, at the apply, than accumulated at
every micro-step? The realistic MLP's fc1 (W [1024, 784]) at B 8, K 4, one thread, ONNX
Runtime's own Gemm (MLAS), kernel times from its profiler (median and minimum over 300 runs,
everything in cache):

- 8 rows written:  dW = dYᵀ·X, what the floor does every micro-step;
- 8 rows onto C:   dW = dYᵀ·X + acc (ONNX Runtime copies C into Y first, then MLAS adds);
- 32 rows written: the window's K micro-batches' rows at once, what a deferred gradient
  would make at the apply (the micro-steps would keep X and dY, 58 KiB each, instead).

Usage: .venv-ort/bin/python benches/kernels/deferred_weight_grad.py (benches/README.md, Run Z)
"""

import json
import os
import statistics
import tempfile

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

M, N, B, K = 1024, 784, 8, 4


def gemm(rows: int, with_c: bool) -> bytes:
    inputs = [
        helper.make_tensor_value_info("dy", TensorProto.FLOAT, [rows, M]),
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, N]),
    ]
    if with_c:
        inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [M, N]))
    node = helper.make_node("Gemm", ["dy", "x"] + (["c"] if with_c else []), ["y"], transA=1)
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])
    graph = helper.make_graph([node], "g", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def kernel_us(model: bytes, feeds: dict, runs: int = 300) -> tuple[float, int]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "p")
    session = ort.InferenceSession(model, options)
    for _ in range(runs):
        session.run(None, feeds)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    times = [e["dur"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    return statistics.median(times), min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    dy = rng.standard_normal((K * B, M), dtype=np.float32)
    x = rng.standard_normal((K * B, N), dtype=np.float32)
    acc = np.zeros((M, N), np.float32)
    cases = [
        ("8 rows written", gemm(B, False), {"dy": dy[:B], "x": x[:B]}),
        ("8 rows onto C", gemm(B, True), {"dy": dy[:B], "x": x[:B], "c": acc}),
        (f"{K * B} rows written", gemm(K * B, False), {"dy": dy, "x": x}),
    ]
    print(f"fc1 weight gradient [{M}x{N}], one thread, ONNX Runtime {ort.__version__}: kernel µs, median (min)")
    for what, model, feeds in cases:
        median, least = kernel_us(model, feeds)
        print(f"  {what:16s} {median:7.0f} ({least})")


if __name__ == "__main__":
    main()
