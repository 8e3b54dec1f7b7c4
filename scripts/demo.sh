#!/usr/bin/env bash
# The main job: rewrite a shipped ONNX Runtime training-artifacts folder into one
# gradient-accumulation training step (K=4 micro-batches per AdamW update), then train it
# 8 windows on standard ONNX Runtime and draw its loss. Installs ONNX Runtime 1.31.1 into
# .venv-ort first.
#
# It builds the release binary (the one `cargo install --path .` installs, from the same
# target/release), with cargo's progress shown: the first build takes a while (README,
# "Install"); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-mlp_ce_adamw}"
out="${OUT_DIR:-target/demo}"
mkdir -p "$out"

ORT_DYLIB_PATH="$(bash scripts/install-ort.sh | tail -n1)"
export ORT_DYLIB_PATH

echo "== cargo build --release (the first build compiles every dependency)" >&2
cargo build --release --locked
bin=target/release/onnx-ga

"$bin" inspect "graphs/$model"
"$bin" rewrite "graphs/$model" -o "$out/$model.step.onnx" --accum-steps 4 --lr 0.01
"$bin" inspect "$out/$model.step.onnx"
"$bin" train "$out/$model.step.onnx" --data "graphs/$model/data.npz" \
  --micro-batch 8 --steps 32 --metrics "$out/$model.metrics.jsonl" \
  --save-state "$out/$model.state.npz" --plot "$out/$model.loss.png"
echo "step model, metrics, loss plot and final state are in $out/"
