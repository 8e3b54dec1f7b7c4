"""torch references for `rewrite --no-decay GLOB` (tests/autodiff.rs): the full-batch AdamW
run of generate.py's `run_full` with two parameter groups, as transformer recipes train:
weight decay 0.1 on the matrices, none on the biases and LayerNorm parameters
(torch_gpt: `*bias`, `*ln*`; torch_mlp: `*bias`). Writes
fixtures/forward/<name>/run_adamw_no_decay.npz (the parameters after the run). Reads the
committed graphs/forward/<name>/dynamo.onnx and data.npz. Run with the torch venv:

    .venv-torch/bin/python graphs/forward/no_decay_reference.py
"""
import copy
import fnmatch
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import generate as g  # noqa: E402

# name: the ONNX initializer globs trained without decay
CASES = {"torch_mlp": ["*bias"], "torch_gpt": ["*bias", "*ln*"]}
WEIGHT_DECAY = 0.1


def run(model, mapping, data, names, batch, globs):
    m = copy.deepcopy(model).train()
    decay, no_decay = [], []
    for onnx_name, p in g.trainable(m, mapping):
        exempt = any(fnmatch.fnmatchcase(onnx_name, x) for x in globs)
        (no_decay if exempt else decay).append(p)
    hp = dict(g.ADAMW, weight_decay=WEIGHT_DECAY)
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], **hp)
    for t in range(g.STEPS):
        x, y = g.step_inputs(data, names, batch, t)
        opt.zero_grad(set_to_none=True)
        g.loss_fn(m(*x), y).backward()
        opt.step()
    return {o: p.detach().numpy().copy() for o, p in g.trainable(m, mapping)}, len(no_decay)


def main():
    torch.set_num_threads(1)
    for name, globs in CASES.items():
        e = g.Exported(name)
        spec, fdir, names, data, mapping, model = e.spec, e.fixtures, e.names, e.data, e.mapping, e.model
        params, exempt = run(model, mapping, data, names, spec["batch"], globs)
        g.save_npz(os.path.join(fdir, "run_adamw_no_decay.npz"), params)
        print(f"{name}: {exempt} parameters without decay ({globs}), weight_decay {WEIGHT_DECAY}")


if __name__ == "__main__":
    main()
