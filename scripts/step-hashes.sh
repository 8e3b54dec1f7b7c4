#!/usr/bin/env bash
# Writes the reference steps (every shipped graph under 9 pipelines, the forward models
# under autodiff with and without AGC + loss scaling: 72 files) into OUT and their sha256
# into OUT.sha, for byte-identity checks of a refactor: run it with the binary before and
# after (BIN, default target/debug/onnx-ga) and diff the two .sha files.
#   bash scripts/step-hashes.sh /tmp/before; (change, build); bash scripts/step-hashes.sh /tmp/after
#   diff /tmp/before.sha /tmp/after.sha
set -u
out=${1:?usage: step-hashes.sh OUT}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin=${BIN:-$root/target/debug/onnx-ga}
mkdir -p "$out"
cd "$root"
for g in bce_logits cnn_bn l1_loss mlp_ce_adamw mlp_mse_sgd transformer_block; do
  i=0
  for p in "" "--accum-steps 4" "--accum-steps 4 --agc 0.01" "--accum-steps 4 --loss-scale dynamic" \
      "--accum-steps 4 --precision fp16" "--accum-steps 4 --apply where" "--accum-steps 4 --engine tract" \
      "--accum-steps 4 --optimizer sgd --momentum 0.9" "--accum-steps 4 --optimizer adam"; do
    # shellcheck disable=SC2086
    "$bin" rewrite "graphs/$g" -o "$out/$g.$i.onnx" --lr 0.01 $p >/dev/null 2>&1 || echo "failed: $g $p"
    i=$((i + 1))
  done
done
for m in graphs/forward/*/legacy.onnx graphs/forward/*/keras.onnx graphs/forward/torch_mlp/dynamo.onnx; do
  n=$(basename "$(dirname "$m")")_$(basename "$m" .onnx)
  common=(--loss-fn cross-entropy --optimizer adamw --lr 0.01 --accum-steps 4)
  "$bin" rewrite "$m" -o "$out/fwd_$n.onnx" "${common[@]}" >/dev/null 2>&1 || echo "failed: $m"
  "$bin" rewrite "$m" -o "$out/fwd_$n.agc.onnx" "${common[@]}" --agc 0.01 --loss-scale dynamic \
    >/dev/null 2>&1 || echo "failed: $m agc"
done
(cd "$out" && sha256sum -- *.onnx) > "$out.sha"
echo "$(wc -l < "$out.sha") steps hashed into $out.sha"
