"""The adaptive placement controller end to end: a real run profiles into SQLite, the planner
re-plans from it, the engine migrates between steps — and training still matches plain PyTorch.

The workload is a small MoE whose zipf router sends most of a step's few tokens to a few experts
that are not the first in model order, with all state on NVMe at the start and a DRAM budget
that holds only part of it.
"""

from __future__ import annotations

import pytest
import torch

import zinf
from zinf.errors import ConfigError
from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens
from zinf.models.moe import set_routing

from profiler import queries

from test_equivalence import OPT, train_plain

MiB = 1 << 20
REPLAN = 4


def skewed_moe(seq_len: int = 4):
    torch.manual_seed(0)
    model, cfg = build_model("moe", "tiny", router="zipf", routing_skew=1.5)
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=1), 1, seq_len, seed=1)
    return model, cfg, data


def adaptive_config(tmp_path, budget_bytes: int, **placement) -> dict:
    nvme = str(tmp_path / "nvme")
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": OPT,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "zinf": {"device": "cpu", "chunk_size": "64KiB", "shard_min_bytes": "16KiB",
                 "staging_buffer_size": "1MiB", "staging_buffers": 2, "dram_budget": budget_bytes,
                 # Adopt any plan predicted faster: whether a gain pays for its migrations depends on
                 # timings of this shared machine; tests/test_policy.py tests that judgement.
                 "placement": {"policy": "adaptive", "replan_every": REPLAN, "adopt_margin": 0,
                               "min_gain_fraction": 0, "revert_fraction": None, **placement},
                 "profiler": {"db": f"sqlite:///{tmp_path}/profile.db"}},
    }


def test_adaptive_run_plans_migrates_hot_experts_and_matches_pytorch(tmp_path):
    steps = 3 * REPLAN + 2
    model, cfg, data = skewed_moe()
    ref_model, _, _ = skewed_moe()
    ref_losses, ref_params = train_plain(ref_model, data, 1, 0.0, steps)

    url = f"sqlite:///{tmp_path}/profile.db"
    losses = []
    with zinf.initialize(model, adaptive_config(tmp_path, 8 * MiB)) as engine:
        controller = engine.controller
        assert controller is not None and engine.recorder.enabled, "adaptive turns the profiler on itself"
        assert (controller.settings.replan_every, controller.policy.settings.margin) == (REPLAN, 0)
        for step in range(steps):
            x, y = data.get(step)
            loss = engine(x, y)
            losses.append(loss.item())
            engine.backward(loss)
            engine.step()
        params = engine.state_dict()
        placement = engine.placement
        engine.recorder.flush()
        run_id = engine.recorder.run_id
        plan_version = engine.plan_version

    # training is exact whatever moved where
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 1e-6, name

    # it planned every REPLAN steps after the first ones, adopted a plan, and the plan moved homes
    plans = queries.plans(url, run_id)
    assert len(plans) >= 2 and plans["adopted"].any(), plans
    assert plan_version == int(plans["adopted"].sum())
    migrations = queries.migrations(url, run_id)
    assert len(migrations) > 0 and set(migrations["dst_tier"]) <= {"cpu", "nvme"}
    in_dram = {(n, s) for n, t in placement.items() for s, tier in t.items() if tier == "cpu"}
    assert in_dram, "the budget has room: some homes must have come into DRAM"
    steps_df = queries.steps(url, run_id)
    assert (steps_df["migration_s"] > 0).any() and steps_df["plan_version"].max() == plan_version
    assignments = queries.plan_assignments(url, int(plans.loc[plans["adopted"], "plan_id"].iloc[0]))
    assert len(assignments) == len(placement)

    # DRAM went to the hot experts, not to the first ones in model order
    stats = queries.shard_access_stats(url, run_id).set_index("name")
    experts = stats[stats["kind"] == "expert"]
    hot = [n for n in experts.index if (n, "param") in in_dram or (n, "optim") in in_dram]
    cold = [n for n in experts.index if n not in hot]
    assert hot and cold, (hot, cold)
    rate = experts["accesses_per_step"]
    assert rate[hot].mean() > 1.5 * rate[cold].mean(), (rate[hot].mean(), rate[cold].mean())


def test_a_routing_change_gets_a_new_plan_within_two_periods(tmp_path):
    model, cfg, data = skewed_moe()
    url = f"sqlite:///{tmp_path}/profile.db"
    drift_at = 3 * REPLAN
    with zinf.initialize(model, adaptive_config(tmp_path, 10 * MiB)) as engine:
        for step in range(drift_at + 2 * REPLAN + 1):
            if step == drift_at:
                version_before = engine.plan_version
                set_routing(engine, seed=7)
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        placement = engine.placement
        engine.recorder.flush()
        run_id = engine.recorder.run_id
        version_after = engine.plan_version
    assert version_before >= 1, "a plan was adopted before the change"
    assert version_after > version_before, "no new plan within two re-plan periods of the change"
    plans = queries.plans(url, run_id)
    adopted_after = plans[plans["adopted"] & (plans["created_step"] > drift_at)]
    assert len(adopted_after) >= 1 and adopted_after["created_step"].min() <= drift_at + 2 * REPLAN
    # after the change, DRAM holds experts the new routing uses more than those left on NVMe
    shard_steps = queries.shard_steps(url, run_id)
    after = shard_steps[shard_steps["step"] > drift_at]  # rows carry the step number after the step
    rate = after.groupby("name")["forward_accesses"].sum()
    experts = [n for n in placement if ".experts." in n]
    rate = rate.reindex(experts, fill_value=0)
    hot = [n for n in experts if "cpu" in placement[n].values()]
    cold = [n for n in experts if n not in hot]
    assert hot and cold
    assert rate[hot].mean() > 1.2 * rate[cold].mean(), (rate[hot].mean(), rate[cold].mean())


def test_adaptive_needs_a_budget_and_the_profiler(tmp_path):
    model, _, _ = skewed_moe()
    config = adaptive_config(tmp_path, 8 * MiB)
    del config["zinf"]["dram_budget"]
    with pytest.raises(ConfigError, match="dram_budget"):
        zinf.initialize(model, config)
    config = adaptive_config(tmp_path, 8 * MiB)
    config["zinf"]["profiler"]["enabled"] = False
    with pytest.raises(ConfigError, match="profiler.enabled"):
        zinf.initialize(model, config)
    config = adaptive_config(tmp_path, 8 * MiB)
    config["zinf"]["profiler"]["detail"] = "step"
    with pytest.raises(ConfigError, match="detail"):
        zinf.initialize(model, config)


def test_the_demo_plans_from_its_profile(tmp_path):
    from rich.console import Console

    from zinf.demo import DemoSettings, run_demo

    summary = run_demo(DemoSettings(steps=12, batch_size=2, preset="demo", workdir=tmp_path, replan_every=4),
                       Console(file=open(tmp_path / "out.txt", "w")))
    assert summary["plans_made"] >= 2  # steps 4 and 8 at least (a plan that lands delays the next)
    plans = queries.plans(summary["profile_db"], queries.latest_run_id(summary["profile_db"]))
    assert len(plans) == summary["plans_made"]
    assert (summary["migrations"] > 0) == (summary["plans_adopted"] > 0)  # an adopted plan moves homes


class _WrongModel:
    """A simulator that believes every placement takes 1 ms a step: the planner's model is wrong."""

    def predict(self, placement):
        from planner.simulator import Prediction

        return Prediction(1e-3, 0, 0, 0, 0, 0, 0, 1e-3, 0, 1, 0, 0)


def test_a_plan_measured_slower_is_reverted_and_not_tried_again(tmp_path):
    """The controller trusts measurement over its model: a plan that makes the steps slower once it
    has landed is undone, recorded as a revert, and the same plan is not adopted again while the
    accesses stay the same. The wrong model is injected: every home to NVMe, "predicted" 1 ms."""
    from planner.controller import AdaptiveController, ControllerSettings
    from planner.policy import PolicySettings
    from zinf.placement import Move

    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    data = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=1), 2, 32, seed=1)
    config = adaptive_config(tmp_path, 64 * MiB)
    config["zinf"]["placement"] = {"policy": "static"}
    config["zinf"]["profiler"]["enabled"] = True
    config["zero_optimization"]["offload_param"]["max_in_cpu"] = 10**9  # every param in DRAM
    url = config["zinf"]["profiler"]["db"]

    class WrongPlanner(AdaptiveController):
        def _best_plan(self, engine, workload, cost):
            plan, _ = super()._best_plan(engine, workload, cost)
            plan.placement = {n: {"param": "nvme", "optim": "nvme"} for n in engine.placement}
            return plan, _WrongModel()

    with zinf.initialize(model, config) as engine:
        engine.migrate([Move(n, "optim", "cpu") for n, t in engine.placement.items() if t["optim"] == "nvme"])
        start = engine.placement
        assert all(t["param"] == "cpu" and t["optim"] in ("cpu", "none") for t in start.values())
        controller = WrongPlanner(url, engine.recorder, 64 * MiB, ControllerSettings(
            replan_every=REPLAN, first_plan_after=6,  # a 5-step median before: robust to one slow step
            error_plans=0,  # the revert's own rule (accesses unchanged) is what refuses the plan again here
            policy=PolicySettings(margin=0, min_gain_fraction=0)))
        engine.controller = controller
        for step in range(6 * REPLAN):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
        end = engine.placement
        engine.recorder.flush()
        run_id = engine.recorder.run_id
    assert controller.plans_reverted == 1, queries.steps(url, run_id)[["step", "wall_s", "forward_s", "backward_s", "optimizer_s", "migration_s"]].to_string()
    assert end == start, "the reverted placement is the one the bad plan replaced"
    plans = queries.plans(url, run_id)
    reasons = plans["reason"].tolist()
    reverts = [i for i, r in enumerate(reasons) if r.get("trigger") == "revert"]
    assert len(reverts) == 1 and plans["adopted"].iat[reverts[0]]
    first = reverts[0] - 1
    assert plans["adopted"].iat[first] and reasons[first]["trigger"] == "schedule"  # the bad plan itself
    assert reasons[reverts[0]]["measured_step_s"] > 1.05 * reasons[reverts[0]]["before_step_s"]
    # the controller kept the bad plan's figures: its prediction against what it measured
    assert len(controller.verified) == 1
    check = controller.verified[0]
    revert = reasons[reverts[0]]
    assert (check["predicted_s"], check["measured_s"], check["before_s"]) == (
        revert["predicted_step_s"], revert["measured_step_s"], revert["before_step_s"])
    assert check["predicted_s"] < 0.01 < check["measured_s"]  # the injected 1 ms, and the truth
    assert controller.model_error is None  # error_plans=0: the model's error is not used
    later = plans.iloc[reverts[0] + 1:]
    assert len(later) >= 1 and not later["adopted"].any()  # the same plan was made again, and refused
    assert all("reverted" in r["why"] for r in later["reason"])


def test_the_models_error_is_the_median_miss_of_its_last_plans():
    """model_error: median |predicted - measured| / measured of the last error_plans verified
    plans; the controller then refuses predicted gains below it (tests/test_policy.py)."""
    from planner.controller import AdaptiveController, ControllerSettings

    c = AdaptiveController("sqlite://", None, 1 << 30, ControllerSettings(error_plans=3))
    assert c.model_error is None
    for predicted, measured in ((0.5, 1.0), (0.9, 1.0), (1.1, 1.0), (1.3, 1.0)):
        c.verified.append({"step": 1, "predicted_s": predicted, "measured_s": measured, "before_s": 1.0})
    assert c.model_error == pytest.approx(0.1)  # the last three: 0.1, 0.1, 0.3
    assert AdaptiveController("sqlite://", None, 1 << 30, ControllerSettings(error_plans=0)).model_error is None
