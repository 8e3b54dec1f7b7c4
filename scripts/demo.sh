#!/usr/bin/env bash
# The main job: rewrite a shipped ONNX Runtime training-artifacts folder into one
# gradient-accumulation training step (K=4 micro-batches per AdamW update), then train it
# 8 windows on standard ONNX Runtime. Installs ONNX Runtime 1.31.1 into .venv-ort first.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-mlp_ce_adamw}"
out="${OUT_DIR:-target/demo}"
mkdir -p "$out"

ORT_DYLIB_PATH="$(bash scripts/install-ort.sh | tail -n1)"
export ORT_DYLIB_PATH

cargo run --quiet -- inspect "graphs/$model"
cargo run --quiet -- rewrite "graphs/$model" -o "$out/$model.step.onnx" --accum-steps 4 --lr 0.01
cargo run --quiet -- train "$out/$model.step.onnx" --data "graphs/$model/data.npz" \
  --micro-batch 8 --steps 32 --metrics "$out/$model.metrics.jsonl" --save-state "$out/$model.state.npz"
echo "step model, metrics and final state are in $out/"
