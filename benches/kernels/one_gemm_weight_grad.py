#!/usr/bin/env python3
"""Would a convolution's weight gradient be cheaper as one GEMM over every image's positions
(K = N·Ho·Wo) than as the lowering's per-image products (a batched MatMul, K = Ho·Wo, then a
sum over the images)? ONNX Runtime 1.31.1 (MLAS), the ResNet-8's geometries at B 32, 1 and
2 threads, both from operands already in the layout each wants, so that only the products
are timed (the one GEMM would need X's columns as [C·kh·kw, N·Ho·Wo] and dY as
[M, N·Ho·Wo]; onnx-ga's Im2Col could write the first directly):

- per image: MatMul(cols [N, C·kh·kw, P], Transpose(dY [N, M, P])) -> [N, C·kh·kw, M]
  (the sum over the images, another pass, not included);
- one Gemm:  Gemm(dY' [M, N·P], cols' [C·kh·kw, N·P], transB = 1) -> [M, C·kh·kw].

Median of 30 runs, middle of three blocks alternating. Usage: .venv-ort/bin/python
benches/kernels/one_gemm_weight_grad.py (benches/README.md, "Run AF").
"""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def session(model, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def graph(nodes, inputs, output):
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def per_image(n: int, rows: int, m: int, p: int):
    return graph(
        [
            helper.make_node("Transpose", ["dy"], ["dy_t"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["cols", "dy_t"], ["products"]),
        ],
        [("cols", [n, rows, p]), ("dy", [n, m, p])],
        ("products", [n, rows, m]),
    )


def one_gemm(n: int, rows: int, m: int, p: int):
    return graph(
        [helper.make_node("Gemm", ["dy2", "cols2"], ["dw"], transB=1)],
        [("cols2", [rows, n * p]), ("dy2", [m, n * p])],
        ("dw", [m, rows]),
    )


def median_ms(s: ort.InferenceSession, feeds: dict, runs: int = 30) -> float:
    for _ in range(5):
        s.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        s.run(None, feeds)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    n = 32
    # (C per product, M, plane, kernel, stride): the 3x3s at 32 (per channel half, and
    # whole), 16 and 8 wide, the two downsamplings, the 1x1 shortcut.
    for c, m, hw, k, stride in [
        (8, 16, 32, 3, 1),
        (16, 16, 32, 3, 1),
        (32, 32, 16, 3, 1),
        (64, 64, 8, 3, 1),
        (16, 32, 32, 3, 2),
        (32, 64, 16, 3, 2),
        (16, 32, 32, 1, 2),
    ]:
        ho = (hw + 2 * (k // 2) - k) // stride + 1
        p, rows = ho * ho, c * k * k
        rng = np.random.default_rng(0)
        cols = rng.standard_normal((n, rows, p), dtype=np.float32)
        dy = rng.standard_normal((n, m, p), dtype=np.float32)
        flat = {
            "cols2": np.ascontiguousarray(cols.transpose(1, 0, 2).reshape(rows, n * p)),
            "dy2": np.ascontiguousarray(dy.transpose(1, 0, 2).reshape(m, n * p)),
        }
        for threads in (1, 2):
            a = session(per_image(n, rows, m, p), threads)
            b = session(one_gemm(n, rows, m, p), threads)
            pa, pb = [], []
            for _ in range(3):
                pa.append(median_ms(a, {"cols": cols, "dy": dy}))
                pb.append(median_ms(b, flat))
            ma, mb = sorted(pa)[1], sorted(pb)[1]
            print(
                f"{c} -> {m} channels, {hw} wide, {k}x{k} stride {stride}, B {n}, "
                f"{threads} thread(s): per image {ma:.3f} ms, one Gemm {mb:.3f} ms "
                f"({mb / ma:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
