"""The planner's simulator against what each placement measured, offline, from profile databases
kept by ``benchmarks/step_phases.py --keep-db DIR``: per database, the median step of its newest
steps (the placement in force there) against the simulator's step for that placement, *before*
calibration - the overhead calibrating would add (measured - simulated) is the model's error on it.

A placement's gain is the difference of two predictions, so what matters is that the overhead is
the same for every placement: its spread over the databases of one workload is the error of the
predicted gains. Run it under two trees to compare simulators on the same measurements:

    .venv/bin/python benchmarks/step_phases.py --path /work/tmp/sp --workload moe --budget 0.3 \\
        --policies dram,nvme,adaptive --keep-db /work/tmp/dbs
    .venv/bin/python benchmarks/model_replay.py /work/tmp/dbs/*.db

The disk's cost model comes from the first database with I/O samples (an all-DRAM run has none):
the runs share the disk. The overlap buffers are the config's, as the profile records it: a run
whose engine switched buffers off under its budget (``max_in_cpu`` at 30% on the MoE: no room for
updates during backward) is replayed with them on, and its overhead is off by that too.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from planner import CostModel, Workload, simulate
from planner.costmodel import CostModelError
from profiler import queries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dbs", nargs="+", type=Path, help="profile databases (SQLite) of one workload")
    ap.add_argument("--last-steps", type=int, default=16, help="the newest steps of each run to take the measurement from")
    args = ap.parse_args()
    runs = []
    cost = None
    for db in args.dbs:
        url = f"sqlite:///{db}"
        run_id = queries.latest_run_id(url)
        runs.append((db, url, run_id))
        if cost is None:
            try:
                cost = CostModel.from_db(url, run_id)
            except CostModelError:
                continue  # no NVMe traffic in this run
    if cost is None:
        raise SystemExit("none of the databases has I/O samples to fit the disk's cost model from; add a run with state on NVMe")
    print(f"{'database':<30}{'measured_s':>11}{'simulated_s':>12}{'overhead_s':>11}{'fwd_s':>8}{'bwd_s':>8}{'opt_s':>8}{'stall_s':>8}")
    overheads = []
    for db, url, run_id in runs:
        wl = Workload.from_profile(url, run_id, last_steps=args.last_steps)
        raw = simulate(wl.with_overhead(0.0), wl.measured_placement, cost)
        overhead = wl.measured_step_s - raw.step_s
        overheads.append(overhead)
        print(f"{db.name:<30}{wl.measured_step_s:>11.3f}{raw.step_s:>12.3f}{overhead:>+11.3f}"
              f"{raw.forward_s:>8.3f}{raw.backward_s:>8.3f}{raw.optimizer_s:>8.3f}{raw.stall_s:>8.3f}")
    print(f"spread of the overhead (max - min): {max(overheads) - min(overheads):.3f} s")


if __name__ == "__main__":
    main()
