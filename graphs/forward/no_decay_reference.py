"""torch references for `rewrite --no-decay GLOB` (tests/autodiff.rs): the full-batch AdamW
run of generate.py's `run_full` with two parameter groups, as transformer recipes train:
weight decay 0.1 on the matrices, none on the biases and LayerNorm parameters
(torch_gpt: `*bias`, `*ln*`; torch_mlp: `*bias`). Writes
fixtures/forward/<name>/run_adamw_no_decay.npz (the parameters after the run); for
torch_mlp also run_momentum_no_decay.npz, the same groups under SGD with momentum 0.9
(lr 0.1), as convolutional recipes train (weight decay added to the gradient, L2, before
the momentum). Reads the committed graphs/forward/<name>/dynamo.onnx and data.npz. Run
with the torch venv:

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


MOMENTUM = dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, foreach=False)


def run(model, mapping, data, names, batch, globs, momentum=False):
    m = copy.deepcopy(model).train()
    decay, no_decay = [], []
    for onnx_name, p in g.trainable(m, mapping):
        exempt = any(fnmatch.fnmatchcase(onnx_name, x) for x in globs)
        (no_decay if exempt else decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if momentum:
        opt = torch.optim.SGD(groups, **MOMENTUM, weight_decay=WEIGHT_DECAY)
    else:
        opt = torch.optim.AdamW(groups, **dict(g.ADAMW, weight_decay=WEIGHT_DECAY))
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
        if name == "torch_mlp":
            params, _ = run(model, mapping, data, names, spec["batch"], globs, momentum=True)
            g.save_npz(os.path.join(fdir, "run_momentum_no_decay.npz"), params)
        print(f"{name}: {exempt} parameters without decay ({globs}), weight_decay {WEIGHT_DECAY}")


if __name__ == "__main__":
    main()
