"""Choose which homes live in DRAM under a DRAM budget: greedy with re-simulation, or an exact MILP.

A *home* is ``(shard, state)`` with state "param" (the working copy) or "optim" (fp32 master +
moments + gradient accumulator). Every movable home is either in DRAM ("cpu") or on NVMe; pinned
homes (the workload's ``pin_param``/``pin_optim``, plus ``fixed``) stay where they are pinned, and
frozen shards have no optimizer home. The homes' DRAM bytes are counted as the engine counts them
(:func:`planner.workload.home_dram_bytes`) and must fit ``room = dram_budget_bytes -
reserved_bytes``, ``reserved_bytes`` (default ``workload.reserved_dram_bytes``) being what the
engine needs besides the homes (working set, staging buffers, the overlap it wants).

**Greedy** (``method="greedy"``, the default). Start from every movable home on NVMe; repeatedly
put in DRAM the home with the highest *simulated* step seconds saved per DRAM byte that still fits,
re-simulating after every move. Candidates are evaluated lazily (CELF): each sits in a heap under
its last known gain per byte - at first an optimistic bound (its disk seconds per step and fetch
overhead, per byte: moving a home cannot save much more than the I/O it removes) - and only the top
of the heap is re-simulated; a candidate whose fresh gain still beats every other key is taken.
It stops when the best fresh gain is not positive (DRAM that saves nothing is left free: fewer
migrations) or nothing fits. ``max_evaluations`` caps the simulations; past it the remaining room
is filled by the keys as they stand, and ``Plan.note`` says so. ``greedy_batch`` > 1 takes that
many homes per round: the best fresh candidates, whose gains were simulated against the same
placement (interactions among them ignored).

**MILP** (``method="milp"``). The linearised model of :func:`planner.hotness.stall_cost`: each
state on NVMe costs its own stall seconds, independently of the others. Binary variables choose,
per shard, one combination of its homes' tiers (one-hot), so that the aliasing rule (fp32 on the
CPU with both homes in DRAM shares one copy) is exact; minimise the total stall of the homes left
on NVMe subject to the DRAM room. Solved by ``scipy.optimize.milp`` (HiGHS). It is exact for the
linear model, and the tests use it as the oracle for small instances; its plan is then simulated
like the greedy's.

Greedy vs optimum: for an additive (linear) model, greedy by density loses at most the value of one
home (the best home that no longer fits) against the optimum; with many homes small against the
budget that is a small fraction. Against the simulator the model is not additive (prefetch overlap,
disk queueing), which is why the greedy re-simulates instead of trusting the linear scores.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from zinf.errors import ZinfError

from planner.hotness import stall_cost
from planner.simulator import O_DRAM, O_NONE, O_NVME, P_COPY, P_NVME, P_RESIDENT, Prediction, Simulator
from planner.workload import Workload, normalize_placement

__all__ = ["Plan", "PlanError", "solve", "STATES"]

STATES = ("param", "optim")


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


def homes_of(placement: Mapping[str, Mapping[str, str]]) -> dict[tuple[str, str], str]:
    """The engine's {shard: {"param": tier, "optim": tier}} as {(shard, state): tier}."""
    return {(n, s): t[s] for n, t in placement.items() for s in STATES}


def solve(workload: Workload, cost_model, dram_budget_bytes: int, *, method: str = "greedy",
          prefetch_bytes: int | None = None, fixed: Mapping | None = None, reserved_bytes: int | None = None,
          max_evaluations: int | None = None, greedy_batch: int | None = None, milp_time_limit_s: float = 30.0,
          **simulate_kwargs: Any) -> Plan:
    """The placement of ``workload``'s homes that minimises the predicted step under the budget.

    ``dram_budget_bytes``: the DRAM budget (``zinf.dram_budget``); the homes get it minus
    ``reserved_bytes`` (default ``workload.reserved_dram_bytes``; pass 0 to give the homes the
    whole budget). ``method``: "greedy" or "milp". ``prefetch_bytes`` and ``simulate_kwargs``:
    passed to the simulator (see :func:`planner.simulator.simulate`). ``fixed``: extra pins,
    ``{shard: {"param": tier, "optim": tier}}`` (either key may be left out) or ``{(shard,
    state): tier}``. ``max_evaluations``: cap on the greedy's simulations (default 4 per
    candidate + 100); ``greedy_batch``: homes the greedy may take per round of re-simulation
    (default 1, the exact greedy: O(n) simulations of O(n) each).
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
    lin = stall_cost(wl, sim.io, prefetch_bytes=sim.prefetch_bytes)
    if method == "milp":
        tp, to, objective, sim_saved, evals, note = _milp(prob, lin, room, milp_time_limit_s)
    else:
        tp, to, objective, sim_saved, evals, note = _greedy(prob, lin, room, max_evaluations, greedy_batch)
    prediction = prob.run(tp, to)
    placement = prob.placement(tp, to)
    used = wl.dram_bytes(placement)
    if used > room:  # the solvers never exceed the room; this guards the bookkeeping
        raise PlanError(f"internal error: the {method} plan needs {used} bytes of DRAM for homes, room {room}")
    scores = prob.scores(lin, tp, to, sim_saved)
    return Plan(placement=placement, prediction=prediction, dram_bytes=int(used), room_bytes=int(room),
                budget_bytes=int(dram_budget_bytes), reserved_bytes=reserved, scores=scores, method=method,
                objective_s=float(prediction.step_s if method == "greedy" else objective),
                evaluations=evals + 1, solve_s=time.perf_counter() - t0, note=note)


# ------------------------------------------------------------------------------ the problem
class _Problem:
    """The homes' tiers (strings, per shard), what may move, and their DRAM bytes."""

    def __init__(self, wl: Workload, sim: Simulator, fixed: Mapping | None):
        self.wl, self.sim = wl, sim
        df = wl.shards
        self.names = df["shard"].tolist()
        self.n = len(self.names)
        start = normalize_placement(wl, fixed or {})  # all-NVMe, pins, then the extra pins
        fixed_homes: set[tuple[str, str]] = set()
        for key, value in (fixed or {}).items():
            if isinstance(key, tuple):
                fixed_homes.add(key)
            elif isinstance(value, Mapping):
                fixed_homes.update((key, s) for s in value)
            else:
                fixed_homes.update((key, s) for s in STATES)
        pins_p, pins_o = df["pin_param"].tolist(), df["pin_optim"].tolist()
        self.trainable = df["trainable"].tolist()
        self.tp0 = [start[n]["param"] for n in self.names]
        self.to0 = [start[n]["optim"] if t else "none" for n, t in zip(self.names, self.trainable)]
        self.movable = {
            "param": [pins_p[i] is None and (n, "param") not in fixed_homes and self.tp0[i] in ("cpu", "nvme")
                      for i, n in enumerate(self.names)],
            "optim": [self.trainable[i] and pins_o[i] is None and (n, "optim") not in fixed_homes
                      and self.to0[i] in ("cpu", "nvme") for i, n in enumerate(self.names)],
        }
        # movable homes start on NVMe (the greedy's starting point; the MILP chooses freely)
        self.tp0 = ["nvme" if m else t for m, t in zip(self.movable["param"], self.tp0)]
        self.to0 = ["nvme" if m else t for m, t in zip(self.movable["optim"], self.to0)]
        self.P = df["param_bytes"].to_numpy(np.int64).tolist()
        self.OG = (df["optim_bytes"] + df["grad_bytes"]).to_numpy(np.int64).tolist()
        self.dram = wl.dram_tiers
        self.alias = bool(wl.aliases_master)
        self.cpu_device = wl.device == "cpu"

    def shard_bytes(self, i: int, ptier: str, otier: str) -> int:
        """DRAM bytes of shard i's homes at these tiers (``home_dram_bytes`` for one shard)."""
        p_in, o_in = ptier in self.dram, otier in self.dram
        aliased = self.alias and p_in and o_in and self.trainable[i]
        return (self.P[i] if p_in and not aliased else 0) + (self.OG[i] if o_in and self.trainable[i] else 0)

    def dram_bytes(self, tp, to) -> int:
        return sum(self.shard_bytes(i, tp[i], to[i]) for i in range(self.n))

    def marginal_bytes(self, i: int, state: str, tp, to) -> int:
        """DRAM bytes added by moving home (i, state) to DRAM."""
        if state == "param":
            return self.shard_bytes(i, "cpu", to[i]) - self.shard_bytes(i, tp[i], to[i])
        return self.shard_bytes(i, tp[i], "cpu") - self.shard_bytes(i, tp[i], to[i])

    @staticmethod
    def moved(tp, to, i: int, state: str):
        tp2, to2 = list(tp), list(to)
        (tp2 if state == "param" else to2)[i] = "cpu"
        return tp2, to2

    def codes(self, tp, to) -> tuple[list[int], list[int]]:
        """Tiers to the simulator's codes."""
        pc = [P_NVME if t == "nvme" else P_RESIDENT if (t == "gpu" or self.cpu_device) else P_COPY for t in tp]
        oc = [O_NVME if t == "nvme" else O_NONE if t == "none" else O_DRAM for t in to]
        return pc, oc

    def run(self, tp, to) -> Prediction:
        return self.sim.run(*self.codes(tp, to))

    def placement(self, tp, to) -> dict[str, dict[str, str]]:
        return {n: {"param": p, "optim": o} for n, p, o in zip(self.names, tp, to)}

    def scores(self, lin: pd.DataFrame, tp, to, sim_saved: dict) -> pd.DataFrame:
        rows = []
        # columns as lists once: a DataFrame lookup per home cost ~25 ms a plan on 200 shards
        col = {(state, what): lin[f"{state}_{what}"].tolist() for state in STATES for what in ("dram_bytes", "stall_s")}
        for i, name in enumerate(self.names):
            for state in STATES:
                if state == "optim" and not self.trainable[i]:
                    continue
                b = int(col[(state, "dram_bytes")][i])
                saved = float(col[(state, "stall_s")][i])
                tier = tp[i] if state == "param" else to[i]
                rows.append({"shard": name, "state": state, "tier": tier, "movable": self.movable[state][i], "bytes": b,
                             "saved_s": saved, "saved_s_per_byte": saved / b if b > 0 else 0.0,
                             "sim_saved_s": sim_saved.get((i, state), math.nan), "chosen": tier in self.dram})
        return pd.DataFrame(rows)


# ------------------------------------------------------------------------------ greedy
def _greedy(prob: _Problem, lin: pd.DataFrame, room: int, max_evaluations: int | None, batch: int | None):
    tp, to = list(prob.tp0), list(prob.to0)
    used = prob.dram_bytes(tp, to)
    current = prob.run(tp, to).step_s
    evals = 0
    cands: list[tuple[int, str]] = [(i, s) for s in STATES for i in range(prob.n) if prob.movable[s][i]]
    limit = max_evaluations if max_evaluations is not None else 4 * len(cands) + 100
    batch = 1 if batch is None else max(1, int(batch))
    # optimistic first keys: the disk seconds (and fetch overhead) the home costs per step, per byte
    fetch_s = prob.wl.fetch_overhead_s
    heap = []
    for c, (i, s) in enumerate(cands):
        b = max(1, prob.marginal_bytes(i, s, tp, to))
        if s == "param":
            bound = lin["param_disk_s"].iat[i] + fetch_s * lin["param_reads_per_step"].iat[i]
        else:
            bound = lin["optim_disk_s"].iat[i]
        bound = max(bound, lin[f"{s}_stall_s"].iat[i])
        heap.append((-bound / b, c, -1))
    heapq.heapify(heap)
    version = 0  # bumped at every round of moves: keys of older versions are stale
    fresh_step: dict[int, float] = {}  # candidate -> simulated step with it moved (current version)
    sim_saved: dict[tuple[int, str], float] = {}
    tol = 1e-12 + 1e-9 * current
    note = ""
    set_aside: list[int] = []  # candidates that did not fit
    taking: list[int] = []  # this round's moves: fresh candidates at the top of the heap
    pending = 0  # their bytes
    done = False
    while not done:
        end_round = not heap
        if heap:
            negkey, c, ver = heapq.heappop(heap)
            i, s = cands[c]
            b = prob.marginal_bytes(i, s, tp, to)
            if used + pending + b > room:
                set_aside.append(c)
                continue
            if ver == version:  # evaluated against this placement and still the best key: take it
                if current - fresh_step[c] <= tol:
                    end_round = True  # the best fresh gain saves nothing
                    done = not taking  # ... not even after this round's moves
                else:
                    taking.append(c)
                    pending += b
                    end_round = len(taking) >= batch
            elif evals >= limit:
                note = (f"stopped re-simulating after {evals} evaluations (max_evaluations); "
                        "the rest of the room was filled in the order of the last known gains")
                heapq.heappush(heap, (negkey, c, ver))
                for c2 in taking:
                    tp, to = prob.moved(tp, to, *cands[c2])
                used += pending
                tp, to, used = _fill_by_keys(prob, heap, cands, tp, to, used, room)
                current = prob.run(tp, to).step_s
                break
            else:
                step = prob.run(*prob.moved(tp, to, i, s)).step_s
                evals += 1
                sim_saved[(i, s)] = current - step
                fresh_step[c] = step
                heapq.heappush(heap, (-(current - step) / max(1, b), c, version))
                continue
        if not end_round:
            continue
        if not taking:
            break
        for c2 in taking:
            tp, to = prob.moved(tp, to, *cands[c2])
        used += pending
        if len(taking) == 1:
            current = fresh_step[taking[0]]
        else:
            current = prob.run(tp, to).step_s
            evals += 1
        taking, pending = [], 0
        version += 1
        # a move can make a set-aside home cheaper (aliasing: a param whose master came to DRAM)
        for c2 in set_aside:
            heapq.heappush(heap, (-math.inf, c2, -1))
        set_aside = []
    return tp, to, current, sim_saved, evals, note


def _fill_by_keys(prob: _Problem, heap, cands, tp, to, used: int, room: int):
    while heap:
        negkey, c, _ = heapq.heappop(heap)
        if negkey >= 0:
            break
        i, s = cands[c]
        b = prob.marginal_bytes(i, s, tp, to)
        if used + b <= room:
            tp, to = prob.moved(tp, to, i, s)
            used += b
    return tp, to, used


# ------------------------------------------------------------------------------ MILP
def _milp(prob: _Problem, lin: pd.DataFrame, room: int, time_limit_s: float):
    """One-hot over each shard's tier combinations; minimise the linear stall within the room."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    cost_p = lin["param_stall_s"].to_numpy(np.float64)
    cost_o = lin["optim_stall_s"].to_numpy(np.float64)
    var_shard, var_tiers, c, bytes_row = [], [], [], []
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
        res = milp(np.asarray(c), constraints=constraints, integrality=np.ones(m), bounds=Bounds(0, 1),
                   options={"time_limit": float(time_limit_s)})
        if res.x is None:
            raise PlanError(f"the MILP found no placement within the room ({res.message})")
        if not res.success:
            note = f"HiGHS stopped early: {res.message}"
        x = np.round(res.x).astype(int)
        for v in np.flatnonzero(x):
            tp[var_shard[v]], to[var_shard[v]] = var_tiers[v]
        objective += float(np.dot(c, x))
    return tp, to, objective, {}, 0, note
