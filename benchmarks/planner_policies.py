"""Placement policies under one DRAM budget: all-NVMe, DeepSpeed's ``max_in_cpu``, zinf's adaptive planner.

One command::

    .venv/bin/python benchmarks/planner_policies.py --path DIR [--workload moe|gpt|both]
        [--budgets 0.2,0.3,0.5] [--policies nvme,max_in_cpu,adaptive] [--steps 8] [--warmup 16]
        [--rounds 3] [--block 8] [--replan-every 4] [--drift-at STEP] [--quick] [--json FILE]

What is measured, for every (workload, DRAM budget, policy):

* the **median optimizer-step time** (seconds, wall clock around the ``gradient_accumulation_steps``
  micro-batches of one optimizer step: forward, backward, ``engine.step()``), over the ``--steps``
  steps after ``--warmup`` steps, pooled over ``--rounds`` rounds;
* its ratio to the **best static policy** at that budget (the faster of ``nvme`` and ``max_in_cpu``;
  > 1 = slower than it);
* the **NVMe bytes per step** (read + written, median), from ``engine.traffic_total`` (migrations
  included as far as the engine counts them there).

Workloads (``--quick`` shrinks both to tiny sizes for a smoke run):

* ``moe`` - a skewed mixture of experts: ``build_model("moe", ...)`` with ``router="zipf"``
  (``routing_skew`` 1.2), 3 layers x 32 experts, each expert its own pair of shards; micro-batches of
  1 x 16 tokens, so that only ~8 of a layer's 32 experts get a token in a step (the others are not
  touched at all: no param read, no gradient, no optimizer I/O). The hot experts are not the first
  ones in model order (the zipf router guarantees expert 0 is never in a layer's hottest quarter),
  so "the first N elements" of ``max_in_cpu`` are not the hot ones. 28.8 M params, 550 MiB of state;
  an all-NVMe step moves ~220 MB and takes ~0.35-0.4 s on the 2-core development VM.
* ``gpt`` - a dense GPT (``build_model("gpt", "small")``, 6.4 M params, 122 MiB of state, every
  weight matrix its own shard), micro-batch 2 x 64 tokens, ``gradient_accumulation_steps`` 4
  (~0.9-1.2 s an optimizer step there): every shard is used alike, so the adaptive planner has
  nothing to find and should only not lose (target >= 0.98x).

The training state is 20 bytes per parameter (fp32 param, grad, master, exp_avg, exp_avg_sq), as
``zinf demo`` and ``benchmarks/step_roofline.py`` count it; a budget of 0.3 is
``"zinf": {"dram_budget": 0.3 * state}``. Policies, all at the same budget:

* ``nvme`` - ``offload_param`` and ``offload_optimizer`` on ``nvme``; the budget only pays for the
  working set, staging and overlap buffers (prefetch, write-behind, ...).
* ``max_in_cpu`` - the same plus ``offload_param.max_in_cpu`` = the largest element count the
  engine accepts under the budget (DeepSpeed's rule: the first N elements in model order keep a
  DRAM param home; the optimizer state stays on NVMe). zinf has no stand-alone ``dram_need``
  function: the engine computes the need in ``Engine.__init__`` (``_dram_need`` +
  ``check_budget``) before it opens any file, so :func:`fits_budget` asks exactly that check, with
  an engine subclass that stops right after it, and a bisection finds the largest N.
* ``adaptive`` - ``"zinf": {"placement": {"policy": "adaptive", "replan_every": K}}``, starting from
  all-NVMe. It needs an engine with a placement controller (``engine.controller``); without one the
  harness prints ``adaptive: not available in this checkout`` and no number.

Fairness on a shared, drifting machine: every run builds a fresh engine from a copy of the same
model and data. The policies of one budget run **side by side** (``--block``, default 8): their
engines exist at once and take turns, a block of optimizer steps each; before the next engine's
block an engine drains its background work (``engine.drain()``: updates, prefetches,
write-behind), so none of one lands in another's steps, and the first step after a pause (nothing
prefetched) is not measured. A slow phase of the machine (on the shared 2-core VM, tens of steps
~20% slower, whatever runs) then falls on every policy alike instead of on whichever ran at the
time: with whole runs one after another, ``max_in_cpu``'s placement measured 0.46 s in each of
three rounds and the adaptive run in that same placement 0.49-0.56 s. The policy order rotates
from round to round (round 0: nvme, max_in_cpu, adaptive; round 1: max_in_cpu, adaptive, nvme;
...), and the medians pool the steps of every round; the table also shows the spread (min-max) of
the per-round medians. Before the first round, one short run is thrown away (the process's own
warm-up). ``--block 0`` runs one whole run after another instead. Each policy has its own folder
under a fresh directory under ``--path`` (shard files; the adaptive runs' profile database),
deleted at the end (also on error or Ctrl-C).

``--drift-at S`` (moe): after the table, one more adaptive run per budget that calls
``set_routing(model, seed=routing_seed + 1)`` before step S (the hot set moves) and prints every
step's time from S - 2 on, with the engine's plan version, so that the recovery is visible; the
step by which the first plan after the change was adopted; and a reference run of as many steps
with the new routing from the start, whose settled step is what "recovered" means at that budget;
the two run side by side like the policies.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zinf  # noqa: E402
from zinf.engine import Engine  # noqa: E402
from zinf.errors import BudgetError  # noqa: E402
from zinf.models import build_model  # noqa: E402
from zinf.models.data import TokenBatches, markov_tokens  # noqa: E402
from zinf.models.moe import expert_load, expert_ranking, set_routing  # noqa: E402
from zinf.placement import fmt_bytes  # noqa: E402
from zinf.storage.fsinfo import filesystem_of  # noqa: E402

STATE_BYTES_PER_PARAM = 4 + 4 + 4 + 4 + 4  # fp32 param, grad, master, exp_avg, exp_avg_sq
DEVICE = "cpu"  # zinf.device of every run (--device): the CPU computes, also on a GPU machine
AIO = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2}
"""The NVMe settings of every policy (--aio-threads, --aio-queue-depth): the same for all, so
that only the placement differs. 2 threads suit the 2-core VM the benchmark was sized on."""
POLICIES = ("nvme", "max_in_cpu", "adaptive")
STATIC_POLICIES = ("nvme", "max_in_cpu")
MOE_HEADLINE_BUDGET = 0.3
MOE_TARGET_SPEEDUP = 1.5  # adaptive vs best static, skewed MoE at 30% (higher = better)
GPT_TARGET_SPEEDUP = 0.98  # adaptive vs best static, dense GPT (at least; 1 = as fast)
DRIFT_PLAN_PERIODS = 2  # after a routing change, a plan within this many re-plan periods ...
DRIFT_RECOVERED = 0.05  # ... and the last steps at most this much slower than a run on the new routing from the start
# The NVMe store's staging pool counts against the budget alike for every policy: 4 x 1 MiB
# (the aio block size) instead of the default 4 x 4 MiB leaves more of a small budget to placement.
STAGING = {"staging_buffers": 4, "staging_buffer_size": "1MiB"}
QUICK_SHARDS = {"shard_min_bytes": "32KiB", "chunk_size": "256KiB", "staging_buffers": 4, "staging_buffer_size": "256KiB"}


# ------------------------------------------------------------------ workloads
@dataclass
class Workload:
    name: str
    model: nn.Module  # the base model; every run trains a deep copy of it
    data: TokenBatches
    grad_accum: int  # micro-batches per optimizer step
    zinf_extra: dict  # shard sizes for the "zinf" section
    about: str

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def state_bytes(self) -> int:
        return STATE_BYTES_PER_PARAM * self.n_params


def make_workload(name: str, quick: bool) -> Workload:
    torch.manual_seed(0)
    if name == "moe":
        if quick:  # 2 x 8 experts of 64 x 256; 32 KiB shards
            sizes = dict(n_layer=2, n_head=2, n_embd=64, n_experts=8, expert_hidden=256)
            extra = QUICK_SHARDS
        else:  # 3 x 32 experts of 192 x 768 (two 576 KiB matrices each, each its own shard)
            sizes = dict(n_layer=3, n_head=3, n_embd=192, n_experts=32, expert_hidden=768)
            extra = {"shard_min_bytes": "512KiB", **STAGING}
        model, cfg = build_model("moe", "tiny", router="zipf", routing_skew=1.2, top_k=1, bias=False, **sizes)
        batch, seq, accum = 1, 16, 1
        about = (f"MoE {cfg.n_layer} layers x {cfg.n_experts} experts (zipf router, skew {cfg.routing_skew}, "
                 f"top-{cfg.top_k}), micro-batch {batch} x {seq} tokens, accumulation {accum}")
    elif name == "gpt":
        model, cfg = build_model("gpt", "tiny" if quick else "small")
        batch, seq, accum = 2, cfg.block_size, 4
        # 256 KiB shards: every weight matrix its own shard, so the chunks that stay materialised
        # for a whole pass are small and a 20% budget still covers the working set
        extra = QUICK_SHARDS if quick else {"shard_min_bytes": "256KiB", **STAGING}
        about = f"dense GPT {cfg.n_layer} x {cfg.n_embd}, micro-batch {batch} x {seq} tokens, accumulation {accum}"
    else:
        raise SystemExit(f"unknown workload {name!r}; use moe, gpt or both")
    data = TokenBatches(markov_tokens(cfg.vocab_size, 200_000, seed=0), batch, seq, seed=0)
    return Workload(name, model, data, accum, extra, about)


# ------------------------------------------------------------------ configs and the budget check
ZINF_EXTRA: dict = {}
"""Settings of the ``zinf`` section every policy gets (``--no-hints``: ``prefetch_hints`` off)."""


def base_config(w: Workload, swap: Path, budget_bytes: int) -> dict:
    """Params and optimizer state on NVMe under ``budget_bytes`` of DRAM (the ``nvme`` policy)."""
    return {
        "train_micro_batch_size_per_gpu": w.data.batch_size,
        "gradient_accumulation_steps": w.grad_accum,
        "gradient_clipping": 0.0,  # lets updates run during backward, as in step_roofline.py
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(swap)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
            "stage3_prefetch_bucket_size": w.n_params // 4,
        },
        "aio": dict(AIO),
        "zinf": {"dram_budget": budget_bytes, "device": DEVICE, **w.zinf_extra, **ZINF_EXTRA},
    }


def policy_config(w: Workload, policy: str, swap: Path, budget_bytes: int, *, max_in_cpu: int = 0,
                  replan_every: int = 4, plan_lag: int | None = None) -> dict:
    cfg = base_config(w, swap, budget_bytes)
    if policy == "max_in_cpu":
        cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
    elif policy == "adaptive":
        if max_in_cpu:  # start where DeepSpeed's rule would put the params, then re-plan
            cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
        cfg["zinf"]["placement"] = {"policy": "adaptive", "replan_every": replan_every}
        if plan_lag is not None:
            cfg["zinf"]["placement"]["plan_lag_steps"] = plan_lag
        # it plans from the profile (and pays for recording it): a database beside the swap files
        cfg["zinf"]["profiler"] = {"db": f"sqlite:///{swap}/profile.db"}
    elif policy != "nvme":
        raise SystemExit(f"unknown policy {policy!r}; use {', '.join(POLICIES)}")
    return cfg


class _FitsBudget(Exception):
    """Raised by :class:`_BudgetProbe` once the engine has accepted the budget."""


class _BudgetProbe(Engine):
    """An engine that stops right after its budget check: ``__init__`` computes the placement's
    DRAM need and refuses it (BudgetError) before ``_open_stores``, the first step that writes."""

    def _open_stores(self) -> None:
        raise _FitsBudget


def fits_budget(model: nn.Module, config: dict) -> bool:
    """Whether ``zinf.initialize(model, config)`` would accept the DRAM budget (no file is written)."""
    try:
        probe = _BudgetProbe(model, config)
    except _FitsBudget:
        return True
    except BudgetError:
        return False
    probe.close()  # the engine changed: the probe no longer stops before any I/O
    raise RuntimeError("fits_budget: Engine no longer calls _open_stores after its budget check; update the probe")


def largest_max_in_cpu(w: Workload, swap: Path, budget_bytes: int) -> int | None:
    """The largest ``max_in_cpu`` (elements) the engine accepts under the budget; None if even 0
    does not fit. Bisection over [0, n_params]: the need grows with N (more DRAM param homes)."""
    def fits(n: int) -> bool:
        return fits_budget(w.model, policy_config(w, "max_in_cpu", swap, budget_bytes, max_in_cpu=n))

    lo, hi = 0, w.n_params
    if not fits(lo):
        return None
    if fits(hi):
        return hi
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ------------------------------------------------------------------ one run
def optimizer_step(engine, w: Workload, micro: int) -> int:
    """One optimizer step of ``w`` on ``engine``: its ``grad_accum`` micro-batches from batch
    ``micro`` on. Returns the next micro-batch's index."""
    for _ in range(w.grad_accum):
        x, y = w.data.get(micro)
        micro += 1
        engine.backward(engine(x, y))
        engine.step()
    return micro


@dataclass
class Run:
    """One engine's life: per-step wall seconds and NVMe bytes of the measured steps."""

    status: str = "ok"  # "ok", "refused" (BudgetError), "unavailable" (no placement controller)
    note: str = ""
    step_s: list[float] = field(default_factory=list)
    nvme_bytes: list[int] = field(default_factory=list)
    dram_homes: str = ""  # what the placement keeps in DRAM at the end
    per_step: list[tuple[int, float, int]] = field(default_factory=list)  # (step, seconds, plan version)
    cold_steps: set[int] = field(default_factory=set)  # steps right after a pause (side by side): not measured
    # adaptive only, over the measured steps: |predicted - measured| / measured of each step whose
    # placement had landed (no migration in it, no plan made after it), the bytes each adopted
    # plan migrated, and the homes sent back within a few plans (the policy's ping-pong count)
    pred_err: list[float] = field(default_factory=list)
    # the same steps as (prediction, measured step s): the error of each prediction against the
    # median of the steps it predicted (a step-time model predicts the typical step, not each one)
    pred_pairs: list[tuple[float, float]] = field(default_factory=list)
    plan_moved_bytes: list[int] = field(default_factory=list)
    pingpong: int = 0
    shards: int = 0
    last_report: object = None  # the engine's last MigrationReport already counted
    # steady state (the measured steps): bytes each re-plan made in them migrated (0 when the
    # plan was not adopted; a plan's deferred moves count with it), the homes sent back within a
    # few plans, and every adopted plan's predicted step against its measured one once landed
    replan_moved_bytes: list[int] = field(default_factory=list)
    steady_pingpong: int = 0
    plan_err: list[float] = field(default_factory=list)
    plans_seen: int = 0  # the controller's plans_made already folded into replan_moved_bytes
    not_solved: int = 0  # re-plans in the measured steps not solved again (nothing had changed)
    trials: list[bool] = field(default_factory=list)  # trials of untried engine modes (whole run): kept or not
    sampled: int = 0  # measured steps during which the profiler sampled its shard detail (1 step in k > 1)
    # CPU seconds of each measured step: the whole process's, and the training thread's alone
    # (the rest: OpenMP workers, NVMe request threads, optimizer worker, profiler writer)
    cpu_s: list[float] = field(default_factory=list)
    measured_from: int = 0  # the first measured step (the warm-up's length)
    train_cpu_s: list[float] = field(default_factory=list)


def dram_homes(engine) -> str:
    """'P param + O optim homes in DRAM' of the engine's placement now."""
    placed = engine.placement.values()
    n_param = sum(p["param"] in ("cpu", "gpu") for p in placed)
    n_optim = sum(p["optim"] in ("cpu", "gpu") for p in placed)
    return f"{n_param}+{n_optim}/{len(engine.placement)}"


class Trainer:
    """One engine's life, a block of optimizer steps at a time, so that several engines can run
    side by side (:func:`side_by_side`): build it, :meth:`advance`, :meth:`pause` between blocks,
    :meth:`finish` for its :class:`Run`. A step right after a pause is not measured: the engine
    drained its prefetches there, and a step that starts with nothing prefetched is not a steady one."""

    def __init__(self, w: Workload, config: dict, warmup: int, steps: int, *, need_controller: bool = False,
                 drift_at: int | None = None) -> None:
        self.w, self.warmup, self.total = w, warmup, warmup + steps
        self.need_controller, self.drift_at = need_controller, drift_at
        self.step = self.micro = 0
        self.cold = False  # the next step follows a pause
        self.engine = None
        try:
            self.engine = zinf.initialize(copy.deepcopy(w.model), config)
        except BudgetError as e:
            self.run = Run("refused", str(e).split(";")[0])
            return
        self.run = Run(measured_from=warmup)
        if need_controller and getattr(self.engine, "controller", None) is None:
            self.run = Run("unavailable", "engine has no placement controller (engine.controller)")
            self.engine.close()
            self.engine = None
            return
        self.prediction, self.versions_before = None, self.engine.plan_version
        self.pingpong_before = self.verified_before = self.skipped_before = 0

    @property
    def done(self) -> bool:
        return self.engine is None or self.step >= self.total

    def advance(self, n: int | None = None) -> None:
        """Train up to ``n`` more optimizer steps (without ``n``: every step left)."""
        engine, run, w = self.engine, self.run, self.w
        stop = self.total if n is None else min(self.total, self.step + n)
        while self.step < stop:
            step = self.step
            if self.need_controller and step == self.warmup:  # the steady state starts here
                c = engine.controller
                run.plans_seen, self.pingpong_before, self.verified_before = c.plans_made, c.policy.pingpong_total, len(c.verified)
                self.skipped_before = getattr(c, "plans_skipped", 0)
            if self.drift_at is not None and step == self.drift_at:
                new = set_routing(engine.module, seed=engine.module.config.routing_seed + 1)
                run.note = f"set_routing(seed={new.routing_seed}) before step {step}"
            traffic = engine.traffic_total
            before_b = traffic.read["nvme"] + traffic.written["nvme"]
            t0, cpu0, train0 = time.perf_counter(), time.process_time(), time.thread_time()
            self.micro = optimizer_step(engine, w, self.micro)
            dt = time.perf_counter() - t0
            cpu_s, train_cpu_s = time.process_time() - cpu0, time.thread_time() - train0
            moved_b = engine.traffic_total.read["nvme"] + engine.traffic_total.written["nvme"] - before_b
            run.per_step.append((step, dt, getattr(engine, "plan_version", 0)))
            cold, self.cold = self.cold, False
            if cold:
                run.cold_steps.add(step)
            if step >= self.warmup:
                if not cold:
                    run.step_s.append(dt)
                    run.nvme_bytes.append(moved_b)
                    run.cpu_s.append(cpu_s)
                    run.train_cpu_s.append(train_cpu_s)
                if self.need_controller:  # plans and moves count in every step; predictions in measured ones
                    track_controller(engine, dt, run, None if cold else self.prediction, self.versions_before)
                    run.sampled += not cold and getattr(engine.controller, "detail_every", 1) > 1
            self.prediction = getattr(engine.controller, "predicted_step_s", None) if self.need_controller else None
            self.versions_before = engine.plan_version
            self.step += 1

    def pause(self) -> None:
        """Let this engine's background work finish before another engine's block starts."""
        if self.engine is not None and not self.done:
            self.engine.drain()
            self.cold = True

    def finish(self) -> Run:
        """Close the engine (idempotent) and return the run."""
        engine, run = self.engine, self.run
        if engine is None:
            return run
        self.engine = None
        try:
            run.dram_homes = dram_homes(engine)
            run.shards = len(engine.placement)
            if self.need_controller:
                c = engine.controller
                run.pingpong = c.policy.pingpong_total
                run.steady_pingpong = c.policy.pingpong_total - self.pingpong_before
                run.not_solved = getattr(c, "plans_skipped", 0) - self.skipped_before
                run.plan_err = [abs(v["predicted_s"] - v["measured_s"]) / v["measured_s"]
                                for v in c.verified[self.verified_before:]]
                run.trials = [bool(t.get("kept")) for t in getattr(c, "trials", [])]
        finally:
            engine.close()
        return run


def folder(swap: Path, name: str) -> Path:
    """A policy's own folder under the swap directory (its shard files and, adaptive, its profile
    database): engines that run side by side must not share either."""
    path = swap / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def side_by_side(trainers: list[Trainer], block: int) -> list[Run]:
    """Run the trainers' steps in turn, ``block`` steps each (0: one whole run after another), and
    return their runs. Each engine drains its background work before the next one's block, so no
    write-behind of one lands in another's steps; a slow phase of a shared machine (minutes of a
    noisy neighbour) then falls on every policy alike instead of on whichever ran at the time."""
    try:
        while any(not t.done for t in trainers):
            for t in trainers:
                if t.done:
                    continue
                t.advance(block or None)
                if sum(not u.done for u in trainers) > 1:
                    t.pause()
    finally:  # every engine closed, also on error or Ctrl-C
        runs = [t.finish() for t in trainers]
    return runs


def train(w: Workload, config: dict, warmup: int, steps: int, *, need_controller: bool = False,
          drift_at: int | None = None) -> Run:
    """Build an engine on a copy of the workload's model, train warmup + steps optimizer steps."""
    return side_by_side([Trainer(w, config, warmup, steps, need_controller=need_controller, drift_at=drift_at)], 0)[0]


def track_controller(engine, step_s: float, run: Run, prediction: float | None, version_before: int) -> None:
    """Fold one measured adaptive step into ``run``: the prediction error of the placement that
    was in force for the whole step (``prediction`` was made before the step; the step moved
    nothing and made no plan), the bytes a newly adopted plan moved, and the re-plans made."""
    c = engine.controller
    report = engine.last_migration
    moved = report.bytes_moved if report is not None and report is not run.last_report else 0
    run.last_report = report
    if engine.plan_version != version_before:
        run.plan_moved_bytes.append(moved)
    elif moved and run.plan_moved_bytes:
        run.plan_moved_bytes[-1] += moved  # the rest of a plan deferred by the per-step byte budget
    if c.plans_made > run.plans_seen:  # re-planned after this step (its first moves are in it)
        run.replan_moved_bytes += [0] * (c.plans_made - run.plans_seen)
        run.plans_seen = c.plans_made
    if moved and run.replan_moved_bytes:
        run.replan_moved_bytes[-1] += moved  # the newest re-plan's moves, deferred ones included
    planned = c.last_plan_step == engine.global_steps
    if prediction is not None and not moved and not planned and not c.migrating:
        run.pred_err.append(abs(prediction - step_s) / step_s)
        run.pred_pairs.append((prediction, step_s))


# ------------------------------------------------------------------ the sweep
@dataclass
class Cell:
    """Everything measured for one (workload, budget, policy), over all rounds."""

    runs: list[Run] = field(default_factory=list)
    max_in_cpu: int | None = None

    @property
    def status(self) -> str:
        return self.runs[0].status if self.runs else "not run"

    @property
    def step_s(self) -> float | None:
        times = [t for r in self.runs for t in r.step_s]
        return statistics.median(times) if self.status == "ok" and times else None

    @property
    def mean_s(self) -> float | None:
        """Mean step: unlike the median it carries the re-plan and migration steps (throughput)."""
        times = [t for r in self.runs for t in r.step_s]
        return statistics.fmean(times) if self.status == "ok" and times else None

    @property
    def nvme_bytes(self) -> float | None:
        b = [x for r in self.runs for x in r.nvme_bytes]
        return statistics.median(b) if self.status == "ok" and b else None

    @property
    def pred_err(self) -> float | None:
        """Median |predicted - measured| / measured step time (adaptive; steps whose placement had landed)."""
        e = [x for r in self.runs for x in r.pred_err]
        return statistics.median(e) if e else None

    def _steps_by_prediction(self) -> list[tuple[float, list[float]]]:
        """(prediction, the measured steps it was in force for), per prediction per run."""
        groups: list[tuple[float, list[float]]] = []
        for r in self.runs:
            by_pred: dict[float, list[float]] = {}
            for pred, t in r.pred_pairs:
                by_pred.setdefault(pred, []).append(t)
            groups += by_pred.items()
        return groups

    @property
    def pred_err_of_median(self) -> float | None:
        """|prediction - median of the steps it was in force for| / that median, per prediction
        (per run), the median over the steps (each prediction weighted by its steps)."""
        errs: list[float] = []
        for pred, ts in self._steps_by_prediction():
            med = statistics.median(ts)
            errs += [abs(pred - med) / med] * len(ts)
        return statistics.median(errs) if errs else None

    @property
    def pred_err_floor(self) -> float | None:
        """The noise floor of :attr:`pred_err`: median |median - measured| / measured over the same
        steps, where median is that of the steps each prediction was in force for - the error of a
        predictor that knew every placement's median step exactly. A step-time model predicts the
        typical step; no single number per placement gets below the steps' own spread."""
        errs: list[float] = []
        for _, ts in self._steps_by_prediction():
            med = statistics.median(ts)
            errs += [abs(med - t) / t for t in ts]
        return statistics.median(errs) if errs else None

    def churn(self, budget_bytes: int) -> tuple[int, float] | None:
        """Steady state: (re-plans made in the measured steps, the most bytes one of them
        migrated as a fraction of the DRAM budget; 0 for a plan not adopted)."""
        b = [x for r in self.runs for x in r.replan_moved_bytes]
        return (len(b), max(b) / budget_bytes) if b else None

    @property
    def pingpong(self) -> float | None:
        """Homes sent back within a few plans, per shard, in the measured steps (all rounds)."""
        shards = sum(r.shards for r in self.runs)
        return sum(r.steady_pingpong for r in self.runs) / shards if shards else None

    @property
    def pingpong_whole_runs(self) -> float | None:
        """Homes sent back within a few plans, per shard, over whole runs (the start included)."""
        shards = sum(r.shards for r in self.runs)
        return sum(r.pingpong for r in self.runs) / shards if shards else None

    @property
    def plan_err(self) -> tuple[int, float] | None:
        """(adopted plans measured in the measured steps, median |predicted - measured| / measured
        of their steps once landed): the model's error on a placement it had not measured."""
        e = [x for r in self.runs for x in r.plan_err]
        return (len(e), statistics.median(e)) if e else None

    @property
    def spread(self) -> str:
        meds = [statistics.median(r.step_s) for r in self.runs if r.step_s]
        return f"{min(meds):.3f}-{max(meds):.3f}" if len(meds) > 1 else ""


def best_static(cells: dict[str, Cell]) -> tuple[str, float] | None:
    timed = [(p, cells[p].step_s) for p in STATIC_POLICIES if p in cells and cells[p].step_s is not None]
    return min(timed, key=lambda pt: pt[1]) if timed else None


def sweep(w: Workload, budgets: list[float], policies: list[str], swap: Path, args) -> dict[float, dict[str, Cell]]:
    cells = {b: {p: Cell() for p in policies} for b in budgets}
    start_n: dict[float, int] = {}
    for b in budgets:
        n = None
        if "max_in_cpu" in policies or ("adaptive" in policies and args.adaptive_start == "max_in_cpu"):
            n = largest_max_in_cpu(w, swap, int(b * w.state_bytes))
        if "max_in_cpu" in policies:
            cells[b]["max_in_cpu"].max_in_cpu = n
        start_n[b] = (n or 0) if args.adaptive_start == "max_in_cpu" else 0
    # one short, discarded run first, so that the process's own warm-up (lazy imports, allocator,
    # the disk's first writes) is charged to no policy
    train(w, policy_config(w, "nvme", swap, int(max(budgets) * w.state_bytes)), warmup=2, steps=0)
    adaptive_missing = False
    for r in range(args.rounds):
        order = policies[r % len(policies):] + policies[: r % len(policies)]  # rotate per round
        for b in budgets:
            budget_bytes = int(b * w.state_bytes)
            trainers: dict[str, Trainer] = {}
            for p in order:
                cell = cells[b][p]
                if p == "adaptive" and adaptive_missing:
                    continue
                if p == "max_in_cpu" and cell.max_in_cpu is None:
                    cell.runs.append(Run("refused", "the budget is below the working set even with max_in_cpu 0"))
                    continue
                n = start_n[b] if p == "adaptive" else cell.max_in_cpu or 0
                cfg = policy_config(w, p, folder(swap, p), budget_bytes, max_in_cpu=n, replan_every=args.replan_every,
                                    plan_lag=args.plan_lag)
                trainers[p] = Trainer(w, cfg, args.warmup, args.steps, need_controller=(p == "adaptive"))
            for p, run in zip(trainers, side_by_side(list(trainers.values()), args.block)):
                cells[b][p].runs.append(run)
                adaptive_missing |= p == "adaptive" and run.status == "unavailable"
                shown = f"{statistics.median(run.step_s):.3f} s" if run.step_s else run.status
                print(f"  round {r + 1}/{args.rounds} {w.name} budget {b:.0%} {p:<10} {shown}", flush=True)
    return cells


def print_table(w: Workload, cells: dict[float, dict[str, Cell]]) -> None:
    print(f"\n{w.name} results (state {fmt_bytes(w.state_bytes)}; budgets are fractions of it)")
    print(f"{'budget':>7} {'policy':<11} {'step_s':>8} {'mean_s':>8} {'spread_s':>13} {'vs_best':>8} {'nvme_MB/step':>13} "
          f"{'dram_homes':>11}  note")
    for b, by_policy in cells.items():
        best = best_static(by_policy)
        for p, cell in by_policy.items():
            note = f"max_in_cpu={cell.max_in_cpu:,}" if p == "max_in_cpu" and cell.max_in_cpu is not None else ""
            if p == "adaptive" and cell.status == "ok":
                churn, plan_err = cell.churn(int(b * w.state_bytes)), cell.plan_err
                note = "; ".join([
                    (f"pred err {cell.pred_err:.1%} (of the median {cell.pred_err_of_median:.1%}; "
                     f"noise floor {cell.pred_err_floor:.1%})"
                     if cell.pred_err is not None else "pred err -"),
                    (f"{churn[0]} re-plans ({sum(r.not_solved for r in cell.runs)} not re-solved), "
                     f"{sum(len(r.plan_moved_bytes) for r in cell.runs)} adopted") if churn else "0 re-plans",
                    f"churn max {churn[1]:.1%} of budget" if churn else "churn -",
                    f"ping-pong {cell.pingpong:.1%} ({cell.pingpong_whole_runs:.1%} whole runs)",
                    f"plan err {plan_err[1]:.1%} (n={plan_err[0]})" if plan_err else "plan err -",
                    f"shard detail sampled in {sum(r.sampled for r in cell.runs) / max(1, sum(len(r.step_s) for r in cell.runs)):.0%} of steps",
                    f"trials of untried engine modes {sum(len(r.trials) for r in cell.runs)} "
                    f"({sum(sum(r.trials) for r in cell.runs)} kept; whole runs)",
                ])
            if cell.status != "ok":
                msg = "not available in this checkout" if cell.status == "unavailable" else cell.status
                detail = cell.runs[0].note if cell.runs else ""
                print(f"{b:>7.0%} {p:<11} {msg:>8}  ({detail})")
                continue
            ratio = f"{cell.step_s / best[1]:.2f}" if best else "-"
            print(f"{b:>7.0%} {p:<11} {cell.step_s:8.3f} {cell.mean_s:8.3f} {cell.spread:>13} {ratio:>8} "
                  f"{cell.nvme_bytes / 1e6:13.1f} {cell.runs[-1].dram_homes:>11}  {note}")
    print("(step_s: median optimizer-step seconds; mean_s: their mean, re-plan and migration steps included; vs_best: step_s / best static policy's, < 1 = faster; "
          "dram_homes: param+optim homes in DRAM / shards, at the end of the last run; adaptive, over the measured steps (the steady state): "
          "pred err = median |predicted - measured| / measured of the steps whose placement had landed (of the median: each prediction against "
          "the median of the steps it was in force for; noise floor: that median against each of those steps, what a predictor that knew every "
          "placement's median step would score), re-plans made (of which not re-solved: "
          "nothing had changed since the last plan solved) and adopted, churn max = "
          "the most bytes one re-plan migrated / DRAM budget, ping-pong = homes sent back within 3 plans / shards, plan err = median "
          "|predicted - measured| / measured of adopted plans once landed; shard detail sampled = measured steps during which the profiler recorded "
          "shard detail in one step of several, the controller's sparse_detail_every; trials = plans in an engine mode that had not run, "
          "kept only if measured faster, over the whole run)")


def block_ratios(num: Run, den: Run, block: int, first_step: int) -> list[float]:
    """``num``'s block median over ``den``'s, for every block of ``block`` steps from
    ``first_step`` on that both measured (steps right after a pause are not)."""
    def blocks(run: Run) -> dict[int, list[float]]:  # the measured steps' seconds, by block
        out: dict[int, list[float]] = {}
        for step, sec, _ in run.per_step:
            if step not in run.cold_steps and step >= first_step:
                out.setdefault(step // block, []).append(sec)
        return out

    n_blocks, d_blocks = blocks(num), blocks(den)
    return [statistics.median(n_blocks[k]) / statistics.median(d_blocks[k]) for k in d_blocks if k in n_blocks]


def paired_speed(adaptive: Cell, static: Cell, block: int) -> tuple[float, float, float, int] | None:
    """Best static's step over adaptive's, block by block: side by side, the policies' blocks of
    ``block`` steps follow each other within seconds, so a slow phase of a shared machine falls
    on both of a pair, while the medians over whole runs still carry it (the same static
    placement measured 0.56-0.63 s in three runs a minute apart on the 2-core VM). Returns the
    median over (round, block) pairs of static's block median / adaptive's, its quartiles and the
    number of pairs; None when the runs were not side by side."""
    if block <= 0:
        return None
    ratios = [r for a_run, s_run in zip(adaptive.runs, static.runs)
              for r in block_ratios(s_run, a_run, block, a_run.measured_from)]
    if len(ratios) < 2:
        return None
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return med, q1, q3, len(ratios)


def headline(name: str, cells: dict[float, dict[str, Cell]] | None, budget: float | None, target: float,
             block: int = 0) -> str:
    """'<workload> at <budget>: adaptive is X.XXx the speed of the best static (target >= T)', and
    the same ratio paired block by block where the policies ran side by side (:func:`paired_speed`)."""
    if cells is None:
        return f"{name}: not measured (workload not selected)"
    budgets = [budget] if budget is not None else list(cells)
    out = []
    for b in budgets:
        if b not in cells:
            out.append(f"{name} at {b:.0%}: not measured (budget not selected)")
            continue
        adaptive, best = cells[b].get("adaptive"), best_static(cells[b])
        if adaptive is None or adaptive.status == "not run":
            out.append(f"{name} at {b:.0%}: adaptive not measured (policy not selected)")
        elif adaptive.status == "unavailable":
            out.append(f"{name} at {b:.0%}: adaptive: not available in this checkout")
        elif adaptive.step_s is None or best is None:
            out.append(f"{name} at {b:.0%}: no ratio (adaptive {adaptive.status}, best static "
                       f"{'missing' if best is None else best[0]})")
        else:
            speed = best[1] / adaptive.step_s
            verdict = "meets" if speed >= target else "MISSES"
            paired = paired_speed(adaptive, cells[b][best[0]], block)
            also = (f"; paired block by block {paired[0]:.2f}x (quartiles {paired[1]:.2f}-{paired[2]:.2f}, {paired[3]} pairs)"
                    if paired else "")
            out.append(f"{name} at {b:.0%}: adaptive {adaptive.step_s:.3f} s vs best static {best[0]} {best[1]:.3f} s "
                       f"-> {speed:.2f}x the speed (target >= {target}x: {verdict}){also}")
    return "\n".join(out)


def drift_run(w: Workload, budgets: list[float], swap: Path, args, cells: dict[float, dict[str, Cell]]) -> list[str]:
    """Adaptive MoE runs in which the hot experts move before step --drift-at: every step's time
    from two steps before the switch on, the medians of --steps steps before it and at the end,
    when the first plan after the switch was adopted (in re-plan periods), and a
    reference: an adaptive run of as many steps on the new routing from its first step, whose
    last --steps steps are what this budget reaches on that routing once settled (the new hot set
    may be more or less skewed than the old one, so the steps before the switch are not it).
    Returns one headline per budget: the drift target is a plan within DRIFT_PLAN_PERIODS re-plan
    periods and the last steps within DRIFT_RECOVERED of the reference's."""
    total = args.drift_at + args.warmup + args.steps  # --warmup + --steps steps to recover
    verdicts: list[str] = []
    moved = copy.deepcopy(w.model)
    seed = set_routing(moved, seed=moved.config.routing_seed + 1).routing_seed
    w_new = replace(w, model=moved)
    for b in budgets:
        n = largest_max_in_cpu(w, swap, int(b * w.state_bytes)) if args.adaptive_start == "max_in_cpu" else 0

        def cfg(name: str) -> dict:
            return policy_config(w, "adaptive", folder(swap, name), int(b * w.state_bytes), max_in_cpu=n or 0,
                                 replan_every=args.replan_every, plan_lag=args.plan_lag)

        # the drifted run and its reference side by side, like the policies of the table
        run, reference = side_by_side([
            Trainer(w, cfg("drifted"), warmup=total, steps=0, need_controller=True, drift_at=args.drift_at),
            Trainer(w_new, cfg("reference"), warmup=total, steps=0, need_controller=True)], args.block)
        if run.status == "unavailable":
            print("\ndrift: adaptive: not available in this checkout")
            return verdicts
        if run.status != "ok":
            print(f"\ndrift at {b:.0%}: {run.status} ({run.note})")
            verdicts.append(f"drift at {b:.0%}: {run.status}")
            continue
        times = run.per_step
        before = measured(times[max(0, args.drift_at - args.steps): args.drift_at], run)
        after = measured(times[-args.steps:], run)
        best = best_static(cells[b]) if b in cells else None
        print(f"\ndrift at {b:.0%}: {run.note}; median step before {statistics.median(before):.3f} s, "
              f"last {args.steps} steps ({len(after)} measured: none right after a pause) {statistics.median(after):.3f} s"
              + (f"; best static without drift: {best[0]} {best[1]:.3f} s" if best else ""))
        periods, when = first_plan_after(run, args.drift_at, args.replan_every)
        print("  " + when)
        ratio = None
        if reference.status == "ok":
            settled = statistics.median(measured(reference.per_step[-args.steps:], reference))
            ratio = statistics.median(after) / settled
            print(f"  reference: adaptive on the new routing (seed {seed}) from step 0, last {args.steps} steps "
                  f"{settled:.3f} s; the drifted run's last {args.steps} / that = {ratio:.2f}")
            # side by side, a slow phase of a shared machine falls on both blocks of a pair
            paired = block_ratios(run, reference, args.block, total - args.steps) if args.block else []
            if len(paired) >= 2:
                q1, med, q3 = statistics.quantiles(paired, n=4)
                print(f"  paired block by block: {med:.2f}x (quartiles {q1:.2f}-{q3:.2f}, {len(paired)} pairs)")
        planned = periods is not None and periods <= DRIFT_PLAN_PERIODS
        recovered = ratio is not None and ratio <= 1 + DRIFT_RECOVERED
        verdicts.append(f"drift at {b:.0%}: "
                        + ("no plan after the change" if periods is None else f"first plan after {periods:.1f} periods")
                        + f" (target <= {DRIFT_PLAN_PERIODS}: {'meets' if planned else 'MISSES'}); last {args.steps} steps "
                        + ("-" if ratio is None else f"{ratio:.2f}x")
                        + f" the reference's (target <= {1 + DRIFT_RECOVERED:.2f}x: {'meets' if recovered else 'MISSES'})")
        print("  step  step_s  plan_version")
        for s, dt, version in run.per_step:
            if s >= args.drift_at - 2:
                notes = (["routing changed before this step"] if s == args.drift_at else []) + \
                        (["after a pause: not measured"] if s in run.cold_steps else [])
                print(f"  {s:4d}  {dt:6.3f}  {version}" + (f"   <- {'; '.join(notes)}" if notes else ""))
    return verdicts


def measured(steps: list[tuple[int, float, int]], run: Run) -> list[float]:
    """The seconds of those of ``steps`` (from ``run.per_step``) that were measured: none right
    after a pause."""
    return [dt for step, dt, _ in steps if step not in run.cold_steps]


def first_plan_after(run: Run, drift_at: int, replan_every: int) -> tuple[float | None, str]:
    """When the first plan after the routing change was adopted: the first step at or after
    ``drift_at`` that ran under a new plan version (its moves start in that step's hook; the
    engine spreads them over the next steps within its per-step byte budget)."""
    versions = {s: v for s, _, v in run.per_step}
    v0 = versions.get(drift_at - 1)
    adopted = next((s for s, _, v in run.per_step if s >= drift_at and v != v0), None)
    if adopted is None:
        return None, "no plan adopted after the routing change"
    steps = adopted - drift_at + 1
    return steps / replan_every, (f"first plan after the change adopted by step {adopted}: {steps} steps = "
                                  f"{steps / replan_every:.1f} re-plan periods after the change")


def load_average() -> str:
    """The machine's 1/5/15-minute load average ("-" where the OS has none)."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def describe_routing(w: Workload) -> str:
    """The measured expert load of the MoE workload: hottest experts and experts hit per step."""
    cfg = w.model.config
    ranking = expert_ranking(cfg)
    hits = [[int((expert_load(cfg, w.data.get(i)[0])[layer] > 0).sum()) for i in range(50)] for layer in range(cfg.n_layer)]
    return "; ".join(f"layer {layer}: hottest experts {ranking[layer, :4].tolist()}, "
                     f"{statistics.mean(h):.1f}/{cfg.n_experts} experts hit per step" for layer, h in enumerate(hits))


def plan_lag_text(plan_lag: int | None) -> str:
    """Where the adaptive policy's plans are made, in words."""
    from planner.controller import default_plan_lag_steps

    lag = default_plan_lag_steps() if plan_lag is None else plan_lag
    where = "between steps" if lag == 0 else f"in the planning process (plan_lag_steps {lag})"
    return where + (" (this machine's default)" if plan_lag is None else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="directory on the disk to measure (swap files go under it)")
    ap.add_argument("--workload", choices=("moe", "gpt", "both"), default="both")
    ap.add_argument("--budgets", default="0.2,0.3,0.5", help="DRAM budgets as fractions of the training state")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ", ".join(POLICIES))
    ap.add_argument("--steps", type=int, default=8, help="measured optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=16,
                    help="optimizer steps before measuring (adaptive: its first plans, migrations and trials - the "
                         "exploring periods end zinf.placement.trial_periods (3) re-plan periods after the first plan)")
    ap.add_argument("--rounds", type=int,
                    help="rounds; the policy order rotates from round to round (default 3: each policy once in "
                         "each slot; 2 with --quick)")
    ap.add_argument("--replan-every", type=int, default=4, help="zinf.placement.replan_every of the adaptive policy")
    ap.add_argument("--plan-lag", type=int, default=None,
                    help="zinf.placement.plan_lag_steps of the adaptive policy (default: the config's default for this "
                         "machine; 0 plans between steps, N > 0 in the planning process)")
    ap.add_argument("--adaptive-start", choices=("max_in_cpu", "nvme"), default="max_in_cpu",
                    help="where the adaptive policy starts: DeepSpeed's max_in_cpu placement at the budget "
                         "(default), or everything on NVMe")
    ap.add_argument("--drift-at", type=int, help="moe: extra adaptive runs with set_routing(...) before this step")
    ap.add_argument("--quick", action="store_true", help="tiny models, for a smoke run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--keep-db", type=Path, help="a directory to copy the adaptive runs' profile databases (SQLite) to at the end")
    ap.add_argument("--block", type=int, default=8,
                    help="the policies of one budget run side by side, this many optimizer steps each in turn "
                         "(each engine drains its background work before the next one's block; the step after "
                         "is not measured); 0: one whole run after another")
    ap.add_argument("--log-plans", action="store_true", help="print the adaptive planner's log (every plan and why)")
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu",
                    help="zinf.device of every run (default cpu: the workloads are sized for CPU compute)")
    ap.add_argument("--aio-threads", type=int, default=AIO["thread_count"],
                    help="aio.thread_count of every policy (default 2, sized for the 2-core VM)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the whole run (seconds; Python's default 0.005)")
    ap.add_argument("--no-hints", action="store_true",
                    help="zinf.prefetch_hints off for every policy: the MoE's routed experts are not read "
                         "ahead on its word (zinf.will_use), only along the recorded trace")
    ap.add_argument("--aio-queue-depth", type=int, default=AIO["queue_depth"], help="aio.queue_depth of every policy")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r}; use {', '.join(POLICIES)}")
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 3)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.block < 0:
        raise SystemExit("--steps and --rounds must be >= 1, --warmup and --block >= 0")
    if args.drift_at is not None and args.drift_at < 1:
        raise SystemExit("--drift-at must be >= 1 (a step with steps before it)")
    # every core to torch's intra-op threads, unless OMP_NUM_THREADS says otherwise: with a GPU
    # computing, the GPU runs' 8 leave cores to zinf's request threads, optimizer worker and
    # planning process (16 of 16 here made every policy's CPU side contend with its own spinning
    # OpenMP team: the H200's adaptive MoE at 30% measured 0.21-0.22 s here, 0.146 s in step_phases.py)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)
    global DEVICE
    DEVICE = args.device
    if args.aio_threads < 1 or args.aio_queue_depth < 1:
        raise SystemExit("--aio-threads and --aio-queue-depth must be >= 1")
    AIO.update(thread_count=args.aio_threads, queue_depth=args.aio_queue_depth)
    if args.no_hints:
        ZINF_EXTRA["prefetch_hints"] = False
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.log_plans:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("    %(message)s"))
        planner_log = logging.getLogger("zinf.planner")
        planner_log.setLevel(logging.INFO)
        planner_log.addHandler(handler)
    names = ["moe", "gpt"] if args.workload == "both" else [args.workload]

    fs = filesystem_of(args.path if args.path.exists() else args.path.parent)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} cores), zinf.device {DEVICE}"
          + (f" ({torch.cuda.get_device_name()})" if DEVICE != "cpu" and torch.cuda.is_available() else "")
          + f", {fs.fstype} at {args.path}; "
          f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} measured steps) per (budget, policy), "
          + (f"the policies side by side in blocks of {args.block} steps; " if args.block else "one run after another; ")
          + f"adaptive plans {plan_lag_text(args.plan_lag)}; every policy's NVMe I/O: {AIO['thread_count']} threads, "
          f"queue depth {AIO['queue_depth']}, {AIO['block_size'] >> 10} KiB blocks; "
          f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms; torch threads {torch.get_num_threads()}; "
          f"routed experts read ahead on the model's word (zinf.prefetch_hints) {'off' if args.no_hints else 'on'}; "
          f"load average {load_average()} (other work on the machine skews every number)")
    swap = args.path / f"planner-policies-{os.getpid()}"
    results: dict[str, dict[float, dict[str, Cell]]] = {}
    drift_verdicts: list[str] = []
    try:
        swap.mkdir(parents=True)
        for name in names:
            w = make_workload(name, args.quick)
            print(f"\n{name}: {w.about}; {w.n_params / 1e6:.1f} M params, state {fmt_bytes(w.state_bytes)}")
            if name == "moe":
                print("  " + describe_routing(w))
            results[name] = sweep(w, budgets, policies, swap, args)
            print_table(w, results[name])
            if name == "moe" and args.drift_at is not None and "adaptive" in policies:
                drift_verdicts = drift_run(w, budgets, swap, args, results[name])
    finally:
        if args.keep_db is not None:
            # the adaptive runs' profiles (one database per folder, one run id per run, in run
            # order), for replaying their plans
            args.keep_db.mkdir(parents=True, exist_ok=True)
            for db in sorted(swap.glob("*/profile.db")):
                shutil.copy2(db, args.keep_db / f"{db.parent.name}.db")
                print(f"profile database of the {db.parent.name} runs kept at {args.keep_db / (db.parent.name + '.db')}")
        shutil.rmtree(swap, ignore_errors=True)

    print(f"\nload average at the end {load_average()} (1, 5, 15 min)")
    print("\nheadline (speed = best static step time / adaptive step time; > 1 = adaptive faster)")
    print(headline("skewed MoE", results.get("moe"), MOE_HEADLINE_BUDGET, MOE_TARGET_SPEEDUP, args.block))
    print(headline("dense GPT", results.get("gpt"), None, GPT_TARGET_SPEEDUP, args.block))
    for line in drift_verdicts:
        print(line)
    if args.json:
        out = {name: {str(b): {p: {"status": c.status, "step_s": c.step_s, "nvme_bytes_per_step": c.nvme_bytes,
                                    "max_in_cpu": c.max_in_cpu, "runs_step_s": [r.step_s for r in c.runs]}
                               for p, c in by_p.items()} for b, by_p in res.items()}
               for name, res in results.items()}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
