"""What the profile database costs a step, by where it lives: the planner benchmark's dense GPT
under ``max_in_cpu`` at one DRAM budget, in one process, five engines side by side -

* ``static``: no profiler;
* ``profiler_swap_disk`` / ``profiler_tmpfs``: the profiler on (``detail: step``), its SQLite file
  beside the swap files or on /dev/shm;
* ``adaptive_swap_disk`` / ``adaptive_tmpfs``: the adaptive policy (it records shard detail in
  one step of several and re-plans every 8 steps), its database beside the swap files or on /dev/shm.

The engines take turns, ``--block`` optimizer steps each, for ``--rounds`` rounds after one
warm-up round, so that the machine's drift over time falls on all of them alike; each round's
medians and the pooled medians ÷ ``static`` are printed. On the 2-core VM two such A/Bs disagreed
(benchmarks/RESULTS.md, tenth run): blocks of 8 steps vary by more than the effect.

    python3 benchmarks/profile_db_placement.py --path /tmp/pdb [--budget 0.3] [--block 8] [--rounds 8]
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_policies as pp  # noqa: E402

import zinf  # noqa: E402

TMPFS = Path("/dev/shm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="swap files (and the on-disk databases) go under it; removed at the end")
    ap.add_argument("--budget", type=float, default=0.3, help="DRAM budget as a fraction of the training state")
    ap.add_argument("--block", type=int, default=8, help="optimizer steps per engine per turn")
    ap.add_argument("--rounds", type=int, default=8, help="measured rounds (after one warm-up round)")
    args = ap.parse_args()
    if not TMPFS.is_dir():
        raise SystemExit(f"{TMPFS} is not a directory: this benchmark compares a database there with one on the swap disk")
    w = pp.make_workload("gpt", False)
    shutil.rmtree(args.path, ignore_errors=True)
    args.path.mkdir(parents=True)
    shm = Path(TMPFS / f"zinf-pdb-{os.getpid()}")
    shm.mkdir()
    budget = int(args.budget * w.state_bytes)
    n_max = pp.largest_max_in_cpu(w, args.path, budget) or 0
    print(f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} cores); {w.about}; "
          f"budget {args.budget:.0%}, max_in_cpu {n_max}; {args.rounds} rounds x {args.block} steps per engine")
    engines = {}
    try:
        for name in ("static", "profiler_swap_disk", "profiler_tmpfs", "adaptive_swap_disk", "adaptive_tmpfs"):
            d = args.path / name
            d.mkdir()
            adaptive = name.startswith("adaptive")
            cfg = pp.policy_config(w, "adaptive" if adaptive else "max_in_cpu", d, budget, max_in_cpu=n_max, replan_every=8)
            db = f"sqlite:///{(shm if name.endswith('tmpfs') else d) / 'profile.db'}"
            if name.startswith("profiler"):
                cfg["zinf"]["profiler"] = {"enabled": True, "db": db, "detail": "step"}
            elif adaptive:
                cfg["zinf"]["profiler"] = {"db": db}
            engines[name] = zinf.initialize(copy.deepcopy(w.model), cfg)
        times = {k: [] for k in engines}
        micro = dict.fromkeys(engines, 0)
        for r in range(args.rounds + 1):
            for name, engine in engines.items():
                for _ in range(args.block):
                    t0 = time.perf_counter()
                    micro[name] = pp.optimizer_step(engine, w, micro[name])
                    if r > 0:  # round 0 warms up (the first plan, the page cache, the trace)
                        times[name].append(time.perf_counter() - t0)
            if r > 0:
                print(f"round {r}: " + "  ".join(f"{k} {statistics.median(v[-args.block:]):.3f}" for k, v in times.items()), flush=True)
        base = statistics.median(times["static"])
        print("pooled median step (s) and ÷ static:")
        for k, v in times.items():
            m = statistics.median(v)
            print(f"  {k:<20} {m:.3f}  {m / base:.3f}x")
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(args.path, ignore_errors=True)


if __name__ == "__main__":
    main()
