#!/usr/bin/env bash
# The test command: installs what the tests need (ONNX Runtime 1.31.1 and onnx 1.23.2 in
# .venv-ort, the onnx backend-test corpus in corpus/), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

ORT_DYLIB_PATH="$(bash scripts/install-ort.sh | tail -n1)"
export ORT_DYLIB_PATH
bash scripts/fetch-corpus.sh >&2

# cargo's output as usual, then one line adding up every test binary's "test result:" line
# (the benches' tables come before it).
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
start=$SECONDS
set +e
cargo test --all-targets "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
awk -v secs="$((SECONDS - start))" -v status="$status" '
  /^test result: / {
    for (i = 1; i <= NF; i++) {
      if ($(i) ~ /^passed;?$/) passed += $(i - 1)
      if ($(i) ~ /^failed;?$/) failed += $(i - 1)
      if ($(i) ~ /^ignored;?$/) ignored += $(i - 1)
    }
    binaries++
  }
  END {
    printf "tests: %d passed, %d failed, %d ignored in %dm%02ds (%d test binaries; cargo test exit %d)\n",
      passed, failed, ignored, secs / 60, secs % 60, binaries, status
  }' "$log"
exit "$status"
