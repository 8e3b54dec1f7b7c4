#!/usr/bin/env bash
# Builds corpus/ (gitignored): ONNX models for the byte-identical round-trip test
# in tests/model_io.rs.
#
#   corpus/backend-data/...   every *.onnx shipped under onnx/backend/test/data in the
#                             onnx wheel, relative paths kept (~149 models)
#   corpus/generated/...      `python -m onnx.backend.test.cmd_tools generate-data`
#                             (the "simple" model test cases; in onnx 1.23.2 this command
#                             no longer writes node tests) plus every node test case
#                             from onnx.backend.test.case.node, written the same way
#                             (model.SerializeToString()) under generated/node/<name>/,
#                             with its data sets (test_data_set_<i>/input_<j>.pb,
#                             output_<j>.pb; tests/legalize_training.rs runs them)
#
# Uses a venv at .venv-corpus (gitignored). Idempotent: when corpus/.done records the
# same onnx version and layout, it exits at once. FORCE=1 rebuilds.
set -euo pipefail

ONNX_VERSION="1.23.2"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-corpus"
CORPUS="$ROOT/corpus"
STAMP="$CORPUS/.done"
PYTHON="${PYTHON:-python3}"

# The stamp also says which layout the corpus has ("+data": node cases with their data sets).
STAMP_TEXT="onnx==$ONNX_VERSION+data"

if [[ "${FORCE:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]]; then
  echo "corpus: up to date ($(find "$CORPUS" -name '*.onnx' | wc -l) models in $CORPUS)"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import onnx, sys; sys.exit(onnx.__version__ != '$ONNX_VERSION')" 2>/dev/null; then
  "$VENV/bin/python" -m pip install --quiet "onnx==$ONNX_VERSION"
fi

rm -rf "$CORPUS"
mkdir -p "$CORPUS/backend-data" "$CORPUS/generated"

# 1. Models shipped in the wheel, relative paths kept.
DATA_DIR="$("$VENV/bin/python" -c 'import os, onnx.backend.test as t; print(os.path.join(os.path.dirname(t.__file__), "data"))')"
(cd "$DATA_DIR" && find . -name '*.onnx' -print0) | while IFS= read -r -d '' rel; do
  mkdir -p "$CORPUS/backend-data/$(dirname "$rel")"
  cp "$DATA_DIR/$rel" "$CORPUS/backend-data/$rel"
done

# 2. Generated model test cases.
"$VENV/bin/python" -W ignore -m onnx.backend.test.cmd_tools generate-data -o "$CORPUS/generated"

# 3. Node test cases (the bulk: ~1900 small models covering every operator/attribute kind).
"$VENV/bin/python" -W ignore - "$CORPUS/generated/node" <<'PY'
import os, sys, warnings
warnings.simplefilter("ignore")
import numpy as np
np.seterr(all="ignore")
import onnx
from onnx import numpy_helper
import onnx.backend.test.case.node as node_test

out = sys.argv[1]
for case in node_test.collect_testcases():
    d = os.path.join(out, case.name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "model.onnx"), "wb") as f:
        f.write(case.model.SerializeToString())
    # The case's data sets, laid out as onnx's backend test data is:
    # test_data_set_<i>/input_<j>.pb and output_<j>.pb, named after the graph's values.
    for i, (inputs, outputs) in enumerate(case.data_sets or []):
        s = os.path.join(d, f"test_data_set_{i}")
        os.makedirs(s, exist_ok=True)
        for kind, values, infos in (("input", inputs, case.model.graph.input),
                                    ("output", outputs, case.model.graph.output)):
            for j, (value, info) in enumerate(zip(values, infos)):
                if isinstance(value, onnx.TensorProto):
                    proto = value
                elif info.type.HasField("map_type"):
                    proto = numpy_helper.from_dict(value, info.name)
                elif info.type.HasField("sequence_type"):
                    proto = numpy_helper.from_list(value, info.name)
                elif info.type.HasField("optional_type"):
                    proto = numpy_helper.from_optional(value, info.name)
                else:
                    proto = numpy_helper.from_array(np.asarray(value), info.name)
                with open(os.path.join(s, f"{kind}_{j}.pb"), "wb") as f:
                    f.write(proto.SerializeToString())
PY

echo "$STAMP_TEXT" > "$STAMP"
echo "corpus: $(find "$CORPUS" -name '*.onnx' | wc -l) models in $CORPUS"
