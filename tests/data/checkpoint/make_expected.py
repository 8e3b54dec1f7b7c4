#!/usr/bin/env python3
"""Write the reference data for tests/checkpoint.rs, using ONNX Runtime's own training API
(onnxruntime-training-cpu 1.19.2) as the independent reader of checkpoints.

Run with the generator venv after graphs/ has been (re)generated:
    .venv-gen/bin/python tests/data/checkpoint/make_expected.py

Writes into this folder:
  expected_<model>.json   for every graphs/<model>/checkpoint: per parameter its shape,
                          trainable flag, first values and sum as ORT's CheckpointState
                          reads them, plus the model's data input names (data.npz keys).
  adamw_step1.ckpt        graphs/mlp_ce_adamw after one train_step + optimizer step on the
                          first 8 samples, saved with the optimizer state and three user
                          properties; expected_adamw_step1.json holds its parameters, the
                          gradients of that step and the AdamW first-step momentums they
                          imply (m = (1-b1) g, v = (1-b2) g^2, b1 = 0.9, b2 = 0.999, in float32).
  nominal.ckpt            a nominal checkpoint (generate_artifacts(nominal_checkpoint=True))
                          of a one-Gemm model: trainable `w`, frozen `b`.
  external.ckpt(.data)    a version-2 checkpoint whose tensors live in the external data
                          file, built with ORT's generated FlatBuffers Python bindings; the
                          script asserts that ORT loads the expected values from it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(ROOT, "graphs"))
import gen_common  # noqa: E402,F401  (registers onnxruntime.training without torch)

import flatbuffers  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs import (  # noqa: E402
    Checkpoint as FbCheckpoint,
    ModuleState as FbModuleState,
    Tensor as FbTensor,
)
from onnxruntime.training import artifacts  # noqa: E402
from onnxruntime.training.api import CheckpointState, Module, Optimizer  # noqa: E402

MODELS = ["mlp_ce_adamw", "mlp_mse_sgd", "cnn_bn", "transformer_block", "bce_logits", "l1_loss"]
N_HEAD = 4


def summary(arr: np.ndarray) -> dict:
    flat = np.asarray(arr).reshape(-1)
    return {
        "shape": [int(d) for d in np.asarray(arr).shape],
        "dtype": str(flat.dtype),
        "head": [float(x) for x in flat[:N_HEAD]],
        "sum": float(flat.astype(np.float64).sum()),
        "abs_sum": float(np.abs(flat.astype(np.float64)).sum()),
    }


def parameters(state: CheckpointState) -> dict:
    out = {}
    for name, param in state.parameters:
        entry = summary(param.data)
        entry["trainable"] = bool(param.requires_grad)
        out[name] = entry
    return dict(sorted(out.items()))


def write_json(name: str, obj) -> None:
    with open(os.path.join(HERE, name), "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def graph_models() -> None:
    for model in MODELS:
        d = os.path.join(ROOT, "graphs", model)
        state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
        data_inputs = list(np.load(os.path.join(d, "data.npz")).keys())
        write_json(f"expected_{model}.json", {"data_inputs": data_inputs, "parameters": parameters(state)})


def adamw_step1() -> None:
    d = os.path.join(ROOT, "graphs", "mlp_ce_adamw")
    state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
    module = Module(os.path.join(d, "training_model.onnx"), state, os.path.join(d, "eval_model.onnx"))
    optimizer = Optimizer(os.path.join(d, "optimizer_model.onnx"), module)
    data = np.load(os.path.join(d, "data.npz"))
    feeds = [np.array(data[name][:8]) for name in module.input_names()]
    module.train()
    module(*feeds)
    grads = {name: np.array(p.grad) for name, p in state.parameters if p.requires_grad}
    optimizer.step()
    state.properties["epoch"] = 3
    state.properties["best_loss"] = 0.5
    state.properties["tag"] = "hello"
    out = os.path.join(HERE, "adamw_step1.ckpt")
    CheckpointState.save_checkpoint(state, out, include_optimizer_state=True)

    reloaded = CheckpointState.load_checkpoint(out)
    momentums = {}
    # ORT's AdamW kernel works in float32: (1 - beta) is 1.0f - 0.9f = 0.100000024 and
    # 1.0f - 0.999f = 0.0009999871, not 0.1 and 0.001.
    one_minus_b1 = np.float32(1) - np.float32(0.9)
    one_minus_b2 = np.float32(1) - np.float32(0.999)
    for name, g in sorted(grads.items()):
        g32 = g.astype(np.float32)
        momentums[name] = {
            "grad": summary(g32),
            "momentum0": summary(one_minus_b1 * g32),
            "momentum1": summary(one_minus_b2 * (g32 * g32)),
        }
    write_json(
        "expected_adamw_step1.json",
        {
            "parameters": parameters(reloaded),
            "optimizer": {"group": "group0", "step": 1, "initial_learning_rate": 0.001, "states": momentums},
            "properties": {"epoch": 3, "best_loss": 0.5, "tag": "hello"},
        },
    )


def nominal() -> None:
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    b = numpy_helper.from_array(np.array([0.5, -0.5], dtype=np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with tempfile.TemporaryDirectory() as tmp:
        artifacts.generate_artifacts(
            model,
            requires_grad=["w"],
            frozen_params=["b"],
            loss=artifacts.LossType.MSELoss,
            optimizer=artifacts.OptimType.AdamW,
            artifact_directory=tmp,
            nominal_checkpoint=True,
        )
        shutil.copyfile(os.path.join(tmp, "nominal_checkpoint"), os.path.join(HERE, "nominal.ckpt"))


def external() -> None:
    """Tensors `a` (float32 [2,3]) at offset 0 and `c` (int64 [2], frozen) at offset 64 of
    external.ckpt.data; `s` (float32 scalar, frozen) inline."""
    a = (np.arange(6, dtype=np.float32) * 1.5 - 2.0).reshape(2, 3)
    c = np.array([7, -8], dtype=np.int64)
    s = np.array(0.25, dtype=np.float32)
    data = bytearray(96)
    data[0:24] = a.tobytes()
    data[64:80] = c.tobytes()

    b = flatbuffers.Builder(256)

    def tensor(name, arr, dtype, offset=None):
        n = b.CreateString(name)
        FbTensor.StartDimsVector(b, arr.ndim)
        for dim in reversed(arr.shape):
            b.PrependInt64(dim)
        dims = b.EndVector()
        raw = None if offset is not None else b.CreateByteVector(arr.tobytes())
        FbTensor.Start(b)
        FbTensor.AddName(b, n)
        FbTensor.AddDims(b, dims)
        FbTensor.AddDataType(b, dtype)
        if raw is not None:
            FbTensor.AddRawData(b, raw)
        else:
            FbTensor.AddExternalDataOffset(b, offset)
        return FbTensor.End(b)

    def vector(items, start):
        start(b, len(items))
        for t in reversed(items):
            b.PrependUOffsetTRelative(t)
        return b.EndVector()

    trainable = [tensor("a", a, TensorProto.FLOAT, 0)]
    frozen = [tensor("c", c, TensorProto.INT64, 64), tensor("s", s, TensorProto.FLOAT)]
    tv = vector(trainable, FbModuleState.StartRequiresGradParamsVector)
    fv = vector(frozen, FbModuleState.StartFrozenParamsVector)
    FbModuleState.Start(b)
    FbModuleState.AddRequiresGradParams(b, tv)
    FbModuleState.AddFrozenParams(b, fv)
    FbModuleState.AddHasExternalData(b, True)
    ms = FbModuleState.End(b)
    FbCheckpoint.Start(b)
    FbCheckpoint.AddVersion(b, 2)
    FbCheckpoint.AddModuleState(b, ms)
    b.Finish(FbCheckpoint.End(b), file_identifier=b"ODTC")

    path = os.path.join(HERE, "external.ckpt")
    with open(path, "wb") as f:
        f.write(b.Output())
    with open(path + ".data", "wb") as f:
        f.write(bytes(data))

    # ORT must read the same values back (this is what fixes the `<checkpoint>.data` convention).
    state = CheckpointState.load_checkpoint(path)
    np.testing.assert_array_equal(state.parameters["a"].data, a)
    np.testing.assert_array_equal(state.parameters["c"].data, c)
    np.testing.assert_array_equal(state.parameters["s"].data, s)
    assert state.parameters["a"].requires_grad and not state.parameters["c"].requires_grad


if __name__ == "__main__":
    graph_models()
    adamw_step1()
    nominal()
    external()
    print("wrote", sorted(os.listdir(HERE)))
