"""torch references for BatchNorm running statistics trained through the autodiff
(tests/autodiff.rs): torch_cnn's running mean and variance after one train-mode forward of
the first 32 rows of its data (one optimizer step's batch), from the exported initial state.

PyTorch moves running_var with the batch's unbiased variance (n - 1). A window of K = 4
micro-batches of 8 pooled per window (`bn_stats=window`) must move them like this one batch
of 32: the window's first micro-steps all run on the initial parameters, so the BatchNorm
inputs are the batch's. Writes fixtures/forward/torch_cnn/{dynamo,legacy}_window_running_stats.npz.
Run with the torch venv:

    .venv-torch/bin/python graphs/forward/bn_reference.py
"""
import copy
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import generate as g  # noqa: E402

NAME = "torch_cnn"


def main():
    torch.set_num_threads(1)
    for export in ["dynamo", "legacy"]:
        e = g.Exported(NAME, export)
        fdir, names, data, mapping = e.fixtures, e.names, e.data, e.mapping
        m = copy.deepcopy(e.model).train()
        x, _ = g.to_inputs(data, slice(0, 32), names)
        with torch.no_grad():
            m(*x)
        stats = {mapping[n]: b.detach().numpy().copy() for n, b in m.named_buffers()
                 if n.endswith("running_mean") or n.endswith("running_var")}
        g.save_npz(os.path.join(fdir, f"{export}_window_running_stats.npz"), stats)
        print(f"{NAME}/{export}: {sorted(stats)}")


if __name__ == "__main__":
    main()
