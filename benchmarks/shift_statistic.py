"""The adaptive planner's shift test, step by step, on a profile kept from a run.

One command::

    .venv/bin/python benchmarks/shift_statistic.py --db DIR/adaptive.db [--run ID] [--steps 12-72]
        [--replan-every 8]

A plan is a *reaction* to a routing change when the short EWMA of the shards' accesses per step
has moved from the long one by at least ``retry_rate_change`` (L1, over the shards that vary) and
by more than ``shift_z`` standard deviations of the noise of their difference
(``AdaptiveController.accesses_shifted``). For every step in ``--steps`` this reads the profile up
to that step as a plan made right after it would (no shift before it: the long EWMA at its full
halflife, the full rate window) and prints the statistic (z), the L1 change and whether each
threshold (``change_z``, ``shift_z``) would call it a shift. Keep a run's profile with
``benchmarks/planner_policies.py --keep-db DIR``: its ``adaptive.db`` (steady routing) and, with
``--drift-at``, ``drifted.db`` (a routing change). The accesses do not depend on timing, so a
profile from the VM stands for a GPU's run of the same workload and data.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.controller import AdaptiveController, ControllerSettings, _rate_change, _rates  # noqa: E402


def steps_of(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", type=Path, required=True, help="a profile database (SQLite file)")
    ap.add_argument("--run", type=int, help="the run's id in it (default: the last)")
    ap.add_argument("--steps", default="12-72", help="steps to test after, FIRST-LAST")
    ap.add_argument("--replan-every", type=int, default=8, help="zinf.placement.replan_every of that run")
    args = ap.parse_args()
    if not args.db.is_file():
        raise SystemExit(f"no profile database at {args.db}; keep one with planner_policies.py --keep-db DIR")
    runs = [r[0] for r in sqlite3.connect(args.db).execute("select id from runs order by id")]
    if not runs or (args.run is not None and args.run not in runs):
        raise SystemExit(f"{args.db} has runs {runs}; pass one of them as --run")
    run = args.run if args.run is not None else runs[-1]
    url = f"sqlite:///{args.db}"
    c = AdaptiveController(url, None, 1 << 30, ControllerSettings(replan_every=args.replan_every))
    s = c.settings
    print(f"{args.db} run {run}: change_z {s.change_z:g}, shift_z {s.shift_z:g}, L1 floor {s.retry_rate_change:g}")
    print(f"{'step':>5} {'z':>7} {'L1':>6}  shift at change_z / at shift_z")
    for step in steps_of(args.steps):
        c._step_now = step
        wl = c.read_profile(run, step, "long", timing_steps=2)  # (timings do not enter the test)
        c._caps = wl.shards["accesses_max"].astype(float).set_axis(wl.shards["shard"])
        short, long = _rates(wl, "short"), _rates(wl, "long")
        z = c.shift_statistic(short, long)
        l1 = _rate_change(short, long, varying_only=True)
        moved = l1 >= s.retry_rate_change
        print(f"{step:>5} {z:>7.2f} {l1:>6.3f}  {'yes' if moved and z > s.change_z else 'no':>3} / "
              f"{'yes' if c.accesses_shifted(short, long) else 'no'}")


if __name__ == "__main__":
    main()
