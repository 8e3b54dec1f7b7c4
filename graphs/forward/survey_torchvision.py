"""A survey of torchvision's architectures through onnx-ga's autodiff (not a test: nothing
here runs in CI, and nothing is committed from it but the table in README.md), as survey.py
does for Hugging Face's: each model built by torchvision (random init, 10 classes; the
transformers at toy width), dropout and stochastic depth off, exported by torch's dynamo
exporter (`model.eval()`, `optimize=False`, dynamic batch), differentiated by `onnx-ga
rewrite --pipeline autodiff --loss-fn cross-entropy` (BatchNorm in training form), its
gradient graph run by ONNX Runtime on 8 images, against torch autograd in `train()` mode in
float32 and float64.

    .venv-torch/bin/pip install --no-deps torchvision pillow   # once; not a test requirement
    .venv-torch/bin/python graphs/forward/survey_torchvision.py [--legacy] [NAME ...]   # after cargo build --release
"""

import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as tv
from torchvision.models import swin_transformer, vision_transformer, maxvit
from torchvision.ops import StochasticDepth

sys.path.insert(0, os.path.dirname(__file__))
import survey as s  # noqa: E402

CLASSES = 10


class SpatialTransformer(nn.Module):
    """Not torchvision's: torch's `F.grid_sample` behind a localisation net's `F.affine_grid`
    (a spatial transformer; dynamo writes affine_grid out in standard ops), or behind a
    learned flow field added to the identity grid, then a conv and a linear head."""

    def __init__(self, affine, size=8):
        super().__init__()
        if affine:
            self.loc = nn.Linear(3 * size * size, 6)
            nn.init.zeros_(self.loc.weight)
            self.loc.bias.data = torch.tensor([1.0, 0.1, 0.05, -0.1, 0.9, 0.02])
        else:
            self.flow = nn.Parameter(0.3 * torch.randn(1, size, size, 2))
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * size * size, CLASSES)
        self.affine, self.size = affine, size

    def forward(self, x):
        if self.affine:
            theta = self.loc(x.flatten(1)).view(-1, 2, 3)
            grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        else:
            axis = torch.linspace(-1, 1, self.size)
            identity = torch.stack(torch.meshgrid(axis, axis, indexing="xy"), -1)
            grid = (identity + self.flow).expand(x.shape[0], -1, -1, -1)
        y = F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")
        return self.fc(F.relu(self.conv(y)).flatten(1))


# name: (constructor, image size)
MODELS = {
    "resnet18": (lambda: tv.resnet18(num_classes=CLASSES), 32),
    "resnext50_32x4d": (lambda: tv.resnext50_32x4d(num_classes=CLASSES), 32),
    "densenet121": (lambda: tv.densenet121(num_classes=CLASSES), 32),
    "googlenet": (lambda: tv.googlenet(num_classes=CLASSES, aux_logits=False, init_weights=True), 32),
    "inception_v3": (lambda: tv.inception_v3(num_classes=CLASSES, aux_logits=False, init_weights=True), 80),
    "squeezenet1_0": (lambda: tv.squeezenet1_0(num_classes=CLASSES), 32),
    "shufflenet_v2_x0_5": (lambda: tv.shufflenet_v2_x0_5(num_classes=CLASSES), 32),
    "mobilenet_v2": (lambda: tv.mobilenet_v2(num_classes=CLASSES), 32),
    "mobilenet_v3_small": (lambda: tv.mobilenet_v3_small(num_classes=CLASSES), 32),
    "mnasnet0_5": (lambda: tv.mnasnet0_5(num_classes=CLASSES), 32),
    "efficientnet_b0": (lambda: tv.efficientnet_b0(num_classes=CLASSES), 32),
    "efficientnet_v2_s": (lambda: tv.efficientnet_v2_s(num_classes=CLASSES), 32),
    "regnet_y_400mf": (lambda: tv.regnet_y_400mf(num_classes=CLASSES), 32),
    "convnext_tiny": (lambda: tv.convnext_tiny(num_classes=CLASSES), 32),
    "vit (toy)": (lambda: vision_transformer.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
        num_classes=CLASSES), 32),
    "swin (toy)": (lambda: swin_transformer.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[2, 2],
        stochastic_depth_prob=0.0, num_classes=CLASSES), 32),
    "swin_v2 (toy)": (lambda: swin_transformer.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[2, 2],
        stochastic_depth_prob=0.0, num_classes=CLASSES,
        block=swin_transformer.SwinTransformerBlockV2,
        downsample_layer=swin_transformer.PatchMergingV2), 32),
    "maxvit (toy)": (lambda: maxvit.MaxVit(
        input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[8, 16],
        block_layers=[1, 1], head_dim=4, stochastic_depth_prob=0.0, num_classes=CLASSES), 32),
    "spatial transformer (affine_grid)": (lambda: SpatialTransformer(affine=True), 8),
    "spatial transformer (flow field)": (lambda: SpatialTransformer(affine=False), 8),
}


class Wrapped(nn.Module):
    """The model under the name `m` (its parameters `m.<torchvision name>`, as survey.py's)."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(x)


def build(name):
    make, size = MODELS[name]
    torch.manual_seed(0)
    model = make()
    for module in model.modules():
        if isinstance(module, (nn.Dropout, StochasticDepth)):
            module.p = 0.0
    return Wrapped(model).eval(), size


def main(names):
    torch.set_num_threads(1)
    # `--legacy`: torch's TorchScript exporter instead, as survey.py's.
    s.LEGACY = "--legacy" in names
    names = [n for n in names if n != "--legacy"]
    with tempfile.TemporaryDirectory() as workdir:
        for name in names or MODELS:
            try:
                model, size = build(name)
                x = s.images(size)(8, torch.Generator().manual_seed(1))
                result = s.compare(name.split()[0], model, (x,), workdir)
            except Exception as e:  # a failed export is a finding too
                result = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{name}: {result}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
