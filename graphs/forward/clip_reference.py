"""torch.nn.utils.clip_grad_norm_ references for `rewrite --clip-norm` (tests/clip_norm.rs).

For each model below: the full-batch AdamW run of generate.py's `run_full` (the batch of 32
that K = 4 micro-batches of 8 make; torch_gpt: 16 = 4 x 4), with the gradient clipped by its
global norm before every optimizer step. max_norm is the median of the unclipped run's
global norms, so some steps clip and some do not. Writes, per model,
fixtures/forward/<name>/run_adamw_clip.npz (the parameters after the run) and
run_adamw_clip.json (max_norm, each step's global norm before clipping, which steps
clipped). Reads the committed graphs/forward/<name>/dynamo.onnx and data.npz; changes nothing
else. Run with the torch venv:

    .venv-torch/bin/python graphs/forward/clip_reference.py
"""
import copy
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import generate as g  # noqa: E402

NAMES = ["torch_mlp", "torch_gpt"]


def run(model, mapping, data, names, batch, max_norm):
    m = copy.deepcopy(model).train()
    params = [p for _, p in m.named_parameters()]
    opt = torch.optim.AdamW(params, **g.ADAMW)
    norms, clipped = [], []
    for t in range(g.STEPS):
        x, y = g.step_inputs(data, names, batch, t)
        opt.zero_grad(set_to_none=True)
        g.loss_fn(m(*x), y).backward()
        limit = float("inf") if max_norm is None else max_norm
        total = float(torch.nn.utils.clip_grad_norm_(params, limit, foreach=False))
        norms.append(total)
        clipped.append(max_norm is not None and max_norm / (total + 1e-6) < 1.0)
        opt.step()
    return {o: p.detach().numpy().copy() for o, p in g.trainable(m, mapping)}, norms, clipped


def main():
    torch.set_num_threads(1)
    for name in NAMES:
        e = g.Exported(name)
        spec, fdir, names, data, mapping, model = e.spec, e.fixtures, e.names, e.data, e.mapping, e.model
        _, free_norms, _ = run(model, mapping, data, names, spec["batch"], None)
        max_norm = float(np.float32(np.median(free_norms)))
        params, norms, clipped = run(model, mapping, data, names, spec["batch"], max_norm)
        g.save_npz(os.path.join(fdir, "run_adamw_clip.npz"), params)
        meta = {"max_norm": max_norm, "batch": spec["batch"], "steps": g.STEPS,
                "global_norms": norms, "clipped": clipped, "torch": torch.__version__}
        with open(os.path.join(fdir, "run_adamw_clip.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        print(f"{name}: max_norm {max_norm:.6g}, clipped {sum(clipped)} of {len(clipped)} steps")


if __name__ == "__main__":
    main()
