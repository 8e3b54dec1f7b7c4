#!/usr/bin/env bash
# Open MPI from Debian's packages, for `cargo build --features mpi` (`train --distributed
# mpi`) and tests/distributed.rs: mpirun (openmpi-bin), the library and headers
# (libopenmpi-dev), and libclang (libclang-dev) for the bindings rsmpi generates at build
# time. Idempotent and quiet: does nothing when the packages are installed. Exits non-zero
# (saying why) when they are missing and cannot be installed (not root, no apt-get).
set -euo pipefail

packages=(openmpi-bin libopenmpi-dev libclang-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-mpi: ${missing[*]} missing and no apt-get here: install Open MPI and libclang by hand" >&2
  exit 1
fi
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo=(sudo -n); else
    echo "install-mpi: ${missing[*]} missing; installing needs root" >&2
    exit 1
  fi
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
echo "install-mpi: installing ${missing[*]}" >&2
if ! { "${sudo[@]}" apt-get update -qq &&
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}"; } >"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "install-mpi: apt-get failed" >&2
  exit 1
fi
command -v mpirun >/dev/null 2>&1 || { echo "install-mpi: no mpirun after installing" >&2; exit 1; }
