"""Make a run's plans again, offline, from what the controller pickled at each plan.

With the environment variable ``ZINF_PLAN_DUMP`` naming a folder, the adaptive controller writes
the inputs of every plan there (:func:`planner.controller.dump_plan_inputs`): its state, the
engine as the plan saw it (:class:`planner.controller.EngineView`) and the newest step the
profile database held then. :func:`replay` makes that plan again against the run's database
(kept to the end of the run: a plan reads it up to its own step, and the copy it reads is cut
where the run's database ended when the plan was made), with this checkout's planner and
optionally other controller settings. A plan that went wrong on a lent GPU machine can so be
studied, and a fix tried, on any machine (``benchmarks/plan_replay.py``).

What a replayed plan does to the controller's state is not carried on: each replay starts from
the state the run had at that plan.
"""
from __future__ import annotations

import copy
import json
import pickle
import sqlite3
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from zinf.placement import Move

from planner.controller import ControllerSettings, _plan_in_child
from planner.policy import PolicySettings


@dataclass
class Replayed:
    """One plan made again: its step, moves, log lines and the plan record it would write
    (``record_plan``'s keyword arguments: ``adopted``, ``predicted_step_s``, ``reason`` ...;
    empty when the plan was skipped)."""

    step: int
    drifted: bool
    moves: list[Move]
    lines: list[str]
    record: dict[str, Any]


def cut_copy(db: Path, last_step: int | None, folder: Path) -> Path:
    """A copy of ``db`` in ``folder`` without the step rows (steps, shard detail, I/O samples)
    after ``last_step`` (None: everything kept)."""
    out = Path(folder) / f"cut{last_step}.db"
    if not out.exists():
        with sqlite3.connect(db) as src, sqlite3.connect(out) as dst:
            src.backup(dst)
        if last_step is not None:
            with sqlite3.connect(out) as con:
                con.execute("DELETE FROM steps WHERE step > ?", (last_step,))
                con.execute("DELETE FROM shard_steps WHERE step + window_steps - 1 > ?", (last_step,))
                con.execute("DELETE FROM io_samples WHERE step > ?", (last_step,))
    return out


def settings_overrides(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs as controller settings - fields of :class:`ControllerSettings` or of
    its :class:`PolicySettings` (``min_gain_fraction``, ``margin`` ...) - each value read as JSON
    (``0.1``, ``null``, ``true``) or, for a text field, as it is."""
    defaults = {**vars(PolicySettings()), **vars(ControllerSettings())}
    del defaults["policy"]
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        if key not in defaults:
            raise ValueError(f"no controller setting {key!r} (one of: {', '.join(sorted(defaults))})")
        out[key] = text if isinstance(defaults[key], str) else json.loads(text)
    return out


def _with_settings(state: dict, overrides: dict[str, Any]) -> dict:
    """The controller ``state`` with ``overrides`` applied to its settings and its policy's."""
    policy_keys = {f.name for f in fields(PolicySettings)}
    mine = {k: v for k, v in overrides.items() if k not in policy_keys}
    theirs = {k: v for k, v in overrides.items() if k in policy_keys}
    settings = replace(state["settings"], **mine)
    if theirs:
        settings = replace(settings, policy=replace(settings.policy, **theirs))
        policy = copy.copy(state["policy"])
        policy.settings = settings.policy
        state = dict(state, policy=policy)
    return dict(state, settings=settings)


def replay(db: Path, dump: Path, scratch: Path, overrides: dict[str, Any] | None = None) -> Replayed:
    """Make the plan pickled in ``dump`` again against the run's database ``db`` (copies are
    cut in ``scratch``), with the controller settings in ``overrides`` changed."""
    blob = pickle.loads(Path(dump).read_bytes())
    url = f"sqlite:///{cut_copy(Path(db), blob.get('db_last_step'), Path(scratch))}"
    state = dict(blob["state"], url=url)
    if overrides:
        state = _with_settings(state, overrides)
    run_id = blob.get("run_id")
    if run_id is None:
        from profiler import queries

        run_id = queries.latest_run_id(url)
    moves, _, calls, lines = _plan_in_child(blob["class"], state, blob["view"], blob["step"], blob["drifted"],
                                            blob["before_s"], run_id)
    record = next((kwargs for name, _, kwargs in calls if name == "record_plan"), {})
    return Replayed(int(blob["step"]), bool(blob["drifted"]), list(moves or []), [line for _, line in lines], record)
