"""Export a run of the profile database: a Chrome trace, or its tables as CSV or Parquet files.

* :func:`export_chrome_trace` - one run as a Chrome Trace Event Format JSON file
  (``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``) that opens in Perfetto
  (ui.perfetto.dev) and ``chrome://tracing``.
* :func:`export_tables` - one run's rows (or every run's, ``run_id=None``) of every table in
  :data:`profiler.schema.TABLES`, one ``<table>.csv`` or ``<table>.parquet`` per table in a
  directory, column names and values as stored.
* :func:`runs_summary` - the runs with their model and last loss (``zinf runs``).

The trace is a *reconstruction*: the database holds per-step totals, not timestamps of each phase.
A step ends when the recorder received its ``StepFinished`` (``steps.recorded_at``) and starts
``wall_s`` before that, moved later if it would overlap the previous step (or, without
``recorded_at``, right after the previous step; the first one at the run's ``started_at``); the
trace's time 0 is the run's ``started_at``. Inside a step the phases are laid end to end -
forward, backward, optimizer, migration - each on its own track; the stall (the waits for shards,
which the engine counts inside forward and backward) is drawn from the start of forward on the
stall track. Per-shard fetch spans (one track per shard, in a second process) come from
``shard_steps.fetch_s`` per step (or window) and start with their step; only the
:data:`MAX_FETCH_SHARDS` shards with the most fetch time get a track, so the file stays bounded
for models with thousands of shards. Migration spans come from the ``migrations`` table, laid end
to end from the start of the migration phase of the step with the same number. No span leaves its
step: where the timers add up to more than ``wall_s`` the phases are scaled down to fit and the
span's args say by how much; a fetch or migration span longer than what is left of its step is cut
and keeps its measured seconds in its args.

Writes are crash-safe: a file is written under a temporary name in the target's folder, fsynced and
renamed into place; a directory is filled as a temporary directory and renamed into place. An
existing non-empty target is replaced only with ``force=True``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from zinf.errors import ProfileError

from profiler import queries, schema
from profiler.store import describe_url, make_engine

__all__ = [
    "ExportError",
    "FORMATS",
    "TABLE_FORMATS",
    "MAX_FETCH_SHARDS",
    "export_chrome_trace",
    "export_tables",
    "parse_run",
    "runs_summary",
]

FORMATS = ("chrome", "csv", "parquet")
TABLE_FORMATS = ("csv", "parquet")
MAX_FETCH_SHARDS = 200  # shard fetch tracks in a Chrome trace: the shards with the most fetch time
CHUNK_ROWS = 50_000  # rows read and written at a time by export_tables

Source = str | URL | Engine
Progress = Callable[[int, int, str], None]

# Chrome trace layout: process 1 holds the step, phase and migration tracks and the counters;
# process 2 one track per shard (thread ids FETCH_TID0 + shard_index, unique across processes).
PID_RUN, PID_FETCH = 1, 2
TRACKS = {  # name -> tid, in display order
    "step": 11,
    "forward": 12,
    "backward": 13,
    "optimizer": 14,
    "migration": 15,
    "stall": 16,
    "migrations (per shard)": 17,
}
FETCH_TID0 = 1000
SEQUENTIAL_PHASES = ("forward", "backward", "optimizer", "migration")
CONFIG_SUMMARY_KEYS = (
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer.type", "optimizer.params.lr",
    "bf16.enabled", "fp16.enabled", "zero_optimization.stage", "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.device", "aio.block_size", "aio.queue_depth", "aio.thread_count",
    "zinf.device", "zinf.dram_budget", "zinf.gpu_budget", "zinf.chunk_size", "zinf.shard_min_bytes",
    "zinf.placement.policy", "zinf.profiler.detail", "zinf.profiler.window_steps", "zinf.autotune.enabled",
)


class ExportError(ProfileError):
    """An export cannot be written as asked: unknown format, missing folder, a target in the way."""


# ---------------------------------------------------------------------------------- helpers
@contextmanager
def _engine(src: Source) -> Iterator[Engine]:
    if isinstance(src, Engine):
        yield src
        return
    engine = make_engine(src, readonly=True)  # a missing SQLite file fails here, naming the URL
    try:
        yield engine
    except ProfileError as e:
        # messages from profiler.queries name the read-only engine's ``file:...?mode=ro`` URI:
        # name the database as the user gave it instead
        inner, shown = describe_url(engine.url), describe_url(src)
        if inner != shown and inner in str(e):
            raise type(e)(str(e).replace(inner, shown)) from None
        raise
    finally:
        engine.dispose()


def parse_run(run: str | int | None, fmt: str) -> int | str | None:
    """The CLI's ``--run``: None (the latest run), ``"all"`` (csv/parquet only) or a run id."""
    if run is None:
        return None
    if isinstance(run, int):
        return run
    text = str(run).strip()
    if text.lower() == "all":
        if fmt not in TABLE_FORMATS:
            raise ExportError("--run all works with --format csv or parquet; a Chrome trace shows one run: give its id")
        return "all"
    try:
        return int(text)
    except ValueError:
        raise ExportError(f"--run {run!r} is not a run id; give a number (see `zinf runs`), or all for csv/parquet") from None


def _resolve_run(engine: Engine, run_id: int | None, shown: str) -> int:
    """``run_id``, checked to exist (the error lists the known ids); None -> the latest run.
    ``shown``: the database as the user named it (the read-only engine's URL is a ``file:`` URI)."""
    if run_id is None:
        latest = queries.latest_run_id(engine)
        if latest is None:
            raise ProfileError(f"no run is recorded in {shown}; record one with the profiler enabled")
        return latest
    with queries._read(engine) as conn:
        queries._check_run(conn, int(run_id), shown)  # "unknown run id N in URL; known: 1, 2, ..."
    return int(run_id)


def _shown(src: Source) -> str:
    return describe_url(src.url if isinstance(src, Engine) else src)


def check_format(fmt: str) -> str:
    f = str(fmt).strip().lower()
    if f not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    return f


def _nonempty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() and (not path.is_file() or path.stat().st_size > 0)


def check_out(out: str | os.PathLike, *, directory: bool, force: bool) -> Path:
    """The output path, checked before anything is read: its folder exists, nothing is in the way."""
    path = Path(out).expanduser()
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ExportError(f"the folder {str(parent)!r} of --out {str(out)!r} does not exist; create it or choose another --out")
    if not directory and path.is_dir():
        raise ExportError(f"--out {str(out)!r} is a directory; a Chrome trace is one file: give a file name such as run.trace.json")
    if _nonempty(path) and not force:
        what = "a non-empty directory" if path.is_dir() else "an existing file"
        raise ExportError(f"--out {str(out)!r} is {what}; choose another path or pass --force to replace it")
    return path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. a filesystem that does not open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _normal_mode(path: Path, *, directory: bool) -> None:
    """mkstemp/mkdtemp make private (0600/0700) entries: give them the mode a plain open() would."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def _write_error(path: Path, e: OSError) -> ExportError:
    return ExportError(f"cannot write {str(path)!r} ({e.strerror or e}); check the folder is writable and has space")


def _atomic_write_file(path: Path, write: Callable[[Any], None], *, binary: bool) -> None:
    parent = path.absolute().parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": ""})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        _normal_mode(Path(tmp), directory=False)
        os.replace(tmp, path)
        _fsync_dir(parent)
    except OSError as e:
        _remove(Path(tmp))
        raise _write_error(path, e) from None
    except BaseException:
        _remove(Path(tmp))
        raise


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink()
    except OSError:  # pragma: no cover - best effort clean-up
        pass


def _install_dir(tmp: Path, path: Path) -> None:
    """Rename the filled temporary directory ``tmp`` to ``path`` (replacing what is there)."""
    parent = path.absolute().parent
    _fsync_dir(tmp)
    old: Path | None = None
    if path.exists() or path.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=parent))
        os.rmdir(old)
        os.rename(path, old)  # moved aside, removed once the new one is in place
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)  # put the previous one back
        raise
    _fsync_dir(parent)
    if old is not None:
        _remove(old)


def _isnan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _num(x: Any) -> float | int | None:
    """A JSON-safe number (None for NULL / NaN)."""
    if x is None or x is pd.NA or x is pd.NaT:
        return None
    try:
        if pd.isna(x):
            return None
    except (TypeError, ValueError):
        pass
    if isinstance(x, bool):
        return int(x)
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    return x


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 3)


def _epoch(ts: Any) -> float | None:
    if ts is None or pd.isna(ts):
        return None
    return float(pd.Timestamp(ts).timestamp())


def _flatten(d: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], d


def _json_obj(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def config_summary(config: Any) -> dict[str, Any]:
    """The settings that shape a run's timeline (placement, batch, I/O), flattened to dotted keys.
    Paths and the database URL are left out: they may hold user names or passwords."""
    flat = dict(_flatten(_json_obj(config) or {}))
    return {k: flat[k] for k in CONFIG_SUMMARY_KEYS if k in flat}


def model_summary(model: Any) -> str:
    """``"GPT, 834.3K params, 19 shards, 16.7 MB state"`` from a run's ``model`` JSON."""
    m = _json_obj(model)
    if not m:
        return ""
    if not isinstance(m, dict):
        return str(m)[:60]
    parts = [str(m.get("class", "?"))]
    if m.get("params") is not None:
        parts.append(f"{_si(m['params'])} params")
    if m.get("shards") is not None:
        parts.append(f"{m['shards']} shards")
    if m.get("state_bytes") is not None:
        parts.append(f"{_si(m['state_bytes'])}B state")
    return ", ".join(parts)


def _si(n: Any) -> str:
    try:
        x = float(n)
    except (TypeError, ValueError):
        return str(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


# ------------------------------------------------------------------------------- Chrome trace
def _step_layout(steps: pd.DataFrame, t0: float) -> pd.DataFrame:
    """Per step row: ``start_s`` (seconds since ``t0``) and ``scale`` (<= 1: the sequential phases
    are shrunk by it when their timers add up to more than the wall time)."""
    starts, scales = [], []
    prev_end = 0.0
    for row in steps.itertuples(index=False):
        wall = max(float(row.wall_s), 0.0)
        rec = _epoch(row.recorded_at)
        start = prev_end if rec is None else max(rec - t0 - wall, prev_end)
        starts.append(start)
        prev_end = start + wall
        seq = sum(max(float(getattr(row, f"{p}_s")), 0.0) for p in SEQUENTIAL_PHASES)
        scales.append(wall / seq if seq > wall and seq > 0 else 1.0)
    out = steps.copy()
    out["start_s"] = starts
    out["scale"] = scales
    return out


def _x(name: str, cat: str, start_s: float, dur_s: float, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": _us(start_s), "dur": _us(max(dur_s, 0.0)),
            "pid": pid, "tid": tid, "args": args}


def _counter(name: str, ts_s: float, values: dict[str, Any]) -> dict:
    return {"name": name, "ph": "C", "ts": _us(ts_s), "pid": PID_RUN, "tid": 0,
            "args": {k: (_num(v) or 0) for k, v in values.items()}}


def _meta(name: str, pid: int, tid: int, value: Any) -> dict:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {key: value}}


def build_chrome_trace(engine: Engine, run_id: int, *, max_fetch_shards: int = MAX_FETCH_SHARDS) -> dict:
    """The Chrome trace of one run, as a dict (see the module docstring for the layout)."""
    info = queries.run_info(engine, run_id)
    steps = queries.steps(engine, run_id)
    t0 = float(info["started_at"])
    lay = _step_layout(steps, t0)
    events: list[dict] = []
    by_step: dict[int, Any] = {}
    for row in lay.itertuples(index=False):
        step, start, wall, k = int(row.step), float(row.start_s), max(float(row.wall_s), 0.0), float(row.scale)
        by_step.setdefault(step, row)  # a repeated step number: the first row anchors its migrations
        args = {"step": step, "micro_batches": int(row.micro_batches), "wall_s": float(row.wall_s),
                "loss": _num(row.loss), "plan_version": int(row.plan_version)}
        if k < 1.0:
            args["phases_scaled_by"] = k
        events.append(_x(f"step {step}", "step", start, wall, PID_RUN, TRACKS["step"], args))
        cursor = start
        for phase in SEQUENTIAL_PHASES:
            secs = max(float(getattr(row, f"{phase}_s")), 0.0)
            if secs > 0:
                pargs = {"step": step, f"{phase}_s": secs}
                if phase in ("forward", "backward"):
                    pargs["micro_batches"] = int(row.micro_batches)
                if k < 1.0:
                    pargs["scaled_by"] = k
                events.append(_x(phase, phase, cursor, secs * k, PID_RUN, TRACKS[phase], pargs))
            cursor += secs * k
        stall = max(float(row.stall_s), 0.0)
        if stall > 0:
            dur = min(stall * k, wall)
            events.append(_x("stall", "stall", start, dur, PID_RUN, TRACKS["stall"], {
                "step": step, "stall_s": stall,
                "note": "total wait for shards during forward+backward; when in the step is not recorded",
            }))

    ss = queries.shard_steps(engine, run_id)
    events += _migration_spans(engine, run_id, by_step)
    fetch_events, fetch_meta, fetch_note = _fetch_spans(ss, lay, int(info.get("shards") or 0), max_fetch_shards)
    events += fetch_events
    events += _counters(engine, run_id, lay, ss)
    events.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))

    meta = [
        _meta("process_name", PID_RUN, 0, f"zinf run {run_id}: {info['name']}"),
        _meta("process_sort_index", PID_RUN, 0, 0),
        _meta("process_name", PID_FETCH, 0, f"shard fetches ({fetch_note})"),
        _meta("process_sort_index", PID_FETCH, 0, 1),
    ]
    for i, (name, tid) in enumerate(TRACKS.items()):
        meta += [_meta("thread_name", PID_RUN, tid, name), _meta("thread_sort_index", PID_RUN, tid, i)]
    meta += fetch_meta

    hardware = _json_obj(info.get("hardware")) or {}
    other = {
        "exported_by": "zinf export",
        "run_id": int(run_id),
        "run_name": info["name"],
        "status": info["status"],
        "started_at_epoch_s": t0,
        "started_at": pd.Timestamp(t0, unit="s", tz="UTC").isoformat(),
        "steps": int(len(steps)),
        "shards": int(info.get("shards") or 0),
        "model": _json_obj(info.get("model")),
        "model_summary": model_summary(info.get("model")),
        "config_summary": config_summary(info.get("config")),
        "hardware": {k: hardware.get(k) for k in ("cpu", "cores", "dram_bytes", "gpu", "gpu_bytes", "torch") if k in hardware},
        "bandwidths": _json_obj(info.get("bandwidths")),
        "o_direct": info.get("o_direct"),
        "detail": info.get("detail"),
        "shard_fetch_tracks": fetch_note,
        "timeline": "time 0 = the run's started_at; a step ends at steps.recorded_at and lasts wall_s; "
                    "phases inside a step are laid end to end from the per-step totals",
    }
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def _step_extents(lay: pd.DataFrame) -> dict[int, tuple[float, float]]:
    """step number -> (start, end) seconds of its span(s)."""
    out: dict[int, tuple[float, float]] = {}
    for step, start, wall in zip(lay["step"], lay["start_s"], lay["wall_s"]):
        a, b = float(start), float(start) + max(float(wall), 0.0)
        old = out.get(int(step))
        out[int(step)] = (a, b) if old is None else (min(old[0], a), max(old[1], b))
    return out


def _step_window(extents: dict[int, tuple[float, float]], first: int, count: int) -> tuple[float, float] | None:
    """The time a window of ``count`` steps from ``first`` covers (None: none of its steps recorded)."""
    spans = [extents[s] for s in range(first, first + max(count, 1)) if s in extents]
    if not spans:
        return None
    return min(a for a, _ in spans), max(b for _, b in spans)


def _fetch_spans(ss: pd.DataFrame, lay: pd.DataFrame, n_shards: int, max_shards: int) -> tuple[list[dict], list[dict], str]:
    if ss.empty or not (ss["fetch_s"] > 0).any():
        return [], [], f"no fetch time recorded for any of the {n_shards} shards"
    totals = ss[ss["fetch_s"] > 0].groupby("shard_id")["fetch_s"].sum().sort_values(ascending=False, kind="stable")
    top = set(totals.index[:max_shards])
    fetched = len(totals)
    note = (f"the top {len(top)} of {fetched} fetched shards by fetch time" if fetched > len(top)
            else f"all {fetched} fetched shards")
    rows = ss[ss["shard_id"].isin(top) & (ss["fetch_s"] > 0)]
    events: list[dict] = []
    windows: dict[tuple[int, int], tuple[float, float] | None] = {}
    extents = _step_extents(lay)
    for r in rows.itertuples(index=False):
        key = (int(r.step), int(r.window_steps))
        if key not in windows:
            windows[key] = _step_window(extents, *key)
        win = windows[key]
        if win is None:
            continue
        start, end = win
        fetch = float(r.fetch_s)
        args = {"shard": r.name, "step": int(r.step), "window_steps": int(r.window_steps), "fetch_s": fetch,
                "stall_s": float(r.stall_s),
                "accesses": int(r.forward_accesses + r.backward_accesses + r.recompute_accesses),
                **{f"read_{t}_bytes": int(getattr(r, f"read_{t}_bytes")) for t in schema.TIERS},
                "param_tier": r.param_tier}
        if fetch > end - start:
            args["cut_to_step"] = True
        events.append(_x(f"fetch {r.name}", "fetch", start, min(fetch, end - start), PID_FETCH,
                         FETCH_TID0 + int(r.shard_index), args))
    meta: list[dict] = []
    names = ss[ss["shard_id"].isin(top)].drop_duplicates("shard_id")[["shard_id", "shard_index", "name"]]
    for r in names.sort_values("shard_index").itertuples(index=False):
        tid = FETCH_TID0 + int(r.shard_index)
        meta += [_meta("thread_name", PID_FETCH, tid, str(r.name)), _meta("thread_sort_index", PID_FETCH, tid, int(r.shard_index))]
    return events, meta, note


def _migration_spans(engine: Engine, run_id: int, by_step: dict[int, Any]) -> list[dict]:
    mig = queries.migrations(engine, run_id)
    if mig.empty:
        return []
    events: list[dict] = []
    cursor = 0.0
    ordered = sorted(by_step)
    for r in mig.itertuples(index=False):
        step = int(r.step)
        row = by_step.get(step)
        if row is not None:
            k = float(row.scale)
            anchor = float(row.start_s) + k * sum(max(float(getattr(row, f"{p}_s")), 0.0) for p in ("forward", "backward", "optimizer"))
            end = float(row.start_s) + max(float(row.wall_s), 0.0)
        else:  # no step row of that number: between the steps around it
            before = [s for s in ordered if s < step]
            anchor = (float(by_step[before[-1]].start_s) + max(float(by_step[before[-1]].wall_s), 0.0)) if before else 0.0
            end = math.inf
        start = max(anchor, cursor)
        if row is not None and start >= end:
            start = end  # the step's migration time is used up: a zero-length mark at its end
        secs = max(float(r.seconds), 0.0)
        dur = min(secs, end - start)
        cursor = start + dur
        args = {"shard": r.shard, "step": step, "state": r.state, "src_tier": r.src_tier, "dst_tier": r.dst_tier,
                "bytes": int(r.bytes), "seconds": secs, "plan_version": _num(r.plan_version)}
        if dur < secs:
            args["cut_to_step"] = True
        events.append(_x(f"{r.state} {r.shard} {r.src_tier}->{r.dst_tier}", "shard_migration", start, dur, PID_RUN,
                         TRACKS["migrations (per shard)"], args))
    return events


def _counters(engine: Engine, run_id: int, lay: pd.DataFrame, ss: pd.DataFrame) -> list[dict]:
    events: list[dict] = []
    if lay.empty:
        return events
    end_s = float((lay["start_s"] + lay["wall_s"].clip(lower=0)).max())
    tiers = list(schema.TIERS)
    # per-step amounts: the value holds over its step; zeros after the last one
    for row in lay.itertuples(index=False):
        t = float(row.start_s)
        events.append(_counter("read bytes per step by tier (cpu = DRAM)", t, {x: getattr(row, f"read_{x}_bytes") for x in tiers}))
        events.append(_counter("written bytes per step by tier (cpu = DRAM)", t, {x: getattr(row, f"written_{x}_bytes") for x in tiers}))
    events.append(_counter("read bytes per step by tier (cpu = DRAM)", end_s, dict.fromkeys(tiers, 0)))
    events.append(_counter("written bytes per step by tier (cpu = DRAM)", end_s, dict.fromkeys(tiers, 0)))
    # occupancy measured at the end of each step
    for row in lay.itertuples(index=False):
        t = float(row.start_s) + max(float(row.wall_s), 0.0)
        events.append(_counter("memory (bytes)", t, {"dram": row.dram_bytes, "pinned": row.pinned_bytes,
                                                     "gpu": row.gpu_bytes, "rss": row.rss_bytes}))
    events += _homed_bytes(engine, run_id, lay, ss)
    # bandwidth per tier and direction, from the I/O samples of each step
    bw = queries.bandwidth_over_time(engine, run_id)
    if not bw.empty:
        bw_tiers = sorted(set(bw["tier"]), key=lambda x: tiers.index(x) if x in tiers else len(tiers))
        by = {(int(r.step), r.tier): r for r in bw.itertuples(index=False)}
        for row in lay.drop_duplicates("step").itertuples(index=False):
            t, step = float(row.start_s), int(row.step)
            for op in ("read", "write"):
                vals = {}
                for tier in bw_tiers:
                    r = by.get((step, tier))
                    vals[tier] = 0.0 if r is None else (_num(getattr(r, f"{op}_GBps")) or 0.0)
                events.append(_counter(f"{op} bandwidth by tier (GB/s)", t, vals))
        for op in ("read", "write"):
            events.append(_counter(f"{op} bandwidth by tier (GB/s)", end_s, dict.fromkeys(bw_tiers, 0.0)))
    return events


def _homed_bytes(engine: Engine, run_id: int, lay: pd.DataFrame, ss: pd.DataFrame) -> list[dict]:
    """Param + optimizer-state bytes whose home is on each tier: the shards' tiers at the start,
    then as ``shard_steps`` (tiers at the end of each window) or, without it, ``migrations`` say."""
    sh = queries.shards(engine, run_id)
    if sh.empty:
        return []
    name = "homed state bytes by tier (cpu = DRAM)"
    tiers = list(schema.TIERS)
    size = {int(r.shard_id): (int(r.param_bytes), int(r.optim_bytes)) for r in sh.itertuples(index=False)}
    where = {int(r.shard_id): [r.param_tier, r.optim_tier] for r in sh.itertuples(index=False)}
    total = dict.fromkeys(tiers, 0)
    for sid, (pt, ot) in where.items():
        if pt in total:
            total[pt] += size[sid][0]
        if ot in total:
            total[ot] += size[sid][1]
    events = [_counter(name, 0.0, total)]
    changes: dict[int, list[tuple[int, int, str]]] = {}  # last step of a window -> (shard, state 0/1, tier)
    if not ss.empty:
        for r in ss.itertuples(index=False):
            last = int(r.step) + max(int(r.window_steps), 1) - 1
            for state, tier in ((0, r.param_tier), (1, r.optim_tier)):
                if isinstance(tier, str):
                    changes.setdefault(last, []).append((int(r.shard_id), state, tier))
    else:
        mig = queries.migrations(engine, run_id)
        ids = {str(r.name): int(r.shard_id) for r in sh.itertuples(index=False)}
        for r in mig.itertuples(index=False):
            if str(r.shard) in ids:
                changes.setdefault(int(r.step), []).append((ids[str(r.shard)], 0 if r.state == "param" else 1, r.dst_tier))
    for row in lay.drop_duplicates("step", keep="last").itertuples(index=False):
        for sid, state, tier in changes.get(int(row.step), []):
            old = where[sid][state]
            if old == tier:
                continue
            b = size[sid][state]
            if old in total:
                total[old] -= b
            if tier in total:
                total[tier] += b
            where[sid][state] = tier
        events.append(_counter(name, float(row.start_s) + max(float(row.wall_s), 0.0), total))
    return events


def export_chrome_trace(src: Source, run_id: int | None, out_path: str | os.PathLike, *, force: bool = False,
                        max_fetch_shards: int = MAX_FETCH_SHARDS) -> Path:
    """Write one run (None: the latest) as a Chrome trace JSON file; returns its path."""
    path = check_out(out_path, directory=False, force=force)
    with _engine(src) as engine:
        rid = _resolve_run(engine, run_id, _shown(src))
        trace = build_chrome_trace(engine, rid, max_fetch_shards=max_fetch_shards)
    text = json.dumps(trace, allow_nan=False, separators=(",", ":"), default=str)
    _atomic_write_file(path, lambda f: f.write(text), binary=False)
    return path


# ------------------------------------------------------------------------------ CSV / Parquet
def _dtype(col: sa.Column) -> str:
    t = col.type
    if isinstance(t, sa.Boolean):
        return "boolean"
    if isinstance(t, sa.Integer):
        return "Int64"
    if isinstance(t, sa.Float):
        return "float64"
    return "object"


def _select(table: sa.Table, run_id: int | None) -> sa.Select:
    cols = [sa.type_coerce(c, sa.Text).label(c.name) if isinstance(c.type, sa.JSON) else c for c in table.c]
    stmt = sa.select(*cols)
    if run_id is not None:
        if table is schema.runs:
            stmt = stmt.where(table.c.id == run_id)
        elif "run_id" in table.c:
            stmt = stmt.where(table.c.run_id == run_id)
        elif table is schema.plan_assignments:
            stmt = stmt.where(table.c.plan_id.in_(sa.select(schema.plans.c.id).where(schema.plans.c.run_id == run_id)))
        # calibrations belong to a disk, not a run: all of them are exported
    pk = list(table.primary_key.columns)
    return stmt.order_by(*pk)


def _frame(table: sa.Table, rows: list) -> pd.DataFrame:
    data = {}
    for i, col in enumerate(table.c):
        values = [r[i] for r in rows]
        if isinstance(col.type, sa.JSON):
            values = [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
        data[col.name] = pd.Series(values, dtype=_dtype(col))
    return pd.DataFrame(data, columns=[c.name for c in table.c])


def table_frame(conn: sa.Connection, name: str, run_id: int | None) -> pd.DataFrame:
    """One table's rows (one run's, or all with None) with the stored column names and values;
    JSON columns as their JSON text, integer/boolean columns nullable (``Int64``/``boolean``)."""
    table = schema.metadata.tables[name]
    return _frame(table, conn.execute(_select(table, run_id)).all())


def _arrow_schema(table: sa.Table):
    import pyarrow as pa

    def typ(col: sa.Column):
        t = col.type
        if isinstance(t, sa.Boolean):
            return pa.bool_()
        if isinstance(t, sa.Integer):
            return pa.int64()
        if isinstance(t, sa.Float):
            return pa.float64()
        return pa.string()

    return pa.schema([pa.field(c.name, typ(c), nullable=True) for c in table.c])


def _write_table(conn: sa.Connection, table: sa.Table, run_id: int | None, file: Path, fmt: str,
                 chunk_rows: int | None = None) -> int:
    """Stream one table's rows into ``file`` (``chunk_rows``, default :data:`CHUNK_ROWS`, at a
    time, so memory stays bounded for long runs), fsync it; returns the row count."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    result = conn.execute(_select(table, run_id))
    n = 0
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrow = _arrow_schema(table)
        with open(file, "wb") as f:
            with pq.ParquetWriter(f, arrow) as writer:
                wrote = False
                for rows in result.partitions(chunk_rows):
                    writer.write_table(pa.Table.from_pandas(_frame(table, rows), schema=arrow, preserve_index=False))
                    n += len(rows)
                    wrote = True
                if not wrote:
                    writer.write_table(pa.Table.from_pandas(_frame(table, []), schema=arrow, preserve_index=False))
            f.flush()
            os.fsync(f.fileno())
        return n
    with open(file, "w", encoding="utf-8", newline="") as f:
        header = True
        for rows in result.partitions(chunk_rows):
            _frame(table, rows).to_csv(f, index=False, header=header)
            header = False
            n += len(rows)
        if header:
            _frame(table, []).to_csv(f, index=False)
        f.flush()
        os.fsync(f.fileno())
    return n


def export_tables(src: Source, run_id: int | None, out_dir: str | os.PathLike, fmt: str, *,
                  force: bool = False, progress: Progress | None = None) -> list[Path]:
    """Write every table's rows of run ``run_id`` (None: of all runs) as ``<out_dir>/<table>.csv``
    or ``.parquet``; returns the files' final paths. ``runs`` is filtered by id, the tables with a
    ``run_id`` by it, ``plan_assignments`` through its plan; ``calibrations`` (per disk, not per
    run) is exported whole. All tables are read in one read transaction, so the files are one
    consistent snapshot even while a run is still writing."""
    fmt = check_format(fmt)
    if fmt not in TABLE_FORMATS:
        raise ExportError(f"export_tables writes {' or '.join(TABLE_FORMATS)}, not {fmt!r}; use export_chrome_trace")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ExportError("Parquet export needs pyarrow; `pip install pyarrow`, or use --format csv") from None
    path = check_out(out_dir, directory=True, force=force)
    with _engine(src) as engine:
        rid = None if run_id is None else _resolve_run(engine, run_id, _shown(src))
        parent = path.absolute().parent
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=parent))
        except OSError as e:
            raise _write_error(path, e) from None
        try:
            _normal_mode(tmp, directory=True)
            written: list[str] = []
            total = len(schema.TABLES)
            with engine.connect() as conn:  # one read transaction: one snapshot of all tables
                for i, name in enumerate(schema.TABLES):
                    if progress is not None:
                        progress(i, total, name)
                    fname = f"{name}.{fmt}"
                    _write_table(conn, schema.metadata.tables[name], rid, tmp / fname, fmt)
                    written.append(fname)
            if progress is not None:
                progress(total, total, "done")
            _install_dir(tmp, path)
        except OSError as e:
            _remove(tmp)
            raise _write_error(path, e) from None
        except sa.exc.DBAPIError as e:
            _remove(tmp)
            msg = str(e.orig if e.orig is not None else e).splitlines()[0]
            raise ProfileError(f"cannot read profile database {_shown(src)} ({msg}); "
                               f"run `zinf db upgrade --db {_shown(src)}` if its schema is older") from None
        except BaseException:
            _remove(tmp)
            raise
    return [path / f for f in written]



# ------------------------------------------------------------------------------------- runs
def runs_summary(src: Source) -> pd.DataFrame:
    """:func:`profiler.queries.list_runs` plus ``model`` (a one-line summary) and ``last_loss``
    (the loss of each run's last recorded step)."""
    with _engine(src) as engine:
        runs = queries.list_runs(engine)
        st = schema.steps
        last_ids = sa.select(sa.func.max(st.c.id)).group_by(st.c.run_id)
        with engine.connect() as conn:
            try:
                models = dict(conn.execute(sa.select(schema.runs.c.id, sa.type_coerce(schema.runs.c.model, sa.Text))).all())
                losses = dict(conn.execute(sa.select(st.c.run_id, st.c.loss).where(st.c.id.in_(last_ids))).all())
            except sa.exc.DBAPIError as e:  # pragma: no cover - list_runs already read these tables
                raise ProfileError(f"cannot read profile database {_shown(src)} ({e.orig})") from None
    runs["model"] = [model_summary(models.get(int(r))) for r in runs["run_id"]]
    runs["last_loss"] = [losses.get(int(r)) for r in runs["run_id"]]
    runs["last_loss"] = pd.to_numeric(runs["last_loss"], errors="coerce").astype("float64")
    return runs
