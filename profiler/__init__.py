"""zinf's profiler: records what the engine measures into the profile database, and reads it back.

* :class:`Recorder` - give it to the engine (``zinf.initialize(..., recorder=Recorder(url))``, or
  set ``zinf.profiler.enabled``); events are queued and written by a background thread.
* :func:`upgrade` - create or migrate a database (Alembic, ``alembic upgrade head``).
* :mod:`profiler.queries` - pandas DataFrames of runs, steps, shard access statistics, bandwidth.
* :func:`record_calibration` - store ``zinf bench-io`` results.

Layering: this package imports ``zinf.events`` and ``zinf.errors`` only; zinf's core never imports
it (``zinf.initialize`` wires it in when the config asks for it).
"""

from __future__ import annotations

from profiler import queries, schema, store
from profiler.recorder import Recorder, record_calibration
from profiler.store import current_revision, head_revision, make_engine, open_readonly, upgrade

__all__ = [
    "Recorder",
    "upgrade",
    "queries",
    "schema",
    "store",
    "record_calibration",
    "current_revision",
    "head_revision",
    "make_engine",
    "open_readonly",
]
