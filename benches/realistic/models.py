"""The realistic benchmark's models (PyTorch), shared by generate.py (export) and peers.py
(the PyTorch-eager column). Sizes as issue 14 asks:

- mlp:       Linear(784,1024) ReLU Linear(1024,1024) ReLU Linear(1024,10); 1,863,690 parameters
- resnet_bn: ResNet-8 for 3x32x32 images (CIFAR layout): conv3x3(16) BN ReLU, three stages
             of one basic block (16, 32, 64 channels; stride 2 and a 1x1 conv + BN shortcut
             from the second on), global average pool, Linear(64,10); 78,042 parameters
- resnet:    the same without BatchNorm (the convolutions have biases); 77,706 parameters
- gpt:       nanoGPT-style decoder: vocab 1024, context 64, d 256, 4 heads, 4 pre-LN layers,
             GELU(erf) MLP 4d, untied lm_head without bias; 3,700,224 parameters

Every model returns logits with the classes on the last axis ([N, 10], or [B, T, 1024] for the
GPT), and the loss is mean cross-entropy over every sample (and token).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

GPT_VOCAB = 1024
GPT_CONTEXT = 64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (each followed by BN when bn) and the residual; a strided 1x1
    convolution (+ BN) on the shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, bn: bool):
        super().__init__()
        norm = (lambda c: nn.BatchNorm2d(c)) if bn else (lambda c: nn.Identity())
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=not bn)
        self.bn1 = norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=not bn)
        self.bn2 = norm(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=not bn), norm(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        s = x if self.shortcut is None else self.shortcut(x)
        return F.relu(h + s)


class ResNet8(nn.Module):
    def __init__(self, bn: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=not bn)
        self.bn1 = nn.BatchNorm2d(16) if bn else nn.Identity()
        self.layer1 = BasicBlock(16, 16, 1, bn)
        self.layer2 = BasicBlock(16, 32, 2, bn)
        self.layer3 = BasicBlock(32, 64, 2, bn)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.layer3(self.layer2(self.layer1(h)))
        return self.fc(h.mean(dim=(2, 3)))


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int, context: int):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head = n_head
        self.d = d
        self.register_buffer("mask", torch.tril(torch.ones(context, context)).view(1, 1, context, context))

    def forward(self, x):
        B, T, C = x.size()
        hd = C // self.n_head
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class DecoderLayer(nn.Module):
    def __init__(self, d: int, n_head: int, context: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head, context)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=GPT_VOCAB, context=GPT_CONTEXT, d=256, n_head=4, n_layer=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList([DecoderLayer(d, n_head, context) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for layer in self.h:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


# name -> (constructor, input name, batch sizes the bench runs)
MODELS = {
    "mlp": (MLP, "x", (8, 32)),
    "resnet_bn": (lambda: ResNet8(bn=True), "x", (8, 32)),
    "resnet": (lambda: ResNet8(bn=False), "x", (8, 32)),
    "gpt": (GPT, "idx", (4, 8)),
}


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every sample and token, classes on the last axis."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
