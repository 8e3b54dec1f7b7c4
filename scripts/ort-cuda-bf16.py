"""Regenerates src/passes/precision/cuda_bf16.rs from ONNX Runtime's operator-kernel table.

    python3 scripts/ort-cuda-bf16.py OperatorKernels.md COMMIT > src/passes/precision/cuda_bf16.rs

OperatorKernels.md is docs/OperatorKernels.md of microsoft/onnxruntime (generated there from
the kernel registrations); COMMIT names the revision it was read at. From the section of the
CUDA execution provider, default domain, it keeps every (op, opset range) whose kernel admits
bfloat16 wherever it admits float32 (the rule schema.rs applies to ONNX's schemas). Only that
provider runs bfloat16 steps: ONNX Runtime's CPU provider has almost no bf16 kernels and, unlike
fp16, inserts no casts around the missing ones; tract has no bfloat16 type. So a bf16 node
without such a kernel does not load at all ("Provider type for Greater node ... is not set").
"""

import re
import sys

ROW = re.compile(r"^\|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|")
RANGE = re.compile(r"^\s*(?:(\d+)\+|\[(\d+),\s*(\d+)\]|(\d+))\s*$")


def cuda_default_domain(lines):
    """The table rows of the CUDA provider's default-domain section."""
    in_cuda = in_onnx = False
    for line in lines:
        if line.startswith("## "):
            in_cuda = "CUDAExecutionProvider" in line
            in_onnx = False
            continue
        if not in_cuda:
            continue
        if "**Operator Domain:**" in line:
            in_onnx = "*ai.onnx*" in line
            continue
        if in_onnx and ROW.match(line):
            yield line


def constraints(types):
    """{constraint name: set of types} of a 'Types Supported' cell."""
    out = {}
    for part in re.split(r"<br\s*/?>", types):
        m = re.match(r"\s*\*\*(\w+)\*\*\s*=\s*(.*)$", part)
        if m:
            out[m.group(1)] = {t.strip() for t in m.group(2).split(", ") if t.strip()}
    return out


def main():
    path, commit = sys.argv[1], sys.argv[2]
    rows, op = [], None
    for line in cuda_default_domain(open(path, encoding="utf-8")):
        name, _, versions, types = ROW.match(line).groups()
        name = name.strip()
        if name == "Op Name" or name.startswith("-"):
            continue  # the table's header
        if name:  # an empty name continues the op above with an older opset range
            op = name
        m = RANGE.match(versions)
        if op is None or not m:
            continue
        since, lo, hi, exact = m.groups()
        first, last = (int(since), 0) if since else (int(lo), int(hi)) if lo else (int(exact), int(exact))
        floats = [t for t in constraints(types).values() if "tensor(float)" in t]
        if floats and all("tensor(bfloat16)" in t for t in floats):
            rows.append((op, first, last))
    rows.sort()
    print("//! Generated from ONNX Runtime's docs/OperatorKernels.md (microsoft/onnxruntime at")
    print(f"//! {commit}) by `scripts/ort-cuda-bf16.py`: the opset ranges at which the")
    print("//! CUDA execution provider has a kernel admitting bfloat16 wherever it admits float32")
    print("//! (last 0: open-ended). Only that provider runs bf16 steps (see the script's header).")
    print()
    print("/// (op type, first opset, last opset or 0).")
    print("pub(super) const CUDA_BF16: &[(&str, u16, u16)] = &[")
    for op, first, last in rows:
        print(f'    ("{op}", {first}, {last}),')
    print("];")


if __name__ == "__main__":
    main()
