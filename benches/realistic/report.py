#!/usr/bin/env python3
"""The realistic benchmark's tables from a run folder (benches/realistic/run.sh):
rust.jsonl, peers.jsonl (timing rounds) and rss.jsonl (peak RSS). Standard library only.

Times are ms per micro-step (K = 4, window averaged): each cell is the median over rounds of
that round's median over windows. A ratio is the median over rounds of the per-round ratio
(both sides measured in the same round, minutes apart at most), shown with its range over
rounds in brackets when there are several.

Usage: report.py DIR
"""

from __future__ import annotations

import json
import os
import statistics
import sys

ORDER = ["mlp", "resnet_bn", "resnet", "gpt"]
NAMES = {"mlp": "MLP 1.9M", "resnet_bn": "ResNet-8 BN", "resnet": "ResNet-8", "gpt": "GPT 3.7M"}
# A core-to-core round trip above this means the two vCPUs were on different dies.
SLOW_C2C_NS = 200
# Below this, the two vCPUs were the two hardware threads of one core (29-31 ns measured; a
# shared L3 60-78 ns): compute-bound kernels then gain little from the second thread.
SMT_C2C_NS = 45


def state(c2c_ns: float) -> str:
    """Where the two vCPUs were when a cell began, from its core-to-core round trip."""
    if c2c_ns < SMT_C2C_NS:
        return "smt"
    return "dies" if c2c_ns > SLOW_C2C_NS else "l3"


def read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    d = sys.argv[1]
    recs = read(os.path.join(d, "rust.jsonl")) + read(os.path.join(d, "peers.jsonl"))
    rss = read(os.path.join(d, "rss.jsonl"))
    cells: dict = {}
    for r in recs:
        cells.setdefault((r["model"], r["batch"], r["threads"], r["column"]), {})[r["round"]] = r
    keys = sorted({(r["model"], r["batch"], r["threads"]) for r in recs},
                  key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else 99, k[1], k[2]))
    rounds = sorted({r["round"] for r in recs})

    def med(k, col, field="ms_per_step"):
        v = [c[field] for c in cells.get((*k, col), {}).values() if c.get(field) is not None]
        return statistics.median(v) if v else None

    def ratios(k, a, b, fa="ms_per_step", fb="ms_per_step"):
        ca, cb = cells.get((*k, a), {}), cells.get((*k, b), {})
        return [ca[r][fa] / cb[r][fb] for r in rounds if r in ca and r in cb
                and ca[r].get(fa) is not None and cb[r].get(fb)]

    def ratio(k, a, b, fa="ms_per_step", fb="ms_per_step", spread=True):
        v = ratios(k, a, b, fa, fb)
        if not v:
            return "–"
        s = f"{statistics.median(v):.2f}"
        if spread and len(v) > 1:
            s += f" [{min(v):.2f}-{max(v):.2f}]"
        return s

    def ms(x):
        if x is None:
            return "–"
        return f"{x:.2f}" if x < 100 else f"{x:.0f}"

    print(f"{len(rounds)} rounds. ms per micro-step, K = 4, window averaged (median over rounds of each "
          "round's median over windows). Ratios: median over rounds of the per-round ratio [range over rounds].\n")
    print("| model | B | T | floor | step | step whole | ORT API | PyTorch | step / ORT API | step / PyTorch "
          "| step / floor | whole / floor |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for k in keys:
        print(f"| {NAMES.get(k[0], k[0])} | {k[1]} | {k[2]} | {ms(med(k, 'floor'))} | {ms(med(k, 'step'))} "
              f"| {ms(med(k, 'step_whole'))} | {ms(med(k, 'ort_api'))} | {ms(med(k, 'torch'))} "
              f"| {ratio(k, 'step', 'ort_api')} | {ratio(k, 'step', 'torch')} | {ratio(k, 'step', 'floor')} "
              f"| {ratio(k, 'step_whole', 'floor')} |")

    print("\nSingle micro-steps, ms (medians as above): the first of a window (accumulators written, "
          "not added), a later non-applying one, the applying one (the K-th: optimizer included). "
          "floor: every micro-step is the same graph.\n")
    print("| model | B | T | floor | step first | step non-applying | step applying | step non-applying / floor "
          "| whole non-applying | ORT API non-applying | ORT API applying | PyTorch non-applying | PyTorch applying |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for k in keys:
        print(f"| {NAMES.get(k[0], k[0])} | {k[1]} | {k[2]} | {ms(med(k, 'floor', 'ms_nonapply'))} "
              f"| {ms(med(k, 'step', 'ms_first'))} | {ms(med(k, 'step', 'ms_nonapply'))} "
              f"| {ms(med(k, 'step', 'ms_apply'))} "
              f"| {ratio(k, 'step', 'floor', 'ms_nonapply', 'ms_nonapply', spread=False)} "
              f"| {ms(med(k, 'step_whole', 'ms_nonapply'))} | {ms(med(k, 'ort_api', 'ms_nonapply'))} "
              f"| {ms(med(k, 'ort_api', 'ms_apply'))} | {ms(med(k, 'torch', 'ms_nonapply'))} "
              f"| {ms(med(k, 'torch', 'ms_apply'))} |")

    # Thread speed-up: T=1 time / T=2 time, from the medians.
    pairs = sorted({(k[0], k[1]) for k in keys}, key=lambda p: (ORDER.index(p[0]) if p[0] in ORDER else 99, p[1]))
    cols = ["floor", "step", "step_whole", "ort_api", "torch"]
    if any(k[2] == 2 for k in keys) and any(k[2] == 1 for k in keys):
        print("\n1 -> 2 threads speed-up (T=1 ms / T=2 ms, medians over rounds):\n")
        print("| model | B | " + " | ".join(cols) + " |")
        print("|---|--:|" + "--:|" * len(cols))
        for m, b in pairs:
            row = []
            for c in cols:
                a, z = med((m, b, 1), c), med((m, b, 2), c)
                row.append(f"{a / z:.2f}" if a and z else "–")
            print(f"| {NAMES.get(m, m)} | {b} | " + " | ".join(row) + " |")

    # The machine's state beside each cell (benches/realistic.rs `core_to_core_ns`; peers.py
    # `--c2c-exe`): two-thread ratios from rounds whose two cells ran in the same state.
    probed = [r for r in recs if r.get("c2c_ns") is not None]
    if probed:
        two = [r for r in probed if r["threads"] == 2]
        slow = [r for r in two if state(r["c2c_ns"]) == "dies"]
        smt = [r for r in two if state(r["c2c_ns"]) == "smt"]
        c2c = sorted(r["c2c_ns"] for r in probed)
        print(f"\nCore-to-core round trip before each cell: median {c2c[len(c2c) // 2]:.0f} ns "
              f"[{c2c[0]:.0f}-{c2c[-1]:.0f}]; of {len(two)} two-thread cells {len(slow)} began above "
              f"{SLOW_C2C_NS} ns (the two vCPUs on different dies: such cells run up to 1.7x slower; "
              f"benches/README.md, \"Run AC\") and {len(smt)} below {SMT_C2C_NS} ns (the two "
              "hardware threads of one core: compute-bound cells up to 1.5x slower; \"Run AF\").")

        def same_state(k, a, b):
            ca, cb = cells.get((*k, a), {}), cells.get((*k, b), {})
            out = {"smt": [], "l3": [], "dies": []}
            for r in rounds:
                x, y = ca.get(r), cb.get(r)
                if not x or not y or x.get("c2c_ns") is None or y.get("c2c_ns") is None:
                    continue
                sx, sy = state(x["c2c_ns"]), state(y["c2c_ns"])
                if sx == sy:
                    out[sx].append(x["ms_per_step"] / y["ms_per_step"])
            return out

        def show(v):
            if not v:
                return "–"
            return f"{statistics.median(v):.2f} ({len(v)})" + (f" [{min(v):.2f}-{max(v):.2f}]" if len(v) > 1 else "")

        two_keys = [k for k in keys if k[2] == 2]
        if two_keys:
            print("\nTwo threads, ratios from rounds whose two cells began in the same state (median (rounds) "
                  "[range]; L3: the vCPUs sharing an L3, SMT: one core's two hardware threads, dies: "
                  "different dies):\n")
            print("| model | B | step / ORT API, L3 | SMT | dies | step / PyTorch, L3 | SMT | dies |")
            print("|---|--:|--:|--:|--:|--:|--:|--:|")
            for k in two_keys:
                o, t = same_state(k, "step", "ort_api"), same_state(k, "step", "torch")
                print(f"| {NAMES.get(k[0], k[0])} | {k[1]} | "
                      + " | ".join(show(o[s]) for s in ("l3", "smt", "dies")) + " | "
                      + " | ".join(show(t[s]) for s in ("l3", "smt", "dies")) + " |")

    if rss:
        by = {}
        for r in rss:
            by.setdefault((r["model"], r["batch"], r["threads"], r["column"]), []).append(r)
        rkeys = sorted({k[:3] for k in by}, key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else 99, k[1], k[2]))

        def peak(k, c, field="peak_mib"):
            v = [r[field] for r in by.get((*k, c), [])]
            return statistics.median(v) if v else None

        def f0(x):
            return "–" if x is None else f"{x:.0f}"

        def rr(a, b):
            return "–" if a is None or b is None else f"{a / b:.2f}"

        print("\nPeak RSS (VmHWM, MiB), one fresh process per cell (the interpreter, torch or ONNX Runtime "
              "loaded, the micro-batches made, the step/session/model built, 4 windows run). In brackets the "
              "baseline before the step, sessions or model were made (the Rust process: ONNX Runtime loaded; "
              "the ORT API: python + onnxruntime; PyTorch: python + torch).\n")
        print("| model | B | T | floor | step | step whole | ORT API | PyTorch | step / ORT API | step / PyTorch "
              "| step - baseline | ORT API - baseline | PyTorch - baseline |")
        print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for k in rkeys:
            step, api, tor = peak(k, "step"), peak(k, "ort_api"), peak(k, "torch")
            def net(c):
                p, b = peak(k, c), peak(k, c, "baseline_mib")
                return "–" if p is None or b is None else f"{p - b:.0f}"
            print(f"| {NAMES.get(k[0], k[0])} | {k[1]} | {k[2]} | {f0(peak(k, 'floor'))} "
                  f"| {f0(step)} ({f0(peak(k, 'step', 'baseline_mib'))}) | {f0(peak(k, 'step_whole'))} "
                  f"| {f0(api)} ({f0(peak(k, 'ort_api', 'baseline_mib'))}) "
                  f"| {f0(tor)} ({f0(peak(k, 'torch', 'baseline_mib'))}) | {rr(step, api)} | {rr(step, tor)} "
                  f"| {net('step')} | {net('ort_api')} | {net('torch')} |")

    prep = read(os.path.join(d, "prepare.jsonl"))
    if prep:
        print("\nThe models as onnx-ga built them (`--prepare`):\n")
        print("| model | trainable tensors | elements | floor nodes | step nodes | step file MiB | build floor s "
              "| build step s |")
        print("|---|--:|--:|--:|--:|--:|--:|--:|")
        for p in prep:
            print(f"| {NAMES.get(p['model'], p['model'])} | {p['trainable_tensors']} | {p['trainable_elements']:,} "
                  f"| {p['floor_nodes']} | {p['step_nodes']} | {p['step_file_mib']:.1f} | {p['build_floor_s']:.1f} "
                  f"| {p['build_step_s']:.1f} |")
        print()
        for p in prep:
            for line in p["checks"]:
                print(f"- {line}")


if __name__ == "__main__":
    main()
