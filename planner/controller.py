"""The adaptive placement controller: re-plans from the profile while training runs.

``zinf.placement.policy: adaptive`` attaches an :class:`AdaptiveController` to the engine
(:func:`zinf.initialize` wires it; the engine only knows the ``after_step`` hook). After every
optimizer step the engine asks it for moves:

1. While a plan is being applied it re-issues what is left of it (the engine moves at most
   ``zinf.placement.migration_bytes_per_step`` a step and defers the rest).
2. Otherwise, every ``replan_every`` steps - or earlier, when the measured step drifts from the
   adopted plan's prediction by more than ``drift_fraction`` - it plans, in the planning process
   (:mod:`planner.background`: a copy of this controller's state and an :class:`EngineView` go
   there, the plan comes back and is taken up at a later step end, at most ``plan_lag_steps``
   later; :meth:`AdaptiveController._take_up`), or between steps with ``plan_lag_steps`` 0:

   * flushes the profiler so the database holds the newest steps, and reads the steps since the
     last placement change (at most ``window_steps``): :meth:`planner.workload.Workload.from_profile`
     (accesses per step smoothed by EWMA), :meth:`planner.costmodel.CostModel.from_db` (fitted from
     this run's I/O samples);
   * calibrates the simulator on the measured placement (:func:`planner.simulator.calibrate`),
     solves under the DRAM budget (:func:`planner.solver.solve`), and lets the policy
     (:class:`planner.policy.PlacementPolicy`) judge the candidate against the current placement
     over a horizon of ``horizon_plans`` re-plan periods;
   * records the plan (adopted or not, with the policy's reasons) through the recorder
     (``plans``, ``plan_assignments``), and returns the moves of an adopted plan.

   What it has measured steers the next plans: an adopted plan, once landed, is measured against
   the newest steps of the placement it replaced (and reverted if slower); the share of their
   predicted gains that its plans realised (:attr:`AdaptiveController.gain_realised`, from plans
   made from similar accesses) scales the next predicted gains and predictions; the steps' own
   spread (:attr:`AdaptiveController.step_noise`) is the smallest gain worth a move; homes a
   recent plan moved are not sent back while their accesses stay the same (the policy's
   ping-pong hold); and a scheduled re-plan whose inputs have not changed since the last plan
   solved (same placement, accesses and step) is recorded without solving again
   (:meth:`AdaptiveController._unchanged`), which keeps a dense model's re-plan steps cheap;
   and while a dense model's re-plans keep the placement, the period to the next one doubles,
   up to ``quiet_backoff_max`` x ``replan_every`` (:attr:`AdaptiveController.replan_period`).
   A kept plan is judged once more over all the steps of its placement when the next plan is due
   (:meth:`AdaptiveController._judge_again`). "The accesses changed" (for the realised gains, the
   model's error and retrying a reverted plan) must be beyond the counts' noise
   (:meth:`AdaptiveController._accesses_changed`); when they have, across all shards, since the
   long run's (a routing change, tested at every plan after the first, scheduled or drift), the plan is a
   reaction: made from the newest steps' accesses, it may send any home where it now belongs (no
   ping-pong hold, :meth:`AdaptiveController.accesses_shifted`). A placement is measured on its
   training steps: what the controller itself and the migrations took in a step is not counted.
   While a dense model's accesses are the same
   every step and the placement is settled, the profiler records shard detail in one step of
   ``sparse_detail_every`` only (:meth:`AdaptiveController._sample_detail`): recording every
   step's detail cost ~4% of a dense GPT step on 2 cores.

Nothing here may stop training: a plan that cannot be made (no NVMe samples yet, a budget the pins
already fill) is skipped with one log line and retried at the next period.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import statistics
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from zinf.errors import ZinfError
from zinf.placement import DramNeed, Move, ShardPlacement
from zinf.sizing import DramSizing, Overlap

from planner.background import PlanningProcessError, shared_process, warm_up

from planner.costmodel import CostModel, CostModelError
from planner.hotness import ewma_difference_steps, ewma_effective_steps
from planner.policy import Decision, PlacementPolicy, PolicySettings, diff_moves
from planner.simulator import Simulator, calibrate
from planner.solver import Plan, PlanError, homes_of, solve
from planner.workload import Workload, measure_io_cpu, measure_update

log = logging.getLogger("zinf.planner")

__all__ = ["ControllerSettings", "AdaptiveController"]

Home = tuple[str, str]


@dataclass(frozen=True)
class ControllerSettings:
    """How often and from what the controller plans."""

    replan_every: int = 20
    """Optimizer steps between plans (``zinf.placement.replan_every``)."""

    first_plan_after: int = 3
    """Steps measured before the first plan: the first records the trace, the next calibrate."""

    window_steps: int = 20
    """Newest steps (since the last placement change) that a plan is made from."""

    rate_window_periods: int = 8
    """Re-plan periods of steps (across placement changes) the access rates are smoothed over."""

    rate_halflife_periods: float = 2.0
    """Halflife of the long EWMA of the access rates, in re-plan periods (the short one is a
    quarter period, planned from when the accesses have shifted: :meth:`AdaptiveController.accesses_shifted`)."""

    drift_fraction: float = 0.25
    """Re-plan early when the measured median step differs from the prediction by this fraction."""

    drift_steps: int = 3
    """Steps whose median is compared with the prediction (after a plan has fully landed)."""

    verify_steps: int = 5
    """Steps of a landed plan whose median is compared with the placement it replaced, for the
    revert test (at most ``replan_every``, at least ``drift_steps``; more than ``drift_steps``:
    with a few tokens a step, steps vary by tens of per cent, and a revert on noise costs two
    migrations and blocks the plan)."""

    horizon_plans: int = 4
    """Re-plan periods over which a plan's gain must pay back its migrations."""

    revert_fraction: float | None = 0.05
    """A plan whose landed placement measures slower than the one it replaced by more than this
    fraction (median of ``verify_steps`` steps against the plan's own window), and by more than
    the noise of those two medians (:meth:`AdaptiveController.noise_of`), is reverted (None:
    never; ``zinf.placement.revert_fraction``)."""

    retry_rate_change: float = 0.25
    """After a revert, plans are not adopted again until the accesses per step have changed by
    this fraction (L1, against those the reverted plan was made from) - and by more than their
    noise (``change_z``); the same test says which landed plans' realised gains still apply."""

    realised_noise_z: float = 0.0
    """A landed plan that promised a clear gain is reverted when the gain it measured is at most
    this many :attr:`AdaptiveController.step_noise` (and ``realised_min_share`` of its promise),
    over its first ``verify_steps`` and again over all its steps. 0: when it measured no gain at
    all. At 2, a revert sent a plan made for a new routing back to the old routing's placement,
    measured 5-11% slower than it (a gain within two noises of five noisy steps), where keeping
    two placements that measure alike costs nothing."""

    refine_noise_z: float = 2.0
    """Once a plan made from accesses like the current ones has landed and been measured (its
    realised gain is known), the next plans refine it rather than react to a change: they must
    promise this many :attr:`AdaptiveController.step_noise`, not one. A plan that promises one noise is as likely to be
    reverted as kept, and every revert moves its homes twice (MoE at 50%: ping-pong). Plans for
    changed accesses (after a routing change) and plans the drift of the steps triggered keep the
    one-noise bar."""

    realised_min_share: float = 0.5
    """... and at most this share of the model's promise (with ``realised_noise_z`` > 0: a plan
    that delivered half of a large promise is kept even on noisy steps)."""

    change_z: float | None = 3.0
    """The accesses per step have changed only when the difference is also beyond their sampling
    noise: the shards' squared differences over their variances (a chi-square over the shards that
    vary) exceed its mean by ``change_z`` standard deviations. A shard's smoothed accesses per
    step are modelled as counts: variance ``rate_dispersion`` x accesses per step x (1 - accesses
    / the shard's most in one step) / the EWMA's effective steps (:func:`_rate_variance`,
    :meth:`AdaptiveController._accesses_changed`). At 16 tokens a step the MoE's long EWMAs
    moved by > 25% (L1) within ~10 steps on noise alone, which dropped the realised-gain evidence
    in steady state. None: the L1 test alone."""

    shift_z: float = 6.0
    """How far beyond their noise the newest steps' accesses (the short EWMA) must have moved from
    the long run's for a plan to be a reaction to a routing change (:meth:`AdaptiveController.
    accesses_shifted`; the same chi-square as ``change_z``, tested at every plan). A reaction plans
    from a few steps' accesses and lifts the ping-pong hold, so a false one moves homes there and
    back. On the benchmark MoE at 30% (steady routing, 16 tokens a step) the statistic reached 3.9
    at one step of 60 on the VM, and on an H100 two of three rounds reacted to such a step (plans
    adopted and reverted in steady state: churn 39% of the budget); a routing change reached 6.7
    two steps after it and 12-13 three and four steps after."""

    rate_dispersion: float = 3.0
    """Variance over mean of a shard's accesses per step: each call of a module is a forward, a
    backward and an optimizer access of its shard together (counts in groups of ~3, so their
    variance is ~3x a Poisson count's)."""

    error_plans: int = 4
    """Adopted plans whose measured outcome sets the model's error (:attr:`AdaptiveController.model_error`):
    no plan predicted to gain less than that fraction of the step is adopted (0: ignore the error);
    and the share of their predicted gains that they realised (:attr:`AdaptiveController.gain_realised`),
    by which the next plans' predicted gains are scaled."""

    unchanged_rate_change: float = 0.05
    """A scheduled re-plan whose accesses per step differ from those of the last plan solved by
    less than this (L1, relative) - or by more, but not beyond their noise (``retry_rate_change``,
    ``change_z``) - with the same placement in force (that plan was not adopted)
    and a measured step within ``min_gain_fraction`` of its, is not solved again: the solver
    would find the same plan and the policy refuse it again (a dense model's accesses never
    change). It still reads the profile; what it saves is the cost model fit, the calibration and
    the solves, ~2/3 of a re-plan's seconds on the training thread. 0: always solve."""

    resolve_every_plans: int = 4
    """Solve at least every this many scheduled re-plans even when nothing changed (the disk's
    cost model is refitted from new samples then)."""

    quiet_backoff_max: int = 8
    """While every shard's accesses are the same every step (a dense model: the short and the long
    EWMA agree within ``constant_rate_change``) and scheduled re-plans keep the placement, the
    period to the next scheduled re-plan doubles after each such plan, up to this many times
    ``replan_every``; an adopted or reverted plan, a drift of the step time or accesses that vary
    start again at ``replan_every``. A re-plan reads the profile even when it solves nothing
    (~0.5 s of a step on the 2-core VM): on the dense GPT every 8 steps that was 2-9% of its
    median step against ``max_in_cpu``'s identical placement. A routed model's accesses are never
    the same every step, so its re-plans - and its response to a routing change - keep the period.
    1: never back off."""

    sparse_detail_every: int = 8
    """While every shard's accesses per step are the same in every step (a dense model: the short
    and the long EWMA agree within ``constant_rate_change``) and the placement in force is settled
    (no plan being applied or measured), the profiler records the shard detail of one step in this
    many (at most ``replan_every``; ``profiler.Recorder.set_shard_detail_every``): the planner
    reads nothing from the other steps that the sampled ones do not say, and recording every
    step's ~10^3 shard events cost 2-5% of a dense GPT step on 2 cores. Back to every step as
    soon as a plan is adopted or reverted or the accesses vary. 1: always every step."""

    constant_rate_change: float = 0.01
    """The accesses per step count as "the same every step" when the short and the long EWMA
    differ by less than this (relative L1) - a few tokens a step of a routed model differ by tens
    of per cent."""

    plan_lag_steps: int | None = None
    """Plans are made in a child process while training goes on (:mod:`planner.background`): a
    plan due after step k is taken up at the first step boundary that finds it made, and at the
    latest after step k + this, at most ``replan_every`` - 1 (training waits for it there, and
    makes the plan itself if the planning process gets no CPU: other work keeps them busy). The
    steps that run meanwhile train as any other but are not measured for the planner (the child
    shares the CPUs), as the seconds a plan took between steps were not. 0:
    plan on the training thread, the step waiting for it, and the moves start right after the
    step the plan was due (what a controller subclass the child cannot import needs). After
    ``PROCESS_FAILURES_INLINE`` plans in a row the planning process did not make (it died, or
    got no CPU), plans are made on the training thread for the rest of the run. None (default): 4 where this
    process may run on at least ``BACKGROUND_MIN_CPUS`` CPUs, else 0 - the planning process needs
    a CPU the training does not: on the 2-core VM, where it has none, planning there measured no
    faster than between steps (see :mod:`planner.background`)."""

    trial_band: float = 0.10
    """A plan whose engine mode (which overlap buffers the engine grants it: prefetch window,
    write-behind, optimizer read-ahead, updates during backward) has never run in this run, whose
    predicted step is within this fraction of the measured step of the best plan's, and which the
    model predicts less than this fraction slower than the placement in force (the model cannot
    tell them apart by more), is tried (not at the first plan, which is
    judged against the run's first, slower steps): adopted although its gain may not pass the
    gate, measured, and reverted unless it measured faster than the placement it replaced
    (judged again over all its steps, only when slower beyond the noise). The simulator's
    calibration (its residual ``overhead_s``) is measured on the mode in force and borrowed by a
    mode that never ran; what it misses differs by mode - on the H100 the dense GPT's all-NVMe
    placement with updates during backward measured 0.462 s where the residual of the no-update
    mode predicted 0.486, and the planner kept a placement 9% slower (0.503 s) on a predicted
    0.3% difference; on another H100 the same placement was predicted 4.7% slower than the
    plan in force and measured 3-8% faster (a band of 0.05 and a required predicted gain kept it
    untried: the GPT at 0.92-0.97x all-NVMe's speed). Once a mode ran, the difference of its residual from
    the others' is known (:attr:`AdaptiveController.mode_offset_s`). Trials are made only in the
    first ``trial_periods`` re-plan periods after the first plan; later, a plan in a mode that
    never ran must clear ``min_gain_fraction`` plus this band (its error is unknown by that much).
    0: never try, and no such margin."""

    trial_periods: int = 3
    """Trials of untried engine modes (see ``trial_band``) are made, measured and if need be
    reverted in this many re-plan periods after the first plan (a trial starts only while a whole
    period is left of them, two where ``trial_confirm_z`` may measure the placement before it
    again), and no later: exploring is over before the steady state, where a trial
    that measured slower would be reverted - a migration there and back (the dense GPT at 30% on
    the 2-core VM: a mode adopted at step 24 on a predicted 6.6% gain measured 9.5% slower, and
    its revert moved 47% of the homes back). Re-plans in these periods are always solved and do
    not lengthen the period (``quiet_backoff_max``), so the trials get their plans. A plan that was
    no trial, reverted within them, starts them again at its revert (it took them to be measured;
    a reverted plan does not bar a trial either: the trial's mode never ran). 0: no trials."""

    trial_verify_steps: int = 10
    """Steps a trial is measured over at most. A trial whose first ``verify_steps`` measure within
    :attr:`AdaptiveController.step_noise` of the placement before it (either way) is measured on,
    up to this many steps, before it is kept (if faster) or reverted: five steps of a few tokens
    each vary by 20-30%, and on the 2-core VM's MoE at 30% a trial of updates during backward,
    measured 3% slower over five, was reverted, where the run that kept it ran its last 32 steps
    1.24x faster. A trial judged clearly faster or slower, or whose steps drift from its first
    ones by ``drift_fraction`` (the accesses changed), is judged at once on its first steps.
    ``verify_steps`` or less: trials are judged like plans, on ``verify_steps`` steps."""

    trial_confirm_z: float | None = 3.0
    """A trial measured faster than the placement before it (A) by less than this many
    :attr:`AdaptiveController.step_noise` is confirmed before it is kept: A is measured again
    after it (A/B/A), and the trial is kept only if it also measured faster than that. A was
    measured in the steps just before the trial, and a slow phase of a shared machine there
    made a slower placement look faster: the dense GPT at 30% on the 2-core VM, A measured
    0.659 s, the trial 0.630 s, and A ran 0.585 s for the rest of the run (the trial kept: 0.93x
    ``max_in_cpu``). The confirmation costs two migrations of the trial's moves (counted as
    ping-pong). None: trials are judged on A's steps before them alone."""

    policy: PolicySettings = field(default_factory=PolicySettings)


Mode = tuple[bool, bool, bool, bool]
"""An engine's overlap mode: (prefetch window, write-behind, optimizer read-ahead, updates during
backward), each granted or not (:func:`mode_of`)."""


def mode_of(wl: Workload) -> Mode:
    """The overlap mode of a workload whose buffers are the engine's (``Workload.with_buffers``)."""
    return (bool(wl.prefetch_bytes and wl.prefetch_bytes > 0), wl.effective_write_window_bytes() > 0,
            bool(wl.pipeline_read), bool(wl.updates_during_backward))


def describe_mode(mode: Mode) -> str:
    """``mode`` in words: the overlap buffers it has."""
    names = [n for n, on in zip(("prefetch", "write-behind", "read-ahead", "updates in backward"), mode) if on]
    return "+".join(names) or "no overlap"


BACKGROUND_MIN_CPUS = 4
"""CPUs this process may run on from which plans are made in the planning process by default."""

DEFAULT_PLAN_LAG_STEPS = 4
"""``plan_lag_steps`` where plans are made in the planning process by default."""


def default_plan_lag_steps() -> int:
    """``plan_lag_steps`` when the config leaves it out: :data:`DEFAULT_PLAN_LAG_STEPS` with at
    least :data:`BACKGROUND_MIN_CPUS` usable CPUs, else 0 (plan between steps)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return DEFAULT_PLAN_LAG_STEPS if cpus >= BACKGROUND_MIN_CPUS else 0


PROCESS_FAILURES_INLINE = 2
"""Plans in a row the planning process did not make (it died, or got no CPU; not a plan that
raised there) after which the controller plans on the training thread instead."""

PLAN_TIMEOUT_S = 600.0
"""Seconds the training thread waits, at the lag limit, for a planning process that runs but
does not answer before it kills it and goes on without that plan (the next plan starts another
process)."""

STARVED_CHECK_S = 0.5
"""While the training thread waits for a plan at the lag limit, how often (seconds) it checks
that the planning process gets CPU."""

STARVED_CPU_FRACTION = 0.1
"""Below this share of one CPU over a check, the planning process counts as starved (other work
keeps the CPUs busy and ``SCHED_IDLE`` leaves it nothing): the training thread makes the plan
itself rather than wait for minutes. 0: never starved."""

PLAN_RESIMULATE_HOMES = 128
"""Above this many movable homes the controller's greedy takes the solver's fast path."""

PLAN_MILP_GAP = 1e-4
"""Relative optimality gap of the controller's MILP solves (the linear model is itself approximate)."""

MOVE_COST_MIGRATIONS = 8
"""How many of the engine's latest migrations the cost of a move is fitted to."""

MOVE_COST_PRIOR_MIB = 64
"""Size (MiB) of the cost model's read-plus-write that anchors the per-byte part of that fit."""


@dataclass
class _Check:
    """An adopted plan, to be measured once it has landed (and reverted if it made things worse)."""

    step: int  # the step it was made after
    before_s: float  # measured median step of the placement it replaced (its newest steps)
    before: dict  # that placement, {home: tier}
    predicted_s: float  # its own predicted step (the model's gain scaled by gain_realised)
    rates: "pd.Series"  # accesses per step per shard it was made from
    model_gain_s: float = 0.0  # the gain per step the model predicted, unscaled
    reaction: bool = False  # made in reaction to a shift of the accesses, from the short EWMA's few steps
    trial: bool = False  # a trial of an untried engine mode: kept only if measured faster (judged again: not slower beyond the noise)
    mode: Mode | None = None  # its engine mode
    model_step_s: float | None = None  # its step as the model predicted it (unscaled), with...
    overhead_s: float = 0.0  # ... this calibration residual
    before_mode: Mode | None = None  # the engine mode of the placement it replaced, and ...
    before_residual_s: float = 0.0  # ... that mode's calibration residual at the plan


@dataclass
class _Confirm:
    """A trial measured faster than the placement before it, gone back to that placement to
    measure it again (:attr:`ControllerSettings.trial_confirm_z`)."""

    check: _Check  # the trial (its ``before`` is the placement measured again now)
    entry: dict  # its entry in ``trials``
    trial_s: float  # the trial's measured median step
    trial_placement: dict  # the trial's placement, {home: tier}: taken again if it is confirmed
    steps: int  # steps the trial was judged on: the placement before it is measured on as many


@dataclass(frozen=True)
class _Solved:
    """The last plan solved, what a scheduled re-plan compares with before solving again (:meth:`AdaptiveController._unchanged`)."""

    rates: "pd.Series"  # accesses per step per shard (long EWMA) it was made from
    measured_s: float  # the measured step it was made from
    placement: dict  # the placement in force then, {home: tier}
    adopted: bool  # whether it was adopted (then the placement has changed since)
    step: int | None = None  # the step it was made after (None: the step under way)


def _model_numbers(wl: Workload) -> dict[str, float | str]:
    """The workload's fitted numbers a plan rests on, for its recorded reason (to tell, from the
    profile alone, why a prediction was off)."""
    out: dict[str, float | str] = {k: float(getattr(wl, k)) for k in (
        "compute_fwd_s", "compute_bwd_s", "update_s_per_elem", "update_overhead_s", "fetch_overhead_s", "overhead_s")}
    out["copy_Bps"] = float(wl.copy_Bps) if math.isfinite(wl.copy_Bps) else "inf"
    out["io_cpu_s_per_byte"] = float(wl.io_cpu_s_per_byte)
    for k in ("update", "fetch_overhead", "copy", "io_cpu"):
        if k in wl.source:
            out[f"{k}_from"] = str(wl.source[k])
    return out


def _placement_of(homes: dict) -> dict[str, dict[str, str]]:
    """{(shard, state): tier} as the engine's {shard: {"param": tier, "optim": tier}} (the inverse
    of :func:`planner.solver.homes_of`)."""
    placement: dict[str, dict[str, str]] = {}
    for (shard, state), tier in homes.items():
        placement.setdefault(shard, {})[state] = tier
    return placement


def _assignments(placement: dict, target: dict, density: dict | None = None) -> list[dict]:
    """The ``plan_assignments`` rows of a plan: every shard of the engine's ``placement`` with the
    tiers ``target`` ({home: tier}) gives it (its current ones where ``target`` is silent) and its
    score (stall seconds saved per byte of its homes, 0 without ``density``)."""
    density = density or {}
    return [{"shard": name, "param_tier": target.get((name, "param"), tiers["param"]),
             "optim_tier": target.get((name, "optim"), tiers["optim"]),
             "score": density.get((name, "param"), 0.0) + density.get((name, "optim"), 0.0)}
            for name, tiers in placement.items()]


def _rates(workload: Workload, which: str = "long") -> "pd.Series":
    """Accesses per step of every shard (forward + backward + optimizer) under the ``which`` EWMA
    ("long" or "short"; the planned columns where the workload has no such column), by shard
    name. Plans compare the long ones: a drift plan is made from the short EWMA, whose difference
    from the long one is mostly its own noise at a few tokens a step."""
    df = workload.shards
    col = f"accesses_{which}"
    if col in df:
        return df[col].astype(float).set_axis(df["shard"])
    return (df["fwd_accesses_per_step"] + df["bwd_accesses_per_step"] + df["opt_accesses_per_step"]).set_axis(df["shard"])


def _rate_variance(rates: "pd.Series", effective_steps: float, dispersion: float,
                   caps: "pd.Series | None" = None) -> "pd.Series":
    """Variance of each shard's smoothed accesses per step ``rates``, an average over
    ``effective_steps`` steps of counts in groups of ``dispersion`` (a forward, a backward and an
    optimizer access of a call together): ``dispersion x r / n``; with the shard's ``caps`` (the
    most accesses it had in one step, ``accesses_max``), binomial: ``dispersion x r x (1 - r / cap)
    / n`` - an expert hit in every step is at its cap and does not vary at all (counted as a
    Poisson count, a 3 -> 0.5 change of a hot expert after a routing change was within its noise,
    and the ping-pong hold kept the old hot set in DRAM for 30 steps)."""
    r = rates.astype(float).clip(lower=0.0)
    spread = pd.Series(1.0, index=r.index)
    if caps is not None:
        cap = caps.astype(float).reindex(r.index)
        capped = cap.notna() & (cap > 0)
        spread[capped] = (1.0 - r[capped] / cap[capped]).clip(lower=0.0, upper=1.0)
    return dispersion * r * spread / max(float(effective_steps), 1.0)


def _change_z(now: "pd.Series", then: "pd.Series", effective_steps: float, dispersion: float,
              then_effective_steps: float | None = None, caps: "pd.Series | None" = None) -> float:
    """How far the difference of two accesses-per-step vectors is beyond their noise, in standard
    deviations of a chi-square: each shard's accesses per step are an average over
    ``effective_steps`` steps (``then_effective_steps`` for ``then``: rates of an early plan
    averaged fewer steps; default the same) of counts with the variance of :func:`_rate_variance`
    (``caps``: the shards' most accesses in one step, for both), so the difference has the sum of
    both variances; sum of squared differences over variances, less the number of shards that vary
    (S), over sqrt(2 S). Shards with the same value in both (a dense model's, never accessed) take
    no part. 0 when none varies."""
    now, then = now.align(then, fill_value=0.0)
    vary = (now.to_numpy(float) != then.to_numpy(float))
    if not vary.any():
        return 0.0
    n_now = max(effective_steps, 1.0)
    n_then = max(then_effective_steps if then_effective_steps is not None else effective_steps, 1.0)
    var = (_rate_variance(now, n_now, dispersion, caps) + _rate_variance(then, n_then, dispersion, caps)).to_numpy(float)[vary]
    var = np.maximum(var, dispersion * 0.5 / min(n_now, n_then))  # a shard at ~0 (or its cap): half an access's noise
    diff = (now - then).to_numpy(float)[vary]
    stat = float((diff ** 2 / var).sum())
    n = int(vary.sum())
    return (stat - n) / math.sqrt(2.0 * n)


def _rate_change(now: "pd.Series", then: "pd.Series", varying_only: bool = False) -> float:
    """Relative L1 change of the accesses per step: sum |now - then| / sum then; ``varying_only``:
    over the shards whose values differ (0 when none does)."""
    now, then = now.align(then, fill_value=0.0)
    if varying_only:
        vary = now != then
        now, then = now[vary], then[vary]
    total = float(then.abs().sum())
    return float((now - then).abs().sum()) / total if total > 0 else float(now.abs().sum() > 0)


@dataclass(frozen=True)
class EngineView:
    """What a plan reads of the engine, taken between two steps: picklable, so that the planning
    process can ask it what the engine would need and grant with other placements
    (:class:`zinf.sizing.DramSizing`) while the engine trains on."""

    placement: dict[str, dict[str, str]]
    overlap: Overlap
    dram_need: DramNeed
    sizing: DramSizing
    dram_budget_bytes: int | None
    prefetch_wanted_bytes: int
    announced_reads: bool = False

    @classmethod
    def of(cls, engine) -> "EngineView":
        return cls(placement=engine.placement, overlap=engine.overlap, dram_need=engine.dram_need,
                   sizing=engine.sizing, dram_budget_bytes=engine.config.zinf.dram_budget,
                   prefetch_wanted_bytes=engine.prefetch_wanted_bytes,
                   announced_reads=bool(getattr(engine, "announced_reads", False)))

    def _places(self, placement) -> list:
        current = [ShardPlacement(self.placement[sh.name]["param"], self.placement[sh.name]["optim"])
                   for sh in self.sizing.shards]
        return self.sizing.places_of(placement, current)

    def dram_need_of(self, placement) -> DramNeed:
        """As :meth:`zinf.engine.Engine.dram_need_of`."""
        return self.sizing.need(self._places(placement))

    def overlap_of(self, placement) -> Overlap:
        """As :meth:`zinf.engine.Engine.overlap_of`."""
        return self.sizing.overlap(self._places(placement), self.dram_budget_bytes, self.prefetch_wanted_bytes)


@dataclass
class _Job:
    """A plan being made in the planning process: due after step ``step``."""

    step: int
    drifted: bool
    before_s: float | None
    started_s: float  # time.perf_counter() when it was handed over
    future: Future | None = None
    abandoned: bool = False  # the training thread gave up on it: not to be sent any more


class _RecorderCalls:
    """The planning process's stand-in for the recorder: it keeps the calls a plan makes, which
    the training process replays on the real recorder when it takes the plan up."""

    def __init__(self, run_id: int | None) -> None:
        self.run_id = run_id
        self.calls: list[tuple[str, tuple, dict]] = []

    def flush(self) -> None:
        pass  # the training process flushed before handing the plan over

    def record_plan(self, *args, **kwargs) -> None:
        self.calls.append(("record_plan", args, kwargs))

    def set_shard_detail_every(self, k: int) -> int:
        self.calls.append(("set_shard_detail_every", (k,), {}))
        return int(k)


class _LogLines(logging.Handler):
    """Keeps the planner's log lines of a plan made in the planning process, for the training
    process to log when it takes the plan up."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


PLAN_DUMP_ENV = "ZINF_PLAN_DUMP"
"""Environment variable: a folder where each plan's inputs are pickled (:func:`dump_plan_inputs`)."""


def dump_plan_inputs(folder: str | os.PathLike, controller: "AdaptiveController", engine, step: int, drifted: bool,
                     before_s: float | None) -> Path:
    """Pickle what the plan due after ``step`` is made from - the controller's state, the engine
    as the plan sees it (:class:`EngineView`) and the call's arguments - to
    ``folder/{database's folder}-{its name}_run{run}_step{step}.pkl``, so that ``benchmarks/plan_replay.py`` can make the same plan
    again, offline, against the run's profile database (which the plan reads up to ``step``
    only): a plan that went wrong on a lent GPU machine can be studied, and a fix tried, on
    any machine. Called by the plan once it has flushed the profiler. Written whole to a
    temporary name, then renamed."""
    from profiler import queries

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    view = engine if isinstance(engine, EngineView) else EngineView.of(engine)
    # the newest step the database held: a plan made between steps on the training thread reads
    # the profile before its own step's row is written (the replay cuts the database there)
    run_id = getattr(controller.recorder, "run_id", None)
    last = queries.run_progress(controller.url, run_id)["last_step"] if run_id is not None else None
    blob = pickle.dumps({"class": type(controller), "state": controller.__getstate__(), "view": view, "step": int(step),
                         "drifted": bool(drifted), "before_s": before_s, "run_id": run_id, "db_last_step": last})
    # runs side by side (a benchmark's policies) share the folder: named by database and run
    db = str(controller.url).split(":///", 1)[1] if ":///" in str(controller.url) else ""
    where = f"{Path(db).parent.name}-{Path(db).stem}" if db else "memory"
    path = out / f"{where}_run{run_id}_step{int(step)}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return path


def _plan_in_child(cls: type, state: dict, view: EngineView, step: int, drifted: bool,
                   before_s: float | None, run_id: int | None):
    """Run in the planning process: a ``cls`` controller with the training process's ``state``
    makes the plan due after ``step``. Returns the moves, its state afterwards (which replaces
    the training process's), the recorder calls and the log lines the plan made."""
    controller = cls.__new__(cls)
    controller.__dict__.update(state)
    calls = _RecorderCalls(run_id)
    controller.recorder = calls
    lines = _LogLines()
    level, propagate = log.level, log.propagate
    log.addHandler(lines)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # the training process logs them, where logging is configured
    try:
        moves = controller._plan_or_skip(view, step, drifted, before_s)
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
        log.propagate = propagate
    return moves, controller.__getstate__(), calls.calls, lines.lines


_helper: ThreadPoolExecutor | None = None


def _helper_thread() -> ThreadPoolExecutor:
    """The thread that hands plans to the planning process and waits for them (it holds the GIL
    only to pickle)."""
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-planner")
    return _helper


class _BudgetFull(PlanError):
    """Every split of the budget is taken by the placement in force: nothing to re-plan."""


class AdaptiveController:
    """Plans placements from the profile database at ``url`` and hands the engine the moves.

    ``recorder``: the run's :class:`profiler.Recorder` (flushed before reading; plans are
    recorded through it). ``dram_budget_bytes``: ``zinf.dram_budget``.
    """

    def __init__(self, url: str, recorder, dram_budget_bytes: int, settings: ControllerSettings | None = None) -> None:
        self.url = url
        self.recorder = recorder
        self.dram_budget_bytes = int(dram_budget_bytes)
        self.settings = settings or ControllerSettings()
        self.policy = PlacementPolicy(self.settings.policy)
        self.plans_made = 0
        self.plans_adopted = 0
        self.last_decision: Decision | None = None
        self.last_plan: Plan | None = None
        self.last_skip: str | None = None
        self._target: dict[Home, str] | None = None  # the adopted placement still being applied
        self._predicted_step_s: float | None = None  # of the placement in force
        # the first step run with the current placement complete (the run's first step at the start)
        self._settled_step = 1
        self._last_plan_step = 0
        self._recent_s: deque[float] = deque(maxlen=max(1, self.settings.drift_steps, self.settings.verify_steps,
                                                        self.settings.trial_verify_steps))
        # the measured steps of the newest placements, one list per placement (newest last): their
        # spread, each about its own placement's median, is what a revert test can tell apart
        self._placement_s: deque[list[float]] = deque([[]], maxlen=8)
        self._verify: _Check | None = None  # the adopted plan whose landed placement is measured next
        # a plan kept after its verify_steps, judged once more over all the steps of its placement
        # (up to window_steps) when the next plan is due: (check, its entry in verified)
        self._rejudge: tuple[_Check, dict] | None = None
        self._confirm: _Confirm | None = None  # a trial whose placement before it is measured again
        self._failed: _Check | None = None  # the last plan reverted, until the accesses change
        self.plans_reverted = 0
        # every adopted plan once measured after it landed: the step it was made after, its
        # predicted step, the measured median, and the placement's before it (seconds), and the
        # gain per step the model predicted for it (unscaled)
        self.verified: list[dict] = []
        # Each engine mode's calibration residual (``Workload.overhead_s``) less the first mode's,
        # for the modes that ran (seconds): from two residuals measured a few steps apart - the
        # mode in force at a plan, and what the mode of the plan it adopted measured once landed.
        # Differences, not the residuals themselves: a shared machine's slow phase (tens of steps
        # ~20% slower) moves every residual, and a mode's residual from before it would compare
        # the current placement with a faster machine.
        self.mode_offset_s: dict[Mode, float] = {}
        self._mode_now: tuple[Mode, float] | None = None  # the mode in force at the newest plan, its residual
        # plans made before this step may be trials (the first plan's step + trial_periods periods)
        self._explore_until: int | None = None
        self._level_s: float | None = None  # the newest steps' median at the last plan (seconds)
        # trials of untried engine modes once measured (as verified, with "kept"): not in verified,
        # whose entries set the model's error and realised gain - a trial promised nothing
        self.trials: list[dict] = []
        self._warned: set[str] = set()
        # This engine's recent migrations as (moves done, bytes copied, seconds), all overheads
        # in: what moves really cost is fitted from them (:meth:`_move_cost`), newest last.
        self.migrations_measured: list[tuple[int, int, float]] = []
        self._seen_report = None
        self.plans_skipped = 0  # scheduled re-plans not solved: nothing had changed
        self._last_solved: _Solved | None = None
        self._skipped_in_row = 0
        self._quiet_plans = 0  # scheduled re-plans in a row that kept the placement of a dense model (replan_period)
        self.detail_every = 1  # the recorder's shard-detail sampling period this controller set
        self._caps: "pd.Series | None" = None  # each shard's most accesses in one step (newest profile read)
        self._step_now = 0  # the engine's step at the last after_step
        self._own_s = 0.0  # seconds the last after_step took (inside that step's wall time)
        # the first step whose accesses the rates are read from: a shift of the accesses (a
        # routing change) restarts them, so the long EWMA does not average the old routing in
        self._rates_from_step = 0
        # (seconds, step) of the newest fetch overhead a profile read measured (see _fetch_overhead_known)
        self._fetch_overhead: tuple[float, int] | None = None
        # (s per element, s per update) of the optimizer update, timed once on the training
        # process (_time_update_once) for the plans made while no shard has both homes in DRAM
        self._update_timing: tuple[float, float] | None = None
        # (s per byte, how) of the compute the store's threads take from training (a CPU device;
        # _time_io_cpu_once), for every plan's workload
        self._io_cpu: tuple[float, str] | None = None
        self._job: _Job | None = None  # the plan being made in the planning process
        self._planner_started = False  # the planning process was asked to import the planner
        self._process_failures = 0  # plans in a row the planning process did not make (died, starved)
        self._planned_through = 0  # the last step that ran while the planning process made a plan
        # plans made in the planning process: (step it was due after, step it was taken up after,
        # seconds from handing it over to taking it up)
        self.plan_lags: list[tuple[int, int, float]] = []

    # ------------------------------------------------------------------ what it is doing
    @property
    def predicted_step_s(self) -> float | None:
        """The predicted step time of the placement in force: an adopted plan's (the model's)
        until its first ``verify_steps`` steps are measured, then their median (the calibrated
        prediction); the calibrated simulator's of the current placement when the last plan was
        not adopted; the measured step before a reverted plan after a revert. None before the
        first plan."""
        return self._predicted_step_s

    @property
    def model_error(self) -> float | None:
        """How far off the model has been: the median |predicted - measured| / measured step of the
        last ``error_plans`` adopted plans once landed (None before the first was measured). A
        plan predicted to gain less than this fraction of the step is not adopted: its gain is
        within what the model gets wrong (with a few tokens a step, the next plan would undo it)."""
        return self._error_of(self.verified)

    def model_error_for(self, rates: "pd.Series | None") -> float | None:
        """:attr:`model_error` over the plans made from accesses like ``rates`` only (not
        :meth:`_accesses_changed` since), as :meth:`gain_realised_for`: after a routing change
        the errors of plans under the old routing do not gate the first plans for the new one
        (the MoE at 20-30%: a 30-38% gate from plans before the change blocked every plan after it)."""
        return self._error_of(self._verified_like(rates))

    def _error_of(self, verified: list[dict]) -> float | None:
        if self.settings.error_plans <= 0:
            return None
        recent = verified[-self.settings.error_plans:]
        if not recent:
            return None
        return statistics.median(abs(v["predicted_s"] - v["measured_s"]) / v["measured_s"] for v in recent)

    def _accesses_changed(self, now: "pd.Series", then: "pd.Series", then_step: int | None = None) -> bool:
        """Whether the accesses per step (long EWMA) ``now`` differ from ``then`` (those of a
        plan made after step ``then_step``; default now) by more than ``retry_rate_change`` (L1)
        and, with ``change_z``, by more than their noise (:meth:`_beyond_noise`; each EWMA's
        effective steps bounded by the steps run when it was taken: an early plan's rates average
        few)."""
        s = self.settings
        if s.change_z is None:
            return _rate_change(now, then) >= s.retry_rate_change
        return self._beyond_noise(now, then, self._rate_steps(self._step_now),
                                  self._rate_steps(then_step if then_step is not None else self._step_now))

    def accesses_shifted(self, short: "pd.Series", long: "pd.Series") -> bool:
        """Whether the newest steps' accesses per step (``short``: the short EWMA) have moved away
        from the long run's (``long``) by more than ``retry_rate_change`` (L1 over the shards
        whose accesses vary: a dense shard's, the same in both, would dilute a routing change)
        and by more than ``shift_z`` standard deviations of the noise of their difference
        (:meth:`_beyond_noise`): a routing change, seen across all shards together a few steps
        after it, when no single home's accesses can yet tell it from noise. Tested at every plan
        but the first. Needs ``change_z`` (the noise model)."""
        s = self.settings
        if s.change_z is None:
            return False
        if _rate_change(short, long, varying_only=True) < s.retry_rate_change:
            return False
        return self.shift_statistic(short, long) > s.shift_z

    def shift_statistic(self, short: "pd.Series", long: "pd.Series") -> float:
        """The z that :meth:`accesses_shifted` holds against ``shift_z``: the chi-square of the
        short EWMA's accesses per step against the long one's (:func:`_change_z`), over the noise
        of their difference at the current step."""
        # Both EWMAs read the same steps: their difference varies as the weights' difference says
        # (_change_z adds two variances, each over twice its effective steps): 0.6-0.8 of the
        # two EWMAs' own variances added, which count the newest steps' noise twice.
        n = 2.0 * ewma_difference_steps(self._short_halflife, self._long_halflife_at(self._step_now),
                                        self._rate_series_steps(self._step_now))
        return _change_z(short, long, n, self.settings.rate_dispersion, n, caps=self._caps)

    def _beyond_noise(self, a: "pd.Series", b: "pd.Series", a_steps: float, b_steps: float) -> bool:
        """Whether two accesses-per-step vectors, EWMAs over ``a_steps`` and ``b_steps`` effective
        steps, differ by at least ``retry_rate_change`` (L1) and by more than ``change_z``
        standard deviations of their noise (:func:`_change_z`, capped as the last profile read
        says)."""
        s = self.settings
        if _rate_change(a, b) < s.retry_rate_change:
            return False
        return _change_z(a, b, a_steps, s.rate_dispersion, b_steps, caps=self._caps) > s.change_z

    def _rate_window(self, step: int) -> int:
        """Steps of accesses a plan after ``step`` reads: ``rate_window_periods`` re-plan periods,
        fewer since a shift of the accesses (:meth:`accesses_shifted`) if the plan comes after it."""
        s = self.settings
        window = s.rate_window_periods * s.replan_every
        if self._rates_from_step and step > self._rates_from_step:
            window = min(window, step - self._rates_from_step)
        return window

    def _rate_steps(self, step: int, which: str = "long") -> float:
        """Effective steps of the ``which`` ("long" or "short") EWMA of the accesses a plan after
        ``step`` reads."""
        halflife = self._long_halflife_at(step) if which == "long" else self._short_halflife
        return ewma_effective_steps(halflife, self._rate_series_steps(step))

    def _rate_series_steps(self, step: int) -> int:
        """Steps of accesses the EWMAs of a plan after ``step`` average: the rate window, fewer
        early in the run."""
        return max(1, min(int(step) - 1, self._rate_window(step)))

    def _long_halflife_at(self, step: int) -> float:
        """Halflife of the long EWMA of the accesses a plan after ``step`` reads (steps):
        ``rate_halflife_periods`` re-plan periods; while the steps since a shift of the accesses
        are fewer than the rate window (:meth:`_rate_window`), at most a quarter of them (at least
        the short halflife). The EWMA starts at the window's first step, which therefore weighs
        as much as all the steps before it would have: 65% of the 12 steps since a routing change
        at a 16-step halflife, 8% at a quarter of them. The plans after a reaction were made for
        that one step's routing: in three of session 29's four VM drift runs before this bound
        (and in session 28's) one was predicted at 66-97 ms, measured 163-221 ms, and reverted."""
        s = self.settings
        full = float(s.rate_halflife_periods * s.replan_every)
        since = step - self._rates_from_step
        if self._rates_from_step and 0 < since < s.rate_window_periods * s.replan_every:
            return min(full, max(self._short_halflife, since / 4))
        return full

    @property
    def _short_halflife(self) -> float:
        """Halflife of the short EWMA of the accesses (steps): a quarter re-plan period."""
        return max(1.0, self.settings.replan_every / 4)

    def rate_variance(self, rates: "pd.Series", which: str = "long") -> dict[str, float]:
        """Variance of each shard's accesses per step ``rates`` under the ``which`` EWMA of a plan
        made now (:func:`_rate_variance`, capped at the shards' most accesses in a step as the last
        profile read says); empty without ``change_z`` (no noise model: the policy's
        ``hold_rate_change`` alone)."""
        s = self.settings
        if s.change_z is None:
            return {}
        return _rate_variance(rates, self._rate_steps(self._step_now, which), s.rate_dispersion, self._caps).to_dict()

    def min_gain_fraction(self, rates: "pd.Series | None", realised: float | None, noise: float | None,
                          drifted: bool = False, calibration_error: float | None = None) -> float:
        """The smallest gain, as a fraction of the step, worth adopting a plan for: what a
        measurement can tell apart (``min_gain_fraction``; the steps' noise, ``refine_noise_z``
        times it once a plan for accesses like ``rates`` has landed, since the next one refines
        rather than reacts - unless the steps ``drifted`` from the prediction and the accesses
        shifted with them (:meth:`accesses_shifted`), which is a reaction too: the long EWMA's
        accesses lag a routing change by tens of steps) and, until a plan's
        realised gain (``realised``) has calibrated the model's gains, the model's own error on
        its landed plans (after that the gains are scaled instead: holding the scaled gain to the
        unscaled model's error would count the error twice); both only from plans made from
        accesses like these (a routing change starts afresh). Before any such plan has landed,
        the model's error on this run stands in for it: the larger of its landed plans' error
        under other accesses (:attr:`model_error`; those since the last shift of the accesses,
        :meth:`accesses_shifted`) and its error on the placement it is measuring
        (``calibration_error``: |measured - simulated| / measured step of the placement in force,
        what calibrating the simulator had to add) - a model 9% off on what it measures cannot
        promise 6% (the dense GPT at 50%: such plans measured no gain and were reverted, every
        revert ping-pong); not for a reaction to a drift, whose newest accesses neither the older
        plans nor the older steps it is calibrated on ran (the first plans for a new routing must
        not wait on the old one's errors), nor for a probe (:meth:`_probe_due`, passed as
        ``drifted``). ``min_gain_fraction`` 0 asks for every predicted gain (tests, a user
        who knows): no noise term."""
        floor = self.policy.settings.min_gain_fraction
        if floor <= 0:
            noise_term = 0.0
        else:
            refining = realised is not None and not drifted
            noise_term = (noise or 0.0) * (self.settings.refine_noise_z if refining else 1.0)
        model_term = None
        if realised is None:
            model_term = self.model_error_for(rates)
            if model_term is None and not drifted and floor > 0:
                # no plan for these accesses has landed: the model's error on this run so far (its
                # landed plans under other accesses; the MoE at 20%: 33-40% off, and a plan for
                # accesses that moved by noise promised 22% and measured 28% slower) and on the
                # placement it measures now, whichever is larger
                known = [e for e in (self._error_of(self._verified_like(None)), calibration_error) if e is not None]
                model_term = max(known) if known else None
        return max(floor, noise_term, model_term or 0.0)

    def _probe_due(self, shifted: bool, realised: float | None) -> bool:
        """Whether the plan being made is a *probe*: the accesses shifted earlier (a routing
        change, :meth:`accesses_shifted`), and no plan made since has landed and been measured -
        the reaction was refused, or found nothing to move. Such a plan is gated like a reaction
        (:meth:`min_gain_fraction` without the model's error): the model's error on the new
        accesses is what only a landed plan measures, and holding plans to its error on the
        placement in force kept every one out. On the 2-core VM's MoE at 20%, after a routing
        change whose reaction promised 3%, plans promising up to 18% were refused against a 25-32%
        calibration error for the rest of the run (6 periods), at 1.23x the reference run's step.
        Its outcome then gates the next plans; a probe that measures slower is reverted like any
        plan. A reaction that landed does not stand for it (kept or reverted): it was planned from
        the short EWMA's few steps, and the model's errors and realised gains leave it out for that
        (:meth:`_verified_like`). On an H100's MoE after a routing change the plans after a
        measured reaction (14-20% promised) met the calibration error on the placement in force,
        30-46%, for the rest of the run."""
        return (self._rates_from_step > 0 and not shifted and realised is None
                and not self._verified_like(None))

    def gain_realised_for(self, rates: "pd.Series | None") -> float | None:
        """:attr:`gain_realised` over the plans made from accesses like ``rates`` only (not
        :meth:`_accesses_changed` since): what plans realised under other accesses (before a routing
        change) says little about the next one, and a model that once realised nothing would
        otherwise never move a home again."""
        return self._realised(self._verified_like(rates))

    def _verified_like(self, rates: "pd.Series | None") -> list[dict]:
        """The entries of :attr:`verified` made from accesses like ``rates`` (not
        :meth:`_accesses_changed` since), reactions to a shift of the accesses left out; for
        ``rates`` None, all but the reactions since the last shift. A reaction is planned from the few steps since a routing change
        (the short EWMA): what it missed by is mostly what those steps got wrong about the new
        accesses, not what the model gets wrong - the MoE at 30%: a reaction 26-49% off gated
        the refinements after it (12-33 ms promised) and its step never recovered. Nor do the
        plans made before the last shift of the accesses count (:attr:`_rates_from_step`): the
        long EWMA lags a routing change by tens of steps, so that for a while the new accesses
        still look like the old ones, whose plans' realised gains then scaled the first reaction
        (the MoE at 20%: x0.40, below the gate, and no plan for 3 periods)."""
        since = [v for v in self.verified if v.get("step", 0) >= self._rates_from_step and not v.get("reaction")]
        if rates is None:
            return since
        return [v for v in since
                if v.get("rates") is None or not self._accesses_changed(rates, v["rates"], v.get("step"))]

    @property
    def gain_realised(self) -> float | None:
        """The share of its predicted gains that the model's plans delivered: the median over the
        last ``error_plans`` adopted plans (once measured) of (measured step before - measured
        step after) / the gain per step the model predicted, each in [-1, 1], the median clipped
        to [0, 1] (None before a plan with a predicted gain was measured). The controller scales
        the next plans' predicted gains by it: a model that promised 40 ms and delivered nothing
        stops moving homes for its next promise, and its predictions of the next plans' steps are
        calibrated the same way. Never above 1: a model that under-promises is not trusted more."""
        return self._realised(self.verified)

    def _realised(self, verified: list[dict]) -> float | None:
        if self.settings.error_plans <= 0:
            return None
        ratios = [max(-1.0, min(1.0, (v["before_s"] - v["measured_s"]) / v["model_gain_s"]))
                  for v in verified[-self.settings.error_plans:] if v.get("model_gain_s", 0.0) > 0]
        if not ratios:
            return None
        return max(0.0, min(1.0, statistics.median(ratios)))

    @property
    def step_noise(self) -> float | None:
        """What the revert test can tell from noise, as a fraction of the step: the standard error
        of the difference of two medians of ``verify_steps`` steps (before and after a plan),
        from the spread of the newest ``window_steps`` measured steps (1.4826 x their median
        absolute deviation, each step about the median of its own placement, placements of at
        least 3 steps: a placement just landed has too few steps to say; a median's standard
        error is 1.2533 sigma / sqrt(n)). None before 5 such steps. A plan whose
        (realisation-scaled) gain is below it is not adopted: neither its success nor its failure
        could be measured, and on the MoE's few-token steps (spread 15-25%) such plans moved a
        quarter of the budget each, half of them reverted."""
        return self.noise_of(self._verify_steps, self._verify_steps)

    def noise_of(self, before_steps: int, after_steps: int) -> float | None:
        """:attr:`step_noise` for medians of ``before_steps`` and ``after_steps`` steps: a plan
        judged again over all the steps of its placement (:meth:`_judge_again`) is compared on
        more of them, so less of a difference is noise."""
        sigma = self._step_spread()
        if sigma is None:
            return None
        return 1.2533 * sigma * math.sqrt(1.0 / max(1, before_steps) + 1.0 / max(1, after_steps))

    def _step_spread(self) -> float | None:
        """The steps' spread about their placement's median, as a fraction of it (sigma, from
        1.4826 x the median absolute deviation; see :attr:`step_noise`)."""
        deviations: list[float] = []
        for xs in reversed(self._placement_s):
            if len(deviations) >= self.settings.window_steps:
                break
            med = statistics.median(xs) if len(xs) >= 3 else 0.0
            if med > 0:
                deviations += [abs(x - med) / med for x in xs]
        if len(deviations) < 5:
            return None
        return 1.4826 * statistics.median(deviations)

    @property
    def plan_lag_steps(self) -> int:
        """``settings.plan_lag_steps``, or its default for this machine (:func:`default_plan_lag_steps`)."""
        lag = self.settings.plan_lag_steps
        return default_plan_lag_steps() if lag is None else lag

    @property
    def _lag_limit(self) -> int:
        """Steps after it was due that a plan is waited for: ``plan_lag_steps``, at most a re-plan
        period less one (the next plan is due after that)."""
        return max(1, min(self.plan_lag_steps, self.settings.replan_every - 1))

    @property
    def _verify_steps(self) -> int:
        """Steps a landed plan is measured over: ``verify_steps``, at most a re-plan period."""
        s = self.settings
        return max(1, s.drift_steps, min(s.verify_steps, s.replan_every))

    @property
    def migrating(self) -> bool:
        """Whether an adopted plan is still being applied (the engine defers moves beyond the
        per-step byte budget)."""
        return self._target is not None

    @property
    def last_plan_step(self) -> int:
        """The optimizer step after which the newest plan was made (0: none yet)."""
        return self._last_plan_step

    # ------------------------------------------------------------------ the engine's hook
    def after_step(self, engine) -> list[Move] | None:
        t0 = time.perf_counter()
        try:
            return self._after_step(engine)
        finally:
            self._own_s = time.perf_counter() - t0

    def _after_step(self, engine) -> list[Move] | None:
        step = engine.global_steps
        if self.plan_lag_steps > 0 and not self._planner_started:
            # the planning process imports the planner while the first steps run
            self._planner_started = True
            _helper_thread().submit(shared_process().call, warm_up, ("planner.controller",))
        if self._job is None:  # (a plan being made reads a copy of these: no migration runs meanwhile)
            self._step_now = step
            self._learn_migration_cost(getattr(engine, "last_migration", None))
        last = getattr(engine, "last_step", None)  # the previous step's {"wall_s": ...}
        # measured: the steps of the placement in force, less its first (it records the module
        # trace again), each less what this hook spent in it (planning, up to a second on the
        # MoE, and the migration): a placement is judged on its training steps - with plans every
        # few steps after a drift, one step in three carried a plan and inflated the noise. Nor
        # are the steps that ran while the planning process made a plan: it shares the CPUs, and
        # on the MoE at 20% measuring them made each plan see a slower step than the last
        # (209 -> 339 ms, same placement), drift plans every 4-5 steps, and more of them.
        overlapped = step - 1 <= self._planned_through or (self._job is not None and step - 1 > self._job.step)
        # Nor is a step after Engine.drain(): it starts with nothing prefetched (the side-by-side
        # benchmark drains each engine every 8 steps and leaves that step out of its medians; a
        # verify window of 5 steps with one in it judged a plan on it)
        if (last and last.get("wall_s") is not None and self._target is None and step - 1 > self._settled_step
                and not overlapped and not last.get("after_drain")):
            wall_s = float(last["wall_s"]) - self._own_s - float(last.get("migration_s") or 0.0)
            wall_s = max(wall_s, 0.0)
            self._recent_s.append(wall_s)
            self._placement_s[-1].append(wall_s)
        if self._job is not None:  # a plan is being made in the planning process: take it up once made
            return self._take_up(engine, step)
        if self._target is not None:
            placement = homes_of(engine.placement)
            self._drop_refused(getattr(engine, "last_migration", None), placement)
            left = diff_moves(placement, self._target)
            if left:
                return left
            self._target = None  # the plan has landed: measure from here on
            self._settled_step = step
            self._recent_s.clear()
            self._placement_s.append([])  # a new placement: its steps have their own median
        s = self.settings
        if self._verify is not None and s.revert_fraction is None and not self._verify.trial:
            self._verify = None  # (a trial is always measured: that is what it is for)
        if self._verify is not None and len(self._recent_s) >= self._verify_steps:
            judged_on = list(self._recent_s)[-max(s.drift_steps, s.verify_steps):]
            if self._verify.trial:
                judged_on = self._trial_steps(list(self._recent_s))
                if judged_on is None:
                    return None  # within the noise of the placement before it: measured on
            check, self._verify = self._verify, None
            measured = statistics.median(judged_on)
            if (check.mode is not None and check.model_step_s is not None and check.mode != check.before_mode
                    and check.before_mode in self.mode_offset_s):
                # the residual that would have predicted what its mode measured, against the
                # residual of the mode before it at the plan, a few steps earlier
                residual = check.overhead_s + measured - check.model_step_s
                self.mode_offset_s[check.mode] = (self.mode_offset_s[check.before_mode]
                                                  + residual - check.before_residual_s)
            entry = {"step": check.step, "predicted_s": check.predicted_s, "measured_s": measured,
                     "before_s": check.before_s, "model_gain_s": check.model_gain_s, "rates": check.rates,
                     "reaction": check.reaction}
            (self.trials if check.trial else self.verified).append(entry)
            failed = self._failed_by(check, measured, len(judged_on))
            entry["kept"] = not failed
            if failed:
                return self._revert(engine, step, check, measured, failed)
            if check.trial and self._needs_confirm(check, measured):
                moves = self._start_confirm(engine, step, check, entry, measured, len(judged_on))
                if moves:
                    return moves
            self._rejudge = (check, entry)
            # Kept: from here on its own steps are its prediction, as calibrating the simulator on
            # the placement in force makes it at the next plan (the plan's prediction was the
            # model's before any step of it was measured; a drift is judged against what it runs at).
            self._predicted_step_s = measured
        if self._confirm is not None:
            return self._end_confirm(engine, step)  # (None while the placement before the trial is measured)
        if self._verify is not None:
            return None  # the plan in force is measured before the next one is made
        if step - self._settled_step < s.first_plan_after:
            return None
        drifted = self._drifted()
        if drifted:
            self._split_drifted()
            self._quiet_plans = 0  # back to replan_every
        if not drifted and step - self._last_plan_step < self.replan_period:
            return None
        if self._rejudge is not None and drifted:
            self._rejudge = None  # the steps drifted from the prediction: no longer comparable with the ones before it
        if self._rejudge is not None:
            moves = self._judge_again(engine, step)
            if moves is not None:
                return moves
        self._last_plan_step = step
        # the newest steps of the placement in force: what an adopted plan is judged against
        # (not the planning window's, whose first steps may be the run's warm-up)
        recent = list(self._recent_s)[-self._verify_steps:]
        before_s = statistics.median(recent) if len(recent) >= s.drift_steps else None
        # where the steps are now: after a drift, the steps that drifted (a wider window may
        # straddle the change)
        self._level_s = statistics.median(recent[-s.drift_steps:]) if drifted else before_s
        self._recent_s.clear()  # drift is judged on steps after this plan
        self._time_update_once(engine)
        self._time_io_cpu_once(engine)
        if self.plan_lag_steps > 0 and self._process_failures < PROCESS_FAILURES_INLINE and self._can_plan_elsewhere():
            self._hand_over(engine, step, drifted, before_s)
            return None
        return self._plan_here(engine, step, step, drifted, before_s)

    def _plan_here(self, engine, due_step: int, step: int, drifted: bool, before_s: float | None) -> list[Move] | None:
        """Make the plan due after ``due_step`` on the training thread, now after ``step``: its
        moves, the plan version moved on when there are any, and the measured steps split at a
        shift it found (:meth:`_split_at_shift`)."""
        shift_before = self._rates_from_step
        moves = self._plan_or_skip(engine, due_step, drifted, before_s)
        self._split_at_shift(shift_before, step)
        if moves:
            engine.plan_version += 1
        return moves

    def _time_update_once(self, engine) -> None:
        """Time the optimizer update here, once a run (a few ms): a plan made while no shard has
        both homes in DRAM cannot read it from the profile, and a planning process timing it
        would time it on whatever CPU training leaves it (and each plan differ by a new timing's
        noise)."""
        if self._update_timing is None:
            self._update_timing = measure_update(engine.config.optimizer)

    def _time_io_cpu_once(self, engine) -> None:
        """On a CPU device, measure once a run (~0.7 s, between steps) how much compute the
        store's request threads take from the training thread per byte they read
        (:func:`planner.workload.measure_io_cpu`, in the param swap folder): moving a home to NVMe
        costs that too, which the disk's time alone does not say (the dense GPT at 30% on the
        2-core VM: a plan promising 562 -> 451 ms measured 670 ms). With a GPU computing it is 0."""
        if self._io_cpu is not None:
            return
        if engine.device.type != "cpu":
            self._io_cpu = (0.0, "a GPU computes: 0")
            return
        cfg = engine.config
        folder = cfg.param_nvme_path
        try:
            timing = measure_io_cpu(folder, thread_count=max(2, int(cfg.aio.thread_count)))
        except (OSError, TypeError) as e:  # no swap folder, or the disk refused: plan without it
            self._io_cpu = (0.0, f"not measured ({type(e).__name__}: {e}): 0")
            log.warning("zinf planner: could not measure the store's CPU cost in %s (%s); planning without it", folder, e)
            return
        self._io_cpu = (timing.s_per_byte, f"measured here: compute {timing.alone_s * 1e3:.0f} ms alone, "
                                           f"{timing.beside_s * 1e3:.0f} ms beside reads at {timing.read_Bps / 1e6:.0f} MB/s")

    # ------------------------------------------------------------------ planning elsewhere
    def __getstate__(self) -> dict:
        """What the planning process gets (:meth:`_hand_over`): everything but the recorder and
        the plan in flight, with copies of the step times the training thread goes on adding to."""
        state = self.__dict__.copy()
        state["recorder"] = None
        state["_job"] = None
        state["_recent_s"] = deque(self._recent_s, maxlen=self._recent_s.maxlen)
        state["_placement_s"] = deque((list(xs) for xs in self._placement_s), maxlen=self._placement_s.maxlen)
        return state

    # measured by the training thread while a plan is being made: kept when the plan's state comes back
    _MEASURED_HERE = ("_recent_s", "_placement_s", "_own_s", "plan_lags")

    def _can_plan_elsewhere(self) -> bool:
        """Whether the planning process can rebuild this controller: its class must be importable
        by name (a subclass defined inside a function is not); else plans are made here, and a
        warning says so once."""
        try:
            pickle.dumps(type(self))
            return True
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            if "elsewhere" not in self._warned:
                self._warned.add("elsewhere")
                log.warning("zinf planner: %s cannot be sent to the planning process (%s); plans are made on the "
                            "training thread (set zinf.placement.plan_lag_steps: 0 to say so)", type(self).__name__, e)
            return False

    def _hand_over(self, engine, step: int, drifted: bool, before_s: float | None) -> None:
        """Have the planning process make the plan due after ``step`` from a copy of this
        controller (:func:`_plan_in_child`), while training goes on; :meth:`_take_up` takes it
        up. The helper thread flushes the profiler first, so that the plan reads every step up
        to ``step``."""
        view = EngineView.of(engine)
        state, cls, recorder = self.__getstate__(), type(self), self.recorder

        job = _Job(step, drifted, before_s, time.perf_counter())

        def make() -> tuple | None:
            if recorder is not None:
                recorder.flush()
            if job.abandoned:  # (queued behind a request the training thread gave up on)
                return None
            run_id = recorder.run_id if recorder is not None else None
            return shared_process().call(_plan_in_child, cls, state, view, step, drifted, before_s, run_id)

        job.future = _helper_thread().submit(make)
        self._job = job

    def _take_up(self, engine, step: int) -> list[Move] | None:
        """The plan in flight, once made (at the latest ``plan_lag_steps`` steps after it was due,
        waiting for it there): its state replaces this controller's (but for the steps measured
        meanwhile), its recorder calls and log lines are made here, and its moves returned. A
        planning process that gets no CPU while the training thread waits is killed and the plan
        made here instead."""
        job = self._job
        if not job.future.done() and step - job.step < self._lag_limit:
            return None
        self._job = None
        waited = self._wait_for(job)
        if waited != "done":
            job.abandoned = True
            job.future.cancel()  # (if still queued behind another request)
            shared_process().kill()
        if waited == "timeout":
            raise PlanningProcessError(
                f"the plan due after step {job.step} took over {PLAN_TIMEOUT_S:g} s in the planning process; "
                "it was killed and the next plan starts another") from None
        if waited == "starved":
            self._failed_elsewhere(f"the planning process got no CPU for the plan due after step {job.step} "
                                   "(other work keeps the CPUs busy)")
            log.warning("zinf planner: the planning process got no CPU for the plan due after step %d (other work "
                        "keeps the CPUs busy); made on the training thread after step %d", job.step, step)
            self._planned_through = step
            return self._plan_here(engine, job.step, step, job.drifted, job.before_s)
        try:
            moves, state, calls, lines = job.future.result()
        except PlanningProcessError as e:
            if e.died:
                self._failed_elsewhere(str(e))
            else:
                self._process_failures = 0
            raise
        self._process_failures = 0
        kept = {k: self.__dict__[k] for k in self._MEASURED_HERE}
        recorder, shift_before = self.recorder, self._rates_from_step
        self.__dict__.update(state)
        self.__dict__.update(kept)
        self.recorder = recorder
        self._split_at_shift(shift_before, step)
        for name, args, kwargs in calls:
            answer = getattr(recorder, name)(*args, **kwargs)
            if name == "set_shard_detail_every":
                self.detail_every = int(answer)
        for level, line in lines:
            log.log(level, line)
        self.plan_lags.append((job.step, step, time.perf_counter() - job.started_s))
        self._planned_through = step  # this step ran while the plan was being made
        if moves:
            engine.plan_version += 1
        return moves

    def _wait_for(self, job: _Job) -> str:
        """Wait for the plan in flight: "done" (made, or failed), "starved" (the planning process
        had a request - this plan or the imports before it - and got under STARVED_CPU_FRACTION
        of a CPU over STARVED_CHECK_S) or "timeout" (not made after PLAN_TIMEOUT_S)."""
        deadline = time.perf_counter() + PLAN_TIMEOUT_S
        proc = shared_process()
        while True:
            cpu0, t0 = proc.cpu_seconds(), time.perf_counter()
            busy = proc.busy
            try:
                job.future.result(timeout=STARVED_CHECK_S)
                return "done"
            except FutureTimeout:
                pass
            except Exception:  # the plan failed there: the caller raises it
                return "done"
            cpu1 = proc.cpu_seconds()
            if (busy and proc.busy and cpu0 is not None and cpu1 is not None and cpu1 >= cpu0
                    and cpu1 - cpu0 < STARVED_CPU_FRACTION * (time.perf_counter() - t0)):
                return "starved"
            if time.perf_counter() > deadline:
                return "timeout"

    def _failed_elsewhere(self, why: str) -> None:
        """Count a plan the planning process did not make; after PROCESS_FAILURES_INLINE in a
        row, plans are made on the training thread for the rest of the run."""
        self._process_failures += 1
        if self._process_failures == PROCESS_FAILURES_INLINE:
            log.warning("zinf planner: %d plans in a row were not made in the planning process (last: %s); plans are "
                        "made on the training thread from now on", self._process_failures, why)

    # ------------------------------------------------------------------ planning
    def _plan_or_skip(self, engine, step: int, drifted: bool, before_s: float | None) -> list[Move] | None:
        """:meth:`_plan`, with a plan that cannot be made recorded as a skip."""
        try:
            return self._plan(engine, step, drifted, before_s)
        except _BudgetFull as e:  # the placement in force already fills the budget: normal
            self.last_skip = str(e)
            log.info("zinf planner: step %d: %s", step, e)
            return None
        except ZinfError as e:  # not enough data yet, a budget the pins fill, ...
            self._skip(str(e))
            return None

    def read_profile(self, run_id: int, step: int, rate: str, timing_steps: int,
                     announced_reads: bool = False) -> Workload:
        """The run's profile up to ``step`` as a plan made right after it reads it: timings from
        the last ``timing_steps`` steps (at least 2, at most ``window_steps``), access rates from
        the rate window with ``rate`` ("long" or "short") EWMA filling the phase columns.
        ``benchmarks/shift_statistic.py`` replays the shift test through this same read."""
        s = self.settings
        wl = Workload.from_profile(self.url, run_id, last_steps=max(2, min(s.window_steps, timing_steps)),
                                   rate_steps=max(2, self._rate_window(step)), rate=rate,
                                   long_halflife_steps=self._long_halflife_at(step),
                                   short_halflife_steps=self._short_halflife, until_step=step,
                                   measured_update=self._update_timing)
        wl = replace(wl, announced_reads=announced_reads)
        return wl if self._io_cpu is None else wl.with_io_cpu(*self._io_cpu)

    def _plan(self, engine, step: int, drifted: bool = False, before_s: float | None = None) -> list[Move] | None:
        s = self.settings
        self.recorder.flush()
        run_id = self.recorder.run_id
        if folder := os.environ.get(PLAN_DUMP_ENV):  # what the plan is made from, for benchmarks/plan_replay.py
            dump_plan_inputs(folder, self, engine, step, drifted, before_s)
        # the steps recorded since the placement changed (up to the previous one: this step's row
        # is written after this hook), less the first (it records the module trace again)
        since = step - 1 - self._settled_step
        # Plans smooth the accesses over the long EWMA; a plan whose accesses have shifted (a
        # routing change: the short EWMA moved from the long one beyond their noise across all
        # shards) is a reaction, planned from the short EWMA - whether the step drifted or not (a
        # routing change that moves the step by less than drift_fraction, or whose drift came
        # before the shift was clear, waited on the long EWMA for periods, the ping-pong hold
        # keeping the old hot set in DRAM). A drift of the step alone (its noise, the model's
        # error) is planned and gated like a scheduled plan: at 50% such drift plans, made from a
        # noisy short EWMA and held to one noise, measured slower.
        # The long EWMA's halflife is rate_halflife_periods re-plan periods (long enough to
        # average out the token noise of small batches; a plan pays back over a few periods), the
        # short one a quarter period.
        # Timings come from the steps of the placement in force; access rates, which no placement
        # changes, from up to rate_window_periods re-plan periods, so that a few tokens a step do
        # not make every plan chase noise (churn).
        # (the engine knows whether the model announces its routed modules; the profile does not)
        announced = bool(getattr(engine, "announced_reads", False))

        def profile(rate: str) -> Workload:
            return self.read_profile(run_id, step, rate, timing_steps=since, announced_reads=announced)

        workload = profile("long")
        if "accesses_max" in workload.shards:
            self._caps = workload.shards["accesses_max"].astype(float).set_axis(workload.shards["shard"])
        # both EWMAs of every shard's accesses, whichever filled the workload's phase columns
        short_rates, rates = _rates(workload, "short"), _rates(workload, "long")
        # the first plan has no earlier accesses to have shifted from (its long EWMA is mostly
        # the window's first step: z 3.2 against the short one on the MoE benchmark, no change)
        shifted = self.plans_made > 0 and self.accesses_shifted(short_rates, rates)
        if shifted:
            # the same profile again, its phase columns from the short EWMA (rare: a routing change)
            workload = profile("short")
            self._rates_from_step = max(self._rates_from_step, step - s.drift_steps)  # the next plans' window
        constant = _rate_change(short_rates, rates) < s.constant_rate_change
        if not drifted and not shifted and not self._exploring(step) and self._unchanged(engine, workload):
            self._record_unchanged(engine, step, workload)
            self._sample_detail(constant)
            self._kept_quietly(constant, step)
            return None
        self._skipped_in_row = 0
        # the disk as it behaves lately (the samples of the rate window; a long run's whole
        # history would make every plan slower to fit than the last)
        cost = CostModel.from_db(self.url, run_id, first_step=max(1, step - s.rate_window_periods * s.replan_every),
                                 last_step=step)
        workload = self._fetch_overhead_known(workload, cost, step)
        overlap = engine.overlap
        # The buffers the engine really has (under the budget it switches off what does not
        # fit, which the config does not say): simulating the measured placement with the
        # config's buffers would calibrate on the wrong engine.
        configured = workload  # the buffers the config asks for: what candidates may have
        workload = workload.with_buffers(prefetch_bytes=overlap.prefetch_bytes, write_bytes=overlap.write_bytes,
                                         read_ahead_bytes=overlap.read_ahead_bytes, eager=overlap.eager)
        workload = calibrate(workload, cost, placement=engine.placement)
        # what calibrating had to add is this engine mode's; other modes that ran differ from it by
        # their offsets, those that never ran borrow it
        self._note_mode(mode_of(workload), float(workload.overhead_s))
        # No trial at the first plan: it is judged against the run's first steps, which are slower
        # (the VM's GPT at 30%: steps 3-7 at 0.70 s, a trial measured 0.72 s "faster" than them and
        # was kept, where the placement before it runs at 0.58 s); nor after the exploring periods
        # (trial_periods), a shift or a drift. A reverted plan does not block one: its mode has
        # run, a trial's never has (the H100's GPT at 30%: the first plan was reverted, and with it
        # went the trial of all-NVMe with updates during backward, 11% faster than max_in_cpu).
        trial_ok = self.plans_made > 0 and self._may_try(step) and not drifted and not shifted
        s_per_move, s_per_byte = self._move_cost(cost)
        candidates = configured.with_overhead(workload.overhead_s)
        plan, sim = self._best_plan(engine, candidates, cost, trial_ok=trial_ok, move_s_per_byte=s_per_byte)
        plan_homes, plan_mode = plan.homes(), getattr(plan, "mode", None)
        sims = {}  # the simulators of the placements the policy weighs, by their buffers and overhead

        def sim_for(homes: dict) -> tuple[Simulator, Mode | None]:
            """The simulator of ``homes`` with the buffers the engine would grant them. The
            policy may take less than the plan (the warm band, the ping-pong hold keep homes
            where they are), and the engine sizes its buffers from the homes it really has: a
            plan that took every home into DRAM had no buffers, and the half of it the warm band
            left was simulated without any, at twice the step it would run (the frozen-block GPT
            with a budget holding every home: every plan "slower" than all-NVMe)."""
            if homes == plan_homes:
                return sim, plan_mode
            granted = self._granted(engine, candidates, _placement_of(homes))
            key = (granted.prefetch_bytes, granted.write_window_bytes, granted.pipeline_read,
                   granted.updates_during_backward, float(granted.overhead_s))
            if key not in sims:
                sims[key] = Simulator(granted, cost, prefetch_bytes=granted.prefetch_bytes)
            return sims[key], mode_of(granted)
        trial = bool(getattr(plan, "trial", False))
        # a plan in a mode that never ran, not tried: its calibration is borrowed, its error
        # unknown by up to trial_band of the step - it must clear that too (a reaction to a
        # routing change is not held back by it: it must react)
        untried = not trial and getattr(plan, "mode", None) is not None and plan.mode not in self.mode_offset_s
        now_sim = Simulator(workload, cost, prefetch_bytes=overlap.prefetch_bytes)
        current = homes_of(engine.placement)
        shards = workload.shards.set_index("shard")

        def move_s(m: Move) -> float:
            nbytes = int(shards.at[m.shard, "param_bytes" if m.state == "param" else "optim_bytes"])
            if self.migrations_measured:  # what this engine's moves really took (its whole
                return s_per_move + nbytes * s_per_byte  # bytes: at most what the move copies)
            return float(cost.predict_s("nvme", "write" if m.dst == "nvme" else "read", nbytes))

        # The current placement with the overlap buffers it has; candidates with the buffers the
        # chosen plan leaves room for (the engine re-sizes them from what the homes leave).
        current_step_s = now_sim.predict(current).step_s
        density = plan.density()
        # plans compare the long EWMA's accesses (``rates``), also after a shift: like with like.
        # The ping-pong hold asks whether a home's own accesses changed since the plan that moved
        # it, on the accesses this plan is made from: after a shift those of the short EWMA (with
        # its larger noise) - the long one lags a routing change by tens of steps, and held the
        # old hot set in DRAM that long.
        which = "short" if shifted else "long"
        hold_rates = short_rates if shifted else rates
        hold_variance = self.rate_variance(hold_rates, which)
        realised = self.gain_realised_for(rates)
        noise = self.step_noise
        # what calibrating on the placement in force had to add: the model's error on what it measures
        calibration_error = abs(float(workload.overhead_s)) / float(workload.measured_step_s) if workload.measured_step_s else None
        probe = self._probe_due(shifted, realised)
        min_gain = self.min_gain_fraction(rates, realised, noise, shifted or probe, calibration_error)
        if untried and not shifted:
            min_gain += s.trial_band
        def decide(warm_band: bool = True) -> Decision:
            return self.policy.decide(
                current, plan.homes(), current_step_s=current_step_s,
                predict_step_s=lambda homes: sim_for(homes)[0].predict(homes).step_s,
                density=density, dram_bytes=plan.home_bytes(), dram_room_bytes=plan.room_bytes,
                migration_s=move_s, horizon_steps=s.replan_every * s.horizon_plans,
                min_gain_fraction=min_gain,
                gain_scale=1.0 if realised is None else realised,
                # a home a recent plan moved goes back only if its own accesses changed since (ping-pong),
                # by more than their noise
                rates=hold_rates.to_dict(), rate_variance=hold_variance,
                # the accesses as a whole moved (a routing change): every home may go where it now
                # belongs; one home's few steps since cannot show it, all of them together can
                accesses_changed=shifted,
                trial_band=s.trial_band if trial else None,
                fits=lambda homes: engine.dram_need_of(_placement_of(homes)).total_bytes <= self.dram_budget_bytes,
                warm_band=warm_band,
            )

        decision = decide()
        if decision.kept_by_warm_band and sim_for(decision.placement)[1] != plan_mode:
            # The band keeps near-threshold homes where they are when that changes the plan
            # little; when what it keeps changes the engine mode (the buffers the engine grants
            # the homes left), it is another plan, one the solver never weighed: the MoE at 20%
            # took a plan solved with no overlap buffers, its band kept 45 homes out, the engine
            # granted the rest buffers, and it ran 56% slower than predicted. Taken whole.
            decision = decide(warm_band=False)

        decision = self._unless_reverted_before(decision, rates, shifted, trial)
        if self._explore_until is None:  # the first plan: trials may follow for trial_periods periods
            self._explore_until = step + s.trial_periods * s.replan_every
        self.plans_made += 1
        self.last_plan, self.last_decision = plan, decision
        sim, target_mode = sim_for(decision.placement)  # the placement taken, as the engine will run it
        self._last_solved = _Solved(rates, float(workload.measured_step_s), dict(current), decision.adopt, step)
        # the plan's step: the current one less the (scaled) gain; the model's own, unscaled
        model_gain_s = current_step_s - sim.predict(decision.placement).step_s if decision.moves else 0.0
        predicted_s = current_step_s - decision.gain_s_per_step
        reason = decision.as_reason() | {
            "current_step_s": current_step_s, "measured_step_s": workload.measured_step_s,
            "solver": plan.method, "solver_s": plan.solve_s, "note": plan.note, "trigger": "drift" if drifted else "schedule",
            "model_error": self.model_error, "model_gain_s": model_gain_s, "step_noise": noise,
            "min_gain_fraction": min_gain, "accesses_shifted": shifted, "calibration_error": calibration_error,
            "model": _model_numbers(workload), "trial": trial, "mode": describe_mode(target_mode or mode_of(workload)),
            "mode_untried": untried, "probe": probe,
        }
        self.recorder.record_plan(
            self.plans_made, _assignments(engine.placement, decision.placement, density), policy="adaptive", created_step=step,
            dram_budget_bytes=self.dram_budget_bytes, predicted_step_s=predicted_s,
            predicted_gain_s=decision.gain_s_per_step, adopted=decision.adopt, reason=reason,
        )
        log.info("zinf planner: step %d plan %d%s %s: %s", step, self.plans_made,
                 " (accesses shifted: a reaction)" if shifted else "",
                 "adopted" if decision.adopt else "kept the current placement", decision.reason)
        if not decision.adopt:
            # the placement stays: the model's step, calibrated on the window's median - but for a
            # dense model (the same accesses every step: only the machine can change its step),
            # the level of its newest steps, so that a drift is judged from where they are (the
            # dense GPT at 50% on the VM: its steps went 0.49 -> 0.65 s, the window's median
            # lagged, and a drift plan every 3-4 steps cost ~0.9 s each)
            level = self._level_s if constant else None
            self._predicted_step_s = current_step_s if level is None else level
            self._sample_detail(constant)
            self._kept_quietly(constant and not drifted and not shifted, step)
            return None
        self._sample_detail(False)  # the new placement's steps are measured in full
        self._quiet_plans = 0
        self._rejudge = None  # its placement is being replaced
        self.plans_adopted += 1
        # a reaction's homes are provisional: the plans after it, with more steps of the new
        # accesses, may send them back without the ping-pong hold (see PlacementPolicy.adopted)
        self.policy.adopted(decision, current, hold_rates.to_dict(), rate_variance=hold_variance, provisional=shifted)
        self._target = decision.placement
        self._predicted_step_s = predicted_s
        before = float(workload.measured_step_s) if before_s is None else before_s
        landed = sim.predict(decision.placement)
        self._verify = _Check(step, before, dict(current), predicted_s, rates, model_gain_s, reaction=shifted,
                              trial=trial, mode=target_mode,
                              model_step_s=float(landed.step_s), overhead_s=float(landed.overhead_s),
                              before_mode=self._mode_now[0], before_residual_s=self._mode_now[1])
        return decision.moves

    def _fetch_overhead_known(self, workload: Workload, cost, step: int) -> Workload:
        """``workload`` with an NVMe param fetch's overhead beyond its read that the planner can
        stand by. A profile read of a placement with no param on NVMe measures none and says 0,
        which made moving params to NVMe look free: the dense GPT at 30%, starting with every
        param in DRAM, promised 150-190 ms from moving 25 params out to make room for optimizer
        homes, and measured 0-18 ms slower (0.7 ms a fetch by the estimate of then, x 8 fetches a
        step each). So: the value measured, remembered for later reads of this run that have
        none; before any, an estimate (:meth:`_fetch_overhead_prior`)."""
        if workload.fetch_overhead_measured:
            self._fetch_overhead = (float(workload.fetch_overhead_s), step)
            return workload
        if self._fetch_overhead is not None:
            seconds, then = self._fetch_overhead
            return workload.with_fetch_overhead(seconds, f"measured at the plan of step {then} (no NVMe param fetch since)",
                                                measured=True)
        params = workload.shards.loc[(workload.shards["param_bytes"] > 0) & ~workload.shards["chunk"], "param_bytes"]
        if params.empty:
            return workload
        seconds, how = self._fetch_overhead_prior(workload, params, cost)
        return workload.with_fetch_overhead(seconds, f"no NVMe param fetch measured yet: {how}", measured=False)

    @staticmethod
    def _fetch_overhead_prior(workload: Workload, param_bytes: "pd.Series", cost) -> tuple[float, str]:
        """Seconds assumed for an NVMe param fetch beyond its read, before any was measured, and how.

        On a GPU machine, what a fetch does beyond its read (resize the storage, launch the
        upload) is what a DRAM param's fetch does whole: the median param shard's bytes at the
        measured upload rate (``copy_Bps``). Measured on the H100 GPT: 0.0225 ms an NVMe fetch,
        0.0013-0.06 ms a DRAM one, and this estimate 0.0075 ms; the latency of one read assumed
        there before (0.30 ms, 13x the overhead measured later) put the GPT's all-NVMe placement
        11 ms a step slower at its first plan than the measured overhead does (part of it is
        hidden behind compute in the simulator).

        Elsewhere (a CPU device: a DRAM param is used where it lies, so no fetch measures the
        copy), the latency of one read (the cost model's fixed part per request): 0.27-0.32 ms
        against 0.14 ms measured on the 2-core VM, the safe side."""
        if workload.copy_measured:
            median = float(param_bytes.median())
            seconds = 0.0 if not math.isfinite(workload.copy_Bps) else median / workload.copy_Bps
            return seconds, (f"the upload of a DRAM param of the median size ({median / 2**20:.1f} MiB at "
                             f"{workload.copy_Bps / 1e9:.3g} GB/s: {seconds * 1e3:.3f} ms) assumed, the same resize and launch")
        seconds = float(cost.predict_s("nvme", "read", 0))
        return seconds, f"the latency of one read ({seconds * 1e3:.2f} ms) assumed"

    def _unless_reverted_before(self, decision: Decision, rates: "pd.Series", shifted: bool,
                                trial: bool = False) -> Decision:
        """``decision``, refused when it would adopt a plan made from accesses like those of the
        last plan reverted (``_failed``): the same model would err again. A drifting step alone is
        no reason to try again; accesses changed beyond their noise are, and so is a shift of the
        accesses as a whole (a routing change, ``shifted``): a plan reverted just after one was
        made, and judged, on the old routing's steps - on the MoE at 50% such a block held the
        old hot set in DRAM for 20 steps after the change (1.50x the settled step)."""
        if not decision.adopt or self._failed is None or trial:
            return decision  # (a trial is in a mode that never ran, not the reverted plan's)
        if shifted or self._accesses_changed(rates, self._failed.rates, self._failed.step):
            self._failed = None
            return decision
        changed = _rate_change(rates, self._failed.rates)
        return replace(decision, adopt=False, reason=(
            f"a plan made from accesses like these was measured slower and reverted at step "
            f"{self._failed.step} (accesses changed {changed:.0%} since: below {self.settings.retry_rate_change:.0%} "
            f"or within their noise)"))

    @property
    def replan_period(self) -> int:
        """Steps from one scheduled re-plan to the next: ``replan_every``, doubled after each
        quiet plan up to ``quiet_backoff_max`` times it (see :attr:`ControllerSettings.quiet_backoff_max`)."""
        s = self.settings
        return s.replan_every * min(max(1, s.quiet_backoff_max), 2 ** min(self._quiet_plans, 30))

    def _exploring(self, step: int) -> bool:
        """Whether ``step`` is in the exploring periods: before the first plan, or within
        ``trial_periods`` re-plan periods after it (see :attr:`ControllerSettings.trial_periods`).
        Re-plans there are solved and keep the period; trials start while :meth:`_may_try`."""
        return self.settings.trial_band > 0 and (self._explore_until is None or step < self._explore_until)

    def _may_try(self, step: int) -> bool:
        """Whether a plan made after ``step`` may be a trial: one re-plan period (what measuring
        it and a revert take) still fits in the exploring periods (:meth:`_exploring`) - a trial
        made later, after a drift plan moved the schedule, was reverted in the steady state; two
        periods where it may be confirmed (:attr:`ControllerSettings.trial_confirm_z`)."""
        periods = 1 if self.settings.trial_confirm_z is None else 2
        return self._exploring(step + periods * self.settings.replan_every - 1)

    def _kept_quietly(self, quiet: bool, step: int) -> None:
        """Count a scheduled re-plan that kept the placement while every shard's accesses were the
        same every step (``quiet``); anything else starts the count again. While trials may still
        be made (:meth:`_exploring`), the period stays: the next plan may be one."""
        before = self.replan_period
        self._quiet_plans = self._quiet_plans + 1 if quiet and not self._exploring(step) else 0
        if self.replan_period != before:
            log.info("zinf planner: next scheduled re-plan in %d steps (the placement kept, the accesses the same "
                     "every step)", self.replan_period)

    def _sample_detail(self, sparse: bool) -> None:
        """Have the recorder record the shard detail of every step, or - ``sparse``: the accesses
        are the same every step and the placement is settled - of one step in
        ``min(sparse_detail_every, replan_every)`` (see :attr:`ControllerSettings.sparse_detail_every`).
        The recorder decides from the next step on; its rows of a sampled step stand for the steps
        since the previous sample, so the access rates a plan reads stay per-step rates."""
        s = self.settings
        k = max(1, min(s.sparse_detail_every, s.replan_every)) if sparse else 1
        setter = getattr(self.recorder, "set_shard_detail_every", None)
        if setter is not None and k != self.detail_every:
            self.detail_every = int(setter(k))
            log.info("zinf planner: shard detail recorded every %d step(s)", self.detail_every)

    def _record_unchanged(self, engine, step: int, workload: Workload) -> None:
        """Record a scheduled re-plan that was not solved again (:meth:`_unchanged`): a plan that
        keeps the current placement, with the last solved plan's scores and the reason."""
        self.plans_skipped += 1
        self._skipped_in_row += 1
        self.plans_made += 1
        why = (f"accesses, step time and placement as at the last plan solved: not solved again "
               f"({self._skipped_in_row} in a row, at most {self.settings.resolve_every_plans - 1})")
        density = self.last_plan.density() if self.last_plan is not None else None
        predicted_s = self._predicted_step_s if self._predicted_step_s is not None else float(workload.measured_step_s)
        self.recorder.record_plan(
            self.plans_made, _assignments(engine.placement, {}, density), policy="adaptive", created_step=step,
            dram_budget_bytes=self.dram_budget_bytes, predicted_step_s=predicted_s, predicted_gain_s=0.0,
            adopted=False, reason={"adopt": False, "why": why, "moves": 0, "trigger": "schedule", "solved": False,
                                   "measured_step_s": workload.measured_step_s})
        log.info("zinf planner: step %d plan %d kept the current placement: %s", step, self.plans_made, why)

    def _unchanged(self, engine, workload: Workload) -> bool:
        """Whether a scheduled re-plan would only repeat the last plan solved: that plan was not
        adopted and the placement is the same, the accesses per step (long EWMA) differ by less
        than ``unchanged_rate_change`` or not beyond their noise (:meth:`_accesses_changed`), and
        the measured step by less than ``min_gain_fraction``; and fewer than
        ``resolve_every_plans`` re-plans in a row were skipped."""
        s = self.settings
        if s.unchanged_rate_change <= 0 or self._last_solved is None or self._skipped_in_row + 1 >= s.resolve_every_plans:
            return False
        last = self._last_solved
        if last.adopted or last.placement != homes_of(engine.placement):
            return False
        if abs(float(workload.measured_step_s) - last.measured_s) > self.policy.settings.min_gain_fraction * last.measured_s:
            return False
        now = _rates(workload)
        if _rate_change(now, last.rates) < s.unchanged_rate_change:
            return True
        # moved, but within their noise (a few tokens a step): solving again would chase it - the
        # MoE's re-plans were all solved (~1.3 s each on 2 cores) and one in the steady state
        # moved a third of the budget for a gain at the edge of the model's error
        return s.change_z is not None and not self._accesses_changed(now, last.rates, last.step)

    def _failed_by(self, check: "_Check", measured_s: float, measured_steps: int, again: bool = False) -> str | None:
        """Why a landed plan is to be reverted, or None: measured (the median of
        ``measured_steps`` steps) slower than the placement it replaced by more than
        ``revert_fraction`` and more than the noise of the two medians (:meth:`noise_of`: its
        newest ``verify_steps`` steps against the plan's): on a host whose steps spread by a third
        (an H100's MoE at 20% after a routing change), a reaction promising 24% measured 14%
        slower on five steps each way, was reverted, and the run stayed on the old routing's
        placement at 1.29x the reference's step; or, although the model promised a gain of at
        least ``revert_fraction`` and of the steps' noise (:attr:`step_noise`), no clear gain: a
        measured gain of at most ``realised_noise_z`` x the noise (and ``realised_min_share`` of
        the promise; the default 0: no gain at all). A promise that far off is the model being
        wrong about this workload, not noise (the dense GPT at 30%: a 30% promise measured 1-4%
        slower, kept by the 5% band alone). Judged over its first ``verify_steps`` and ``again``
        over all its steps (:meth:`_judge_again`).

        A trial is first kept only if measured faster (it promised nothing). Judged ``again``, it
        is a measured placement like any other: reverted only when slower beyond the noise. On
        an H100's GPT at 30% a trial confirmed faster (A/B/A: 712 against 716 ms) measured 743 ms
        over its 17 steps, within the steps' noise, and its revert moved 27% of the budget back."""
        s = self.settings
        before = check.before_s
        if check.trial and not again:  # kept if faster: it promised nothing
            if measured_s >= before:
                return f"a trial, not faster ({describe_mode(check.mode) if check.mode else 'its engine mode'})"
            return None
        slower_by = max(s.revert_fraction, self.noise_of(self._verify_steps, measured_steps) or 0.0)
        if measured_s > before * (1 + slower_by):
            return f"slower by more than {slower_by:.0%}" + ("" if slower_by == s.revert_fraction else " (the noise)")
        noise = self.step_noise or 0.0
        promised = max(s.revert_fraction, noise) * before
        gain = before - measured_s
        clear = min(s.realised_noise_z * noise * before, s.realised_min_share * check.model_gain_s)
        if not check.trial and check.model_gain_s >= promised and gain <= clear:
            within = f" (at most {clear * 1e3:.1f}: within the noise)" if clear > 0 else ""
            return (f"no clear gain: {gain * 1e3:.1f} ms/step measured{within}, "
                    f"{check.model_gain_s * 1e3:.1f} ms/step promised")
        return None

    def _trial_steps(self, steps: list[float]) -> list[float] | None:
        """The steps of the trial being measured (``steps``, all of them since it landed) that it is
        judged on now, or None to measure it on (:attr:`ControllerSettings.trial_verify_steps`):
        its first ``verify_steps`` when the newest ones drifted from them by ``drift_fraction``
        (the accesses changed under it: a routing change would judge the trial on the new
        routing against a placement measured on the old); all of them once it measured clearly
        faster or slower than the placement before it (by more than :attr:`step_noise`, all
        taken when that is unknown yet) or ``trial_verify_steps`` were measured."""
        s = self.settings
        first = steps[:self._verify_steps]
        later = steps[self._verify_steps:][-s.drift_steps:]
        if len(later) >= s.drift_steps:
            level = statistics.median(first)
            if abs(statistics.median(later) - level) > s.drift_fraction * level:
                return first
        if len(steps) >= s.trial_verify_steps:
            return steps
        before = self._verify.before_s
        noise = self.step_noise
        if noise is not None and abs(statistics.median(steps) - before) > noise * before:
            return steps
        return None

    def _judge_again(self, engine, step: int) -> list[Move] | None:
        """A kept plan, judged once more when the next plan is due, over every step of its
        placement so far (at most ``window_steps``, at least twice ``verify_steps``): a few lucky
        steps right after it landed are not its measure (the dense GPT at 50%: a plan measured a
        little faster than the 5 steps before it, then ran 9% slower than ``max_in_cpu`` for the
        rest of the run, and its moves were held against undoing). Reverted by the same test
        (:meth:`_failed_by`); its entry in :attr:`verified` takes the longer median either way."""
        check, entry = self._rejudge
        steps = self._placement_s[-1][-self.settings.window_steps:]
        if len(steps) < 2 * self._verify_steps:
            return None  # not enough yet: the next due plan judges it
        self._rejudge = None
        measured = statistics.median(steps)
        entry["measured_s"] = measured
        failed = self._failed_by(check, measured, len(steps), again=True)
        entry["kept"] = not failed
        if not failed:
            return None
        return self._revert(engine, step, check, measured, f"over {len(steps)} steps: {failed}") or []

    def _needs_confirm(self, check: "_Check", measured_s: float) -> bool:
        """Whether a trial that measured ``measured_s``, faster than the placement before it, is
        to be confirmed by measuring that placement again (:attr:`ControllerSettings.trial_confirm_z`):
        its gain is less than ``trial_confirm_z`` x the step noise (or the noise is unknown)."""
        z = self.settings.trial_confirm_z
        if z is None or check.before_s <= 0:
            return False
        noise = self.step_noise
        return noise is None or (check.before_s - measured_s) / check.before_s < z * noise

    def _start_confirm(self, engine, step: int, check: "_Check", entry: dict, trial_s: float,
                       steps: int) -> list[Move] | None:
        """Go back to the placement before a trial to measure it again (A/B/A); recorded as a plan
        of its own (adopted, trigger "confirm"), its moves counted as ping-pong. None (nothing to
        move back) when the trial's placement is that placement."""
        current = homes_of(engine.placement)
        moves = diff_moves(current, check.before)
        if not moves:
            return None
        self._confirm = _Confirm(check, entry, trial_s, current, max(steps, self._verify_steps))
        entry["kept"] = None  # not judged yet
        why = (f"a trial measured {trial_s * 1e3:.1f} ms/step against {check.before_s * 1e3:.1f} before it, "
               f"within {self.settings.trial_confirm_z:g}x the step noise: the placement before it is "
               f"measured again ({self._confirm.steps} steps) and the trial kept only if faster than that too")
        self._record_move_plan(engine, step, check.before, predicted_s=check.before_s,
                               gain_s=trial_s - check.before_s, why=why, moves=moves, trigger="confirm")
        self.policy.pingpong_total += len(moves)
        self._measure_again(check)
        self._target = check.before
        return moves

    def _end_confirm(self, engine, step: int) -> list[Move] | None:
        """Once the placement before a trial has been measured again: keep the trial (moved to
        once more) if it measured faster than both measurements of that placement, else stay."""
        confirm = self._confirm
        if len(self._recent_s) < confirm.steps:
            return None
        self._confirm = None
        again_s = statistics.median(list(self._recent_s)[-confirm.steps:])
        check, entry = confirm.check, confirm.entry
        entry["again_s"] = again_s
        entry["kept"] = confirm.trial_s < again_s
        self._sample_detail(False)
        if not entry["kept"]:
            self._predicted_step_s = again_s
            why = (f"the placement before the trial of step {check.step} measured {again_s * 1e3:.1f} ms/step again "
                   f"({check.before_s * 1e3:.1f} before it), the trial {confirm.trial_s * 1e3:.1f}: not faster, "
                   f"the placement stays")
            log.info("zinf planner: step %d: %s", step, why)
            self.plans_made += 1
            self.recorder.record_plan(
                self.plans_made, _assignments(engine.placement, {}), policy="adaptive", created_step=step,
                dram_budget_bytes=self.dram_budget_bytes, predicted_step_s=again_s, predicted_gain_s=0.0,
                adopted=False, reason={"adopt": False, "why": why, "moves": 0, "trigger": "confirm",
                                       "measured_step_s": again_s, "trial_step_s": confirm.trial_s})
            return None
        moves = diff_moves(homes_of(engine.placement), confirm.trial_placement)
        why = (f"the trial of step {check.step} measured {confirm.trial_s * 1e3:.1f} ms/step, faster than the "
               f"placement before it both before ({check.before_s * 1e3:.1f}) and after it ({again_s * 1e3:.1f}): "
               f"taken again")
        self._predicted_step_s = confirm.trial_s
        # judged once more over all its steps at the next plan, against the newer measure
        self._rejudge = (replace(check, before_s=again_s, before=homes_of(engine.placement)), entry)
        if not moves:
            return None
        self._record_move_plan(engine, step, confirm.trial_placement, predicted_s=confirm.trial_s,
                               gain_s=again_s - confirm.trial_s, why=why, moves=moves, trigger="confirm")
        self._target = confirm.trial_placement
        return moves

    def _measure_again(self, check: "_Check") -> None:
        """Back to the placement before ``check`` (a revert, a trial's confirmation): its measured
        step is the prediction again, no plan is left to judge again, the shard detail of every
        step is recorded, and the quiet re-plans are counted afresh."""
        self._predicted_step_s = check.before_s
        self._rejudge = None
        self._sample_detail(False)
        self._quiet_plans = 0

    def _record_move_plan(self, engine, step: int, target: dict, *, predicted_s: float, gain_s: float, why: str,
                          moves: list[Move], trigger: str, **reason) -> None:
        """Record (and log) a plan the controller adopts without solving one - a revert, a trial's
        confirmation - with ``reason``'s extra fields. The engine's plan version moves on."""
        self.plans_made += 1
        self.recorder.record_plan(
            self.plans_made, _assignments(engine.placement, target), policy="adaptive", created_step=step,
            dram_budget_bytes=self.dram_budget_bytes, predicted_step_s=predicted_s, predicted_gain_s=gain_s,
            adopted=True, reason={"adopt": True, "why": why, "moves": len(moves), "trigger": trigger, **reason})
        log.info("zinf planner: step %d plan %d: %s", step, self.plans_made, why)
        engine.plan_version += 1
        self._last_plan_step = step

    def _revert(self, engine, step: int, check: "_Check", measured_s: float, failed: str = "") -> list[Move] | None:
        """Go back to the placement a plan replaced: it measured ``measured_s`` against
        ``check.before_s`` before it (the model was wrong about this workload). Recorded as a plan
        of its own (adopted, trigger "revert"); its moves count as ping-pong."""
        moves = diff_moves(homes_of(engine.placement), check.before)
        why = (f"plan of step {check.step} measured {measured_s * 1e3:.1f} ms/step against {check.before_s * 1e3:.1f} "
               f"before it (predicted {check.predicted_s * 1e3:.1f}; {failed}): reverted")
        # the same model would err again on accesses like these: blocked until they change (a
        # trial is not: what its mode measured is now the model's, mode_offset_s)
        self._failed = None if check.trial else check
        if not check.trial and self._explore_until is not None and step < self._explore_until:
            # a plan that was no trial took the exploring periods to be measured and reverted:
            # they start again here (the first plan reverted left no trial on the H100's GPT at 30%)
            self._explore_until = step + self.settings.trial_periods * self.settings.replan_every
        self._measure_again(check)
        if not moves:
            return None
        self.plans_reverted += 1
        self.policy.pingpong_total += len(moves)
        self._record_move_plan(engine, step, check.before, predicted_s=check.before_s, gain_s=measured_s - check.before_s,
                               why=why, moves=moves, trigger="revert", measured_step_s=measured_s,
                               before_step_s=check.before_s, predicted_step_s=check.predicted_s)
        self._target = check.before
        return moves

    def _best_plan(self, engine, workload: Workload, cost, trial_ok: bool = False,
                   move_s_per_byte: float | None = None) -> tuple[Plan, Simulator]:
        """The fastest predicted plan over a few ways of splitting the budget between homes and
        the engine's overlap buffers.

        ``workload`` carries the buffers the config asks for. The engine grants buffers from
        what the homes leave of the budget (writes in flight first, then the optimizer
        read-ahead, the updates during backward, the prefetch window), so the room left for hot
        homes is a choice: keep room for every kind of overlap (with a prefetch window of a useful
        size, max(2 x largest param, 10% of all params), or the configured one); give up the
        updates during backward, the prefetch, the read-ahead, or everything - which is what
        DeepSpeed-style ``max_in_cpu`` ends up doing when its params take the budget, and which
        pays when param reads dominate (accumulation). Each split is solved by the MILP (cheap);
        then every plan is simulated again with the buffers the engine would really grant it
        (:meth:`Engine.overlap_of`), and the fastest is kept; the greedy (re-simulating) refines
        that split, and the faster of the two plans wins. Every movable home on NVMe, which no
        split proposes, is weighed too, with the buffers the engine would grant it.

        With ``trial_ok`` (and ``trial_band``), a winner in an engine mode that never ran is
        marked ``plan.trial``; when the winner's mode has run but another split's plan is in a
        mode that never ran and predicted within ``trial_band`` of the winner's step, that plan
        is returned instead, marked ``plan.trial``: the model cannot tell the two apart, as its
        calibration of that mode is borrowed. ``move_s_per_byte``: what a migration costs per byte
        copied (:meth:`_move_cost`, which the caller has fitted already; fitted here if None).
        """
        need = engine.dram_need
        shards = workload.shards
        param_bytes = shards["param_bytes"]
        # the largest optimizer group (master, moments, gradient) that a plan could put on NVMe
        trainable = shards["trainable"].to_numpy(bool)
        group = int((shards["optim_bytes"] + shards["grad_bytes"])[trainable].max()) if trainable.any() else 0
        wanted_prefetch = int(workload.prefetch_bytes)
        useful_prefetch = min(wanted_prefetch, max(2 * int(param_bytes.max()), int(param_bytes.sum()) // 10))
        eager_ok = bool(workload.updates_during_backward)
        fixed = need.working_bytes + need.staging_bytes
        # label: (prefetch window, updates during backward, write-behind, read-ahead)
        options = {
            "every overlap, useful prefetch": (useful_prefetch, eager_ok, True, True),
            "every overlap, configured prefetch": (wanted_prefetch, eager_ok, True, True),
            "no updates in backward": (useful_prefetch, False, True, True),
            "no prefetch": (0, eager_ok, True, True),
            "write-behind and read-ahead only": (0, False, True, True),
            "no overlap buffers": (0, False, False, False),
        }
        best: tuple[Plan, Workload, int, Workload, int] | None = None
        by_mode: dict[Mode, tuple[Plan, Workload]] = {}  # the fastest predicted plan of each engine mode
        tried: set[tuple] = set()
        for label, (prefetch, eager, keep_write, keep_read) in options.items():
            key = (prefetch, eager, keep_write, keep_read)
            if key in tried:
                continue
            tried.add(key)
            buffers = prefetch + (3 * group if eager else 0) + (2 * group if keep_write else 0) + (group if keep_read else 0)
            wl = workload.with_buffers(prefetch_bytes=prefetch, write_bytes=2 * group if keep_write else 0,
                                       read_ahead_bytes=group if keep_read else 0, eager=eager)
            plan, reserved = self._solve_with_working_set(engine, wl, cost, fixed, buffers)
            if plan is None:
                continue  # this split leaves no room at all
            plan.note = f"{plan.note}; buffers: {label}".lstrip("; ")
            granted = self._as_granted(engine, workload, plan, cost)
            if plan.mode not in by_mode or plan.prediction.step_s < by_mode[plan.mode][0].prediction.step_s:
                by_mode[plan.mode] = (plan, granted)
            if best is None or plan.prediction.step_s < best[0].prediction.step_s:
                best = (plan, wl, reserved, granted, buffers)
        if best is None:
            raise _BudgetFull("no split of zinf.dram_budget between homes and buffers leaves room for another plan")
        # Every movable home on NVMe: the engine grants that placement the most buffers, more than
        # any split above reserves for them (a split's room goes to a home or two instead). On an
        # H100 the GPT at 30% ran all-NVMe with updates during backward at 0.445 s, while the best
        # split's plan in that mode, with one param in DRAM and a smaller window, was put at 0.58 s.
        all_nvme = workload.all_nvme_placement()
        nvme = replace(best[0], placement=all_nvme, note="every movable home on NVMe", dram_bytes=workload.dram_bytes(all_nvme))
        nvme_granted = self._as_granted(engine, workload, nvme, cost)
        if nvme.mode not in by_mode or nvme.prediction.step_s < by_mode[nvme.mode][0].prediction.step_s:
            by_mode[nvme.mode] = (nvme, nvme_granted)
        plan, wl, reserved, granted, buffers = best
        # the greedy re-simulates every home on small models; above PLAN_RESIMULATE_HOMES it takes
        # the solver's fast path (a bounded number of simulations): planning runs between steps
        greedy = solve(wl, cost, self.dram_budget_bytes, reserved_bytes=reserved, prefetch_bytes=wl.prefetch_bytes,
                       method="greedy", resimulate_max_homes=PLAN_RESIMULATE_HOMES)
        greedy.note = plan.note
        greedy_granted = self._as_granted(engine, workload, greedy, cost)
        if greedy.prediction.step_s < plan.prediction.step_s:
            plan, granted = greedy, greedy_granted
        # The plans above ignore what moving costs. Solved again with every home's move charged
        # (its migration seconds spread over the horizon), the MILP keeps homes of nearly equal
        # worth where they are - the accesses of a few tokens a step reorder them from period to
        # period - and moves only what pays back. Whichever plan is cheaper counting its moves wins.
        if move_s_per_byte is None:
            move_s_per_byte = self._move_cost(cost)[1]
        per_byte = move_s_per_byte / max(1, self.settings.replan_every * self.settings.horizon_plans)
        current = homes_of(engine.placement)
        try:
            sticky = solve(wl, cost, self.dram_budget_bytes, reserved_bytes=reserved, prefetch_bytes=wl.prefetch_bytes,
                           method="milp", milp_rel_gap=PLAN_MILP_GAP, incumbent=current, switch_s_per_byte=per_byte)
        except PlanError:
            sticky = None
        shards = workload.shards.set_index("shard")

        def with_moves_s(p: Plan) -> float:
            moved = sum(int(shards.at[m.shard, f"{m.state}_bytes"]) for m in diff_moves(current, p.homes()))
            return p.prediction.step_s + per_byte * moved

        if sticky is not None and engine.dram_need_of(sticky.placement).total_bytes + buffers <= self.dram_budget_bytes:
            sticky.note = f"{plan.note}; moves charged".lstrip("; ")
            sticky_granted = self._as_granted(engine, workload, sticky, cost)
            if with_moves_s(sticky) < with_moves_s(plan):
                plan, granted = sticky, sticky_granted
        if with_moves_s(nvme) < with_moves_s(plan):
            plan, granted = nvme, nvme_granted
        plan.trial = False
        band = self.settings.trial_band
        untried = [pg for mode, pg in by_mode.items() if mode not in self.mode_offset_s]
        if trial_ok and band > 0 and plan.mode not in self.mode_offset_s:
            plan.trial = True  # the fastest plan itself is in a mode that never ran: tried
            plan.note = f"{plan.note}; a trial of the untried engine mode {describe_mode(plan.mode)}".lstrip("; ")
        elif trial_ok and band > 0 and untried:  # (the winner's mode has run)
            alt, alt_granted = min(untried, key=lambda pg: pg[0].prediction.step_s)
            if alt.prediction.step_s <= plan.prediction.step_s + band * float(workload.measured_step_s):
                alt.trial = True
                alt.note = f"{alt.note}; a trial of the untried engine mode {describe_mode(alt.mode)}".lstrip("; ")
                plan, granted = alt, alt_granted
        return plan, Simulator(granted, cost, prefetch_bytes=granted.prefetch_bytes)

    def _move_cost(self, cost) -> tuple[float, float]:
        """What a migration costs: ``(seconds per move, seconds per byte copied)``.

        Fitted (non-negative least squares) to this engine's recent migrations, which measure
        both parts: a move costs more than its disk I/O (verification read-back, buffer
        re-sizing, the drain before it), and a move whose NVMe copy is current copies nothing.
        One more row anchors the per-byte part at the cost model's read plus write of
        ``MOVE_COST_PRIOR_MIB`` (a move to NVMe writes and reads back to verify), so that a single
        migration, or several of the same shape, split their time by it: a migration of 126
        moves that copied 2.4 MB in 89 ms, read as seconds per byte alone, priced the next plan's
        78 MB at 3 s (the skewed MoE at 20%). Without migrations: the cost model's per byte only.
        Where the cost model has no NVMe cost (a run that never read its disk), the migrations'
        seconds are read as per byte alone.
        """
        mib = 1 << 20
        measured = self.migrations_measured
        try:
            prior_per_mib = float(cost.predict_s("nvme", "read", mib) + cost.predict_s("nvme", "write", mib))
        except CostModelError:
            if not measured:
                raise
            copied = sum(nbytes for _, nbytes, _ in measured)
            return 0.0, sum(sec for _, _, sec in measured) / max(1, copied)
        if not measured:
            return 0.0, prior_per_mib / mib
        rows = [[moves, nbytes / mib] for moves, nbytes, _ in measured]
        seconds = [sec for _, _, sec in measured]
        # (weighted a tenth: it splits what the migrations leave open, not what they measure)
        rows.append([0.0, 0.1 * MOVE_COST_PRIOR_MIB])
        seconds.append(0.1 * MOVE_COST_PRIOR_MIB * prior_per_mib)
        (s_per_move, s_per_mib), _ = nnls(np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float))
        return float(s_per_move), float(s_per_mib) / mib

    def _note_mode(self, mode: Mode, residual_s: float) -> None:
        """The mode in force at a plan and its residual: the first mode is the offsets' origin; a
        mode that arrived unmeasured (a plan adopted without verification) is placed against the
        mode of the plan before."""
        if mode not in self.mode_offset_s:
            before = self._mode_now  # (its mode is in the offsets: noted here first)
            self.mode_offset_s[mode] = 0.0 if before is None else self.mode_offset_s[before[0]] + residual_s - before[1]
        self._mode_now = (mode, residual_s)

    def _as_granted(self, engine, workload: Workload, plan: Plan, cost) -> Workload:
        """Re-predict ``plan`` with the buffers the engine would grant it (the solver assumed the
        split's) and the calibration residual of that engine mode (:meth:`_granted`); sets
        ``plan.prediction`` and ``plan.mode`` and returns the workload with those buffers."""
        granted = self._granted(engine, workload, plan.placement)
        plan.mode = mode_of(granted)
        plan.prediction = Simulator(granted, cost, prefetch_bytes=granted.prefetch_bytes).predict(plan.placement)
        return granted

    def _granted(self, engine, workload: Workload, placement: dict) -> Workload:
        """``workload`` with the overlap buffers the engine would grant ``placement`` and the
        calibration residual of that engine mode: ``workload``'s (the mode in force's) plus the
        mode's offset from it where the mode has run (:attr:`mode_offset_s`)."""
        ov = engine.overlap_of(placement)
        granted = workload.with_buffers(prefetch_bytes=ov.prefetch_bytes, write_bytes=ov.write_bytes,
                                        read_ahead_bytes=ov.read_ahead_bytes, eager=ov.eager)
        mode, offsets, now = mode_of(granted), self.mode_offset_s, self._mode_now
        if now is not None and mode != now[0] and mode in offsets:
            granted = granted.with_overhead(float(workload.overhead_s) + offsets[mode] - offsets[now[0]])
        return granted

    def _solve_with_working_set(self, engine, wl: Workload, cost, fixed: int, buffers: int):
        """MILP plan with ``buffers`` bytes of overlap buffers, its room corrected by the working
        set the engine would have with the plan (it grows when params move to NVMe, shrinks once
        they are resident): a plan over the budget by the engine's own count is solved again with
        the shortfall reserved too; one under it, with the smaller working set. Returns
        ``(plan, reserved_bytes)`` of the last plan that fits, or ``(None, 0)`` when this split
        leaves no room."""
        staging = engine.dram_need.staging_bytes
        reserved = fixed + buffers
        plan, used_reserved = None, 0
        for _ in range(4):
            try:
                candidate = solve(wl, cost, self.dram_budget_bytes, reserved_bytes=reserved,
                                  prefetch_bytes=wl.prefetch_bytes, method="milp", milp_rel_gap=PLAN_MILP_GAP)
            except PlanError:
                break
            need = engine.dram_need_of(candidate.placement)
            over = need.total_bytes + buffers - self.dram_budget_bytes
            if over > 0:  # the working set assumed was too small for this plan
                reserved += over
                continue
            plan, used_reserved = candidate, reserved
            refined = need.working_bytes + staging + buffers
            if refined >= reserved or plan is not None and refined == used_reserved:
                break
            reserved = refined
        return (plan, used_reserved) if plan is not None else (None, 0)

    def _drop_refused(self, report, placement: dict[Home, str]) -> None:
        """The moves of the plan being applied that the engine refused (over its DRAM budget by
        its count, a move that failed) in a migration that made no other move leave the target:
        the home stays where it is, and the plan lands without them. Asked again, the engine
        would refuse again, and the plan would never land (nor be measured, nor another one
        made). While other moves land, a refused one is asked again: what it needed may be freed
        by the moves after it (evicting a param whose optimizer home stays in DRAM grows the
        working set until that home follows it)."""
        if report is None or not report.refused or self._target is None or report.done or report.deferred:
            return
        dropped = [(m, why) for m, why in report.refused if self._target.get((m.shard, m.state)) == m.dst]
        for m, _ in dropped:
            self._target[(m.shard, m.state)] = placement[(m.shard, m.state)]
        if dropped:
            log.warning("zinf planner: the engine refused %d move(s) of the plan being applied (%s); it lands without them",
                        len(dropped), dropped[0][1])

    def _learn_migration_cost(self, report) -> None:
        """Keep a new migration report in :attr:`migrations_measured` (the last
        ``MOVE_COST_MIGRATIONS``), which :meth:`_move_cost` fits."""
        if report is None or report is self._seen_report:
            return
        self._seen_report = report
        if not report.done or report.seconds <= 0:
            return
        self.migrations_measured.append((len(report.done), int(report.bytes_moved), float(report.seconds)))
        del self.migrations_measured[:-MOVE_COST_MIGRATIONS]

    def _split_drifted(self) -> None:
        """The steps that drifted from the prediction start a regime of their own in the step-noise
        bookkeeping (:attr:`step_noise` measures each step about its own segment's median): after
        a routing change, steps before and after it about one median made the MoE's noise 25-28%
        of the step, and that gate blocked every plan for the new routing for 40 steps."""
        self._split_newest(self.settings.drift_steps)

    def _split_at_shift(self, rates_from_before: int, step: int) -> None:
        """After a plan that found the accesses shifted (it moved :attr:`_rates_from_step` on), the
        steps since the shift start a segment of their own in the step-noise bookkeeping, as after
        a drift (:meth:`_split_drifted`), which a shift need not come with: on an H100's MoE at 30%
        the placement's steps before and after a routing change, about one median, made the noise
        26-29% of the step after the reaction (14% before the change), and that gate held back
        every refinement of the reaction (12-14% promised) for the rest of the run, at 1.17x the
        reference's step. Called in the training process, which keeps the measured steps."""
        if self._rates_from_step > rates_from_before:
            self._split_newest(step - self._rates_from_step)

    def _split_newest(self, n: int) -> None:
        """The newest ``n`` steps of the placement in force become a segment of their own."""
        steps = self._placement_s[-1]
        if 0 < n < len(steps):
            self._placement_s[-1] = steps[:-n]
            self._placement_s.append(steps[-n:])

    def _drifted(self) -> bool:
        """The placement has landed and its measured median step is far from the prediction."""
        s = self.settings
        if self._predicted_step_s is None or len(self._recent_s) < s.drift_steps:
            return False
        measured = statistics.median(list(self._recent_s)[-s.drift_steps:])
        return abs(measured - self._predicted_step_s) > s.drift_fraction * self._predicted_step_s

    def _skip(self, why: str) -> None:
        self.last_skip = why
        if why not in self._warned:
            self._warned.add(why)
            log.warning("zinf planner: no plan this period: %s", why)
