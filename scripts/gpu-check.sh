#!/usr/bin/env bash
# The GPU check: tests/device_cuda.rs with ONNX_GA_EXPECT_CUDA=1 (every case must train on
# CUDA and end where the CPU does), then a rough timing of `train --device cuda` against the
# CPU. For a machine with an NVIDIA GPU and CUDA 13 but no Rust toolchain and no network:
# build here, carry the binaries and ONNX Runtime's GPU libraries there.
#
# Prepare (on the build machine, in the repository root):
#   cargo test --release --no-run --test suite        # and cargo build --release
#   bash scripts/gpu-check.sh --pack DIR              # DIR: .gpu, ignored by git
# which downloads onnxruntime-gpu 1.31.1 (CUDA 13), keeps libonnxruntime and the CUDA
# provider, and (because the provider is 284 MB) zeroes the provider's kernels for other
# GPUs than sm_90 and those of contributed ops no standard-op step reaches (flash and
# memory-efficient attention, mixture of experts, quantized matmuls), then compresses it
# all: about 35 MB with the two binaries. On the GPU machine:
#   bash scripts/gpu-check.sh --run DIR [OUT]       # QUICK=1: the tests only
# CUDA 13's runtime, cuBLAS, cuRAND, cuFFT and cuDNN 9 are taken from the Python
# packages there (PyTorch's nvidia-* wheels) or from LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-}"
dir="${2:-.gpu}"

if [[ "$mode" == --pack ]]; then
    python3 scripts/gpu_pack.py "$dir"
    exe="$(ls -t target/release/deps/suite-* | grep -v '\.d$' | head -n1)"
    for f in "$exe" target/release/onnx-ga; do
        xz -T0 -6 -c "$f" > "$dir/$(basename "$f" | sed 's/-[0-9a-f]*$//').xz"
    done
    du -sh "$dir"/*
    exit 0
fi
[[ "$mode" == --run ]] || { echo "usage: $0 --pack DIR | --run DIR [OUT]" >&2; exit 2; }
out="${3:-${OUT:-/tmp/gpu-check}}"
mkdir -p "$out"

# The test binary has this checkout's absolute paths compiled in (the onnx-ga binary, the
# fixtures): make them resolve here.
built_at="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["root"])' "$dir/meta.json")"
if [[ "$(pwd -P)" != "$built_at" ]]; then
    mkdir -p "$(dirname "$built_at")"
    ln -sfn "$(pwd -P)" "$built_at"
fi
lib="$(pwd -P)/$dir/lib"
mkdir -p "$lib" target/release
# Python's lzma: xz itself need not be installed there.
unxz_to() { python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; }
for f in "$dir"/*.so*.xz; do unxz_to "$f" "$lib/$(basename "$f" .xz)"; done
unxz_to "$dir/onnx-ga.xz" target/release/onnx-ga
unxz_to "$dir/suite.xz" target/release/suite
chmod +x target/release/onnx-ga target/release/suite
export ORT_DYLIB_PATH="$lib/libonnxruntime.so.1.31.1"

# CUDA 13 libraries: the nvidia-* Python packages' lib folders, if any.
cuda_dirs="$(python3 - <<'EOF' 2>/dev/null || true
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
found = set()
for r in roots:
    for so in glob.glob(os.path.join(r, "nvidia", "**", "lib*.so*"), recursive=True):
        found.add(os.path.dirname(so))
print(":".join(sorted(found)))
EOF
)"
# The driver's libcuda where the image mounts it outside the loader's cache.
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64; do
    [[ -d "$d" ]] && cuda_dirs="${cuda_dirs:+$cuda_dirs:}$d"
done
export LD_LIBRARY_PATH="$lib${cuda_dirs:+:$cuda_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
    nvidia-smi -L || true
    echo "ORT_DYLIB_PATH=$ORT_DYLIB_PATH"
    echo "the provider's libraries:"
    ldd "$lib/libonnxruntime_providers_cuda.so" | grep -E "cu|not found" || true
} 2>&1 | tee "$out/setup.log"

set +e
CI=true ONNX_GA_EXPECT_CUDA=1 target/release/suite device_cuda --test-threads 1 --nocapture 2>&1 \
    | tee "$out/tests.log"
status=${PIPESTATUS[0]}
set -e

[[ "${QUICK:-0}" == 1 ]] && exit "$status"

# Rough speed: a 784-1024-1024-10 MLP (1.9M parameters, AdamW, K 4) at micro-batches 32
# and 256, on CUDA and on the CPU's cores.
work="$(mktemp -d)"
python3 scripts/make_mlp.py "$work/mlp" 784,1024,1024,10 4096
target/release/onnx-ga rewrite "$work/mlp/model.onnx" -o "$work/mlp.onnx" \
    --loss-fn cross-entropy --accum-steps 4 --optimizer adamw --lr 1e-3 >/dev/null 2>&1
cores="$(nproc)"
for b in 32 256; do
    for device in cuda cpu; do
        printf 'mlp 1.9M, B %s, %s: ' "$b" "$device"
        target/release/onnx-ga train "$work/mlp.onnx" --data "$work/mlp/data.npz" \
            --micro-batch "$b" --steps 400 --device "$device" --threads "$cores" 2>&1 \
            | grep '^time:' || echo "train failed"
    done
done 2>&1 | tee "$out/timing.log"

# Where a CUDA micro-step's time goes: ONNX Runtime's profiler on the MLP at B 256.
ONNX_GA_ORT_PROFILE="$work/prof" target/release/onnx-ga train "$work/mlp.onnx" \
    --data "$work/mlp/data.npz" --micro-batch 256 --steps 40 --quiet --device cuda || true
python3 - "$work" <<'PY' 2>&1 | tee "$out/profile.log" || true
import collections, glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/prof*.json")):
    events = json.load(open(f))
    by_op, runs = collections.Counter(), [e["dur"] for e in events if e.get("name") == "model_run"]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[(e["args"].get("op_name"), e["args"].get("provider"))] += e["dur"]
    n = max(len(runs), 1)
    print(f"{f.rsplit('/', 1)[-1]}: {len(runs)} runs, {sum(runs) / n:.0f} us per run; "
          f"kernels {sum(by_op.values()) / n:.0f} us per run")
    for (op, provider), us in by_op.most_common(12):
        print(f"  {op:28} {provider:24} {us / n:8.1f} us per run")
PY

# Probe: which nodes of half-precision steps ONNX Runtime's CUDA provider has no kernel
# for (its verbose log names each one it leaves to the CPU, which has none either).
probe() { # model data precision
    local step="$work/probe-$(echo "$1" | tr / _)-$3.onnx"
    local flags=(--precision "$3" --optimizer adamw --lr 1e-3)
    [[ "$1" == *.onnx ]] && flags+=(--loss-fn cross-entropy --ignore-index -100)
    if ! target/release/onnx-ga rewrite "$1" -o "$step" --accum-steps 2 "${flags[@]}" >/dev/null 2>"$step.rewrite"; then
        echo "$1 $3: rewrite failed: $(tail -n1 "$step.rewrite")"; return
    fi
    if ORT_LOG=verbose target/release/onnx-ga train "$step" --data "$2" --micro-batch 4 --steps 3 \
        --device cuda --quiet >"$step.log" 2>&1; then
        echo "$1 $3: trains"
    else
        echo "$1 $3: fails: $(grep '^error' "$step.log" | cut -c1-400)"
    fi
    grep -iE 'kernel not found|not supported|fall ?back|Provider type' "$step.log" | sed 's/^.*\] //' | sort | uniq -c | head -n 40 || true
}
for p in fp16 bf16; do
    probe graphs/mlp_ce_adamw graphs/mlp_ce_adamw/data.npz "$p"
    for m in torch_mlp torch_cnn torch_gpt torch_unet torch_vit torch_bert torch_rnn; do
        probe "graphs/forward/$m/dynamo.onnx" "graphs/forward/$m/data.npz" "$p"
    done
done 2>&1 | tee "$out/probe.log"

# Where CUDA and the CPU part under Adam on the GPT (the key bias's zero gradient?).
target/release/onnx-ga rewrite graphs/forward/torch_gpt/dynamo.onnx -o "$work/gpt-adamw.onnx" \
    --loss-fn cross-entropy --ignore-index -100 --normalize weighted --accum-steps 4 \
    --optimizer adamw --lr 1e-3 >/dev/null 2>&1
for device in cpu cuda; do
    target/release/onnx-ga train "$work/gpt-adamw.onnx" --data graphs/forward/torch_gpt/data.npz \
        --micro-batch 4 --steps 12 --quiet --device "$device" --save-state "$work/gpt-$device.npz" || true
done
python3 - "$work/gpt-cpu.npz" "$work/gpt-cuda.npz" <<'PY' 2>&1 | tee "$out/gpt-adamw.log" || true
import sys, numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
rows = []
for k in a.files:
    if a[k].dtype.kind != "f": continue
    d = np.abs(a[k].astype(np.float64) - b[k]).ravel()
    for i in np.argsort(d)[-3:]:
        rows.append((d[i], k, a[k].shape, int(i)))
for r in sorted(rows, reverse=True)[:12]: print("%.3e %s %s flat index %d" % r)
PY
exit "$status"
