"""Regenerates the test inputs in this folder (run with the onnx venv of
scripts/fetch-corpus.sh: `.venv-corpus/bin/python tests/data/model_io/generate.py`).

all_fields_<k>.onnx   every field of every message of onnx.proto set to a non-default
                      value (recursively, to a depth limit), with oneof member k % n
                      chosen; written by the official protobuf runtime, so decode + encode
                      must reproduce them byte for byte. Variants 3..5 put a TypeProto
                      `denotation` (6) before optional_type (9) / sparse_tensor_type (8) /
                      opaque_type (7), the case prost writes out of order.
ext/model.onnx        a small model saved by onnx.save_model(save_as_external_data=True)
ext/weights.bin       (W: 32x32 float32 -> weights.bin; the bias stays inline)
inline.onnx           the same model with all data inline
"""
import os
import sys

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor as F
from onnx import helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))


def fill(msg, depth, choice):
    chosen = {o.name: o.fields[choice % len(o.fields)].name for o in msg.DESCRIPTOR.oneofs}
    for f in msg.DESCRIPTOR.fields:
        if f.containing_oneof is not None and chosen[f.containing_oneof.name] != f.name:
            continue
        repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == F.LABEL_REPEATED
        if f.type == F.TYPE_MESSAGE:
            if depth > 0:
                sub = getattr(msg, f.name).add() if repeated else getattr(msg, f.name)
                fill(sub, depth - 1, choice)
            continue
        if f.type == F.TYPE_ENUM:
            values = [f.enum_type.values[-1].number, f.enum_type.values[0].number]
        elif f.type == F.TYPE_STRING:
            values = ["s_" + f.name, ""]
        elif f.type == F.TYPE_BYTES:
            values = [b"\x00\xff", b""]
        elif f.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            values = [1.5, -0.0]
        elif f.type in (F.TYPE_UINT64, F.TYPE_UINT32):
            values = [2**63 + 5, 0]
        else:
            # Negative ints are 10-byte varints; 0 checks that presence is kept.
            values = [-1, 0]
        if repeated:
            getattr(msg, f.name).extend(values)
        else:
            setattr(msg, f.name, values[1] if f.type in (F.TYPE_INT64, F.TYPE_INT32) else values[0])


def main():
    for k in range(6):
        m = onnx.ModelProto()
        fill(m, 5, k)
        m.ir_version = 10
        with open(os.path.join(HERE, f"all_fields_{k}.onnx"), "wb") as f:
            f.write(m.SerializeToString())

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.arange(32, dtype=np.float32), "B")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "B"], ["Y"], name="gemm")],
        "tiny",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [1, 32])],
        [w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, os.path.join(HERE, "inline.onnx"))
    os.makedirs(os.path.join(HERE, "ext"), exist_ok=True)
    onnx.save_model(
        model,
        os.path.join(HERE, "ext", "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=1024,
    )


if __name__ == "__main__":
    sys.exit(main())
