"""A model stored in half precision: torch_mlp after `.half()`, exported by both exporters
(parameters and input float16), and PyTorch's mixed-precision training of it as a user
writes it without autocast: float32 master weights, the forward and backward in float16 on
those weights rounded to half, the loss in float32 (`F.cross_entropy(logits.float(), y)`).

Writes graphs/forward/torch_mlp_half/{dynamo,legacy}.onnx and data.npz (torch_mlp's data with
`x` rounded to float16 and stored as float32: the float32 interface onnx-ga gives a half
model, whose Cast to half at entry is then exact), and fixtures/forward/torch_mlp_half/:
- grads.npz: the float32 loss on rows [0, 8) and torch's float16 gradient of every
  parameter (as float32);
- grads64.npz: the same in float64 on the same (half-valued) weights and inputs: what exact
  arithmetic gives, to see how far each half computation is from it;
- run_micro_sgd.npz: the float32 masters after 8 windows of K = 4 micro-batches of 8 (window
  w, micro-step k: rows 32 w + 8 k ... + 8, mod 64), each micro-step `(loss / 4).backward()`
  on the half model, its half gradients added to float32 accumulators, then
  `torch.optim.SGD(lr=0.1)` on the masters and the half weights set from them;
- eval_data.npz, eval.json: torch_mlp's 20 validation rows (`x` rounded to float16, stored
  as float32) and, before that run and after each of its windows, the float32 mean
  cross-entropy and the accuracy of the half model on them (tests/eval_loss.rs's format).

And torch_cnn_nobn_half, torch_gpt_half: those models after `.half()`, both exports, data.npz
(the float input rounded to float16) and grads.npz / grads64.npz only.

Keys: the ONNX initializer names (the same in both exports). Run with the torch venv:

    .venv-torch/bin/python graphs/forward/half_reference.py
"""
import copy
import json
import os
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import generate as g  # noqa: E402

NAME = "torch_mlp_half"
K = 4
MICRO = 8


# Also in half, gradients only (grads.npz, grads64.npz): a CNN (convolutions, MaxPool, a
# mean over the map: ConvGrad, MaxPoolGrad) and the GPT (an embedding: GatherGrad; masks,
# LayerNorm, softmax), each `<name>_half`.
GRADIENTS_ONLY = ("torch_cnn_nobn", "torch_gpt")


def export(model, example, graphs, name="x"):
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            copy.deepcopy(model).eval(), (example,), dynamo=True, optimize=False,
            verbose=False, input_names=[name], output_names=["logits"],
            dynamic_shapes={name: {0: batch}},
        )
        proto = prog.model_proto
        g.strip_stack_traces(proto)
        onnx.save_model(proto, os.path.join(graphs, "dynamo.onnx"), save_as_external_data=False)
        torch.onnx.export(
            copy.deepcopy(model), (example,), os.path.join(graphs, "legacy.onnx"), dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
            opset_version=g.LEGACY_OPSET, input_names=[name], output_names=["logits"],
            dynamic_axes={name: {0: "batch"}, "logits": {0: "batch"}},
        )


def loss_of(model, x, y):
    return g.loss_fn(model(x).float(), y)


def half_data(data, name):
    """The model's data with its float input rounded to float16 (stored as float32)."""
    out = dict(data)
    if out[name].dtype == np.float32:
        out[name] = out[name].astype(np.float16).astype(np.float32)
    return out


def gradients(half, data, name, fixtures):
    """grads.npz (torch's float16 gradients) and grads64.npz (float64, the same weights)."""
    rows = slice(0, g.GRAD_SAMPLES)
    x, y = torch.from_numpy(data[name][rows]), torch.from_numpy(data["labels"][rows])
    for dtype, file in ((torch.float16, "grads.npz"), (torch.float64, "grads64.npz")):
        m = copy.deepcopy(half).to(dtype).train()
        loss = loss_of(m, x.to(dtype) if x.is_floating_point() else x, y)
        loss.backward()
        kind = np.float32 if dtype == torch.float16 else np.float64
        grads = {"loss": loss.detach().numpy().astype(kind)}
        grads.update({n: p.grad.numpy().astype(kind) for n, p in m.named_parameters()})
        g.save_npz(os.path.join(fixtures, file), grads)


def gradients_only(name):
    base = g.Exported(name)
    input_name = base.spec["input"]
    half = copy.deepcopy(base.model).half()
    data = half_data({k: base.data[k] for k in (input_name, "labels")}, input_name)
    graphs = os.path.join(g.GRAPHS, f"{name}_half")
    fixtures = os.path.join(g.FIXTURES, f"{name}_half")
    os.makedirs(graphs, exist_ok=True)
    os.makedirs(fixtures, exist_ok=True)
    g.save_npz(os.path.join(graphs, "data.npz"), data)
    example = torch.from_numpy(data[input_name][: g.EXPORT_BATCH])
    export(half, example.half() if example.is_floating_point() else example, graphs, input_name)
    gradients(half, data, input_name, fixtures)


def validation(m, val):
    """(loss, accuracy) of the half model on the validation rows."""
    x, y = torch.from_numpy(val["x"].astype(np.float16)), torch.from_numpy(val["labels"])
    with torch.no_grad():
        logits = m(x).float()
        loss = float(F.cross_entropy(logits, y))
        accuracy = float((logits.argmax(dim=-1) == y).sum()) / len(y)
    return loss, accuracy


def main():
    torch.set_num_threads(1)
    base = g.Exported("torch_mlp")
    half = copy.deepcopy(base.model).half()
    x16 = base.data["x"].astype(np.float16)
    data = {"x": x16.astype(np.float32), "labels": base.data["labels"]}
    graphs = os.path.join(g.GRAPHS, NAME)
    fixtures = os.path.join(g.FIXTURES, NAME)
    os.makedirs(graphs, exist_ok=True)
    os.makedirs(fixtures, exist_ok=True)
    g.save_npz(os.path.join(graphs, "data.npz"), data)
    export(half, torch.from_numpy(x16[: g.EXPORT_BATCH]), graphs)
    for export_name in ("dynamo", "legacy"):
        inits = g.onnx_initializers(os.path.join(graphs, f"{export_name}.onnx"))
        for n, p in half.named_parameters():
            assert inits[n].dtype == np.float16, (export_name, n, inits[n].dtype)
            assert np.array_equal(inits[n], p.detach().numpy()), (export_name, n)

    gradients(half, data, "x", fixtures)

    # Mixed precision by hand: float32 masters, half compute, float32 accumulation.
    mlp_val = np.load(os.path.join(g.FIXTURES, "torch_mlp", "eval_data.npz"))
    val = {"x": mlp_val["x"].astype(np.float16).astype(np.float32), "labels": mlp_val["labels"]}
    m = copy.deepcopy(half).train()
    validations = [validation(m, val)]
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in m.named_parameters()}
    opt = torch.optim.SGD(masters.values(), **g.SGD)
    losses = []
    for window in range(g.STEPS):
        opt.zero_grad(set_to_none=False)
        for master in masters.values():
            master.grad = torch.zeros_like(master)
        for k in range(K):
            rows = (np.arange(MICRO) + 32 * window + MICRO * k) % g.N_SAMPLES
            xb, yb = torch.from_numpy(x16[rows]), torch.from_numpy(data["labels"][rows])
            m.zero_grad(set_to_none=True)
            loss = loss_of(m, xb, yb)
            (loss / K).backward()
            losses.append(loss.item())
            for n, p in m.named_parameters():
                masters[n].grad += p.grad.float()
        opt.step()
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(masters[n].half())
        validations.append(validation(m, val))
    g.save_npz(os.path.join(fixtures, "run_micro_sgd.npz"),
               {n: v.detach().numpy() for n, v in masters.items()})
    g.save_npz(os.path.join(fixtures, "eval_data.npz"), val)
    meta = {"optimizer": "sgd_micro", "rows": len(val["labels"]),
            "counted_labels": len(val["labels"]), "steps": g.STEPS,
            "losses": [l for l, _ in validations], "accuracies": [a for _, a in validations],
            "torch": torch.__version__}
    with open(os.path.join(fixtures, "eval.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{NAME}: loss {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} micro-steps")
    for name in GRADIENTS_ONLY:
        gradients_only(name)
        print(f"{name}_half: gradients")


if __name__ == "__main__":
    main()
