"""A small mixture-of-experts transformer: the GPT of ``gpt.py`` with each block's MLP replaced by
a :class:`MoELayer` of ``n_experts`` MLPs, each token sent to ``top_k`` of them.

Three routers:

* ``"learned"``: a Linear ``router`` scores the experts per token; the token goes to the ``top_k``
  best, weighted by a softmax over those ``top_k`` logits. (With ``top_k=1`` that weight is always
  1, so the router learns only through the load-balancing loss, ``aux_loss_coef > 0``.)
* ``"fixed"``: a token's experts are a fixed function of its token id,
  ``routing_table[layer][token_id]``, drawn once from ``routing_seed``; weights are 1/top_k. Tests
  then know exactly which experts get tokens: :func:`expected_experts`.
* ``"zipf"``: a fixed table like ``"fixed"``, but skewed: in each layer the experts are ranked by
  a permutation drawn from ``routing_seed`` (expert 0 never among the hottest quarter, so the hot
  experts are not the first ones in model order), and the expert of rank r receives a share of
  the token ids proportional to (r + 1) ** -``routing_skew`` (exactly, up to rounding; capped at
  one slot per token id when top_k > 1). :func:`expert_ranking` gives the ranking,
  :func:`expert_load` the tokens each expert gets, and :func:`set_routing` redraws the tables of a
  built model in place (drift: the hot set moves). Neither fixed router has parameters.

An expert that receives no token in a forward is not called at all, so its parameters get no
gradient (``p.grad is None``), exactly as plain PyTorch leaves parameters it never used. Token ids
are passed explicitly from ``MoETransformer.forward`` through each block to its ``MoELayer``.

Shapes: B = batch, T = tokens per sequence, N = B*T, C = n_embd, E = n_experts, k = top_k.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zinf.errors import ConfigError, ModelError
from zinf.hints import will_use
from zinf.models.gpt import MLP, CausalSelfAttention, GPTConfig, count_params, init_weights


ROUTERS = ("learned", "fixed", "zipf")
TABLE_ROUTERS = ("fixed", "zipf")  # routers that are a table of token id -> experts, no parameters


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
    """"learned" (a Linear scores the experts per token), "fixed" (table[layer][token id], uniform)
    or "zipf" (a table whose expert popularity follows a Zipf law, see ``routing_skew``)."""
    aux_loss_coef: float = 0.0
    """Weight of the Switch-Transformer load-balancing loss added to the returned loss (learned
    router only; 0 = off, 0.01 is the usual value)."""
    routing_seed: int = 0
    """Seed of the routing table (router "fixed" or "zipf"); independent of torch's global RNG."""
    routing_skew: float = 1.2
    """Zipf exponent of expert popularity (router="zipf"): the expert of rank r gets a share of the
    token ids proportional to (r + 1) ** -routing_skew; 0 = uniform. With 8 experts and 1.2 the
    hottest gets 43% of the tokens, the coldest 3.5%."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.router not in ROUTERS:
            raise ConfigError(f'MoEConfig.router must be "learned", "fixed" or "zipf", got {self.router!r}')
        if not self.routing_skew >= 0:  # also refuses NaN
            raise ConfigError(f"MoEConfig.routing_skew must be >= 0, got {self.routing_skew}")
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
    """The table routing ("fixed" or "zipf"): a (n_layer, vocab_size, top_k) LongTensor, ``[l, t]``
    = the top_k distinct experts that token id ``t`` goes to in layer ``l``. Drawn on the CPU from
    ``cfg.routing_seed`` (and, for zipf, ``cfg.routing_skew``) alone, so it is the same on every
    machine and for every model built from ``cfg``."""
    if cfg.router == "zipf":
        return torch.stack([_zipf_layer(cfg, layer)[0] for layer in range(cfg.n_layer)])
    gen = torch.Generator().manual_seed(cfg.routing_seed)
    scores = torch.rand(cfg.n_layer, cfg.vocab_size, cfg.n_experts, generator=gen)
    return scores.argsort(dim=-1)[..., : cfg.top_k].contiguous()  # a random permutation's first k


def expert_ranking(cfg: MoEConfig) -> Tensor:
    """For router="zipf": a (n_layer, n_experts) LongTensor, each row the layer's experts from the
    most to the least popular. Expert 0 is never in the first ceil(n_experts / 4) places (for
    n_experts >= 2)."""
    _need_router(cfg, ("zipf",), "expert_ranking")
    return torch.stack([_zipf_layer(cfg, layer)[1] for layer in range(cfg.n_layer)])


def _zipf_layer(cfg: MoEConfig, layer: int) -> tuple[Tensor, Tensor]:
    """(table (V, k), ranking (E,)) of one layer of the zipf router.

    1. Rank the experts with a random permutation (seeded by (routing_seed, layer)); if expert 0
       lands in the hottest quarter, swap it with a random place below it.
    2. Give the expert of rank r ``V * k * w_r / sum(w)`` of the V * k (token id, slot) pairs,
       ``w_r = (r + 1) ** -skew``, at most V (one slot per token id), rounded by largest remainder.
    3. Lay the experts' slots out in rank order and wrap them over the table column by column
       (slot i -> row i % V, column i // V): an expert with at most V slots never lands twice in
       one row, so each token's k experts are distinct. Then shuffle the rows over the token ids.
    """
    V, E, k = cfg.vocab_size, cfg.n_experts, cfg.top_k
    gen = torch.Generator().manual_seed((cfg.routing_seed * 1_000_003 + layer + 1) % (1 << 62))
    ranking = torch.randperm(E, generator=gen)
    n_top = -(-E // 4) if E >= 2 else 0  # ceil(E / 4): the "hottest quarter"
    pos0 = int((ranking == 0).nonzero())
    if pos0 < n_top:
        swap = int(torch.randint(n_top, E, (1,), generator=gen))
        ranking[pos0], ranking[swap] = ranking[swap].clone(), ranking[pos0].clone()
    counts = _zipf_counts(V, E, k, cfg.routing_skew)  # by rank
    slots = torch.repeat_interleave(ranking, torch.tensor(counts))  # (V * k,) experts in rank order
    table = slots.view(k, V).t()  # slot i -> row i % V, column i // V
    rows = torch.randperm(V, generator=gen)  # token id t gets row rows[t]
    return table[rows].contiguous(), ranking


def _zipf_counts(n_ids: int, n_experts: int, k: int, skew: float) -> list[int]:
    """(token id, slot) pairs per expert rank: Zipf shares of n_ids * k, each at most n_ids, summing
    exactly to n_ids * k (water-filling for the cap, then largest remainder)."""
    w = [(r + 1) ** -skew for r in range(n_experts)]
    total, capped = n_ids * k, set()
    while True:  # cap at n_ids and share the excess among the rest, until nothing exceeds the cap
        free_w = sum(w[r] for r in range(n_experts) if r not in capped)
        left = total - n_ids * len(capped)
        target = [float(n_ids) if r in capped else left * w[r] / free_w for r in range(n_experts)]
        over = {r for r in range(n_experts) if r not in capped and target[r] > n_ids}
        if not over:
            break
        capped |= over
    counts = [int(t) for t in target]
    by_remainder = sorted(range(n_experts), key=lambda r: (-(target[r] - counts[r]), r))
    for r in by_remainder[: total - sum(counts)]:
        counts[r] += 1
    return counts


def _need_router(cfg, routers: tuple[str, ...], what: str) -> None:
    if not isinstance(cfg, MoEConfig) or cfg.router not in routers:
        want = " or ".join(f'router="{r}"' for r in routers)
        raise ConfigError(f"{what} needs an MoE model or MoEConfig with {want}")


def _config_of(model_or_cfg: nn.Module | MoEConfig) -> MoEConfig:
    return model_or_cfg.config if isinstance(model_or_cfg, nn.Module) else model_or_cfg


def expected_experts(model_or_cfg: nn.Module | MoEConfig, idx: Tensor) -> dict[int, set[int]]:
    """For a table-routed ("fixed" or "zipf") MoE model (or its config) and token ids ``idx`` (any
    shape): layer index -> the set of experts that get at least one token. The others are not
    called in that forward, and their parameters get no gradient."""
    cfg = _config_of(model_or_cfg)
    _need_router(cfg, TABLE_ROUTERS, "expected_experts")
    table = routing_table(cfg)  # (L, V, k)
    ids = idx.detach().reshape(-1).cpu()
    return {layer: set(table[layer, ids].reshape(-1).tolist()) for layer in range(cfg.n_layer)}


def expert_load(model_or_cfg: nn.Module | MoEConfig, idx: Tensor) -> Tensor:
    """For a table-routed MoE model (or config) and token ids ``idx``: a (n_layer, n_experts)
    LongTensor of the (token, slot) pairs each expert receives; each row sums to idx.numel() * top_k."""
    cfg = _config_of(model_or_cfg)
    _need_router(cfg, TABLE_ROUTERS, "expert_load")
    table = routing_table(cfg)  # (L, V, k)
    ids = idx.detach().reshape(-1).cpu()
    return torch.stack([torch.bincount(table[layer, ids].reshape(-1), minlength=cfg.n_experts)
                        for layer in range(cfg.n_layer)])


def set_routing(model: nn.Module, *, seed: int | None = None, skew: float | None = None) -> MoEConfig:
    """Redraw the routing tables of a built table-routed MoE model in place, for drift experiments:
    with a new ``seed`` the hot experts of a zipf router move; ``skew`` (zipf only) changes how hot.
    Parameters are untouched; the tables keep their device. ``model`` may be the MoETransformer or
    anything whose ``.module`` is one (a zinf engine). Updates and returns ``model.config`` (a new
    MoEConfig), so :func:`expected_experts` (model) follows. Call it between steps."""
    model = model if isinstance(model, MoETransformer) else getattr(model, "module", model)
    if not isinstance(model, MoETransformer):
        raise ModelError(f"set_routing needs an MoETransformer (or an engine wrapping one), got {type(model).__name__}")
    cfg = model.config
    _need_router(cfg, TABLE_ROUTERS, "set_routing")
    if skew is not None and cfg.router != "zipf":
        raise ConfigError('set_routing(skew=...) needs router="zipf"; a "fixed" table is uniform')
    changes = {k: v for k, v in (("routing_seed", seed), ("routing_skew", skew)) if v is not None}
    new = dataclasses.replace(cfg, **changes)  # validates the new values
    table = routing_table(new)  # (L, V, k)
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            block.moe.routing_table.copy_(table[layer])
    model.config = new
    return new


class MoELayer(nn.Module):
    """Top-k mixture of expert MLPs. forward(x (B, T, C), idx (B, T)) -> (y (B, T, C), aux loss (scalar))."""

    def __init__(self, cfg: MoEConfig, layer: int):
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss_coef = cfg.n_experts, cfg.top_k, cfg.aux_loss_coef
        # A table-routed model has no router parameters at all (rather than unused ones).
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False) if cfg.router == "learned" else None
        self.experts = nn.ModuleList(MLP(cfg.n_embd, cfg.hidden, cfg.bias, cfg.dropout) for _ in range(cfg.n_experts))
        if self.router is None:
            # (V, k) experts of each token id in this layer; a buffer so that .to(device) moves it,
            # not persistent because it is rebuilt from the config.
            table = _zipf_layer(cfg, layer)[0] if cfg.router == "zipf" else routing_table(cfg)[layer]
            self.register_buffer("routing_table", table, persistent=False)

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
        # the experts this pass runs, known from here on: zinf starts reading those on NVMe now
        will_use(expert for expert, n in zip(self.experts, counts) if n)
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
            x, aux = block(x, idx)  # the token ids go down to each MoE layer (table routing)
            aux_total = aux_total + aux
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        if self.config.aux_loss_coef > 0:
            loss = loss + self.config.aux_loss_coef * aux_total
        return loss
