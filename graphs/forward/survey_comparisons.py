"""The gradient rules that compare values, on a model stored in float16 (not a test: the
findings are in docs/precision.md).

ONNX Runtime's CPU provider runs float16 ops in float32 between casts it inserts and drops the
casts it considers free, so a comparison in a gradient can see a value unrounded where the
forward saw it rounded (Min/Max's rule once zeroed Whisper's encoder gradient that way). Each
case here is `Linear(16, 32)` into one op that compares (or picks by comparing), then
`Linear(8, 10)`, after `.half()`, through survey.py's comparison: onnx-ga's gradient against
torch's float16 and float64 gradients of the same half-valued weights.

    .venv-torch/bin/python graphs/forward/survey_comparisons.py [--f32] [CASE ...]   # after cargo build --release
"""

import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import survey  # noqa: E402


def groups(h):
    return h.view(-1, 8, 4)


# Each case: the [N, 32] hidden values -> [N, 8].
CASES = {
    "amax": lambda m, h: torch.amax(groups(h), dim=-1),
    "amin": lambda m, h: torch.amin(groups(h), dim=-1),
    "max_dim": lambda m, h: torch.max(groups(h), dim=-1).values,
    "relu": lambda m, h: groups(torch.relu(h)).sum(-1),
    "relu6": lambda m, h: groups(F.relu6(h * 8)).sum(-1),
    "hardtanh": lambda m, h: groups(F.hardtanh(h * 3)).sum(-1),
    "hardsigmoid": lambda m, h: groups(F.hardsigmoid(h * 5)).sum(-1),
    "hardswish": lambda m, h: groups(F.hardswish(h * 5)).sum(-1),
    "leaky_relu": lambda m, h: groups(F.leaky_relu(h)).sum(-1),
    "elu": lambda m, h: groups(F.elu(h)).sum(-1),
    "abs": lambda m, h: groups(h.abs()).sum(-1),
    "inf_norm": lambda m, h: torch.linalg.vector_norm(groups(h), ord=float("inf"), dim=-1),
    "topk": lambda m, h: torch.topk(groups(h), 2, dim=-1).values.sum(-1),
    "sort": lambda m, h: torch.sort(groups(h), dim=-1).values[..., -1],
    "where": lambda m, h: groups(torch.where(h > 0.1, h, h * 0.5)).sum(-1),
    "softmax_amax": lambda m, h: torch.softmax(groups(h), -1).amax(-1),
    "max_pool1d": lambda m, h: F.max_pool1d(h.view(-1, 1, 32), 4).reshape(-1, 8),
    "max_pool2d": lambda m, h: F.max_pool2d(h.view(-1, 2, 4, 4), 2).reshape(-1, 8),
    # A convolution before the pool: windows whose largest values tie after rounding to
    # float16 (ONNX Runtime's float16 MaxPool takes the later of equals, torch the first).
    "conv_max_pool2d": lambda m, h: F.max_pool2d(m.conv(h.view(-1, 2, 4, 4)), 2)
    .reshape(-1, 16)[:, :8],
}


class Case(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name
        self.a, self.b = nn.Linear(16, 32), nn.Linear(8, 10)
        if name == "conv_max_pool2d":
            self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x):
        return self.b(CASES[self.name](self, self.a(x)))


def main(args):
    torch.set_num_threads(1)
    survey.HALF = "--f32" not in args
    names = [a for a in args if a != "--f32"] or list(CASES)
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            torch.manual_seed(0)
            model = Case(name).eval()
            x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
            if survey.HALF:
                model, x = model.half(), x.half()
            try:
                result = survey.compare(name, model, (x,), workdir)
            except Exception as e:  # a failed export is a finding too
                result = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{name}: {result}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
