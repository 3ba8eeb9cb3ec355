"""The GPT-style model of the GPU benchmarks, the same shape as the DeepSpeed baseline's
(../shared/gpu/ds_baseline.py): pre-norm blocks, 16 heads, GELU MLP, untied head, vocab 32000.
Plain torch, so that zinf, DeepSpeed and plain PyTorch run exactly the same model.

Defaults (d=1024, 24 layers) give 368 M parameters; batch 8 x 512 tokens in the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32000
SEQ = 512


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 16):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.n2 = nn.LayerNorm(d)
        self.f1 = nn.Linear(d, 4 * d)
        self.f2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d/heads)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        return x + self.f2(F.gelu(self.f1(self.n2(x))))


class GPT(nn.Module):
    def __init__(self, d: int = 1024, layers: int = 24):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.n = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.n(h)).float().view(-1, VOCAB), y.view(-1))


def cuda_seconds(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()``'s result and the seconds it took, the GPU's queued work drained before and after
    (CUDA runs asynchronously: without the second drain only the launches would be timed)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def train_step(engine, x, y):
    """One training step through a zinf or DeepSpeed engine (the same three calls); the loss."""
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss


def batch(step: int, b: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random tokens for step ``step`` (targets: the next token)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (b, SEQ), generator=gen)
    return x.to(device), torch.roll(x, -1, 1).to(device)
