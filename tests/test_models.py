"""The built-in models and synthetic data: shapes, learning, tying, MoE routing, determinism, the
parameter-ownership rule the engine depends on, and build_model's errors."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn

from zinf.errors import ConfigError, ModelError
from zinf.models import PRESETS, build_model, freeze
from zinf.models.data import TokenBatches, classification_batches, markov_tokens, zipf_tokens
from zinf.models.moe import expected_experts, expert_load, expert_ranking, routing_table, set_routing


def _batch(name, cfg, batch_size=4, seed=0):
    """One (x, y) batch for a model: next-token data, or (x, labels) for the encoder."""
    if name == "encoder":
        return classification_batches(cfg.vocab_size, cfg.n_classes, batch_size, cfg.max_len, seed=seed).get(0)
    return TokenBatches(markov_tokens(cfg.vocab_size, 5_000, seed=seed), batch_size, cfg.block_size, seed=seed).get(0)


# ------------------------------------------------------------------ shapes and basic contracts
@pytest.mark.parametrize("name", ["gpt", "moe", "encoder"])
def test_shapes_and_scalar_loss(name):
    torch.manual_seed(0)
    model, cfg = build_model(name, "tiny")
    x, y = _batch(name, cfg, batch_size=3)
    logits = model(x)
    if name == "encoder":
        assert logits.shape == (3, cfg.n_classes)
    else:
        assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
        assert model(x[:, :5]).shape == (3, 5, cfg.vocab_size)  # shorter sequences work too
    loss = model(x, y)
    assert loss.dim() == 0
    # at init the prediction is close to uniform: loss ~ ln(number of classes)
    n_out = cfg.n_classes if name == "encoder" else cfg.vocab_size
    assert abs(loss.item() - math.log(n_out)) < 0.5


@pytest.mark.parametrize("name", ["gpt", "moe", "encoder"])
def test_tiny_presets_are_tiny(name):
    model, _ = build_model(name, "tiny")
    assert 0.2e6 <= model.num_params() <= 1e6


def test_gpt_module_names():
    model, cfg = build_model("gpt", "tiny")
    names = {n for n, _ in model.named_modules()}
    for n in ["wte", "wpe", "drop", "blocks.0.ln_1", "blocks.0.attn.c_attn", "blocks.0.attn.c_proj",
              "blocks.0.ln_2", "blocks.0.mlp.c_fc", "blocks.0.mlp.c_proj", "ln_f", "lm_head"]:
        assert n in names
    assert model.blocks[0].attn.c_attn.out_features == 3 * cfg.n_embd
    assert model.blocks[0].mlp.c_fc.out_features == 4 * cfg.n_embd
    assert model.lm_head.bias is None


def test_encoder_names_match_hf_bert():
    model, cfg = build_model("encoder", "tiny")
    names = {n for n, _ in model.named_parameters()}
    want = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight", "embeddings.LayerNorm.weight"]
    for i in range(cfg.n_layer):
        p = f"encoder.layer.{i}."
        want += [p + s + ".weight" for s in ("attention.self.query", "attention.self.key", "attention.self.value",
                                             "attention.output.dense", "attention.output.LayerNorm",
                                             "intermediate.dense", "output.dense", "output.LayerNorm")]
    want += ["classifier.weight", "classifier.bias"]
    assert set(want) <= names


def test_tied_weights_are_one_parameter():
    for name in ("gpt", "moe"):
        model, cfg = build_model(name, "tiny")
        assert model.lm_head.weight is model.wte.weight
        assert model.num_params() == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        untied, _ = build_model(name, "tiny", tie_weights=False)
        assert untied.lm_head.weight is not untied.wte.weight
        assert untied.num_params() == model.num_params() + cfg.vocab_size * cfg.n_embd


def test_gpt_is_causal():
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    x = torch.randint(cfg.vocab_size, (2, 16))
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % cfg.vocab_size  # change only the future
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :10], model(x2)[:, :10], atol=1e-6)
        assert not torch.allclose(model(x)[:, 10:], model(x2)[:, 10:])


def test_too_long_sequence_is_refused():
    model, cfg = build_model("gpt", "tiny")
    with pytest.raises(ConfigError, match="block_size"):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


# ------------------------------------------------------------------ learning
def test_gpt_loss_falls_on_markov_data():
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=0), 8, cfg.block_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for i in range(50):
        x, y = data.get(i)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 2.0, (first, last)  # from ~5.4 nats (near uniform over 256) to ~2


def test_encoder_learns_classification():
    torch.manual_seed(0)
    model, cfg = build_model("encoder", "tiny", n_layer=2)
    data = classification_batches(cfg.vocab_size, cfg.n_classes, 16, 32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(40):
        x, y = data.get(i)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    x, y = data.get(10_000)  # a batch not trained on
    with torch.no_grad():
        assert (model(x).argmax(-1) == y).float().mean() > 0.8


# ------------------------------------------------------------------ MoE routing
def _expert_grads(model):
    """layer -> set of experts with at least one parameter that has a gradient."""
    return {
        layer: {e for e, ex in enumerate(block.moe.experts) if any(p.grad is not None for p in ex.parameters())}
        for layer, block in enumerate(model.blocks)
    }


def test_moe_fixed_routing_grads_match_expected_experts():
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="fixed")
    x, y = _batch("moe", cfg, batch_size=2)
    model(x, y).backward()
    expected = expected_experts(model, x)
    assert _expert_grads(model) == expected
    assert expected_experts(cfg, x) == expected  # the config alone is enough
    for block in model.blocks:  # no router parameters with a fixed router
        assert block.moe.router is None


def test_moe_idle_experts_get_no_grad():
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="fixed", top_k=2)
    # a crafted batch: only token ids whose layer-0 experts are all in {0, 1, 2}
    allowed = [t for t in range(cfg.vocab_size) if expected_experts(cfg, torch.tensor([t]))[0] <= {0, 1, 2}]
    assert allowed
    gen = torch.Generator().manual_seed(0)
    x = torch.tensor(allowed)[torch.randint(len(allowed), (2, 16), generator=gen)]
    model(x, torch.roll(x, -1, dims=1)).backward()
    got = _expert_grads(model)
    assert got == expected_experts(cfg, x)
    assert got[0] <= {0, 1, 2}
    for e in range(3, cfg.n_experts):  # idle experts: not called, so p.grad stays None
        assert all(p.grad is None for p in model.blocks[0].moe.experts[e].parameters())


def test_moe_fixed_routing_is_deterministic_and_seeded():
    _, a = build_model("moe", "tiny", router="fixed")
    _, b = build_model("moe", "tiny", router="fixed", routing_seed=1)
    idx = torch.arange(a.vocab_size)
    assert expected_experts(a, idx) == expected_experts(a, idx)
    per_token = lambda cfg: [expected_experts(cfg, torch.tensor([t]))[0] for t in range(cfg.vocab_size)]
    assert per_token(a) != per_token(b)


def test_moe_learned_router_and_aux_loss():
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", top_k=2, aux_loss_coef=0.01)
    x, y = _batch("moe", cfg)
    loss = model(x, y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(b.moe.router.weight.grad is not None and b.moe.router.weight.grad.abs().sum() > 0 for b in model.blocks)


def test_zipf_tokens_skew_moe_routing():
    tokens = zipf_tokens(256, 50_000, alpha=1.2, seed=0)
    freq = torch.bincount(tokens, minlength=256).float() / tokens.numel()
    assert 0.2 < freq[0] < 0.3 and freq[0] > 10 * freq[50]
    _, cfg = build_model("moe", "tiny", router="fixed")
    load = torch.bincount(routing_table(cfg)[0, tokens, 0], minlength=cfg.n_experts).float()
    assert load.max() / load.mean() > 1.5  # skewed expert load


def test_moe_fixed_table_is_unchanged():
    """The "fixed" router's table is the formula it always was (the zipf router left it alone)."""
    _, cfg = build_model("moe", "tiny", router="fixed", top_k=2, routing_seed=5)
    gen = torch.Generator().manual_seed(5)
    want = torch.rand(cfg.n_layer, cfg.vocab_size, cfg.n_experts, generator=gen).argsort(dim=-1)[..., :2]
    assert torch.equal(routing_table(cfg), want)


# ------------------------------------------------------------------ MoE zipf router
def _ceil_quarter(n: int) -> int:
    return -(-n // 4)


def test_moe_zipf_shares_follow_the_skew():
    _, cfg = build_model("moe", "tiny", router="zipf", n_experts=8, routing_skew=1.2)
    ranking = expert_ranking(cfg)  # (L, E), hottest first
    w = torch.arange(1, 9, dtype=torch.float64).pow(-1.2)
    zipf_share = w / w.sum()  # 0.43, 0.19, ..., 0.035 by rank
    # over the token ids, each expert's share is the Zipf share of its rank (up to rounding)
    share = expert_load(cfg, torch.arange(cfg.vocab_size)).double() / cfg.vocab_size  # (L, E)
    for layer in range(cfg.n_layer):
        assert torch.allclose(share[layer, ranking[layer]], zipf_share, atol=1.0 / cfg.vocab_size)
        assert share[layer].max() > 3 * (1 / cfg.n_experts)  # the hottest: ~3.4x uniform
        assert ranking[layer].tolist() != list(range(cfg.n_experts))  # popularity is not model order
        assert 0 not in ranking[layer, :2].tolist()  # expert 0 is not in the hottest quarter
    # on real (Markov) data too: the hottest expert by design is the most loaded, ~2x+ uniform
    load = expert_load(cfg, markov_tokens(cfg.vocab_size, 50_000, seed=0)).double()
    load /= load.sum(dim=1, keepdim=True)
    for layer in range(cfg.n_layer):
        assert load[layer].argmax() == ranking[layer, 0]
        assert load[layer].max() > 2 / cfg.n_experts
    # a larger exponent concentrates more; 0 is uniform
    _, hot = build_model("moe", "tiny", router="zipf", n_experts=8, routing_skew=2.0)
    _, flat = build_model("moe", "tiny", router="zipf", n_experts=8, routing_skew=0.0)
    ids = torch.arange(cfg.vocab_size)
    assert expert_load(hot, ids).max() > expert_load(cfg, ids).max()
    assert expert_load(flat, ids).tolist() == [[32] * 8] * cfg.n_layer


@pytest.mark.parametrize("n_experts,top_k", [(2, 1), (4, 1), (8, 2), (16, 1), (5, 3)])
def test_moe_zipf_expert_zero_is_never_hot(n_experts, top_k):
    for seed in range(25):
        _, cfg = build_model("moe", "tiny", router="zipf", n_experts=n_experts, top_k=top_k, routing_seed=seed)
        ranking = expert_ranking(cfg)
        assert (ranking[:, : _ceil_quarter(n_experts)] != 0).all(), (seed, ranking)
        assert sorted(ranking[0].tolist()) == list(range(n_experts))
        table = routing_table(cfg)  # (L, V, k): each token's k experts are distinct
        assert table.shape == (cfg.n_layer, cfg.vocab_size, top_k)
        assert all(len(set(row)) == top_k for row in table.reshape(-1, top_k).tolist())


def test_moe_zipf_top_k_caps_an_expert_at_one_slot_per_token():
    _, cfg = build_model("moe", "tiny", router="zipf", n_experts=4, top_k=3, routing_skew=2.0)
    load = expert_load(cfg, torch.arange(cfg.vocab_size))
    assert (load.sum(dim=1) == 3 * cfg.vocab_size).all()
    assert load.max() == cfg.vocab_size  # the hottest experts take every token
    assert (load[torch.arange(cfg.n_layer), expert_ranking(cfg)[:, 0]] == cfg.vocab_size).all()


def test_moe_zipf_is_deterministic_and_seeded():
    def build(seed, torch_seed):
        torch.manual_seed(torch_seed)  # the model's init, not the routing
        model, cfg = build_model("moe", "tiny", router="zipf", n_experts=8, routing_seed=seed)
        return model, cfg

    (m1, c1), (m2, c2), (m3, c3) = build(3, 0), build(3, 1), build(4, 0)
    assert torch.equal(expert_ranking(c1), expert_ranking(c2)) and torch.equal(routing_table(c1), routing_table(c2))
    for b1, b2 in zip(m1.blocks, m2.blocks):
        assert torch.equal(b1.moe.routing_table, b2.moe.routing_table)
        assert b1.moe.router is None  # no router parameters
    assert not torch.equal(routing_table(c1), routing_table(c3))
    # building a zipf model draws nothing from torch's global RNG: same params as a "fixed" one
    torch.manual_seed(0)
    fixed, _ = build_model("moe", "tiny", router="fixed", n_experts=8)
    for p, q in zip(m1.parameters(), fixed.parameters()):
        assert torch.equal(p, q)


def test_moe_zipf_idle_experts_get_no_grad():
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="zipf", n_experts=16)
    x, y = TokenBatches(markov_tokens(cfg.vocab_size, 5_000, seed=0), 1, 16, seed=0).get(0)
    model(x, y).backward()
    expected = expected_experts(model, x)
    assert _expert_grads(model) == expected
    assert all(len(hit) < cfg.n_experts for hit in expected.values())  # 16 tokens: some idle
    ranking = expert_ranking(cfg)
    assert all(int(ranking[layer, 0]) in hit for layer, hit in expected.items())  # the hottest is hit
    for layer, hit in expected.items():
        for e in set(range(cfg.n_experts)) - hit:
            assert all(p.grad is None for p in model.blocks[layer].moe.experts[e].parameters())


def test_set_routing_moves_the_hot_set():
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="zipf", n_experts=8, n_layer=4)
    hot_before = [set(r[:2].tolist()) for r in expert_ranking(model.config)]
    params_before = [p.detach().clone() for p in model.parameters()]
    new = set_routing(model, seed=7)
    assert model.config is new and new.routing_seed == 7 and new.routing_skew == cfg.routing_skew
    hot_after = [set(r[:2].tolist()) for r in expert_ranking(model.config)]
    assert hot_after != hot_before
    for layer, block in enumerate(model.blocks):  # the buffers are the new config's tables
        assert torch.equal(block.moe.routing_table, routing_table(new)[layer])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
    # training after the switch follows the new table
    x, y = _batch("moe", new, batch_size=1)
    model(x[:, :16], y[:, :16]).backward()
    assert _expert_grads(model) == expected_experts(model, x[:, :16]) == expected_experts(new, x[:, :16])
    # back to the first seed: the first tables again; skew 0: uniform
    set_routing(model, seed=cfg.routing_seed)
    assert torch.equal(model.blocks[0].moe.routing_table, routing_table(cfg)[0])
    set_routing(model, skew=0.0)
    assert expert_load(model, torch.arange(cfg.vocab_size)).tolist() == [[32] * 8] * 4


def test_set_routing_errors():
    learned, _ = build_model("moe", "tiny")
    with pytest.raises(ConfigError, match="router"):
        set_routing(learned, seed=1)
    fixed, _ = build_model("moe", "tiny", router="fixed")
    set_routing(fixed, seed=1)  # a fixed table can be redrawn ...
    with pytest.raises(ConfigError, match="zipf"):
        set_routing(fixed, skew=2.0)  # ... but it has no skew
    zipf, _ = build_model("moe", "tiny", router="zipf")
    with pytest.raises(ConfigError, match="routing_skew"):
        set_routing(zipf, skew=-1.0)
    gpt, _ = build_model("gpt", "tiny")
    with pytest.raises(ModelError, match="MoETransformer"):
        set_routing(gpt, seed=1)
    with pytest.raises(ConfigError, match="routing_skew"):
        build_model("moe", "tiny", router="zipf", routing_skew=float("nan"))


# ------------------------------------------------------------------ determinism
@pytest.mark.parametrize("name", ["gpt", "moe", "encoder"])
def test_same_seed_same_params_and_loss(name):
    def run():
        torch.manual_seed(123)
        model, cfg = build_model(name, "tiny")
        x, y = _batch(name, cfg, seed=7)
        return model, model(x, y).item()

    (m1, l1), (m2, l2) = run(), run()
    assert l1 == l2
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    torch.manual_seed(124)
    m3, _ = build_model(name, "tiny")
    assert not torch.equal(next(m3.parameters()), next(m1.parameters()))


def test_data_is_deterministic():
    assert torch.equal(markov_tokens(256, 3000, seed=1), markov_tokens(256, 3000, seed=1))
    assert not torch.equal(markov_tokens(256, 3000, seed=1), markov_tokens(256, 3000, seed=2))
    assert torch.equal(zipf_tokens(256, 3000, seed=1), zipf_tokens(256, 3000, seed=1))
    tokens = markov_tokens(256, 3000, seed=1)
    a, b = TokenBatches(tokens, 4, 16, seed=3), TokenBatches(tokens, 4, 16, seed=3)
    x5, y5 = a.get(5)
    for _ in a:  # iterating (or any other use) does not change what get(i) returns
        pass
    assert torch.equal(b.get(5)[0], x5) and torch.equal(b.get(5)[1], y5)
    assert x5.shape == y5.shape == (4, 16) and x5.dtype == torch.long
    assert torch.equal(x5[:, 1:], y5[:, :-1])  # y is x shifted by one token
    assert not torch.equal(a.get(6)[0], x5)
    assert len(list(a)) == len(a) == (3000 - 1) // 64
    c1, c2 = classification_batches(256, 4, 8, 32, seed=2), classification_batches(256, 4, 8, 32, seed=2)
    assert all(torch.equal(u, v) for u, v in zip(c1.get(3), c2.get(3)))


def test_markov_data_is_predictable():
    """Each token has at most `branching` successors, so a model can learn the chain."""
    tokens = markov_tokens(64, 20_000, seed=0, branching=4)
    pairs = set(zip(tokens[:-1].tolist(), tokens[1:].tolist()))
    succ = Counter(a for a, _ in pairs)
    assert max(succ.values()) <= 4
    assert len(set(tokens.tolist())) > 32  # the walk visits much of the vocabulary


# ------------------------------------------------------------------ the ownership rule
class OwnershipChecker:
    """Enforces zinf's rule mechanically, as the engine would: outside the live window of a module
    that directly owns it (its forward, or its backward), every parameter's data is swapped for a
    same-shape tensor of NaNs. A parameter read anywhere else (by a parent's forward, say) poisons
    the loss or the gradients; in-place edits of a module output trip the full backward hooks."""

    def __init__(self, model: nn.Module):
        self.real: dict[int, torch.Tensor] = {}
        self.poison: dict[int, torch.Tensor] = {}
        self.live: Counter = Counter()
        self.held: list[list[nn.Parameter]] = []
        self.handles = []
        for p in model.parameters():
            self.real[id(p)] = p.data
            self.poison[id(p)] = torch.full_like(p.data, float("nan"))
            p.data = self.poison[id(p)]
        for m in model.modules():
            own = list({id(p): p for p in m.parameters(recurse=False)}.values())
            if not own:
                continue
            self.handles += [
                m.register_forward_pre_hook(lambda mod, args, own=own: self._acquire(own)),
                m.register_forward_hook(lambda mod, args, out, own=own: self._release(own)),
                m.register_full_backward_pre_hook(lambda mod, g, own=own: self._backward_acquire(own)),
                m.register_full_backward_hook(lambda mod, gi, go, own=own: self._backward_release(own, gi)),
            ]

    def _acquire(self, params):
        for p in params:
            self.live[id(p)] += 1
            p.data = self.real[id(p)]

    def _release(self, params):
        for p in params:
            self.live[id(p)] -= 1
            if self.live[id(p)] == 0:
                p.data = self.poison[id(p)]

    def _backward_acquire(self, params):
        self._acquire(params)
        self.held.append(params)

    def _backward_release(self, params, grad_input):
        # As in the engine: with no input needing a gradient torch calls this hook before the
        # module's backward ran, so such modules are released when backward ends.
        if all(g is None for g in grad_input) or params not in self.held:
            return
        self.held.remove(params)
        self._release(params)

    def end_backward(self):
        for params in self.held:
            self._release(params)
        self.held = []
        assert all(v == 0 for v in self.live.values())

    def remove(self, model):
        for h in self.handles:
            h.remove()
        for p in model.parameters():
            p.data = self.real[id(p)]


def _checked_step(model, x, y):
    """Loss and grads of one forward + backward, plain and under the ownership checker."""
    model.zero_grad(set_to_none=True)
    ref_loss = model(x, y)
    ref_loss.backward()
    ref = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    checker = OwnershipChecker(model)
    try:
        loss = model(x, y)
        loss.backward()
        checker.end_backward()
    finally:
        checker.remove(model)
    return ref_loss, ref, loss, {n: p.grad for n, p in model.named_parameters()}


# torch warns that a full backward hook of a module whose inputs need no grad (the embeddings)
# fires early; the checker, like the engine, handles that case.
NO_INPUT_GRAD_WARNING = "ignore:Full backward hook is firing"


@pytest.mark.filterwarnings(NO_INPUT_GRAD_WARNING)
@pytest.mark.parametrize("name,overrides,frozen", [
    ("gpt", {}, None), ("gpt", {"tie_weights": False, "bias": False}, None), ("gpt", {}, "blocks.0."),
    ("moe", {"router": "fixed"}, None), ("moe", {"top_k": 2, "aux_loss_coef": 0.01}, None),
    ("moe", {"router": "zipf", "n_experts": 16}, None),
    ("encoder", {"n_layer": 3}, None), ("encoder", {"n_layer": 3}, "embeddings."),
])
def test_every_parameter_is_used_only_by_its_owner(name, overrides, frozen):
    torch.manual_seed(0)
    model, cfg = build_model(name, "tiny", **overrides)
    if frozen:
        freeze(model, frozen)
    x, y = _batch(name, cfg, batch_size=2)
    ref_loss, ref_grads, loss, grads = _checked_step(model, x, y)
    assert torch.isfinite(loss) and torch.equal(loss, ref_loss)
    for n, g in grads.items():
        assert (g is None) == (ref_grads[n] is None), n
        if g is not None:
            assert torch.isfinite(g).all(), n
            assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-7), n


@pytest.mark.filterwarnings(NO_INPUT_GRAD_WARNING)
def test_ownership_checker_catches_a_parent_reading_a_child_weight():
    """The check is honest: a model that breaks the rule fails it."""

    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10)

        def forward(self, x, y):
            h = self.emb(x) + self.head.bias[:8]  # a child's parameter read in the parent's forward
            return nn.functional.cross_entropy(self.head(h).view(-1, 10), y.view(-1))

    x = torch.randint(10, (2, 5))
    _, _, loss, _ = _checked_step(Bad(), x, x)
    assert torch.isnan(loss)


@pytest.mark.filterwarnings(NO_INPUT_GRAD_WARNING)
def test_ownership_checker_catches_in_place_edits_of_module_outputs():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10)

        def forward(self, x, y):
            h = self.emb(x)
            h += 1.0  # in place on a module's output
            return nn.functional.cross_entropy(self.head(h).view(-1, 10), y.view(-1))

    x = torch.randint(10, (2, 5))
    with pytest.raises(RuntimeError, match="modified inplace"):
        _checked_step(Bad(), x, x)


# ------------------------------------------------------------------ build_model and freeze
def test_build_model_errors_name_the_valid_choices():
    with pytest.raises(ConfigError, match="gpt, moe, encoder"):
        build_model("llama")
    with pytest.raises(ConfigError, match="tiny, small, demo"):
        build_model("gpt", "huge")
    with pytest.raises(ConfigError, match="n_layers.*valid fields.*n_layer"):
        build_model("gpt", "tiny", n_layers=2)
    with pytest.raises(ConfigError, match="router"):
        build_model("moe", "tiny", router="random")
    with pytest.raises(ConfigError, match="divisible"):
        build_model("encoder", "tiny", n_head=5)
    assert set(PRESETS) == {"gpt", "moe", "encoder"}


def test_overrides_apply():
    model, cfg = build_model("gpt", "tiny", n_layer=1, n_embd=32)
    assert cfg.n_layer == 1 and len(model.blocks) == 1 and model.wte.weight.shape == (cfg.vocab_size, 32)


def test_freeze():
    model, _ = build_model("gpt", "tiny")
    names = freeze(model, "blocks.0.")
    assert names and all(n.startswith("blocks.0.") for n in names)
    for n, p in model.named_parameters():
        assert p.requires_grad == (not n.startswith("blocks.0."))
    assert freeze(model, "lm_head.") == ["lm_head.weight"]  # a tied weight, under its second name
    assert not model.wte.weight.requires_grad
    with pytest.raises(ConfigError, match="no parameter"):
        freeze(model, "block.0.")
