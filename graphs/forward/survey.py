"""A survey of Hugging Face architectures through onnx-ga's autodiff (not a test: nothing here
runs in CI, and nothing is committed from it but the table in README.md).

Each model is built at toy size from its transformers config, exported by torch's dynamo
exporter (`optimize=False`, dynamic batch), differentiated by `onnx-ga rewrite --pipeline
autodiff --loss-fn cross-entropy`, and its gradient graph run by ONNX Runtime on 8 samples,
against torch autograd of the same cross-entropy in float32 and float64 (`model.train()`,
dropout 0). Per model: the loss difference, and the worst parameter's gradient error
relative to max(its norm, 1e-3 of the whole gradient's norm), ours and torch float32's,
each against torch float64.

    .venv-torch/bin/python graphs/forward/survey.py [--half] [--legacy] [NAME ...]   # after cargo build --release

`--half`: each model after `.half()` (a model stored in float16; onnx-ga trains float32
masters of its parameters), against torch's float16 and float64 gradients of the same
half-valued weights.

`--legacy`: exported by torch's TorchScript exporter instead (`dynamo=False`, training mode,
no constant folding, opset 17, dynamic batch), as generate.py's `_legacy` fixtures are; it
exports T5 and Swin, which dynamo fails to.
"""

import copy
import os
import subprocess
import sys
import warnings

import numpy as np
import onnxruntime as ort
import torch
import torch.nn as nn
import transformers as T

from survey_report import report_each

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "onnx-ga")


class Logits(nn.Module):
    """model(**{argument: x}) -> its logits (or CLIP's image embeddings); an encoder-decoder
    also takes the decoder's tokens, `y`."""

    def __init__(self, model, argument):
        super().__init__()
        self.m, self.argument = model, argument

    def forward(self, x, y=None):
        kwargs = {self.argument: x}
        if y is not None:
            kwargs.update(decoder_input_ids=y, use_cache=False)
        out = self.m(**kwargs)
        return out.logits if hasattr(out, "logits") else out.image_embeds


def tokens(vocab=32, t=8):
    return lambda n, g: torch.randint(2, vocab, (n, t), generator=g)


def images(size, channels=3):
    return lambda n, g: torch.randn(n, channels, size, size, generator=g)


NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
DECODER = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16)
ENCODER = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=32, max_position_embeddings=20, num_labels=3, **NO_DROPOUT)
SEQ2SEQ = dict(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
               decoder_ffn_dim=32, max_position_embeddings=16, dropout=0.0,
               attention_dropout=0.0, activation_dropout=0.0)
VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              image_size=8, patch_size=4, num_channels=3, num_labels=4, **NO_DROPOUT)

# name: (config class, model class, config, the model's input argument, data)
MODELS = {
    "gpt2": (T.GPT2Config, T.GPT2LMHeadModel,
             dict(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
             "input_ids", tokens()),
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, DECODER, "input_ids", tokens()),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, DECODER, "input_ids", tokens()),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(DECODER, head_dim=4), "input_ids",
              tokens()),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, DECODER, "input_ids", tokens()),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(DECODER, pad_token_id=0), "input_ids",
             tokens()),
    "opt": (T.OPTConfig, T.OPTForCausalLM,
            dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 ffn_dim=32, max_position_embeddings=16, word_embed_proj_dim=16, dropout=0.0,
                 attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=0),
            "input_ids", tokens()),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
                 dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=16, rotary_pct=0.5,
                      hidden_dropout=0.0, attention_dropout=0.0),
                 "input_ids", tokens()),
    "bloom": (T.BloomConfig, T.BloomForCausalLM,
              dict(vocab_size=32, hidden_size=16, n_layer=2, n_head=2, hidden_dropout=0.0,
                   attention_dropout=0.0),
              "input_ids", tokens()),
    "falcon": (T.FalconConfig, T.FalconForCausalLM,
               dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                    hidden_dropout=0.0, attention_dropout=0.0),
               "input_ids", tokens()),
    # encoder-decoders: a second input, the decoder's 6 tokens
    "bart": (T.BartConfig, T.BartForConditionalGeneration, dict(SEQ2SEQ), "input_ids", tokens()),
    "marian": (T.MarianConfig, T.MarianMTModel,
               dict(SEQ2SEQ, pad_token_id=0, decoder_start_token_id=0), "input_ids", tokens()),
    "whisper": (T.WhisperConfig, T.WhisperForConditionalGeneration,
                dict(SEQ2SEQ, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                     pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2,
                     suppress_tokens=None, begin_suppress_tokens=None),
                "input_features", lambda n, g: torch.randn(n, 8, 16, generator=g)),
    "t5": (T.T5Config, T.T5ForConditionalGeneration,
           dict(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
           "input_ids", tokens()),
    "bert": (T.BertConfig, T.BertForSequenceClassification, ENCODER, "input_ids", tokens()),
    "roberta": (T.RobertaConfig, T.RobertaForSequenceClassification, ENCODER, "input_ids",
                tokens()),
    "distilbert": (T.DistilBertConfig, T.DistilBertForSequenceClassification,
                   dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                        seq_classif_dropout=0.0, num_labels=3),
                   "input_ids", tokens()),
    "vit": (T.ViTConfig, T.ViTForImageClassification, VISION, "pixel_values", images(8)),
    "deit": (T.DeiTConfig, T.DeiTForImageClassification, VISION, "pixel_values", images(8)),
    "clip_vision": (T.CLIPVisionConfig, T.CLIPVisionModelWithProjection,
                    dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, image_size=8, patch_size=4, projection_dim=4),
                    "pixel_values", images(8)),
    "swin": (T.SwinConfig, T.SwinForImageClassification,
             dict(image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1],
                  num_heads=[2, 2], window_size=4, num_labels=4, drop_path_rate=0.0,
                  **NO_DROPOUT),
             "pixel_values", images(16)),
    "mobilevit": (T.MobileViTConfig, T.MobileViTForImageClassification,
                  dict(num_channels=3, image_size=32, patch_size=2, hidden_sizes=[16, 16, 16],
                       neck_hidden_sizes=[8, 8, 8, 16, 16, 16, 32], num_attention_heads=2,
                       num_labels=4, classifier_dropout_prob=0.0, **NO_DROPOUT),
                  "pixel_values", images(32)),
    "resnet": (T.ResNetConfig, T.ResNetForImageClassification,
               dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                    layer_type="basic", num_labels=4),
               "pixel_values", images(16)),
    "mobilenet_v2": (T.MobileNetV2Config, T.MobileNetV2ForImageClassification,
                     dict(num_channels=3, image_size=16, depth_multiplier=0.25, num_labels=4,
                          classifier_dropout_prob=0.0),
                     "pixel_values", images(16)),
    "convnext": (T.ConvNextConfig, T.ConvNextForImageClassification,
                 dict(num_stages=2, num_channels=3, hidden_sizes=[8, 16], depths=[1, 1],
                      image_size=16, num_labels=4, drop_path_rate=0.0),
                 "pixel_values", images(16)),
    "segformer": (T.SegformerConfig, T.SegformerForImageClassification,
                  dict(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                       hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2],
                       num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=4,
                       drop_path_rate=0.0, classifier_dropout_prob=0.0, **NO_DROPOUT),
                  "pixel_values", images(16)),
    "efficientnet": (T.EfficientNetConfig, T.EfficientNetForImageClassification,
                     dict(num_channels=3, image_size=32, width_coefficient=0.25,
                          depth_coefficient=0.25, hidden_dim=320, num_labels=4,
                          dropout_rate=0.0, drop_connect_rate=0.0),
                     "pixel_values", images(32)),
    "wav2vec2": (T.Wav2Vec2Config, T.Wav2Vec2ForSequenceClassification,
                 dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2),
                      conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                      num_conv_pos_embedding_groups=2, num_labels=3, hidden_dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                      layerdrop=0.0, mask_time_prob=0.0, final_dropout=0.0,
                      classifier_proj_size=8),
                 "input_values", lambda n, g: torch.randn(n, 200, generator=g)),
}


# transformers' own initialisation leaves these with a vanishing signal at toy width (the
# gradient below the head ~1e-36): torch's defaults instead, as the hf_efficientnet fixture.
TORCH_INIT = {"efficientnet"}


def cross_entropy(logits, labels):
    logits = logits.float() if logits.dtype == torch.float16 else logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def torch_gradients(model, inputs, labels, dtype):
    m = copy.deepcopy(model).to(dtype).train()
    inputs = [i.to(dtype) if i.is_floating_point() else i for i in inputs]
    loss = cross_entropy(m(*inputs), labels)
    loss.backward()
    # Tied weights: every name of the one tensor (the file keeps one of them).
    return float(loss), {k: p.grad.double().numpy()
                         for k, p in m.named_parameters(remove_duplicate=False)
                         if p.grad is not None}


HALF = False
LEGACY = False


def survey(name, workdir):
    config_class, model_class, config, argument, data = MODELS[name]
    torch.manual_seed(0)
    model = Logits(model_class(config_class(**config)), argument).eval()
    if name in TORCH_INIT:
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
                module.reset_parameters()
    g = torch.Generator().manual_seed(1)
    x = data(8, g)
    seq2seq = "decoder_layers" in config or "num_decoder_layers" in config
    inputs = (x, tokens(t=6)(8, g)) if seq2seq else (x,)
    if HALF:
        model = model.half()
        inputs = tuple(i.half() if i.is_floating_point() else i for i in inputs)
    return compare(name, model, inputs, workdir)


def compare(name, model, inputs, workdir):
    """`model(*inputs)` (logits; inputs named x, y) exported, differentiated by onnx-ga with
    a cross-entropy on random labels, its gradient graph run on ONNX Runtime, against torch
    autograd in float32 and float64: one line of findings."""
    names = ["x", "y"][:len(inputs)]
    with torch.no_grad():
        logits = model(*inputs)
    labels = torch.randint(0, logits.shape[-1], logits.shape[:-1],
                           generator=torch.Generator().manual_seed(2))
    path = os.path.join(workdir, f"{name}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if LEGACY:
            torch.onnx.export(copy.deepcopy(model).train(), tuple(i[:4] for i in inputs), path,
                              dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, opset_version=17,
                              input_names=names, output_names=["logits"],
                              dynamic_axes={n: {0: "batch"} for n in names})
        else:
            batch = torch.export.Dim("batch")
            program = torch.onnx.export(copy.deepcopy(model), tuple(i[:4] for i in inputs),
                                        dynamo=True, optimize=False, verbose=False,
                                        input_names=names, output_names=["logits"],
                                        dynamic_shapes={n: {0: batch} for n in names})
            program.save(path)
    gradient_graph = os.path.join(workdir, f"{name}.grad.onnx")
    # torch's export does not record requires_grad (Marian's and Whisper's sinusoidal
    # position tables): frozen by name, as a user would.
    frozen = [f"--freeze={n}" for n, p in model.named_parameters() if not p.requires_grad]
    r = subprocess.run([BIN, "rewrite", path, "-o", gradient_graph, "--pipeline", "autodiff",
                        "--loss-fn", "cross-entropy", *frozen], capture_output=True, text=True)
    if r.returncode != 0:
        return f"rewrite failed: {r.stderr.strip().splitlines()[-1]}"
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(gradient_graph, options)
    # A half model's float inputs are float32 in its gradient graph (onnx-ga's interface).
    feeds = {n: (i.float() if i.is_floating_point() else i).numpy() for n, i in zip(names, inputs)}
    outputs = [o.name for o in session.get_outputs()]
    out = dict(zip(outputs, session.run(None, {**feeds, "labels": labels.numpy()})))
    loss32, g32 = torch_gradients(model, inputs, labels, torch.float16 if HALF else torch.float32)
    _, g64 = torch_gradients(model, inputs, labels, torch.float64)
    whole = np.sqrt(sum(np.sum(v ** 2) for v in g64.values()))
    trained = [k for k in g32 if f"{k}_grad" in out]
    if len(trained) != len({id(p) for p in model.parameters() if p.requires_grad}):
        missing = sorted(set(g32) - set(trained))
        return f"{len(trained)} of the parameters trained; no gradient for {missing[:3]}"
    worst = max(
        (np.linalg.norm(out[f"{k}_grad"] - g64[k]) / max(np.linalg.norm(g64[k]), 1e-3 * whole),
         np.linalg.norm(g32[k] - g64[k]) / max(np.linalg.norm(g64[k]), 1e-3 * whole), k)
        for k in trained)
    return (f"{len(trained)} parameters, loss {abs(float(out['loss']) - loss32):.1e} from torch, "
            f"worst gradient {worst[0]:.1e} from float64 (torch {'float16' if HALF else 'float32'} {worst[1]:.1e}, "
            f"{worst[2]})")


def main(names):
    global HALF, LEGACY
    torch.set_num_threads(1)
    HALF = "--half" in names
    LEGACY = "--legacy" in names
    names = [n for n in names if n not in ("--half", "--legacy")]
    report_each(names or MODELS, survey)


if __name__ == "__main__":
    main(sys.argv[1:])
