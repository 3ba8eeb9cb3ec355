"""Choose which homes live in DRAM under a DRAM budget: a greedy with re-simulation, or an exact MILP.

A *home* is ``(shard, state)`` with state "param" (the working copy) or "optim" (fp32 master +
moments + gradient accumulator). Every movable home is either in DRAM ("cpu") or on NVMe; pinned
homes (the workload's ``pin_param``/``pin_optim``, plus ``fixed``) stay where they are pinned, and
frozen shards have no optimizer home. The homes' DRAM bytes are counted as the engine counts them
(:func:`planner.workload.home_dram_bytes`) and must fit ``room = dram_budget_bytes -
reserved_bytes``, ``reserved_bytes`` (default ``workload.reserved_dram_bytes``) being what the
engine needs besides the homes (working set, staging buffers, the overlap it wants).

**Greedy** (``method="greedy"``, the default), in two stages on problems of up to
``resimulate_max_homes`` movable homes:

1. *Density pass.* Start from every movable home on NVMe; repeatedly put in DRAM the home with the
   highest *simulated* step seconds saved per DRAM byte that still fits, re-simulating after every
   move. Candidates are evaluated lazily (CELF): each sits in a heap under its last known gain per
   byte - at first an optimistic bound (its disk seconds per step and fetch overhead, per byte) -
   and only the top of the heap is re-simulated; a candidate whose fresh gain still beats every
   other key is taken. Homes that do not fit are skipped, so smaller ones fill the room a big one
   could not use. The pass stops when the best fresh gain is not positive (DRAM that saves nothing
   is left free: fewer migrations) or nothing fits.
2. *Exchange search* (``exchange=True``). A density greedy can lose up to one home's value: it
   fills the room with dense small homes and then has no room for a big valuable one. So, for
   each of the most valuable homes left on NVMe that does not fit, the search makes room by
   evicting DRAM homes (the least valuable per byte first; or the single least valuable home that
   frees enough alone), refills the rest of the room by density, and estimates the net gain from
   the homes' known values (their simulated gains; the linear stall where never simulated). The
   best few exchanges are simulated; the first that makes the step faster is taken, the density
   pass refills what room is left, and the search repeats until no exchange helps.

``max_evaluations`` caps the simulations (default ``8 x movable homes + 100``); past it the
remaining room is filled by the keys as they stand, and ``Plan.note`` says so. ``greedy_batch`` > 1
takes that many homes per round of the density pass: the best fresh candidates, simulated against
the same placement (interactions among them ignored).

**Fast path** (more than ``resimulate_max_homes`` movable homes). One simulation costs time in
proportion to the shards, so a greedy that simulates every home is quadratic (~10 s on 1000
shards). Above the threshold the greedy sorts the homes once by linear stall saved per byte
(:func:`planner.hotness.stall_cost`), fills the room in that order (skipping what does not fit),
and spends at most ``max_evaluations`` simulations (default: as many as ~20 000 shard-simulations,
at least the plan's own prediction) on a golden-section search of how far down that order to go:
where the linear model misjudges overlap, taking fewer homes can be faster.

**MILP** (``method="milp"``). The linearised model of :func:`planner.hotness.stall_cost`: each
state on NVMe costs its own stall seconds, independently of the others. Binary variables choose,
per shard, one combination of its homes' tiers (one-hot), so that the aliasing rule (fp32 on the
CPU with both homes in DRAM shares one copy) is exact; minimise the total stall of the homes left
on NVMe subject to the DRAM room. Solved by ``scipy.optimize.milp`` (HiGHS). It is exact for the
linear model, and the tests use it as the oracle for small instances; its plan is then simulated
like the greedy's.

Greedy vs optimum: in the synchronous regime (no I/O overlaps compute) the simulator is additive,
the MILP's plan is the simulator's optimum, and the greedy (density pass + exchange search) is
within 1% of it on every one of 200 random small instances (``tests/test_solver.py``; the density
pass alone misses 1% on a third of them). With overlap the model is not additive, which is why the
greedy re-simulates instead of trusting the linear scores.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pandas as pd

from zinf.errors import ZinfError

from planner.hotness import stall_cost
from planner.simulator import O_DRAM, O_NONE, O_NVME, P_COPY, P_NVME, P_RESIDENT, Prediction, Simulator
from planner.workload import Workload, WorkloadError, home_dram_bytes

__all__ = ["Plan", "PlanError", "solve", "STATES"]

STATES = ("param", "optim")

_EXCHANGE_WANTED = 16
"""Exchange search: homes on NVMe (the most valuable that do not fit) it tries to make room for."""
_EXCHANGE_TRIES = 4
"""Exchange search: the best estimated exchanges simulated per round before it gives up."""
_COVER_STARTS = 12
"""Exchange search: first evictions tried for each home it makes room for (see ``_covers``)."""
_STR = pd.Series(["home"]).dtype
"""The dtype pandas gives text (what a DataFrame makes of a column of Python strings)."""
_FAST_SIM_BUDGET_SHARDS = 20_000
"""Fast path: default simulations = this / shards (at least 1, at most 16); ~0.05 s of simulator
time on the dev VM up to 10^4 shards, and from 10^5 the plan's own simulation only (~0.4 s)."""


class PlanError(ZinfError):
    """No placement can satisfy the budget and the pins (or the input is unusable)."""


@dataclass
class Plan:
    """A placement chosen under a DRAM budget, with its prediction and why."""

    placement: dict[str, dict[str, str]]
    """{shard: {"param": tier, "optim": tier}}, the engine's form."""
    prediction: Prediction
    """The simulated step of :attr:`placement`."""
    dram_bytes: int
    """DRAM bytes of the homes (param + optimizer homes), as the engine counts them."""
    room_bytes: int
    """What the homes were allowed: ``budget_bytes - reserved_bytes``."""
    budget_bytes: int
    reserved_bytes: int
    scores: pd.DataFrame
    """One row per home: ``shard, state, tier, movable, bytes`` (DRAM bytes of the home alone),
    ``saved_s`` (linear stall saved per step by DRAM), ``saved_s_per_byte``, ``sim_saved_s`` (the
    simulated gain when the greedy took it or last evaluated it; NaN if never), ``chosen``."""
    method: str
    objective_s: float
    """MILP: the linear stall of the homes left on NVMe; greedy: the simulated step."""
    evaluations: int = 0
    """Simulations run."""
    solve_s: float = 0.0
    """Wall seconds the solver took."""
    note: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    """Wall seconds of the solve by part: ``setup_s`` (simulator, problem), ``stall_cost_s`` (the
    linear scores), ``choose_s`` (the method itself, simulations excluded), ``simulate_s`` (all
    simulations), ``plan_s`` (placement and scores tables)."""

    def homes(self) -> dict[tuple[str, str], str]:
        """{(shard, state): tier} of every shard's param and optimizer home."""
        return homes_of(self.placement)

    def density(self) -> dict[tuple[str, str], float]:
        """{(shard, state): stall seconds saved per DRAM byte} (simulated where known, else linear)."""
        sc = self.scores
        sim = sc["sim_saved_s"].to_numpy(np.float64)
        lin = sc["saved_s"].to_numpy(np.float64)
        b = sc["bytes"].to_numpy(np.float64)
        val = np.where(np.isnan(sim), lin, sim)
        d = np.divide(val, b, out=np.zeros(len(sc)), where=b > 0)
        return {(n, s): float(x) for n, s, x in zip(sc["shard"], sc["state"], d)}

    def home_bytes(self) -> dict[tuple[str, str], int]:
        """{(shard, state): DRAM bytes the home takes in DRAM}."""
        return {(n, s): int(b) for n, s, b in zip(self.scores["shard"], self.scores["state"], self.scores["bytes"])}


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector (during a solve). A solve makes no reference cycles, but
    10^5 small dicts (the placement): every 700 new ones the collector would walk the growing
    placement again, and the simulator's lists of 10^5 numbers (~35 ms for 10^5 shards, for
    nothing). What the solve leaves is walked once, at the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def homes_of(placement: Mapping[str, Mapping[str, str]]) -> dict[tuple[str, str], str]:
    """The engine's {shard: {"param": tier, "optim": tier}} as {(shard, state): tier}."""
    return {(n, s): t[s] for n, t in placement.items() for s in STATES}


@_gc_paused()
def solve(workload: Workload, cost_model, dram_budget_bytes: int, *, method: str = "greedy",
          prefetch_bytes: int | None = None, fixed: Mapping | None = None, reserved_bytes: int | None = None,
          max_evaluations: int | None = None, greedy_batch: int | None = None, milp_time_limit_s: float = 30.0,
          milp_rel_gap: float = 1e-9, exchange: bool = True, resimulate_max_homes: float = 512,
          incumbent: Mapping | None = None, switch_s_per_byte: float = 0.0, **simulate_kwargs: Any) -> Plan:
    """The placement of ``workload``'s homes that minimises the predicted step under the budget.

    ``dram_budget_bytes``: the DRAM budget (``zinf.dram_budget``); the homes get it minus
    ``reserved_bytes`` (default ``workload.reserved_dram_bytes``; pass 0 to give the homes the
    whole budget). ``method``: "greedy" or "milp". ``prefetch_bytes`` and ``simulate_kwargs``:
    passed to the simulator (see :func:`planner.simulator.simulate`). ``fixed``: extra pins,
    ``{shard: {"param": tier, "optim": tier}}`` (either key may be left out) or ``{(shard,
    state): tier}``. ``max_evaluations``: cap on the greedy's simulations (default ``8 x movable
    homes + 100``; on the fast path ~20 000 / shards). ``greedy_batch``: homes the density pass may
    take per round of re-simulation (default 1). ``exchange``: run the exchange search after the
    density pass. ``resimulate_max_homes``: above this many movable homes the greedy takes its
    fast path (one sort, a bounded number of simulations; see the module docstring).
    ``milp_time_limit_s`` / ``milp_rel_gap``: HiGHS's time limit and relative optimality gap (the
    default gap makes the MILP the exact oracle the tests need; HiGHS's own 1e-4 stops earlier
    with a plan up to 0.01% worse, which matters from ~10^4 shards, where 1e-9 can reach the
    time limit).
    ``incumbent`` and ``switch_s_per_byte`` (MILP only): the placement in force (the forms of
    ``fixed``), and the seconds per step that moving one byte of a home costs (a migration's
    seconds spread over the steps it has to pay back in); the MILP then charges every home whose
    tier differs from the incumbent's its bytes x ``switch_s_per_byte``, so it moves a home only
    where that pays, and homes of nearly equal worth stay where they are. The plan's objective
    and prediction leave that charge out.
    Raises :class:`PlanError` when the pinned DRAM homes alone exceed the room.
    """
    t0 = time.perf_counter()
    if method not in ("greedy", "milp"):
        raise PlanError(f"method must be 'greedy' or 'milp', got {method!r}")
    wl = workload
    reserved = int(wl.reserved_dram_bytes if reserved_bytes is None else reserved_bytes)
    room = int(dram_budget_bytes) - reserved
    sim = Simulator(wl, cost_model, prefetch_bytes=prefetch_bytes, **simulate_kwargs)
    prob = _Problem(wl, sim, fixed)
    base_bytes = prob.dram_bytes(prob.tp0, prob.to0)
    if base_bytes > room:
        raise PlanError(
            f"the pinned DRAM homes need {base_bytes} bytes but the room for homes is {room} bytes "
            f"(DRAM budget {int(dram_budget_bytes)} - {reserved} reserved for the working set, staging and overlap); "
            f"raise zinf.dram_budget or pin fewer homes to 'cpu'")
    t1 = time.perf_counter()
    lin = stall_cost(wl, sim.io, prefetch_bytes=sim.prefetch_bytes)
    t2 = time.perf_counter()
    prediction: Prediction | None = None  # the greedy returns the simulation of its plan; the MILP does not
    sim_saved: dict[tuple[int, str], float] = {}
    if incumbent is not None and method != "milp":
        raise PlanError("incumbent and switch_s_per_byte are for method='milp'")
    if method == "milp":
        switch = None
        if incumbent is not None and switch_s_per_byte > 0:
            cur_p, cur_o, _, _ = _start_tiers(wl, incumbent)
            switch = (cur_p, cur_o, float(switch_s_per_byte))
        tp, to, objective, sim_saved, evals, note = _milp(prob, lin, room, milp_time_limit_s, milp_rel_gap, switch)
    elif prob.n_homes > resimulate_max_homes:
        tp, to, prediction, evals, note = _fast_greedy(prob, lin, room, max_evaluations)
    else:
        tp, to, prediction, sim_saved, evals, note = _greedy(prob, lin, room, max_evaluations, greedy_batch, exchange)
    if prediction is None:
        prediction = prob.run(tp, to)
        evals += 1
    t3 = time.perf_counter()
    used = int(home_dram_bytes(wl, tp, to).sum())  # the workload's own count, not the solver's
    if used > room:  # the solvers never exceed the room; this guards the bookkeeping
        raise PlanError(f"internal error: the {method} plan needs {used} bytes of DRAM for homes, room {room}")
    placement, scores = prob.placement(tp, to), prob.scores(lin, tp, to, sim_saved)
    t4 = time.perf_counter()
    timings = {"setup_s": t1 - t0, "stall_cost_s": t2 - t1, "choose_s": t3 - t2 - prob.simulate_s,
               "simulate_s": prob.simulate_s, "plan_s": t4 - t3}
    return Plan(placement=placement, prediction=prediction, dram_bytes=used, room_bytes=int(room),
                budget_bytes=int(dram_budget_bytes), reserved_bytes=reserved, scores=scores, method=method,
                objective_s=float(prediction.step_s if method == "greedy" else objective),
                evaluations=evals, solve_s=t4 - t0, note=note, timings=timings)


# ------------------------------------------------------------------------------ the problem
class _Problem:
    """The homes' tiers (one string per shard and state, in shard order), what may move, and their
    DRAM bytes. Tier lists ``tp`` (param) and ``to`` (optim) are what the solvers pass around."""

    def __init__(self, wl: Workload, sim: Simulator, fixed: Mapping | None):
        self.wl, self.sim = wl, sim
        self.simulate_s = 0.0  # wall seconds spent in simulations (see Plan.timings)
        df = wl.shards
        self.names = sim.names
        self.n = len(self.names)
        trainable = df["trainable"].to_numpy(bool)
        self.trainable = trainable.tolist()
        tp, to, fixed_p, fixed_o = _start_tiers(wl, fixed)
        movable_p = df["pin_param"].isna().to_numpy() & ~fixed_p & np.isin(np.array(tp, dtype=object), ("cpu", "nvme"))
        movable_o = (trainable & df["pin_optim"].isna().to_numpy() & ~fixed_o
                     & np.isin(np.array(to, dtype=object), ("cpu", "nvme")))
        self.movable = {"param": movable_p.tolist(), "optim": movable_o.tolist()}
        self._movable_p, self._movable_o = movable_p, movable_o
        # movable homes start on NVMe (the greedy's starting point; the MILP chooses freely)
        self.tp0 = np.where(movable_p, "nvme", np.array(tp, dtype=object)).tolist()
        self.to0 = np.where(movable_o, "nvme", np.array(to, dtype=object)).tolist()
        # the candidates of the greedy: every movable home, params first, by index `c` (as
        # arrays; the list of (shard, state) is :attr:`homes`)
        param_homes, optim_homes = np.flatnonzero(movable_p), np.flatnonzero(movable_o)
        self.home_shard = np.concatenate([param_homes, optim_homes]).astype(np.int64)
        self.home_is_optim = np.arange(len(self.home_shard)) >= len(param_homes)
        self.n_homes = len(self.home_shard)
        self._P = df["param_bytes"].to_numpy(np.int64)
        self._OG = (df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64)
        self._trainable = trainable
        self.dram = wl.dram_tiers
        self.alias = bool(wl.aliases_master)
        self.cpu_device = wl.device == "cpu"

    @functools.cached_property
    def homes(self) -> list[tuple[int, str]]:
        """The candidates as ``(shard, state)`` (built on first use: the fast path does without)."""
        return [(i, "optim" if o else "param") for i, o in zip(self.home_shard.tolist(), self.home_is_optim.tolist())]

    @functools.cached_property
    def index(self) -> dict[tuple[int, str], int]:
        """{home: candidate index} (built on first use: the fast path does without)."""
        return {h: c for c, h in enumerate(self.homes)}

    # ---- bytes
    @functools.cached_property
    def P(self) -> list[int]:
        return self._P.tolist()

    @functools.cached_property
    def OG(self) -> list[int]:
        return self._OG.tolist()

    def shard_bytes(self, i: int, ptier: str, otier: str) -> int:
        """DRAM bytes of shard i's homes at these tiers (``home_dram_bytes`` for one shard)."""
        p_in, o_in = ptier in self.dram, otier in self.dram
        aliased = self.alias and p_in and o_in and self.trainable[i]
        return (self.P[i] if p_in and not aliased else 0) + (self.OG[i] if o_in and self.trainable[i] else 0)

    @functools.cached_property
    def in_dram0(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`in_dram` of the starting tiers (param, optim); copy before changing them."""
        return self.in_dram(self.tp0), self.in_dram(self.to0)

    def in_dram(self, tiers) -> np.ndarray:
        """Per shard: is this tier list's home in a DRAM tier (elementwise ``==``: 5 ms on 10^5)."""
        t = np.asarray(tiers, dtype=object)
        out = np.zeros(self.n, bool)
        for tier in self.dram:
            out |= t == tier
        return out

    def bytes_of(self, p_in: np.ndarray, o_in: np.ndarray) -> np.ndarray:
        """DRAM bytes per shard with its param home in DRAM where ``p_in`` and its optimizer home
        where ``o_in``: :func:`~planner.workload.home_dram_bytes` on arrays prepared once (that
        function reads the shard table at every call, ~0.3 ms; the exchange search counts often)."""
        o_in = o_in & self._trainable
        aliased = p_in & o_in if self.alias else np.zeros(self.n, bool)
        return np.where(p_in & ~aliased, self._P, 0) + np.where(o_in, self._OG, 0)

    def dram_bytes(self, tp, to) -> int:
        """DRAM bytes of all homes."""
        return int(self.bytes_of(self.in_dram(tp), self.in_dram(to)).sum())

    def added_bytes(self, tp, to) -> np.ndarray:
        """Per candidate home: the DRAM bytes moving it (alone) to DRAM adds to ``(tp, to)``."""
        return self.added_bytes_at(self.in_dram(tp), self.in_dram(to))

    def added_bytes_at(self, p_in: np.ndarray, o_in: np.ndarray) -> np.ndarray:
        """:meth:`added_bytes` with the homes in DRAM given per shard (see :meth:`bytes_of`)."""
        base = self.bytes_of(p_in, o_in)
        everywhere = np.ones(self.n, bool)
        add_param, add_optim = self.bytes_of(everywhere, o_in) - base, self.bytes_of(p_in, everywhere) - base
        return np.where(self.home_is_optim, add_optim[self.home_shard], add_param[self.home_shard])

    def marginal_bytes(self, i: int, state: str, tp, to) -> int:
        """DRAM bytes added by moving home (i, state) to DRAM."""
        return self.delta_bytes(i, state, "cpu", tp, to)

    def delta_bytes(self, i: int, state: str, tier: str, tp, to) -> int:
        """DRAM bytes added (negative: freed) by moving home (i, state) to ``tier``."""
        now = self.shard_bytes(i, tp[i], to[i])
        if state == "param":
            return self.shard_bytes(i, tier, to[i]) - now
        return self.shard_bytes(i, tp[i], tier) - now

    # ---- tiers
    @staticmethod
    def tier(tp, to, i: int, state: str) -> str:
        return tp[i] if state == "param" else to[i]

    @staticmethod
    def put(tp, to, i: int, state: str, tier: str = "cpu") -> None:
        """Move home (i, state) to ``tier`` in place."""
        (tp if state == "param" else to)[i] = tier

    @staticmethod
    def moved(tp, to, i: int, state: str):
        """Copies of the tier lists with home (i, state) in DRAM."""
        tp2, to2 = list(tp), list(to)
        (tp2 if state == "param" else to2)[i] = "cpu"
        return tp2, to2

    def partner(self, i: int, state: str) -> tuple[int, str]:
        return (i, "optim" if state == "param" else "param")

    def codes(self, tp, to) -> tuple[np.ndarray, np.ndarray]:
        """Tiers to the simulator's codes (elementwise on arrays: 10^5 shards)."""
        tp, to = np.asarray(tp, dtype=object), np.asarray(to, dtype=object)
        resident = (tp == "gpu") | self.cpu_device
        pc = np.where(tp == "nvme", P_NVME, np.where(resident, P_RESIDENT, P_COPY))
        oc = np.where(to == "nvme", O_NVME, np.where(to == "none", O_NONE, O_DRAM))
        return pc, oc

    def moved_many(self, tp, to, cands: np.ndarray, tier: str = "cpu"):
        """Copies of the tier lists with the homes ``cands`` (candidate indices) at ``tier``."""
        tp2, to2 = np.array(tp, dtype=object), np.array(to, dtype=object)
        shard, is_optim = self.home_shard[cands], self.home_is_optim[cands]
        tp2[shard[~is_optim]] = tier
        to2[shard[is_optim]] = tier
        return tp2.tolist(), to2.tolist()

    def run(self, tp, to) -> Prediction:
        t0 = time.perf_counter()
        out = self.sim.run(*self.codes(tp, to))
        self.simulate_s += time.perf_counter() - t0
        return out

    def placement(self, tp, to) -> dict[str, dict[str, str]]:
        return {n: {"param": p, "optim": o} for n, p, o in zip(self.names, tp, to)}

    def _names_column(self):
        col = self.wl.shards["shard"]
        return col.array if col.dtype == _STR else pd.array(self.names, dtype=_STR)

    def scores(self, lin: pd.DataFrame, tp, to, sim_saved: Mapping[tuple[int, str], float]) -> pd.DataFrame:
        """One row per home (shard order, param before optim), built column-wise (a dict per row
        cost ~0.5 s on 10^5 shards), the text columns as pandas strings already (inferring them
        from Python objects cost ~30 ms)."""
        rows = 1 + self._trainable  # per shard: its param home, and its optimizer home when trainable
        shard = np.repeat(np.arange(self.n), rows)
        first = np.cumsum(rows) - rows  # each shard's param row
        is_optim = np.zeros(len(shard), bool)
        is_optim[first[self._trainable] + 1] = True

        def per_row(param: np.ndarray, optim: np.ndarray) -> np.ndarray:
            return np.where(is_optim, optim[shard], param[shard])

        nbytes = per_row(lin["param_dram_bytes"].to_numpy(np.int64), lin["optim_dram_bytes"].to_numpy(np.int64))
        saved = per_row(lin["param_stall_s"].to_numpy(np.float64), lin["optim_stall_s"].to_numpy(np.float64))
        tp, to = np.asarray(tp, dtype=object), np.asarray(to, dtype=object)
        sim = np.full(len(shard), math.nan)
        for (i, s), v in sim_saved.items():
            sim[first[i] + (s == "optim")] = v
        return pd.DataFrame({
            "shard": self._names_column().take(shard),
            "state": pd.array(["param", "optim"], dtype=_STR).take(is_optim.astype(np.intp)),
            "tier": pd.array(per_row(tp, to), dtype=_STR),
            "movable": per_row(self._movable_p, self._movable_o), "bytes": nbytes, "saved_s": saved,
            "saved_s_per_byte": np.divide(saved, nbytes, out=np.zeros(len(shard)), where=nbytes > 0),
            "sim_saved_s": sim, "chosen": per_row(self.in_dram(tp), self.in_dram(to)),
        })


def _start_tiers(wl: Workload, fixed: Mapping | None):
    """Tiers before solving - every home on NVMe but the workload's pins and the ``fixed`` ones -
    and which homes ``fixed`` names. ``fixed`` takes the forms of
    :func:`planner.workload.normalize_placement` (here without a dict per shard: 10^5 shards)."""
    df = wl.shards
    trainable = df["trainable"].tolist()
    tp = [p or "nvme" for p in df["pin_param"].tolist()]
    to = [(o or "nvme") if t else "none" for o, t in zip(df["pin_optim"].tolist(), trainable)]
    fixed_p = np.zeros(len(tp), bool)
    fixed_o = np.zeros(len(tp), bool)
    if fixed:
        index = {name: i for i, name in enumerate(df["shard"].tolist())}
        for key, value in fixed.items():
            name = key[0] if isinstance(key, tuple) else key
            if name not in index:
                raise WorkloadError(f"placement names unknown shard {name!r}")
            if isinstance(key, tuple):
                states = {key[1]: value}
            elif isinstance(value, Mapping):
                states = dict(value)
            else:
                states = dict(zip(STATES, value))
            i = index[name]
            if "param" in states:
                tp[i], fixed_p[i] = states["param"], True
            if "optim" in states:
                fixed_o[i] = True
                if trainable[i]:  # a frozen shard has no optimizer home, whatever it is pinned to
                    to[i] = states["optim"]
    return tp, to, fixed_p, fixed_o


def _linear_value(prob: _Problem, lin: pd.DataFrame) -> list[float]:
    """Stall seconds per step each candidate home saves in DRAM by the linear model."""
    col = {s: lin[f"{s}_stall_s"].to_numpy(np.float64) for s in STATES}
    return [float(col[s][i]) for i, s in prob.homes]


def _optimistic_gain(prob: _Problem, lin: pd.DataFrame) -> list[float]:
    """First CELF keys (seconds per step, per candidate): the disk seconds (and fetch overhead) the
    home costs per step - moving a home cannot save much more than the I/O it removes - or its
    linear stall if larger."""
    fetch_s = prob.wl.fetch_overhead_s
    col = {c: lin[c].to_numpy(np.float64) for c in
           ("param_disk_s", "param_reads_per_step", "optim_disk_s", "param_stall_s", "optim_stall_s")}
    out = []
    for i, s in prob.homes:
        if s == "param":
            bound = col["param_disk_s"][i] + fetch_s * col["param_reads_per_step"][i]
        else:
            bound = col["optim_disk_s"][i]
        out.append(float(max(bound, col[f"{s}_stall_s"][i])))
    return out


# ------------------------------------------------------------------------------ greedy
def _greedy(prob: _Problem, lin: pd.DataFrame, room: int, max_evaluations: int | None, batch: int | None,
            exchange: bool):
    """Density pass, then the exchange search (module docstring). Returns ``(tp, to, prediction,
    sim_saved, evaluations, note)``; ``sim_saved[(i, state)]`` is the last simulated gain of a home
    (seconds per step), against the placement it was evaluated at."""
    tp, to = list(prob.tp0), list(prob.to0)
    pred = prob.run(tp, to)
    evals = 1
    limit = max_evaluations if max_evaluations is not None else 8 * len(prob.homes) + 100
    batch = 1 if batch is None else max(1, int(batch))
    bound = _optimistic_gain(prob, lin)
    sim_saved: dict[tuple[int, str], float] = {}
    tp, to, pred, evals, note = _density_pass(prob, bound, room, tp, to, pred, sim_saved, evals, limit, batch)
    if exchange and not note:
        tp, to, pred, evals, note = _exchange_search(prob, _linear_value(prob, lin), bound, room, tp, to, pred,
                                                     sim_saved, evals, limit, batch)
    return tp, to, pred, sim_saved, evals, note


def _density_pass(prob: _Problem, bound: list[float], room: int, tp, to, pred: Prediction,
                  sim_saved: dict, evals: int, limit: int, batch: int):
    """Move homes from NVMe to DRAM by simulated gain per byte (CELF) from ``(tp, to)``, whose
    simulation is ``pred``, until no home that fits saves time. Returns ``(tp, to, prediction,
    evaluations, note)``; ``note`` is set when ``limit`` stopped the re-simulation."""
    tp, to = list(tp), list(to)
    current = pred.step_s
    used = prob.dram_bytes(tp, to)
    tol = 1e-12 + 1e-9 * current  # seconds: a "gain" below this is rounding
    # heap of (-gain per byte, candidate, version, entry): `version` = the round its gain was
    # simulated in (-1: a bound, never simulated this round); `entry` lets a re-keyed candidate's
    # older entries be skipped
    heap: list[tuple[float, int, int, int]] = []
    entry = [0] * len(prob.homes)
    for c, (i, s) in enumerate(prob.homes):
        if prob.tier(tp, to, i, s) == "nvme":
            heap.append((-bound[c] / max(1, prob.marginal_bytes(i, s, tp, to)), c, -1, 0))
    heapq.heapify(heap)
    version = 0  # bumped at every round of moves: gains of older versions are stale
    fresh: dict[int, Prediction] = {}  # candidate -> simulation with it moved (this version)
    set_aside: list[int] = []  # candidates that did not fit
    taking: list[int] = []  # this round's moves: fresh candidates at the top of the heap
    pending = 0  # their bytes
    while True:
        round_over = not heap
        if heap:
            negkey, c, ver, e = heapq.heappop(heap)
            if e != entry[c]:
                continue  # re-keyed since
            i, s = prob.homes[c]
            b = prob.marginal_bytes(i, s, tp, to)
            if used + pending + b > room:
                set_aside.append(c)
                continue
            if ver == version:  # simulated against this placement and still the best key: take it
                if current - fresh[c].step_s <= tol:
                    if not taking:
                        break  # the best fresh gain saves nothing
                    round_over = True
                else:
                    taking.append(c)
                    pending += b
                    round_over = len(taking) >= batch
            elif evals >= limit:
                heapq.heappush(heap, (negkey, c, ver, e))
                for c2 in taking:
                    prob.put(tp, to, *prob.homes[c2])
                _fill_by_keys(prob, heap, entry, tp, to, used + pending, room)
                note = (f"stopped re-simulating after {evals} evaluations (max_evaluations); "
                        "the rest of the room was filled in the order of the last known gains")
                return tp, to, prob.run(tp, to), evals + 1, note
            else:
                p = prob.run(*prob.moved(tp, to, i, s))
                evals += 1
                sim_saved[(i, s)] = current - p.step_s
                fresh[c] = p
                heapq.heappush(heap, (-(current - p.step_s) / max(1, b), c, version, e))
                continue
        if not round_over:
            continue
        if not taking:
            break
        for c2 in taking:
            prob.put(tp, to, *prob.homes[c2])
        used += pending
        if len(taking) == 1:
            pred = fresh[taking[0]]
        else:
            pred = prob.run(tp, to)
            evals += 1
        current = pred.step_s
        version += 1
        fresh.clear()
        # with aliasing a move changes the bytes of its shard's other home (a param whose master
        # came to DRAM costs nothing more), and the homes set aside may be cheaper now: re-key
        # them so they are evaluated first (their old keys per byte are not bounds any more)
        rekey = set(set_aside)
        for c2 in taking if prob.alias else ():
            h = prob.partner(*prob.homes[c2])
            if h in prob.index and prob.tier(tp, to, *h) == "nvme":
                rekey.add(prob.index[h])
        for c2 in rekey:
            entry[c2] += 1
            heapq.heappush(heap, (-math.inf, c2, -1, entry[c2]))
        set_aside, taking, pending = [], [], 0
    return tp, to, pred, evals, ""


def _fill_by_keys(prob: _Problem, heap, entry, tp, to, used: int, room: int) -> int:
    """Past ``max_evaluations``: the homes left in the heap, by key, wherever they fit (in place)."""
    while heap:
        negkey, c, _, e = heapq.heappop(heap)
        if e != entry[c]:
            continue
        if negkey >= 0:
            break
        i, s = prob.homes[c]
        b = prob.marginal_bytes(i, s, tp, to)
        if used + b <= room:
            prob.put(tp, to, i, s)
            used += b
    return used


def _exchange_search(prob: _Problem, linear: list[float], bound: list[float], room: int, tp, to, pred: Prediction,
                     sim_saved: dict, evals: int, limit: int, batch: int):
    """Take exchanges (evict some DRAM homes, bring in one that did not fit, refill) while a
    simulated one makes the step faster; after each, the density pass refills the room."""
    tried: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()  # placements simulated already
    while evals < limit:
        tol = 1e-12 + 1e-9 * pred.step_s
        value = [sim_saved.get(h, linear[c]) for c, h in enumerate(prob.homes)]
        better = None
        for _, tp2, to2 in _exchanges(prob, value, room, tp, to)[:_EXCHANGE_TRIES]:
            key = (tuple(tp2), tuple(to2))
            if key in tried or evals >= limit:
                continue
            tried.add(key)
            p = prob.run(tp2, to2)
            evals += 1
            if p.step_s < pred.step_s - tol:
                better = (tp2, to2, p)
                break
        if better is None:
            break
        tp, to, pred = better
        tp, to, pred, evals, note = _density_pass(prob, bound, room, tp, to, pred, sim_saved, evals, limit, batch)
        if note:
            return tp, to, pred, evals, note
    return tp, to, pred, evals, ""


def _exchanges(prob: _Problem, value: list[float], room: int, tp, to) -> list[tuple[float, list, list]]:
    """Candidate exchanges from ``(tp, to)``, best estimated net gain first: ``(gain_s, tp2, to2)``.

    An *item* is one home, or - with aliasing, where a shard's two homes in DRAM cost one copy -
    both homes of a shard together. For each of the ``_EXCHANGE_WANTED`` most valuable items on
    NVMe that do not fit, ways to make room: cheap covers of the bytes it needs (:func:`_covers`),
    or the one least valuable item that frees enough alone; then what room is left is filled by
    value per byte. Gains are estimated additively from ``value`` (seconds per step, per
    candidate): exact when the simulator is additive, a ranking to be checked by simulation
    otherwise.
    """
    free = room - prob.dram_bytes(tp, to)
    in_dram = [prob.tier(tp, to, *h) != "nvme" for h in prob.homes]
    singles = [(c,) for c in range(len(prob.homes))]
    pairs = []  # both homes of a shard, when aliasing makes the pair cheaper than its parts
    if prob.alias:
        pairs = [(c, prob.index[prob.partner(i, s)]) for c, (i, s) in enumerate(prob.homes)
                 if s == "param" and prob.partner(i, s) in prob.index]
        pairs = [pr for pr in pairs if in_dram[pr[0]] == in_dram[pr[1]]]

    def bytes_to(item, tier: str) -> int:
        """DRAM bytes added by moving the item's homes to ``tier`` (its shard's bytes after - before)."""
        i = prob.homes[item[0]][0]
        tp2, to2 = {i: tp[i]}, {i: to[i]}
        for c in item:
            prob.put(tp2, to2, *prob.homes[c], tier)
        return prob.shard_bytes(i, tp2[i], to2[i]) - prob.shard_bytes(i, tp[i], to[i])

    inside = [it for it in singles + pairs if in_dram[it[0]]]
    outside = [it for it in singles + pairs if not in_dram[it[0]] and sum(value[c] for c in it) > 0]
    worth = {it: sum(value[c] for c in it) for it in inside + outside}
    nbytes = {it: bytes_to(it, "cpu") for it in outside}
    freed = {it: -bytes_to(it, "nvme") for it in inside}
    refill_order = sorted((it for it in outside if len(it) == 1), key=lambda it: -worth[it] / max(1, nbytes[it]))
    wanted = sorted((it for it in outside if nbytes[it] > free), key=lambda it: -worth[it])[:_EXCHANGE_WANTED]
    moves = []
    for j in wanted:
        shard_j = prob.homes[j[0]][0]
        need = nbytes[j] - free  # bytes to free (> 0)
        # with aliasing, evicting its own shard's other home frees nothing: that home rides along
        pool = [it for it in inside if not (prob.alias and prob.homes[it[0]][0] == shard_j)]
        single = min((it for it in pool if freed[it] >= need), key=lambda it: worth[it], default=None)
        for gone in _covers(prob, tp, to, pool, need, value) + ([set(single)] if single is not None else []):
            tp2, to2 = list(tp), list(to)
            gain = worth[j] - sum(value[c] for c in gone)
            for c in gone:
                prob.put(tp2, to2, *prob.homes[c], "nvme")
            for c in j:
                prob.put(tp2, to2, *prob.homes[c])
            left = room - prob.dram_bytes(tp2, to2)
            if left < 0:
                continue
            for (c,) in refill_order:  # what room is left, by value per byte
                if c in j or c in gone or prob.tier(tp2, to2, *prob.homes[c]) != "nvme":
                    continue
                b = prob.marginal_bytes(*prob.homes[c], tp2, to2)
                if b <= left:
                    prob.put(tp2, to2, *prob.homes[c])
                    left -= b
                    gain += value[c]
            if gain > 0:
                moves.append((gain, tp2, to2))
    moves.sort(key=lambda m: -m[0])
    return moves


def _covers(prob: _Problem, tp, to, pool: list[tuple[int, ...]], need: int, value: list[float]) -> list[set[int]]:
    """Sets of DRAM homes (candidate indices) to evict that free ``need`` bytes while losing
    little value.

    The greedy for a covering knapsack - repeatedly the item of least value per *useful* byte
    freed (bytes beyond what is still needed are worth nothing, so one big item does not look
    cheap) - then, most valuable first, drop the homes the others cover without. Bytes freed are
    recounted as homes go (with aliasing, a param frees nothing while its master stays in DRAM,
    and its full size once the master has gone). The greedy alone can start wrong, so it is run
    once as is and once from each of the ``_COVER_STARTS`` cheapest first items (a partial
    enumeration); duplicates are dropped.
    """
    homes = prob.homes

    def shard_freed(i: int, states) -> int:
        """Bytes shard i frees with its homes in ``states`` moved to NVMe."""
        return prob.shard_bytes(i, tp[i], to[i]) - prob.shard_bytes(
            i, "nvme" if "param" in states else tp[i], "nvme" if "optim" in states else to[i])

    shard_of = {it: homes[it[0]][0] for it in pool}
    states_of = {it: frozenset(homes[c][1] for c in it) for it in pool}
    worth = {it: sum(value[c] for c in it) for it in pool}
    by_shard: dict[int, list[tuple[int, ...]]] = {}
    for it in pool:
        by_shard.setdefault(shard_of[it], []).append(it)
    freed0 = {it: shard_freed(shard_of[it], states_of[it]) for it in pool}
    starts = sorted((it for it in pool if freed0[it] > 0), key=lambda it: worth[it] / min(freed0[it], need))
    out: dict[frozenset, set[int]] = {}
    for first in [None, *starts[:_COVER_STARTS]]:
        freed = dict(freed0)  # what each item would free now
        gone: dict[int, set[str]] = {}  # shard -> states evicted so far
        rest = need
        item = first
        while rest > 0:
            if item is None:
                left = [it for it in pool if freed[it] > 0]
                if not left:
                    break
                item = min(left, key=lambda it: worth[it] / min(freed[it], rest))
            i = shard_of[item]
            rest -= freed[item]
            g = gone.setdefault(i, set())
            g.update(states_of[item])
            for other in by_shard[i]:  # the shard's other items free what is left of it
                freed[other] = shard_freed(i, g | states_of[other]) - shard_freed(i, g)
            item = None
        if rest > 0:
            continue
        evicted = {c for c, (i, s) in enumerate(homes) if s in gone.get(i, ())}
        total = sum(shard_freed(i, g) for i, g in gone.items())
        for c in sorted(evicted, key=lambda c: -value[c]):  # keep what the rest covers without
            i = homes[c][0]
            g = {homes[c2][1] for c2 in evicted if homes[c2][0] == i}
            without = total - shard_freed(i, g) + shard_freed(i, g - {homes[c][1]})
            if without >= need:
                evicted.discard(c)
                total = without
        out.setdefault(frozenset(evicted), evicted)
    return list(out.values())


# ------------------------------------------------------------------------------ fast path
def _fast_greedy(prob: _Problem, lin: pd.DataFrame, room: int, max_evaluations: int | None):
    """Large problems: fill the room in one order of the homes - by linear stall saved per byte,
    or by disk seconds per byte - and spend the bounded simulations on choosing the order and
    then, by golden section, how many of the filled homes to keep. Returns ``(tp, to, prediction,
    evaluations, note)``."""
    shard, is_optim = prob.home_shard, prob.home_is_optim

    def per_home(param_col: str, optim_col: str) -> np.ndarray:
        return np.where(is_optim, lin[optim_col].to_numpy(np.float64)[shard], lin[param_col].to_numpy(np.float64)[shard])

    stall = per_home("param_stall_s", "optim_stall_s")
    # what the home costs the disk per step (with a param's fetch overhead): where the disk queue
    # delays prefetches, this predicts the gain better than the linear stall; neither always does
    disk = per_home("param_disk_s", "optim_disk_s") + np.where(
        is_optim, 0.0, prob.wl.fetch_overhead_s * lin["param_reads_per_step"].to_numpy(np.float64)[shard])
    per_byte = np.maximum(prob.added_bytes_at(*prob.in_dram0), 1)  # bytes from the start

    def order_by(first: np.ndarray, then: np.ndarray) -> np.ndarray:
        """Homes with ``first`` > 0 by ``first`` per byte, then those with only ``then`` > 0 by it."""
        a, b = np.flatnonzero(first > 0), np.flatnonzero((first <= 0) & (then > 0))
        return np.concatenate([a[np.argsort(-first[a] / per_byte[a], kind="stable")],
                               b[np.argsort(-then[b] / per_byte[b], kind="stable")]])

    orders = {"linear stall per byte": lambda: order_by(stall, disk),
              "disk seconds per byte": lambda: order_by(np.maximum(stall, disk), stall)}
    budget = max_evaluations if max_evaluations is not None else min(16, _FAST_SIM_BUDGET_SHARDS // max(1, prob.n))
    budget = max(1, int(budget))  # the plan's own prediction at least
    if budget < 2:  # no simulation to spare for choosing: the linear model's order (the MILP's)
        orders = dict(list(orders.items())[:1])
    fills = {name: _fill(prob, order(), room) for name, order in orders.items()}
    sims = {name: prob.run(*fills[name][:2]) for name in fills}
    name = min(sims, key=lambda k: sims[k].step_s)
    tp, to, taken = fills[name]

    # how many of `taken` (in fill order) to keep: golden section on the simulated step
    def placement_at(cut: int):
        """The first ``cut`` homes of the fill in DRAM."""
        if cut == len(taken):
            return tp, to
        return prob.moved_many(prob.tp0, prob.to0, taken[:cut])

    seen: dict[int, Prediction] = {len(taken): sims[name]}

    def step_at(cut: int) -> float:
        if cut not in seen:
            seen[cut] = prob.run(*placement_at(cut))
        return seen[cut].step_s

    lo, hi = 0, len(taken)
    while len(sims) + len(seen) + 1 <= budget and hi - lo > 2:
        a, b = lo + round(0.382 * (hi - lo)), lo + round(0.618 * (hi - lo))
        if step_at(a) <= step_at(b):
            hi = b
        else:
            lo = a
    best = min(seen, key=lambda cut: (seen[cut].step_s, -cut))
    evaluations = len(sims) + len(seen) - 1
    note = (f"fast path ({prob.n_homes} movable homes > resimulate_max_homes): homes by {name}, "
            f"{best} of {len(taken)} filled kept, {evaluations} simulation(s)")
    return *placement_at(best), seen[best], evaluations, note


def _fill(prob: _Problem, order: np.ndarray, room: int):
    """Move homes to DRAM in ``order`` wherever they fit: ``(tp, to, taken)``. Twice with
    aliasing: first by the bytes from the start, then - a pair of homes in DRAM costs one copy, so
    some room is left - by the bytes each home adds to the placement reached."""
    shard, is_optim = prob.home_shard, prob.home_is_optim
    p_in, o_in = (m.copy() for m in prob.in_dram0)  # homes in DRAM, per shard
    taken = []
    for _ in range(2 if prob.alias else 1):
        inside = np.where(is_optim, o_in[shard], p_in[shard])
        free = room - int(prob.bytes_of(p_in, o_in).sum())
        new = _fill_in_order(order[~inside[order]], prob.added_bytes_at(p_in, o_in), free)
        p_in[shard[new[~is_optim[new]]]] = True  # moved to "cpu", a DRAM tier
        o_in[shard[new[is_optim[new]]]] = True
        taken.append(new)
    taken = np.concatenate(taken)
    return *prob.moved_many(prob.tp0, prob.to0, taken), taken


def _fill_in_order(order: np.ndarray, nbytes: np.ndarray, free: int) -> np.ndarray:
    """The homes ``order`` (candidate indices) that a pass in that order takes, each if its bytes
    still fit in ``free``: vectorised by runs - the longest run of fitting homes whose bytes add up
    within the room, then the same from the home after the first one that did not fit (a home
    that does not fit now never will: the room only shrinks)."""
    out = []
    rest = order
    while rest.size and free >= 0:
        fits = rest[nbytes[rest] <= free]
        if not fits.size:
            break
        cum = np.cumsum(nbytes[fits])
        k = int(np.searchsorted(cum, free, side="right"))
        out.append(fits[:k])
        free -= int(cum[k - 1]) if k else 0
        rest = fits[k + 1:]  # fits[k] did not fit after the run
    return np.concatenate(out) if out else np.zeros(0, np.int64)


# ------------------------------------------------------------------------------ MILP
def _milp(prob: _Problem, lin: pd.DataFrame, room: int, time_limit_s: float, rel_gap: float,
          switch: tuple[list, list, float] | None = None):
    """One-hot over each shard's tier combinations; minimise the linear stall within the room
    (plus, with ``switch`` = (incumbent param tiers, optim tiers, seconds per byte), the cost of
    every home moved away from its incumbent tier; the objective returned leaves it out)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    cost_p = lin["param_stall_s"].to_numpy(np.float64)
    cost_o = lin["optim_stall_s"].to_numpy(np.float64)
    if switch is not None:
        cur_p, cur_o, per_byte = switch
        move_p = prob.wl.shards["param_bytes"].to_numpy(np.float64) * per_byte  # s/step to move the home
        move_o = prob.wl.shards["optim_bytes"].to_numpy(np.float64) * per_byte
    var_shard, var_tiers, c, bytes_row, switch_c = [], [], [], [], []
    const_cost, const_bytes = 0.0, 0
    for i in range(prob.n):
        ps = ["nvme", "cpu"] if prob.movable["param"][i] else [prob.tp0[i]]
        os_ = ["nvme", "cpu"] if prob.movable["optim"][i] else [prob.to0[i]]
        options = [(p, o) for p in ps for o in os_]

        def cost(p: str, o: str) -> float:
            return (cost_p[i] if p == "nvme" else 0.0) + (cost_o[i] if o == "nvme" else 0.0)

        if len(options) == 1:
            const_cost += cost(*options[0])
            const_bytes += prob.shard_bytes(i, *options[0])
            continue
        for p, o in options:
            var_shard.append(i)
            var_tiers.append((p, o))
            c.append(cost(p, o))
            bytes_row.append(prob.shard_bytes(i, p, o))
            if switch is not None:
                switch_c.append((move_p[i] if p != cur_p[i] else 0.0) + (move_o[i] if o != cur_o[i] else 0.0))
    tp, to = list(prob.tp0), list(prob.to0)
    note = ""
    objective = const_cost
    m = len(c)
    if m:
        shards = sorted(set(var_shard))
        row_of = {s: r for r, s in enumerate(shards)}
        one_hot = coo_matrix((np.ones(m), ([row_of[s] for s in var_shard], np.arange(m))), shape=(len(shards), m))
        constraints = [LinearConstraint(one_hot, 1, 1),
                       LinearConstraint(np.asarray(bytes_row, np.float64)[None, :], -np.inf, float(room - const_bytes))]
        objective_c = np.asarray(c) + (np.asarray(switch_c) if switch is not None else 0.0)
        res = milp(objective_c, constraints=constraints, integrality=np.ones(m), bounds=Bounds(0, 1),
                   options={"time_limit": float(time_limit_s), "mip_rel_gap": float(rel_gap)})
        if res.x is None:
            raise PlanError(f"the MILP found no placement within the room ({res.message})")
        if not res.success:
            note = f"HiGHS stopped early: {res.message}"
        x = np.round(res.x).astype(int)
        for v in np.flatnonzero(x):
            tp[var_shard[v]], to[var_shard[v]] = var_tiers[v]
        objective += float(np.dot(c, x))
    return tp, to, objective, {}, 0, note
