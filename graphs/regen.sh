#!/usr/bin/env bash
# Regenerate graphs/<name>/ (ORT training artifacts + data.npz) and fixtures/<name>/
# (reference runs of ORT's training API). Creates the generator venv on first use.
#   graphs/regen.sh            all models
#   graphs/regen.sh cnn_bn     only the named models
# VENV overrides the venv location (default: <repo>/.venv-gen); PYTHON the interpreter used
# to create it (default: python3; onnxruntime-training-cpu 1.19.2 has wheels for 3.8-3.12).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-gen}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/graphs/requirements.txt"

export PYTHONDONTWRITEBYTECODE=1
"$VENV/bin/python" "$ROOT/graphs/generate.py" "$@"
"$VENV/bin/python" "$ROOT/fixtures/generate.py" "$@"
