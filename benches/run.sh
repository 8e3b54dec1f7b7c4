#!/usr/bin/env bash
# The step benchmark, every column interleaved in one run (see benches/README.md).
#
# Alternates rounds of the Rust bench (benches/step.rs: floor, step If, step Where, host
# loop, and the ORT-value diagnostics) with rounds of benches/ort_training_api.py (ONNX
# Runtime's training API, onnxruntime-training-cpu 1.19.2 from .venv-gen), R rounds of each,
# the order flipped every round; then prints the markdown tables (medians over rounds).
# This machine's speed drifts ~25% between runs, so nothing is compared across runs.
#
# Environment:
#   ROUNDS    rounds of each kind (default 8)
#   CELL_MS   measured time per cell and round, ms (default 100; warm-up 15 ms more)
#   OUT       folder for the raw JSON lines and table.md (default target/bench-step/<time>)
#   MODELS, BATCHES, THREADS   comma lists (default all three models, 8,32, 1,2)
#   PYTHON    interpreter with onnxruntime-training (default .venv-gen/bin/python);
#             without it the ORT-API column is left empty.
# About 2.5 minutes on 2 cores once built.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

rounds="${ROUNDS:-8}"
cell_ms="${CELL_MS:-100}"
out="${OUT:-target/bench-step/$(date +%Y%m%d-%H%M%S)}"
models="${MODELS:-mlp_ce_adamw,cnn_bn,transformer_block}"
batches="${BATCHES:-8,32}"
threads="${THREADS:-1,2}"
python="${PYTHON:-$root/.venv-gen/bin/python}"
common=(--models "$models" --batches "$batches" --threads "$threads" --cell-ms "$cell_ms")

log() { printf 'run.sh: %s\n' "$*" >&2; }

# ONNX Runtime 1.31.1 for the Rust side (idempotent; found automatically afterwards).
if [[ ! -x "$root/.venv-ort/bin/python" && -z "${ORT_DYLIB_PATH:-}" ]]; then
    bash scripts/install-ort.sh >/dev/null
fi

have_api=1
if ! "$python" -c 'import sys; sys.path.insert(0, "graphs"); import gen_common; from onnxruntime.training.api import Module' >/dev/null 2>&1; then
    log "no onnxruntime-training at $python (make .venv-gen as graphs/README.md says): the ORT API column stays empty"
    have_api=0
fi

mkdir -p "$out"
log "results in $out"

# Build once and run a private copy of the executable: a rebuild by someone editing src/
# during the run must not change the code between rounds.
log "building (cargo bench --bench step --no-run)"
exe="$(cargo bench --bench step --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*step-[^"]*"' | tail -n1 | cut -d'"' -f4)"
[[ -n "$exe" && -x "$exe" ]] || { cargo bench --bench step --no-run; log "build failed"; exit 1; }
cp "$exe" "$out/step-bench"
bench() { "$out/step-bench" "$@"; }
bench --check --models "$models" | tee "$out/check.txt"

start=$SECONDS
for ((r = 0; r < rounds; r++)); do
    rust() { bench --round "$r" --out "$out/rust.jsonl" "${common[@]}"; }
    api() { [[ $have_api == 1 ]] && "$python" benches/ort_training_api.py --round "$r" --out "$out/ort_api.jsonl" "${common[@]}"; return 0; }
    if ((r % 2 == 0)); then rust; api; else api; rust; fi
done
log "$rounds rounds in $((SECONDS - start)) s"

{
    echo "onnx-ga $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- src 2>/dev/null || echo ' (src modified)'), $(date -u +%Y-%m-%dT%H:%MZ), nproc $(nproc)"
    echo
    bench --report "$out"
} | tee "$out/table.md"
