"""The what-if planner and the recommendations (issue 6, items 3-4), on a real profile: the tiny GPT
trained for a few steps with its state on NVMe files under tmp_path (block 0 pinned to DRAM) and
the profiler recording into SQLite. Copies of that database are edited (steps, I/O samples,
calibrations, tuning trials) for the cases a fresh run does not give."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import zinf
from zinf.config import load_config
from zinf.errors import ZinfError
from zinf.models import build_model

from conftest import SMALL_SHARDS, gpt_batches
from planner.costmodel import CostModelError
from planner.recommend import recommend
from planner.solver import solve
from planner.whatif import WHAT_IF_COLUMNS, WhatIf, WhatIfError, parse_budget, plan_for_budget, what_if
from profiler import queries
from profiler.recorder import record_calibration
from test_equivalence import OPT

N_STEPS = 6
BATCH = 1  # sequences per micro-batch: little compute, so that where the state lives matters
PIN = {"blocks.0": {"device": "cpu"}}  # both homes: the profile then times updates without I/O (deterministic)
STAGING = {"staging_buffers": 2, "staging_buffer_size": "256KiB"}  # small beside the 17 MB model state


def tiny_gpt_config(workdir: Path, pins=PIN, **zinf_keys) -> dict:
    """State on NVMe under ``workdir``, ``pins`` on both homes, small shards and staging, plus
    ``zinf_keys`` in the "zinf" section."""
    nvme = str(workdir / "nvme")
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": OPT,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "module_parameters": pins},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "module_parameters": pins},
        },
        "zinf": {"device": "cpu", **SMALL_SHARDS, **STAGING, **zinf_keys},
    }


def profile_config(workdir: Path, url: str) -> dict:
    """The profiled run's config: state on NVMe, block 0 pinned to DRAM, small shards and staging."""
    return tiny_gpt_config(workdir, profiler={"enabled": True, "db": url})


def profiled_run(workdir: Path, steps: int = N_STEPS) -> str:
    """Train the tiny GPT for ``steps`` steps profiled; returns the database URL."""
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny")
    url = f"sqlite:///{workdir / 'profile.db'}"
    data = gpt_batches(cfg, batch_size=BATCH)
    with zinf.initialize(model, profile_config(workdir, url)) as engine:
        for step in range(steps):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
    return url


def copy_db(url: str, to: Path) -> tuple[str, Path]:
    src = Path(url[len("sqlite:///"):])
    dst = to / "copy.db"
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    return f"sqlite:///{dst}", dst


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    url = profiled_run(tmp_path_factory.mktemp("whatif"))
    return url, queries.latest_run_id(url)


@pytest.fixture(scope="module")
def wi(profile):
    url, run_id = profile
    return WhatIf.from_profile(url, run_id)


# ------------------------------------------------------------------------------ what_if
def test_what_if_columns_monotone_and_endpoints(profile, wi):
    url, run_id = profile
    t0 = time.perf_counter()
    df = wi.table()
    table_s = time.perf_counter() - t0
    assert list(df.columns) == WHAT_IF_COLUMNS
    assert str(df["dram_budget_bytes"].dtype) == "int64" and df["feasible"].dtype == bool
    budgets = df["dram_budget_bytes"].tolist()
    assert budgets == sorted(budgets) and 8 <= len(budgets) <= 10
    assert budgets[0] == wi.min_budget_bytes and budgets[-1] == wi.all_dram_budget_bytes
    assert wi.all_nvme_budget_bytes in budgets
    assert df["feasible"].all() and df["predicted_step_s"].gt(0).all()
    assert df["budget_fraction"].tolist() == pytest.approx([b / wi.state_bytes for b in budgets])
    assert (df["dram_used_bytes"] <= df["dram_budget_bytes"]).all()
    # the predicted step does not grow with the budget (within 3%: the greedy is not exactly monotone)
    step = df["predicted_step_s"].to_numpy()
    assert (step[1:] <= step[:-1] * 1.03).all(), step
    assert step[-1] < 0.95 * step[0], step  # DRAM helps this run
    # speed-up is against all-NVMe with the config's buffers
    assert df["speedup"].to_numpy() == pytest.approx(wi.all_nvme_step_s / step)
    # endpoints: what solve() gives at those budgets (the MILP on every split of the budget that
    # fits, the fastest split refined by the greedy)
    for budget in (wi.min_budget_bytes, wi.all_dram_budget_bytes):
        fits = [s for s in wi.splits if budget - s.reserved_bytes >= wi.pinned_bytes]
        milp = {s.name: solve(s.workload, wi.cost_model, budget, reserved_bytes=s.reserved_bytes, method="milp",
                              milp_rel_gap=1e-4).prediction.step_s for s in fits}
        split = min(fits, key=lambda s: milp[s.name])
        greedy = solve(split.workload, wi.cost_model, budget, reserved_bytes=split.reserved_bytes, method="greedy",
                       resimulate_max_homes=128).prediction.step_s
        direct = min(milp[split.name], greedy)
        assert df.loc[df["dram_budget_bytes"] == budget, "predicted_step_s"].item() == pytest.approx(direct, rel=1e-12)
    assert [s.name for s in wi.splits if wi.min_budget_bytes - s.reserved_bytes >= wi.pinned_bytes] == ["no overlap buffers"]
    # at the minimum only the pinned homes are in DRAM; at the all-DRAM budget every home is
    low, high = wi.plan(wi.min_budget_bytes), wi.plan(wi.all_dram_budget_bytes)
    assert low.home_dram_bytes == wi.pinned_bytes
    assert high.home_dram_bytes == wi.all_dram_home_bytes
    assert all(t["param"] == "cpu" for n, t in low.placement.items() if n.startswith("blocks.0."))
    # the functional API gives the same numbers (everything here is deterministic)
    again = what_if(url, run_id, budgets)
    assert again["predicted_step_s"].to_numpy() == pytest.approx(step, rel=1e-9)
    print(f"\nwhat-if of run {run_id} ({len(wi.workload.shards)} shards): build {wi.build_s:.2f} s, "
          f"{len(budgets)} budgets {table_s:.2f} s; min {wi.min_budget_bytes / 2**20:.2f} MiB, "
          f"all-DRAM {wi.all_dram_budget_bytes / 2**20:.2f} MiB; steps {np.round(step * 1e3, 1)} ms")
    assert wi.build_s + table_s < 20


def test_below_the_minimum_is_infeasible_or_an_error(wi, profile):
    url, run_id = profile
    df = wi.table([wi.min_budget_bytes - 1, wi.min_budget_bytes])
    assert df["feasible"].tolist() == [False, True]
    assert math.isnan(df.loc[0, "predicted_step_s"]) and math.isnan(df.loc[0, "speedup"])
    with pytest.raises(WhatIfError) as exc:
        plan_for_budget(url, run_id, 1024)
    msg = one_line(exc)
    assert "below" in msg and str(wi.min_budget_bytes) in msg


def test_plan_for_budget_document(wi):
    budget = (wi.all_nvme_budget_bytes + wi.all_dram_budget_bytes) // 2
    p = wi.plan(budget)
    assert wi.plan(budget) is p  # a budget asked for again is not solved again
    doc = p.to_document("2025-01-01T00:00:00Z")
    assert list(doc) == ["format", "version", "run_id", "dram_budget_bytes", "predicted_step_s", "placement", "created_at"]
    assert doc["format"] == "zinf-plan" and doc["version"] == 1 and doc["dram_budget_bytes"] == budget
    assert set(doc["placement"]) == set(wi.workload.names)
    tiers = {t for v in doc["placement"].values() for t in v.values()}
    assert {"cpu", "nvme"} <= tiers <= {"cpu", "nvme", "gpu", "none"}
    json.dumps(doc, allow_nan=False)
    assert p.home_dram_bytes == wi.workload.dram_bytes(p.placement) and p.dram_used_bytes <= budget


def test_parse_budget():
    assert parse_budget("2GiB", 100) == 2 << 30
    assert parse_budget("30%", 1000) == 300
    assert parse_budget(" 12.5 % ", 1000) == 125
    for bad in ("abc", "-5%", "x%", "1.5"):
        with pytest.raises(ZinfError) as exc:
            parse_budget(bad, 1000)
        assert "--dram-budget" in one_line(exc)


# ------------------------------------------------------------------------------ errors
def test_too_few_steps(profile, tmp_path):
    url, run_id = profile
    copy, path = copy_db(url, tmp_path)
    with sqlite3.connect(path) as c:
        c.execute("DELETE FROM steps WHERE step > 2")
    with pytest.raises(WhatIfError) as exc:
        what_if(copy, run_id)
    msg = one_line(exc)
    assert f"run {run_id} has 2 recorded" in msg and "train more steps" in msg


def test_no_io_samples_and_no_calibrations(profile, tmp_path):
    url, run_id = profile
    copy, path = copy_db(url, tmp_path)
    with sqlite3.connect(path) as c:
        c.execute("DELETE FROM io_samples")
        c.execute("DELETE FROM calibrations")
    with pytest.raises(CostModelError) as exc:
        plan_for_budget(copy, run_id, 1 << 30)
    assert "zinf bench-io" in one_line(exc)
    with pytest.raises(ZinfError) as exc:
        what_if(copy, run_id + 7)  # an unknown run: one line naming the known ids
    assert f"unknown run id {run_id + 7}" in one_line(exc)


# ------------------------------------------------------------------------------ recommendations
def test_recommendations_from_the_run_calibrations_and_trials(profile, wi, tmp_path):
    url, run_id = profile
    budget = (wi.all_nvme_budget_bytes + wi.all_dram_budget_bytes) // 2
    rec = recommend(url, run_id, budget, whatif=wi)
    cfg = wi.config
    # no trials, no bench-io: the run's own settings, saying why
    assert rec.aio.source == "run_config" and "zinf bench-io" in rec.aio.note
    assert (rec.aio.block_size, rec.aio.queue_depth, rec.aio.thread_count) == (cfg.aio.block_size, cfg.aio.queue_depth,
                                                                               cfg.aio.thread_count)
    d = rec.deepspeed
    numel = wi.workload.shards["numel"]
    assert d.buffer_size == numel.max() and 1 <= d.buffer_count <= 5
    assert 0 < d.max_in_cpu <= numel.sum() and d.dram_need_bytes <= budget
    # DeepSpeed's rule as zinf applies it: a larger max_in_cpu by one more shard would not fit
    assert d.offload_optimizer_device in ("cpu", "nvme") and d.predicted_step_s > 0
    text = json.dumps(rec.to_dict(), allow_nan=False)  # JSON-serialisable
    assert '"max_in_cpu"' in text
    loaded = load_config(d.config())  # the snippet is a valid (DeepSpeed-compatible) config
    assert loaded.zero_optimization.offload_param.max_in_cpu == d.max_in_cpu or d.offload_param_device == "cpu"

    # bench-io results of the run's disk: the best read+write setting
    copy, path = copy_db(url, tmp_path)
    swap = queries.run_info(url, run_id)["swap_dir"]
    rows = []
    for (bs, qd, tc), (r, w) in {(1 << 20, 8, 1): (1.0, 1.0), (1 << 20, 32, 4): (2.5, 1.9), (4 << 20, 32, 8): (3.0, 0.5)}.items():
        for op, gbps in (("read", r), ("write", w)):
            rows.append({"path": swap, "op": op, "fstype": "ext4", "block_size": bs, "queue_depth": qd, "thread_count": tc,
                         "bytes": 1 << 28, "GBps": gbps, "raw_baseline_GBps": 2.0, "source": "bench-io/zinf",
                         "created_at": 1000.0})
    record_calibration(copy, rows)
    aio = recommend(copy, run_id, budget).aio
    assert aio.source == "calibrations" and (aio.block_size, aio.queue_depth, aio.thread_count) == (1 << 20, 32, 4)
    assert swap in aio.note

    # an autotuned run: the setting its tuner kept wins over bench-io
    with sqlite3.connect(path) as c:
        for setting, step_s, chosen in (({"block_size": 1 << 20, "queue_depth": 8, "thread_count": 4, "prefetch_bytes": 1 << 20}, 0.5, 0),
                                        ({"block_size": 512 << 10, "queue_depth": 16, "thread_count": 2, "prefetch_bytes": 2 << 20}, 0.4, 1)):
            c.execute("INSERT INTO tuning_trials (run_id, step, created_at, setting, step_s, chosen) VALUES (?, 3, 0, ?, ?, ?)",
                      (run_id, json.dumps(setting), step_s, chosen))
    rec = recommend(copy, run_id, budget)
    assert rec.aio.source == "tuning_trials"
    assert (rec.aio.block_size, rec.aio.queue_depth, rec.aio.thread_count, rec.aio.prefetch_bytes) == (512 << 10, 16, 2, 2 << 20)
    assert rec.deepspeed.config()["aio"]["block_size"] == 512 << 10
    assert rec.deepspeed.stage3_prefetch_bucket_size == (2 << 20) // 4  # fp32 elements


def test_max_in_cpu_fills_the_budget_in_model_order(profile, wi):
    """A larger budget never gets a smaller max_in_cpu, and the whole model fits at all-DRAM."""
    url, run_id = profile
    small = recommend(url, run_id, wi.all_nvme_budget_bytes + (2 << 20), whatif=wi).deepspeed
    large = recommend(url, run_id, wi.all_dram_budget_bytes * 2, whatif=wi).deepspeed
    assert small.max_in_cpu <= large.max_in_cpu
    assert large.offload_param_device == "cpu" and large.offload_optimizer_device == "cpu"
