"""Shared helpers for graphs/generate.py and fixtures/generate.py.

1. Import onnxruntime's training Python modules without torch.
   `onnxruntime/training/__init__.py` (onnxruntime-training-cpu 1.19.2) imports `.ortmodule`
   and through it torch. The submodules we need (`artifacts`, `onnxblock`, `api`) do not.
   Importing this module registers a bare package object for `onnxruntime.training` whose
   __path__ points at the installed folder, so `import onnxruntime.training.artifacts`
   skips the package __init__.
2. `save_npz`: np.savez with fixed zip timestamps, so regenerated files are byte-identical.
"""

from __future__ import annotations

import io
import os
import sys
import types
import zipfile

import numpy as np
import onnxruntime


def install_training_package() -> None:
    if "onnxruntime.training" in sys.modules:
        return
    pkg = types.ModuleType("onnxruntime.training")
    pkg.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
    pkg.__package__ = "onnxruntime.training"
    sys.modules["onnxruntime.training"] = pkg
    onnxruntime.training = pkg


install_training_package()


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez (uncompressed, one `<key>.npy` member per array, insertion order) but
    byte-deterministic: every member gets the DOS epoch as its timestamp."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())
