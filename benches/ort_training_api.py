#!/usr/bin/env python3
"""The ORT-API column of benches/step.rs: ONNX Runtime's own training loop.

Per window of K micro-steps: K x module.train_step (Module.__call__ in train mode), then
optimizer.step() and module.lazy_reset_grad(): the loop a user of onnxruntime-training
writes for gradient accumulation. Runs on the original artifacts (graphs/<model>/:
training_model.onnx with ORT's fused training kernels, optimizer_model.onnx, checkpoint),
with onnxruntime-training-cpu 1.19.2 from .venv-gen (see graphs/gen_common.py for the
torch-free import). Learning rate 0.01, as the Rust columns.

Writes one JSON line per (model, micro-batch, threads) in the same format as the Rust
rounds (column "ort_api"): us_per_step is the median over windows of (window time / K),
us_nonapply the median of one train_step, us_apply the median of the K-th micro-step
(train_step + optimizer.step + lazy_reset_grad), us_mean the mean over windows.

Usage: .venv-gen/bin/python benches/ort_training_api.py --round N --out FILE
       [--models a,b] [--batches 8,32] [--threads 1,2] [--k 4] [--cell-ms 120] [--warm-ms 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(ROOT, "graphs"))
import gen_common  # noqa: E402,F401  (registers onnxruntime.training without torch)
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnxruntime.training.api import CheckpointState, Module, Optimizer  # noqa: E402

ort.set_default_logger_severity(3)
LR = 0.01


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def session_options(threads: int) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return so


def micro_batches(data: dict, names: list[str], batch: int) -> list[list[np.ndarray]]:
    """Micro-step i takes samples [i*B, (i+1)*B) modulo the data size, like
    onnx_ga::train::micro_batch; the distinct ones, contiguous, made up front."""
    n = next(iter(data.values())).shape[0]
    distinct = n // np.gcd(n, batch)
    out = []
    for i in range(distinct):
        idx = np.arange(i * batch, (i + 1) * batch) % n
        out.append([np.ascontiguousarray(data[k][idx]) for k in names])
    return out


def cell(model: str, batch: int, threads: int, k: int, warm_s: float, cell_s: float) -> dict:
    d = os.path.join(ROOT, "graphs", model)
    state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
    module = Module(os.path.join(d, "training_model.onnx"), state, None, session_options=session_options(threads))
    optimizer = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    module.train()
    with np.load(os.path.join(d, "data.npz")) as z:
        data = {name: z[name] for name in z.files}
    batches = micro_batches(data, module.input_names(), batch)
    nb = len(batches)
    clock = time.perf_counter_ns

    i = 0
    t0 = clock()
    while (clock() - t0) < warm_s * 1e9 or i < 2 * k:
        for _ in range(k):
            module(*batches[i % nb])
            i += 1
        optimizer.step()
        module.lazy_reset_grad()

    per_step, nonapply, apply = [], [], []
    t0 = clock()
    while (clock() - t0) < cell_s * 1e9 or len(per_step) < 5:
        window = 0
        for j in range(k):
            s = clock()
            module(*batches[i % nb])
            if j == k - 1:
                optimizer.step()
                module.lazy_reset_grad()
            dt = clock() - s
            window += dt
            (apply if j == k - 1 else nonapply).append(dt / 1e3)
            i += 1
        per_step.append(window / k / 1e3)
    return {
        "us_per_step": statistics.median(per_step),
        "us_nonapply": statistics.median(nonapply) if nonapply else None,
        "us_apply": statistics.median(apply),
        "us_mean": statistics.fmean(per_step),
        "windows": len(per_step),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", type=csv(str), default=["mlp_ce_adamw", "cnn_bn", "transformer_block"])
    ap.add_argument("--batches", type=csv(int), default=[8, 32])
    ap.add_argument("--threads", type=csv(int), default=[1, 2])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--cell-ms", type=float, default=120)
    ap.add_argument("--warm-ms", type=float, default=15)
    a = ap.parse_args()
    t = time.perf_counter()
    lines = []
    for model in a.models:
        for batch in a.batches:
            for threads in a.threads:
                r = cell(model, batch, threads, a.k, a.warm_ms / 1e3, a.cell_ms / 1e3)
                lines.append(json.dumps({"round": a.round, "model": model, "batch": batch, "threads": threads, "column": "ort_api", **r}))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    print(f"ort_training_api: round {a.round}: {len(lines)} cells in {time.perf_counter() - t:.1f} s "
          f"(onnxruntime {ort.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
