#!/usr/bin/env bash
# Makes the realistic benchmark's venv (default <repo>/.venv-bench): torch and
# onnxruntime-training-cpu 1.19.2 (benches/realistic/requirements.txt). Idempotent.
# VENV overrides the location, PYTHON the interpreter that makes it (3.11).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${VENV:-$root/.venv-bench}"
python="${PYTHON:-python3}"
req="$root/benches/realistic/requirements.txt"
stamp="$venv/.requirements.txt"
if [[ -x "$venv/bin/python" && -f "$stamp" ]] && cmp -s "$req" "$stamp"; then
    exit 0
fi
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet -r "$req"
cp "$req" "$stamp"
"$venv/bin/python" - <<'PY'
import torch, onnxruntime, onnx, numpy
print(f"setup.sh: torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}, numpy {numpy.__version__}")
PY
