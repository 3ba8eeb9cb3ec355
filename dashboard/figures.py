"""Plotly figures of a profiled run, shared by the live dashboard and the offline HTML report.

Each function is pure: a DataFrame from :mod:`profiler.queries` (or a :class:`planner.CostModel`)
in, a ``plotly.graph_objects.Figure`` out; nothing is read from the database here. Axis titles
carry their units; byte axes are in MB (10^6 bytes) and bandwidth in GB/s (10^9 bytes/s), the
convention of :mod:`profiler.queries`.

====================================  ==================================================  =================
figure                                input                                               x
====================================  ==================================================  =================
:func:`step_time_figure`              ``queries.steps(url, run_id)``                      step
:func:`add_plan_markers`              a step-axis figure, ``queries.plans(url, run_id)``  step
:func:`loss_figure`                   ``queries.steps(url, run_id)``                      step
:func:`bandwidth_figure`              ``queries.bandwidth_over_time(url, run_id)``        step
:func:`bytes_per_tier_figure`         ``queries.steps(url, run_id)``                      step
:func:`memory_figure`                 ``queries.homed_bytes(url, run_id)``, steps         step
:func:`cost_model_figure`             ``queries.io_samples(url, run_id)``, a model        bytes per request
:func:`shard_heatmap_figure`          ``queries.shard_heatmap(url, run_id)``              step
:func:`shard_treemap_figure`          ``dashboard.views.treemap_frame(...)``              (module, shard)
:func:`migrations_figure`             ``queries.migrations_per_step(url, run_id)``        step
:func:`predicted_vs_measured_figure`  ``queries.steps(...)``, ``queries.plans(...)``      step
:func:`whatif_figure`                 ``planner.whatif.what_if(url, run_id)``             DRAM budget
====================================  ==================================================  =================
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from planner.costmodel import CostModel, CostModelError

__all__ = [
    "step_time_figure",
    "add_plan_markers",
    "loss_figure",
    "bandwidth_figure",
    "bytes_per_tier_figure",
    "memory_figure",
    "cost_model_figure",
    "shard_heatmap_figure",
    "shard_treemap_figure",
    "migrations_figure",
    "predicted_vs_measured_figure",
    "whatif_figure",
    "note_figure",
    "step_time_breakdown",
    "STEP_TIME_PARTS",
    "TIERS",
]

TIERS = ("gpu", "cpu", "nvme")  # the order of profiler.schema.TIERS
MB = 1e6
GB = 1e9
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


def note_figure(title: str, text: str) -> go.Figure:
    """A figure with no data and ``text`` in its middle: for a figure that cannot be drawn (say why)."""
    fig = go.Figure()
    fig.update_layout(title=title, template="plotly_white", xaxis={"visible": False}, yaxis={"visible": False})
    return _empty_note(fig, text)


# ------------------------------------------------------------------------------- step time
# The traces of step_time_figure, in order (a live page appends new steps to them by index).
STEP_TIME_PARTS = ("compute", "stall", "optimizer", "migration", "other")


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
    for part in STEP_TIME_PARTS:
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
    _layout(fig, "Training loss", "optimizer step", "loss (dimensionless)")
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


# ---------------------------------------------------------------------------- plan markers
MAX_PLAN_LABELS = 20  # more adopted plans than this are drawn as lines without labels


def add_plan_markers(fig: go.Figure, plans_df: pd.DataFrame) -> go.Figure:
    """Mark each adopted plan on a figure whose x axis is the optimizer step: a dotted vertical line
    between step ``created_step`` (the last step before the plan) and the next one, labelled with
    the plan's version. Shapes, not traces, so the figure's traces keep their indices. Returns
    ``fig``, changed in place."""
    _require(plans_df, ["version", "created_step", "adopted"], "add_plan_markers", "profiler.queries.plans(url, run_id)")
    adopted = plans_df[plans_df["adopted"].astype(bool)].sort_values("created_step")
    label = len(adopted) <= MAX_PLAN_LABELS
    for row in adopted.itertuples(index=False):
        text = {"annotation_text": f"plan v{int(row.version)}", "annotation_position": "top left",
                "annotation_font_size": 10} if label else {}
        fig.add_vline(x=float(row.created_step) + 0.5, line={"color": "#555", "dash": "dot", "width": 1},
                      exclude_empty_subplots=False, **text)
    return fig


# ------------------------------------------------------------------------------- memory
def memory_figure(homed_df: pd.DataFrame, steps_df: pd.DataFrame | None = None) -> go.Figure:
    """Bytes homed on each tier per step (stacked areas, MB: param homes' ``param_bytes`` plus
    optimizer homes' ``optim_bytes``, see ``queries.homed_bytes``), and, from ``steps_df``, the DRAM
    the engine measured in use (``dram_bytes``: homes, buffers, working set) as a line. (The process
    RSS, mostly the framework's own, would dwarf the rest: it is in the steps table.)"""
    _require(homed_df, ["step", *[f"{t}_bytes" for t in TIERS]], "memory_figure", "profiler.queries.homed_bytes(url, run_id)")
    d = homed_df.sort_values("step")
    fig = go.Figure()
    for tier in TIERS:
        y = d[f"{tier}_bytes"].astype("float64")
        if not (y > 0).any():
            continue
        fig.add_trace(go.Scatter(
            x=d["step"], y=y / MB, name=f"homed on {tier}", stackgroup="homes", mode="lines",
            line={"color": TIER_COLORS[tier], "width": 0.5}, customdata=y,
            hovertemplate=f"step %{{x}}<br>homed on {tier} %{{y:.2f}} MB (%{{customdata:,.0f}} B)<extra></extra>"))
    if steps_df is not None:
        _require(steps_df, ["step", "dram_bytes"], "memory_figure", "profiler.queries.steps(url, run_id)")
        s = steps_df.sort_values("step")
        y = s["dram_bytes"].astype("float64")
        if (y > 0).any():
            fig.add_trace(go.Scatter(
                x=s["step"], y=y / MB, name="engine DRAM in use (measured)", mode="lines", line={"color": "#333"},
                hovertemplate="step %{x}<br>engine DRAM in use %{y:.2f} MB<extra></extra>"))
    _layout(fig, "Memory per tier", "optimizer step", "bytes (MB = 10^6 B)")
    if not fig.data:
        _empty_note(fig, "no steps recorded")
    return fig


# ------------------------------------------------------------------------------ shards
def shard_heatmap_figure(heat_df: pd.DataFrame, labels: dict[int, str] | None = None) -> go.Figure:
    """Accesses per shard per step, binned (``queries.shard_heatmap``): steps across, shards down in
    model order. ``labels``: a name for the shard bins (keyed by ``index_lo``), e.g. the shard's
    name where a bin holds one shard; bins without a label read ``#lo-hi``."""
    _require(heat_df, ["step_lo", "step_hi", "index_lo", "index_hi", "accesses_per_shard_step"],
             "shard_heatmap_figure", "profiler.queries.shard_heatmap(url, run_id)")
    fig = go.Figure()
    if len(heat_df):
        z = heat_df.pivot_table(index="index_lo", columns="step_lo", values="accesses_per_shard_step",
                                aggfunc="sum", fill_value=0.0)
        his = heat_df.drop_duplicates("index_lo").set_index("index_lo")["index_hi"]
        labels = labels or {}

        def name(lo: int) -> str:
            hi = int(his[lo])
            return labels.get(int(lo)) or (f"#{lo}" if hi == lo else f"#{lo}-{hi}")

        step_w = int(heat_df["step_hi"].iloc[0] - heat_df["step_lo"].iloc[0] + 1)
        fig.add_trace(go.Heatmap(
            x=[int(c) for c in z.columns], y=[name(int(i)) for i in z.index], z=z.to_numpy(),
            colorscale="YlOrRd", colorbar={"title": {"text": "accesses per<br>shard per step"}},
            hovertemplate="steps from %{x}<br>shards %{y}<br>%{z:.3g} accesses per shard per step<extra></extra>"))
        fig.update_yaxes(autorange="reversed", type="category")
        title = "Shard accesses over steps" + (f" ({step_w} steps a column)" if step_w > 1 else "")
    else:
        title = "Shard accesses over steps"
    _layout(fig, title, "optimizer step (first of the bin)", "shard (model order)")
    if not fig.data:
        _empty_note(fig, "no per-shard rows recorded (profiler detail: step)")
    return fig


def shard_treemap_figure(tree_df: pd.DataFrame) -> go.Figure:
    """The model's state as nested boxes: module, then shard, then its param and optimizer homes,
    each box sized by its bytes and the homes coloured by their tier (green GPU, blue DRAM, red
    NVMe). ``tree_df``: one row per home, ``module, shard, state, tier, bytes`` (rows with 0 bytes
    are left out)."""
    _require(tree_df, ["module", "shard", "state", "tier", "bytes"], "shard_treemap_figure",
             "dashboard.views.treemap_frame(shards, migrations)")
    d = tree_df[tree_df["bytes"] > 0]
    module = d["module"].astype(str)
    shard = d["shard"].astype(str)
    homes = pd.DataFrame({  # the leaves: one box per home
        "id": "h/" + module + "/" + shard + "/" + d["state"] + "/" + d["tier"],
        "label": d["state"] + " (" + d["tier"] + ")",
        "parent": "s/" + module + "/" + shard,
        "bytes": d["bytes"],
        "color": d["tier"].map(TIER_COLORS).fillna("#BAB0AC"),
        "hover": shard + " " + d["state"] + " home on " + d["tier"],
    })
    per_shard = d.assign(module=module, shard=shard).groupby(["module", "shard"], as_index=False, sort=False)["bytes"].sum()
    shards = pd.DataFrame({
        "id": "s/" + per_shard["module"] + "/" + per_shard["shard"], "label": per_shard["shard"],
        "parent": "m/" + per_shard["module"], "bytes": per_shard["bytes"], "color": "#e8e8e8",
        "hover": "shard " + per_shard["shard"],
    })
    per_module = per_shard.groupby("module", as_index=False)["bytes"].sum()
    shown = per_module["module"].where(per_module["module"] != "", "(top level)")
    modules = pd.DataFrame({
        "id": "m/" + per_module["module"], "label": shown, "parent": "", "bytes": per_module["bytes"],
        "color": "#f4f4f4", "hover": "module " + shown,
    })
    # branchvalues="total": a box's value is the sum of its children's; values are whole bytes, so
    # the sums are exact (a parent smaller than its children by a rounding error is not drawn)
    nodes = pd.concat([modules, shards, homes], ignore_index=True)
    fig = go.Figure()
    if len(nodes):
        fig.add_trace(go.Treemap(
            ids=nodes["id"].tolist(), labels=nodes["label"].tolist(), parents=nodes["parent"].tolist(),
            values=nodes["bytes"].astype("float64").tolist(), branchvalues="total",
            marker={"colors": nodes["color"].tolist()}, customdata=nodes["hover"].tolist(),
            hovertemplate="%{customdata}<br>%{value:,.0f} B<extra></extra>"))
    fig.update_layout(title="State by module, sized by bytes, coloured by tier (green GPU, blue DRAM, red NVMe)",
                      template="plotly_white", margin={"t": 50, "l": 10, "r": 10, "b": 10})
    if not fig.data:
        _empty_note(fig, "no shards recorded")
    return fig


# ------------------------------------------------------------------------------- plans
def migrations_figure(mig_df: pd.DataFrame) -> go.Figure:
    """Bytes migrated per step (MB), stacked by direction (``src -> dst``, coloured by destination).
    Input: ``queries.migrations_per_step``."""
    _require(mig_df, ["step", "src_tier", "dst_tier", "moves", "bytes"], "migrations_figure",
             "profiler.queries.migrations_per_step(url, run_id)")
    fig = go.Figure()
    for (src, dst), part in mig_df.sort_values("step").groupby(["src_tier", "dst_tier"], sort=True):
        fig.add_trace(go.Bar(
            x=part["step"], y=part["bytes"].astype("float64") / MB, name=f"{src} → {dst}",
            marker_color=TIER_COLORS.get(dst), marker_pattern_shape="" if dst != "nvme" else "/",
            customdata=part["moves"],
            hovertemplate=f"after step %{{x}}<br>{src} → {dst} %{{y:.2f}} MB in %{{customdata}} moves<extra></extra>"))
    _layout(fig, "Migrations between steps", "optimizer step (moved after it)", "bytes moved (MB = 10^6 B)", barmode="stack")
    if not fig.data:
        _empty_note(fig, "no migrations recorded")
    return fig


def predicted_vs_measured_figure(steps_df: pd.DataFrame, plans_df: pd.DataFrame) -> go.Figure:
    """Measured step wall time per step (grey), the measured median over the steps each plan
    version was in force (``steps.plan_version``), and each adopted plan's predicted step time
    from its creation to the next adopted plan (dashed); plans not adopted are hollow markers at
    the step they were made."""
    _require(steps_df, ["step", "wall_s", "plan_version"], "predicted_vs_measured_figure", "profiler.queries.steps(url, run_id)")
    _require(plans_df, ["version", "created_step", "predicted_step_s", "adopted"], "predicted_vs_measured_figure",
             "profiler.queries.plans(url, run_id)")
    s = steps_df.sort_values("step")
    fig = go.Figure()
    if len(s):
        fig.add_trace(go.Scatter(x=s["step"], y=s["wall_s"], mode="lines", name="measured step",
                                 line={"color": "#BAB0AC", "width": 1},
                                 hovertemplate="step %{x}<br>measured %{y:.4f} s<extra></extra>"))
        # the measured median of each run of consecutive steps under one plan version
        run_break = (s["plan_version"] != s["plan_version"].shift()).cumsum()
        xs: list = []
        ys: list = []
        for _, seg in s.groupby(run_break, sort=False):
            med = float(seg["wall_s"].median())
            xs += [float(seg["step"].iloc[0]) - 0.5, float(seg["step"].iloc[-1]) + 0.5, None]
            ys += [med, med, None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="measured median per plan",
                                 line={"color": "#333", "width": 2},
                                 hovertemplate="measured median %{y:.4f} s<extra></extra>"))
    p = plans_df.dropna(subset=["predicted_step_s"]).sort_values("created_step")
    adopted = p[p["adopted"].astype(bool)]
    if len(adopted):
        last = float(s["step"].max()) + 0.5 if len(s) else float(adopted["created_step"].max()) + 1.5
        starts = adopted["created_step"].astype(float).to_numpy() + 0.5
        ends = np.append(starts[1:], max(last, starts[-1] + 1))
        xs, ys = [], []
        for a, b, y in zip(starts, ends, adopted["predicted_step_s"].astype(float)):
            xs += [a, b, None]
            ys += [y, y, None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="predicted (adopted plan)",
                                 line={"color": PHASE_COLORS["optimizer"], "dash": "dash", "width": 2},
                                 hovertemplate="predicted %{y:.4f} s<extra></extra>"))
    rejected = p[~p["adopted"].astype(bool)]
    if len(rejected):
        fig.add_trace(go.Scatter(x=rejected["created_step"], y=rejected["predicted_step_s"], mode="markers",
                                 name="predicted (plan not adopted)", customdata=rejected["version"],
                                 marker={"symbol": "circle-open", "size": 8, "color": PHASE_COLORS["optimizer"]},
                                 hovertemplate="plan v%{customdata} after step %{x}<br>predicted %{y:.4f} s<extra></extra>"))
    _layout(fig, "Predicted against measured step time", "optimizer step", "time per step (s)")
    if not fig.data:
        _empty_note(fig, "no steps or plans recorded")
    return fig


# ------------------------------------------------------------------------------ what-if
def whatif_figure(df: pd.DataFrame, chosen_budget_bytes: int | None = None) -> go.Figure:
    """The predicted step time against the DRAM budget, one point per budget the planner placed
    (``planner.whatif.what_if``); budgets it could not place are grey crosses at 0. The budget axis
    is in GB (10^9 B), or MB (10^6 B) when every budget is below 1 GB. With
    ``chosen_budget_bytes`` a vertical line marks that budget, and a star the prediction at it
    (the row with that budget, or the nearest), named with its step time and speed-up."""
    _require(df, ["dram_budget_bytes", "budget_fraction", "predicted_step_s", "speedup", "dram_used_bytes", "feasible"],
             "whatif_figure", "planner.whatif.what_if(url, run_id)")
    d = df.sort_values("dram_budget_bytes")
    ok = d[d["feasible"].astype(bool)]
    bad = d[~d["feasible"].astype(bool)]
    most = max([float(d["dram_budget_bytes"].max()) if len(d) else 0.0, float(chosen_budget_bytes or 0)])
    scale, unit = (GB, "GB") if most >= GB else (MB, "MB")
    custom = ["budget_fraction", "speedup", "dram_used_bytes"]
    fig = go.Figure()
    if len(ok):
        fig.add_trace(go.Scatter(
            x=ok["dram_budget_bytes"] / scale, y=ok["predicted_step_s"], mode="lines+markers", name="predicted step",
            line={"color": PHASE_COLORS["compute"]}, customdata=ok[custom].to_numpy(dtype="float64"),
            hovertemplate=(f"budget %{{x:.4g}} {unit} (%{{customdata[0]:.0%}} of the state)<br>predicted %{{y:.4f}} s"
                           "<br>speed-up %{customdata[1]:.2f}x over all-NVMe<br>DRAM used %{customdata[2]:,.0f} B<extra></extra>")))
    if len(bad):
        fig.add_trace(go.Scatter(
            x=bad["dram_budget_bytes"] / scale, y=np.zeros(len(bad)), mode="markers", name="cannot place",
            marker={"symbol": "x", "color": "#999", "size": 9},
            hovertemplate=f"budget %{{x:.4g}} {unit}: below what the engine needs<extra></extra>"))
    if chosen_budget_bytes is not None:
        x = float(chosen_budget_bytes) / scale
        fig.add_vline(x=x, line={"color": PHASE_COLORS["stall"], "dash": "dot"}, exclude_empty_subplots=False)
        if len(ok):
            at = ok.iloc[int(np.argmin(np.abs(ok["dram_budget_bytes"].to_numpy(dtype="float64") - float(chosen_budget_bytes))))]
            fig.add_trace(go.Scatter(
                x=[at["dram_budget_bytes"] / scale], y=[at["predicted_step_s"]], mode="markers",
                name=f"chosen {x:.3g} {unit}: {at['predicted_step_s']:.4g} s, {at['speedup']:.2f}x",
                marker={"symbol": "star", "size": 16, "color": PHASE_COLORS["stall"]},
                hovertemplate=f"chosen %{{x:.4g}} {unit}<br>predicted %{{y:.4f}} s<extra></extra>"))
    _layout(fig, "What-if: predicted step time against the DRAM budget", f"DRAM budget ({unit} = 10^{9 if unit == 'GB' else 6} B)",
            "predicted time per step (s)")
    if not fig.data:
        _empty_note(fig, "no what-if rows")
    return fig
