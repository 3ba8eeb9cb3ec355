"""Plotly figures of a profiled run, shared by the live dashboard and the offline HTML report.

Each function is pure: a DataFrame from :mod:`profiler.queries` (or a :class:`planner.CostModel`)
in, a ``plotly.graph_objects.Figure`` out; nothing is read from the database here. Axis titles
carry their units; byte axes are in MB (10^6 bytes) and bandwidth in GB/s (10^9 bytes/s), the
convention of :mod:`profiler.queries`.

===========================  =============================================  ===================
figure                       input                                          x
===========================  =============================================  ===================
:func:`step_time_figure`     ``queries.steps(url, run_id)``                 step
:func:`loss_figure`          ``queries.steps(url, run_id)``                 step
:func:`bandwidth_figure`     ``queries.bandwidth_over_time(url, run_id)``   step
:func:`bytes_per_tier_figure` ``queries.steps(url, run_id)``                step
:func:`cost_model_figure`    ``queries.io_samples(url, run_id)``, a model   bytes per request
===========================  =============================================  ===================
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from planner.costmodel import CostModel, CostModelError

__all__ = [
    "step_time_figure",
    "loss_figure",
    "bandwidth_figure",
    "bytes_per_tier_figure",
    "cost_model_figure",
    "step_time_breakdown",
    "TIERS",
]

TIERS = ("gpu", "cpu", "nvme")  # the order of profiler.schema.TIERS
MB = 1e6
WEBGL_ABOVE_POINTS = 5_000  # larger scatters render through WebGL (Scattergl), smaller as SVG

# One colour per phase / tier / op, the same in every figure.
PHASE_COLORS = {"compute": "#4C78A8", "stall": "#E45756", "optimizer": "#F58518", "migration": "#72B7B2", "other": "#BAB0AC"}
TIER_COLORS = {"gpu": "#54A24B", "cpu": "#4C78A8", "nvme": "#E45756"}
OP_DASH = {"read": "solid", "write": "dash", "written": "dash"}


def _require(df: pd.DataFrame, columns: list[str], what: str, source: str) -> None:
    lacking = [c for c in columns if c not in df.columns]
    if lacking:
        raise ValueError(f"{what} needs column(s) {', '.join(lacking)}; pass {source}")


def _layout(fig: go.Figure, title: str, x_title: str, y_title: str, **kw) -> go.Figure:
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, template="plotly_white",
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0}, **kw)
    return fig


def _empty_note(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


# ------------------------------------------------------------------------------- step time
def step_time_breakdown(steps_df: pd.DataFrame) -> pd.DataFrame:
    """Per step, the wall time split into parts that add up to it: ``step, compute_s, stall_s,
    optimizer_s, migration_s, other_s, wall_s``.

    The engine times ``forward_s`` and ``backward_s`` including the waits for shards, which it
    also reports as ``stall_s``; so ``compute_s = forward_s + backward_s - stall_s`` and
    ``other_s = wall_s - (compute_s + stall_s + optimizer_s + migration_s)`` (bookkeeping between
    the timed phases). Both are clipped at 0, so a step whose timers overlap more than that shows a
    stack slightly taller than ``wall_s``.
    """
    _require(steps_df, ["step", "wall_s", "forward_s", "backward_s", "optimizer_s", "stall_s", "migration_s"],
             "step_time_breakdown", "profiler.queries.steps(url, run_id)")
    d = steps_df.sort_values("step")
    out = pd.DataFrame({"step": d["step"].to_numpy()})
    out["compute_s"] = (d["forward_s"] + d["backward_s"] - d["stall_s"]).clip(lower=0).to_numpy()
    out["stall_s"] = d["stall_s"].to_numpy()
    out["optimizer_s"] = d["optimizer_s"].to_numpy()
    out["migration_s"] = d["migration_s"].to_numpy()
    parts = out[["compute_s", "stall_s", "optimizer_s", "migration_s"]].sum(axis=1)
    out["other_s"] = (d["wall_s"].to_numpy() - parts).clip(lower=0)
    out["wall_s"] = d["wall_s"].to_numpy()
    return out


def step_time_figure(steps_df: pd.DataFrame) -> go.Figure:
    """Stacked bars per step: compute, stall, optimizer, migration and other seconds (they add up
    to the step's wall time; see :func:`step_time_breakdown`)."""
    b = step_time_breakdown(steps_df)
    fig = go.Figure()
    for part in ("compute", "stall", "optimizer", "migration", "other"):
        fig.add_trace(go.Bar(x=b["step"], y=b[f"{part}_s"], name=part, marker_color=PHASE_COLORS[part],
                             customdata=b["wall_s"],
                             hovertemplate=f"step %{{x}}<br>{part} %{{y:.4f}} s<br>wall %{{customdata:.4f}} s<extra></extra>"))
    _layout(fig, "Step time by phase", "optimizer step", "time per step (s)", barmode="stack")
    if b.empty:
        _empty_note(fig, "no steps recorded")
    return fig


# ------------------------------------------------------------------------------------ loss
def loss_figure(steps_df: pd.DataFrame) -> go.Figure:
    """The training loss (mean of the losses passed to ``engine.backward`` in the step) per step;
    steps that recorded no loss are left out."""
    _require(steps_df, ["step", "loss"], "loss_figure", "profiler.queries.steps(url, run_id)")
    d = steps_df[["step", "loss"]].dropna().sort_values("step")
    fig = go.Figure(go.Scatter(x=d["step"], y=d["loss"], mode="lines+markers", name="loss",
                               hovertemplate="step %{x}<br>loss %{y:.4f}<extra></extra>"))
    _layout(fig, "Training loss", "optimizer step", "loss (dimensionless, as passed to engine.backward)")
    if d.empty:
        _empty_note(fig, "no loss recorded")
    return fig


# ------------------------------------------------------------------------------- bandwidth
def bandwidth_figure(bandwidth_df: pd.DataFrame) -> go.Figure:
    """Achieved per-request bandwidth per tier and direction, per step (sum of bytes over sum of
    seconds of that step's I/O samples). Steps without samples of a (tier, op) are gaps, not zeros.

    Note: I/O done after the last optimizer step (e.g. writes drained at ``engine.close()``) is
    recorded under the next step number, so this figure can have one step more than the steps table.
    """
    _require(bandwidth_df, ["step", "tier", "read_GBps", "write_GBps", "read_samples", "write_samples"],
             "bandwidth_figure", "profiler.queries.bandwidth_over_time(url, run_id)")
    fig = go.Figure()
    for tier in _ordered_tiers(bandwidth_df["tier"].dropna().unique()):
        d = bandwidth_df[bandwidth_df["tier"] == tier].sort_values("step")
        for op in ("read", "write"):
            part = d[d[f"{op}_samples"] > 0]
            if part.empty:
                continue
            fig.add_trace(go.Scatter(
                x=part["step"], y=part[f"{op}_GBps"], mode="lines+markers", name=f"{tier} {op}",
                line={"color": TIER_COLORS.get(tier), "dash": OP_DASH[op]}, customdata=part[f"{op}_samples"],
                hovertemplate=f"step %{{x}}<br>{tier} {op} %{{y:.3f}} GB/s<br>%{{customdata}} samples<extra></extra>"))
    _layout(fig, "I/O bandwidth per tier", "optimizer step", "bandwidth (GB/s = 10^9 B/s)")
    if not fig.data:
        _empty_note(fig, "no I/O samples recorded")
    return fig


def _ordered_tiers(tiers) -> list[str]:
    known = [t for t in TIERS if t in set(tiers)]
    return known + sorted(set(tiers) - set(TIERS))


# -------------------------------------------------------------------------- bytes per tier
def bytes_per_tier_figure(steps_df: pd.DataFrame) -> go.Figure:
    """Bytes read from and written to each tier per step (MB), grouped bars; tiers with no
    traffic in the whole run are left out."""
    cols = [f"{op}_{t}_bytes" for t in TIERS for op in ("read", "written")]
    _require(steps_df, ["step", *cols], "bytes_per_tier_figure", "profiler.queries.steps(url, run_id)")
    d = steps_df.sort_values("step")
    fig = go.Figure()
    for tier in TIERS:
        for op in ("read", "written"):
            y = d[f"{op}_{tier}_bytes"].astype("float64")
            if not (y > 0).any():
                continue
            fig.add_trace(go.Bar(
                x=d["step"], y=y / MB, name=f"{tier} {op}", marker_color=TIER_COLORS[tier],
                marker_pattern_shape="/" if op == "written" else "", customdata=y,
                hovertemplate=f"step %{{x}}<br>{tier} {op} %{{y:.2f}} MB (%{{customdata:,.0f}} B)<extra></extra>"))
    _layout(fig, "Bytes moved per tier", "optimizer step", "bytes per step (MB = 10^6 B)", barmode="group")
    if not fig.data:
        _empty_note(fig, "no tier traffic recorded")
    return fig


# ------------------------------------------------------------------------------ cost model
def cost_model_figure(samples_df: pd.DataFrame, cost_model: CostModel, *, max_points: int = 20_000,
                      line_points: int = 64) -> go.Figure:
    """Measured seconds against bytes of every I/O sample (log-log), one colour per (tier, op), with
    the cost model's pooled line ``latency_s + bytes / bandwidth_Bps`` over the sizes measured.

    More than ``max_points`` samples are subsampled (deterministically) and the title says so. A
    (tier, op) the model has no cost for is drawn without a line.
    """
    _require(samples_df, ["tier", "op", "bytes", "seconds"], "cost_model_figure", "profiler.queries.io_samples(url, run_id)")
    d = samples_df[(samples_df["bytes"] > 0) & (samples_df["seconds"] > 0)]
    n_all = len(d)
    if n_all > max_points:
        d = d.sample(max_points, random_state=0)
    fig = go.Figure()
    pairs = sorted(set(map(tuple, d[["tier", "op"]].to_numpy())) | set(cost_model.pairs))
    for tier, op in pairs:
        part = d[(d["tier"] == tier) & (d["op"] == op)]
        color = TIER_COLORS.get(tier)
        symbol = "circle" if op == "read" else "x"
        if len(part):
            scatter = go.Scattergl if len(part) > WEBGL_ABOVE_POINTS else go.Scatter
            fig.add_trace(scatter(
                x=part["bytes"], y=part["seconds"], mode="markers", name=f"{tier} {op} samples",
                marker={"color": color, "symbol": symbol, "size": 5, "opacity": 0.45},
                hovertemplate=f"{tier} {op}<br>%{{x:,.0f}} B<br>%{{y:.5f}} s<extra></extra>"))
        try:
            c = cost_model.cost(tier, op)
        except CostModelError:
            continue
        lo = part["bytes"].min() if len(part) else c.bytes_min
        hi = part["bytes"].max() if len(part) else c.bytes_max
        if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
            continue
        x = np.geomspace(float(lo), float(max(hi, lo * 1.0001)), line_points)
        fig.add_trace(go.Scatter(
            x=x, y=c.latency_s + x / c.bandwidth_Bps, mode="lines", line={"color": color, "dash": OP_DASH[op], "width": 2},
            name=f"{tier} {op} fit: {c.latency_s * 1e3:.3g} ms + B / {c.bandwidth_GBps:.3g} GB/s ({c.method})",
            hovertemplate=f"{tier} {op} model<br>%{{x:,.0f}} B<br>%{{y:.5f}} s<extra></extra>"))
    title = "I/O cost model: seconds = latency + bytes / bandwidth"
    if n_all > len(d):
        title += f" (showing {len(d)} of {n_all} samples)"
    _layout(fig, title, "bytes per request (B)", "seconds per request (s)")
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    if not fig.data:
        _empty_note(fig, "no I/O samples recorded")
    return fig
