"""What the adaptive policy's own work costs a step, in a placement it does not change: DeepSpeed's
``max_in_cpu`` placement run four ways side by side (``planner_policies.py``'s blocks of 8 steps
each in turn): static; static with the profiler (shard detail every step); adaptive that never
re-plans (profiler, controller hook, planning process started, detail every step); adaptive
re-planning every ``--replan-every`` steps (detail sampled once its plans keep the placement).

One command::

    .venv/bin/python benchmarks/adaptive_overhead.py --path DIR [--workload gpt|moe] [--budget 0.3]
        [--rounds 2] [--warmup 24] [--steps 32] [--replan-every 8] [--device cpu|cuda]

Rounds alternate the order of the four. Prints each variant's median step per round and its
ratio to the static one of the same round, and the CPU seconds a step of the whole process and of
the training thread: on a shared machine CPU time shows what the wall clock's noise hides (every
CPU second another thread spends is one the training's compute may wait for on 2 cores). An adaptive run that adopts a plan no longer runs
``max_in_cpu``'s placement: its DRAM homes are printed beside it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_policies as pp  # noqa: E402

VARIANTS = ("static", "static+profiler", "adaptive, never re-planning", "adaptive")


def configs(w: pp.Workload, swap: Path, budget: int, max_in_cpu: int, replan_every: int) -> dict[str, dict]:
    """The four variants' configs, each with its own folder under ``swap``."""
    out = {}
    for name in VARIANTS:
        folder = pp.folder(swap, name.replace(" ", "_").replace(",", "").replace("+", "_"))
        if name.startswith("static"):
            cfg = pp.policy_config(w, "max_in_cpu", folder, budget, max_in_cpu=max_in_cpu)
            if name == "static+profiler":
                cfg["zinf"]["profiler"] = {"db": f"sqlite:///{folder}/profile.db"}
        else:
            never = name == "adaptive, never re-planning"
            cfg = pp.policy_config(w, "adaptive", folder, budget, max_in_cpu=max_in_cpu,
                                   replan_every=10**6 if never else replan_every)
        out[name] = cfg
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="directory on the disk to measure (swap files go under it)")
    ap.add_argument("--workload", choices=("gpt", "moe"), default="gpt")
    ap.add_argument("--budget", type=float, default=0.3, help="DRAM budget as a fraction of the training state")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--replan-every", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    pp.DEVICE = args.device
    w = pp.make_workload(args.workload, quick=False)
    swap = args.path / "adaptive_overhead"
    shutil.rmtree(swap, ignore_errors=True)
    swap.mkdir(parents=True)
    budget = int(args.budget * w.state_bytes)
    max_in_cpu = pp.largest_max_in_cpu(w, swap, budget)
    if max_in_cpu is None:
        raise SystemExit(f"no max_in_cpu placement fits a {args.budget:.0%} budget; raise --budget")
    print(f"{w.about}; budget {args.budget:.0%} = {budget / 2**20:.0f} MiB; max_in_cpu {max_in_cpu:,}; "
          f"{args.warmup} + {args.steps} steps, side by side in blocks of 8; device {args.device}")
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}  # (process, training thread) s/step
    try:
        for r in range(args.rounds):
            cfgs = configs(w, swap, budget, max_in_cpu, args.replan_every)
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            trainers = [pp.Trainer(w, cfgs[name], warmup=args.warmup, steps=args.steps,
                                   need_controller=name.startswith("adaptive")) for name in order]
            runs = dict(zip(order, pp.side_by_side(trainers, 8)))
            for name in VARIANTS:
                run = runs[name]
                if run.status != "ok":
                    raise SystemExit(f"{name}: {run.status} ({run.note})")
                medians[name].append(statistics.median(run.step_s))
                cpu[name].append((statistics.median(run.cpu_s), statistics.median(run.train_cpu_s)))
            static = medians["static"][-1]
            for name in VARIANTS:
                proc, train = cpu[name][-1]
                print(f"round {r + 1}  {name:28s} {medians[name][-1]:.3f} s  {medians[name][-1] / static:.3f}x static  "
                      f"CPU {proc:.3f} s (training thread {train:.3f}, others {proc - train:.3f})  "
                      f"DRAM homes {runs[name].dram_homes}", flush=True)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    print("\nmedian step per round (s), and its ratio to static's of the same round")
    for name in VARIANTS:
        ratios = [m / s for m, s in zip(medians[name], medians["static"])]
        print(f"  {name:28s} " + "  ".join(f"{m:.3f} ({q:.2f}x)" for m, q in zip(medians[name], ratios)))
    print("\nmedian CPU seconds a step (the whole process; beside it the training thread's), and the ratio to static's")
    for name in VARIANTS:
        print(f"  {name:28s} " + "  ".join(f"{p:.3f}/{t:.3f} ({p / s[0]:.2f}x)" for (p, t), s in zip(cpu[name], cpu["static"])))


if __name__ == "__main__":
    main()
