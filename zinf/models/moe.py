"""A small mixture-of-experts transformer: the GPT of ``gpt.py`` with each block's MLP replaced by
a :class:`MoELayer` of ``n_experts`` MLPs, each token sent to ``top_k`` of them.

Two routers:

* ``"learned"``: a Linear ``router`` scores the experts per token; the token goes to the ``top_k``
  best, weighted by a softmax over those ``top_k`` logits. (With ``top_k=1`` that weight is always
  1, so the router learns only through the load-balancing loss, ``aux_loss_coef > 0``.)
* ``"fixed"``: a token's experts are a fixed function of its token id,
  ``routing_table[layer][token_id]``, drawn once from ``routing_seed``; weights are 1/top_k. Tests
  then know exactly which experts get tokens: :func:`expected_experts`.

An expert that receives no token in a forward is not called at all, so its parameters get no
gradient (``p.grad is None``), exactly as plain PyTorch leaves parameters it never used. Token ids
are passed explicitly from ``MoETransformer.forward`` through each block to its ``MoELayer``.

Shapes: B = batch, T = tokens per sequence, N = B*T, C = n_embd, E = n_experts, k = top_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zinf.errors import ConfigError
from zinf.models.gpt import MLP, CausalSelfAttention, GPTConfig, count_params, init_weights


@dataclass
class MoEConfig(GPTConfig):
    """The fields of :class:`GPTConfig`, plus:"""

    n_experts: int = 8
    """Experts (MLPs) per MoE layer."""
    top_k: int = 1
    """Experts each token is sent to (1 = Switch-style, 2 = Mixtral-style)."""
    expert_hidden: int | None = None
    """Hidden width of each expert MLP; None means 4 * n_embd, as a dense GPT block."""
    router: str = "learned"
    """Either "learned" (a Linear scores the experts per token) or "fixed" (table[layer][token id])."""
    aux_loss_coef: float = 0.0
    """Weight of the Switch-Transformer load-balancing loss added to the returned loss (learned
    router only; 0 = off, 0.01 is the usual value)."""
    routing_seed: int = 0
    """Seed of the fixed routing table (router="fixed"); independent of torch's global RNG."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.router not in ("learned", "fixed"):
            raise ConfigError(f'MoEConfig.router must be "learned" or "fixed", got {self.router!r}')
        if self.n_experts < 1:
            raise ConfigError(f"MoEConfig.n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"MoEConfig.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.expert_hidden is not None and self.expert_hidden < 1:
            raise ConfigError(f"MoEConfig.expert_hidden must be >= 1 or None, got {self.expert_hidden}")
        if self.aux_loss_coef < 0:
            raise ConfigError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    @property
    def hidden(self) -> int:
        return self.expert_hidden if self.expert_hidden is not None else 4 * self.n_embd


def routing_table(cfg: MoEConfig) -> Tensor:
    """The fixed routing: a (n_layer, vocab_size, top_k) LongTensor, ``[l, t]`` = the top_k distinct
    experts that token id ``t`` goes to in layer ``l``. Drawn on the CPU from ``cfg.routing_seed``
    alone, so it is the same on every machine and for every model built from ``cfg``."""
    gen = torch.Generator().manual_seed(cfg.routing_seed)
    scores = torch.rand(cfg.n_layer, cfg.vocab_size, cfg.n_experts, generator=gen)
    return scores.argsort(dim=-1)[..., : cfg.top_k].contiguous()  # a random permutation's first k


def expected_experts(model_or_cfg: nn.Module | MoEConfig, idx: Tensor) -> dict[int, set[int]]:
    """For a fixed-routing MoE model (or its config) and token ids ``idx`` (any shape): layer index
    -> the set of experts that get at least one token. The others are not called in that forward,
    and their parameters get no gradient."""
    cfg = model_or_cfg.config if isinstance(model_or_cfg, nn.Module) else model_or_cfg
    if not isinstance(cfg, MoEConfig) or cfg.router != "fixed":
        raise ConfigError('expected_experts needs an MoE model or MoEConfig with router="fixed"')
    table = routing_table(cfg)  # (L, V, k)
    ids = idx.detach().reshape(-1).cpu()
    return {layer: set(table[layer, ids].reshape(-1).tolist()) for layer in range(cfg.n_layer)}


class MoELayer(nn.Module):
    """Top-k mixture of expert MLPs. forward(x (B, T, C), idx (B, T)) -> (y (B, T, C), aux loss (scalar))."""

    def __init__(self, cfg: MoEConfig, layer: int):
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss_coef = cfg.n_experts, cfg.top_k, cfg.aux_loss_coef
        # A fixed-routing model has no router parameters at all (rather than unused ones).
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False) if cfg.router == "learned" else None
        self.experts = nn.ModuleList(MLP(cfg.n_embd, cfg.hidden, cfg.bias, cfg.dropout) for _ in range(cfg.n_experts))
        if self.router is None:
            # (V, k) experts of each token id in this layer; a buffer so that .to(device) moves it,
            # not persistent because it is rebuilt from the config.
            self.register_buffer("routing_table", routing_table(cfg)[layer], persistent=False)

    def forward(self, x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)  # (N, C)
        aux = flat.new_zeros(())
        if self.router is not None:
            logits = self.router(flat)  # (N, E)
            top_logits, chosen = logits.topk(self.top_k, dim=-1)  # (N, k) each
            weights = F.softmax(top_logits, dim=-1)  # (N, k), sums to 1 per token
            if self.aux_loss_coef > 0:
                # Switch Transformer eq. 4: E * sum_e (fraction of tokens whose first choice is e)
                # * (mean router probability of e); 1.0 when the load is perfectly balanced.
                probs = F.softmax(logits, dim=-1)  # (N, E)
                frac = torch.bincount(chosen[:, 0], minlength=self.n_experts).to(probs.dtype) / chosen.size(0)
                aux = self.n_experts * (frac * probs.mean(dim=0)).sum()
        else:
            chosen = self.routing_table[idx.reshape(-1)]  # (N, k)
            weights = flat.new_full(chosen.shape, 1.0 / self.top_k)
        # Tokens per expert, on the host: decides which experts run at all (a sync on CUDA).
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n_experts).tolist()
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            if counts[e] == 0:
                continue  # idle expert: not called, its parameters get no gradient
            rows, slot = torch.where(chosen == e)  # tokens routed to e, and which of their k choices
            y = expert(flat[rows]) * weights[rows, slot].unsqueeze(-1)  # (n_e, C)
            out = out.index_add(0, rows, y)  # out-of-place: scatter back to token positions
        return out.view(B, T, C), aux


class MoEBlock(nn.Module):
    """A GPT block whose MLP is a :class:`MoELayer`. forward(x, idx) -> (x, aux loss)."""

    def __init__(self, cfg: MoEConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.moe = MoELayer(cfg, layer)

    def forward(self, x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, aux = self.moe(self.ln_2(x), idx)
        return x + y, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # (V, C)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # (block_size, C)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(MoEBlock(cfg, layer) for layer in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight  # one Parameter, used by both modules' forwards
        init_weights(self, cfg.n_layer)  # nanoGPT init; router weights ~ N(0, 0.02) like any Linear

    def num_params(self, non_embedding: bool = False) -> int:
        return count_params(self, non_embedding)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Like :meth:`GPT.forward`: the mean cross-entropy (plus ``aux_loss_coef`` x the summed
        load-balancing losses) when ``targets`` is given, else logits (B, T, V)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ConfigError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}; "
                              "raise block_size or feed shorter sequences")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        aux_total = x.new_zeros(())
        for block in self.blocks:
            x, aux = block(x, idx)  # the token ids go down to each MoE layer (fixed routing)
            aux_total = aux_total + aux
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        if self.config.aux_loss_coef > 0:
            loss = loss + self.config.aux_loss_coef * aux_total
        return loss
