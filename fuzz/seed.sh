#!/bin/sh
# Seed corpora for the fuzz targets from the repository's own files.
set -e
cd "$(dirname "$0")"
root=..
mkdir -p corpus/checkpoint corpus/model_signature corpus/rewrite corpus/data_state
for g in "$root"/graphs/*/; do
    n=$(basename "$g")
    [ -f "$g/checkpoint" ] && cp "$g/checkpoint" "corpus/checkpoint/$n"
    for m in "$g"/*.onnx; do
        [ -f "$m" ] || continue
        cp "$m" "corpus/model_signature/$n-$(basename "$m")"
        cp "$m" "corpus/rewrite/$n-$(basename "$m")"
    done
    # data_state: the first byte picks the reader (even: npz).
    [ -f "$g/data.npz" ] && { printf '\000'; cat "$g/data.npz"; } > "corpus/data_state/$n-data"
done
for m in "$root"/graphs/forward/*/*.onnx; do
    n=$(basename "$(dirname "$m")")-$(basename "$m")
    cp "$m" "corpus/model_signature/$n"
    cp "$m" "corpus/rewrite/$n"
done
for c in "$root"/tests/data/checkpoint/*; do
    [ -f "$c" ] && cp "$c" corpus/checkpoint/
done
echo "seeded: $(ls corpus/checkpoint | wc -l) checkpoints, $(ls corpus/rewrite | wc -l) models, $(ls corpus/data_state | wc -l) data files"
