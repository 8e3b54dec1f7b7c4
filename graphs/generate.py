#!/usr/bin/env python3
"""Generate the ONNX Runtime on-device-training artifacts used by onnx-ga's tests.

For every model below this script
  1. builds a small forward graph by hand with onnx.helper (no torch), with seeded weights,
  2. calls onnxruntime.training.artifacts.generate_artifacts, which writes
     graphs/<name>/{training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint},
  3. writes graphs/<name>/data.npz: a deterministic, learnable synthetic dataset with one
     array per data input of the training graph (named exactly like the graph input,
     first axis = sample),
then prints op counts per folder and asserts that the union of ops covers the
training-only ops listed in DESIGN.md section 6.

Requires the pins in graphs/requirements.txt (onnxruntime-training-cpu 1.19.2, onnx 1.16.2,
numpy 1.26.4). Run `graphs/regen.sh` or `python graphs/generate.py [name ...]`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.dont_write_bytecode = True  # no __pycache__ next to the checked-in scripts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_common import save_npz  # noqa: E402  (also registers onnxruntime.training without torch)
from onnxruntime.training import artifacts, onnxblock  # noqa: E402
from onnxruntime.training.onnxblock import _graph_utils  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OPSET = 17
IR_VERSION = 8  # what opset 17 implies; ORT 1.19 accepts up to IR 10
N_SAMPLES = 64

# Ops that standard ONNX Runtime lacks and that the generated graphs must exercise
# (DESIGN.md section 6). Keys are (domain, op_type).
REQUIRED_OPS = [
    ("com.microsoft", "InPlaceAccumulatorV2"),
    ("com.microsoft", "ReluGrad"),
    ("com.microsoft", "SigmoidGrad"),
    ("com.microsoft", "GeluGrad"),
    ("com.microsoft", "SoftmaxGrad_13"),
    ("com.microsoft", "Scale"),
    ("com.microsoft", "SoftmaxCrossEntropyLossGrad"),
    ("com.microsoft", "LayerNormalizationGrad"),
    ("com.microsoft", "ConvGrad"),
    ("com.microsoft", "BatchNormInternal"),
    ("com.microsoft", "BatchNormalizationGrad"),
    ("com.microsoft", "AdamWOptimizer"),
    ("com.microsoft", "SGDOptimizerV2"),
    ("", "MaxPoolGrad"),
]


# ----------------------------------------------------------------------------- helpers


class Builder:
    """Collects nodes, initializers and trainable/frozen parameter names for one model."""

    def __init__(self, name: str, seed: int):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.trainable: list[str] = []
        self.frozen: list[str] = []

    def param(self, name: str, shape, std: float | None = None, value: float | None = None, frozen=False) -> str:
        if value is not None:
            arr = np.full(shape, value, dtype=np.float32)
        else:
            if std is None:  # Kaiming-uniform-ish on fan_in = prod(shape[1:])
                fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
                std = 1.0 / np.sqrt(fan_in)
            arr = (self.rng.standard_normal(shape) * std).astype(np.float32)
        self.inits.append(numpy_helper.from_array(arr, name))
        (self.frozen if frozen else self.trainable).append(name)
        return name

    def const(self, name: str, arr: np.ndarray) -> str:
        """A constant initializer that is not a parameter (stays embedded in the graph)."""
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def node(self, op: str, inputs, outputs, domain: str = "", name: str | None = None, **attrs):
        outputs = [outputs] if isinstance(outputs, str) else list(outputs)
        self.nodes.append(
            helper.make_node(op, list(inputs), outputs, name=name or f"{op}_{len(self.nodes)}", domain=domain, **attrs)
        )
        return outputs[0] if len(outputs) == 1 else outputs

    def model(self, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, inputs, outputs, self.inits)
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
        m = helper.make_model(graph, opset_imports=opsets, producer_name="onnx-ga/graphs/generate.py")
        m.ir_version = IR_VERSION
        onnx.checker.check_model(m)
        return m


def fin(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


# ----------------------------------------------------------------------------- models
# Each builder returns (forward ModelProto, trainable names, frozen names, loss, optimizer,
# data dict). Data dicts hold the *forward* inputs; the label/target array is named like
# the input the loss block adds ("labels" for CrossEntropyLoss, "target" otherwise).


def teacher_labels(rng, x2d: np.ndarray, classes: int) -> np.ndarray:
    w = rng.standard_normal((x2d.shape[1], classes)).astype(np.float32)
    return np.argmax(x2d @ w, axis=1).astype(np.int64)


def mlp_ce_adamw():
    b = Builder("mlp_ce_adamw", seed=1)
    h = b.node("Gemm", ["input", b.param("fc1.weight", [32, 16]), b.param("fc1.bias", [32], std=0.1)], "fc1", transB=1)
    h = b.node("Relu", [h], "relu1")
    b.node("Gemm", [h, b.param("fc2.weight", [10, 32]), b.param("fc2.bias", [10], std=0.1)], "logits", transB=1)
    m = b.model([fin("input", ["batch", 16])], [fin("logits", ["batch", 10])])
    rng = np.random.default_rng(101)
    x = rng.standard_normal((N_SAMPLES, 16)).astype(np.float32)
    data = {"input": x, "labels": teacher_labels(rng, x, 10)}
    return m, b, artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW, data


def mlp_mse_sgd():
    b = Builder("mlp_mse_sgd", seed=2)
    h = b.node("MatMul", ["input", b.param("fc1.weight", [16, 24], std=0.25)], "fc1_mm")
    h = b.node("Add", [h, b.param("fc1.bias", [24], std=0.1)], "fc1")
    h = b.node("Sigmoid", [h], "sig1")
    h = b.node("MatMul", [h, b.param("fc2.weight", [24, 4], std=0.2)], "fc2_mm")
    b.node("Add", [h, b.param("fc2.bias", [4], std=0.1)], "output")
    m = b.model([fin("input", ["batch", 16])], [fin("output", ["batch", 4])])
    rng = np.random.default_rng(102)
    x = rng.standard_normal((N_SAMPLES, 16)).astype(np.float32)
    wt = (rng.standard_normal((16, 4)) * 0.5).astype(np.float32)
    y = np.tanh(x @ wt).astype(np.float32)
    data = {"input": x, "target": y}
    return m, b, artifacts.LossType.MSELoss, artifacts.OptimType.SGD, data


def cnn_bn():
    b = Builder("cnn_bn", seed=3)
    h = b.node(
        "Conv",
        ["input", b.param("conv.weight", [4, 3, 3, 3]), b.param("conv.bias", [4], std=0.1)],
        "conv",
        kernel_shape=[3, 3],
        pads=[1, 1, 1, 1],
        strides=[1, 1],
    )
    h = b.node(
        "BatchNormalization",
        [
            h,
            b.param("bn.weight", [4], value=1.0),
            b.param("bn.bias", [4], value=0.0),
            b.param("bn.running_mean", [4], value=0.0, frozen=True),
            b.param("bn.running_var", [4], value=1.0, frozen=True),
        ],
        "bn",
        epsilon=1e-5,
        momentum=0.9,
    )
    h = b.node("Relu", [h], "relu")
    h = b.node("MaxPool", [h], "pool", kernel_shape=[3, 3], strides=[2, 2])  # 8x8 -> 3x3, overlapping
    h = b.node("Flatten", [h], "flat", axis=1)
    b.node("Gemm", [h, b.param("fc.weight", [4, 36]), b.param("fc.bias", [4], std=0.1)], "logits", transB=1)
    m = b.model([fin("input", ["batch", 3, 8, 8])], [fin("logits", ["batch", 4])])
    rng = np.random.default_rng(103)
    x = rng.standard_normal((N_SAMPLES, 3, 8, 8)).astype(np.float32)
    # Label: which channel/quadrant summary a random teacher prefers.
    feats = x.reshape(N_SAMPLES, 3, 2, 4, 2, 4).mean(axis=(3, 5)).reshape(N_SAMPLES, 12)
    data = {"input": x, "labels": teacher_labels(rng, feats, 4)}
    return m, b, artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW, data


def transformer_block():
    T, D, H, C = 4, 8, 16, 4
    b = Builder("transformer_block", seed=4)

    def layer_norm(x, prefix):
        y, _, _ = b.node(
            "LayerNormalization",
            [x, b.param(f"{prefix}.weight", [D], value=1.0), b.param(f"{prefix}.bias", [D], value=0.0)],
            [f"{prefix}.out", f"{prefix}.mean", f"{prefix}.inv_std"],
            axis=-1,
            epsilon=1e-5,
        )
        return y

    x = "input"
    h = layer_norm(x, "ln1")
    q = b.node("MatMul", [h, b.param("attn.wq", [D, D])], "q")
    k = b.node("MatMul", [h, b.param("attn.wk", [D, D])], "k")
    v = b.node("MatMul", [h, b.param("attn.wv", [D, D])], "v")
    kt = b.node("Transpose", [k], "kT", perm=[0, 2, 1])
    s = b.node("MatMul", [q, kt], "scores_raw")
    s = b.node("Mul", [s, b.const("attn.scale", np.array(1.0 / np.sqrt(D), dtype=np.float32))], "scores")
    p = b.node("Softmax", [s], "probs", axis=-1)
    a = b.node("MatMul", [p, v], "attn")
    a = b.node("MatMul", [a, b.param("attn.wo", [D, D])], "attn_proj")
    r1 = b.node("Add", [x, a], "resid1")
    h = layer_norm(r1, "ln2")
    h = b.node("MatMul", [h, b.param("mlp.fc1.weight", [D, H])], "mlp_fc1_mm")
    h = b.node("Add", [h, b.param("mlp.fc1.bias", [H], std=0.1)], "mlp_fc1")
    h = b.node("Gelu", [h], "mlp_gelu", domain="com.microsoft")
    h = b.node("MatMul", [h, b.param("mlp.fc2.weight", [H, D])], "mlp_fc2_mm")
    h = b.node("Add", [h, b.param("mlp.fc2.bias", [D], std=0.1)], "mlp_fc2")
    r2 = b.node("Add", [r1, h], "resid2")
    pooled = b.node("ReduceMean", [r2], "pooled", axes=[1], keepdims=0)
    b.node("Gemm", [pooled, b.param("head.weight", [C, D]), b.param("head.bias", [C], std=0.1)], "logits", transB=1)
    m = b.model([fin("input", ["batch", T, D])], [fin("logits", ["batch", C])])
    rng = np.random.default_rng(104)
    x = rng.standard_normal((N_SAMPLES, T, D)).astype(np.float32)
    # Label depends on token interactions: teacher on [mean over T, first token * last token].
    feats = np.concatenate([x.mean(axis=1), x[:, 0] * x[:, -1]], axis=1)
    data = {"input": x, "labels": teacher_labels(rng, feats, C)}
    return m, b, artifacts.LossType.CrossEntropyLoss, artifacts.OptimType.AdamW, data


BCE_WEIGHT_DECAY = 0.01


def bce_logits():
    b = Builder("bce_logits", seed=5)
    b.node("Gemm", ["input", b.param("fc.weight", [4, 16]), b.param("fc.bias", [4], std=0.1)], "logits", transB=1)
    m = b.model([fin("input", ["batch", 16])], [fin("logits", ["batch", 4])])
    rng = np.random.default_rng(105)
    x = rng.standard_normal((N_SAMPLES, 16)).astype(np.float32)
    wt = rng.standard_normal((16, 4)).astype(np.float32)
    y = (x @ wt > 0).astype(np.float32)  # multi-label, linearly separable
    data = {"input": x, "target": y}
    # AdamW with non-zero weight decay so the decay term of AdamWOptimizer is exercised.
    optim = onnxblock.optim.AdamW(weight_decay=BCE_WEIGHT_DECAY)
    return m, b, artifacts.LossType.BCEWithLogitsLoss, optim, data


def l1_loss():
    b = Builder("l1_loss", seed=6)
    b.node("Gemm", ["input", b.param("fc.weight", [2, 16]), b.param("fc.bias", [2], std=0.1)], "output", transB=1)
    m = b.model([fin("input", ["batch", 16])], [fin("output", ["batch", 2])])
    rng = np.random.default_rng(106)
    x = rng.standard_normal((N_SAMPLES, 16)).astype(np.float32)
    wt = (rng.standard_normal((16, 2)) * 0.5).astype(np.float32)
    y = (x @ wt + 0.3).astype(np.float32)
    data = {"input": x, "target": y}
    return m, b, artifacts.LossType.L1Loss, artifacts.OptimType.SGD, data


MODELS = {
    "mlp_ce_adamw": mlp_ce_adamw,
    "mlp_mse_sgd": mlp_mse_sgd,
    "cnn_bn": cnn_bn,
    "transformer_block": transformer_block,
    "bce_logits": bce_logits,
    "l1_loss": l1_loss,
}


# ----------------------------------------------------------------------------- driver


def op_counts(path: str) -> collections.Counter:
    m = onnx.load(path)
    c = collections.Counter()

    def walk(g):
        for n in g.node:
            c[(n.domain or "", n.op_type)] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                for sg in a.graphs:
                    walk(sg)

    walk(m.graph)
    return c


@contextlib.contextmanager
def quiet_native_stderr():
    """ORT's gradient builder logs every graph transformer at INFO level to fd 2 (the
    default logger severity does not reach it). Swallow fd 2, replay it on failure."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            tmp.seek(0)
            sys.stderr.write(tmp.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def generate(name: str) -> dict[str, collections.Counter]:
    out = os.path.join(HERE, name)
    os.makedirs(out, exist_ok=True)
    model, b, loss, optim, data = MODELS[name]()
    # onnxblock names loss nodes/outputs with a process-global counter (onnx::loss::N).
    # Reset it so each model's names do not depend on which models were generated before.
    _graph_utils._GRAPH_TOKEN = 0
    with quiet_native_stderr():
        artifacts.generate_artifacts(
            model,
            requires_grad=b.trainable,
            frozen_params=b.frozen or None,
            loss=loss,
            optimizer=optim,
            artifact_directory=out,
        )

    # data.npz: arrays named exactly like the training graph's data inputs, in graph order.
    train = onnx.load(os.path.join(out, "training_model.onnx"))
    params = set(b.trainable) | set(b.frozen)
    data_inputs = [
        i.name for i in train.graph.input
        if i.name not in params and not i.name.endswith(".accumulation.buffer") and i.name != "lazy_reset_grad"
    ]
    assert sorted(data_inputs) == sorted(data), (name, data_inputs, list(data))
    for n in data_inputs:
        assert data[n].shape[0] == N_SAMPLES
    save_npz(os.path.join(out, "data.npz"), {n: data[n] for n in data_inputs})

    return {f: op_counts(os.path.join(out, f"{f}_model.onnx")) for f in FILES}


FILES = ("training", "eval", "optimizer")


def main(argv: list[str]) -> None:
    names = argv or list(MODELS)
    where: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for name in names:
        per_file = generate(name)
        ops = sorted(set().union(*per_file.values()))
        print(f"== {name}: op counts in training / eval / optimizer model")
        for domain, op in ops:
            cols = " ".join(f"{per_file[f][(domain, op)]:5d}" for f in FILES)
            print(f"   {domain or 'ai.onnx':14s} {op:30s}{cols}")
            where[(domain, op)].append(name)
    print("== training-only ops of DESIGN.md section 6 -> models using them")
    for key in REQUIRED_OPS:
        print(f"   {key[0] or 'ai.onnx':14s} {key[1]:30s} {', '.join(where.get(key, [])) or 'MISSING'}")
    if argv:
        return
    missing = [k for k in REQUIRED_OPS if k not in where]
    assert not missing, f"missing training-only ops: {missing}"
    print("== all covered")


if __name__ == "__main__":
    main(sys.argv[1:])
