"""Every step's time of the planner benchmark's dense GPT at a 20% DRAM budget under three set-ups,
one after another: static ``max_in_cpu``, the same with the profiler recording, and adaptive
(starting from ``max_in_cpu``, re-planning every 8 steps). A ``*`` marks a step during which the
engine's plan version changed, a ``p`` one after which the controller planned; the seconds the
controller's ``after_step`` took are summed per run (the planning cost on the training thread).
Says whether adaptive's cost is the profiler, the planning steps or something that grows over the run.
The adaptive line also says in how many steps the profiler sampled its shard detail (the
controller's ``sparse_detail_every``, on while a dense model's accesses are the same every step).

    OMP_NUM_THREADS=8 python3 benchmarks/adaptive_steps_gpt20.py [--path /tmp/diag] [--budget 0.2] [--rounds 1]
"""
import argparse, copy, sys, time, shutil, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_policies as pp

ap = argparse.ArgumentParser()
ap.add_argument("--path", type=Path, default=Path("/tmp/diag"), help="swap files go under it (removed at the end)")
ap.add_argument("--budget", type=float, default=0.2, help="DRAM budget as a fraction of the training state")
ap.add_argument("--rounds", type=int, default=1, help="rounds of the three set-ups (order rotated)")
ap.add_argument("--replan-every", type=int, default=8, help="adaptive's zinf.placement.replan_every (10**6: never re-plans after the first)")
ap.add_argument("--setups", default="static,static_profiled,adaptive", help="which set-ups to run, comma-separated")
args = ap.parse_args()
w = pp.make_workload("gpt", False)
swap = args.path; shutil.rmtree(swap, ignore_errors=True); swap.mkdir(parents=True)
budget = int(args.budget * w.state_bytes)
n = pp.largest_max_in_cpu(w, swap, budget)
medians: dict[str, list[float]] = {}


def show(name, cfg, r):
    d = swap / f"{name}-{r}"; d.mkdir()
    s = str(d); cfg["zero_optimization"]["offload_param"]["nvme_path"] = s; cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = s
    if "profiler" in cfg["zinf"]: cfg["zinf"]["profiler"]["db"] = f"sqlite:///{d}/profile.db"
    adaptive = "placement" in cfg["zinf"]
    hook_s, planned, every = [], set(), []
    if adaptive:  # time the controller's hook (planning runs in it, on the training thread)
        from planner.controller import AdaptiveController
        orig = AdaptiveController.after_step

        def timed(self, engine):
            t0 = time.perf_counter()
            try:
                return orig(self, engine)
            finally:
                hook_s.append(time.perf_counter() - t0)
                every.append(getattr(self, "detail_every", 1))  # the profiler's shard-detail sampling
                if self.last_plan_step == engine.global_steps:
                    planned.add(engine.global_steps - 1)  # pp.train counts steps from 0
        AdaptiveController.after_step = timed
    t = time.time()
    try:
        run = pp.train(w, cfg, 24, 32, need_controller=adaptive)
    finally:
        if adaptive:
            AdaptiveController.after_step = orig
    versions = [v for _, _, v in run.per_step]
    per = [f"{dt:.2f}{'*' if i and v != versions[i - 1] else ''}{'p' if i in planned else ''}"
           for i, (_, dt, v) in enumerate(run.per_step)]
    med = statistics.median(run.step_s)
    medians.setdefault(name, []).append(med)
    extra = f"; controller hook {sum(hook_s):.2f} s over {len(hook_s)} steps ({len(planned)} plans)" if adaptive else ""
    if adaptive:
        sparse = [i for i, k in enumerate(every) if k > 1]
        extra += (f"; shard detail 1 step in {max(every)} in {len(sparse)} steps (from step {sparse[0]})" if sparse
                  else "; shard detail every step")
    print(f"{name}: median measured {med:.3f} s; wall {time.time()-t:.0f} s{extra}", flush=True)
    print("  " + " ".join(per), flush=True)


static = pp.policy_config(w, "max_in_cpu", swap, budget, max_in_cpu=n)
prof = copy.deepcopy(static); prof["zinf"]["profiler"] = {"enabled": True, "db": "x"}
setups = [("static", static), ("static_profiled", prof),
          ("adaptive", pp.policy_config(w, "adaptive", swap, budget, max_in_cpu=n, replan_every=args.replan_every))]
setups = [s for s in setups if s[0] in args.setups.split(",")]
try:
    for r in range(args.rounds):
        for name, cfg in setups[r % len(setups):] + setups[:r % len(setups)]:
            show(name, copy.deepcopy(cfg), r)
    print("medians of the 32 measured steps per round: " + "; ".join(
        f"{k} {' / '.join(f'{m:.3f}' for m in v)}" for k, v in medians.items()))
finally:
    shutil.rmtree(swap, ignore_errors=True)
