#!/usr/bin/env python3
"""Packs ONNX Runtime's CUDA libraries small enough to carry to a GPU machine without network.

Used by scripts/gpu-check.sh --pack DIR. Downloads onnxruntime-gpu 1.31.1 (CUDA 13) with pip,
keeps libonnxruntime, the shared-provider bridge and the CUDA provider, and shrinks the CUDA
provider (284 MB) by zeroing the payloads in its fat binary that the check cannot use:

- kernels for GPUs other than KEEP_ARCH (sm_90, the H100/H200): the driver loads the machine
  code of the exact architecture, and this build ships no PTX to fall back on;
- whole translation units all of whose kernels belong to contributed ops a standard-op step
  never reaches (flash and memory-efficient attention, mixture of experts, int4/fp8 matmuls,
  beam search). A unit with one kernel outside that list is kept.

The fat binary format (`.nv_fatbin`): containers, each a 16-byte header (magic 0xBA55ED50,
version, header size, size of what follows) and entries, each a header (kind, header size,
payload size at 8, architecture at 28) and a payload, here zstd-compressed ELF. Zeroed
payloads keep every offset, so nothing else in the library changes; zeros compress to nothing.
Then everything is compressed with xz and DIR/meta.json records this checkout's root.
"""

import json
import lzma
import os
import re
import struct
import subprocess
import sys
import tempfile
import zipfile

VERSION = "1.31.1"
KEEP_ARCH = 90
KEEP_FILES = [
    f"libonnxruntime.so.{VERSION}",
    "libonnxruntime_providers_shared.so",
    "libonnxruntime_providers_cuda.so",
]
FATBIN_MAGIC = 0xBA55ED50
# Kernel names of contributed ops no step of standard ops reaches.
UNREACHED = re.compile(
    rb"flash|MoeFC|fpA_intB|3llm|GroupProblemShape|attention_kernel_batched|AttentionKernel|"
    rb"SaveNoSpeech|moe|Moe|fmha|Fmha|xqa|BeamSearch|beam|sampling|Sampling|qmoe|MatMulNBits|"
    rb"matmul_nbits|Dequantize4Bits|blockwise|GroupQuery|gqa|Gqa|sparse|Sparse|rotary|Rotary|"
    rb"paged|Paged|lean|Lean"
)


def section(elf: bytes, wanted: str) -> tuple[int, int]:
    """File offset and size of the ELF64 section named `wanted`."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    def header(i):
        return struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
    names_off = header(shstrndx)[4]
    for i in range(shnum):
        name, _, _, _, offset, size = header(i)
        end = elf.index(b"\0", names_off + name)
        if elf[names_off + name:end].decode() == wanted:
            return offset, size
    raise SystemExit(f"gpu_pack: no section {wanted}")


def shrink_fatbin(data: bytearray, zstd) -> tuple[int, int]:
    """Zeroes the payloads described above; returns (bytes zeroed, bytes kept)."""
    offset, size = section(data, ".nv_fatbin")
    pos, end = offset, offset + size
    zeroed = kept = 0
    while pos < end:
        magic, _, header_size, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between containers
            pos += 8
            continue
        entry, stop = pos + header_size, pos + header_size + body
        while entry < stop:
            _, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch, = struct.unpack_from("<I", data, entry + 28)
            start = entry + entry_header
            drop = arch != KEEP_ARCH
            if not drop:
                elf = zstd.decompress(bytes(data[start:start + payload]), max_output_size=1 << 30)
                kernels = set(re.findall(rb"\.text\.(_Z[\w$]+)", elf))
                drop = bool(kernels) and all(UNREACHED.search(k) for k in kernels)
            if drop:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            else:
                kept += payload
            entry = start + payload
        pos = stop
    return zeroed, kept


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", f"{tmp}/py",
                        "zstandard"], check=True)
        sys.path.insert(0, f"{tmp}/py")
        import zstandard
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                        "--platform", "manylinux_2_28_x86_64", "-d", tmp,
                        f"onnxruntime-gpu=={VERSION}"], check=True)
        wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
            for name in KEEP_FILES:
                data = bytearray(z.read(f"onnxruntime/capi/{name}"))
                if name == "libonnxruntime_providers_cuda.so":
                    zeroed, kept = shrink_fatbin(data, zstandard.ZstdDecompressor())
                    print(f"gpu_pack: {name}: {zeroed >> 20} MiB of kernels zeroed, "
                          f"{kept >> 20} MiB kept (sm_{KEEP_ARCH})")
                with lzma.open(os.path.join(out, name + ".xz"), "wb", preset=6) as f:
                    f.write(data)
    root = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({"root": root, "onnxruntime_gpu": VERSION, "arch": KEEP_ARCH}, f)


if __name__ == "__main__":
    main()
