"""GPT-2 small (124M parameters) at its real size: Hugging Face's GPT2LMHeadModel from its
default config, exported by dynamo, trained by onnx-ga (`rewrite --loss-fn cross-entropy
--optimizer adamw --accum-steps 4`, then `train`) next to PyTorch eager, each in processes
of its own, for time per micro-step and peak RSS; then what a long run does besides
training, at this size: a checkpoint (`--save-state`), a resume (`--init-state`) and
`export` of the trained model.

    .venv-torch/bin/python benches/realistic/hf_gpt2_small.py [THREADS ...]    # default: 2
    (after cargo build --release; ~4 min a thread count on 2 cores; files under
    target/bench-gpt2-small/, about 3 GB)

Model: vocab 50257, context 1024, d 768, 12 layers, 12 heads, tied lm_head; dropout off in
both (the export is of the model in eval mode, so torch trains without it too, which makes
the two runs' losses comparable). Micro-batch 2 sequences of 128 tokens, K = 4,
AdamW(lr 1e-4). Time per micro-step: onnx-ga's whole runs of 4 and 16 micro-steps, the
difference over 12 (session setup and file reading cancel); PyTorch: 4 micro-steps of
warm-up, 12 timed, `(loss / K).backward()`, `step()` and `zero_grad()` on the K-th. Peak
RSS: the process's maximum resident set (`wait4`), and PyTorch's after building the model
and loading the weights (its baseline: the library and one copy of the parameters).
"""

import json
import os
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "onnx-ga")
WORK = os.path.join(ROOT, "target", "bench-gpt2-small")
B, T_SEQ, K, VOCAB = 2, 128, 4, 50257


def model():
    import torch.nn as nn
    import transformers as T

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            config = T.GPT2Config(attn_implementation="sdpa", resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
            self.m = T.GPT2LMHeadModel(config)

        def forward(self, x):
            return self.m(input_ids=x, use_cache=False).logits

    return Logits()


def prepare():
    """The export, the data and the step (once)."""
    import numpy as np
    import torch

    os.makedirs(WORK, exist_ok=True)
    step = os.path.join(WORK, "step.onnx")
    if os.path.exists(step):
        return
    torch.manual_seed(0)
    m = model().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (32, T_SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (32, T_SEQ), generator=g)
    np.savez(os.path.join(WORK, "data.npz"), x=ids.numpy(), labels=labels.numpy())
    torch.save(m.state_dict(), os.path.join(WORK, "init.pt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(m, (ids[:2],), dynamo=True, optimize=False, verbose=False,
                                    input_names=["x"], output_names=["logits"],
                                    dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    program.save(os.path.join(WORK, "gpt2.onnx"))
    run([BIN, "rewrite", os.path.join(WORK, "gpt2.onnx"), "--loss-fn", "cross-entropy",
         "--optimizer", "adamw", "--lr", "1e-4", "--accum-steps", str(K), "-o", step])


def run(cmd):
    """(seconds, peak RSS MiB, stdout, stderr) of a child process, which must succeed; its
    peak RSS read by wait4 (so it is reaped here, not by Popen)."""
    with open(os.path.join(WORK, "out.log"), "w+") as out, \
            open(os.path.join(WORK, "err.log"), "w+") as err:
        start = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        seconds = time.perf_counter() - start
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    return seconds, usage.ru_maxrss / 1024, stdout, stderr


def onnx_ga(threads):
    step, data = os.path.join(WORK, "step.onnx"), os.path.join(WORK, "data.npz")
    base = [BIN, "train", step, "--data", data, "--micro-batch", str(B), "--threads",
            str(threads)]
    short, rss_short, _, _ = run(base + ["--steps", "4"])
    long, rss, _, _ = run(base + ["--steps", "16", "--metrics",
                                  os.path.join(WORK, f"ours{threads}.jsonl")])
    losses = [json.loads(l)["loss"] for l in open(os.path.join(WORK, f"ours{threads}.jsonl"))]
    return (long - short) / 12 * 1e3, max(rss, rss_short), losses


TORCH_CHILD = r"""
import os, sys, time, resource, json
import numpy as np, torch, torch.nn as nn
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import hf_gpt2_small as bench
torch.set_num_threads(int(sys.argv[2])); torch.set_num_interop_threads(1)
m = bench.model()
m.load_state_dict(torch.load(os.path.join(bench.WORK, "init.pt")))
m.train()
d = np.load(os.path.join(bench.WORK, "data.npz"))
ids, labels = torch.from_numpy(d["x"]), torch.from_numpy(d["labels"])
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
losses, times = [], []
for i in range(16):
    t = time.perf_counter()
    rows = slice((i * bench.B) % 32, (i * bench.B) % 32 + bench.B)
    loss = nn.functional.cross_entropy(m(ids[rows]).reshape(-1, bench.VOCAB),
                                       labels[rows].reshape(-1))
    (loss / bench.K).backward()
    if i % bench.K == bench.K - 1:
        opt.step()
        opt.zero_grad()
    times.append(time.perf_counter() - t)
    losses.append(loss.item())
print(json.dumps({"ms": sum(times[4:]) / 12 * 1e3, "baseline": base, "losses": losses}))
"""


def pytorch(threads):
    _, rss, out, _ = run([sys.executable, "-c", TORCH_CHILD, os.path.abspath(__file__),
                          str(threads)])
    r = json.loads(out.strip().splitlines()[-1])
    return r["ms"], rss, r["baseline"], r["losses"]


def files():
    """Checkpoint, resume and export at this size: seconds and peak RSS MiB."""
    step, data = os.path.join(WORK, "step.onnx"), os.path.join(WORK, "data.npz")
    state, resumed = os.path.join(WORK, "s.safetensors"), os.path.join(WORK, "r.safetensors")
    train = [BIN, "train", step, "--data", data, "--micro-batch", str(B), "--threads", "2"]
    plain = run(train + ["--steps", "4"])
    saved = run(train + ["--steps", "4", "--save-state", state])
    resume = run(train + ["--steps", "4", "--init-state", state, "--save-state",
                                   resumed])
    export = run([BIN, "export", os.path.join(WORK, "gpt2.onnx"), "--state", resumed,
                           "--step", step, "-o", os.path.join(WORK, "trained.onnx")])
    print("what | s | peak RSS MiB")
    print(f"train 4 micro-steps | {plain[0]:.1f} | {plain[1]:.0f}")
    print(f"the same, --save-state | {saved[0]:.1f} | {saved[1]:.0f}")
    print(f"resume 4 more (--init-state, --save-state) | {resume[0]:.1f} | {resume[1]:.0f}")
    print(f"export | {export[0]:.1f} | {export[1]:.0f}")


def main(threads):
    # The export runs in a process of its own: a child forked from a process that has
    # loaded torch and the model would report that process's peak RSS as its own (Linux
    # keeps the high-water mark across exec).
    if not os.path.exists(os.path.join(WORK, "step.onnx")):
        os.makedirs(WORK, exist_ok=True)
        run([sys.executable, os.path.abspath(__file__), "--prepare"])
    state_mib = 4 * 124439808 * 4 / 2**20
    print(f"GPT-2 small: 124,439,808 parameters; state (parameters, accumulators, two "
          f"moments) {state_mib:.0f} MiB")
    print("threads | onnx-ga ms | PyTorch ms | ratio | onnx-ga peak RSS MiB | PyTorch peak "
          "(baseline) | largest loss difference over 16 micro-steps")
    for t in threads:
        ours, ours_rss, ours_losses = onnx_ga(t)
        theirs, theirs_rss, base, theirs_losses = pytorch(t)
        diff = max(abs(a - b) for a, b in zip(ours_losses, theirs_losses))
        print(f"{t} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x | {ours_rss:.0f} | "
              f"{theirs_rss:.0f} ({base:.0f}) | {diff:.1e}", flush=True)
    files()


if __name__ == "__main__":
    if sys.argv[1:] == ["--prepare"]:
        prepare()
    else:
        main([int(t) for t in sys.argv[1:]] or [2])
