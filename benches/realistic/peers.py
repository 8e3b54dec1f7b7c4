#!/usr/bin/env python3
"""The peers of the realistic benchmark (benches/realistic.rs): ONNX Runtime's training API
and PyTorch eager, on the same models, data, micro-batches, K and threads.

- ort_api: onnxruntime-training 1.19.2 on OUT/<model>/artifacts (made from the same
  forward.onnx by generate.py). A window is K x module(*batch) (train_step), then
  optimizer.step() and module.lazy_reset_grad(): ORT's own gradient-accumulation loop.
  intra-op threads T, inter-op 1. AdamW lr 1e-3 (the artifacts' AdamW: betas 0.9/0.999,
  eps 1e-8, weight decay 0.01).
- torch: the model from models.py with init.pt, train mode, torch.set_num_threads(T),
  torch.optim.AdamW(lr=1e-3, weight_decay=0.01) with torch's defaults otherwise; per
  micro-step (loss_fn(model(x), labels) / K).backward(), on the K-th optimizer.step() and
  optimizer.zero_grad() (set_to_none, torch's default): what a torch user writes.

Micro-step i takes samples [i*B, (i+1)*B) mod 64 (onnx_ga::train::micro_batch), the distinct
micro-batches made before timing. Each cell is fresh (new session / model and optimizer),
runs one warm-up window, then windows until --cell-ms has passed (at least 3); every
micro-step timed alone. JSON lines in the Rust bench's record format (milliseconds).

Usage:
  peers.py --round N --column ort_api|torch --out FILE [--only a,b] [--threads 1,2]
  peers.py --rss --column ort_api|torch --out FILE     peak RSS, one fresh process per cell
  peers.py --rss-child COLUMN MODEL B T                one cell's peak RSS (a JSON line)
  peers.py --profile MODEL B                           ORT's profiler on the ORT API, per op type
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

BATCHES = {"mlp": (8, 32), "resnet_bn": (8, 32), "resnet": (8, 32), "gpt": (4, 8)}
INPUT = {"mlp": "x", "resnet_bn": "x", "resnet": "x", "gpt": "idx"}
LR = 1e-3
WEIGHT_DECAY = 0.01


def vm() -> tuple[float, float]:
    """VmRSS, VmHWM of this process, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) / 1024
    return out["VmRSS"], out["VmHWM"]


def micro_batches(data: dict, batch: int) -> list[dict]:
    n = next(iter(data.values())).shape[0]
    distinct = n // int(np.gcd(n, batch))
    out = []
    for i in range(distinct):
        idx = np.arange(i * batch, (i + 1) * batch) % n
        out.append({k: np.ascontiguousarray(v[idx]) for k, v in data.items()})
    return out


def load_data(models_dir: str, model: str) -> dict:
    with np.load(os.path.join(models_dir, model, "data.npz")) as z:
        return {k: z[k] for k in z.files}


# ----------------------------------------------------------------------------- runners

def ort_api_runner(models_dir: str, model: str, threads: int, k: int):
    import onnxruntime as ort

    if "onnxruntime.training" not in sys.modules:
        # Its __init__ imports ORTModule and torch; the api submodule needs neither.
        pkg = types.ModuleType("onnxruntime.training")
        pkg.__path__ = [os.path.join(os.path.dirname(ort.__file__), "training")]
        sys.modules["onnxruntime.training"] = pkg
        ort.training = pkg
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    ort.set_default_logger_severity(3)
    d = os.path.join(models_dir, model, "artifacts")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
    module = Module(os.path.join(d, "training_model.onnx"), state, None, session_options=so)
    optimizer = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    module.train()
    names = module.input_names()

    def prepare(batch: dict):
        return [batch[n] for n in names]

    def step(inputs, j: int) -> None:
        module(*inputs)
        if j == k - 1:
            optimizer.step()
            module.lazy_reset_grad()

    return prepare, step


def torch_runner(models_dir: str, model: str, threads: int, k: int):
    import torch

    import models

    torch.set_num_threads(threads)
    net = models.make(model)
    net.load_state_dict(torch.load(os.path.join(models_dir, model, "init.pt")))
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    inp = INPUT[model]

    def prepare(batch: dict):
        return torch.from_numpy(batch[inp]), torch.from_numpy(batch["labels"])

    def step(inputs, j: int) -> None:
        x, y = inputs
        (models.loss_fn(net(x), y) / k).backward()
        if j == k - 1:
            opt.step()
            opt.zero_grad()

    return prepare, step


def runner(column: str, models_dir: str, model: str, threads: int, k: int):
    if column == "ort_api":
        return ort_api_runner(models_dir, model, threads, k)
    if column == "torch":
        if threads_set.get("interop") is None:
            import torch

            torch.set_num_interop_threads(1)
            threads_set["interop"] = 1
        return torch_runner(models_dir, model, threads, k)
    raise SystemExit(f"unknown column {column}")


threads_set: dict = {}


def measure(step, batches: list, k: int, cell_s: float) -> dict:
    clock = time.perf_counter_ns
    nb = len(batches)
    i = 0
    for j in range(k):  # one warm-up window
        step(batches[i % nb], j)
        i += 1
    per, nonapply, first, apply = [], [], [], []
    t0 = clock()
    while clock() - t0 < cell_s * 1e9 or len(per) < 3:
        window = 0.0
        for j in range(k):
            s = clock()
            step(batches[i % nb], j)
            ms = (clock() - s) / 1e6
            window += ms
            if j == 0:
                first.append(ms)
            (apply if j == k - 1 else nonapply).append(ms)
            i += 1
        per.append(window / k)
    return {
        "ms_per_step": statistics.median(per),
        "ms_nonapply": statistics.median(nonapply),
        "ms_first": statistics.median(first),
        "ms_apply": statistics.median(apply),
        "ms_mean": statistics.fmean(per),
        "windows": len(per),
    }


def core_to_core_ns(exe: str | None) -> float | None:
    """The machine's core-to-core round trip now, from the Rust bench (`--c2c`): ~65 ns while
    the two vCPUs share an L3, ~320 across dies (benches/README.md, "Run AC")."""
    if not exe:
        return None
    res = subprocess.run([exe, "--bench", "--c2c"], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{exe} --c2c: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["c2c_ns"]


def cell(column: str, models_dir: str, model: str, batch: int, threads: int, k: int, cell_s: float,
         c2c_exe: str | None = None) -> dict:
    t = time.perf_counter()
    prepare, step = runner(column, models_dir, model, threads, k)
    batches = [prepare(b) for b in micro_batches(load_data(models_dir, model), batch)]
    setup_s = time.perf_counter() - t
    c2c_ns = core_to_core_ns(c2c_exe)
    r = measure(step, batches, k, cell_s)
    r["setup_s"] = setup_s
    if c2c_ns is not None:
        r["c2c_ns"] = c2c_ns
    return r


def rss_child(column: str, models_dir: str, model: str, batch: int, threads: int, k: int, windows: int) -> None:
    if column == "torch":
        import torch  # noqa: F401  (the interpreter and torch loaded: the baseline)

        import models  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    data = micro_batches(load_data(models_dir, model), batch)
    base, _ = vm()
    t = time.perf_counter()
    prepare, step = runner(column, models_dir, model, threads, k)
    batches = [prepare(b) for b in data]
    made, _ = vm()
    setup_s = time.perf_counter() - t
    for i in range(windows * k):
        step(batches[i % len(batches)], i % k)
    end, peak = vm()
    print(json.dumps({"model": model, "batch": batch, "threads": threads, "column": column,
                      "peak_mib": peak, "baseline_mib": base, "after_setup_mib": made,
                      "end_mib": end, "setup_s": setup_s, "windows": windows,
                      "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def profile_ort_api(models_dir: str, model: str, batch: int, k: int, windows: int, top: int) -> None:
    """ONNX Runtime's profiler on the training API's session (1 thread): kernel time per
    window by op type, after one warm-up window; printed as a markdown table."""
    import collections
    import glob
    import tempfile

    import onnxruntime as ort

    prefix = os.path.join(tempfile.mkdtemp(prefix="ort-api-profile-"), model)
    real = ort.SessionOptions

    class Profiled(real):  # the runner makes its own options: turn profiling on in them
        def __init__(self):
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = prefix

    ort.SessionOptions = Profiled
    try:
        prepare, step = ort_api_runner(models_dir, model, 1, k)
    finally:
        ort.SessionOptions = real
    batches = [prepare(b) for b in micro_batches(load_data(models_dir, model), batch)]
    for i in range((windows + 1) * k):
        step(batches[i % len(batches)], i % k)
    del step, prepare
    import gc

    gc.collect()
    files = glob.glob(prefix + "*.json")
    if not files:
        raise SystemExit(f"no profile written under {prefix}")
    by_op = collections.Counter()
    for path in files:
        with open(path) as f:
            events = json.load(f)
        runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
        t0 = runs[k] if len(runs) > windows * k else 0  # skip the warm-up window of train_step runs
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= t0:
                by_op[e.get("args", {}).get("op_name", "?")] += e["dur"]
    total = sum(by_op.values())
    print(f"\n### ORT API, {model}, B={batch}, 1 thread, {windows} windows of K={k} (kernel time, ms per window)\n")
    print(f"total {total / 1e3 / windows:.2f} ms per window ({len(files)} profiled sessions: training and optimizer)\n")
    print("| op | ms/window |")
    print("|---|--:|")
    for op, us in by_op.most_common(top):
        print(f"| {op} | {us / 1e3 / windows:.2f} |")


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--round", type=int)
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--rss-child", nargs=4, metavar=("COLUMN", "MODEL", "B", "T"))
    ap.add_argument("--column", choices=["ort_api", "torch"])
    ap.add_argument("--out")
    ap.add_argument("--models", default=os.path.join(ROOT, "target", "bench-realistic", "models"))
    ap.add_argument("--only", type=csv(str), default=list(BATCHES))
    ap.add_argument("--threads", type=csv(int), default=[1, 2])
    ap.add_argument("--batches", type=csv(int), help="only these micro-batch sizes (default: the model's)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--cell-ms", type=float, default=600)
    ap.add_argument("--rss-windows", type=int, default=4)
    ap.add_argument("--c2c-exe", help="the Rust bench executable, to record the core-to-core round trip "
                    "before each timed cell (c2c_ns)")
    ap.add_argument("--profile", nargs=2, metavar=("MODEL", "B"),
                    help="ORT's profiler on the ORT API (1 thread), op types by kernel time")
    a = ap.parse_args()
    if a.column == "ort_api" or a.profile or (a.rss_child and a.rss_child[0] == "ort_api"):
        # onnxruntime-training's import-time validation imports ORTModule and through it torch
        # (+560 MiB RSS) when torch is installed, as it is in this venv; the training API
        # needs none of it, and a user of the API alone would not have torch loaded.
        sys.modules["torch"] = None

    if a.profile:
        profile_ort_api(a.models, a.profile[0], int(a.profile[1]), a.k, 3, 12)
        return
    if a.rss_child:
        column, model, b, t = a.rss_child
        rss_child(column, a.models, model, int(b), int(t), a.k, a.rss_windows)
        return
    if not a.out or not a.column:
        raise SystemExit("--round and --rss need --column and --out")
    t0 = time.perf_counter()
    lines = []
    for model in a.only:
        for batch in [b for b in BATCHES[model] if not a.batches or b in a.batches]:
            for threads in a.threads:
                if a.rss:
                    res = subprocess.run(
                        [sys.executable, os.path.abspath(__file__), "--rss-child", a.column, model, str(batch),
                         str(threads), "--models", a.models, "--k", str(a.k), "--rss-windows", str(a.rss_windows)],
                        capture_output=True, text=True)
                    if res.returncode != 0:
                        raise SystemExit(f"{a.column} {model} B={batch} T={threads}: {res.stderr[-2000:]}")
                    line = res.stdout.strip().splitlines()[-1]
                    print(f"  rss {line}", file=sys.stderr)
                    lines.append(line)
                else:
                    r = cell(a.column, a.models, model, batch, threads, a.k, a.cell_ms / 1e3, a.c2c_exe)
                    print(f"  {model} B={batch} T={threads} {a.column}: {r['ms_per_step']:.3f} ms/step "
                          f"({r['windows']} windows)", file=sys.stderr)
                    lines.append(json.dumps({"round": a.round, "model": model, "batch": batch, "threads": threads,
                                             "column": a.column, **r}))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    what = "rss" if a.rss else f"round {a.round}"
    print(f"peers.py: {a.column} {what}: {len(lines)} cells in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
