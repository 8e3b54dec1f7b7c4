#!/usr/bin/env bash
# The realistic benchmark (issue 14 item 6; benches/README.md, "Real model sizes"), every
# column interleaved: rounds of the Rust bench (benches/realistic.rs: floor, step, step whole)
# alternate with rounds of benches/realistic/peers.py (ONNX Runtime's training API, PyTorch
# eager), the order rotating per round; then peak RSS, one fresh process per configuration
# and column; then the tables (benches/realistic/report.py) into $OUT/table.md.
#
# Makes what is missing first: .venv-bench (setup.sh: torch, onnxruntime-training 1.19.2),
# the models (generate.py into target/bench-realistic/models), ONNX Runtime 1.31.1 for the
# Rust side (scripts/install-ort.sh, or ORT_DYLIB_PATH).
#
# Environment:
#   ROUNDS    timing rounds of each kind (default 3)
#   CELL_MS   measured time per cell and round, ms (default 600; one warm-up window more)
#   ONLY      models, comma list (default mlp,resnet_bn,resnet,gpt)
#   THREADS   comma list (default 1,2)
#   RSS       1 (default) to measure peak RSS, 0 to skip it
#   OUT       raw JSON lines, logs and table.md (default target/bench-realistic/<time>)
#   BENCH_EXE the bench executable to copy instead of building it
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
rounds="${ROUNDS:-3}"
cell_ms="${CELL_MS:-600}"
only="${ONLY:-mlp,resnet_bn,resnet,gpt}"
threads="${THREADS:-1,2}"
do_rss="${RSS:-1}"
out="${OUT:-target/bench-realistic/$(date +%Y%m%d-%H%M%S)}"
models="$root/target/bench-realistic/models"
py="$root/.venv-bench/bin/python"
log() { printf 'run.sh: %s\n' "$*" >&2; }

bash benches/realistic/setup.sh
if [[ -z "${ORT_DYLIB_PATH:-}" && ! -x "$root/.venv-ort/bin/python" ]]; then
    bash scripts/install-ort.sh >/dev/null
fi
mkdir -p "$out"
rev="$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- src 2>/dev/null || echo ' + uncommitted src changes')"
IFS=, read -ra want <<<"$only"
for m in "${want[@]}"; do
    if [[ ! -f "$models/$m/meta.json" || ! -f "$models/$m/grads.npz" ]]; then
        log "generating $m into $models"
        "$py" benches/realistic/generate.py --out "$models" --models "$m" >>"$out/generate.log" 2>&1 \
            || { tail -20 "$out/generate.log"; exit 1; }
    fi
done

# Build once and run a private copy: someone rebuilding src/ mid-run must not change the code.
# BENCH_EXE: an executable built before (cargo bench --bench realistic --no-run) instead.
if [[ -n "${BENCH_EXE:-}" ]]; then
    exe="$BENCH_EXE"
else
    log "building (cargo bench --bench realistic --no-run)"
    exe="$(cargo bench --bench realistic --no-run --message-format=json 2>/dev/null \
        | grep -o '"executable":"[^"]*realistic-[^"]*"' | tail -n1 | cut -d'"' -f4)"
fi
[[ -n "$exe" && -x "$exe" ]] || { cargo bench --bench realistic --no-run; log "build failed"; exit 1; }
cp "$exe" "$out/realistic-bench"
work="$out/work"
common=(--models "$models" --only "$only" --threads "$threads" --cell-ms "$cell_ms")
rust() { "$out/realistic-bench" --models "$models" --work "$work" "$@"; }

log "building the floors and steps, checking them against torch (into $work)"
rust --prepare --only "$only" | tee "$out/prepare.jsonl"

start=$SECONDS
kinds=(rust ort_api torch)
for ((r = 0; r < rounds; r++)); do
    for ((j = 0; j < 3; j++)); do
        kind="${kinds[$(((j + r) % 3))]}"
        log "round $r: $kind"
        # The core-to-core round trip: ~65 ns while the two vCPUs share an L3, ~320 across
        # dies, where two-thread cells run up to 1.7x slower (benches/README.md, "Run AC").
        echo "round $r $kind start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $(rust --c2c)" >>"$out/load.txt"
        if [[ $kind == rust ]]; then
            rust --round "$r" --out "$out/rust.jsonl" --only "$only" --threads "$threads" --cell-ms "$cell_ms"
        else
            "$py" benches/realistic/peers.py --round "$r" --column "$kind" --out "$out/peers.jsonl" \
                --c2c-exe "$out/realistic-bench" "${common[@]}"
        fi
    done 2>>"$out/rounds.log"
done
log "$rounds rounds in $((SECONDS - start)) s"

if [[ $do_rss == 1 ]]; then
    start=$SECONDS
    log "peak RSS, one process per configuration"
    {
        rust --rss --out "$out/rss.jsonl" --only "$only" --threads "$threads"
        "$py" benches/realistic/peers.py --rss --column ort_api --out "$out/rss.jsonl" --models "$models" --only "$only" --threads "$threads"
        "$py" benches/realistic/peers.py --rss --column torch --out "$out/rss.jsonl" --models "$models" --only "$only" --threads "$threads"
    } 2>>"$out/rss.log"
    log "peak RSS in $((SECONDS - start)) s"
fi

{
    echo "onnx-ga $rev when the run started$([[ -n "${BENCH_EXE:-}" ]] && echo " (bench executable given: $BENCH_EXE)"), ended $(date -u +%Y-%m-%dT%H:%MZ), nproc $(nproc), load average $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    "$py" benches/realistic/report.py "$out"
} | tee "$out/table.md"
