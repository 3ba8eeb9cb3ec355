"""How long the training thread waits for gradient sums read back between micro-batches.

With gradient accumulation, a shard whose optimizer home is on NVMe writes its gradient sum to
its file after each micro-batch and reads it back in the next one before the new gradient adds
to it. This trains the planner benchmark's dense GPT (accumulation 4, 34 shards) at a DRAM budget
under the given static policies and prints, per optimizer step (medians over the steps after
``--warmup``): the step, the engine's recorded stall, how many sums were read back and how long
the training thread waited for them in all (``ShardTransfer`` events of ``grad``/``read``).

``--tree DIR`` imports zinf (and this benchmark's workload) from another checkout, so that two
commits can be compared on the same disk, one run after the other (the figures in RESULTS.md
alternate them):

    .venv/bin/python benchmarks/grad_readback.py --path /work/tmp/gw --tree /work/tmp/base
    .venv/bin/python benchmarks/grad_readback.py --path /work/tmp/gw
"""
from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="swap files go under it (removed at the end)")
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the checkout whose zinf runs (default: this one)")
    ap.add_argument("--policies", default="max_in_cpu,nvme")
    ap.add_argument("--budget", type=float, default=0.3, help="DRAM budget as a fraction of the training state")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    sys.path[:0] = [str(args.tree), str(args.tree / "benchmarks")]
    import planner_policies as pp

    import zinf
    from zinf.events import ListRecorder, ShardTransfer, StepFinished

    w = pp.make_workload("gpt", quick=False)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, zinf from {args.tree}; {w.about}; "
          f"budget {args.budget:.0%}; {args.warmup} + {args.steps} steps per policy")
    for policy in args.policies.split(","):
        d = args.path / policy
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        budget = int(args.budget * w.state_bytes)
        n = pp.largest_max_in_cpu(w, d, budget) if policy == "max_in_cpu" else 0
        rec = ListRecorder()
        walls, micro = [], 0
        try:
            with zinf.initialize(pp.copy.deepcopy(w.model), pp.policy_config(w, policy, d, budget, max_in_cpu=n or 0),
                                 recorder=rec) as engine:
                for step in range(args.warmup + args.steps):
                    t0 = time.perf_counter()
                    # (planner_policies.optimizer_step, written out: --tree may be a checkout older than it)
                    for _ in range(w.grad_accum):
                        x, y = w.data.get(micro)
                        micro += 1
                        engine.backward(engine(x, y))
                        engine.step()
                    if step >= args.warmup:
                        walls.append(time.perf_counter() - t0)
                ahead = getattr(engine, "grad_reads_ahead", None)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        first = args.warmup + 1  # (StepFinished and transfers count steps from 1)
        waits: dict[int, list[float]] = {}
        for e in rec.events:
            if isinstance(e, ShardTransfer) and e.what == "grad" and e.op == "read" and e.step >= first - 1:
                waits.setdefault(e.step, []).append(e.stall_s)
        stalls = [e.stall_s for e in rec.events if isinstance(e, StepFinished) and e.step >= first]
        each = [s for v in waits.values() for s in v]
        print(f"{policy:<11} step {statistics.median(walls):.3f} s, stall {statistics.median(stalls):.3f} s; "
              f"sums read back {statistics.median(len(v) for v in waits.values()):.0f} a step, waited "
              f"{statistics.median(sum(v) for v in waits.values()) * 1e3:.1f} ms a step "
              f"(median {statistics.median(each) * 1e3:.2f} ms each); read ahead of their gradient: "
              f"{'-' if ahead is None else ahead}")


if __name__ == "__main__":
    main()
