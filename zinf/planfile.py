"""The saved-plan file (``plan.json``): a placement chosen offline, to start a training run from.

``zinf plan --db URL --dram-budget SIZE --out plan.json`` (and ``zinf report``) write one; the
config key ``"zinf": {"placement": {"plan_file": "plan.json"}}`` makes :func:`zinf.initialize`
start from it. The format, version 1::

    {
      "format": "zinf-plan",
      "version": 1,
      "run_id": 3,                        # the profiled run the plan was made from
      "dram_budget_bytes": 8589934592,    # the DRAM budget it was made for
      "predicted_step_s": 0.41,           # the planner's predicted step time (seconds)
      "placement": {"blocks.0.attn.c_attn.weight": {"param": "cpu", "optim": "nvme"}, ...},
      "created_at": "2025-01-31T12:00:00Z"
    }

``placement`` names every shard of the model (the keys of ``engine.placement``) with the tier of
its param home and of its optimizer home: "gpu" (the compute device), "cpu" (DRAM) or "nvme";
the optimizer home of a frozen shard is "none".

This module is part of the engine core: it reads and checks the JSON itself, and imports nothing
from the profiler, the planner or the dashboard. Every problem with a file is one
:class:`~zinf.errors.ConfigError` line naming the file and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zinf.errors import ConfigError

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "HOME_TIERS", "plan_document", "read_plan_file"]

PLAN_FORMAT = "zinf-plan"
"""The ``format`` field of every plan file."""
PLAN_VERSION = 1
"""The version this zinf writes and reads."""
HOME_TIERS = ("gpu", "cpu", "nvme")
"""Tiers a home may have in a plan file ("none" too, for the optimizer home of a frozen shard)."""

_FIX = "write a new one with `zinf plan --db URL --dram-budget SIZE --out FILE`"


def plan_document(*, run_id: int, dram_budget_bytes: int, predicted_step_s: float,
                  placement: dict[str, dict[str, str]], created_at: str) -> dict[str, Any]:
    """The JSON object of a plan file (see the module docstring), keys in the documented order."""
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "run_id": int(run_id),
        "dram_budget_bytes": int(dram_budget_bytes),
        "predicted_step_s": float(predicted_step_s),
        "placement": {name: {"param": str(t["param"]), "optim": str(t["optim"])} for name, t in placement.items()},
        "created_at": str(created_at),
    }


def read_plan_file(path: str | os.PathLike) -> dict[str, Any]:
    """The checked contents of a plan file: its JSON object, whose ``placement`` is
    {shard: {"param": tier, "optim": tier}}. Raises :class:`ConfigError` (one line) when the
    file is missing, unreadable, not JSON, not a zinf plan, of another version, or malformed."""
    p = Path(path).expanduser()
    where = f"zinf.placement.plan_file {str(path)!r}"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; check the path (relative paths start at the working directory) "
                          f"or {_FIX}") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory; give the plan's JSON file") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ConfigError(f"{where} cannot be read ({reason}); check its permissions or {_FIX}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); "
                          f"the file is damaged: {_FIX}") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"{where} is not a zinf plan (format {found!r}, expected {PLAN_FORMAT!r}); {_FIX}")
    if doc.get("version") != PLAN_VERSION:
        raise ConfigError(f"{where} has plan version {doc.get('version')!r}; this zinf reads version {PLAN_VERSION}: {_FIX}")
    placement = doc.get("placement")
    if not isinstance(placement, dict) or not placement:
        raise ConfigError(f"{where} has no placement (an object of shard -> {{\"param\": tier, \"optim\": tier}}); {_FIX}")
    for name, tiers in placement.items():
        if not isinstance(tiers, dict) or set(tiers) != {"param", "optim"}:
            raise ConfigError(f"{where}: shard {name!r} must map to {{\"param\": tier, \"optim\": tier}}, got {tiers!r}; {_FIX}")
        if tiers["param"] not in HOME_TIERS:
            raise ConfigError(f"{where}: shard {name!r} has param tier {tiers['param']!r}; use one of "
                              f"{', '.join(HOME_TIERS)}")
        if tiers["optim"] not in (*HOME_TIERS, "none"):
            raise ConfigError(f"{where}: shard {name!r} has optim tier {tiers['optim']!r}; use one of "
                              f"{', '.join(HOME_TIERS)} (\"none\" for a frozen shard)")
    return doc
