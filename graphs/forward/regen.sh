#!/usr/bin/env bash
# Regenerate graphs/forward/<name>/ (dynamo.onnx, legacy.onnx, data.npz) and
# fixtures/forward/<name>/ (torch autograd gradients, torch optimizer runs, meta.json).
# Creates the torch venv on first use. The Rust tests read only the committed outputs.
#   graphs/forward/regen.sh                all models
#   graphs/forward/regen.sh torch_gpt      only the named models
# VENV overrides the venv location (default: <repo>/.venv-torch); PYTHON the interpreter used
# to create it (default: python3, >= 3.10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-torch}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$ROOT/graphs/forward/requirements.txt"

# One thread: deterministic references, and the machine is shared.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
"$VENV/bin/python" "$ROOT/graphs/forward/generate.py" "$@"
# torch_mlp_nll starts from torch_mlp's export: after it.
"$VENV/bin/python" "$ROOT/graphs/forward/own_loss_reference.py"
# torch_mlp_half too (torch_mlp after .half()).
"$VENV/bin/python" "$ROOT/graphs/forward/half_reference.py"
# Hugging Face architectures through torch's TorchScript exporter (legacy_<name>/).
"$VENV/bin/python" "$ROOT/graphs/forward/legacy_reference.py"
