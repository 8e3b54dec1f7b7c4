#!/usr/bin/env bash
# Install the ONNX Runtime shared library (C API) for onnx-ga's tests and tools.
#
# Creates a virtual environment at <repo>/.venv-ort holding the PyPI wheels
#   onnxruntime==1.31.1   (ships onnxruntime/capi/libonnxruntime.so.1.31.1, the C API ort loads)
#   onnx==1.23.2          (onnx.checker, used by tests)
#   safetensors==0.8.0    (reads the .safetensors state files `train --save-state` writes, in tests)
# and prints the absolute path of the shared library as the LAST line on stdout, so
#   export ORT_DYLIB_PATH="$(bash scripts/install-ort.sh | tail -n1)"
# works. Progress goes to stderr. onnx_ga::runtime::find_onnxruntime() finds this venv on its
# own, so exporting ORT_DYLIB_PATH is optional.
#
# Idempotent: when the venv already has these packages at these versions, nothing is installed.
#
# Environment overrides:
#   PYTHON          interpreter to build the venv with (default: python3.11, then python3, then python)
#   ORT_VENV        venv location (default: <repo>/.venv-ort)
#   ORT_FORCE=1     delete and recreate the venv
set -euo pipefail

ORT_VERSION="1.31.1"
ONNX_VERSION="1.23.2"
SAFETENSORS_VERSION="0.8.0"

log() { printf 'install-ort: %s\n' "$*" >&2; }
die() { printf 'install-ort: error: %s\n' "$*" >&2; exit 1; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ORT_VENV:-$repo_root/.venv-ort}"

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON is not an executable"
        printf '%s\n' "$PYTHON"
        return
    fi
    local c
    for c in python3.11 python3 python; do
        # `command -v` alone is not enough with pyenv shims: make sure the interpreter runs.
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
            printf '%s\n' "$c"
            return
        fi
    done
    die "no python3 (>= 3.11, required by the onnxruntime 1.31.1 wheels) found; install python3.11 with pip, or set PYTHON=/path/to/python3"
}

venv_python() {
    if [[ -x "$venv/bin/python" ]]; then
        printf '%s\n' "$venv/bin/python"
    elif [[ -x "$venv/Scripts/python.exe" ]]; then
        printf '%s\n' "$venv/Scripts/python.exe"
    else
        return 1
    fi
}

# Prints "ok" when the venv has exactly the wanted versions.
versions_ok() {
    local py="$1"
    "$py" - "$ORT_VERSION" "$ONNX_VERSION" "$SAFETENSORS_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
want_ort, want_onnx, want_safetensors = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    ok = (version("onnxruntime") == want_ort and version("onnx") == want_onnx
          and version("safetensors") == want_safetensors)
except PackageNotFoundError:
    ok = False
print("ok" if ok else "no")
EOF
}

# Prints the absolute path of the C API shared library inside the venv's onnxruntime package.
# Uses find_spec, so the package is located without being imported.
library_path() {
    local py="$1"
    "$py" - <<'EOF'
import importlib.util, os, sys
spec = importlib.util.find_spec("onnxruntime")
if spec is None or not spec.submodule_search_locations:
    sys.exit("onnxruntime package not found in the venv")
capi = os.path.join(list(spec.submodule_search_locations)[0], "capi")
names = sorted(os.listdir(capi)) if os.path.isdir(capi) else []
if sys.platform == "win32":
    hits = [n for n in names if n.lower() == "onnxruntime.dll"]
elif sys.platform == "darwin":
    hits = [n for n in names if n.startswith("libonnxruntime.") and n.endswith(".dylib")]
else:
    hits = [n for n in names if n == "libonnxruntime.so" or n.startswith("libonnxruntime.so.")]
if not hits:
    sys.exit("no onnxruntime shared library in " + capi + " (found: " + ", ".join(names) + ")")
print(os.path.abspath(os.path.join(capi, hits[-1])))
EOF
}

if [[ "${ORT_FORCE:-0}" == "1" && -e "$venv" ]]; then
    log "ORT_FORCE=1: removing $venv"
    rm -rf "$venv"
fi

if py="$(venv_python)" && [[ "$(versions_ok "$py")" == "ok" ]]; then
    log "already installed: onnxruntime==$ORT_VERSION onnx==$ONNX_VERSION safetensors==$SAFETENSORS_VERSION in $venv"
else
    # A venv without a working interpreter (half-created, or its base python was removed) is rebuilt.
    if [[ -e "$venv" ]] && ! { py="$(venv_python)" && "$py" -c 'pass' >/dev/null 2>&1; }; then
        log "removing broken venv at $venv"
        rm -rf "$venv"
    fi
    if ! py="$(venv_python)"; then
        base="$(pick_python)"
        log "creating venv at $venv with $("$base" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
        if ! "$base" -m venv "$venv" >&2; then
            # Debian/Ubuntu without python3-venv: ensurepip is missing. Make a pip-less venv and
            # drive the base interpreter's pip into it (pip >= 22.3 supports --python).
            log "'$base -m venv' failed (ensurepip missing?); retrying without pip"
            rm -rf "$venv"
            "$base" -m venv --without-pip "$venv" >&2 || die "could not create a venv at $venv"
            py="$(venv_python)" || die "venv at $venv has no python"
            "$base" -m pip --python "$py" install --disable-pip-version-check --quiet pip >&2 \
                || die "no pip for the venv; install python3-venv (or a pip >= 22.3) and rerun"
        fi
        py="$(venv_python)" || die "venv at $venv has no python"
    fi
    log "installing onnxruntime==$ORT_VERSION onnx==$ONNX_VERSION safetensors==$SAFETENSORS_VERSION into $venv"
    "$py" -m pip install --disable-pip-version-check --quiet \
        "onnxruntime==$ORT_VERSION" "onnx==$ONNX_VERSION" "safetensors==$SAFETENSORS_VERSION" >&2 \
        || die "pip install failed (is PyPI reachable? does a wheel exist for $("$py" -c 'import sys,platform; print(f"python {sys.version.split()[0]} on {platform.machine()}")')?)"
    [[ "$(versions_ok "$py")" == "ok" ]] || die "installed, but versions do not match onnxruntime==$ORT_VERSION onnx==$ONNX_VERSION safetensors==$SAFETENSORS_VERSION"
fi

lib="$(library_path "$py")" || die "onnxruntime is installed but its shared library was not found"
log "ONNX Runtime library: $lib"
log "(onnx_ga finds it automatically; or: export ORT_DYLIB_PATH=\"$lib\")"
printf '%s\n' "$lib"
