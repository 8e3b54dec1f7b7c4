#!/usr/bin/env python3
"""Can standard ops put a convolution's weight in ONNX Runtime's blocked (NCHWc, OIHWBiBo)
layout faster than the six-axis Transpose that src/passes/nchwc_conv.rs writes? Three forms
of the same data movement on W [M, C, 3, 3] with blocks of 16, one session each (ONNX
Runtime 1.31.1, CPU), the 10% quantile of a whole run in ms over 300 runs, 1 and 2 threads:

- 6d:  Reshape [M/16, 16, C/16, 16, 3, 3], Transpose [0, 2, 4, 5, 3, 1], Reshape back;
- 5d:  the taps merged, [M/16, 16, C/16, 16, 9], Transpose [0, 2, 4, 3, 1];
- two: a batched 2-D transpose [M/16, 16, C·16·9] -> [M/16, C·16·9, 16], then a swap of
  whole 16-float blocks.

Every form is checked to give the same array as the first. On the Zen 4 machine of
benches/README.md "Run AA" they all took the same time (64x64: 0.20-0.21 ms on one
thread), which is why the weights went onto onnx-ga's `BlockedWeight` kernel instead.

Usage: .venv-ort/bin/python benches/kernels/weight_layout_transpose.py
"""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh


def model(kind: str, m: int, c: int, b: int = 16) -> bytes:
    w = h.make_tensor_value_info("w", TP.FLOAT, [m, c, 3, 3])
    inits, nodes = [], []

    def ints(values, name):
        inits.append(nh.from_array(np.array(values, np.int64), name))

    mo, co = m // b, c // b
    ints([m, c, 3, 3], "back")
    if kind == "6d":
        ints([mo, b, co, b, 3, 3], "split")
        nodes += [
            h.make_node("Reshape", ["w", "split"], ["t"]),
            h.make_node("Transpose", ["t"], ["u"], perm=[0, 2, 4, 5, 3, 1]),
        ]
    elif kind == "5d":
        ints([mo, b, co, b, 9], "split")
        nodes += [
            h.make_node("Reshape", ["w", "split"], ["t"]),
            h.make_node("Transpose", ["t"], ["u"], perm=[0, 2, 4, 3, 1]),
        ]
    else:
        ints([mo, b, co * b * 9], "split")
        ints([mo, co, b, 9, b], "blocks")
        nodes += [
            h.make_node("Reshape", ["w", "split"], ["t"]),
            h.make_node("Transpose", ["t"], ["t2"], perm=[0, 2, 1]),
            h.make_node("Reshape", ["t2", "blocks"], ["t3"]),
            h.make_node("Transpose", ["t3"], ["u"], perm=[0, 1, 3, 2, 4]),
        ]
    nodes.append(h.make_node("Reshape", ["u", "back"], ["y"]))
    graph = h.make_graph(nodes, "g", [w], [h.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=9).SerializeToString()


def main() -> None:
    for threads in (1, 2):
        for m, c in [(64, 64), (64, 32), (32, 32), (16, 16)]:
            w = np.random.rand(m, c, 3, 3).astype(np.float32)
            row, first = [], None
            for kind in ["6d", "5d", "two"]:
                so = ort.SessionOptions()
                so.intra_op_num_threads = threads
                so.inter_op_num_threads = 1
                s = ort.InferenceSession(model(kind, m, c), so, providers=["CPUExecutionProvider"])
                y = s.run(None, {"w": w})[0]
                first = y if first is None else first
                if not np.array_equal(y, first):
                    raise SystemExit(f"{kind} {m}x{c}: not the same layout")
                for _ in range(20):
                    s.run(None, {"w": w})
                times = []
                for _ in range(300):
                    t = time.perf_counter()
                    s.run(None, {"w": w})
                    times.append(time.perf_counter() - t)
                row.append(f"{kind} {np.percentile(times, 10) * 1e3:.3f}")
            print(f"threads {threads}, W {m}x{c}x3x3: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
