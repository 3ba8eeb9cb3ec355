"""fp16 training with loss scaling matches plain PyTorch's mixed precision (fp32 masters, an fp16
working copy, ``torch.amp.GradScaler``), overflowing steps included: they are skipped in both, and
the scale evolves the same way. On the CPU, so it runs everywhere; the GPU tests repeat it."""

from __future__ import annotations

import copy

import pytest
import torch

import zinf
from zinf.loss_scale import LossScaler
from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens

from conftest import placement_config
from test_equivalence import OPT, train_zinf

STEPS = 12
# 2**24 overflows fp16 gradients at once: the first steps are skipped until the scale comes down
FP16 = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1, "loss_scale_window": 4}


def _model():
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    return model, TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=5), 4, cfg.block_size, seed=5)


def train_plain_fp16(model, data, gas, clip, device="cpu", work_device=None, fused=False):
    """Plain PyTorch mixed precision: fp32 master model and GradScaler on ``device``, fp16 working
    copy on ``work_device`` (default: the same), AdamW (``fused`` or op by op)."""
    master = model.to(device)
    work = copy.deepcopy(master).to(work_device or device, torch.float16)
    opt = torch.optim.AdamW(master.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                            **({"fused": True} if fused else {"foreach": False}))
    scaler = torch.amp.GradScaler(device, init_scale=2.0**24, growth_interval=4)
    losses, skipped = [], 0
    for step in range(STEPS):
        for k in range(gas):
            x, y = data.get(step * gas + k)
            loss = work(x.to(work_device or device), y.to(work_device or device))
            losses.append(loss.item())
            scaler.scale(loss / gas if gas > 1 else loss).backward()
            for p32, p16 in zip(master.parameters(), work.parameters()):  # accumulate in fp32, as zinf does
                g = p16.grad.to(device, torch.float32)
                p32.grad = g if p32.grad is None else p32.grad + g
                p16.grad = None
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p32, p16 in zip(master.parameters(), work.parameters()):
                p16.copy_(p32)
    return losses, {n: p.detach().cpu().clone() for n, p in master.named_parameters(remove_duplicate=False)}, skipped, scaler.get_scale()


def train_zinf_fp16(model, data, gas, clip, config):
    """zinf in fp16 (FP16): losses, state_dict, skipped steps and the final loss scale."""
    return train_zinf(model, data, gas, clip, dict(config, fp16=FP16), steps=STEPS,
                      collect=lambda e: (e.state_dict(), e.skipped_steps, e.loss_scaler.scale))


@pytest.mark.parametrize("placement", ["dram", "nvme"])
@pytest.mark.parametrize("gas,clip", [(1, 0.0), (2, 0.05)])
def test_fp16_matches_gradscaler(placement, gas, clip, tmp_path):
    model, data = _model()
    ref_losses, ref_params, ref_skipped, ref_scale = train_plain_fp16(copy.deepcopy(model), data, gas, clip)
    losses, params, skipped, scale = train_zinf_fp16(model, data, gas, clip, placement_config(placement, tmp_path))
    assert ref_skipped >= 2, "the test must exercise overflowing steps"
    assert skipped == ref_skipped and scale == ref_scale
    assert losses == ref_losses  # bit-identical on the CPU
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), f"{name} differs by {(params[name] - ref).abs().max().item()}"
    assert sum(losses[-3:]) < sum(losses[:3]), "training must learn"


def test_skipped_step_changes_nothing(tmp_path):
    model, data = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = dict(placement_config("nvme", tmp_path), optimizer=OPT, fp16=dict(FP16, initial_scale_power=40))
    with zinf.initialize(model, cfg) as engine:
        x, y = data.get(0)
        engine.backward(engine(x, y))
        engine.step()
        assert engine.skipped_steps == 1 and engine.loss_scaler.scale == 2.0**39
        after = engine.state_dict()
        assert all(not st.has_moments for st in engine.states), "no optimizer state may be created by a skipped step"
    for name, p in before.items():
        assert torch.equal(after[name], p), name  # the fp32 masters are untouched


def test_loss_scaler_rules():
    """DeepSpeed's dynamic rules: hysteresis delays the first halving; doubling after a window."""
    s = LossScaler(scale=2.0**10, window=3, hysteresis=2, min_scale=2.0**8)
    s.update(overflow=True)
    assert s.scale == 2.0**10  # one overflow tolerated
    s.update(overflow=True)
    assert s.scale == 2.0**9
    s.update(overflow=True)
    assert s.scale == 2.0**8  # the budget stays spent
    s.update(overflow=True)
    assert s.scale == 2.0**8 and s.overflows == 4  # floor
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 2.0**8
    s.update(overflow=False)
    assert s.scale == 2.0**9  # three good steps since the last overflow
    static = LossScaler(scale=128.0, dynamic=False)
    static.update(overflow=True)
    static.update(overflow=False)
    assert static.scale == 128.0 and static.overflows == 1
