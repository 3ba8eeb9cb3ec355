"""What the prefetcher's issuer costs the training thread: ``Prefetcher._issue`` (the walk along
the trace that starts the next reads, run at every fetch) timed per optimizer step on the
planner benchmark's skewed MoE, every home on NVMe under a DRAM budget, with the prefetch
counters of the same steps. Run it on two trees to compare issuers; the counters must agree.

    .venv/bin/python benchmarks/prefetch_walk.py --path /work/tmp/pw
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_policies as pp  # noqa: E402

import zinf  # noqa: E402
from zinf import prefetch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="swap files go under it (removed at the end)")
    ap.add_argument("--budget", type=float, default=0.3, help="DRAM budget as a fraction of the training state")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()

    spent = [0.0]
    issue = prefetch.Prefetcher._issue

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return issue(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    prefetch.Prefetcher._issue = timed
    w = pp.make_workload("moe", False)
    shutil.rmtree(args.path, ignore_errors=True)
    args.path.mkdir(parents=True)
    cfg = pp.policy_config(w, "nvme", args.path, int(args.budget * w.state_bytes))
    per_step_ms, walls = [], []
    try:
        with zinf.initialize(pp.copy.deepcopy(w.model), cfg) as engine:
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    before = engine.prefetch_stats
                s0 = spent[0]
                x, y = w.data.get(step)
                engine.backward(engine(x, y))
                engine.step()
                if step >= args.warmup:
                    per_step_ms.append((spent[0] - s0) * 1e3)
                    walls.append(engine.last_step["wall_s"])
            after = engine.prefetch_stats
    finally:
        shutil.rmtree(args.path, ignore_errors=True)
    counters = ", ".join(f"{k} {(getattr(after, k) - getattr(before, k)) / args.steps:.1f}"
                         for k in ("issued", "hits", "misses", "dropped", "kept"))
    print(f"MoE, all-NVMe at {args.budget:.0%}: Prefetcher._issue {statistics.median(per_step_ms):.1f} ms a step "
          f"(median of {args.steps}); step {statistics.median(walls):.3f} s; per step: {counters}")


if __name__ == "__main__":
    main()
