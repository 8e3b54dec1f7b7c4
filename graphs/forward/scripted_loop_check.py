"""A TorchScript-scripted recurrent loop with an `if` on the step number, through onnx-ga.

    .venv-torch/bin/python graphs/forward/scripted_loop_check.py [--onnx-ga target/release/onnx-ga]

torch.jit.script keeps Python control flow, so the TorchScript exporter writes the loop over
`x.size(1)` as a Loop whose body holds an If (`t == 0`): control flow nested in control flow.
Exported twice: with the time axis fixed (the Loop's trip count is known: onnx-ga unrolls it
and each iteration decides its If) and with it dynamic (the Loop stays, its If on the step
number inside, differentiated by a backward Loop holding a backward If). For each, `rewrite
--pipeline autodiff` writes the gradient graph, ONNX Runtime runs it, and the loss and every
parameter's gradient are compared with torch autograd's on the same batch. Prints the worst
relative difference (a gradient's max |diff| over its max |torch gradient|) and exits 1 above
1e-5. A check to rerun by hand (torch is not needed by the tests); tests/autodiff_rules.rs
holds the same structures against finite differences.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import onnxruntime as ort
import torch


class ScriptedRnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.cell = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.zeros(x.size(0), 8)
        for t in range(x.size(1)):
            xt = self.inp(x[:, t])
            if t == 0:
                h = torch.tanh(xt)
            else:
                h = torch.tanh(xt + self.cell(h))
        return self.out(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--onnx-ga", default="target/release/onnx-ga")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = ScriptedRnn()
    x = torch.randn(6, 5, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    worst = 0.0
    with tempfile.TemporaryDirectory() as work:
        for kind, axes in [("time fixed", {0: "B"}), ("time dynamic", {0: "B", 1: "T"})]:
            forward = os.path.join(work, "forward.onnx")
            graph = os.path.join(work, "gradients.onnx")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    torch.jit.script(model), (x,), forward, dynamo=False, opset_version=17,
                    input_names=["x"], output_names=["logits"], dynamic_axes={"x": axes},
                    training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
            report = subprocess.run(
                [args.onnx_ga, "rewrite", forward, "--loss-fn", "cross-entropy",
                 "--pipeline", "autodiff", "-o", graph],
                check=True, capture_output=True, text=True)
            report = report.stdout + report.stderr
            options = ort.SessionOptions()
            options.log_severity_level = 3
            session = ort.InferenceSession(graph, options)
            names = [o.name for o in session.get_outputs()]
            outs = dict(zip(names, session.run(None, {"x": x.numpy(), "labels": y.numpy()})))
            rel = abs(float(outs["loss"]) - loss.item()) / abs(loss.item())
            for name, g in grads.items():
                ours = outs[f"{name}_grad"]
                rel = max(rel, float(np.abs(ours - g).max() / np.abs(g).max()))
            worst = max(worst, rel)
            loops = [line.strip() for line in report.splitlines() if line.startswith("autodiff(")]
            print(f"{kind}: worst relative difference from torch {rel:.1e}")
            for line in loops:
                print(f"  {line}")
    sys.exit(0 if worst <= 1e-5 else 1)


if __name__ == "__main__":
    main()
