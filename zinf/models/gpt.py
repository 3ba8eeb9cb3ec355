"""A small GPT (decoder-only transformer), after nanoGPT's ``model.py``.

Shapes in comments: B = batch, T = sequence length (tokens), C = n_embd, V = vocab_size,
nh = n_head, hs = C // nh (head size).

zinf's rule for models holds throughout: every parameter is used only inside the forward of the
module that directly owns it (positional embeddings are an ``nn.Embedding`` called by
``GPT.forward``, the tied ``lm_head`` is a ``Linear`` that shares ``wte``'s Parameter object), and no
module output is modified in place. ``tests/test_models.py`` checks this mechanically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zinf.errors import ConfigError


@dataclass
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids (256: byte-level, what the synthetic data in ``data.py`` uses)."""
    block_size: int = 64
    """Longest sequence the model accepts, in tokens (size of the positional embedding table)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream (model dimension)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches (0 = off)."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms, as in GPT-2 (False is slightly faster)."""
    tie_weights: bool = True
    """Share one Parameter between the token embedding ``wte`` and the output head ``lm_head``."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # output projection (residual)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: C -> hidden -> C (hidden = 4 C in GPT-2)."""

    def __init__(self, n_embd: int, hidden: int, bias: bool, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)  # residual projection
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg.n_embd, 4 * cfg.n_embd, cfg.bias, cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # out-of-place adds: module outputs are never modified
        x = x + self.mlp(self.ln_2(x))
        return x


def init_weights(model: nn.Module, n_layer: int) -> None:
    """nanoGPT / GPT-2 init: Linear and Embedding weights ~ N(0, 0.02), biases 0, and the
    projections into the residual stream (every ``c_proj``) ~ N(0, 0.02 / sqrt(2 n_layer)), since
    each block adds two of them to the residual. Uses torch's global RNG: deterministic given
    ``torch.manual_seed``."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def count_params(model: nn.Module, non_embedding: bool = False) -> int:
    """Number of parameter elements, tied parameters counted once. ``non_embedding`` leaves out the
    positional embedding table (``wpe``), as nanoGPT reports it; the token embedding stays in
    because it doubles as the output head when tied."""
    n = sum(p.numel() for p in model.parameters())
    if non_embedding and hasattr(model, "wpe"):
        n -= model.wpe.weight.numel()
    return n


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        # Submodules are registered in the order the forward calls them: zinf packs small
        # parameters into chunks in registration order, as a proxy for first-use order.
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # token embedding, (V, C)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # positional embedding, (block_size, C)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # (V, C) weight
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight  # one Parameter object, used by both modules' forwards
        init_weights(self, cfg.n_layer)

    def num_params(self, non_embedding: bool = False) -> int:
        return count_params(self, non_embedding)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """``idx``: (B, T) token ids. Returns the mean cross-entropy over all positions (a scalar)
        when ``targets`` (B, T) is given (positions with target -1 are ignored), else the logits
        (B, T, V)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ConfigError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}; "
                              "raise block_size or feed shorter sequences")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) + (T, C) broadcast
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
