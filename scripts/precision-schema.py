"""Regenerates src/passes/precision/schema.rs from the installed onnx package's operator
schemas: for every default-domain op with a float32 type constraint, the first opset version
at which every type constraint admitting float32 also admits float16 (and bfloat16).

    .venv-ort/bin/python scripts/precision-schema.py > src/passes/precision/schema.rs
"""

import onnx
from onnx import defs


def main():
    by_op = {}
    for s in defs.get_all_schemas_with_history():
        if s.domain == "":
            by_op.setdefault(s.name, []).append(s)
    rows = []
    for name, schemas in sorted(by_op.items()):
        f16 = bf16 = None
        has_float = False
        for s in sorted(schemas, key=lambda s: s.since_version):
            floats = [
                set(tc.allowed_type_strs)
                for tc in s.type_constraints
                if "tensor(float)" in tc.allowed_type_strs
            ]
            if not floats:
                continue
            has_float = True
            if f16 is None and all("tensor(float16)" in a for a in floats):
                f16 = s.since_version
            if bf16 is None and all("tensor(bfloat16)" in a for a in floats):
                bf16 = s.since_version
        if has_float:
            rows.append((name, f16 or 0, bf16 or 0))
    print(f"//! Generated from the operator schemas of onnx {onnx.__version__} by")
    print("//! `scripts/precision-schema.py`: for every default-domain op with a float32 type")
    print("//! constraint, the first opset version at which *every* type constraint that admits")
    print("//! float32 also admits float16 (and bfloat16); 0: no version does. Schemas only ever add")
    print("//! types, so an op admits the type at opset N exactly when N >= that version.")
    print()
    print("/// (op type, float16 since, bfloat16 since).")
    print("pub(super) const HALF_SINCE: &[(&str, u16, u16)] = &[")
    for name, a, b in rows:
        print(f'    ("{name}", {a}, {b}),')
    print("];")


if __name__ == "__main__":
    main()
