"""Make a run's plans again, offline (:mod:`planner.replay`): from the inputs the controller
pickled at each plan (``ZINF_PLAN_DUMP=DIR``) and the run's profile database, print what each
plan decides now - with this checkout's planner, and optionally other controller settings -
beside what the run decided then (its ``plans`` table).

    ZINF_PLAN_DUMP=/tmp/dumps python3 benchmarks/planner_policies.py --keep-db /tmp/dbs ...
    .venv/bin/python benchmarks/plan_replay.py --db /tmp/dbs/adaptive.db /tmp/dumps/adaptive-profile_run1_*.pkl
    .venv/bin/python benchmarks/plan_replay.py --db ... --set trial_band=0.1 /tmp/dumps/adaptive-profile_run1_step16.pkl
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

from planner.replay import replay, settings_overrides
from profiler import queries


def run_decisions(db: Path) -> dict[int, str]:
    """The plans the run made, by the step they were made after: one line each."""
    url = f"sqlite:///{db.resolve()}"
    plans = queries.plans(url, queries.latest_run_id(url))
    return {int(p.created_step): f"{'adopted' if p.adopted else 'kept'}, predicted {p.predicted_step_s:.3f} s: "
                                 f"{(p.reason or {}).get('why', '')}" for p in plans.itertuples()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+", type=Path, help="*_step*.pkl files written under ZINF_PLAN_DUMP (one run's)")
    ap.add_argument("--db", type=Path, required=True, help="the run's profile database (SQLite), kept to its end")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a controller setting to replay with instead of the run's (repeatable; JSON values)")
    args = ap.parse_args()
    try:
        overrides = settings_overrides(args.set)
    except (ValueError, json.JSONDecodeError) as e:
        raise SystemExit(f"--set: {e}") from None
    then = run_decisions(args.db)
    scratch = Path(tempfile.mkdtemp(prefix="zinf-replay-"))
    try:
        for path in sorted(args.dumps, key=lambda p: int(re.sub(r".*_step", "", p.stem) or 0)):
            r = replay(args.db, path, scratch, overrides)
            print(f"== plan after step {r.step}" + (" (drifted)" if r.drifted else ""))
            print(f"   then: {then.get(r.step, 'no plan recorded at this step')}")
            for line in r.lines:
                print(f"   now:  {line}")
            if r.record:
                reason = r.record.get("reason") or {}
                keep = {k: reason[k] for k in ("note", "mode", "trial", "mode_untried") if k in reason}
                print(f"   now:  {'adopted' if r.record.get('adopted') else 'kept'}, predicted "
                      f"{r.record.get('predicted_step_s', float('nan')):.3f} s, {len(r.moves)} moves {json.dumps(keep, default=str)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
