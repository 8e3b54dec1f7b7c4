#!/usr/bin/env bash
# The test command: installs what the tests need (ONNX Runtime 1.31.1 and onnx 1.23.2 in
# .venv-ort, the onnx backend-test corpus in corpus/), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

ORT_DYLIB_PATH="$(bash scripts/install-ort.sh | tail -n1)"
export ORT_DYLIB_PATH
bash scripts/fetch-corpus.sh >&2
# Open MPI (Debian's packages) for the distributed tests, which then build with the cargo
# feature `mpi` and run 2 ranks on loopback. Under CI=true it must install; elsewhere a
# machine without it tests the build without MPI (tests/distributed.rs then skips).
features=()
if bash scripts/install-mpi.sh; then
  features=(--features mpi)
elif [ "${CI:-}" = true ]; then
  echo "test.sh: Open MPI is required under CI=true" >&2
  exit 1
else
  echo "test.sh: no Open MPI: testing without the mpi feature" >&2
fi

# cargo's output as usual, then one line adding up every test binary's "test result:" line
# (the benches' tables come before it).
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
start=$SECONDS
set +e
cargo test --all-targets ${features[@]+"${features[@]}"} "$@" 2>&1 | tee "$log"
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
