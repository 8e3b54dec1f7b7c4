"""Hugging Face architectures through torch's TorchScript exporter (`dynamo=False`): the
fixtures of the models whose legacy export onnx-ga once refused or differentiated wrong.

For each model of `LEGACY_MODELS` (survey.py's toy configs): the legacy export (training mode,
no constant folding, opset 17, dynamic batch, as generate.py's `legacy.onnx`) to
graphs/forward/legacy_<name>/legacy.onnx, the 8 samples of survey.py to data.npz (inputs `x`
and, for an encoder-decoder, `y`; `labels`), and torch autograd's loss and gradients of the
mean cross-entropy on them, keyed by parameter name (the file's initializer names), in
float32 (fixtures/forward/legacy_<name>/grads.npz) and float64 (grads64.npz). tests/autodiff.rs
compares onnx-ga's gradient graph with them as it does generate.py's fixtures.

What each one needed (2026-12-06):
- t5: its layer norm casts float32 hidden states to float32; the dropout gradient's
  `Div(1, keep)` scale then met ONNX Runtime 1.31's DivMulFusion, which folded it after
  removing that Cast, and the gradient graph did not load.
- bert: position ids sliced from a [1, 512] buffer to a length known at run time; the
  slice's facts lost the row axis, the table's gradient was not summed over the batch, and
  the graph failed at run time.
- gpt_neox: the rotary half `x[..., : d // 2]`, bounds computed through float Casts.
- bloom: ALiBi slopes expanded to a target of ones whose length is a computed shape.
- swin: feature maps padded to a multiple of the window by pads computed from Shape.

    .venv-torch/bin/python graphs/forward/legacy_reference.py   # regen.sh runs it
"""

import copy
import os
import sys
import warnings

import numpy as np
import onnx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import survey  # noqa: E402

LEGACY_MODELS = ["t5", "bert", "gpt_neox", "bloom", "swin"]
ROOT = survey.ROOT


def generate(name):
    config_class, model_class, config, argument, data = survey.MODELS[name]
    torch.manual_seed(0)
    model = survey.Logits(model_class(config_class(**config)), argument).eval()
    g = torch.Generator().manual_seed(1)
    x = data(8, g)
    seq2seq = "decoder_layers" in config or "num_decoder_layers" in config
    inputs = (x, survey.tokens(t=6)(8, g)) if seq2seq else (x,)
    names = ["x", "y"][:len(inputs)]
    with torch.no_grad():
        logits = model(*inputs)
    labels = torch.randint(0, logits.shape[-1], logits.shape[:-1],
                           generator=torch.Generator().manual_seed(2))

    gdir = os.path.join(ROOT, "graphs/forward", f"legacy_{name}")
    fdir = os.path.join(ROOT, "fixtures/forward", f"legacy_{name}")
    os.makedirs(gdir, exist_ok=True)
    os.makedirs(fdir, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(model).train(), tuple(i[:4] for i in inputs),
                          os.path.join(gdir, "legacy.onnx"), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, opset_version=17,
                          input_names=names, output_names=["logits"],
                          dynamic_axes={n: {0: "batch"} for n in names})
    np.savez(os.path.join(gdir, "data.npz"),
             **{n: i.numpy() for n, i in zip(names, inputs)}, labels=labels.numpy())
    # A tied tensor (T5's shared embedding, read as the encoder's and the decoder's token
    # embedding and the lm_head) is one initializer in the file, under one of its names.
    stored = {i.name for i in onnx.load(os.path.join(gdir, "legacy.onnx")).graph.initializer}
    for dtype, file in [(torch.float32, "grads.npz"), (torch.float64, "grads64.npz")]:
        loss, grads = survey.torch_gradients(model, inputs, labels, dtype)
        out = {"loss": np.array(loss, dtype=np.float32 if dtype == torch.float32 else np.float64)}
        out.update({k: (v.astype(np.float32) if dtype == torch.float32 else v)
                    for k, v in sorted(grads.items()) if k in stored})
        np.savez(os.path.join(fdir, file), **out)
    grads = {k: v for k, v in grads.items() if k in stored}
    print(f"{name}: {len(grads)} parameters, loss {loss:.6f}")


def main(names):
    torch.set_num_threads(1)
    for name in names or LEGACY_MODELS:
        generate(name)


if __name__ == "__main__":
    main(sys.argv[1:])
