"""How long the planner's solver takes as the number of shards grows, and where the time goes.

One command::

    .venv/bin/python benchmarks/solver_scale.py [--shards 1000,10000,100000] [--repeats 3]
        [--budget 0.3] [--regime overlap|linear] [--methods greedy,milp] [--milp-max-shards 1000]
        [--resimulating-at 1000] [--seed 0] [--json FILE]

For every size it builds one random synthetic workload (``Workload.from_rows``, like
``tests/test_planner.py``: shard sizes log-uniform 16 KiB - 4 MiB of fp32 param, accesses per step
0.05-2 with conditional use, 10% chunks, 10% frozen, 2% of the homes pinned) and times
``planner.solve`` end to end - building the simulator, the linear scores, choosing the homes, every
simulation, the placement and scores tables - ``--repeats`` times; the table shows the median.
The header also gives the seconds of a pure-Python loop of 10^7 additions: a coarse reference for
the interpreter's speed on this machine. It does not normalise the solve times: on 2026-12-07 the
dev VM's loop stayed at 0.38-0.41 s while the 10^5-shard solve moved between 1.0 and 1.5 s (the
simulation walks lists and heaps of 10^5 entries, so the host's memory contention moves it more).
Columns:

* ``shards``, ``method`` (greedy / milp) and ``path``: the greedy re-simulates every candidate up to
  ``resimulate_max_homes`` movable homes (512 by default) and takes its fast path above
  (``fast``); ``--resimulating-at N`` adds a row for N shards with the re-simulating greedy forced
  (``resimulate_max_homes`` = inf), to compare.
* ``solve_s``: median wall seconds of ``solve()``; ``sim_s``: the part of it spent simulating (all
  ``sims`` simulations, the plan's own prediction included); ``own_s``: the rest (solver + linear
  scores + tables), from ``Plan.timings``.
* ``step_s``: the plan's predicted step; ``dram``: homes' DRAM bytes / the room for them.

``--regime overlap`` (default): prefetch window 64 MiB, reuse distance 1 GiB, 4 disk servers,
write-behind (the engine's defaults, roughly); ``linear``: every I/O synchronous (the settings under
which the simulator is additive, ``LINEAR`` in the tests). The budget is ``--budget`` x the DRAM
all homes would take; nothing is reserved (``reserved_bytes=0``). The MILP is run up to
``--milp-max-shards`` only (HiGHS on 10^4 shards takes tens of seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import CostModel, Workload, solve  # noqa: E402

READ_LAT, READ_BPS = 2e-4, 1e9  # seconds, bytes/s: a request to the dev VM's disk, roughly
WRITE_LAT, WRITE_BPS = 3e-4, 1.5e9

OVERLAP = dict(prefetch_bytes=64 << 20, reuse_distance_bytes=1 << 30, disk_servers=4)
LINEAR = dict(prefetch_bytes=0, reuse_distance_bytes=0, write_window_bytes=0, pipeline_read=False,
              updates_during_backward=False, micro_batches=1, disk_servers=1)


def cost_model() -> CostModel:
    """A cost model fitted on exact ``latency + bytes / bandwidth`` samples (as in the tests)."""
    sizes = np.geomspace(1e4, 1e8, 24)
    rows = [{"tier": "nvme", "op": "read", "bytes": b, "seconds": READ_LAT + b / READ_BPS} for b in sizes]
    rows += [{"tier": "nvme", "op": "write", "bytes": b, "seconds": WRITE_LAT + b / WRITE_BPS} for b in sizes]
    return CostModel.fit(pd.DataFrame(rows))


def workload(n: int, seed: int, regime: str) -> Workload:
    """``n`` random shards (see the module docstring); forward compute 0.2 ms a shard (backward 2x)."""
    rng = np.random.default_rng(seed)
    uses = rng.choice([0.05, 0.3, 1.0, 1.0, 2.0], n)
    trainable = rng.random(n) > 0.1
    pin = rng.random(n)
    rows = pd.DataFrame({
        "numel": np.exp(rng.uniform(np.log(1 << 12), np.log(1 << 20), n)).astype(np.int64),
        "fwd_accesses_per_step": uses, "bwd_accesses_per_step": uses, "opt_accesses_per_step": np.minimum(1.0, uses),
        "chunk": rng.random(n) < 0.1, "trainable": trainable,
        "pin_param": np.where(pin < 0.01, "cpu", np.where(pin < 0.02, "nvme", None)),
    })
    settings = OVERLAP if regime == "overlap" else LINEAR
    return Workload.from_rows(rows, compute_fwd_s=2e-4 * n, update_s_per_elem=2e-9, update_overhead_s=2e-5,
                              fetch_overhead_s=5e-5, **settings)


def python_speed_s() -> float:
    """Seconds this interpreter takes for 10^7 additions in a loop, the best of three: how fast
    the machine runs pure Python now (a coarse reference: see the module docstring)."""
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(10_000_000):
            total += i
        best = min(best, time.perf_counter() - t0)
    return best


def run_one(wl: Workload, cm, room: int, method: str, repeats: int, **kw) -> dict:
    plans, seconds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plans.append(solve(wl, cm, room, reserved_bytes=0, method=method, **kw))
        seconds.append(time.perf_counter() - t0)
    plan = plans[-1]
    path = "-" if method == "milp" else "fast" if plan.note.startswith("fast path") else "resim"
    return {
        "shards": len(wl.shards), "method": method, "path": path, "solve_s": statistics.median(seconds),
        "sim_s": statistics.median(p.timings["simulate_s"] for p in plans),
        "own_s": statistics.median(s - p.timings["simulate_s"] for s, p in zip(seconds, plans)),
        "sims": plan.evaluations, "step_s": plan.prediction.step_s, "dram_bytes": plan.dram_bytes, "room_bytes": room,
        "timings": {k: statistics.median(p.timings[k] for p in plans) for k in plan.timings},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", default="1000,10000,100000", help="comma-separated shard counts")
    ap.add_argument("--repeats", type=int, default=3, help="solves per row (the median is shown)")
    ap.add_argument("--budget", type=float, default=0.3, help="fraction of the DRAM all homes would take")
    ap.add_argument("--regime", choices=("overlap", "linear"), default="overlap")
    ap.add_argument("--methods", default="greedy,milp")
    ap.add_argument("--milp-max-shards", type=int, default=1000)
    ap.add_argument("--resimulating-at", type=int, default=None,
                    help="also time the re-simulating greedy (no fast path) at this many shards")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)

    cm = cost_model()
    sizes = [int(float(x)) for x in args.shards.split(",")]
    methods = args.methods.split(",")
    print(f"solver scale: regime {args.regime}, budget {args.budget:.0%} of all homes, median of {args.repeats}; "
          f"{platform.node()} ({platform.processor() or platform.machine()}), python {platform.python_version()}; "
          f"10^7 additions in a Python loop: {python_speed_s():.2f} s")
    print(f"{'shards':>7} {'method':<7} {'path':<6} {'solve_s':>8} {'sim_s':>7} {'own_s':>7} {'sims':>5} "
          f"{'step_s':>8}  dram used / room")
    rows = []

    def show(r: dict) -> None:
        rows.append(r)
        print(f"{r['shards']:>7} {r['method']:<7} {r['path']:<6} {r['solve_s']:>8.3f} {r['sim_s']:>7.3f} {r['own_s']:>7.3f} "
              f"{r['sims']:>5} {r['step_s']:>8.3f}  {r['dram_bytes'] / 2**20:,.0f} / {r['room_bytes'] / 2**20:,.0f} MiB",
              flush=True)

    for n in sizes:
        wl = workload(n, args.seed, args.regime)
        room = int(args.budget * wl.dram_bytes(wl.all_dram_placement()))
        for method in methods:
            if method == "milp" and n > args.milp_max_shards:
                continue
            show(run_one(wl, cm, room, method, args.repeats))
        if args.resimulating_at == n and "greedy" in methods:
            show(run_one(wl, cm, room, "greedy", 1, resimulate_max_homes=math.inf))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
