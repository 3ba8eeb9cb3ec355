"""Every step's time of the planner benchmark's dense GPT at a 20% DRAM budget under three set-ups,
one after another: static ``max_in_cpu``, the same with the profiler recording, and adaptive
(starting from ``max_in_cpu``, re-planning every 8 steps). A ``*`` marks a step during which the
engine's plan version changed. Says whether adaptive's cost is the profiler, the planning steps or
something that grows over the run.

    OMP_NUM_THREADS=8 python3 benchmarks/adaptive_steps_gpt20.py    # swap files under /tmp/diag
"""
import copy, sys, time, shutil, statistics
from pathlib import Path
sys.path.insert(0, "benchmarks")
import planner_policies as pp
w = pp.make_workload("gpt", False)
swap = Path("/tmp/diag"); shutil.rmtree(swap, ignore_errors=True); swap.mkdir()
budget = int(0.2 * w.state_bytes)
n = pp.largest_max_in_cpu(w, swap, budget)
def show(name, cfg):
    d = swap / name; d.mkdir()
    s = str(d); cfg["zero_optimization"]["offload_param"]["nvme_path"] = s; cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = s
    if "profiler" in cfg["zinf"]: cfg["zinf"]["profiler"]["db"] = f"sqlite:///{d}/profile.db"
    t = time.time(); r = pp.train(w, cfg, 24, 32, need_controller=("placement" in cfg["zinf"]))
    versions = [v for _, _, v in r.per_step]
    per = [f"{dt:.2f}{'*' if i and v != versions[i - 1] else ''}" for i, (_, dt, v) in enumerate(r.per_step)]
    print(f"{name}: median measured {statistics.median(r.step_s):.3f} s; wall {time.time()-t:.0f} s", flush=True)
    print("  " + " ".join(per), flush=True)
static = pp.policy_config(w, "max_in_cpu", swap, budget, max_in_cpu=n)
show("static", copy.deepcopy(static))
prof = copy.deepcopy(static); prof["zinf"]["profiler"] = {"enabled": True, "db": "x"}
show("static_profiled", prof)
show("adaptive", pp.policy_config(w, "adaptive", swap, budget, max_in_cpu=n, replan_every=8))
