"""A model that computes its own loss, as PyTorch users write one: torch_mlp with
`F.nll_loss(F.log_softmax(logits, dim=1), labels, weight=class_weight, ignore_index=3)` in
its forward, exported by both exporters (`rewrite --loss loss`, no `--loss-fn`). The dynamo
exporter writes LogSoftmax + NegativeLogLikelihoodLoss; the legacy one fuses the two into a
SoftmaxCrossEntropyLoss with the class weights. `class_weight` is a buffer (not trained).

Writes graphs/forward/torch_mlp_nll/{dynamo,legacy}.onnx and data.npz (torch_mlp's data), and
fixtures/forward/torch_mlp_nll/:
- grads.npz / grads64.npz: the loss on rows [0, 8) and torch autograd's gradient of every
  parameter, in float32 / float64 (`model.double()`);
- run_sgd.npz, run_adamw.npz: the parameters after 8 full-batch steps of 32 rows (step t:
  rows (arange(32) + 32 t) mod 64), generate.py's SGD and AdamW hyperparameters. The loss
  is the class-weighted mean over the batch's non-ignored labels, so K micro-batches match it
  only when the window is normalised by their weights (`--normalize weighted`).

Keys: the ONNX initializer names (the same in both exports). Run with the torch venv:

    .venv-torch/bin/python graphs/forward/own_loss_reference.py
"""
import copy
import os
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import generate as g  # noqa: E402

NAME = "torch_mlp_nll"
IGNORE = 3
NAMES = ["x", "labels"]


class WithLoss(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, 10))

    def forward(self, x, labels):
        log_probs = F.log_softmax(self.net(x), dim=1)
        return F.nll_loss(log_probs, labels, weight=self.class_weight, ignore_index=IGNORE)


def export(model, example, graphs):
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            copy.deepcopy(model).eval(), example, dynamo=True, optimize=False, verbose=False,
            input_names=NAMES, output_names=["loss"],
            dynamic_shapes={n: {0: batch} for n in NAMES},
        )
        proto = prog.model_proto
        g.strip_stack_traces(proto)
        onnx.save_model(proto, os.path.join(graphs, "dynamo.onnx"), save_as_external_data=False)
        torch.onnx.export(
            copy.deepcopy(model), example, os.path.join(graphs, "legacy.onnx"), dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
            opset_version=g.LEGACY_OPSET, input_names=NAMES, output_names=["loss"],
            dynamic_axes={n: {0: "batch"} for n in NAMES},
        )


def rows(data, sl):
    return torch.from_numpy(data["x"][sl]), torch.from_numpy(data["labels"][sl])


def parameters(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def run(model, data, make_optimizer):
    m = copy.deepcopy(model).train()
    opt = make_optimizer(m.parameters())
    for t in range(g.STEPS):
        x, y = rows(data, (np.arange(32) + 32 * t) % g.N_SAMPLES)
        opt.zero_grad(set_to_none=True)
        m(x, y).backward()
        opt.step()
    return parameters(m)


def main():
    torch.set_num_threads(1)
    base = g.Exported("torch_mlp")
    model = WithLoss(base.model)
    data = {k: base.data[k] for k in ("x", "labels")}
    graphs = os.path.join(g.GRAPHS, NAME)
    fixtures = os.path.join(g.FIXTURES, NAME)
    os.makedirs(graphs, exist_ok=True)
    os.makedirs(fixtures, exist_ok=True)
    g.save_npz(os.path.join(graphs, "data.npz"), data)
    export(model, rows(data, slice(0, g.EXPORT_BATCH)), graphs)
    names = set(parameters(model))
    for export_name in ("dynamo", "legacy"):
        inits = g.onnx_initializers(os.path.join(graphs, f"{export_name}.onnx"))
        missing = names - set(inits)
        assert not missing, f"{export_name}: parameters not kept by name: {missing}"
        for n, p in model.named_parameters():
            assert np.array_equal(inits[n], p.detach().numpy()), n

    for dtype, file in ((torch.float32, "grads.npz"), (torch.float64, "grads64.npz")):
        m = copy.deepcopy(model).to(dtype).train()
        x, y = rows(data, slice(0, g.GRAD_SAMPLES))
        loss = m(x.to(dtype), y)
        loss.backward()
        grads = {"loss": loss.detach().numpy()}
        grads.update({n: p.grad.numpy().copy() for n, p in m.named_parameters()})
        g.save_npz(os.path.join(fixtures, file), grads)
        if dtype == torch.float32:
            first_loss = float(loss)
    g.save_npz(os.path.join(fixtures, "run_sgd.npz"),
               run(model, data, lambda p: torch.optim.SGD(p, **g.SGD)))
    g.save_npz(os.path.join(fixtures, "run_adamw.npz"),
               run(model, data, lambda p: torch.optim.AdamW(p, **g.ADAMW)))
    ignored = int((data["labels"] == IGNORE).sum())
    print(f"{NAME}: loss {first_loss:.6f} on rows [0, 8); {ignored} of {len(data['labels'])} labels ignored")


if __name__ == "__main__":
    main()
