"""What the dashboard and the offline report show of a run: data assembled from
:mod:`profiler.queries` (and :mod:`planner.whatif`) and handed to :mod:`dashboard.figures`.

* :func:`run_figures` - every figure of a run, in reading order (the offline report builds its
  HTML from it; the web pages show the same figures through :class:`DashboardData`).
* :data:`FIGURES` - the figures by URL name (``step-time``, ``shard-heatmap``, ...), each with the
  page it belongs to and the function that builds it from a database and a run id.
* :class:`DashboardData` - the web app's view of one database: tables as pages, figures as plotly
  JSON, the what-if curve; results computed from a run are cached until the recorder writes to that
  run again (:func:`profiler.queries.run_progress`), so a finished run is read once per figure and
  a live page's polling costs a few index look-ups.

Nothing here writes to the database: every read goes through the read-only engine (SQLite
``mode=ro`` and ``PRAGMA query_only``) of :func:`profiler.store.open_readonly`.
"""

from __future__ import annotations

import importlib
import json
import math
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.utils import PlotlyJSONEncoder
from sqlalchemy.engine import URL, Engine

from planner.costmodel import CostModel
from profiler import queries
from profiler.export import _json_obj, config_summary, model_summary, runs_summary
from profiler.store import open_readonly
from zinf.errors import ProfileError, ZinfError

from dashboard import figures

__all__ = [
    "run_figures",
    "FIGURES",
    "FigureSpec",
    "DashboardData",
    "WhatIfUnavailable",
    "is_unknown_id",
    "treemap_frame",
    "shard_table",
    "current_homes",
    "hardware_summary",
    "figure_json",
]

Source = str | URL | Engine

TREEMAP_MAX_SHARDS = 2_000  # shards drawn one by one in the treemap; the smaller rest are lumped per module
HEATMAP_MAX_STEPS = 200  # heatmap columns (step bins)
HEATMAP_MAX_SHARDS = 150  # heatmap rows (shard bins)
HEAVY_STALE_S = 15.0  # a live run's whole-run shard aggregates are recomputed at most this often


class WhatIfUnavailable(ZinfError):
    """The what-if planner (``planner.whatif``) is not installed in this zinf."""


def is_unknown_id(exc: BaseException) -> bool:
    """Whether ``exc`` is :mod:`profiler.queries`' error for a run or plan id the database lacks."""
    return isinstance(exc, ProfileError) and str(exc).startswith(("unknown run id", "unknown plan id"))


@contextmanager
def _engine(src: Source) -> Iterator[Engine]:
    """A read-only engine for ``src``: the one given, or one opened here for the block."""
    if isinstance(src, Engine):
        yield src
        return
    engine = open_readonly(src)
    try:
        yield engine
    finally:
        engine.dispose()


# ------------------------------------------------------------------------- frames for figures
def current_homes(shards_df: pd.DataFrame, migrations_df: pd.DataFrame) -> pd.DataFrame:
    """``shards_df`` (``queries.shards``) with ``param_tier``/``optim_tier`` as they are after the
    run's recorded migrations (``queries.migrations``, in step order), and the tiers at the start
    kept as ``initial_param_tier``/``initial_optim_tier``."""
    d = shards_df.drop(columns=["members"], errors="ignore").copy()
    for state in ("param", "optim"):
        d[f"initial_{state}_tier"] = d[f"{state}_tier"]
    if len(migrations_df):
        last = migrations_df.drop_duplicates(["shard", "state"], keep="last")
        for state in ("param", "optim"):
            moved = last[last["state"] == state].set_index("shard")["dst_tier"]
            now = d["name"].map(moved)
            d[f"{state}_tier"] = now.where(now.notna(), d[f"{state}_tier"])
    return d


def shard_table(src: Source, run_id: int) -> pd.DataFrame:
    """One row per shard: what it is (``queries.shards``), where its homes are now
    (:func:`current_homes`), and its accesses, bytes and seconds over the run
    (``queries.shard_totals``) in total and per recorded step (``*_per_step``); shards never
    accessed have zeros. ``state_bytes`` = param + optimizer bytes."""
    with _engine(src) as engine:
        shards = current_homes(queries.shards(engine, run_id), queries.migrations(engine, run_id))
        totals = queries.shard_totals(engine, run_id)
        n_steps = queries.run_progress(engine, run_id)["steps"]
    df = shards.merge(totals, on="shard_id", how="left")
    for c in totals.columns.drop("shard_id"):
        df[c] = df[c].fillna(0).astype(totals[c].dtype)
    df["state_bytes"] = df["param_bytes"] + df["optim_bytes"]
    df["total_accesses"] = df[["forward_accesses", "backward_accesses", "recompute_accesses", "optimizer_accesses"]].sum(axis=1)
    per = float(n_steps) if n_steps else float("nan")
    for c in ("total_accesses", "read_bytes", "fetch_s", "stall_s", "optimizer_s"):
        df[("accesses" if c == "total_accesses" else c) + "_per_step"] = df[c] / per
    return df


def treemap_frame(shards_df: pd.DataFrame, migrations_df: pd.DataFrame, *, max_shards: int = TREEMAP_MAX_SHARDS) -> pd.DataFrame:
    """One row per home as it is now: ``module, shard, state, tier, bytes`` (``param`` homes hold
    ``param_bytes``, ``optim`` homes ``optim_bytes``; tiers from :func:`current_homes`). Beyond
    ``max_shards`` shards the largest are kept and the rest summed per module and tier as one
    shard ``(N smaller shards)``."""
    d = current_homes(shards_df, migrations_df)[["name", "module", "param_bytes", "optim_bytes", "param_tier", "optim_tier"]]
    d = d.assign(total_bytes=d["param_bytes"] + d["optim_bytes"])
    if len(d) > max_shards:
        d = d.sort_values("total_bytes", ascending=False)
        keep, rest = d.iloc[:max_shards], d.iloc[max_shards:]
        counts = rest.groupby("module")["name"].size()
    else:
        keep, rest, counts = d, d.iloc[0:0], pd.Series(dtype="int64")
    rows = []
    for state in ("param", "optim"):
        rows.append(pd.DataFrame({"module": keep["module"], "shard": keep["name"], "state": state,
                                  "tier": keep[f"{state}_tier"], "bytes": keep[f"{state}_bytes"]}))
        if len(rest):
            lumped = rest.groupby(["module", f"{state}_tier"], as_index=False)[f"{state}_bytes"].sum()
            rows.append(pd.DataFrame({
                "module": lumped["module"],
                "shard": [f"({counts[m]} smaller shards)" for m in lumped["module"]],
                "state": state, "tier": lumped[f"{state}_tier"], "bytes": lumped[f"{state}_bytes"]}))
    out = pd.concat(rows, ignore_index=True)
    out = out[(out["bytes"] > 0) & (out["tier"] != "none")]
    return out.sort_values(["module", "shard", "state"], kind="stable").reset_index(drop=True)


def _heatmap_labels(shards_df: pd.DataFrame, heat_df: pd.DataFrame) -> dict[int, str]:
    """A name for each heatmap row that holds one shard: ``#index name`` (shortened)."""
    single = heat_df.loc[heat_df["index_lo"] == heat_df["index_hi"], "index_lo"].unique()
    names = shards_df.set_index("shard_index")["name"]
    return {int(i): f"#{int(i)} {_short(str(names.get(int(i), '')))}" for i in single}


def _short(text: str, n: int = 32) -> str:
    return text if len(text) <= n else "…" + text[-(n - 1):]


def _cost_model_figure(src: Source, run_id: int) -> go.Figure:
    samples = queries.io_samples(src, run_id)
    try:
        model = CostModel.fit(samples)
    except ZinfError as e:  # too few samples and no calibration: say so in the figure
        return figures.note_figure("I/O cost model", f"no cost model: {e}")
    return figures.cost_model_figure(samples, model)


# --------------------------------------------------------------------------------- figures
@dataclass(frozen=True)
class FigureSpec:
    """One figure of a run: its URL ``name``, ``title`` (a heading, and the key in
    :func:`run_figures`), the ``page`` that shows it, and ``build(src, run_id)``. ``heavy``: it
    aggregates every ``shard_steps`` row (~0.5 s on 10^6 rows), so while the run is written it is
    rebuilt at most every :data:`HEAVY_STALE_S` seconds."""

    name: str
    title: str
    page: str
    build: Callable[[Source, int], go.Figure]
    heavy: bool = False


def _step_time(src: Source, run_id: int) -> go.Figure:
    fig = figures.step_time_figure(queries.steps(src, run_id))
    return figures.add_plan_markers(fig, queries.plans(src, run_id))


def _memory(src: Source, run_id: int) -> go.Figure:
    return figures.memory_figure(queries.homed_bytes(src, run_id), queries.steps(src, run_id))


def _heatmap(src: Source, run_id: int) -> go.Figure:
    heat = queries.shard_heatmap(src, run_id, max_steps=HEATMAP_MAX_STEPS, max_shards=HEATMAP_MAX_SHARDS)
    labels = _heatmap_labels(queries.shards(src, run_id), heat) if len(heat) else {}
    return figures.shard_heatmap_figure(heat, labels)


def _treemap(src: Source, run_id: int) -> go.Figure:
    return figures.shard_treemap_figure(treemap_frame(queries.shards(src, run_id), queries.migrations(src, run_id)))


FIGURES: dict[str, FigureSpec] = {s.name: s for s in (
    FigureSpec("step-time", "Step time by phase", "overview", _step_time),
    FigureSpec("loss", "Training loss", "overview", lambda src, rid: figures.loss_figure(queries.steps(src, rid))),
    FigureSpec("bandwidth", "I/O bandwidth per tier", "overview",
               lambda src, rid: figures.bandwidth_figure(queries.bandwidth_over_time(src, rid))),
    FigureSpec("memory", "Memory per tier", "overview", _memory),
    FigureSpec("bytes-moved", "Bytes moved per tier", "overview",
               lambda src, rid: figures.bytes_per_tier_figure(queries.steps(src, rid))),
    FigureSpec("shard-heatmap", "Shard accesses over steps", "shards", _heatmap, heavy=True),
    FigureSpec("shard-treemap", "State by module and tier", "shards", _treemap),
    FigureSpec("migrations", "Migrations between steps", "plans",
               lambda src, rid: figures.migrations_figure(queries.migrations_per_step(src, rid))),
    FigureSpec("predicted-vs-measured", "Predicted against measured step time", "plans",
               lambda src, rid: figures.predicted_vs_measured_figure(queries.steps(src, rid), queries.plans(src, rid))),
    FigureSpec("cost-model", "I/O cost model", "plans", _cost_model_figure),
)}
WHAT_IF_TITLE = "What-if: predicted step time against the DRAM budget"


def run_figures(src: Source, run_id: int, *, what_if: pd.DataFrame | None = None) -> dict[str, go.Figure]:
    """Every figure of run ``run_id``, title -> figure, in reading order: the overview (step time
    with plan changes, loss, bandwidth, memory, bytes moved), the shards (heatmap, treemap), the
    plans (migrations, predicted against measured, cost model) and, given a what-if frame
    (``planner.whatif.what_if``), its curve. An unknown run id is a ProfileError."""
    with _engine(src) as engine:
        queries.run_info(engine, run_id)  # an unknown id fails here, once
        out = {spec.title: spec.build(engine, int(run_id)) for spec in FIGURES.values()}
    if what_if is not None:
        out[WHAT_IF_TITLE] = figures.whatif_figure(what_if)
    return out


def figure_points(fig: go.Figure) -> int:
    """How many points a figure draws: x values of each trace, cells of a heatmap, boxes of a treemap."""
    n = 0
    for t in fig.data:
        z = getattr(t, "z", None)
        if z is not None:
            n += int(np.asarray(z).size)
        elif getattr(t, "ids", None) is not None:
            n += len(t.ids)
        elif getattr(t, "x", None) is not None:
            n += sum(1 for v in t.x if v is not None)
    return n


def figure_json(fig: go.Figure) -> str:
    """``{"data": [...], "layout": {...}}`` with plain JSON arrays (not plotly's base64 typed
    arrays), so that the page's script can count and extend them; NaN becomes null."""
    plain = {"data": [t.to_plotly_json() for t in fig.data], "layout": fig.layout.to_plotly_json()}
    return json.dumps(plain, cls=PlotlyJSONEncoder, separators=(",", ":"))


# ------------------------------------------------------------------------------ helpers
def hardware_summary(hw: Any) -> str:
    """``"AMD EPYC 9654 (16 cores), 128.0 GB DRAM, NVIDIA H200"`` from a run's ``hardware`` JSON."""
    if isinstance(hw, str):
        try:
            hw = json.loads(hw)
        except ValueError:
            return hw[:80]
    if not isinstance(hw, dict):
        return ""
    parts = []
    if hw.get("cpu"):
        parts.append(f"{hw['cpu']}" + (f" ({hw['cores']} cores)" if hw.get("cores") else ""))
    if hw.get("dram_bytes"):
        parts.append(f"{float(hw['dram_bytes']) / 1e9:.1f} GB DRAM")
    parts.append(str(hw["gpu"]) if hw.get("gpu") else "no GPU")
    return ", ".join(parts)


def records(df: pd.DataFrame, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows as dicts of plain Python values: NaN/NaT -> None, numpy scalars -> int/float/bool."""
    d = df if columns is None else df[[c for c in columns if c in df.columns]]
    out = []
    for row in d.to_dict("records"):
        out.append({k: _plain(v) for k, v in row.items()})
    return out


def _plain(v: Any) -> Any:
    if v is None or v is pd.NaT:
        return None
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, pd.Timestamp):
        return v.to_pydatetime(warn=False)  # microseconds are enough
    return v


# -------------------------------------------------------------------------------- cache
class _Cache:
    """Results keyed by what they are, each kept with the run ``version`` it was computed at; a
    lookup with another version recomputes, unless the entry is younger than ``max_stale_s`` (the
    costly aggregates of a run being written are recomputed at most that often). Least recently
    used entries go beyond ``max_entries``."""

    def __init__(self, max_entries: int = 256) -> None:
        self._entries: OrderedDict[tuple, tuple[tuple, float, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_entries

    def get(self, key: tuple, version: tuple, compute: Callable[[], Any], *, max_stale_s: float = 0.0) -> Any:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and (hit[0] == version or time.monotonic() - hit[1] < max_stale_s):
                self._entries.move_to_end(key)
                return hit[2]
        value = compute()  # outside the lock: two requests may compute the same thing once each
        with self._lock:
            self._entries[key] = (version, time.monotonic(), value)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        return value


# ------------------------------------------------------------------------ the web app's data
SHARD_SORT_COLUMNS = (
    "shard_index", "name", "module", "kind", "state_bytes", "param_bytes", "optim_bytes", "param_tier", "optim_tier",
    "accesses_per_step", "read_bytes_per_step", "fetch_s_per_step", "stall_s_per_step", "total_accesses", "stall_s",
)


class DashboardData:
    """The dashboard's reads of one profile database, through one read-only engine, with a cache
    of what was computed from each run (see the module docstring)."""

    def __init__(self, engine: Engine, *, cache_entries: int = 256) -> None:
        self.engine = engine
        self._cache = _Cache(cache_entries)

    def version(self, run_id: int) -> tuple:
        """What the cache keys a run's results on: its progress counters except the heartbeat
        (which ticks without new data). Raises ProfileError for an unknown id."""
        p = queries.run_progress(self.engine, run_id)
        return (p["steps"], p["last_step"], p["last_plan_id"], p["last_migration_id"], p["recorded_status"])

    # --------------------------------------------------------------------------- runs
    def runs(self) -> list[dict[str, Any]]:
        """Every run with its headline numbers (newest first)."""
        df = runs_summary(self.engine)
        if df.empty:
            return []
        totals = queries.run_totals(self.engine)[["run_id", "stall_fraction"]]
        meta = queries.run_metadata(self.engine)
        meta["hardware"] = [hardware_summary(h) for h in meta["hardware"]]
        df = df.merge(totals, on="run_id", how="left").merge(meta[["run_id", "hardware"]], on="run_id", how="left")
        df = df.sort_values("run_id", ascending=False)
        return records(df, ["run_id", "name", "status", "started_at", "finished_at", "duration_s", "steps", "median_step_s",
                            "total_wall_s", "last_loss", "stall_fraction", "model", "hardware", "hostname"])

    def run(self, run_id: int) -> dict[str, Any]:
        """One run: status, what was trained where, and counts; ProfileError for an unknown id."""
        info = queries.run_info(self.engine, run_id)
        progress = queries.run_progress(self.engine, run_id)
        ts = lambda v: None if v is None else datetime.fromtimestamp(float(v), tz=timezone.utc)  # noqa: E731
        bandwidths = _json_obj(info.get("bandwidths"))
        return {
            "run_id": info["run_id"], "name": info["name"], "status": info["status"],
            "recorded_status": info["recorded_status"], "started_at": ts(info["started_at"]),
            "finished_at": ts(info["finished_at"]), "last_heartbeat_at": ts(info["last_heartbeat"]),
            "steps": info["steps"], "last_step": progress["last_step"], "shards": info["shards"],
            "detail": info.get("detail"), "window_steps": info.get("window_steps"), "hostname": info.get("hostname"),
            "model": model_summary(info.get("model")), "hardware": hardware_summary(info.get("hardware")),
            "config": {k: (v if isinstance(v, (int, float, bool)) or v is None else str(v))
                       for k, v in config_summary(info.get("config")).items()},
            "bandwidths_GBps": {k: float(v) for k, v in (bandwidths or {}).items()
                                if str(k).endswith("_GBps") and isinstance(v, (int, float)) and math.isfinite(v)},
        }

    def steps(self, run_id: int, *, after_step: int | None, limit: int) -> tuple[list[dict[str, Any]], bool, str]:
        """The steps after ``after_step`` (at most ``limit``), each with its time split as in the
        step-time figure; whether more follow; and the run's status."""
        status = queries.run_info(self.engine, run_id)["status"]
        df = queries.steps_page(self.engine, run_id, after_step=after_step, limit=limit + 1)
        more = len(df) > limit
        df = df.iloc[:limit].reset_index(drop=True)
        parts = figures.step_time_breakdown(df)  # rows in the same (step) order
        for col in ("compute_s", "other_s"):
            df[col] = parts[col].to_numpy()
        return records(df), more, status

    # ------------------------------------------------------------------------ figures
    def figure(self, run_id: int, name: str) -> dict[str, Any]:
        """``{"name", "title", "points", "last_step", "figure_json"}`` of one figure of FIGURES."""
        spec = FIGURES[name]
        version = self.version(run_id)

        def build() -> dict[str, Any]:
            fig = spec.build(self.engine, int(run_id))
            return {"name": name, "title": spec.title, "points": figure_points(fig), "last_step": version[1],
                    "figure_json": figure_json(fig)}

        return self._cache.get(("figure", int(run_id), name), version, build,
                               max_stale_s=HEAVY_STALE_S if spec.heavy else 0.0)

    # ------------------------------------------------------------------------- shards
    def shard_stats(self, run_id: int) -> pd.DataFrame:
        """:func:`shard_table` of the run (cached; see HEAVY_STALE_S)."""
        return self._cache.get(("shard-table", int(run_id)), self.version(run_id),
                               lambda: shard_table(self.engine, run_id), max_stale_s=HEAVY_STALE_S)

    def shards_page(self, run_id: int, *, sort: str, descending: bool, limit: int, offset: int) -> tuple[list[dict], int]:
        """One page of the shards sorted by ``sort`` (one of SHARD_SORT_COLUMNS), and their number."""
        df = self.shard_stats(run_id)
        if sort not in SHARD_SORT_COLUMNS:
            raise ValueError(f"cannot sort shards by {sort!r}; use one of {', '.join(SHARD_SORT_COLUMNS)}")
        # ties in model order, so pages do not overlap
        page = df.sort_values([sort, "shard_index"], ascending=[not descending, True], kind="stable",
                              na_position="last").iloc[offset:offset + limit]
        return records(page), len(df)

    def heatmap(self, run_id: int, *, max_steps: int, max_shards: int) -> list[dict[str, Any]]:
        """The binned accesses of :func:`profiler.queries.shard_heatmap`, as rows."""
        return self._cache.get(("heatmap", int(run_id), max_steps, max_shards), self.version(run_id),
                               lambda: records(queries.shard_heatmap(self.engine, run_id, max_steps=max_steps,
                                                                     max_shards=max_shards)),
                               max_stale_s=HEAVY_STALE_S)

    def io_samples(self, run_id: int, *, limit: int, offset: int, first_step: int | None) -> tuple[list[dict], int]:
        df, total = queries.io_samples_page(self.engine, run_id, limit=limit, offset=offset, first_step=first_step)
        return records(df), total

    # -------------------------------------------------------------------------- plans
    def plans(self, run_id: int) -> list[dict[str, Any]]:
        """The run's plans with, for adopted ones, the measured median step while each was in
        force (steps with its ``plan_version``) and the bytes migrated for it."""
        def build() -> list[dict[str, Any]]:
            p = queries.plans(self.engine, run_id)
            steps = queries.steps(self.engine, run_id)
            measured = steps.groupby("plan_version")["wall_s"].agg(["median", "size"])
            moved = queries.migrations(self.engine, run_id).groupby("plan_version")["bytes"].sum()
            adopted = p["adopted"].astype(bool)
            p["measured_step_s"] = p["version"].map(measured["median"]).where(adopted)
            p["measured_steps"] = p["version"].map(measured["size"]).where(adopted).fillna(0).astype("int64")
            p["migrated_bytes"] = p["version"].map(moved).where(adopted).fillna(0).astype("int64")
            p["reason"] = [_json_obj(r) for r in p["reason"]]
            return records(p.sort_values("version", ascending=False))

        return self._cache.get(("plans", int(run_id)), self.version(run_id), build)

    def plan(self, plan_id: int) -> dict[str, Any]:
        info = queries.plan_info(self.engine, plan_id)
        info["reason"] = _json_obj(info.get("reason"))
        return {k: _plain(v) for k, v in info.items()}

    def plan_assignments(self, plan_id: int, *, limit: int, offset: int) -> tuple[list[dict], int]:
        queries.plan_info(self.engine, plan_id)  # an unknown id is a 404, not an empty page
        df, total = queries.plan_assignments_page(self.engine, plan_id, limit=limit, offset=offset)
        return records(df), total

    def migrations(self, run_id: int, *, limit: int, offset: int) -> tuple[list[dict], int]:
        df, total = queries.migrations_page(self.engine, run_id, limit=limit, offset=offset)
        return records(df), total

    # ------------------------------------------------------------------------ what-if
    def what_if(self, run_id: int, budget_bytes: int | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
        """The what-if curve of a run (``planner.whatif``: the predicted step at its default DRAM
        budgets) with, given ``budget_bytes``, that budget re-planned and added; and the figure
        marking it. The planner's model of the run (~0.3 s to build) is kept per run version, and
        each budget is solved once (~0.1 s)."""
        whatif = _whatif_module()
        version = self.version(run_id)
        rid = int(run_id)
        model = self._cache.get(("what-if model", rid), version, lambda: whatif.WhatIf.from_profile(self.engine, rid))
        curve = self._cache.get(("what-if", rid), version, lambda: model.table())
        df = curve
        if budget_bytes is not None:
            point = self._cache.get(("what-if", rid, int(budget_bytes)), version, lambda: model.table([int(budget_bytes)]))
            df = pd.concat([curve, point], ignore_index=True).drop_duplicates("dram_budget_bytes", keep="last")
        df = df.sort_values("dram_budget_bytes").reset_index(drop=True)
        fig = figures.whatif_figure(df, budget_bytes)
        return df, {"name": "what-if", "title": WHAT_IF_TITLE, "points": figure_points(fig), "last_step": version[1],
                    "figure_json": figure_json(fig)}


def _whatif_module():
    try:
        return importlib.import_module("planner.whatif")
    except ModuleNotFoundError as e:
        if e.name not in ("planner.whatif",):
            raise
        raise WhatIfUnavailable("this zinf has no what-if planner (planner.whatif); upgrade zinf") from None

