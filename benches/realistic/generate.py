#!/usr/bin/env python3
"""Makes the realistic benchmark's models (benches/realistic/models.py) into OUT/<name>/:

  forward.onnx   torch.onnx.export(model.train(), dynamo=False, training=TRAINING,
                 do_constant_folding=False, opset 17), batch dynamic: what onnx-ga's own
                 autodiff differentiates (`rewrite forward.onnx --loss-fn cross-entropy`)
  artifacts/     ONNX Runtime training artifacts from the same forward.onnx
                 (onnxruntime-training 1.19.2, generate_artifacts: every torch parameter
                 requires grad, mean cross-entropy, AdamW): training_model.onnx,
                 eval_model.onnx, optimizer_model.onnx, checkpoint
  init.pt        the torch state_dict the export was made from (peers.py's PyTorch column)
  data.npz       64 samples: `x` float32 (or `idx` int64 for the GPT) and `labels` int64
  meta.json      parameter counts and names, shapes, versions

The models are not committed (tens of MB): benches/realistic/run.sh runs this when they are
missing. Needs .venv-bench (benches/realistic/setup.sh).

Usage: .venv-bench/bin/python benches/realistic/generate.py [--out DIR] [--models a,b]
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import sys
import types
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.dont_write_bytecode = True
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime  # noqa: E402
import torch  # noqa: E402
import warnings  # noqa: E402

warnings.filterwarnings("ignore")
onnxruntime.set_default_logger_severity(3)


def training_package():
    """onnxruntime.training's __init__ imports ORTModule (and through it torch internals that
    torch 2.15 no longer has); artifacts and onnxblock need none of it: register a bare
    package whose __path__ is the installed folder."""
    if "onnxruntime.training" not in sys.modules:
        pkg = types.ModuleType("onnxruntime.training")
        pkg.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
        pkg.__package__ = "onnxruntime.training"
        sys.modules["onnxruntime.training"] = pkg
        onnxruntime.training = pkg
    from onnxruntime.training import artifacts, onnxblock

    return artifacts, onnxblock


import models  # noqa: E402

OPSET = 17
SAMPLES = 64


def make_data(name: str) -> dict[str, np.ndarray]:
    g = np.random.default_rng(1234)
    if name == "mlp":
        return {"x": g.standard_normal((SAMPLES, 784), dtype=np.float32),
                "labels": g.integers(0, 10, SAMPLES, dtype=np.int64)}
    if name.startswith("resnet"):
        return {"x": g.standard_normal((SAMPLES, 3, 32, 32), dtype=np.float32),
                "labels": g.integers(0, 10, SAMPLES, dtype=np.int64)}
    # GPT: random token streams, the label of each position is the next token.
    stream = g.integers(0, models.GPT_VOCAB, (SAMPLES, models.GPT_CONTEXT + 1), dtype=np.int64)
    return {"idx": np.ascontiguousarray(stream[:, :-1]), "labels": np.ascontiguousarray(stream[:, 1:])}


def relu_margin(model: torch.nn.Module, x: np.ndarray) -> float:
    """The smallest |input| of any ReLU of `model` on `x`: its forward in float64, train
    mode, on a copy. A ReLU input within float32 rounding of 0 may take the other side of the
    kink in another engine's sums, which moves a weight's gradient by far more than rounding
    (ResNet-8 BN on an AVX2 CPU: one at -7.2e-7, layer3.conv1.weight's gradient 9% of its
    largest element off torch's)."""
    seen = []
    relu = torch.nn.functional.relu

    def recording(t, inplace=False):
        seen.append(float(t.detach().abs().min()))
        return relu(t, inplace=inplace)

    inputs = torch.from_numpy(x)
    inputs = inputs.double() if inputs.is_floating_point() else inputs  # not token ids
    torch.nn.functional.relu = recording  # models.py calls F.relu
    try:
        with torch.no_grad():
            copy.deepcopy(model).double().train()(inputs)
    finally:
        torch.nn.functional.relu = relu
    return min(seen, default=float("inf"))


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """np.savez, byte-deterministic (fixed member timestamps)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def token_cross_entropy(onnxblock):
    """Mean cross-entropy over every token of logits [B, T, V] with labels [B, T]: ONNX's
    SoftmaxCrossEntropyLoss wants the classes on axis 1, so both are flattened first
    (logits to [B*T, V], labels to [B*T]), as models.loss_fn does for torch."""

    class TokenCrossEntropy(onnxblock.Block):
        def build(self, logits: str, labels: str = "labels"):
            g = self.base.graph
            out = next(o for o in g.output if o.name == logits)
            vocab = out.type.tensor_type.shape.dim[-1].dim_value
            labels_in = onnx.helper.make_tensor_value_info(labels, onnx.TensorProto.INT64, ["batch", models.GPT_CONTEXT])
            g.input.append(labels_in)
            g.initializer.append(onnx.numpy_helper.from_array(np.array([-1, vocab], np.int64), "tce.logits_shape"))
            g.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "tce.labels_shape"))
            g.node.append(onnx.helper.make_node("Reshape", [logits, "tce.logits_shape"], ["tce.logits2d"], name="tce.Reshape_logits"))
            g.node.append(onnx.helper.make_node("Reshape", [labels, "tce.labels_shape"], ["tce.labels1d"], name="tce.Reshape_labels"))
            g.node.append(onnx.helper.make_node("SoftmaxCrossEntropyLoss", ["tce.logits2d", "tce.labels1d"], ["loss", "tce.log_prob"],
                                                reduction="mean", name="tce.SoftmaxCrossEntropyLoss"))
            return "loss"

    return TokenCrossEntropy()


def generate(name: str, out: str) -> dict:
    artifacts, onnxblock = training_package()
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    model = models.make(name)
    input_name = models.MODELS[name][1]
    data = make_data(name)
    example = torch.from_numpy(data[input_name][:4])
    torch.save(model.state_dict(), os.path.join(d, "init.pt"))
    params = [n for n, _ in model.named_parameters()]
    n_params = sum(p.numel() for p in model.parameters())

    model.train()
    path = os.path.join(d, "forward.onnx")
    torch.onnx.export(
        model, (example,), path, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False, opset_version=OPSET,
        input_names=[input_name], output_names=["logits"],
        dynamic_axes={input_name: {0: "batch"}, "logits": {0: "batch"}},
    )
    proto = onnx.load(path)
    inits = {t.name for t in proto.graph.initializer}
    missing = [p for p in params if p not in inits]
    if missing:
        raise SystemExit(f"{name}: torch parameters not initializers of the export: {missing}")
    # The forward check: ORT (1.19.2) on the export agrees with torch.
    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = data[input_name][:8]
    with torch.no_grad():  # train mode (BatchNorm on batch statistics), on a copy
        ref = copy.deepcopy(model).train()(torch.from_numpy(x)).numpy()
    got = sess.run(None, {input_name: x})[0]
    err = float(np.abs(got - ref).max())
    if err > 1e-3:
        raise SystemExit(f"{name}: ORT forward differs from torch by {err}")

    # ORT's gradient of LayerNormalization reads the saved mean and inverse standard
    # deviation (its optional outputs 1 and 2), which torch's export leaves off: name them
    # for the artifacts' copy (the same math; forward.onnx stays as exported).
    for node in proto.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([node.output[0] + ".mean", node.output[0] + ".inv_std_dev"])
    loss = artifacts.LossType.CrossEntropyLoss if name != "gpt" else token_cross_entropy(onnxblock)
    frozen = [t for t in inits if t not in params]
    art = os.path.join(d, "artifacts")
    os.makedirs(art, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(art)  # onnxblock writes temporary files into the working directory
    try:
        artifacts.generate_artifacts(
            proto, requires_grad=params, frozen_params=frozen, loss=loss,
            optimizer=artifacts.OptimType.AdamW, artifact_directory=art,
        )
    finally:
        os.chdir(cwd)
    save_npz(os.path.join(d, "data.npz"), data)
    # torch's loss and gradients on one micro-batch (the bench's first micro-batch size),
    # train mode, on a copy: the bench checks its floor graph against them. The micro-batch
    # whose ReLU inputs keep farthest from 0 (`relu_margin`), so that rounding alone cannot
    # move a gradient across a kink; the first one without ReLUs.
    b = models.MODELS[name][2][0]
    margins = [relu_margin(model, data[input_name][i * b:(i + 1) * b]) for i in range(SAMPLES // b)]
    check = int(np.argmax(margins)) if np.isfinite(margins).any() else 0
    rows = slice(check * b, (check + 1) * b)
    ref = copy.deepcopy(model).train()
    loss0 = models.loss_fn(ref(torch.from_numpy(data[input_name][rows])), torch.from_numpy(data["labels"][rows]))
    loss0.backward()
    grads = {"loss": np.array(loss0.item(), np.float32), "micro_step": np.array(check, np.int64)}
    grads.update({n: p.grad.numpy().astype(np.float32) for n, p in ref.named_parameters()})
    save_npz(os.path.join(d, "grads.npz"), grads)
    meta = {
        "model": name,
        "input": input_name,
        "parameters": n_params,
        "parameter_tensors": len(params),
        "param_names": params,
        "frozen_initializers": sorted(frozen),
        "input_shape": list(data[input_name].shape),
        "forward_check_max_abs": err,
        "gradient_check_micro_step": check,
        "gradient_check_relu_margin": margins[check],
        "opset": OPSET,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime_training": onnxruntime.__version__,
        "forward_nodes": len(proto.graph.node),
    }
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "bench-realistic", "models"))
    ap.add_argument("--models", default=",".join(models.MODELS))
    a = ap.parse_args()
    # Absolute: generate() writes the artifacts after a chdir into their folder.
    a.out = os.path.abspath(a.out)
    torch.set_num_threads(1)
    for name in a.models.split(","):
        meta = generate(name, a.out)
        print(f"generate.py: {name}: {meta['parameters']:,} parameters in {meta['parameter_tensors']} tensors, "
              f"{meta['forward_nodes']} forward nodes -> {os.path.join(a.out, name)}", file=sys.stderr)


if __name__ == "__main__":
    main()
