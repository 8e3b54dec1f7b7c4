#!/usr/bin/env bash
# The test command: installs what the tests need (ONNX Runtime 1.31.1 and onnx 1.23.2 in
# .venv-ort, the onnx backend-test corpus in corpus/), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

ORT_DYLIB_PATH="$(bash scripts/install-ort.sh | tail -n1)"
export ORT_DYLIB_PATH
bash scripts/fetch-corpus.sh >&2

cargo test --all-targets "$@"
