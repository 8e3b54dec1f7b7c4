"""Hugging Face's own LlamaForCausalLM at a real size, trained by onnx-ga from its dynamo
export (opset 23: ONNX Attention, written out by our autodiff; and opset 18: torch's own
decomposition) next to PyTorch eager on the same micro-batches, K and threads. A whole-run
measurement, not a column of `realistic.rs`: the ORT training API has no artifacts for this
export.

    .venv-torch/bin/python benches/realistic/hf_llama.py [THREADS ...]    # default: 1 2
    (after cargo build --release; writes its files under target/bench-hf-llama/)

Model: vocab 512, d 256, 4 layers, 4 query heads over 2 key/value heads, SwiGLU 1024, context
64 (4.2M parameters); micro-batch 8 sequences, K = 4, AdamW(lr 1e-3). onnx-ga: `rewrite
--loss-fn cross-entropy --optimizer adamw --accum-steps 4`, then `train --steps 96`: its own
report (micro-steps per second, session setup included). PyTorch: `(loss / K).backward()`
per micro-step, `step()` and `zero_grad()` on the K-th; 8 micro-steps of warm-up, then 40
timed.
"""

import copy
import os
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import transformers as T

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "onnx-ga")
WORK = os.path.join(ROOT, "target", "bench-hf-llama")
VOCAB, D, LAYERS, CONTEXT, B, K = 512, 256, 4, 64, 8, 4


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=4 * D,
                               num_hidden_layers=LAYERS, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=CONTEXT,
                               attn_implementation="sdpa")
        self.m = T.LlamaForCausalLM(config)

    def forward(self, x):
        return self.m(input_ids=x, use_cache=False).logits


def torch_ms(model, ids, labels, threads):
    torch.set_num_threads(threads)
    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def micro_step(i):
        rows = slice((i * B) % len(ids), (i * B) % len(ids) + B)
        loss = nn.functional.cross_entropy(m(ids[rows]).reshape(-1, VOCAB),
                                           labels[rows].reshape(-1)) / K
        loss.backward()
        if i % K == K - 1:
            opt.step()
            opt.zero_grad()

    for i in range(8):
        micro_step(i)
    start = time.perf_counter()
    for i in range(40):
        micro_step(i)
    return (time.perf_counter() - start) / 40 * 1e3


def onnx_ga_ms(step, data, threads):
    out = subprocess.run([BIN, "train", step, "--data", data, "--micro-batch", str(B),
                          "--steps", "96", "--threads", str(threads)],
                         capture_output=True, text=True, check=True).stderr
    rate = float(re.search(r"([0-9.]+) micro-steps/s", out.splitlines()[-1]).group(1))
    return 1e3 / rate


def main(threads):
    os.makedirs(WORK, exist_ok=True)
    torch.manual_seed(0)
    model = Logits().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (256, CONTEXT), generator=g)
    labels = torch.randint(0, VOCAB, (256, CONTEXT), generator=g)
    data = os.path.join(WORK, "data.npz")
    np.savez(data, x=ids.numpy(), labels=labels.numpy())
    steps = {}
    for opset in (23, 18):
        path = os.path.join(WORK, f"llama{opset}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(copy.deepcopy(model), (ids[:2],), dynamo=True,
                                        optimize=False, verbose=False, opset_version=opset,
                                        input_names=["x"], output_names=["logits"],
                                        dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
        program.save(path)
        steps[opset] = os.path.join(WORK, f"llama{opset}_step.onnx")
        subprocess.run([BIN, "rewrite", path, "--loss-fn", "cross-entropy", "--optimizer",
                        "adamw", "--lr", "1e-3", "--accum-steps", str(K), "-o", steps[opset]],
                       capture_output=True, check=True)
    print(f"parameters {sum(p.numel() for p in model.parameters())}")
    print("threads | onnx-ga opset 23 | onnx-ga opset 18 | PyTorch eager | ratio (23)")
    for t in threads:
        ours = {o: onnx_ga_ms(s, data, t) for o, s in steps.items()}
        theirs = torch_ms(model, ids, labels, t)
        print(f"{t} | {ours[23]:.1f} ms | {ours[18]:.1f} ms | {theirs:.1f} ms | "
              f"{ours[23] / theirs:.2f}x", flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [1, 2])
