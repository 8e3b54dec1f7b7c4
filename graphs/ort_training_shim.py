"""Import onnxruntime's training Python modules without torch.

`onnxruntime/training/__init__.py` (onnxruntime-training-cpu 1.19.2) imports `.ortmodule`
and through it torch. The submodules we need (`artifacts`, `onnxblock`, `api`) do not.
We register a bare package object for `onnxruntime.training` whose __path__ points at the
installed folder, so `import onnxruntime.training.artifacts` skips the package __init__.
"""

import os
import sys
import types

import onnxruntime


def install() -> None:
    if "onnxruntime.training" in sys.modules:
        return
    pkg = types.ModuleType("onnxruntime.training")
    pkg.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
    pkg.__package__ = "onnxruntime.training"
    sys.modules["onnxruntime.training"] = pkg
    onnxruntime.training = pkg


install()
