#!/usr/bin/env bash
# Data-parallel training (train --distributed mpi, issue 16): time per window and the
# all-reduce's share of it for R = 1 and 2 ranks on this machine (loopback), and the bytes
# one window's all-reduce moves, on the shipped graphs and the torch GPT export. See
# benches/README.md ("Data parallel").
#
#   bash benches/distributed.sh        # ~1 minute on 2 cores once built
#
# Needs Open MPI (bash scripts/install-mpi.sh) and ONNX Runtime (.venv-ort). Builds the
# binary with --features mpi once and copies it, so nobody's rebuild changes it mid-run.
# Settings: STEPS (micro-steps per run, 1024), BATCH (micro-batch, 8), ROUNDS (3: the median
# is reported), MODELS (names, comma-separated; default all), OUT (default
# target/bench-distributed/<time>/).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-1024}"
BATCH="${BATCH:-8}"
ROUNDS="${ROUNDS:-3}"
OUT="${OUT:-target/bench-distributed/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
bash scripts/install-mpi.sh
ORT_DYLIB_PATH="$(bash scripts/install-ort.sh | tail -n1)"
export ORT_DYLIB_PATH
cargo build --release --features mpi --bin onnx-ga >&2
bin="$OUT/onnx-ga"
cp target/release/onnx-ga "$bin"
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none
  --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo)

# name | how to rewrite it | data
models=(
  "mlp_ce_adamw|graphs/mlp_ce_adamw --lr 0.01|graphs/mlp_ce_adamw/data.npz"
  "cnn_bn|graphs/cnn_bn --lr 0.01|graphs/cnn_bn/data.npz"
  "transformer_block|graphs/transformer_block --lr 0.01|graphs/transformer_block/data.npz"
  "torch_gpt|graphs/forward/torch_gpt/dynamo.onnx --loss-fn cross-entropy --ignore-index -100 --class-axis -1 --optimizer adamw --lr 0.001|graphs/forward/torch_gpt/data.npz"
)
# The realistic models of benches/realistic (issue 14), when their generator has made them
# (bash benches/realistic/run.sh, or benches/realistic/generate.py): not committed, too big.
realistic=target/bench-realistic/models
for m in mlp gpt; do
  if [ -f "$realistic/$m/forward.onnx" ]; then
    models+=("realistic_$m|$realistic/$m/forward.onnx --loss-fn cross-entropy --class-axis -1 --optimizer adamw --lr 0.001|$realistic/$m/data.npz")
  fi
done
MODELS="${MODELS:-}"
if [ -n "$MODELS" ]; then
  kept=()
  for entry in "${models[@]}"; do
    [[ ",$MODELS," == *",${entry%%|*},"* ]] && kept+=("$entry")
  done
  models=("${kept[@]}")
fi
echo "machine: $(nproc) cores, $(uname -m); $(mpirun --version | head -n1); K = 4, micro-batch $BATCH, $STEPS micro-steps ($((STEPS / 4)) windows) per run, median of $ROUNDS" | tee "$OUT/table.md"
echo | tee -a "$OUT/table.md"
echo "| model | ranks | ms per window | all-reduce ms per window | all-reduce share | bytes per window |" | tee -a "$OUT/table.md"
echo "| --- | --- | --- | --- | --- | --- |" | tee -a "$OUT/table.md"
for entry in "${models[@]}"; do
  IFS='|' read -r name rewrite data <<<"$entry"
  # shellcheck disable=SC2086
  "$bin" rewrite $rewrite --accum-steps 4 -o "$OUT/$name.onnx" >"$OUT/$name.rewrite.log" 2>&1
  for ranks in 1 2; do
    for round in $(seq "$ROUNDS"); do
      "${mpirun[@]}" -n "$ranks" "$bin" train "$OUT/$name.onnx" --data "$data" \
        --micro-batch "$BATCH" --steps "$STEPS" --distributed mpi \
        2>"$OUT/$name.r$ranks.$round.log"
      # rank 0's last note (not under --quiet, which prints only errors):
      # "distributed: R ranks in W s; N all-reduces of B bytes, M ms each (P% of the wall time)"
      sed -n 's/.* in \([0-9.]*\) s; \([0-9]*\) all-reduces of \([0-9]*\) bytes, \([0-9.]*\) ms each.*/\1 \2 \3 \4/p' \
        "$OUT/$name.r$ranks.$round.log" >>"$OUT/$name.r$ranks.txt"
    done
    sort -n "$OUT/$name.r$ranks.txt" | awk -v n="$ROUNDS" -v name="$name" -v ranks="$ranks" '
      { wall[NR] = $1; windows = $2; bytes = $3; reduce[NR] = $4 }
      END {
        m = int((n + 1) / 2)
        per = 1000 * wall[m] / windows
        printf "| %s | %d | %.3f | %.3f | %.1f%% | %d |\n", name, ranks, per, reduce[m], 100 * reduce[m] / per, bytes
      }' | tee -a "$OUT/table.md"
  done
done
echo "raw data: $OUT" >&2
