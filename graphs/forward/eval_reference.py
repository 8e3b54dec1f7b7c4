"""torch references for `train --eval-data/--eval-model` (tests/eval_loss.rs): the validation
loss and accuracy of `model.eval()` on held-out rows, before training and after every
optimizer step.

- torch_mlp, torch_gpt: the full-batch AdamW run of generate.py's `run_full` (K = 4
  micro-batches of 8, or of 4 sequences, as one batch). The GPT's labels hold ignored
  (padded) positions: the validation loss is the mean over every non-ignored label of the
  set, which batches of any size must add up to.
- torch_cnn (BatchNorm): torch's own micro-batch loop with SGD (generate.py's
  `run_micro_sgd`: loss / K per micro-batch, a step per window), whose running statistics
  move at every micro-batch, as a step rewritten with `--bn-stats micro` moves them. The
  eval model normalises with them.

The validation rows are the model's own data generator drawn from numpy's default_rng(5000 +
the model's seed) (the training data is 1000 + seed): rows 20 for the MLP and CNN, 10 for the
GPT, not multiples of the batch. Their labels are random, like the training data's, so
training does not lower their loss much (the MLP's and CNN's rise after a few steps). Writes, per model,
fixtures/forward/<name>/eval_data.npz and eval.json (the losses, index 0 before training).
Reads the committed graphs/forward/<name>/dynamo.onnx and data.npz; changes nothing else.
Run with the torch venv:

    .venv-torch/bin/python graphs/forward/eval_reference.py
"""
import copy
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import generate as g  # noqa: E402

# name: (optimizer, validation rows)
CASES = {"torch_mlp": ("adamw", 20), "torch_gpt": ("adamw", 10), "torch_cnn": ("sgd_micro", 20)}


def validation(m, val, names):
    """(loss, accuracy) of `m.eval()` on the whole set: the mean cross-entropy and the
    share of counted labels whose class scores highest (torch's argmax: the first of equals)."""
    x, y = g.to_inputs(val, slice(0, len(val["labels"])), names)
    was_training = m.training
    m.eval()
    with torch.no_grad():
        logits = m(*x)
        loss = float(g.loss_fn(logits, y))
        counted = y != g.IGNORE_INDEX
        hits = (logits.argmax(dim=-1) == y) & counted
        accuracy = float(hits.sum()) / float(counted.sum())
    m.train(was_training)
    return loss, accuracy


def run_adamw(model, data, names, batch, val):
    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW([p for _, p in m.named_parameters()], **g.ADAMW)
    losses = [validation(m, val, names)]
    for t in range(g.STEPS):
        x, y = g.step_inputs(data, names, batch, t)
        opt.zero_grad(set_to_none=True)
        g.loss_fn(m(*x), y).backward()
        opt.step()
        losses.append(validation(m, val, names))
    return losses


def run_sgd_micro(model, data, names, val, k=4, micro=8):
    m = copy.deepcopy(model).train()
    opt = torch.optim.SGD([p for _, p in m.named_parameters()], **g.SGD)
    window = k * micro
    losses = [validation(m, val, names)]
    opt.zero_grad(set_to_none=True)
    for t in range(g.STEPS):
        for j in range(k):
            idx = (np.arange(micro) + window * t + micro * j) % g.N_SAMPLES
            x, y = g.to_inputs(data, idx, names)
            (g.loss_fn(m(*x), y) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(validation(m, val, names))
    return losses


def main():
    torch.set_num_threads(1)
    for name, (optimizer, rows) in CASES.items():
        e = g.Exported(name)
        spec, fdir, names, data, model = e.spec, e.fixtures, e.names, e.data, e.model
        drawn = spec["data"](np.random.default_rng(5000 + spec["seed"]))
        val = {k: v[:rows] for k, v in drawn.items()}
        if optimizer == "adamw":
            losses = run_adamw(model, data, names, spec["batch"], val)
        else:
            losses = run_sgd_micro(model, data, names, val)
        g.save_npz(os.path.join(fdir, "eval_data.npz"), val)
        counted = int(np.sum(val["labels"] != g.IGNORE_INDEX))
        meta = {"optimizer": optimizer, "rows": rows, "counted_labels": counted,
                "steps": g.STEPS, "losses": [l for l, _ in losses],
                "accuracies": [a for _, a in losses], "torch": torch.__version__}
        with open(os.path.join(fdir, "eval.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        print(f"{name}: {optimizer}, {rows} rows ({counted} labels counted), "
              f"validation loss {losses[0][0]:.6f} -> {losses[-1][0]:.6f}, "
              f"accuracy {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")


if __name__ == "__main__":
    main()
