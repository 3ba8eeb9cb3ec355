"""A tiny BERT-like sequence classifier whose module names match HuggingFace's ``BertModel``:

    embeddings.word_embeddings / position_embeddings / LayerNorm
    encoder.layer.{i}.attention.self.query / key / value
    encoder.layer.{i}.attention.output.dense / LayerNorm
    encoder.layer.{i}.intermediate.dense
    encoder.layer.{i}.output.dense / LayerNorm
    classifier

so that placement pins written for BERT (``encoder.layer[0-2]``, ``encoder.layer[3-]``) apply as
written. Differences from BERT, for size and simplicity: no token-type embeddings, no attention
mask (all sequences are full length), no pooler (the classifier reads the mean of the last hidden
states over positions). Post-LayerNorm residuals and GELU, as BERT.

Shapes: B = batch, T = tokens, H = hidden, nh = n_head, hs = H // nh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zinf.errors import ConfigError


@dataclass
class EncoderConfig:
    vocab_size: int = 256
    """Number of token ids."""
    n_layer: int = 12
    """Encoder layers (BERT-base has 12)."""
    hidden: int = 64
    """Hidden size H (BERT-base: 768)."""
    n_head: int = 4
    """Attention heads; must divide ``hidden``."""
    max_len: int = 64
    """Longest sequence, in tokens (size of the position embedding table)."""
    n_classes: int = 4
    """Number of labels of the classifier."""
    intermediate: int | None = None
    """Width of the feed-forward layer; None means 4 * hidden, as BERT."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches (0 = off)."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon (BERT's value)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "hidden", "n_head", "max_len", "n_classes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EncoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.n_head:
            raise ConfigError(f"EncoderConfig.hidden ({self.hidden}) must be divisible by n_head ({self.n_head})")
        if self.intermediate is not None and self.intermediate < 1:
            raise ConfigError(f"EncoderConfig.intermediate must be >= 1 or None, got {self.intermediate}")

    @property
    def ffn(self) -> int:
        return self.intermediate if self.intermediate is not None else 4 * self.hidden


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)  # (V, H)
        self.position_embeddings = nn.Embedding(cfg.max_len, cfg.hidden)  # (max_len, H)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
        x = self.word_embeddings(idx) + self.position_embeddings(pos)  # (B, T, H)
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention: separate query / key / value projections, as BERT."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: Tensor) -> Tensor:
        B, T, H = x.shape
        q = self.query(x).view(B, T, self.n_head, H // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = self.key(x).view(B, T, self.n_head, H // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, H // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return y.transpose(1, 2).reshape(B, T, H)  # heads side by side again


class SelfOutput(nn.Module):
    """Projection after attention, then LayerNorm(residual + projection) (post-LN)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self = SelfAttention(cfg)  # HF's name; ``self.self`` is a submodule, not a typo
        self.output = SelfOutput(cfg)

    def forward(self, x: Tensor) -> Tensor:
        return self.output(self.self(x), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.ffn)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.intermediate_act_fn(self.dense(x))  # (B, T, ffn)


class Output(nn.Module):
    """Feed-forward down-projection, then LayerNorm(residual + projection)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.ffn, cfg.hidden)
        self.LayerNorm = nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = Output(cfg)

    def forward(self, x: Tensor) -> Tensor:
        a = self.attention(x)
        return self.output(self.intermediate(a), a)


class LayerStack(nn.Module):
    """HF's ``BertEncoder``: holds ``layer``, a ModuleList, so the names are ``encoder.layer.{i}``."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class EncoderClassifier(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = LayerStack(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.hidden, cfg.n_classes)
        # BERT init: Linear and Embedding weights ~ N(0, 0.02), biases 0, LayerNorm (1, 0).
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, labels: Tensor | None = None) -> Tensor:
        """``idx``: (B, T) token ids. Returns the mean cross-entropy (a scalar) when ``labels``
        (B,) is given, else the logits (B, n_classes)."""
        if idx.size(1) > self.config.max_len:
            raise ConfigError(f"sequence of {idx.size(1)} tokens is longer than max_len={self.config.max_len}; "
                              "raise max_len or feed shorter sequences")
        h = self.encoder(self.embeddings(idx))  # (B, T, H)
        logits = self.classifier(self.dropout(h.mean(dim=1)))  # mean over positions -> (B, n_classes)
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels.reshape(-1))
