"""Sampled shard detail end to end: with the recorder sampling one step in k, the engine builds no
detail event in the other steps, and the profile's accesses per step are those of recording every
step (a dense model's accesses are the same every step)."""

from __future__ import annotations

import pytest
import torch

import zinf
from zinf import events as ev
from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens

from profiler import queries
from profiler.recorder import DETAIL_EVENTS

from test_equivalence import OPT

MiB = 1 << 20
STEPS = 10


def run(tmp_path, every: int):
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=1), 2, 16, seed=1)
    nvme = str(tmp_path / f"nvme{every}")
    url = f"sqlite:///{tmp_path}/profile{every}.db"
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": OPT,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 20_000},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "zinf": {"device": "cpu", "shard_min_bytes": "16KiB", "staging_buffer_size": "1MiB", "staging_buffers": 2,
                 "profiler": {"enabled": True, "db": url}},
    }
    detail_per_step, sampled = [], []
    with zinf.initialize(model, config) as engine:
        rec = engine.recorder
        emit = rec.emit
        counts = [0]

        def counting(e):
            if isinstance(e, DETAIL_EVENTS):
                counts[0] += 1
            emit(e)
        rec.emit = counting
        assert rec.set_shard_detail_every(every) == every
        micro = 0
        for _ in range(STEPS):
            sampled.append(rec.shard_detail_now)
            counts[0] = 0
            for _ in range(2):
                x, y = data.get(micro)
                micro += 1
                engine.backward(engine(x, y))
                engine.step()
            detail_per_step.append(counts[0])
        rec.flush()
        run_id = rec.run_id
    return url, run_id, sampled, detail_per_step


def test_unsampled_steps_build_no_detail_events_and_rates_stay_per_step(tmp_path):
    url1, run1, sampled1, detail1 = run(tmp_path, 1)
    url3, run3, sampled3, detail3 = run(tmp_path, 3)
    assert all(sampled1) and all(d > 0 for d in detail1)
    # step 1 was decided at the run's start (every step then); then one step in 3: steps 4, 7, 10
    assert sampled3 == [True, False, False, True, False, False, True, False, False, True]
    assert [d > 0 for d in detail3] == sampled3, detail3  # nothing built (nor emitted) in the others
    assert detail3[3] == detail1[3]  # a sampled step records all its events
    ss3 = queries.shard_steps(url3, run3)
    assert sorted(set(zip(ss3["step"], ss3["window_steps"]))) == [(1, 1), (2, 3), (5, 3), (8, 3)]
    # accesses per step over steps 2-10 (the first records the trace): the same as every step's
    a = queries.shard_access_stats(url1, run1, first_step=2).set_index("name")
    b = queries.shard_access_stats(url3, run3, first_step=2).set_index("name")
    assert (a["accesses_per_step"] > 0).all()
    assert b["accesses_per_step"].to_numpy() == pytest.approx(a["accesses_per_step"].to_numpy())
    assert b["optimizer_accesses"].sum() == a["optimizer_accesses"].sum()  # 9 steps' worth either way
    steps3 = queries.steps(url3, run3)
    assert len(steps3) == STEPS  # the steps table is never sampled


def test_the_planner_samples_a_dense_models_detail_and_plans_from_it(tmp_path):
    """Adaptive on a dense model: once a plan keeps the placement, the controller has the recorder
    sample one step in min(sparse_detail_every, replan_every) (the accesses are the same every
    step); later plans read the sampled rows, and an adopted plan (the first usually is: the budget
    holds everything) brings back every step's detail."""
    from planner.controller import AdaptiveController

    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=1), 2, 16, seed=1)
    nvme = str(tmp_path / "nvme")
    url = f"sqlite:///{tmp_path}/profile.db"
    config = {
        "train_micro_batch_size_per_gpu": 2, "optimizer": OPT,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "zinf": {"device": "cpu", "shard_min_bytes": "16KiB", "staging_buffer_size": "1MiB", "staging_buffers": 2,
                 "dram_budget": 64 * MiB,  # room for everything: the first plan brings it all in
                 "placement": {"policy": "adaptive", "replan_every": 4, "adopt_margin": 0, "min_gain_fraction": 0,
                               "revert_fraction": None},
                 "profiler": {"db": url}},
    }
    rates_seen = []
    orig = AdaptiveController._plan

    def plan(self, engine, step, *a, **kw):
        out = orig(self, engine, step, *a, **kw)
        if self.last_plan is not None:
            rates_seen.append((step, self.detail_every, out is not None))
        return out

    AdaptiveController._plan = plan
    every = []
    try:
        with zinf.initialize(model, config) as engine:
            for step in range(40):  # quiet re-plans back off (4, 8, 16 steps apart): 40 steps hold 3+
                x, y = data.get(step)
                engine.backward(engine(x, y))
                engine.step()
                every.append((engine.controller.detail_every, engine.recorder.shard_detail_every))
            engine.recorder.flush()
            run_id = engine.recorder.run_id
            controller = engine.controller
    finally:
        AdaptiveController._plan = orig
    assert controller.plans_made >= 3
    assert any(k == 4 for k, _ in every), every  # sampled once the placement settled
    assert all(k == r for k, r in every)  # the controller's period is the recorder's
    for step, k, adopted in rates_seen:
        if adopted:
            assert k == 1, rates_seen  # an adopted plan: every step recorded again
    ss = queries.shard_steps(url, run_id)
    assert (ss["window_steps"] == 4).any()
    # the steps the sampled rows stand for are each covered once: no gap, no overlap
    covered = sorted(s for first, w in set(zip(ss["step"], ss["window_steps"])) for s in range(first, first + w))
    assert covered == sorted(set(covered))
