"""Forward ONNX models exported from real PyTorch models, and torch reference runs on them.

Writes, per model NAME (torch_mlp, torch_cnn, torch_cnn_nobn, torch_gpt, torch_bert, torch_vit,
torch_unet, torch_rnn, torch_llama):

  graphs/forward/NAME/dynamo.onnx   torch.onnx.export(dynamo=True, optimize=False), batch dynamic
  graphs/forward/NAME/legacy.onnx   torch.onnx.export(dynamo=False, training=TRAINING,
                                    do_constant_folding=False, opset 17), batch dynamic
                                    (not for torch_llama: dynamo.onnx at opset 23, dynamo18.onnx
                                    the same export at opset 18)
  graphs/forward/NAME/data.npz      64 samples: the model input (`x` or `idx`) and `labels`
  fixtures/forward/NAME/...         torch autograd gradients and torch optimizer runs, all
                                    starting from the initializer values in the .onnx files,
                                    keyed by ONNX initializer name; meta.json describes them.

Run through graphs/forward/regen.sh (creates .venv-torch from requirements.txt).
  generate.py                 all models
  generate.py torch_cnn ...   only the named models
Everything is seeded and single-threaded; .npz files are written byte-deterministically.
"""

from __future__ import annotations

import collections
import copy
import io
import json
import math
import os
import platform
import sys
import warnings
import zipfile

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRAPHS = os.path.join(ROOT, "graphs", "forward")
FIXTURES = os.path.join(ROOT, "fixtures", "forward")

N_SAMPLES = 64
GRAD_SAMPLES = 8
STEPS = 8
LEGACY_OPSET = 17
EXPORT_BATCH = 4  # example batch given to both exporters (legacy's trace moves BN stats with it)
SGD = dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, foreach=False)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, foreach=False)
IGNORE_INDEX = -100

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


# ---------------------------------------------------------------------------------------------
# Models


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    """conv-BN-ReLU-maxpool, one residual block (conv-BN-ReLU + skip), spatial mean, linear.
    With bn=False the BatchNorms are gone and the convs have biases."""

    def __init__(self, bn: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=not bn)
        self.bn1 = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=not bn)
        self.bn2 = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = h + F.relu(self.bn2(self.conv2(h)))
        return self.fc(h.mean(dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, the explicit (non-flash) path."""

    def __init__(self, d: int, n_head: int, block: int):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head = n_head
        self.n_embd = d
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, block: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, block)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = GPTMLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT layout and names; torch default initialisation; no dropout; untied lm_head."""

    def __init__(self, vocab=32, block=8, d=16, n_head=2, n_layer=2):
        super().__init__()
        self.block_size = block
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(block, d),
                h=nn.ModuleList([Block(d, n_head, block) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for blk in self.transformer.h:
            x = blk(x)
        return self.lm_head(self.transformer.ln_f(x))


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary position embeddings, through
    F.scaled_dot_product_attention, which the exporter writes as ONNX Attention from opset
    23 on. The rotary frequencies are a non-persistent float buffer, as in Hugging Face's
    Llama: the loss reaches it (cos and sin multiply q and k), and only torch's graph
    signature in the export says that it is not a parameter."""

    def __init__(self, d: int, n_head: int, n_kv_head: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head = n_head, n_kv_head, d // n_head
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, n_kv_head * self.head, bias=False)
        self.v_proj = nn.Linear(d, n_kv_head * self.head, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        half = self.head // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, half, dtype=torch.float32) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, x, t):
        half = self.head // 2
        ang = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x):
        b, t, _ = x.size()
        q = self.q_proj(x).view(b, t, self.n_head, self.head).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_head, self.head).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head).transpose(1, 2)
        q, k = self.rope(q, t), self.rope(k, t)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaBlock(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv_head: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.attn = LlamaAttention(d, n_head, n_kv_head)
        self.mlp_norm = nn.RMSNorm(d)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama layout at toy size: RMSNorm, rotary GQA attention (4 query heads over 2
    key/value heads), SwiGLU MLP, untied head; torch default initialisation."""

    def __init__(self, vocab=32, d=16, n_head=4, n_kv_head=2, n_layer=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([LlamaBlock(d, n_head, n_kv_head) for _ in range(n_layer)])
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class HFLlama(nn.Module):
    """Hugging Face transformers' LlamaForCausalLM at toy size (sdpa attention, no cache),
    as a user would export it: its logits for the token ids."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=16, attn_implementation="sdpa")
        self.m = LlamaForCausalLM(config)

    def forward(self, idx):
        return self.m(input_ids=idx, use_cache=False).logits


class HFGPT2(nn.Module):
    """Hugging Face transformers' GPT2LMHeadModel at toy size: its lm_head is tied to the token
    embedding (torch's signature lists both names; the file holds the tensor once), Conv1D
    layers (addmm of a [in, out] weight), GELU(tanh), learned positions, no dropout."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        self.m = GPT2LMHeadModel(config)

    def forward(self, idx):
        return self.m(input_ids=idx, use_cache=False).logits


class HFEfficientNet(nn.Module):
    """Hugging Face transformers' EfficientNetForImageClassification at toy size (width and
    depth 0.25, 32x32 one-channel images): depthwise convolutions, squeeze-and-excitation, SiLU,
    BatchNorm, and a head `AvgPool2d(hidden_dim, ceil_mode=True)` whose kernel is larger
    than its 1x1 input (ONNX AveragePool with ceil_mode)."""

    def __init__(self):
        super().__init__()
        from transformers import EfficientNetConfig, EfficientNetForImageClassification

        config = EfficientNetConfig(num_channels=1, image_size=32, width_coefficient=0.1,
                                    depth_coefficient=0.25, hidden_dim=128, num_labels=4,
                                    dropout_rate=0.0, drop_connect_rate=0.0)
        self.m = EfficientNetForImageClassification(config)
        # transformers' own initialisation (normal(0, 0.02) convolutions) shrinks the signal
        # about 1e-5 per block at this width: the gradient below the head is ~1e-36 and
        # checks nothing. torch's default initialisation keeps it alive.
        for module in self.m.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
                module.reset_parameters()

    def forward(self, x):
        return self.m(pixel_values=x).logits


class HFWav2Vec2(nn.Module):
    """Hugging Face transformers' Wav2Vec2ForSequenceClassification at toy size on 200
    samples of audio: a 1-D convolutional feature encoder with GroupNorm (exported as
    InstanceNormalization, its scale unsqueezed over `Range` axes), a weight-normed
    convolutional position embedding (torch parametrizations), a post-LN transformer,
    mean pooling, a classifier."""

    def __init__(self):
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

        config = Wav2Vec2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2),
                                conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                                num_conv_pos_embedding_groups=2, num_labels=3,
                                hidden_dropout=0.0, attention_dropout=0.0,
                                activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                                mask_time_prob=0.0, final_dropout=0.0, classifier_proj_size=8)
        self.m = Wav2Vec2ForSequenceClassification(config)

    def forward(self, x):
        return self.m(input_values=x).logits


class HFBert(nn.Module):
    """Hugging Face transformers' BertForSequenceClassification at toy size, called as users
    call it: token ids and an attention mask (0 on the padding), two inputs."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, num_labels=3,
                            attn_implementation="sdpa")
        self.m = BertForSequenceClassification(config)

    def forward(self, idx, attention_mask):
        return self.m(input_ids=idx, attention_mask=attention_mask).logits


class EncoderAttention(nn.Module):
    """Bidirectional multi-head attention with an additive key mask (BERT, ViT). The key
    projection has no bias: its gradient is exactly zero in exact arithmetic (softmax ignores
    a per-query constant), so in float it is rounding noise that Adam turns into lr-sized
    steps of arbitrary sign, in torch and here alike (see torch_gpt's AdamW test)."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.n_head = n_head

    def forward(self, x, key_mask=None):
        B, T, C = x.size()
        hd = C // self.n_head
        q = self.query(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_head, hd).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        if key_mask is not None:
            att = att + key_mask
        y = F.softmax(att, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class BertLayer(nn.Module):
    """Post-LN (BERT): x = LN(x + attn(x)); x = LN(x + FFN(x)), tanh-approximated GELU."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.attention = EncoderAttention(d, n_head)
        self.ln_1 = nn.LayerNorm(d, eps=1e-12)
        self.ff_in = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.ff_out = nn.Linear(4 * d, d)
        self.ln_2 = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x, key_mask):
        x = self.ln_1(x + self.attention(x, key_mask))
        return self.ln_2(x + self.ff_out(self.act(self.ff_in(x))))


class BERT(nn.Module):
    """BERT-style sequence classifier: token + position embeddings (arange), embedding
    LayerNorm, 2 post-LN layers with a padding mask from the tokens (id 0 = pad), tanh
    pooler on the first token, linear classifier. No dropout."""

    def __init__(self, vocab=32, block=8, d=16, n_head=2, n_layer=2, classes=3):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.ln_emb = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList([BertLayer(d, n_head) for _ in range(n_layer)])
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, classes)

    def forward(self, idx):
        b, t = idx.size()
        key_mask = (idx == 0).to(torch.float32)[:, None, None, :] * -10000.0
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.ln_emb(self.tok(idx) + self.pos(pos))
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class ViTBlock(nn.Module):
    """Pre-LN encoder block (ViT): x += attn(LN(x)); x += MLP(LN(x)), erf GELU."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attention = EncoderAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x))))


class ViT(nn.Module):
    """ViT-style classifier: 4x4 patches by a strided Conv2d (8x8 image -> 4 tokens), a class
    token expanded to the batch and concatenated, learned position embeddings, 2 pre-LN
    blocks, final LayerNorm, linear head on the class token. No dropout."""

    def __init__(self, d=16, n_head=2, n_layer=2, classes=4, patch=4, image=8):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens, d))
        self.blocks = nn.ModuleList([ViTBlock(d, n_head) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        b = x.size(0)
        p = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(b, -1, -1), p], dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x)[:, 0])


class UNet(nn.Module):
    """A small encoder-decoder image classifier built from the ops U-Nets, FPNs and recent
    CNNs bring beyond the plain CNN: PReLU (per channel), Mish, a strided encoder, nearest
    upsampling by 2 (Resize) with a skip Concat, PixelShuffle (DepthToSpace), bilinear
    downsampling (Resize, align_corners=False), SiLU, channel attention through einsum,
    global max and mean pooling, a linear head. 3x8x8 images, 4 classes, no BatchNorm."""

    def __init__(self, classes=4):
        super().__init__()
        self.enc1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.PReLU(8)
        self.enc2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.act2 = nn.Mish()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec = nn.Conv2d(24, 16, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)
        self.mix = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        s = self.act1(self.enc1(x))                                  # [B, 8, 8, 8]
        h = self.act2(self.enc2(s))                                  # [B, 16, 4, 4]
        h = self.dec(torch.cat([self.up(h), s], dim=1))              # [B, 16, 8, 8]
        h = self.shuffle(h)                                          # [B, 4, 16, 16]
        h = F.interpolate(h, scale_factor=0.5, mode="bilinear", align_corners=False)
        h = F.silu(self.mix(h))                                      # [B, 8, 8, 8]
        f = h.flatten(2)                                             # [B, 8, 64]
        att = torch.softmax(torch.einsum("bci,bdi->bcd", f, f) / 8.0, dim=-1)
        f = torch.einsum("bcd,bdi->bci", att, f).reshape(h.shape) + h
        pooled = torch.cat([F.adaptive_max_pool2d(f, 1), F.adaptive_avg_pool2d(f, 1)], dim=1)
        return self.head(pooled.flatten(1))


class RecurrentClassifier(nn.Module):
    """A sequence classifier of recurrent layers: token embeddings, a two-layer
    bidirectional LSTM, a GRU over its outputs, a linear head on the GRU's last state.
    batch_first, torch's zero initial states, 3 classes; the tokens of make_data_bert."""

    def __init__(self, vocab=32, d=12, hidden=10, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(2 * hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx):
        h, _ = self.lstm(self.emb(idx))
        _, last = self.gru(h)
        return self.head(last[0])


class CondMLP(nn.Module):
    """An MLP whose hidden layer goes through one of two experts, chosen per batch by a
    condition on the data (`torch.cond`: ONNX If, both branches reading the parameters of the
    enclosing graph): tanh(a(h)) where the batch's mean input is positive, sigmoid(b(h)) * h
    otherwise."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))

        def then(h):
            return torch.tanh(self.a(h))

        def otherwise(h):
            return torch.sigmoid(self.b(h)) * h

        return self.out(torch.cond(x.mean() > 0, then, otherwise, (h,)))


def make_data_bert(rng):
    idx = rng.integers(1, 32, size=(N_SAMPLES, 8)).astype(np.int64)
    pads = rng.integers(0, 5, size=N_SAMPLES)  # 0..4 trailing pad tokens (id 0) per row
    for r, p in enumerate(pads):
        if p:
            idx[r, 8 - p:] = 0
    return {"idx": idx, "labels": rng.integers(0, 3, size=N_SAMPLES).astype(np.int64)}


def make_data_bert_masked(rng):
    """make_data_bert's tokens and labels, with the mask a tokenizer gives: 1 on the tokens, 0
    on the trailing padding."""
    data = make_data_bert(rng)
    return {"idx": data["idx"], "attention_mask": (data["idx"] != 0).astype(np.int64),
            "labels": data["labels"]}


def make_data_mlp(rng):
    return {
        "x": rng.standard_normal((N_SAMPLES, 16)).astype(np.float32),
        "labels": rng.integers(0, 10, size=N_SAMPLES).astype(np.int64),
    }


def make_data_cond(rng):
    """make_data_mlp's shapes, each block of 8 rows shifted by +-0.4 (+ - - + + - + -), so that
    a micro-batch of 8 takes CondMLP's then branch or its else branch by a wide margin (the
    mean of 128 values of N(0.4, 1): 4.5 standard deviations from 0). Rows [0, 8) take the
    then branch, [8, 16) the else branch."""
    x = rng.standard_normal((N_SAMPLES, 16)).astype(np.float32)
    signs = np.repeat(np.array([1, -1, -1, 1, 1, -1, 1, -1], dtype=np.float32), 8)
    return {
        "x": (x + 0.4 * signs[:, None]).astype(np.float32),
        "labels": rng.integers(0, 10, size=N_SAMPLES).astype(np.int64),
    }


def make_data_cnn(rng):
    return {
        "x": rng.standard_normal((N_SAMPLES, 3, 8, 8)).astype(np.float32),
        "labels": rng.integers(0, 4, size=N_SAMPLES).astype(np.int64),
    }


def make_data_image32(rng):
    """32x32 one-channel images: the smallest an EfficientNet's five stride-2 stages take."""
    return {
        "x": rng.standard_normal((N_SAMPLES, 1, 32, 32)).astype(np.float32),
        "labels": rng.integers(0, 4, size=N_SAMPLES).astype(np.int64),
    }


def make_data_audio(rng):
    return {
        "x": rng.standard_normal((N_SAMPLES, 200)).astype(np.float32),
        "labels": rng.integers(0, 3, size=N_SAMPLES).astype(np.int64),
    }


def make_data_gpt(rng):
    seq = rng.integers(0, 32, size=(N_SAMPLES, 9)).astype(np.int64)
    idx, labels = seq[:, :8].copy(), seq[:, 1:].copy()
    pads = rng.integers(0, 5, size=N_SAMPLES)  # 0..4 trailing padded positions per row
    for r, p in enumerate(pads):
        if p:
            labels[r, 8 - p:] = IGNORE_INDEX
            idx[r, 8 - p:] = 0  # pad token; causal, so it only reaches ignored positions
    return {"idx": idx, "labels": labels}


MODELS = {
    "torch_mlp": dict(make=MLP, seed=0, input="x", data=make_data_mlp, batch=32, runs=True,
                      desc="Linear(16,32) -> ReLU -> Linear(32,10)"),
    "torch_cnn": dict(make=lambda: CNN(bn=True), seed=1, input="x", data=make_data_cnn,
                      batch=32, runs=False,
                      desc="Conv2d(3,8,3,p=1,no bias) -> BatchNorm2d -> ReLU -> MaxPool2d(2) -> "
                           "h + ReLU(BatchNorm2d(Conv2d(8,8,3,p=1,no bias)(h))) -> mean(H,W) -> Linear(8,4)"),
    "torch_cnn_nobn": dict(make=lambda: CNN(bn=False), seed=2, input="x", data=make_data_cnn,
                           batch=32, runs=True,
                           desc="torch_cnn without BatchNorm, convs with bias"),
    "torch_gpt": dict(make=GPT, seed=3, input="idx", data=make_data_gpt, batch=16, runs=True,
                      desc="nanoGPT-style decoder: vocab 32, T=8, d 16, 2 heads, 2 layers, pre-LN, "
                           "wte + wpe(arange(T)), causal masked_fill(-inf) from a tril buffer, "
                           "GELU(erf) MLP 4d, ln_f, lm_head (no bias, untied), no dropout"),
    "torch_bert": dict(make=BERT, seed=4, input="idx", data=make_data_bert, batch=16, runs=True,
                       desc="BERT-style classifier: vocab 32, T=8, d 16, 2 heads, 2 post-LN layers "
                            "(LayerNorm eps 1e-12), tok + pos(arange(T)) embeddings, embedding "
                            "LayerNorm, additive padding mask from idx == 0, GELU(tanh) FFN 4d, "
                            "tanh pooler on token 0, 3 classes, key projection without bias"),
    "torch_vit": dict(make=ViT, seed=5, input="x", data=make_data_cnn, batch=16, runs=True,
                      adamw64=True,
                      desc="ViT-style classifier: Conv2d(3,16,4,stride 4) patches of an 8x8 image, "
                           "cls_token.expand(B) concatenated, + pos_embed, 2 pre-LN blocks (2 "
                           "heads, GELU(erf) MLP 4d), LayerNorm, head on token 0, 4 classes, key "
                           "projection without bias"),
    "torch_unet": dict(make=UNet, seed=6, input="x", data=make_data_cnn, batch=16, runs=True,
                       desc="encoder-decoder classifier: Conv2d -> PReLU(8) -> strided Conv2d -> "
                            "Mish -> Upsample(x2, nearest) ++ skip -> Conv2d -> PixelShuffle(2) -> "
                            "bilinear x0.5 -> Conv2d -> SiLU -> einsum channel attention + residual "
                            "-> [global max ++ global mean] -> Linear(16, 4)"),
    "torch_llama": dict(make=Llama, seed=8, input="idx", data=make_data_gpt, batch=16, runs=True,
                        dynamo_opset=23, legacy=False,
                        desc="Llama-style decoder: vocab 32, T=8, d 16, 2 layers, RMSNorm, rotary "
                             "(inv_freq a non-persistent buffer), scaled_dot_product_attention(is_causal, "
                             "enable_gqa) with 4 query heads over 2 key/value heads, SwiGLU MLP "
                             "2d, untied lm_head; dynamo at opset 23 (ONNX Attention and "
                             "RMSNormalization) and at opset 18 (dynamo18: both written out); "
                             "no legacy export"),
    "hf_llama": dict(make=HFLlama, seed=9, input="idx", data=make_data_gpt, batch=16, runs=True,
                     dynamo_opset=23, legacy=False, node_metadata=False, adamw64=True,
                     desc="Hugging Face transformers LlamaForCausalLM: vocab 32, d 16, 2 layers, "
                          "4 query heads over 2 key/value heads, SwiGLU 32, rotary inv_freq "
                          "buffer, sdpa attention, use_cache=False; dynamo at opset 23 and 18"),
    "hf_gpt2": dict(make=HFGPT2, seed=10, input="idx", data=make_data_gpt, batch=16, runs=True,
                    legacy=False, node_metadata=False,
                    desc="Hugging Face transformers GPT2LMHeadModel: vocab 32, d 16, 2 layers, "
                         "2 heads, lm_head tied to the token embedding, Conv1D layers, "
                         "GELU(tanh), learned positions; dynamo at its default opset"),
    "hf_efficientnet": dict(make=HFEfficientNet, seed=11, input="x", data=make_data_image32,
                            batch=32, runs=False, legacy=False, node_metadata=False,
                            desc="Hugging Face transformers EfficientNetForImageClassification: "
                                 "width 0.1, depth 0.25, 32x32 one-channel images, depthwise convolutions, "
                                 "squeeze-and-excitation, SiLU, BatchNorm, AvgPool2d head with "
                                 "ceil_mode and a kernel larger than its input, 4 classes"),
    "hf_wav2vec2": dict(make=HFWav2Vec2, seed=12, input="x", data=make_data_audio, batch=16,
                        runs=True, legacy=False, node_metadata=False,
                        desc="Hugging Face transformers Wav2Vec2ForSequenceClassification: 200 "
                             "audio samples, two 1-D convolutions (GroupNorm on the first), "
                             "weight-normed convolutional positions, 2 post-LN layers of d 16, "
                             "mean pooling, 3 classes"),
    "hf_bert": dict(make=HFBert, seed=13, input="idx", extra_inputs=["attention_mask"],
                    data=make_data_bert_masked, batch=16, runs=True, legacy=False, adamw64=True,
                    node_metadata=False,
                    desc="Hugging Face transformers BertForSequenceClassification: vocab 32, d 16, "
                         "2 layers, 2 heads, two inputs (token ids and the attention mask, 0 "
                         "on the padding), sdpa attention, pooler, 3 classes"),
    "torch_cond": dict(make=CondMLP, seed=14, input="x", data=make_data_cond, batch=32,
                       runs=False, legacy=False, micro=("sgd", "adamw"), else_rows=True,
                       runs_skipped="the branch is chosen per batch: K micro-batches of 8 "
                                    "cannot equal one batch of 32; see micro",
                       desc="Linear(16,32) -> ReLU -> torch.cond(x.mean() > 0, tanh(Linear(32,32)), "
                            "sigmoid(Linear(32,32)) * h) -> Linear(32,10); dynamo only (ONNX If)"),
    "torch_rnn": dict(make=RecurrentClassifier, seed=7, input="idx", data=make_data_bert, batch=16,
                      runs=True,
                      desc="sequence classifier: Embedding(32, 12) -> 2-layer bidirectional "
                           "LSTM(12, 10, batch_first) -> GRU(20, 10, batch_first) -> Linear(10, 3) "
                           "on the GRU's last state"),
}


# ---------------------------------------------------------------------------------------------
# Helpers


def save_npz(path: str, arrays: dict) -> None:
    """np.savez-compatible (uncompressed, `<key>.npy` members in insertion order), with fixed
    member timestamps so that regenerated files are byte-identical."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            a = np.asarray(arr)  # (np.ascontiguousarray would make a scalar 1-d)
            if not a.flags.c_contiguous:
                a = a.copy(order="C")
            np.lib.format.write_array(buf, a, allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def loss_fn(logits, labels):
    """Mean cross-entropy over all non-ignored positions; classes on the last axis."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="mean")


def op_counts(model: onnx.ModelProto) -> dict:
    c = collections.Counter(
        (n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}")
        for n in model.graph.node
    )
    return dict(sorted(c.items()))


def strip_stack_traces(model: onnx.ModelProto) -> int:
    """Drop the dynamo exporter's per-node `pkg.torch.onnx.stack_trace` metadata: it holds the
    absolute paths of this script and of the venv's torch (so the bytes would depend on where
    the repo lives) and is most of the file. Semantics are untouched."""
    n = 0
    for node in model.graph.node:
        keep = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        n += len(node.metadata_props) - len(keep)
        del node.metadata_props[:]
        node.metadata_props.extend(keep)
    return n


def export_dynamo(model, example, names, path, opset=None, node_metadata=True):
    """`example`: one tensor per input of `names` (the forward's argument names)."""
    m = copy.deepcopy(model).eval()
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            m, tuple(example), dynamo=True, optimize=False, verbose=False, opset_version=opset,
            input_names=list(names), output_names=["logits"],
            dynamic_shapes={n: {0: batch} for n in names},
        )
    proto = prog.model_proto
    stripped = strip_stack_traces(proto)
    info = {"exported_from": "model.eval() (deep copy)", "stack_trace_metadata_stripped": stripped}
    if not node_metadata:
        # The exporter's per-node provenance (namespace, class hierarchy, fx node, name
        # scopes) is most of a transformers model's file: 0.4 of 0.56 MB here. Semantics
        # are untouched; the graph's own metadata (torch's signature) stays.
        for node in proto.graph.node:
            del node.metadata_props[:]
        info["node_metadata_stripped"] = True
    onnx.save_model(proto, path, save_as_external_data=False)
    return info


def export_legacy(model, example, names, path):
    m = copy.deepcopy(model)  # TRAINING export runs the BN trace in train mode: moves stats
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            m, tuple(example), path, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False, opset_version=LEGACY_OPSET,
            input_names=list(names), output_names=["logits"],
            dynamic_axes={**{n: {0: "batch"} for n in names}, "logits": {0: "batch"}},
        )
    return {"exported_from": "deep copy, training=TrainingMode.TRAINING"}


def onnx_initializers(path) -> dict:
    m = onnx.load(path)
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


def map_state(model: nn.Module, inits: dict):
    """torch state name -> ONNX initializer name. Names are expected to survive; anything not
    found by name is matched by unique value (and recorded)."""
    sd = model.state_dict()
    params = dict(model.named_parameters())
    mapping, by_value = {}, {}
    for tname, t in sd.items():
        if tname in inits and tuple(inits[tname].shape) == tuple(t.shape):
            mapping[tname] = tname
            continue
        if tname.endswith("num_batches_tracked"):
            continue
        hits = [o for o, a in inits.items()
                if a.shape == tuple(t.shape) and a.dtype == t.detach().numpy().dtype
                and np.array_equal(a, t.detach().numpy()) and o not in mapping.values()]
        if len(hits) == 1:
            mapping[tname] = by_value[tname] = hits[0]
        elif tname in params:
            raise SystemExit(f"parameter {tname} has no initializer by name or unique value")
    return mapping, by_value


def load_state_from_onnx(make, seed, mapping, inits):
    torch.manual_seed(seed)
    model = make()
    sd = model.state_dict()
    for tname, oname in mapping.items():
        sd[tname] = torch.from_numpy(inits[oname].copy())
    model.load_state_dict(sd)
    return model


def trainable(model, mapping):
    return [(mapping[n], p) for n, p in model.named_parameters()]


class Exported:
    """A committed model as the reference scripts (clip_, eval_, no_decay_, bn_reference.py)
    start from: its spec, folders, input names and data, and the torch model holding the
    export's initial state (`mapping`: torch state name -> ONNX initializer name)."""

    def __init__(self, name: str, export: str = "dynamo"):
        self.spec = MODELS[name]
        self.graphs = os.path.join(GRAPHS, name)
        self.fixtures = os.path.join(FIXTURES, name)
        self.names = [self.spec["input"], *self.spec.get("extra_inputs", [])]
        self.data = dict(np.load(os.path.join(self.graphs, "data.npz")))
        inits = onnx_initializers(os.path.join(self.graphs, f"{export}.onnx"))
        torch.manual_seed(self.spec["seed"])
        self.mapping, _ = map_state(self.spec["make"](), inits)
        self.model = load_state_from_onnx(self.spec["make"], self.spec["seed"], self.mapping, inits)


def to_inputs(data, sl, names, dtype=torch.float32):
    """The model's inputs (a tuple, in `names` order; floats as `dtype`) and the labels."""
    xs = tuple(torch.from_numpy(data[n][sl]) for n in names)
    xs = tuple(x.to(dtype) if x.is_floating_point() else x for x in xs)
    return xs, torch.from_numpy(data["labels"][sl])


def step_inputs(data, names, batch, t, dtype=torch.float32):
    """The inputs and labels of full-batch step t: rows [t*batch, (t+1)*batch), wrapping."""
    return to_inputs(data, (np.arange(batch) + batch * t) % N_SAMPLES, names, dtype)


def grads_ref(model, mapping, data, names, dtype, rows=slice(0, GRAD_SAMPLES)):
    m = copy.deepcopy(model)
    if dtype == torch.float64:
        m = m.double()
    m.train()
    x, y = to_inputs(data, rows, names, dtype)
    loss = loss_fn(m(*x), y)
    loss.backward()
    out = {"loss": loss.detach().numpy()}
    for oname, p in trainable(m, mapping):
        out[oname] = p.grad.detach().numpy()
    return out


def run_full(model, mapping, data, names, opt_name, batch, dtype=torch.float32):
    m = copy.deepcopy(model).train()
    if dtype == torch.float64:
        m = m.double()
    params = [p for _, p in m.named_parameters()]
    opt = torch.optim.SGD(params, **SGD) if opt_name == "sgd" else torch.optim.AdamW(params, **ADAMW)
    losses = []
    for t in range(STEPS):
        x, y = step_inputs(data, names, batch, t, dtype)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m(*x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {o: p.detach().numpy().copy() for o, p in trainable(m, mapping)}, losses


def run_micro_sgd(model, mapping, data, names, k=4, micro=8, opt_name="sgd"):
    m = copy.deepcopy(model).train()
    params = [p for _, p in m.named_parameters()]
    opt = torch.optim.SGD(params, **SGD) if opt_name == "sgd" else torch.optim.AdamW(params, **ADAMW)
    window = k * micro
    opt.zero_grad(set_to_none=True)
    for t in range(STEPS):
        for j in range(k):
            idx = (np.arange(micro) + window * t + micro * j) % N_SAMPLES
            x, y = to_inputs(data, idx, names)
            (loss_fn(m(*x), y) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {o: p.detach().numpy().copy() for o, p in trainable(m, mapping)}
    stats, tracked = {}, {}
    for n, b in m.named_buffers():
        if n.endswith("running_mean") or n.endswith("running_var"):
            stats[mapping[n]] = b.detach().numpy().copy()
        elif n.endswith("num_batches_tracked"):
            tracked[n] = int(b)
    return params, stats, tracked


def ort_forward_check(path, model, data, names, bn_training_mode):
    """ORT logits vs torch logits with the file's state, on batches of 8 and 64. A BatchNorm in
    inference form is compared with torch eval(), in training form with torch train()."""
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    worst = 0.0
    for n in (8, N_SAMPLES):
        xs = [data[name][:n] for name in names]
        got = sess.run(["logits"], dict(zip(names, xs)))[0]
        m = copy.deepcopy(model)
        m.train() if bn_training_mode else m.eval()
        with torch.no_grad():
            want = m(*map(torch.from_numpy, xs)).numpy()
        if got.shape != want.shape:
            raise SystemExit(f"{path}: ORT shape {got.shape} != torch {want.shape}")
        worst = max(worst, float(np.max(np.abs(got - want))))
    if worst > 1e-5:
        raise SystemExit(f"{path}: ORT forward differs from torch by {worst:.3g}")
    return {"batches": [8, N_SAMPLES], "torch_mode": "train" if bn_training_mode else "eval",
            "max_abs_diff": worst}


def bn_forms(model: onnx.ModelProto):
    forms = set()
    for n in model.graph.node:
        if n.op_type == "BatchNormalization":
            tm = [a.i for a in n.attribute if a.name == "training_mode"]
            forms.add(f"training_mode={tm[0] if tm else 0}, outputs={len([o for o in n.output if o])}")
    return sorted(forms)


def probe_dynamo_train_mode(model, example, names, data):
    """Export a train() copy with dynamo as well (not saved): which BatchNormalization form."""
    m = copy.deepcopy(model).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            m, tuple(example), dynamo=True, optimize=False, verbose=False,
            input_names=list(names), output_names=["logits"],
            dynamic_shapes={n: {0: torch.export.Dim("batch")} for n in names},
        )
    proto = prog.model_proto
    moved = any(not torch.equal(a, b) for a, b in zip(m.buffers(), model.buffers()))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    xs = [data[n][:8] for n in names]
    got = sess.run(["logits"], dict(zip(names, xs)))[0]
    diffs = {}
    for mode in ("train", "eval"):
        mm = copy.deepcopy(model)
        getattr(mm, mode)()
        with torch.no_grad():
            diffs[mode] = float(np.max(np.abs(got - mm(*map(torch.from_numpy, xs)).numpy())))
    return {"bn_forms": bn_forms(proto), "op_counts": op_counts(proto),
            "torch_buffers_moved_by_export": moved,
            "ort_logits_max_abs_diff_vs_torch": diffs}


def versions():
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
    }


def shape_of(value_info):
    dims = []
    for d in value_info.type.tensor_type.shape.dim:
        dims.append(d.dim_param if d.HasField("dim_param") else d.dim_value)
    return dims


# ---------------------------------------------------------------------------------------------


def generate(name: str, spec: dict) -> dict:
    gdir, fdir = os.path.join(GRAPHS, name), os.path.join(FIXTURES, name)
    os.makedirs(gdir, exist_ok=True)
    os.makedirs(fdir, exist_ok=True)
    for d in (fdir,):
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
    inp = spec["input"]
    names = [inp, *spec.get("extra_inputs", [])]  # the forward's arguments, in order

    rng = np.random.default_rng(1000 + spec["seed"])
    data = spec["data"](rng)
    save_npz(os.path.join(gdir, "data.npz"), data)

    torch.manual_seed(spec["seed"])
    ref = spec["make"]()
    ref_state = copy.deepcopy(ref.state_dict())
    example = tuple(torch.from_numpy(data[n][:EXPORT_BATCH]) for n in names)

    exports, states, failures = {}, {}, {}
    keep = spec.get("node_metadata", True)
    exporters = [("dynamo", lambda *a: export_dynamo(*a, opset=spec.get("dynamo_opset"),
                                                     node_metadata=keep))]
    if spec.get("dynamo_opset"):
        # the same model at the exporter's default opset too (ops written out, no
        # Attention or RMSNormalization)
        exporters.append(("dynamo18", lambda *a: export_dynamo(*a, opset=18, node_metadata=keep)))
    if spec.get("legacy", True):
        exporters.append(("legacy", export_legacy))
    for kind, fn in exporters:
        path = os.path.join(gdir, f"{kind}.onnx")
        try:
            info = fn(ref, example, names, path)
        except Exception as e:  # recorded, the other export goes on
            failures[kind] = f"{type(e).__name__}: {e}"
            if os.path.exists(path):
                os.remove(path)
            continue
        assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ref_state.items()), \
            "export moved the reference model's state"
        proto = onnx.load(path)
        inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        assert not any(i.data_location == onnx.TensorProto.EXTERNAL for i in proto.graph.initializer)
        mapping, by_value = map_state(ref, inits)
        model = load_state_from_onnx(spec["make"], spec["seed"], mapping, inits)
        params = dict(ref.named_parameters())
        bufs = dict(ref.named_buffers())
        rev = {o: t for t, o in mapping.items()}
        init_list = []
        for i in proto.graph.initializer:
            t = rev.get(i.name)
            kind_of = "parameter" if t in params else ("buffer" if t in bufs else "other")
            init_list.append({"name": i.name, "shape": list(i.dims),
                              "dtype": onnx.TensorProto.DataType.Name(i.data_type),
                              "kind": kind_of, **({"torch_name": t} if t and t != i.name else {})})
        changed = sorted(t for t, o in mapping.items()
                         if not np.array_equal(inits[o], ref_state[t].numpy()))
        bn_train = any(f.startswith("training_mode=1") for f in bn_forms(proto))
        info.update({
            "file": f"graphs/forward/{name}/{kind}.onnx",
            "bytes": os.path.getsize(path),
            "ir_version": proto.ir_version,
            "opset": {(o.domain or "ai.onnx"): o.version for o in proto.opset_import},
            "inputs": {v.name: shape_of(v) for v in proto.graph.input},
            "outputs": {v.name: shape_of(v) for v in proto.graph.output},
            "op_counts": op_counts(proto),
            "nodes": len(proto.graph.node),
            "batchnorm": bn_forms(proto),
            "initializers": init_list,
            "torch_names_not_surviving": ({t: o for t, o in by_value.items()} or None),
            "torch_state_missing_from_file": sorted(set(ref_state) - set(mapping)),
            "initializers_differing_from_torch_model": changed,
            "ort_forward_check": ort_forward_check(path, model, data, names, bn_train),
        })
        if name == "torch_cnn" and kind == "legacy":
            # is the file's running stats exactly one momentum update from the example batch?
            m = copy.deepcopy(ref).train()
            with torch.no_grad():
                m(*example)
            one = all(np.array_equal(inits[mapping[n]], b.numpy()) for n, b in m.named_buffers()
                      if n in mapping)
            info["running_stats_are_one_train_forward_of_example_batch"] = one
        exports[kind] = info
        states[kind] = (model, mapping)
        print(f"  {kind}: {info['bytes']} B, opset {info['opset']}, {info['nodes']} nodes, "
              f"ORT max|diff| {info['ort_forward_check']['max_abs_diff']:.2e} "
              f"({info['ort_forward_check']['torch_mode']})")
        print(f"    ops: {info['op_counts']}")
        if info["batchnorm"]:
            print(f"    BatchNormalization: {info['batchnorm']}")
        if changed:
            print(f"    initializers differing from the torch model: {changed}")

    if not states:
        raise SystemExit(f"{name}: both exports failed: {failures}")

    # one reference set when both files hold the same values, else one per export
    def same(a, b):
        (ma, mpa), (mb, mpb) = a, b
        sa, sb = ma.state_dict(), mb.state_dict()
        return mpa == mpb and all(torch.equal(sa[k], sb[k]) for k in mpa)

    kinds = list(states)
    shared = len(kinds) == 1 or same(states[kinds[0]], states[kinds[1]])
    ref_sets = {"": states[kinds[0]]} if shared else {f"{k}_": states[k] for k in kinds}

    refs = {}
    for prefix, (model, mapping) in ref_sets.items():
        files = {}
        g32 = grads_ref(model, mapping, data, names, torch.float32)
        g64 = grads_ref(model, mapping, data, names, torch.float64)
        save_npz(os.path.join(fdir, f"{prefix}grads.npz"), g32)
        save_npz(os.path.join(fdir, f"{prefix}grads64.npz"), g64)
        files["grads"] = f"{prefix}grads.npz"
        files["grads64"] = f"{prefix}grads64.npz"
        files["loss_first8"] = float(g32["loss"])
        files["loss_first8_float64"] = float(g64["loss"])
        if spec["runs"]:
            for opt_name in ("sgd", "adamw"):
                params, losses = run_full(model, mapping, data, names, opt_name, spec["batch"])
                save_npz(os.path.join(fdir, f"{prefix}run_{opt_name}.npz"), params)
                files[f"run_{opt_name}"] = f"{prefix}run_{opt_name}.npz"
                files[f"run_{opt_name}_losses"] = losses
            if spec.get("adamw64"):
                # The same AdamW run in float64: how far torch's own float32 run is from
                # exact arithmetic, element by element (Adam amplifies the rounding of small
                # gradients into lr-sized differences).
                params, _ = run_full(model, mapping, data, names, "adamw", spec["batch"],
                                     torch.float64)
                save_npz(os.path.join(fdir, f"{prefix}run_adamw64.npz"), params)
                files["run_adamw64"] = f"{prefix}run_adamw64.npz"
        if spec.get("else_rows"):
            # rows [8, 16): the else branch of the condition on the data
            rows = slice(GRAD_SAMPLES, 2 * GRAD_SAMPLES)
            for suffix, dtype in (("", torch.float32), ("64", torch.float64)):
                g = grads_ref(model, mapping, data, names, dtype, rows)
                save_npz(os.path.join(fdir, f"{prefix}grads_else{suffix}.npz"), g)
                files[f"grads_else{suffix}"] = f"{prefix}grads_else{suffix}.npz"
        for opt_name in spec.get("micro", ()):
            params, _, _ = run_micro_sgd(model, mapping, data, names, opt_name=opt_name)
            save_npz(os.path.join(fdir, f"{prefix}run_micro_{opt_name}.npz"), params)
            files[f"run_micro_{opt_name}"] = f"{prefix}run_micro_{opt_name}.npz"
        if name == "torch_cnn":
            params, stats, tracked = run_micro_sgd(model, mapping, data, names)
            save_npz(os.path.join(fdir, f"{prefix}run_micro_sgd.npz"), params)
            save_npz(os.path.join(fdir, f"{prefix}running_stats.npz"), stats)
            files["run_micro_sgd"] = f"{prefix}run_micro_sgd.npz"
            files["running_stats"] = f"{prefix}running_stats.npz"
            files["num_batches_tracked_after"] = tracked
        refs[(prefix.rstrip("_") or "both")] = files

    model, mapping = states[kinds[0]]
    param_names = [(mapping[n], list(p.shape)) for n, p in model.named_parameters()]
    x_arr = data[inp]
    meta = {
        "model": name,
        "description": spec["desc"],
        "versions": versions(),
        "input": {"name": inp, "dtype": str(x_arr.dtype), "shape": ["N", *x_arr.shape[1:]]},
        **({"extra_inputs": {n: {"dtype": str(data[n].dtype), "shape": ["N", *data[n].shape[1:]]}
                             for n in names[1:]}} if names[1:] else {}),
        "output": {"name": "logits", "shape": ["N", *list(model.eval()(*(
            torch.from_numpy(data[n][:1]) for n in names)).shape[1:])]},
        "labels": {"name": "labels", "dtype": "int64", "shape": ["N", *data["labels"].shape[1:]]},
        "parameters": {n: s for n, s in param_names},
        "buffers": {mapping.get(n, n): list(b.shape) for n, b in model.named_buffers()
                    if not n.endswith("num_batches_tracked")},
        "loss": {"fn": "cross-entropy", "reduction": "mean", "class_axis": -1,
                 "ignore_index": IGNORE_INDEX,
                 "normalisation": "divided by the number of non-ignored labels in the batch",
                 "torch": "F.cross_entropy(logits.reshape(-1, C), labels.reshape(-1), "
                          "ignore_index=-100, reduction='mean')"},
        "data": {"file": f"graphs/forward/{name}/data.npz", "samples": N_SAMPLES,
                 "arrays": {k: [str(v.dtype), list(v.shape)] for k, v in data.items()},
                 "seed": f"numpy default_rng({1000 + spec['seed']})"},
        "torch_init_seed": spec["seed"],
        "export_example_input": f"data.npz {inp}[0:{EXPORT_BATCH}]",
        "exports": exports,
        "export_failures": failures or None,
        "references_per_export": not shared,
        "references_note": (
            "references start from the initializer values read back from the .onnx file(s), "
            "loaded into the torch model by name; the torch model is in train() mode"
        ),
        "grads": {"samples": f"[0, {GRAD_SAMPLES})", "mode": "train()",
                  "keys": "'loss' (scalar, mean CE) and, per trainable parameter, its gradient keyed "
                          "by ONNX initializer name",
                  "dtypes": {"grads.npz": "float32", "grads64.npz": "float64 (model.double())"}},
        "references": refs,
    }
    if data["labels"].ndim == 2:
        meta["data"]["non_ignored_labels_first8"] = int((data["labels"][:GRAD_SAMPLES] != IGNORE_INDEX).sum())
        meta["data"]["padded_positions_per_row"] = (data["labels"] == IGNORE_INDEX).sum(1).tolist()
    if spec["runs"]:
        b = spec["batch"]
        meta["runs"] = {
            "steps": STEPS, "batch": b,
            "sampling": f"step t (0-based) takes samples (arange({b}) + {b}*t) mod {N_SAMPLES}",
            "sgd": {"torch": "torch.optim.SGD", **SGD},
            "adamw": {"torch": "torch.optim.AdamW", **{k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in ADAMW.items()}},
            "keys": "trainable parameters after the last step, by ONNX initializer name",
        }
        if data["labels"].ndim == 2:
            meta["runs"]["non_ignored_labels_per_step"] = [
                int((data["labels"][(np.arange(b) + b * t) % N_SAMPLES] != IGNORE_INDEX).sum())
                for t in range(STEPS)]
        if b == 16:
            meta["runs"]["note"] = ("full batch of 16 samples (not 32) per step; "
                                    "K=4 micro-batches of 4 sequences is the matching accumulation")
    else:
        meta["runs"] = {"skipped": spec.get(
            "runs_skipped", "BatchNorm: K micro-batches cannot equal one full batch "
                            "(batch statistics differ); see micro")}
    if spec.get("micro"):
        meta["micro"] = {
            "windows": STEPS, "K": 4, "micro_batch": 8, "optimizers": list(spec["micro"]),
            "sampling": "window t, micro-batch j takes samples (arange(8) + 32*t + 8*j) mod 64",
            "loop": "per micro-batch: (mean CE / K).backward() accumulating .grad; after the K-th: "
                    "optimizer.step(), optimizer.zero_grad()",
            "sgd": {"torch": "torch.optim.SGD", **SGD},
            "adamw": {"torch": "torch.optim.AdamW", **{k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in ADAMW.items()}},
            "why": "the branch is chosen per batch: K micro-batches of 8 take their own branches, "
                   "a batch of 32 one, so only torch's own micro-batch loop is the reference",
        }
    if name == "torch_cnn":
        meta["micro"] = {
            "windows": STEPS, "K": 4, "micro_batch": 8,
            "sampling": "window t, micro-batch j takes samples (arange(8) + 32*t + 8*j) mod 64",
            "loop": "per micro-batch: (mean CE / K).backward() accumulating .grad; after the K-th: "
                    "optimizer.step(), optimizer.zero_grad()",
            "sgd": {"torch": "torch.optim.SGD", **SGD},
            "bn": {"momentum_torch": 0.1, "eps": 1e-5},
        }
        meta["micro"]["running_stats"] = (
            "torch updates BatchNorm running stats at every micro-step (each train() forward), "
            "32 updates over 8 windows: running = 0.9 * running + 0.1 * batch_stat, the variance "
            "unbiased (n / (n - 1)) with n = 8*8*8 = 512 for bn1 and n = 8*4*4 = 128 for bn2; "
            "the normalisation itself uses the biased variance. ONNX momentum attribute = 0.9.")
        meta["dynamo_export_of_train_mode_model"] = probe_dynamo_train_mode(ref, example, names, data)
        print("  probe, dynamo export of the model in train():",
              json.dumps({k: v for k, v in meta["dynamo_export_of_train_mode_model"].items()
                         if k != "op_counts"}))
    with open(os.path.join(fdir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=False)
        f.write("\n")
    return meta


def main(argv):
    names = argv or list(MODELS)
    for n in names:
        if n not in MODELS:
            raise SystemExit(f"unknown model {n}; known: {', '.join(MODELS)}")
    print("versions:", versions())
    for n in names:
        print(f"{n}:")
        generate(n, MODELS[n])


if __name__ == "__main__":
    main(sys.argv[1:])
