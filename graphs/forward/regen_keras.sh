#!/usr/bin/env bash
# Regenerate graphs/forward/keras_<name>/ (keras.onnx, default.onnx, data.npz) and
# fixtures/forward/keras_<name>/ (Keras GradientTape gradients, Keras SGD / Adam runs, meta.json).
# Creates the Keras venv on first use. The Rust tests (tests/autodiff_keras.rs) read only the
# committed outputs; CI never runs this.
#   graphs/forward/regen_keras.sh                both models
#   graphs/forward/regen_keras.sh keras_cnn      only the named models
# VENV overrides the venv location (default: <repo>/.venv-keras); PYTHON the interpreter used
# to create it (default: python3, 3.9 to 3.11 for TensorFlow 2.15).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-keras}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/graphs/forward/requirements-keras.txt"

# One thread (the script also pins TF's thread pools): deterministic references.
export OMP_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1 PYTHONDONTWRITEBYTECODE=1
"$VENV/bin/python" "$ROOT/graphs/forward/generate_keras.py" "$@"
