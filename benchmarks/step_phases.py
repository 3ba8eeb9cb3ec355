"""Where a placement policy's step goes: the per-phase medians (forward, backward, optimizer,
stall; seconds per optimizer step, as the engine's ``last_step`` times them) and the NVMe bytes
per step of the planner benchmark's workloads under one DRAM budget, policy after policy, with
the overlap buffers the engine granted each placement. Every run records a profile, so that the
planner's model of each placement can be replayed offline from the databases kept (``--keep-db``).

Answers "why is policy A slower than policy B here": more stall (I/O not hidden), more optimizer
time (updates not overlapped), or the same phases and more overhead. ``loop_s`` is the wall clock
around the whole training-loop step (data included), as ``planner_policies.py`` measures it;
``--cprofile N`` prints Python's profile of the training thread over the last N steps (on a CPU
device the backward's hooks run there too; with CUDA they run on autograd's device thread).

    OMP_NUM_THREADS=8 python3 benchmarks/step_phases.py --path /tmp/sp --workload gpt --budget 0.2 --device cuda
"""
from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import shutil
import sqlite3
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_policies as pp  # noqa: E402

import zinf  # noqa: E402

PHASES = ("wall_s", "forward_s", "backward_s", "optimizer_s", "stall_s")
# loop_s: the wall clock around the training loop's step (data, every micro-batch, the step's end),
# as planner_policies.py measures it; wall_s is the engine's own clock (first forward to the end
# of the optimizer step and the controller's call)
COLUMNS = ("loop_s",) + PHASES


def run_policy(w: pp.Workload, policy: str, swap: Path, budget: int, n_max: int, args) -> dict:
    """Train ``args.warmup + args.steps`` optimizer steps under ``policy``; medians of the measured ones."""
    d = swap / policy
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    if policy == "dram":  # the floor: every home in DRAM, no budget, no NVMe traffic
        cfg = pp.policy_config(w, "nvme", d, None, replan_every=args.replan_every)
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        del cfg["zinf"]["dram_budget"]
    else:
        cfg = pp.policy_config(w, policy, d, budget, max_in_cpu=n_max, replan_every=args.replan_every)
    cfg["zinf"]["profiler"] = {"enabled": True, "db": f"sqlite:///{d}/profile.db"}  # every policy records (like for like)
    engine = zinf.initialize(pp.copy.deepcopy(w.model), cfg)
    rows, nvme_b, predicted = [], [], []
    pf_before = engine.prefetch_stats  # moved to the end of warm-up below
    n_steps = args.warmup + args.steps
    profiled = max(0, n_steps - args.torch_profile) if args.torch_profile else None
    prof = None
    cprof = cProfile.Profile() if args.cprofile else None
    with engine:
        micro = 0
        for step in range(n_steps):
            if step == profiled:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                              + ([torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else []))
                prof.__enter__()
            if cprof is not None and step == n_steps - args.cprofile:
                cprof.enable()
            before = engine.traffic_total
            before_b = before.read["nvme"] + before.written["nvme"]
            prediction = getattr(getattr(engine, "controller", None), "predicted_step_s", None)
            t0 = time.perf_counter()
            micro = pp.optimizer_step(engine, w, micro)
            loop_s = time.perf_counter() - t0
            if step == args.warmup - 1:
                pf_before = engine.prefetch_stats
            if step >= args.warmup:
                rows.append({k: engine.last_step[k] for k in PHASES} | {"loop_s": loop_s})
                after = engine.traffic_total
                nvme_b.append(after.read["nvme"] + after.written["nvme"] - before_b)
                if prediction is not None:
                    predicted.append(prediction)
        if cprof is not None:
            cprof.disable()
            print(f"--- cProfile, {policy}, the training thread over the last {args.cprofile} steps (seconds over them)")
            pstats.Stats(cprof, stream=sys.stdout).sort_stats("tottime").print_stats(args.torch_profile_rows)
            pstats.Stats(cprof, stream=sys.stdout).sort_stats("cumulative").print_stats(args.torch_profile_rows)
        if prof is not None:
            prof.__exit__(None, None, None)
            print(f"--- torch.profiler, {policy}, the last {args.torch_profile} steps (ms over them; main thread and workers)")
            table = prof.key_averages()
            print(table.table(sort_by="cpu_time_total", row_limit=args.torch_profile_rows))
            print(table.table(sort_by="self_cpu_time_total", row_limit=args.torch_profile_rows))
        ov = engine.overlap  # the buffers of the placement in force at the end
        pf = engine.prefetch_stats
        homes = pp.dram_homes(engine)
    if args.keep_db:
        args.keep_db.mkdir(parents=True, exist_ok=True)
        # SQLite's backup, not a file copy: rows still in the WAL file (a planning process may
        # have kept a reader open, so nothing was checkpointed at close) come along
        with sqlite3.connect(d / "profile.db") as src, sqlite3.connect(args.keep_db / f"{w.name}_{policy}_{args.budget:g}.db") as dst:
            src.backup(dst)
    shutil.rmtree(d, ignore_errors=True)
    out = {k: statistics.median(r[k] for r in rows) for k in COLUMNS}
    out["nvme_MB"] = statistics.median(nvme_b) / 1e6
    out["predicted_s"] = statistics.median(predicted) if predicted else None
    out["buffers"] = (f"prefetch {ov.prefetch_bytes >> 20} MiB, write {ov.write_bytes >> 20} MiB, "
                      f"read-ahead {ov.read_ahead_bytes >> 20} MiB, eager {'on' if ov.eager else 'off'}")
    out["homes"] = homes
    out["prefetch"] = ", ".join(f"{k} {(getattr(pf, k) - getattr(pf_before, k)) / len(rows):.1f}"
                                for k in ("issued", "hinted", "hits", "misses", "dropped", "kept"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", type=Path, required=True, help="swap files go under it (removed at the end)")
    ap.add_argument("--workload", choices=("gpt", "moe"), default="gpt")
    ap.add_argument("--budget", type=float, default=0.2, help="DRAM budget as a fraction of the training state")
    ap.add_argument("--policies", default="nvme,max_in_cpu,adaptive",
                    help="comma-separated; 'dram' (every home in DRAM, no budget) gives the floor")
    ap.add_argument("--warmup", type=int, default=24, help="optimizer steps before measuring")
    ap.add_argument("--steps", type=int, default=16, help="measured optimizer steps per policy")
    ap.add_argument("--replan-every", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N",
                    help="run torch.profiler over each policy's last N steps and print its table of ops")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="run Python's cProfile on the training thread over each policy's last N steps and print its top functions")
    ap.add_argument("--torch-profile-rows", type=int, default=40, help="rows of each profile table printed")
    ap.add_argument("--keep-db", type=Path, default=None, help="copy each run's profile database here")
    ap.add_argument("--no-hints", action="store_true",
                    help="zinf.prefetch_hints off: the MoE's routed experts are not read ahead on its word")
    args = ap.parse_args()
    pp.DEVICE = args.device
    if args.no_hints:
        pp.ZINF_EXTRA["prefetch_hints"] = False
    w = pp.make_workload(args.workload, False)
    args.path.mkdir(parents=True, exist_ok=True)
    budget = int(args.budget * w.state_bytes)
    n_max = pp.largest_max_in_cpu(w, args.path, budget) or 0
    print(f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({os.cpu_count()} cores), zinf.device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "") + f", torch {torch.__version__}")
    print(f"{w.about}; budget {args.budget:.0%} = {budget >> 20} MiB; max_in_cpu {n_max}; "
          f"{args.warmup} + {args.steps} steps per policy")
    print(f"{'policy':<11}" + "".join(f"{k:>12}" for k in COLUMNS) + f"{'NVMe MB':>9}{'predicted':>11}")
    for policy in args.policies.split(","):
        r = run_policy(w, policy, args.path, budget, n_max, args)
        pred = f"{r['predicted_s']:.3f}" if r["predicted_s"] is not None else "-"
        print(f"{policy:<11}" + "".join(f"{r[k]:12.3f}" for k in COLUMNS) + f"{r['nvme_MB']:9.1f}{pred:>11}", flush=True)
        print(f"{'':<11}buffers: {r['buffers']}; DRAM homes: {r['homes']}", flush=True)
        print(f"{'':<11}param prefetch a step: {r['prefetch']}", flush=True)


if __name__ == "__main__":
    main()
