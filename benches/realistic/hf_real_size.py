"""Hugging Face models at their real sizes, trained by onnx-ga from their dynamo export
(`rewrite --loss-fn cross-entropy --optimizer adamw --accum-steps 4`, then `train`) next to
PyTorch eager, each in processes of its own, for time per micro-step and peak RSS; then
what a long run does besides training, at that size: a checkpoint (`--save-state`), a
resume (`--init-state`) and `export` of the trained model.

    .venv-torch/bin/python benches/realistic/hf_real_size.py MODEL [THREADS ...]
    MODEL: gpt2 (GPT-2 small, 124M parameters) or resnet50 (25.6M); THREADS default 2
    (after cargo build --release; 4-6 min a thread count on 2 cores; files under
    target/bench-real-size/MODEL/, up to 3 GB)

gpt2: GPT2LMHeadModel from its default config (vocab 50257, context 1024, d 768, 12
layers, 12 heads, tied lm_head), dropout off in both (the export is of the model in eval
mode, so torch trains without it too, which makes the two runs' losses comparable);
micro-batch 2 sequences of 128 tokens, AdamW(lr 1e-4). resnet50: ResNetForImageClassification
from its default config (ResNet-50, 1000 classes, BatchNorm trained on batch statistics
in both), micro-batch 4 images of 3x224x224, AdamW(lr 1e-3). K = 4.

Time per micro-step: onnx-ga's whole runs of 4 and 16 micro-steps, the difference over 12
(session setup and file reading cancel); PyTorch: 4 micro-steps of warm-up, 12 timed,
`(loss / K).backward()`, `step()` and `zero_grad()` on the K-th. Peak RSS: the process's
maximum resident set (`wait4`), and PyTorch's after building the model and loading the
weights (its baseline: the library and the parameters).
"""

import json
import os
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "onnx-ga")
MODELS = {
    # name: (parameters, micro-batch, learning rate)
    "gpt2": (124439808, 2, 1e-4),
    "resnet50": (25557032, 4, 1e-3),
}
NAME = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in MODELS else "gpt2"
PARAMETERS, B, LR = MODELS[NAME]
WORK = os.path.join(ROOT, "target", "bench-real-size", NAME)
K, SAMPLES = 4, 32


def model():
    import torch.nn as nn
    import transformers as T

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            if NAME == "gpt2":
                config = T.GPT2Config(attn_implementation="sdpa", resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
                self.m = T.GPT2LMHeadModel(config)
            else:
                self.m = T.ResNetForImageClassification(T.ResNetConfig(num_labels=1000))

        def forward(self, x):
            if NAME == "gpt2":
                return self.m(input_ids=x, use_cache=False).logits
            return self.m(pixel_values=x).logits

    return Logits()


def samples():
    """SAMPLES inputs and labels, made the same way every time."""
    import torch

    g = torch.Generator().manual_seed(1)
    if NAME == "gpt2":
        ids = torch.randint(0, 50257, (SAMPLES, 128), generator=g)
        return ids, torch.randint(0, 50257, (SAMPLES, 128), generator=g)
    x = torch.randn(SAMPLES, 3, 224, 224, generator=g)
    return x, torch.randint(0, 1000, (SAMPLES,), generator=g)


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
    x, labels = samples()
    np.savez(os.path.join(WORK, "data.npz"), x=x.numpy(), labels=labels.numpy())
    torch.save(m.state_dict(), os.path.join(WORK, "init.pt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(m, (x[:2],), dynamo=True, optimize=False, verbose=False,
                                    input_names=["x"], output_names=["logits"],
                                    dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    program.save(os.path.join(WORK, "model.onnx"))
    run([BIN, "rewrite", os.path.join(WORK, "model.onnx"), "--loss-fn", "cross-entropy",
         "--optimizer", "adamw", "--lr", str(LR), "--accum-steps", str(K), "-o", step])


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
path = sys.argv[1]
sys.argv = [path] + sys.argv[2:]  # [script, MODEL, THREADS]: what the module reads
sys.path.insert(0, os.path.dirname(path))
import hf_real_size as bench
torch.set_num_threads(int(sys.argv[2])); torch.set_num_interop_threads(1)
m = bench.model()
m.load_state_dict(torch.load(os.path.join(bench.WORK, "init.pt")))
m.train()
d = np.load(os.path.join(bench.WORK, "data.npz"))
x, labels = torch.from_numpy(d["x"]), torch.from_numpy(d["labels"])
opt = torch.optim.AdamW(m.parameters(), lr=bench.LR)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
losses, times = [], []
for i in range(16):
    t = time.perf_counter()
    rows = slice((i * bench.B) % bench.SAMPLES, (i * bench.B) % bench.SAMPLES + bench.B)
    logits = m(x[rows])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
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
    _, rss, out, _ = run([sys.executable, "-c", TORCH_CHILD, os.path.abspath(__file__), NAME,
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
    export = run([BIN, "export", os.path.join(WORK, "model.onnx"), "--state", resumed,
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
        run([sys.executable, os.path.abspath(__file__), NAME, "--prepare"])
    state_mib = 4 * PARAMETERS * 4 / 2**20
    print(f"{NAME}: {PARAMETERS:,} parameters; AdamW state (parameters, accumulators, two "
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
    if len(sys.argv) < 2 or sys.argv[1] not in MODELS:
        raise SystemExit(f"usage: hf_real_size.py {{{'|'.join(MODELS)}}} [THREADS ...]")
    if sys.argv[2:] == ["--prepare"]:
        prepare()
    else:
        main([int(t) for t in sys.argv[2:]] or [2])
