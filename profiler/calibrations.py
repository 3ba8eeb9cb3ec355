"""``zinf bench-io`` results in the profile database's ``calibrations`` table.

:func:`save_calibrations` writes the rows :meth:`zinf.bench_io.BenchReport.calibration_rows`
makes (creating or migrating the database first, through Alembic); :func:`load_calibrations`
reads them back as a DataFrame whose column names carry units:

=====================  ==========================================================================
``created_at``         when the bench-io run started (UTC ``pandas.Timestamp``; one per run)
``path``               the directory measured
``fstype``             its filesystem ("ext4", "xfs", "tmpfs", ...)
``op``                 "read" or "write" (zinf's writes are overwrites of existing keys)
``method``             "zinf", or the raw baseline's tool: "fio", "dd" or "python"
``o_direct``           False where the filesystem refused O_DIRECT and buffered I/O was measured
``block_size_bytes``   aio block size (the baseline's request size for baseline rows)
``queue_depth``        aio queue depth (1 for baseline rows)
``thread_count``       aio threads (1 for baseline rows)
``bytes``              bytes moved in that direction
``GBps``               10^9 bytes per second
``raw_baseline_GBps``  the raw baseline of the same run and op (empty on baseline rows)
``vs_raw``             ``GBps / raw_baseline_GBps``
``source``             as stored: "bench-io/<method>", with "/buffered" appended without O_DIRECT
=====================  ==========================================================================

The table itself has no ``method``/``o_direct`` columns (changing it needs a migration);
both are decoded from ``source``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from profiler.queries import calibrations as _query_calibrations
from profiler.recorder import record_calibration

__all__ = ["save_calibrations", "load_calibrations", "COLUMNS"]

BUFFERED_SUFFIX = "/buffered"

COLUMNS = (
    "created_at", "path", "fstype", "op", "method", "o_direct", "block_size_bytes", "queue_depth",
    "thread_count", "bytes", "GBps", "raw_baseline_GBps", "vs_raw", "source",
)


def save_calibrations(url: str, rows: Iterable[Mapping[str, Any]]) -> int:
    """Append bench-io ``rows`` to the ``calibrations`` table of the database at ``url`` (created or
    migrated to the newest schema first). Returns the number of rows written. Raises
    :class:`zinf.errors.ProfileError` when the database cannot be opened or written."""
    return record_calibration(url, rows)


def _method_of(source: object) -> str:
    text = str(source or "")
    text = text.removesuffix(BUFFERED_SUFFIX)
    return text.split("/", 1)[1] if text.startswith("bench-io/") else text


def load_calibrations(url: str, path: str | None = None) -> pd.DataFrame:
    """All calibration rows (only those of directory ``path`` when given), newest run first,
    with the columns listed in the module docstring."""
    df = _query_calibrations(url, None if path is None else str(path))  # newest first, by id within a run
    # runs newest first, the rows of a run in the order they were written
    df = df.iloc[::-1].sort_values("created_at", ascending=False, kind="stable")
    df = df.rename(columns={"block_size": "block_size_bytes"})
    df["method"] = df["source"].map(_method_of)
    df["o_direct"] = ~df["source"].fillna("").str.endswith(BUFFERED_SUFFIX)
    df["vs_raw"] = df["GBps"] / df["raw_baseline_GBps"]
    return df[list(COLUMNS)].reset_index(drop=True)
