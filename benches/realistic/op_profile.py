#!/usr/bin/env python3
"""Where a window's time goes, op by op: ONNX Runtime's own profiler (1.31.1, the version the
Rust columns use; run with .venv-ort/bin/python) on the realistic bench's floor and step
(the step run whole, its `If` included, state fed back through the manifest as the Trainer
does), one thread, micro-batch B, W windows of K after one warm-up window.

Prints, per graph, kernel time per window by op type (top N) and the total, and for the step
the time inside the apply `If`'s then-branch (the optimizer) vs everything else.

Usage: .venv-ort/bin/python benches/realistic/op_profile.py WORK_DIR [--models DIR] [--only mlp,gpt]
       [--windows 3] [--top 10] [--batch B]
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


def kernel_times(profile: str, skip_runs: int) -> tuple[list[tuple[str, str, float]], int]:
    """(node name, op type, us) of every kernel after the first skip_runs runs, and the runs."""
    with open(profile) as f:
        events = json.load(f)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    runs.sort(key=lambda e: e["ts"])
    if len(runs) <= skip_runs:
        raise SystemExit(f"{profile}: only {len(runs)} runs")
    t0 = runs[skip_runs]["ts"]
    out = []
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < t0:
            continue
        out.append((e["name"][: -len("_kernel_time")], e.get("args", {}).get("op_name", "?"), e["dur"]))
    return out, len(runs) - skip_runs


def branch_nodes(model: onnx.ModelProto, branch: str) -> set[str]:
    names = set()
    for n in model.graph.node:
        if n.op_type == "If":
            for a in n.attribute:
                if a.name == branch:
                    names.update(x.name for x in a.g.node)
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--models", default=os.path.join(ROOT, "target", "bench-realistic", "models"))
    ap.add_argument("--only", default="mlp,resnet_bn,resnet,gpt")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--batch", type=int, help="micro-batch size (default 8, GPT 4)")
    a = ap.parse_args()
    ort.set_default_logger_severity(3)
    for model in a.only.split(","):
        b = a.batch or BATCH[model]
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
        f_k, f_runs = kernel_times(floor_prof, K)
        # The step, whole: state fed back as the manifest says.
        step_path = os.path.join(a.work, model, "step.onnx")
        proto = onnx.load(step_path)
        md = {p.key: p.value for p in proto.metadata_props}
        state = json.loads(md["onnx_ga.state"])
        data_inputs = json.loads(md["onnx_ga.data_inputs"])
        then_nodes = branch_nodes(proto, "then_branch")
        else_nodes = branch_nodes(proto, "else_branch")
        s = session(step_path, prof)
        # State without an initializer starts at zeros (the step file does not store it).
        inits = {t.name for t in proto.graph.initializer}
        held = {}
        for inp in proto.graph.input:
            if inp.name in inits or inp.name in data_inputs:
                continue
            tt = inp.type.tensor_type
            dims = [d.dim_value for d in tt.shape.dim]
            held[inp.name] = np.zeros(dims, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        for i in range((a.windows + 1) * K):
            outs = s.run(None, {**{n: mb[i % len(mb)][n] for n in data_inputs}, **held})
            by = dict(zip([o.name for o in s.get_outputs()], outs))
            held = {e["input"]: by[e["output"]] for e in state if e["output"] in by}
        step_prof = s.end_profiling()
        s_k, s_runs = kernel_times(step_prof, K)
        fw, sw = f_runs / K, s_runs / K

        def table(kernels, where):
            c = collections.Counter()
            for name, op, us in kernels:
                if op != "If" and where(name):
                    c[op] += us
            return c

        floor_ops = table(f_k, lambda n: True)
        main_ops = table(s_k, lambda n: n not in then_nodes and n not in else_nodes)
        then_ops = table(s_k, lambda n: n in then_nodes)
        else_ops = table(s_k, lambda n: n in else_nodes)
        if_total = sum(us for _, op, us in s_k if op == "If")
        if_own = if_total - sum(then_ops.values()) - sum(else_ops.values())
        ms = lambda c, w: sum(c.values()) / 1e3 / w  # noqa: E731
        print(f"\n### {model}, B={b}, 1 thread, {a.windows} windows of K={K} after one warm-up "
              "(ONNX Runtime kernel time, ms per window)\n")
        print(f"floor {ms(floor_ops, fw):.2f}; step whole: main graph {ms(main_ops, sw):.2f}, apply If "
              f"then-branch (the optimizer, {len(then_nodes)} nodes, once per window) {ms(then_ops, sw):.2f}, "
              f"else-branch (pass-through, {len(else_nodes)} nodes, K-1 times) {ms(else_ops, sw):.2f}, the If "
              f"itself {if_own / 1e3 / sw:.2f}\n")
        print("| op | floor | step: main graph | step: then-branch (apply) | step: else-branch |")
        print("|---|--:|--:|--:|--:|")
        ops = sorted(set(floor_ops) | set(main_ops) | set(then_ops) | set(else_ops),
                     key=lambda o: -(main_ops.get(o, 0) + then_ops.get(o, 0) + else_ops.get(o, 0)))
        for op in ops[: a.top]:
            print(f"| {op} | {floor_ops.get(op, 0) / 1e3 / fw:.2f} | {main_ops.get(op, 0) / 1e3 / sw:.2f} "
                  f"| {then_ops.get(op, 0) / 1e3 / sw:.2f} | {else_ops.get(op, 0) / 1e3 / sw:.2f} |")
        for p in glob.glob(os.path.join(prof, "*")):
            os.remove(p)
        os.rmdir(prof)


if __name__ == "__main__":
    sys.exit(main())
