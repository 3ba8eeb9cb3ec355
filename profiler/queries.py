"""Read the profile database into pandas DataFrames (for the planner, the dashboard and users).

Every function takes a SQLAlchemy URL (opened read-only, SQLite ``mode=ro``, so it can run beside
a training process that is writing) or an engine from :func:`profiler.store.open_readonly`.
Column names carry their units: ``_s`` seconds, ``_bytes`` bytes, ``_GBps`` 10^9 bytes per second,
``_at`` timestamps (UTC ``pandas.Timestamp``).

A run's ``status`` here is the *effective* one: a row still ``running`` whose process is gone
(same host: its pid is dead or reused) or whose heartbeat is older than ``stale_after_s`` is
reported as ``crashed``; ``recorded_status`` keeps what the row says.
"""

from __future__ import annotations

import math
import socket
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pandas as pd
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Engine

from zinf.errors import ProfileError

from profiler import schema
from profiler.store import describe_url, pid_alive, reading

STALE_AFTER_S = 60.0

__all__ = [
    "list_runs",
    "latest_run_id",
    "run_info",
    "steps",
    "shards",
    "shard_steps",
    "shard_access_stats",
    "io_samples",
    "bandwidth_over_time",
    "migrations",
    "plans",
    "plan_assignments",
    "tuning_trials",
    "calibrations",
    "effective_status",
    "STALE_AFTER_S",
    # pages and bins, for the dashboard
    "run_progress",
    "run_metadata",
    "run_totals",
    "steps_page",
    "io_samples_page",
    "migrations_page",
    "migrations_per_step",
    "plan_info",
    "plan_assignments_page",
    "homed_bytes",
    "shard_totals",
    "shard_heatmap",
]

Source = str | URL | Engine


@contextmanager
def _read(src: Source) -> Iterator[sa.Connection]:
    shown = describe_url(src.url if isinstance(src, Engine) else src)
    with reading(src) as conn:
        try:
            yield conn
        except sa_exc.OperationalError as e:
            msg = str(e.orig if e.orig is not None else e).splitlines()[0]
            if "no such table" in msg or "no such column" in msg or "does not exist" in msg:
                raise ProfileError(
                    f"profile database {shown} has no (or an older) profile schema ({msg}); "
                    f"run `zinf db upgrade --db {shown}`"
                ) from None
            raise ProfileError(f"cannot read profile database {shown} ({msg}); check the URL and that the file is readable") from None
        except sa_exc.DBAPIError as e:
            msg = str(e.orig if e.orig is not None else e).splitlines()[0]
            raise ProfileError(f"cannot read profile database {shown} ({msg}); check the URL and that the file is readable") from None


def _frame(conn: sa.Connection, stmt, columns: list[str] | None = None) -> pd.DataFrame:
    result = conn.execute(stmt)
    keys = list(result.keys())
    # plain tuples: pandas probes a Row object's attributes one by one (~8 us a row)
    return pd.DataFrame([tuple(r) for r in result], columns=columns or keys)


def _ts(s: pd.Series) -> pd.Series:
    return pd.to_datetime(pd.to_numeric(s, errors="coerce"), unit="s", utc=True)


def _check_run(conn: sa.Connection, run_id: int, shown: str) -> None:
    found = conn.execute(sa.select(schema.runs.c.id).where(schema.runs.c.id == int(run_id))).first()
    if found is None:
        ids = [r[0] for r in conn.execute(sa.select(schema.runs.c.id).order_by(schema.runs.c.id))]
        if not ids:
            known = "none (no run recorded yet)"
        elif len(ids) > 20:
            known = ", ".join(map(str, ids[:5])) + ", ..., " + ", ".join(map(str, ids[-10:]))
        else:
            known = ", ".join(map(str, ids))
        raise ProfileError(f"unknown run id {run_id} in {shown}; known: {known}")


def _shown(src: Source) -> str:
    return describe_url(src.url if isinstance(src, Engine) else src)


def effective_status(
    status: str,
    *,
    hostname: str | None,
    pid: int | None,
    pid_start_ticks: int | None,
    last_heartbeat: float | None,
    started_at: float | None,
    now: float | None = None,
    stale_after_s: float = STALE_AFTER_S,
    this_host: str | None = None,
) -> str:
    """``status``, except that a ``running`` row whose process is gone reads ``crashed``."""
    if status != "running":
        return status
    this_host = this_host or socket.gethostname()
    if hostname == this_host and pid:
        alive = pid_alive(int(pid), None if _isnull(pid_start_ticks) else int(pid_start_ticks))
        if alive is False:
            return "crashed"
        if alive is True:
            return "running"
    now = time.time() if now is None else now
    beat = last_heartbeat if not _isnull(last_heartbeat) else started_at
    if beat is None or _isnull(beat) or now - float(beat) > stale_after_s:
        return "crashed"
    return "running"


def _isnull(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


# ------------------------------------------------------------------------------------- runs
def list_runs(src: Source, *, stale_after_s: float = STALE_AFTER_S) -> pd.DataFrame:
    """One row per run: ``run_id, name, status, recorded_status, started_at, finished_at,
    last_heartbeat_at, duration_s, steps, median_step_s, total_wall_s, hostname, pid, dropped_events``."""
    r = schema.runs
    with _read(src) as conn:
        runs = _frame(conn, sa.select(
            r.c.id.label("run_id"), r.c.name, r.c.status.label("recorded_status"), r.c.started_at,
            r.c.finished_at, r.c.last_heartbeat, r.c.hostname, r.c.pid, r.c.pid_start_ticks, r.c.dropped_events,
        ).order_by(r.c.id))
        walls = _frame(conn, sa.select(schema.steps.c.run_id, schema.steps.c.wall_s))
    if walls.empty:
        agg = pd.DataFrame({"steps": pd.Series(dtype="int64"), "median_step_s": pd.Series(dtype="float64"),
                            "total_wall_s": pd.Series(dtype="float64")})
    else:
        g = walls.groupby("run_id")["wall_s"]
        agg = pd.DataFrame({"steps": g.size(), "median_step_s": g.median(), "total_wall_s": g.sum()})
    runs = runs.merge(agg, left_on="run_id", right_index=True, how="left")
    runs["steps"] = runs["steps"].fillna(0).astype("int64")
    now, host = time.time(), socket.gethostname()
    runs["status"] = [
        effective_status(row.recorded_status, hostname=row.hostname, pid=None if _isnull(row.pid) else int(row.pid),
                         pid_start_ticks=row.pid_start_ticks, last_heartbeat=row.last_heartbeat,
                         started_at=row.started_at, now=now, stale_after_s=stale_after_s, this_host=host)
        for row in runs.itertuples()
    ]
    end = runs["finished_at"].where(runs["finished_at"].notna(), runs["last_heartbeat"])
    runs["duration_s"] = pd.to_numeric(end, errors="coerce") - pd.to_numeric(runs["started_at"], errors="coerce")
    runs["started_at"] = _ts(runs["started_at"])
    runs["finished_at"] = _ts(runs["finished_at"])
    runs["last_heartbeat_at"] = _ts(runs["last_heartbeat"])
    cols = ["run_id", "name", "status", "recorded_status", "started_at", "finished_at", "last_heartbeat_at",
            "duration_s", "steps", "median_step_s", "total_wall_s", "hostname", "pid", "dropped_events"]
    return runs[cols].reset_index(drop=True)


def latest_run_id(src: Source) -> int | None:
    """The id of the newest run, or None when no run is recorded."""
    with _read(src) as conn:
        v = conn.execute(sa.select(sa.func.max(schema.runs.c.id))).scalar()
    return None if v is None else int(v)


def run_info(src: Source, run_id: int, *, stale_after_s: float = STALE_AFTER_S) -> dict[str, Any]:
    """Everything stored about one run (config, model, hardware, bandwidths, ...) as a dict."""
    r = schema.runs
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        row = conn.execute(sa.select(r).where(r.c.id == int(run_id))).mappings().one()
        n_steps = conn.execute(sa.select(sa.func.count()).select_from(schema.steps).where(schema.steps.c.run_id == int(run_id))).scalar()
        n_shards = conn.execute(sa.select(sa.func.count()).select_from(schema.shards).where(schema.shards.c.run_id == int(run_id))).scalar()
    info = dict(row)
    info["run_id"] = info.pop("id")
    info["recorded_status"] = info["status"]
    info["status"] = effective_status(
        info["status"], hostname=info["hostname"], pid=info["pid"], pid_start_ticks=info["pid_start_ticks"],
        last_heartbeat=info["last_heartbeat"], started_at=info["started_at"], stale_after_s=stale_after_s,
    )
    info["steps"] = int(n_steps or 0)
    info["shards"] = int(n_shards or 0)
    return info


# ------------------------------------------------------------------------------------ steps
def steps(src: Source, run_id: int) -> pd.DataFrame:
    """One row per optimizer step: ``step, wall_s, forward_s, backward_s, optimizer_s, stall_s,
    migration_s, loss, read_<tier>_bytes, written_<tier>_bytes, dram_bytes, ..., plan_version``."""
    t = schema.steps
    cols = [c for c in t.c if c.name not in ("id", "run_id")]
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        df = _frame(conn, sa.select(*cols).where(t.c.run_id == int(run_id)).order_by(t.c.step, t.c.id))
    df["recorded_at"] = _ts(df["recorded_at"])
    return df


def shards(src: Source, run_id: int) -> pd.DataFrame:
    """The run's shards as recorded at its start (``shard_id, shard_index, name, module, kind, numel,
    param_bytes, optim_bytes, grad_bytes, members, param_tier, optim_tier``)."""
    t = schema.shards
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        df = _frame(conn, sa.select(t.c.id.label("shard_id"), *[c for c in t.c if c.name not in ("id", "run_id")])
                    .where(t.c.run_id == int(run_id)).order_by(t.c.shard_index))
    return df


def shard_steps(src: Source, run_id: int, *, first_step: int | None = None, last_step: int | None = None,
                covering: bool = False) -> pd.DataFrame:
    """The raw per-shard, per-window rows, with the shard's ``name``; only the rows whose ``step``
    is in ``[first_step, last_step]`` when given (filtered in SQL: the planner reads the last few
    steps of a run that may have 10^6 rows). ``covering``: also the rows of windows that start
    before ``first_step`` and reach it (a sampled run's rows stand for up to
    :data:`profiler.recorder.MAX_SHARD_DETAIL_EVERY` steps, ending with the sampled one)."""
    from profiler.recorder import MAX_SHARD_DETAIL_EVERY

    ss, sh = schema.shard_steps, schema.shards
    cols = [c for c in ss.c if c.name not in ("id", "run_id")]
    where = [ss.c.run_id == int(run_id)]
    if first_step is not None and covering:
        where.append(ss.c.step >= int(first_step) - MAX_SHARD_DETAIL_EVERY + 1)
        where.append(ss.c.step + ss.c.window_steps > int(first_step))
    elif first_step is not None:
        where.append(ss.c.step >= int(first_step))
    if last_step is not None:
        where.append(ss.c.step <= int(last_step))
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        df = _frame(conn, sa.select(*cols, sh.c.name, sh.c.shard_index)
                    .join_from(ss, sh, ss.c.shard_id == sh.c.id)
                    .where(*where).order_by(ss.c.step, sh.c.shard_index))
    return df


def shard_access_stats(src: Source, run_id: int, first_step: int | None = None, last_step: int | None = None) -> pd.DataFrame:
    """Per shard, over the windows that start in ``[first_step, last_step]``: accesses by phase,
    bytes by tier, fetch/stall/optimizer seconds (``fetch_overhead_s``: the part of the stall of its
    fetches not spent waiting for a read; ``update_s``: of ``optimizer_s``, the updates alone; both 0
    in profiles older than schema 0003), totals and per-step rates, and the tiers at the
    end of the range. ``steps`` is the number of steps the rates are divided by (those of the
    selected windows). Shards never accessed in the range are listed with zeros."""
    ss, sh, st = schema.shard_steps, schema.shards, schema.steps
    rid = int(run_id)
    sums = ["forward_accesses", "backward_accesses", "recompute_accesses", "optimizer_accesses",
            *[f"read_{t}_bytes" for t in schema.TIERS], *[f"written_{t}_bytes" for t in schema.TIERS],
            "fetch_s", "stall_s", "fetch_overhead_s", "optimizer_s", "update_s"]
    cond = [ss.c.run_id == rid]
    if first_step is not None:
        cond.append(ss.c.step >= int(first_step))
    if last_step is not None:
        cond.append(ss.c.step <= int(last_step))
    with _read(src) as conn:
        _check_run(conn, rid, _shown(src))
        base = _frame(conn, sa.select(
            sh.c.id.label("shard_id"), sh.c.shard_index, sh.c.name, sh.c.module, sh.c.kind, sh.c.numel,
            sh.c.param_bytes, sh.c.optim_bytes, sh.c.grad_bytes,
            sh.c.param_tier.label("initial_param_tier"), sh.c.optim_tier.label("initial_optim_tier"),
        ).where(sh.c.run_id == rid).order_by(sh.c.shard_index))
        agg = _frame(conn, sa.select(
            ss.c.shard_id, *[sa.func.sum(ss.c[c]).label(c) for c in sums],
            sa.func.count().label("windows"),
        ).where(*cond).group_by(ss.c.shard_id))
        last = sa.select(ss.c.shard_id, sa.func.max(ss.c.step).label("m")).where(*cond).group_by(ss.c.shard_id).subquery()
        tiers = _frame(conn, sa.select(ss.c.shard_id, ss.c.param_tier, ss.c.optim_tier)
                       .join(last, sa.and_(ss.c.shard_id == last.c.shard_id, ss.c.step == last.c.m))
                       .where(ss.c.run_id == rid))
        # the divisor of the per-step rates: the steps of the windows selected (a window holds
        # window_steps steps); without shard rows (detail="step"), the recorded steps in the range
        windows = conn.execute(sa.select(ss.c.step, sa.func.max(ss.c.window_steps)).where(*cond).group_by(ss.c.step)).all()
        if windows:
            n_steps = int(sum(w for _, w in windows))
        else:
            scond = [st.c.run_id == rid]
            if first_step is not None:
                scond.append(st.c.step >= int(first_step))
            if last_step is not None:
                scond.append(st.c.step <= int(last_step))
            n_steps = int(conn.execute(sa.select(sa.func.count()).select_from(st).where(*scond)).scalar() or 0)
    tiers = tiers.drop_duplicates("shard_id", keep="last")
    df = base.merge(agg, on="shard_id", how="left").merge(tiers, on="shard_id", how="left")
    for c in sums + ["windows"]:
        df[c] = df[c].fillna(0)
        if c.endswith(("_accesses", "_bytes")) or c == "windows":
            df[c] = df[c].astype("int64")
        else:
            df[c] = df[c].astype("float64")
    df["param_tier"] = df["param_tier"].where(df["param_tier"].notna(), df["initial_param_tier"])
    df["optim_tier"] = df["optim_tier"].where(df["optim_tier"].notna(), df["initial_optim_tier"])
    df["total_accesses"] = df[["forward_accesses", "backward_accesses", "recompute_accesses", "optimizer_accesses"]].sum(axis=1)
    df["read_bytes"] = df[[f"read_{t}_bytes" for t in schema.TIERS]].sum(axis=1)
    df["written_bytes"] = df[[f"written_{t}_bytes" for t in schema.TIERS]].sum(axis=1)
    df["steps"] = n_steps
    div = float(n_steps) if n_steps else float("nan")
    df["accesses_per_step"] = df["total_accesses"] / div
    df["read_bytes_per_step"] = df["read_bytes"] / div
    df["fetch_s_per_step"] = df["fetch_s"] / div
    df["stall_s_per_step"] = df["stall_s"] / div
    df["optimizer_s_per_step"] = df["optimizer_s"] / div
    return df.reset_index(drop=True)


# --------------------------------------------------------------------------------------- I/O
def io_samples(src: Source, run_id: int, *, first_step: int | None = None, last_step: int | None = None) -> pd.DataFrame:
    """The recorded I/O samples (``step, shard, op, tier, what, bytes, seconds, GBps, o_direct,
    block_size, queue_depth, thread_count, concurrency``); subsampled beyond the recorder's per-step
    cap. ``concurrency``: mean requests in flight on the disk while the sample ran, itself included
    (NaN in profiles recorded before zinf measured it). ``first_step``: only samples of that step
    and later (a planner refitting during a long run needs the recent ones); ``last_step``: of that
    step and earlier (a plan made while training goes on reads what there was when it was due)."""
    io, sh = schema.io_samples, schema.shards
    cols = [c for c in io.c if c.name not in ("id", "run_id")]
    where = io.c.run_id == int(run_id)
    if first_step is not None:
        where = where & (io.c.step >= int(first_step))
    if last_step is not None:
        where = where & (io.c.step <= int(last_step))
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        df = _frame(conn, sa.select(*cols, sh.c.name.label("shard"))
                    .join_from(io, sh, io.c.shard_id == sh.c.id, isouter=True)
                    .where(where).order_by(io.c.step, io.c.id))
    secs = df["seconds"].astype("float64")
    df["GBps"] = (df["bytes"].astype("float64") / secs.where(secs > 0)) / 1e9
    return df


def bandwidth_over_time(src: Source, run_id: int) -> pd.DataFrame:
    """Per step and tier, from the I/O samples: ``read_bytes, read_s, read_samples, read_GBps``
    and the same for ``write``. GB/s = sum(bytes) / sum(seconds) / 1e9 (NaN without samples)."""
    io = schema.io_samples
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        agg = _frame(conn, sa.select(
            io.c.step, io.c.tier, io.c.op, sa.func.count().label("samples"),
            sa.func.sum(io.c.bytes).label("bytes"), sa.func.sum(io.c.seconds).label("seconds"),
        ).where(io.c.run_id == int(run_id)).group_by(io.c.step, io.c.tier, io.c.op))
    out_cols = ["step", "tier", "read_bytes", "read_s", "read_samples", "read_GBps",
                "write_bytes", "write_s", "write_samples", "write_GBps"]
    if agg.empty:
        return pd.DataFrame({c: pd.Series(dtype="object" if c == "tier" else "float64") for c in out_cols})
    df = agg[["step", "tier"]].drop_duplicates().sort_values(["step", "tier"]).reset_index(drop=True)
    for op in ("read", "write"):
        part = agg[agg["op"] == op].rename(columns={"bytes": f"{op}_bytes", "seconds": f"{op}_s", "samples": f"{op}_samples"})
        df = df.merge(part.drop(columns="op"), on=["step", "tier"], how="left")
        df[f"{op}_bytes"] = df[f"{op}_bytes"].fillna(0).astype("int64")
        df[f"{op}_samples"] = df[f"{op}_samples"].fillna(0).astype("int64")
        df[f"{op}_s"] = df[f"{op}_s"].fillna(0.0).astype("float64")
        secs = df[f"{op}_s"]
        df[f"{op}_GBps"] = df[f"{op}_bytes"].astype("float64") / secs.where(secs > 0) / 1e9
    return df[out_cols]


# -------------------------------------------------------------------- plans, migrations, tuning
def migrations(src: Source, run_id: int) -> pd.DataFrame:
    """Tier moves of shards between steps (``step, plan_version, shard, state, src_tier, dst_tier, bytes, seconds``)."""
    m, sh = schema.migrations, schema.shards
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        return _frame(conn, sa.select(m.c.step, m.c.plan_version, sh.c.name.label("shard"), m.c.state, m.c.src_tier,
                                      m.c.dst_tier, m.c.bytes, m.c.seconds)
                      .join_from(m, sh, m.c.shard_id == sh.c.id).where(m.c.run_id == int(run_id)).order_by(m.c.step, m.c.id))


def plans(src: Source, run_id: int) -> pd.DataFrame:
    """The run's plans (``plan_id, version, created_step, created_at, policy, dram_budget_bytes,
    predicted_step_s, predicted_gain_s, adopted, reason, assignments``)."""
    p, a = schema.plans, schema.plan_assignments
    n = sa.select(sa.func.count()).where(a.c.plan_id == p.c.id).scalar_subquery()
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        df = _frame(conn, sa.select(p.c.id.label("plan_id"), *[c for c in p.c if c.name not in ("id", "run_id")],
                                    n.label("assignments")).where(p.c.run_id == int(run_id)).order_by(p.c.version, p.c.id))
    df["created_at"] = _ts(df["created_at"])
    return df


def plan_assignments(src: Source, plan_id: int) -> pd.DataFrame:
    """One plan's per-shard tiers and scores (``shard, shard_index, param_tier, optim_tier, score``)."""
    a, sh = schema.plan_assignments, schema.shards
    with _read(src) as conn:
        return _frame(conn, sa.select(sh.c.name.label("shard"), sh.c.shard_index, a.c.param_tier, a.c.optim_tier, a.c.score)
                      .join_from(a, sh, a.c.shard_id == sh.c.id).where(a.c.plan_id == int(plan_id)).order_by(sh.c.shard_index))


def tuning_trials(src: Source, run_id: int | None = None) -> pd.DataFrame:
    """Autotuner trials (all, or one run's): ``run_id, step, created_at, setting, step_s, chosen``."""
    t = schema.tuning_trials
    stmt = sa.select(*[c for c in t.c if c.name != "id"]).order_by(t.c.id)
    if run_id is not None:
        stmt = stmt.where(t.c.run_id == int(run_id))
    with _read(src) as conn:
        df = _frame(conn, stmt)
    df["created_at"] = _ts(df["created_at"])
    return df


def calibrations(src: Source, path: str | None = None) -> pd.DataFrame:
    """bench-io results (optionally of one ``path``), newest first."""
    c = schema.calibrations
    stmt = sa.select(*[col for col in c.c if col.name != "id"]).order_by(c.c.created_at.desc(), c.c.id.desc())
    if path is not None:
        stmt = stmt.where(c.c.path == str(path))
    with _read(src) as conn:
        df = _frame(conn, stmt)
    df["created_at"] = _ts(df["created_at"])
    return df


# ------------------------------------------------------------- pages and bins (the dashboard)
# The dashboard asks for a slice of a large table at a time: these read only the rows of one page
# (``limit``/``offset`` in SQL, ``total`` counted on an index) or aggregate in SQL, so a request
# costs the same on a run with 10^6 shard-step rows as on one with 10^3.
def run_progress(src: Source, run_id: int) -> dict[str, Any]:
    """Counters that change whenever the recorder writes to a run (cheap: index look-ups only):
    ``steps, last_step, last_plan_id, last_migration_id, recorded_status, last_heartbeat``. A
    reader caches what it computed from a run under these and recomputes when they change."""
    st, p, m, r = schema.steps, schema.plans, schema.migrations, schema.runs
    rid = int(run_id)
    with _read(src) as conn:
        _check_run(conn, rid, _shown(src))
        n, last = conn.execute(sa.select(sa.func.count(), sa.func.max(st.c.step)).where(st.c.run_id == rid)).one()
        last_plan = conn.execute(sa.select(sa.func.max(p.c.id)).where(p.c.run_id == rid)).scalar()
        last_mig = conn.execute(sa.select(sa.func.max(m.c.id)).where(m.c.run_id == rid)).scalar()
        status, beat = conn.execute(sa.select(r.c.status, r.c.last_heartbeat).where(r.c.id == rid)).one()
    return {"steps": int(n or 0), "last_step": None if last is None else int(last), "last_plan_id": last_plan,
            "last_migration_id": last_mig, "recorded_status": status, "last_heartbeat": beat}


def run_metadata(src: Source) -> pd.DataFrame:
    """Per run, the JSON the recorder stored at its start: ``run_id, model, hardware`` (dicts)."""
    r = schema.runs
    with _read(src) as conn:
        return _frame(conn, sa.select(r.c.id.label("run_id"), r.c.model, r.c.hardware).order_by(r.c.id),
                      ["run_id", "model", "hardware"])


def run_totals(src: Source) -> pd.DataFrame:
    """Per run with steps: ``run_id, wall_s_total, stall_s_total, stall_fraction`` (stall seconds over
    wall seconds, summed over the run's steps)."""
    st = schema.steps
    with _read(src) as conn:
        df = _frame(conn, sa.select(st.c.run_id, sa.func.sum(st.c.wall_s).label("wall_s_total"),
                                    sa.func.sum(st.c.stall_s).label("stall_s_total")).group_by(st.c.run_id))
    wall = df["wall_s_total"].astype("float64")
    df["stall_fraction"] = df["stall_s_total"].astype("float64") / wall.where(wall > 0)
    return df


def steps_page(src: Source, run_id: int, *, after_step: int | None = None, limit: int | None = None) -> pd.DataFrame:
    """:func:`steps`, only the rows with ``step > after_step`` (all when None), the first ``limit``
    of them in step order: what a live page polls for."""
    t = schema.steps
    cols = [c for c in t.c if c.name not in ("id", "run_id")]
    stmt = sa.select(*cols).where(t.c.run_id == int(run_id))
    if after_step is not None:
        stmt = stmt.where(t.c.step > int(after_step))
    stmt = stmt.order_by(t.c.step, t.c.id)
    if limit is not None:
        stmt = stmt.limit(int(limit))
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        df = _frame(conn, stmt, [c.name for c in cols])
    df["recorded_at"] = _ts(df["recorded_at"])
    return df


def _count(conn: sa.Connection, table: sa.Table, *where) -> int:
    return int(conn.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar() or 0)


def io_samples_page(src: Source, run_id: int, *, limit: int, offset: int = 0,
                    first_step: int | None = None) -> tuple[pd.DataFrame, int]:
    """One page of :func:`io_samples` in recording order, and the number of samples in all pages."""
    io, sh = schema.io_samples, schema.shards
    cols = [c for c in io.c if c.name not in ("id", "run_id")]
    where = [io.c.run_id == int(run_id)]
    if first_step is not None:
        where.append(io.c.step >= int(first_step))
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        total = _count(conn, io, *where)
        df = _frame(conn, sa.select(*cols, sh.c.name.label("shard"))
                    .join_from(io, sh, io.c.shard_id == sh.c.id, isouter=True)
                    .where(*where).order_by(io.c.step, io.c.id).limit(int(limit)).offset(int(offset)),
                    [*(c.name for c in cols), "shard"])
    secs = df["seconds"].astype("float64")
    df["GBps"] = (df["bytes"].astype("float64") / secs.where(secs > 0)) / 1e9
    return df, total


def migrations_page(src: Source, run_id: int, *, limit: int, offset: int = 0) -> tuple[pd.DataFrame, int]:
    """One page of :func:`migrations` in recording order, and the number of migrations in all pages."""
    m, sh = schema.migrations, schema.shards
    cols = ["step", "plan_version", "shard", "state", "src_tier", "dst_tier", "bytes", "seconds"]
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        total = _count(conn, m, m.c.run_id == int(run_id))
        df = _frame(conn, sa.select(m.c.step, m.c.plan_version, sh.c.name.label("shard"), m.c.state, m.c.src_tier,
                                    m.c.dst_tier, m.c.bytes, m.c.seconds)
                    .join_from(m, sh, m.c.shard_id == sh.c.id).where(m.c.run_id == int(run_id))
                    .order_by(m.c.step, m.c.id).limit(int(limit)).offset(int(offset)), cols)
    return df, total


def migrations_per_step(src: Source, run_id: int) -> pd.DataFrame:
    """Migrations summed per step and direction: ``step, src_tier, dst_tier, moves, bytes, seconds``."""
    m = schema.migrations
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        return _frame(conn, sa.select(m.c.step, m.c.src_tier, m.c.dst_tier, sa.func.count().label("moves"),
                                      sa.func.sum(m.c.bytes).label("bytes"), sa.func.sum(m.c.seconds).label("seconds"))
                      .where(m.c.run_id == int(run_id)).group_by(m.c.step, m.c.src_tier, m.c.dst_tier)
                      .order_by(m.c.step, m.c.src_tier, m.c.dst_tier),
                      ["step", "src_tier", "dst_tier", "moves", "bytes", "seconds"])


def plan_info(src: Source, plan_id: int) -> dict[str, Any]:
    """One plan's row (as in :func:`plans`, with ``run_id``); an unknown id is a ProfileError."""
    p, a = schema.plans, schema.plan_assignments
    n = sa.select(sa.func.count()).where(a.c.plan_id == p.c.id).scalar_subquery()
    with _read(src) as conn:
        row = conn.execute(sa.select(p.c.id.label("plan_id"), *[c for c in p.c if c.name != "id"], n.label("assignments"))
                           .where(p.c.id == int(plan_id))).mappings().first()
        if row is None:
            last = conn.execute(sa.select(sa.func.max(p.c.id))).scalar()
            known = "none (no plan recorded yet)" if last is None else f"1 to {last}"
            raise ProfileError(f"unknown plan id {plan_id} in {_shown(src)}; known: {known}")
    info = dict(row)
    info["created_at"] = None if info["created_at"] is None else pd.Timestamp(info["created_at"], unit="s", tz="UTC")
    return info


def plan_assignments_page(src: Source, plan_id: int, *, limit: int, offset: int = 0) -> tuple[pd.DataFrame, int]:
    """One page of :func:`plan_assignments` (in shard order) and the plan's number of assignments."""
    a, sh = schema.plan_assignments, schema.shards
    cols = ["shard", "shard_index", "param_tier", "optim_tier", "score"]
    with _read(src) as conn:
        total = _count(conn, a, a.c.plan_id == int(plan_id))
        df = _frame(conn, sa.select(sh.c.name.label("shard"), sh.c.shard_index, a.c.param_tier, a.c.optim_tier, a.c.score)
                    .join_from(a, sh, a.c.shard_id == sh.c.id).where(a.c.plan_id == int(plan_id))
                    .order_by(sh.c.shard_index).limit(int(limit)).offset(int(offset)), cols)
    return df, total


def homed_bytes(src: Source, run_id: int) -> pd.DataFrame:
    """Bytes whose home is each tier, per recorded step: ``step, gpu_bytes, cpu_bytes, nvme_bytes``.

    A shard's param home holds ``param_bytes`` and its optimizer home ``optim_bytes``; the homes at
    the run's start (``shards``) are replayed through the recorded migrations. A migration recorded
    with step ``k`` happened between steps ``k`` and ``k + 1`` (the engine's ``global_steps``), so
    step ``s`` counts the migrations with step ``< s``. Optimizer homes of frozen shards (tier
    ``none``) count nowhere.
    """
    sh, m, st = schema.shards, schema.migrations, schema.steps
    rid = int(run_id)
    moved = sa.case((m.c.state == "param", sh.c.param_bytes), else_=sh.c.optim_bytes)
    with _read(src) as conn:
        _check_run(conn, rid, _shown(src))
        start: dict[str, int] = {t: 0 for t in schema.TIERS}
        for state in ("param", "optim"):
            tier, nbytes = sh.c[f"{state}_tier"], sh.c[f"{state}_bytes"]
            for t, b in conn.execute(sa.select(tier, sa.func.sum(nbytes)).where(sh.c.run_id == rid).group_by(tier)):
                if t in start:
                    start[t] += int(b or 0)
        deltas = _frame(conn, sa.select(m.c.step, m.c.src_tier, m.c.dst_tier, sa.func.sum(moved).label("bytes"))
                        .join_from(m, sh, m.c.shard_id == sh.c.id).where(m.c.run_id == rid)
                        .group_by(m.c.step, m.c.src_tier, m.c.dst_tier), ["step", "src_tier", "dst_tier", "bytes"])
        step_nums = [r[0] for r in conn.execute(sa.select(st.c.step).where(st.c.run_id == rid).distinct().order_by(st.c.step))]
    out = pd.DataFrame({"step": pd.Series(step_nums, dtype="int64")})
    for t in schema.TIERS:
        change = pd.Series(0, index=deltas.index, dtype="int64")
        if len(deltas):
            b = deltas["bytes"].astype("int64")
            change = b.where(deltas["dst_tier"] == t, 0) - b.where(deltas["src_tier"] == t, 0)
        # the change in force at step s: the migrations recorded at steps < s
        per_step = change.groupby(deltas["step"]).sum().sort_index().cumsum() if len(deltas) else pd.Series(dtype="int64")
        if per_step.empty:
            out[f"{t}_bytes"] = start[t]
        else:
            idx = per_step.index.searchsorted(out["step"].to_numpy(), side="left") - 1
            vals = per_step.to_numpy()
            out[f"{t}_bytes"] = start[t] + pd.Series(vals[idx.clip(min=0)], dtype="int64").where(idx >= 0, 0).to_numpy()
    return out


def _indexed_by(conn: sa.Connection, table: sa.Table, *columns: str) -> Any:
    """``table`` as a FROM clause that on SQLite walks its index on ``columns`` (``INDEXED BY``:
    SQLAlchemy's ``with_hint`` renders nothing on SQLite), elsewhere the table itself. Select
    unbound ``sa.column(name)`` columns from it."""
    if conn.dialect.name != "sqlite":
        return table
    index = next(ix for ix in table.indexes if [c.name for c in ix.columns] == list(columns))
    return sa.text(f"{table.name} INDEXED BY {index.name}")


def shard_totals(src: Source, run_id: int) -> pd.DataFrame:
    """Per shard with recorded accesses, its ``shard_steps`` rows summed over the whole run in one
    pass: ``shard_id, forward_accesses, backward_accesses, recompute_accesses, optimizer_accesses,
    read_bytes, written_bytes, fetch_s, stall_s, optimizer_s, windows``. (:func:`shard_access_stats`
    says more - bytes per tier, tiers per window, a step range - and costs ~3x as much on 10^6 rows.)"""
    c = sa.column
    phases = ["forward_accesses", "backward_accesses", "recompute_accesses", "optimizer_accesses"]
    read = sum((c(f"read_{t}_bytes") for t in schema.TIERS[1:]), c(f"read_{schema.TIERS[0]}_bytes"))
    written = sum((c(f"written_{t}_bytes") for t in schema.TIERS[1:]), c(f"written_{schema.TIERS[0]}_bytes"))
    cols = ["shard_id", *phases, "read_bytes", "written_bytes", "fetch_s", "stall_s", "optimizer_s", "windows"]
    with _read(src) as conn:
        _check_run(conn, run_id, _shown(src))
        # SQLite would group along the (run_id, shard_id) index, reading the rows in random order
        # (1.1 s on 10^6 rows, 2 cores); walking the (run_id, step) index reads them in the order
        # they were written and sorts them for the grouping (0.7 s)
        stmt = (sa.select(c("shard_id"), *[sa.func.sum(c(p)).label(p) for p in phases],
                          sa.func.sum(read).label("read_bytes"), sa.func.sum(written).label("written_bytes"),
                          *[sa.func.sum(c(s)).label(s) for s in ("fetch_s", "stall_s", "optimizer_s")],
                          sa.func.count().label("windows"))
                .select_from(_indexed_by(conn, schema.shard_steps, "run_id", "step"))
                .where(c("run_id") == int(run_id)).group_by(c("shard_id")))
        df = _frame(conn, stmt, cols)
    for col in cols:
        df[col] = df[col].fillna(0).astype("float64" if col.endswith("_s") else "int64")
    return df


def shard_heatmap(src: Source, run_id: int, *, max_steps: int = 200, max_shards: int = 200) -> pd.DataFrame:
    """The accesses of every shard over the run's steps, summed in SQL into at most ``max_steps`` x
    ``max_shards`` bins: ``step_lo, step_hi, index_lo, index_hi, accesses, accesses_per_shard_step``
    (one row per bin with recorded accesses; shards by ``shard_index``, a window's accesses under its
    first step; ``accesses_per_shard_step`` divides by the bin's shards and the steps it spans).
    Empty without ``shard_steps`` rows (a run recorded at ``detail: step``)."""
    ss, sh = schema.shard_steps, schema.shards
    rid = int(run_id)
    cols = ["step_lo", "step_hi", "index_lo", "index_hi", "accesses", "accesses_per_shard_step"]
    with _read(src) as conn:
        _check_run(conn, rid, _shown(src))
        s0, s1 = conn.execute(sa.select(sa.func.min(ss.c.step), sa.func.max(ss.c.step)).where(ss.c.run_id == rid)).one()
        n_shards = _count(conn, sh, sh.c.run_id == rid)
        if s0 is None or not n_shards:
            return pd.DataFrame({c: pd.Series(dtype="float64" if c == "accesses_per_shard_step" else "int64") for c in cols})
        s0, s1 = int(s0), int(s1)
        step_w = -(-(s1 - s0 + 1) // max(1, int(max_steps)))  # steps per bin (ceil)
        shard_w = -(-n_shards // max(1, int(max_shards)))  # shards per bin
        accesses = ss.c.forward_accesses + ss.c.backward_accesses + ss.c.recompute_accesses + ss.c.optimizer_accesses
        sb = ((ss.c.step - s0) // step_w).label("sb")  # SQL integer division
        hb = (sh.c.shard_index // shard_w).label("hb")
        stmt = (sa.select(sb, hb, sa.func.sum(accesses).label("accesses")).select_from(ss.join(sh, ss.c.shard_id == sh.c.id))
                .where(ss.c.run_id == rid).group_by(sb, hb))
        bins = _frame(conn, stmt, ["sb", "hb", "accesses"])
    bins = bins[bins["accesses"].notna()]
    out = pd.DataFrame({
        "step_lo": s0 + bins["sb"].astype("int64") * step_w,
        "index_lo": bins["hb"].astype("int64") * shard_w,
        "accesses": bins["accesses"].astype("int64"),
    })
    out["step_hi"] = (out["step_lo"] + step_w - 1).clip(upper=s1)
    out["index_hi"] = (out["index_lo"] + shard_w - 1).clip(upper=n_shards - 1)
    cells = (out["step_hi"] - out["step_lo"] + 1) * (out["index_hi"] - out["index_lo"] + 1)
    out["accesses_per_shard_step"] = out["accesses"] / cells
    return out[cols].sort_values(["step_lo", "index_lo"]).reset_index(drop=True)
