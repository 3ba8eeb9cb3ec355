"""What if the DRAM budget were B? The predicted step time of a profiled run at any DRAM budget.

The planner's model of a run is built once from its profile - the :class:`~planner.workload.Workload`
(shards, accesses, compute and update seconds, engine settings), the
:class:`~planner.costmodel.CostModel` fitted from its I/O samples (or ``zinf bench-io``
calibrations), and the simulator calibrated on the step time the run measured - and then the
placement is solved (:func:`planner.solver.solve`) at each budget asked for. That is what the
adaptive controller does between steps, without the engine at hand:

* **What the budget pays for besides homes.** The engine needs a working set (params in use at
  once, the optimizer group being updated) and the NVMe store's staging buffers whatever the
  placement (:attr:`WhatIf.base_bytes`: :func:`engine_minimum_bytes`, ``Engine._dram_need`` at
  the all-NVMe placement - the most any placement needs), and grants the overlap buffers the
  config asks for (prefetch window, write-behind, optimizer read-ahead, updates during
  backward) from what the homes leave; what does not fit is switched off. So, as the controller
  does, each budget is solved for a few ways of sharing it (:meth:`Buffers.splits`: every buffer;
  a smaller prefetch window; no updates during backward; no prefetch; write-behind and
  read-ahead only; no overlap buffers) by the MILP of the linear model, the fastest predicted
  split refined by the greedy (which re-simulates), and the faster plan kept. A budget below the
  working set, the staging buffers and the pinned DRAM homes (:attr:`WhatIf.min_budget_bytes`)
  is refused by the engine at ``initialize``: here it is infeasible (``what_if``) or an error
  (``plan_for_budget``).
* **Calibration.** The simulator's residual (``overhead_s``, the same for every placement) is
  fitted on the run's measured placement with the buffers the engine granted it: all it asked
  for without ``zinf.dram_budget``; under a budget, granted in the engine's order from what the
  homes, working set and staging left.
* **Speed-up** is against the all-NVMe placement with the config's buffers (what DeepSpeed's
  ``"device": "nvme"`` gives), at every budget.

:func:`what_if` returns one row per budget (the columns of :data:`WHAT_IF_COLUMNS`);
:func:`plan_for_budget` the placement at one budget (``zinf plan`` writes it with
:func:`write_plan`). Both build the model from the database on every call; a caller asking for
many budgets over time (the dashboard's slider) keeps a :class:`WhatIf` and calls its
:meth:`WhatIf.table` / :meth:`WhatIf.plan` (which keeps the plans it made). On the 2-core dev
VM: building takes ~0.1 s for the tiny GPT of the tests (20 shards) and ~0.45 s for a 3 x 32-expert
MoE (193 shards), each budget ~0.05 s and ~0.13 s (the default 9 budgets: 0.4 s and 1.1 s).

Units: bytes (``_bytes``), seconds (``_s``); ``budget_fraction`` is the budget over the run's
model state (params, gradients, master weights and optimizer moments: ``runs.model.state_bytes``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from zinf.config import Config, ConfigError, load_config, parse_size
from zinf.placement import fmt_bytes
from zinf.planfile import plan_document

from profiler import queries
from profiler.export import ExportError, _atomic_write_file, check_out
from profiler.store import describe_url

from planner.costmodel import CostModel
from planner.simulator import calibrate, simulate
from planner.solver import Plan, PlanError, solve
from planner.workload import Workload

__all__ = [
    "WHAT_IF_COLUMNS",
    "MIN_STEPS",
    "WhatIf",
    "WhatIfError",
    "BudgetPlan",
    "Buffers",
    "engine_minimum_bytes",
    "what_if",
    "plan_for_budget",
    "parse_budget",
    "write_plan",
]

WHAT_IF_COLUMNS = ["dram_budget_bytes", "budget_fraction", "predicted_step_s", "speedup", "dram_used_bytes", "feasible"]
"""The columns of :func:`what_if`'s frame, in order (the dashboard codes against them)."""

MIN_STEPS = 3
"""Recorded optimizer steps a run needs to be planned from: the first records the prefetch trace
(and is left out), the others give the medians."""

DEFAULT_BUDGETS = 8
"""Budgets from the minimum to the all-DRAM endpoint in the default what-if (plus the all-NVMe one)."""

RESIMULATE_MAX_HOMES = 128
"""Above this many movable homes the greedy takes the solver's fast path (as the controller does)."""

MILP_GAP = 1e-4
"""Relative optimality gap of the MILP solves (the linear model is itself approximate)."""

Progress = Callable[[int, int, str], None]  # (done, total, what comes next)


class WhatIfError(PlanError):
    """A run cannot be planned from (too few steps, no per-shard accesses) or a budget is below
    what the engine needs."""


# ------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Split:
    """One way of sharing a budget between homes and the engine's overlap buffers."""

    name: str
    """"every overlap buffer" or "no overlap buffers"."""
    workload: Workload
    """The calibrated workload with these buffers."""
    reserved_bytes: int
    """DRAM the homes cannot use: working set + staging + these buffers."""


@dataclass
class BudgetPlan:
    """The placement the planner chooses at one DRAM budget, and what it predicts."""

    run_id: int
    dram_budget_bytes: int
    placement: dict[str, dict[str, str]]
    """{shard: {"param": tier, "optim": tier}}, the engine's form."""
    predicted_step_s: float
    """The simulated step of :attr:`placement` (calibrated on the run's measured step)."""
    all_nvme_step_s: float
    """The simulated step of the all-NVMe placement with the config's buffers (the reference)."""
    home_dram_bytes: int
    """DRAM of the homes in DRAM (param + optimizer homes, pinned ones included)."""
    dram_used_bytes: int
    """DRAM the engine would use: the homes + working set + staging + the buffers reserved."""
    buffers: str
    """Which split won: "every overlap buffer" or "no overlap buffers"."""
    plan: Plan = field(repr=False)
    """The solver's plan (scores, timings, note)."""

    @property
    def speedup(self) -> float:
        """All-NVMe predicted step / this plan's (> 1: faster than all-NVMe)."""
        return self.all_nvme_step_s / self.predicted_step_s if self.predicted_step_s > 0 else math.nan

    @property
    def homes_in_dram(self) -> tuple[int, int]:
        """(homes in DRAM - or on the compute device, where pinned there - and homes in all; a
        frozen shard has one home)."""
        tiers = [t for p in self.placement.values() for t in p.values() if t != "none"]
        return sum(t in ("cpu", "gpu") for t in tiers), len(tiers)

    def to_document(self, created_at: str | None = None) -> dict[str, Any]:
        """The plan file's JSON object (:func:`zinf.planfile.plan_document`)."""
        created_at = created_at or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return plan_document(run_id=self.run_id, dram_budget_bytes=self.dram_budget_bytes,
                             predicted_step_s=self.predicted_step_s, placement=self.placement, created_at=created_at)


# ------------------------------------------------------------------------------ the model of a run
@dataclass
class WhatIf:
    """A profiled run as the planner sees it, built once (:meth:`from_profile`), to be planned
    at any number of DRAM budgets (:meth:`plan`, :meth:`table`)."""

    run_id: int
    info: dict[str, Any]
    """``profiler.queries.run_info`` of the run (config, model, hardware, ...)."""
    config: Config
    """The run's config."""
    cost_model: CostModel
    splits: list[Split]
    """Ways to share a budget between homes and overlap buffers; the first has every buffer."""
    base_bytes: int
    """Working set + staging buffers the engine needs at the all-NVMe placement (an upper bound)."""
    pinned_bytes: int
    """DRAM of the homes pinned to DRAM (``module_parameters``)."""
    all_dram_home_bytes: int
    """DRAM of every home in DRAM."""
    state_bytes: int
    """The model state: params + gradients + master weights + optimizer moments (bytes)."""
    all_nvme_step_s: float
    """Predicted step of the all-NVMe placement with the config's buffers (the speed-up's reference)."""
    build_s: float = 0.0
    """Wall seconds :meth:`from_profile` took (queries, cost-model fit, calibration)."""
    notes: list[str] = field(default_factory=list)
    """How the numbers were made, where a reader should know (buffers assumed, calibration)."""
    _plans: dict[int, BudgetPlan] = field(default_factory=dict, repr=False)
    """Plans made so far, by budget (a budget asked for again is not solved again)."""

    @property
    def workload(self) -> Workload:
        """The calibrated workload with the buffers the config asks for."""
        return self.splits[0].workload

    @property
    def min_budget_bytes(self) -> int:
        """The smallest budget the engine accepts: working set, staging and pinned DRAM homes."""
        return self.base_bytes + self.pinned_bytes

    @property
    def all_nvme_budget_bytes(self) -> int:
        """The budget of the all-NVMe endpoint: the minimum plus every overlap buffer the config asks for."""
        return self.splits[0].reserved_bytes + self.pinned_bytes

    @property
    def all_dram_budget_bytes(self) -> int:
        """The budget of the all-DRAM endpoint: every home in DRAM beside the working set and
        staging (with nothing on NVMe no overlap buffer is needed)."""
        return self.base_bytes + self.all_dram_home_bytes

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_profile(cls, src, run_id: int | None = None) -> "WhatIf":
        """Build from the profile database ``src`` (an SQLAlchemy URL): run ``run_id``, or the
        newest run. Raises :class:`WhatIfError` for a run that cannot be planned from,
        ``CostModelError`` when the run has too few I/O samples and no calibrations,
        ``ProfileError`` for an unknown run id or an unreadable database (all ZinfErrors)."""
        t0 = time.perf_counter()
        shown = describe_url(src) if isinstance(src, str) else str(src)
        if run_id is None:
            run_id = queries.latest_run_id(src)
            if run_id is None:
                raise WhatIfError(f"no run is recorded in {shown}; train with the profiler on "
                                  f"(\"zinf\": {{\"profiler\": {{\"enabled\": true}}}}) first")
        info = queries.run_info(src, run_id)  # ProfileError for an unknown id, listing the known ones
        cfg = load_config(info["config"])
        if info["steps"] < MIN_STEPS:
            raise WhatIfError(f"run {run_id} has {info['steps']} recorded optimizer step(s); planning needs at least "
                              f"{MIN_STEPS} (the first records the prefetch trace and is left out): train more steps "
                              f"with the profiler on")
        if cfg.zinf.profiler.detail != "shard":
            raise WhatIfError(f"run {run_id} was recorded with zinf.profiler.detail {cfg.zinf.profiler.detail!r}, "
                              f"without per-shard accesses; record a run with detail 'shard' to plan from it")
        wl = Workload.from_profile(src, run_id)
        cost = CostModel.from_db(src, run_id)

        # What the budget pays for besides homes (see the module docstring).
        staging = int(cfg.zinf.staging_buffers * cfg.zinf.staging_buffer_size)
        base = engine_minimum_bytes(wl, queries.shards(src, run_id), staging)
        wanted = Buffers.wanted(wl)
        notes = []
        budget = cfg.zinf.dram_budget
        granted = wanted if budget is None else Buffers.granted(wl, wl.measured_placement, budget, base, wanted)
        if granted != wanted:
            notes.append(f"calibrated with the overlap buffers the engine could grant under the run's budget "
                         f"({granted.describe()}), not all the config asks for ({wanted.describe()})")
        overhead_s = calibrate(granted.apply(wl), cost, placement=wl.measured_placement).overhead_s
        splits = [Split(name, buffers.apply(wl).with_overhead(overhead_s), base + buffers.total_bytes)
                  for name, buffers in Buffers.splits(wl, wanted).items()]
        df = wl.shards
        all_nvme = wl.all_nvme_placement()
        state = int((df["param_bytes"] + df["optim_bytes"] + df["grad_bytes"]).sum())
        return cls(
            run_id=int(run_id), info=info, config=cfg, cost_model=cost, splits=splits, base_bytes=int(base),
            pinned_bytes=wl.dram_bytes(all_nvme), all_dram_home_bytes=wl.dram_bytes(wl.all_dram_placement()),
            state_bytes=state, all_nvme_step_s=simulate(splits[0].workload, all_nvme, cost).step_s,
            build_s=time.perf_counter() - t0, notes=notes,
        )

    # -- asking --------------------------------------------------------------------------
    def default_budgets(self, n: int = DEFAULT_BUDGETS) -> list[int]:
        """``n`` budgets evenly spaced from the minimum to the all-DRAM endpoint (both included),
        and the all-NVMe endpoint when it lies between; sorted, without repeats."""
        lo, hi = self.min_budget_bytes, max(self.min_budget_bytes, self.all_dram_budget_bytes)
        points = {int(round(x)) for x in np.linspace(lo, hi, max(2, n))}
        if self.all_nvme_budget_bytes < hi:
            points.add(self.all_nvme_budget_bytes)
        return sorted(points)

    def plan(self, dram_budget_bytes: int) -> BudgetPlan:
        """The placement at ``dram_budget_bytes``: solved with every overlap buffer reserved and
        with none, the faster predicted kept. Raises :class:`WhatIfError` below
        :attr:`min_budget_bytes`."""
        budget = int(dram_budget_bytes)
        if budget < self.min_budget_bytes:
            raise WhatIfError(
                f"a DRAM budget of {fmt_bytes(budget)} is below the {fmt_bytes(self.min_budget_bytes)} the engine needs "
                f"for run {self.run_id} (working set and staging {fmt_bytes(self.base_bytes)}, pinned DRAM homes "
                f"{fmt_bytes(self.pinned_bytes)}); plan with at least {self.min_budget_bytes} bytes")
        if budget in self._plans:
            return self._plans[budget]
        # Every split that leaves room for the pinned homes, by the MILP of the linear model
        # (cheap); the fastest predicted is refined by the greedy, which re-simulates (as the
        # adaptive controller plans). The first split (every buffer) wins ties.
        candidates = [(split, solve(split.workload, self.cost_model, budget, reserved_bytes=split.reserved_bytes,
                                    method="milp", milp_rel_gap=MILP_GAP))
                      for split in self.splits if budget - split.reserved_bytes >= self.pinned_bytes]
        best = min(candidates, key=lambda c: c[1].prediction.step_s)  # the last split always fits the minimum
        split = best[0]
        greedy = solve(split.workload, self.cost_model, budget, reserved_bytes=split.reserved_bytes,
                       method="greedy", resimulate_max_homes=RESIMULATE_MAX_HOMES)
        if greedy.prediction.step_s < best[1].prediction.step_s:
            best = (split, greedy)
        split, plan = best
        result = BudgetPlan(run_id=self.run_id, dram_budget_bytes=budget, placement=plan.placement,
                            predicted_step_s=float(plan.prediction.step_s), all_nvme_step_s=float(self.all_nvme_step_s),
                            home_dram_bytes=int(plan.dram_bytes), dram_used_bytes=int(plan.dram_bytes + plan.reserved_bytes),
                            buffers=split.name, plan=plan)
        self._plans[budget] = result
        return result

    def table(self, budgets_bytes: Sequence[int] | None = None, *, progress: Progress | None = None) -> pd.DataFrame:
        """One row per budget (default :meth:`default_budgets`), columns :data:`WHAT_IF_COLUMNS`;
        a budget below :attr:`min_budget_bytes` is a row with ``feasible`` False and NaN numbers."""
        budgets = self.default_budgets() if budgets_bytes is None else [int(b) for b in budgets_bytes]
        rows = []
        for i, budget in enumerate(budgets):
            if progress is not None:
                progress(i, len(budgets), f"planning at {fmt_bytes(budget)}")
            row = {"dram_budget_bytes": budget, "budget_fraction": budget / self.state_bytes if self.state_bytes else math.nan,
                   "predicted_step_s": math.nan, "speedup": math.nan, "dram_used_bytes": math.nan, "feasible": False}
            if budget >= self.min_budget_bytes:
                p = self.plan(budget)
                row.update(predicted_step_s=p.predicted_step_s, speedup=p.speedup, dram_used_bytes=float(p.dram_used_bytes),
                           feasible=True)
            rows.append(row)
        if progress is not None:
            progress(len(budgets), len(budgets), "done")
        df = pd.DataFrame(rows, columns=WHAT_IF_COLUMNS)
        return df.astype({"dram_budget_bytes": "int64", "budget_fraction": "float64", "predicted_step_s": "float64",
                          "speedup": "float64", "dram_used_bytes": "float64", "feasible": "bool"})

    def parse_budget(self, text: str | int) -> int:
        """A budget as the CLI takes it: a size ("2GiB", "512MiB", bytes) or a percentage of the
        run's model state ("30%"). See :func:`parse_budget`."""
        return parse_budget(text, self.state_bytes)


@dataclass(frozen=True)
class Buffers:
    """Overlap buffers (bytes), as :class:`zinf.sizing.Overlap` has them: the parameter prefetch
    window, NVMe writes in flight, one optimizer group read ahead, the groups held by updates
    during backward."""

    prefetch_bytes: int = 0
    write_bytes: int = 0
    read_ahead_bytes: int = 0
    eager_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.prefetch_bytes + self.write_bytes + self.read_ahead_bytes + self.eager_bytes

    def describe(self) -> str:
        parts = [f"{k} {fmt_bytes(v)}" for k, v in (("prefetch", self.prefetch_bytes), ("write-behind", self.write_bytes),
                                                    ("read-ahead", self.read_ahead_bytes),
                                                    ("updates in backward", self.eager_bytes)) if v]
        return ", ".join(parts) or "none"

    def apply(self, wl: Workload) -> Workload:
        """A copy of ``wl`` whose engine has these buffers."""
        return wl.with_buffers(prefetch_bytes=self.prefetch_bytes, write_bytes=self.write_bytes,
                               read_ahead_bytes=self.read_ahead_bytes, eager=self.eager_bytes > 0)

    @classmethod
    def none(cls) -> "Buffers":
        return cls()

    @classmethod
    def wanted(cls, wl: Workload) -> "Buffers":
        """What the config asks for at the all-NVMe placement (``Engine._size_overlap``'s wishes),
        the prefetch window at most the bytes of every param that can be on NVMe (a larger
        window holds nothing more)."""
        group = _largest_group_bytes(wl)
        nvme = np.array([t["param"] == "nvme" for t in wl.all_nvme_placement().values()], bool)
        params = int(wl.shards["param_bytes"].to_numpy(np.int64)[nvme].sum())
        return cls(prefetch_bytes=min(int(wl.prefetch_bytes), params), write_bytes=wl.effective_write_window_bytes(),
                   read_ahead_bytes=group if wl.pipeline_read else 0,
                   eager_bytes=3 * group if wl.updates_during_backward else 0)

    @classmethod
    def splits(cls, wl: Workload, wanted: "Buffers") -> dict[str, "Buffers"]:
        """The ways of sharing a budget that the adaptive controller weighs (``_best_plan``): every
        buffer wanted; a prefetch window of a useful size (max(2 x the largest param, 10% of all
        params)); no updates during backward; no prefetch; write-behind and read-ahead only; no
        overlap buffers at all. Name -> buffers, repeats left out, every buffer first."""
        param = wl.shards["param_bytes"].to_numpy(np.int64)
        useful = min(wanted.prefetch_bytes, max(2 * int(param.max(initial=0)), int(param.sum()) // 10))
        options = {
            "every overlap buffer": wanted,
            "every overlap buffer, a smaller prefetch window": replace(wanted, prefetch_bytes=useful),
            "no updates during backward": replace(wanted, prefetch_bytes=useful, eager_bytes=0),
            "no prefetch": replace(wanted, prefetch_bytes=0),
            "write-behind and read-ahead only": replace(wanted, prefetch_bytes=0, eager_bytes=0),
            "no overlap buffers": cls.none(),
        }
        out: dict[str, Buffers] = {}
        for name, buffers in options.items():
            if buffers not in out.values():
                out[name] = buffers
        return out

    @classmethod
    def granted(cls, wl: Workload, placement, budget: int, base: int, wanted: "Buffers") -> "Buffers":
        """What the engine grants under ``budget`` with ``placement``, in its order (write-behind,
        read-ahead, updates during backward: all or nothing each; the prefetch window: what is
        left, if it holds the largest NVMe param)."""
        left = budget - wl.dram_bytes(placement) - base

        def grant(want: int) -> int:
            nonlocal left
            got = want if want <= left else 0
            left -= got
            return got

        write, read, eager = grant(wanted.write_bytes), grant(wanted.read_ahead_bytes), grant(wanted.eager_bytes)
        nvme = np.array([placement[n]["param"] == "nvme" for n in wl.names], bool)
        largest = int(wl.shards["param_bytes"].to_numpy(np.int64)[nvme].max()) if nvme.any() else 0
        prefetch = max(0, min(wanted.prefetch_bytes, left))
        return cls(prefetch_bytes=prefetch if prefetch >= largest else 0, write_bytes=write, read_ahead_bytes=read,
                   eager_bytes=eager)


def _largest_group_bytes(wl: Workload) -> int:
    """Bytes of the largest optimizer group with its gradient (master, moments, grad)."""
    df = wl.shards
    trainable = df["trainable"].to_numpy(bool)
    return int((df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64)[trainable].max()) if trainable.any() else 0


def engine_minimum_bytes(wl: Workload, shards: pd.DataFrame, staging_bytes: int) -> int:
    """What the engine needs besides homes and overlap buffers at the all-NVMe placement (pins
    kept): its working set and the NVMe store's staging buffers, as ``Engine._dram_need`` counts
    them. It is the most any placement needs (every term shrinks as homes move to DRAM), and the
    smallest ``zinf.dram_budget`` the engine accepts with the pinned homes added.

    ``shards``: ``profiler.queries.shards`` of the run (its ``members`` name the modules that own
    each shard). The working set: the optimizer group being updated (master, moments and the
    gradient twice), the gradients of packed chunks (they wait for the end of backward), and on a
    CPU device the params materialised at once - every module's own shards and its ancestors'
    (the worst chain), one more module's own, and the chunks, held for a whole pass.
    """
    place = wl.all_nvme_placement()
    df = wl.shards
    names = df["shard"].tolist()
    param = dict(zip(names, df["param_bytes"].astype(int)))
    group = dict(zip(names, (df["optim_bytes"] + df["grad_bytes"]).astype(int)))
    grad = dict(zip(names, df["grad_bytes"].astype(int)))
    chunk = dict(zip(names, df["chunk"].astype(bool)))
    cpu_device = wl.device == "cpu"

    def fetched(name: str) -> int:  # a param not resident on the compute device is fetched at each use
        tier = place[name]["param"]
        return 0 if tier == "gpu" or (cpu_device and tier == "cpu") else param[name]

    owned: dict[str, set[str]] = {}  # module -> the shards of its own parameters
    for name, members in zip(shards["name"], shards["members"]):
        for fqn in members or ():
            owned.setdefault(str(fqn).rpartition(".")[0], set()).add(name)

    def chain(module: str) -> set[str]:  # the module's shards and its ancestors'
        parts = module.split(".") if module else []
        out: set[str] = set()
        for depth in range(len(parts) + 1):
            out |= owned.get(".".join(parts[:depth]), set())
        return out

    worst = max((sum(fetched(n) for n in chain(m)) for m in owned), default=0)
    largest = max((sum(fetched(n) for n in own) for own in owned.values()), default=0)
    live = worst + largest + sum(param[n] for n in names if chunk[n] and place[n]["param"] == "nvme")
    on_nvme = [n for n in names if place[n]["optim"] == "nvme"]
    working = (live if cpu_device else 0) + max((group[n] + grad[n] for n in on_nvme), default=0) + sum(
        grad[n] for n in on_nvme if chunk[n])
    anything_on_nvme = any(t["param"] == "nvme" or t["optim"] == "nvme" for t in place.values())
    return int(working + (staging_bytes if anything_on_nvme else 0))


# ------------------------------------------------------------------------------ the API
def what_if(src, run_id: int | None = None, budgets_bytes: list[int] | None = None, *,
            progress: Progress | None = None) -> pd.DataFrame:
    """The predicted step time of run ``run_id`` (default: the newest) of the profile database
    ``src`` at each DRAM budget in ``budgets_bytes`` (default: ~9 budgets from the smallest the
    engine accepts through the all-NVMe endpoint up to the all-DRAM one): columns
    ``dram_budget_bytes`` (int), ``budget_fraction`` (budget / model state), ``predicted_step_s``,
    ``speedup`` (all-NVMe predicted step / this one), ``dram_used_bytes`` (what the engine would
    use of the budget), ``feasible`` (False below the minimum; the numbers are NaN there).
    ``progress(done, total, label)`` is called before each budget."""
    return WhatIf.from_profile(src, run_id).table(budgets_bytes, progress=progress)


def plan_for_budget(src, run_id: int | None, budget_bytes: int) -> BudgetPlan:
    """The placement of run ``run_id`` (None: the newest) at ``budget_bytes`` of DRAM, with its
    predicted step (what ``zinf plan`` writes). Raises :class:`WhatIfError` below the minimum."""
    return WhatIf.from_profile(src, run_id).plan(budget_bytes)


def parse_budget(text: str | int, state_bytes: int) -> int:
    """``"2GiB"``, ``"512MiB"``, ``1073741824`` -> bytes; ``"30%"`` -> 30% of ``state_bytes``.
    Raises :class:`ConfigError` (one line) otherwise."""
    if isinstance(text, str) and text.strip().endswith("%"):
        number = text.strip()[:-1].strip()
        try:
            pct = float(number)
        except ValueError:
            pct = math.nan
        if not math.isfinite(pct) or pct <= 0:
            raise ConfigError(f"--dram-budget {text!r}: a percentage must be a positive number, e.g. 30%")
        return int(state_bytes * pct / 100)
    try:
        return parse_size(text)
    except ConfigError as e:
        raise ConfigError(f"--dram-budget: {e}, or a percentage of the model state such as 30%") from None


def write_plan(plan: BudgetPlan, out: str | Path, *, force: bool = False, created_at: str | None = None) -> Path:
    """Write ``plan`` as a plan file (``zinf.planfile`` format) to ``out``, atomically (temporary
    file, fsync, rename); an existing file is replaced only with ``force``. Returns the path."""
    if Path(out).expanduser().is_dir():
        raise ExportError(f"--out {str(out)!r} is a directory; give the plan file's name, such as plan.json")
    path = check_out(out, directory=False, force=force)
    text = json.dumps(plan.to_document(created_at), indent=2, allow_nan=False) + "\n"
    _atomic_write_file(path, lambda f: f.write(text), binary=False)
    return path
