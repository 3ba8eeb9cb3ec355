"""What the profiler costs on the planner benchmark's workloads: step time with the profiler on
(``detail: shard``, what the adaptive policy needs) ÷ off, for one static policy at one budget.

One command::

    .venv/bin/python benchmarks/profiler_overhead_placements.py --path DIR [--workload gpt|moe]
        [--policy max_in_cpu|nvme] [--budget 0.3] [--rounds 2] [--warmup 6] [--steps 8]
        [--device cpu|cuda] [--db-dir DIR]

It reuses ``benchmarks/planner_policies.py``'s workloads and configs, so the ratio says how much of
"adaptive vs static" there is the profiler's. Rounds alternate off / on; the medians pool the
measured steps of every round. (``benchmarks/profiler_overhead.py`` measures the demo GPT with
its state on NVMe, where the overhead is ~1%.)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_policies as pp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="directory on the disk to swap to")
    ap.add_argument("--workload", choices=("gpt", "moe"), default="gpt")
    ap.add_argument("--policy", choices=pp.STATIC_POLICIES, default="max_in_cpu")
    ap.add_argument("--budget", type=float, default=0.3, help="DRAM budget as a fraction of the training state")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help="zinf.device of every run")
    ap.add_argument("--db-dir", type=Path, default=None,
                    help="directory of the profile database (default: beside the swap files, on the disk swapped to)")
    args = ap.parse_args()
    pp.DEVICE = args.device
    w = pp.make_workload(args.workload, False)
    swap = args.path / "profiler-overhead-placements"
    shutil.rmtree(swap, ignore_errors=True)
    swap.mkdir(parents=True)
    db_dir = swap if args.db_dir is None else args.db_dir / "profiler-overhead-placements-db"
    db_dir.mkdir(parents=True, exist_ok=True)
    try:
        budget = int(args.budget * w.state_bytes)
        n = pp.largest_max_in_cpu(w, swap, budget) if args.policy == "max_in_cpu" else 0
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in ("off", "on"):
                cfg = pp.policy_config(w, args.policy, swap, budget, max_in_cpu=n or 0)
                if mode == "on":
                    cfg["zinf"]["profiler"] = {"enabled": True, "db": f"sqlite:///{db_dir}/profile-{r}.db"}
                run = pp.train(w, cfg, args.warmup, args.steps)
                times[mode] += run.step_s
                print(f"round {r + 1}/{args.rounds} profiler {mode:3s}: median {statistics.median(run.step_s):.3f} s", flush=True)
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        where = "beside the swap files" if args.db_dir is None else f"in {args.db_dir}"
        print(f"{args.workload} {args.policy} at {args.budget:.0%} on {args.device}, database {where}: profiler on {on:.3f} s / off {off:.3f} s = {on / off:.3f}")
    finally:
        shutil.rmtree(swap, ignore_errors=True)
        shutil.rmtree(db_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
