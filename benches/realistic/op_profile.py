#!/usr/bin/env python3
"""Where a window's time goes, op by op: ONNX Runtime's own profiler (1.31.1, the version the
Rust columns use; run with .venv-ort/bin/python) on the realistic bench's floor and step
(the step run whole, its `If` included, state fed back through the manifest as the Trainer
does), one thread, micro-batch B, W windows of K after one warm-up window.

Prints, per graph, kernel time per window by op type (top N) and the total, and for the step
the time inside the apply `If`'s then-branch (the optimizer) vs everything else.

Usage: .venv-ort/bin/python benches/realistic/op_profile.py WORK_DIR [--models DIR] [--only mlp,gpt]
       [--windows 3] [--top 10]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = {"mlp": 8, "resnet_bn": 8, "resnet": 8, "gpt": 4}
K = 4


def batches(models_dir: str, model: str, b: int) -> list[dict]:
    with np.load(os.path.join(models_dir, model, "data.npz")) as z:
        data = {k: z[k] for k in z.files}
    n = next(iter(data.values())).shape[0]
    out = []
    for i in range(n // int(np.gcd(n, b))):
        idx = np.arange(i * b, (i + 1) * b) % n
        out.append({k: np.ascontiguousarray(v[idx]) for k, v in data.items()})
    return out


def session(path: str, prof_dir: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(prof_dir, os.path.basename(path))
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def kernel_times(profile: str, skip_runs: int) -> tuple[collections.Counter, collections.Counter, int]:
    """(op type -> us, node name -> us, runs) over the runs after the first skip_runs."""
    with open(profile) as f:
        events = json.load(f)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    runs.sort(key=lambda e: e["ts"])
    if len(runs) <= skip_runs:
        raise SystemExit(f"{profile}: only {len(runs)} runs")
    t0 = runs[skip_runs]["ts"]
    by_op, by_node = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < t0:
            continue
        op = e.get("args", {}).get("op_name", "?")
        by_op[op] += e["dur"]
        by_node[e["name"][: -len("_kernel_time")]] += e["dur"]
    return by_op, by_node, len(runs) - skip_runs


def then_branch_nodes(model: onnx.ModelProto) -> set[str]:
    names = set()
    for n in model.graph.node:
        if n.op_type == "If":
            for a in n.attribute:
                if a.name == "then_branch":
                    names.update(x.name for x in a.g.node)
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--models", default=os.path.join(ROOT, "target", "bench-realistic", "models"))
    ap.add_argument("--only", default="mlp,resnet_bn,resnet,gpt")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    ort.set_default_logger_severity(3)
    for model in a.only.split(","):
        b = BATCH[model]
        mb = batches(a.models, model, b)
        prof = tempfile.mkdtemp(prefix=f"profile-{model}-")
        # The floor: data in, parameters from their initializers (graph inputs with defaults).
        floor_path = os.path.join(a.work, model, "floor.onnx")
        s = session(floor_path, prof)
        meta = json.load(open(os.path.join(a.work, model, "floor.manifest.json")))
        held = {}
        for i in range((a.windows + 1) * K):
            outs = s.run(None, {**{n: mb[i % len(mb)][n] for n in meta["data_inputs"]}, **held})
            names = [o.name for o in s.get_outputs()]
            by = dict(zip(names, outs))
            held = {inp: by[out] for inp, out in meta["state"]}
        floor_prof = s.end_profiling()
        f_op, _, f_runs = kernel_times(floor_prof, K)
        # The step, whole: state fed back as the manifest says.
        step_path = os.path.join(a.work, model, "step.onnx")
        proto = onnx.load(step_path)
        md = {p.key: p.value for p in proto.metadata_props}
        state = json.loads(md["onnx_ga.state"])
        data_inputs = json.loads(md["onnx_ga.data_inputs"])
        then_nodes = then_branch_nodes(proto)
        s = session(step_path, prof)
        held = {}
        for i in range((a.windows + 1) * K):
            outs = s.run(None, {**{n: mb[i % len(mb)][n] for n in data_inputs}, **held})
            by = dict(zip([o.name for o in s.get_outputs()], outs))
            held = {e["input"]: by[e["output"]] for e in state if e["output"] in by}
        step_prof = s.end_profiling()
        s_op, s_node, s_runs = kernel_times(step_prof, K)
        windows = s_runs / K
        apply_us = sum(v for n, v in s_node.items() if n in then_nodes)
        total = sum(s_op.values())
        print(f"\n### {model}, B={b}, 1 thread, {a.windows} windows of K={K} (kernel time, ms per window)\n")
        print(f"floor: {sum(f_op.values()) / 1e3 / (f_runs / K):.2f} ms per window ({K} runs); "
              f"step whole: {total / 1e3 / windows:.2f} ms per window, of which the apply If's then-branch "
              f"(the optimizer) {apply_us / 1e3 / windows:.2f} ms in {len(then_nodes)} nodes\n")
        print("| op | floor ms/window | step whole ms/window |")
        print("|---|--:|--:|")
        ops = sorted(set(f_op) | set(s_op), key=lambda o: -(s_op.get(o, 0)))
        for op in ops[: a.top]:
            print(f"| {op} | {f_op.get(op, 0) / 1e3 / (f_runs / K):.2f} | {s_op.get(op, 0) / 1e3 / windows:.2f} |")
        for p in glob.glob(os.path.join(prof, "*")):
            os.remove(p)
        os.rmdir(prof)


if __name__ == "__main__":
    sys.exit(main())
