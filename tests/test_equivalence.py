"""zinf trains exactly as plain PyTorch does, in every placement (fp32 on the CPU).

Each case trains a copy of the same model on the same data for 20 optimizer steps twice: once
with torch.optim and plain autograd, once through zinf. Losses of every micro-batch and the final
parameters must agree to 1e-6 (in practice they are bit-identical).
"""

from __future__ import annotations

import copy

import pytest
import torch

import zinf
from zinf.models import build_model, freeze
from zinf.models.data import TokenBatches, markov_tokens
from zinf.models.moe import expected_experts

from conftest import PLACEMENTS, placement_config

STEPS = 20
TOL = 1e-6


def _gpt():
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    return model, TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=1), 4, cfg.block_size, seed=1)


def _moe_idle():
    """MoE with fixed routing, fed only tokens routed to some experts: the others stay idle."""
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="fixed")
    # tokens whose layer-0 expert is 0..n/2-1: the upper experts of layer 0 get nothing
    allowed = [t for t in range(cfg.vocab_size) if expected_experts(cfg, torch.tensor([[t]]))[0] <= set(range(cfg.n_experts // 2))]
    gen = torch.Generator().manual_seed(2)
    tokens = torch.tensor(allowed)[torch.randint(len(allowed), (20_000,), generator=gen)]
    return model, TokenBatches(tokens, 4, cfg.block_size, seed=2)


def _frozen():
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    freeze(model, "blocks.0.")
    freeze(model, "wpe.")
    return model, TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=3), 4, cfg.block_size, seed=3)


MODELS = {
    "gpt_tied": (_gpt, 1, 0.0),
    "moe_idle": (_moe_idle, 1, 0.0),
    "frozen_block": (_frozen, 1, 0.0),
    "gpt_accum4_clip": (_gpt, 4, 0.05),  # a small clip norm, so that clipping really scales
}

OPT = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}}


def train_plain(model, data, gas, clip, steps=None):
    """Plain PyTorch AdamW (the config's OPT) on the micro-batches ``data.get(0), data.get(1), ...``:
    the loss of every micro-batch and the parameters after ``steps`` (default STEPS) optimizer steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    losses = []
    for step in range(STEPS if steps is None else steps):
        for k in range(gas):
            x, y = data.get(step * gas + k)
            loss = model(x, y)
            losses.append(loss.item())
            (loss / gas if gas > 1 else loss).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def train_steps(engine, data, steps, first=0):
    """``steps`` optimizer steps of ``engine``, one micro-batch each (``data.get(first)``,
    ``data.get(first + 1)``, ...): the loss of every step."""
    losses = []
    for i in range(first, first + steps):
        x, y = data.get(i)
        loss = engine(x, y)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def train_zinf(model, data, gas, clip, config, steps=STEPS, collect=None):
    """zinf (the config plus OPT, ``gas`` and ``clip``) on the same micro-batches as
    :func:`train_plain`: the loss of every micro-batch, then ``collect(engine)`` before the engine
    closes (default: its state_dict and placement), spread into the returned tuple."""
    config = dict(config, optimizer=OPT, gradient_accumulation_steps=gas, gradient_clipping=clip, train_micro_batch_size_per_gpu=4)
    losses = []
    with zinf.initialize(model, config) as engine:
        for step in range(steps):
            for k in range(gas):
                x, y = data.get(step * gas + k)
                loss = engine(x, y)
                losses.append(loss.item())
                engine.backward(loss)
                engine.step()
        assert engine.global_steps == steps
        return (losses, *(collect or (lambda e: (e.state_dict(), e.placement)))(engine))


@pytest.mark.parametrize("placement", [*PLACEMENTS, "adaptive"])
@pytest.mark.parametrize("case", list(MODELS))
def test_matches_plain_pytorch(case, placement, tmp_path):
    make, gas, clip = MODELS[case]
    model, data = make()
    ref = copy.deepcopy(model)
    ref_losses, ref_params = train_plain(ref, data, gas, clip)
    config = placement_config(placement, tmp_path, model)
    losses, params, place, adopted, planned = train_zinf(
        model, data, gas, clip, config,
        collect=lambda e: (e.state_dict(), e.placement, e.plan_version, e.controller.plans_made if e.controller else 0))

    assert len(losses) == len(ref_losses) == STEPS * gas
    worst_loss = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst_loss <= TOL, f"loss differs by {worst_loss}"
    assert set(params) == set(ref_params), "state_dict must name every parameter, tied ones included"
    for name, ref_p in ref_params.items():
        diff = (params[name] - ref_p).abs().max().item()
        assert diff <= TOL, f"{name} differs by {diff}"
    # the placement really is the one asked for
    tiers = {t for p in place.values() for t in p.values()}
    if placement == "dram":
        assert tiers <= {"cpu", "none"}
    elif placement == "adaptive":
        # it planned while training ran, and an adopted plan moved homes into DRAM (the budget holds
        # ~40% of the state: the rest stays on NVMe). The frozen block's plans were once refused
        # in 1-2 of 5-6 runs: a trimmed plan was simulated with the untrimmed plan's buffers
        assert planned >= 2, planned
        assert adopted >= 1 and "cpu" in tiers and "nvme" in tiers, (adopted, tiers)
    elif placement == "nvme":
        assert {p["param"] for p in place.values()} == {"nvme"}
    else:
        assert {p["param"] for p in place.values()} == {"cpu", "nvme"}


def test_training_changes_params_and_reduces_loss(tmp_path):
    """Guard against a vacuous equivalence: both runs must actually learn."""
    model, data = _gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, params, _ = train_zinf(model, data, 1, 0.0, placement_config("nvme", tmp_path))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert all(not torch.equal(params[n], before[n]) for n in before if not n.startswith("wpe"))


def test_moe_idle_experts_get_no_optimizer_state(tmp_path):
    model, data = _moe_idle()
    from zinf.events import ListRecorder, OptimizerShardDone

    rec = ListRecorder()
    cfg = dict(placement_config("nvme", tmp_path, model), optimizer=OPT)
    with zinf.initialize(model, cfg, recorder=rec) as engine:
        idle_expert = next(n for n in engine.placement if "blocks.0.moe.experts.7." in n)
        for step in range(3):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        updated = {e.shard for e in rec.of(OptimizerShardDone)}
        assert idle_expert not in updated
        st = next(s for s in engine.states if s.name == idle_expert)
        assert not st.has_moments and st.steps == [0]
        store = engine._stores["optim"]
        assert not store.exists(st.key("exp_avg")), "no optimizer state may be written for an idle expert"


def test_eval_under_no_grad(tmp_path):
    model, data = _gpt()
    ref = copy.deepcopy(model)
    x, y = data.get(0)
    with zinf.initialize(model, placement_config("nvme", tmp_path)) as engine:
        with torch.no_grad():
            out = engine(x, y)
        assert torch.equal(out, ref(x, y).detach())
        assert all(st.param_state.value == "freed" for st in engine.states)


@pytest.mark.parametrize("placement", ["dram", "nvme"])
def test_fused_optimizer_matches_torch_fused_adamw(placement, tmp_path):
    """``zinf.fused_optimizer`` (the default with CUDA) runs torch's fused kernel: the same result
    as ``torch.optim.AdamW(fused=True)``, clipping and accumulation included."""
    model, data = _gpt()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    gas, clip, steps = 2, 0.05, 6
    for step in range(steps):
        for k in range(gas):
            x, y = data.get(step * gas + k)
            (ref(x, y) / gas).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    cfg = placement_config(placement, tmp_path)
    cfg["zinf"]["fused_optimizer"] = True
    cfg = dict(cfg, optimizer=OPT, gradient_accumulation_steps=gas, gradient_clipping=clip)
    with zinf.initialize(model, cfg) as engine:
        assert engine.optimizer.fused
        for step in range(steps):
            for k in range(gas):
                x, y = data.get(step * gas + k)
                engine.backward(engine(x, y))
                engine.step()
        params = engine.state_dict()
    for name, p in ref.named_parameters():
        diff = (params[name] - p.detach()).abs().max().item()
        assert diff <= TOL, f"{name} differs by {diff}"


class _Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, inner: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_matches_plain_pytorch_on_nvme(reentrant, tmp_path):
    """Backward fetches again for the recomputed forwards: the prefetcher then keeps the recorded
    trace (which holds them) instead of following the forward in reverse. torch's non-reentrant
    checkpoint stops a recomputation early, inside the block's last module: what that module had
    acquired is released at the end of backward, or the next step would run on stale params."""
    model, data = _gpt()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _Checkpointed(block, reentrant)
    ref = copy.deepcopy(model)
    ref_losses, ref_params = train_plain(ref, data, 1, 0.0, steps=6)
    config = placement_config("nvme", tmp_path, model)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 10**6  # a window: the prefetcher works
    losses, params, recomputes, held = train_zinf(
        model, data, 1, 0.0, config, steps=6,
        collect=lambda e: (e.state_dict(), e._recomputes, [st.name for st in e.states if st.refcount]))
    assert recomputes, "the blocks' forwards ran again in backward"
    assert held == [], "no shard stays acquired after a step"
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    for name, ref_p in ref_params.items():
        assert (params[name] - ref_p).abs().max().item() <= TOL, name


def test_gradient_sums_come_back_ahead_of_their_micro_batch(tmp_path):
    """With accumulation and NVMe optimizer homes, each micro-batch after the first reads every
    shard's gradient sum back from its file as backward reaches the shard's module (its pre-hook),
    not when the gradient arrives: once per shard and micro-batch, none left over, exact."""
    make, gas, clip = MODELS["gpt_accum4_clip"]
    model, data = make()
    ref_losses, ref_params = train_plain(copy.deepcopy(model), data, gas, clip, steps=3)
    losses, params, reads, spilled = train_zinf(
        model, data, gas, clip, placement_config("nvme", tmp_path, model), steps=3,
        collect=lambda e: (e.state_dict(), e.grad_reads_ahead,
                           sum(st.shard.trainable and st.place.optim == "nvme" for st in e.states)))
    assert spilled > 0 and reads == 3 * (gas - 1) * spilled
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    assert max((params[n] - p).abs().max().item() for n, p in ref_params.items()) <= TOL
