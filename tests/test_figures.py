"""The dashboard's figures, built from a real profile: the tiny GPT trained for a few steps with its
params and optimizer state on NVMe files under tmp_path and the profiler recording into SQLite."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from conftest import SMALL_SHARDS
from test_costmodel import train_profiled
from dashboard import figures
from planner import CostModel
from profiler import queries

N_STEPS = 5


@pytest.fixture(scope="module")
def run_url(tmp_path_factory):
    """(URL, run id) of a real 5-step run."""
    url = train_profiled(tmp_path_factory.mktemp("figures"), N_STEPS, shards=SMALL_SHARDS)
    return url, queries.latest_run_id(url)


@pytest.fixture(scope="module")
def profile(run_url):
    """(steps, bandwidth_over_time, io_samples) frames of a real 5-step run."""
    url, run_id = run_url
    return queries.steps(url, run_id), queries.bandwidth_over_time(url, run_id), queries.io_samples(url, run_id)


def check_common(fig: go.Figure, x_unit: str | None, y_unit: str) -> None:
    assert isinstance(fig, go.Figure) and len(fig.data) > 0
    assert y_unit in fig.layout.yaxis.title.text
    if x_unit is not None:
        assert x_unit in fig.layout.xaxis.title.text
    html = fig.to_html(include_plotlyjs=True, full_html=True)
    assert "<html>" in html[:100] and "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js inlined


def test_step_time_figure(profile):
    steps, _, _ = profile
    assert len(steps) == N_STEPS
    fig = figures.step_time_figure(steps)
    check_common(fig, "step", "(s)")
    assert [t.name for t in fig.data] == ["compute", "stall", "optimizer", "migration", "other"]
    assert fig.layout.barmode == "stack"
    for t in fig.data:
        assert len(t.x) == len(t.y) == N_STEPS
        assert list(t.x) == list(steps["step"])
    stacked = np.sum([np.asarray(t.y, dtype=float) for t in fig.data], axis=0)
    assert stacked == pytest.approx(steps["wall_s"].to_numpy(), rel=1e-9)  # the parts add up to the wall time
    b = figures.step_time_breakdown(steps)
    assert (b[["compute_s", "stall_s", "optimizer_s", "migration_s", "other_s"]] >= 0).all().all()
    assert (b["stall_s"] > 0).any()  # NVMe placement: compute really waited for shards


def test_loss_figure(profile):
    steps, _, _ = profile
    fig = figures.loss_figure(steps)
    check_common(fig, "step", "loss")
    (trace,) = fig.data
    assert len(trace.x) == len(trace.y) == N_STEPS
    assert list(trace.y) == pytest.approx(steps["loss"].tolist())
    assert "dimensionless" in fig.layout.yaxis.title.text


def test_bandwidth_figure(profile):
    _, bw, _ = profile
    fig = figures.bandwidth_figure(bw)
    check_common(fig, "step", "(GB/s")
    assert {t.name for t in fig.data} == {"nvme read", "nvme write"}
    for t in fig.data:
        tier, op = t.name.split()
        expected = bw[(bw["tier"] == tier) & (bw[f"{op}_samples"] > 0)]
        assert len(t.x) == len(t.y) == len(expected) >= N_STEPS - 1
        assert np.all(np.asarray(t.y, dtype=float) > 0)
        assert list(t.y) == pytest.approx(expected[f"{op}_GBps"].tolist())


def test_bytes_per_tier_figure(profile):
    steps, _, _ = profile
    fig = figures.bytes_per_tier_figure(steps)
    check_common(fig, "step", "(MB")
    assert {t.name for t in fig.data} == {"nvme read", "nvme written"}  # everything lives on NVMe
    for t in fig.data:
        assert len(t.x) == len(t.y) == N_STEPS
        tier, op = t.name.split()
        assert np.asarray(t.y, dtype=float) * 1e6 == pytest.approx(steps[f"{op}_{tier}_bytes"].to_numpy(dtype=float))


def test_cost_model_figure(profile):
    _, _, samples = profile
    model = CostModel.fit(samples)
    fig = figures.cost_model_figure(samples, model)
    check_common(fig, "(B)", "(s)")
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    names = [t.name for t in fig.data]
    for op in ("read", "write"):
        (scatter,) = [t for t in fig.data if t.name == f"nvme {op} samples"]
        assert len(scatter.x) == len(scatter.y) == int((samples["op"] == op).sum())
        (line,) = [t for t in fig.data if t.name.startswith(f"nvme {op} fit")]
        c = model.cost("nvme", op)
        x, y = np.asarray(line.x, dtype=float), np.asarray(line.y, dtype=float)
        assert y == pytest.approx(c.latency_s + x / c.bandwidth_Bps)
        assert x.min() == pytest.approx(c.bytes_min) and x.max() == pytest.approx(c.bytes_max)
        assert np.all(np.diff(y) > 0)
    assert len(names) == 4
    small = figures.cost_model_figure(samples, model, max_points=50)
    assert "showing 50 of" in small.layout.title.text
    assert sum(len(t.x) for t in small.data if t.name.endswith("samples")) == 50


def test_empty_frames_give_annotated_figures(profile):
    steps, bw, samples = profile
    for fig in (figures.step_time_figure(steps.iloc[0:0]), figures.loss_figure(steps.iloc[0:0]),
                figures.bandwidth_figure(bw.iloc[0:0]), figures.bytes_per_tier_figure(steps.iloc[0:0])):
        assert fig.layout.annotations and "no " in fig.layout.annotations[0].text
        fig.to_html(include_plotlyjs=False)
    with pytest.raises(ValueError, match="profiler.queries.steps"):
        figures.loss_figure(bw)


# ------------------------------------------------------------------ the dashboard's other figures
def test_memory_figure(run_url, profile):
    url, run_id = run_url
    steps, _, _ = profile
    homed = queries.homed_bytes(url, run_id)
    fig = figures.memory_figure(homed, steps)
    check_common(fig, "step", "(MB")
    names = [t.name for t in fig.data]
    assert names[0] == "homed on nvme" and "engine DRAM in use (measured)" in names  # everything on NVMe
    (nvme,) = [t for t in fig.data if t.name == "homed on nvme"]
    shards = queries.shards(url, run_id)
    state = shards["param_bytes"].sum() + shards["optim_bytes"].sum()
    assert np.asarray(nvme.y, dtype=float) * 1e6 == pytest.approx(np.full(N_STEPS, float(state)))


def test_shard_heatmap_figure(run_url):
    url, run_id = run_url
    heat = queries.shard_heatmap(url, run_id)
    shards = queries.shards(url, run_id)
    assert heat["step_lo"].nunique() == N_STEPS and heat["index_lo"].nunique() == len(shards)  # small: one bin each
    labels = {int(i): f"#{i} {n}" for i, n in zip(shards["shard_index"], shards["name"])}
    fig = figures.shard_heatmap_figure(heat, labels)
    check_common(fig, "step", "shard")
    (trace,) = fig.data
    z = np.asarray(trace.z, dtype=float)
    assert z.shape == (len(shards), N_STEPS) and z.sum() == pytest.approx(heat["accesses"].sum())  # 1x1 bins
    assert list(trace.y)[0] == labels[0]
    binned = queries.shard_heatmap(url, run_id, max_steps=2, max_shards=4)
    assert binned["step_lo"].nunique() <= 2 and binned["index_lo"].nunique() <= 4
    assert binned["accesses"].sum() == heat["accesses"].sum()
    assert "steps a column" in figures.shard_heatmap_figure(binned).layout.title.text


def test_shard_treemap_figure(run_url):
    from dashboard.views import treemap_frame

    url, run_id = run_url
    shards = queries.shards(url, run_id)
    tree = treemap_frame(shards, queries.migrations(url, run_id))
    assert set(tree["tier"]) == {"nvme"} and tree["bytes"].sum() == shards["param_bytes"].sum() + shards["optim_bytes"].sum()
    fig = figures.shard_treemap_figure(tree)
    (trace,) = fig.data
    values = dict(zip(trace.ids, trace.values))
    roots = [i for i, p in zip(trace.ids, trace.parents) if p == ""]
    assert sum(values[r] for r in roots) == tree["bytes"].sum()  # the boxes add up to the whole state
    for node in trace.ids:  # each box holds exactly its children
        children = [values[c] for c, p in zip(trace.ids, trace.parents) if p == node]
        if children:
            assert sum(children) == values[node]
    leaf_colors = {c for i, c in zip(trace.ids, trace.marker.colors) if i.startswith("h/")}
    assert leaf_colors == {figures.TIER_COLORS["nvme"]}
    # lumped beyond max_shards: the same bytes, fewer boxes
    small = treemap_frame(shards, queries.migrations(url, run_id), max_shards=3)
    assert small["bytes"].sum() == tree["bytes"].sum() and small["shard"].str.contains("smaller shards").any()


PLANS = pd.DataFrame({"version": [1, 2, 3], "created_step": [2, 3, 4], "predicted_step_s": [0.5, 0.4, 0.45],
                      "adopted": [True, False, True]})


def test_plan_markers_and_predicted_vs_measured(profile):
    steps, _, _ = profile
    fig = figures.add_plan_markers(figures.step_time_figure(steps), PLANS)
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert [s.x0 for s in lines] == [2.5, 4.5]  # adopted plans only, between their step and the next
    assert [a.text for a in fig.layout.annotations] == ["plan v1", "plan v3"]
    assert len(fig.data) == 5  # markers are shapes: the traces a live page extends keep their indices

    s = steps.assign(plan_version=[0, 0, 1, 1, 3])
    fig = figures.predicted_vs_measured_figure(s, PLANS)
    check_common(fig, "step", "(s)")
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["measured step"].y) == pytest.approx(s["wall_s"].tolist())
    medians = [y for y in by_name["measured median per plan"].y if y is not None]
    assert medians[::2] == pytest.approx([s["wall_s"][:2].median(), s["wall_s"][2:4].median(), s["wall_s"][4:].median()])
    predicted = by_name["predicted (adopted plan)"]
    assert [x for x in predicted.x if x is not None] == [2.5, 4.5, 4.5, 5.5]  # v1 until v3, v3 to the end
    assert list(by_name["predicted (plan not adopted)"].y) == [0.4]


def test_migrations_figure():
    mig = pd.DataFrame({"step": [3, 3, 5], "src_tier": ["nvme", "nvme", "cpu"], "dst_tier": ["cpu", "cpu", "nvme"],
                        "moves": [2, 1, 1], "bytes": [2_000_000, 1_000_000, 500_000], "seconds": [0.01, 0.02, 0.01]})
    per_step = mig.groupby(["step", "src_tier", "dst_tier"], as_index=False)[["moves", "bytes", "seconds"]].sum()
    fig = figures.migrations_figure(per_step)
    check_common(fig, "step", "(MB")
    assert {t.name: list(t.y) for t in fig.data} == {"cpu → nvme": [0.5], "nvme → cpu": [3.0]}
    assert fig.layout.barmode == "stack"
    empty = figures.migrations_figure(per_step.iloc[0:0])
    assert not empty.data and "no migrations" in empty.layout.annotations[0].text


WHAT_IF = pd.DataFrame({  # the columns of planner.whatif.what_if
    "dram_budget_bytes": [1_000_000, 5_000_000, 10_000_000, 20_000_000],
    "budget_fraction": [0.05, 0.25, 0.5, 1.0],
    "predicted_step_s": [float("nan"), 2.0, 1.5, 1.0],
    "speedup": [float("nan"), 1.0, 1.33, 2.0],
    "dram_used_bytes": [float("nan"), 4.9e6, 9.8e6, 19.9e6],
    "feasible": [False, True, True, True],
})


def test_whatif_figure():
    fig = figures.whatif_figure(WHAT_IF)
    check_common(fig, "MB", "(s)")  # budgets below 1 GB: MB
    curve, bad = fig.data
    assert list(curve.x) == pytest.approx([5, 10, 20]) and list(curve.y) == [2.0, 1.5, 1.0]
    assert list(bad.x) == pytest.approx([1]) and bad.name == "cannot place"
    chosen = figures.whatif_figure(WHAT_IF, chosen_budget_bytes=9_000_000)
    star = chosen.data[-1]
    assert list(star.y) == [1.5] and star.name == "chosen 9 MB: 1.5 s, 1.33x"  # the nearest budget planned
    assert [s.x0 for s in chosen.layout.shapes] == [pytest.approx(9)]
    big = figures.whatif_figure(WHAT_IF.assign(dram_budget_bytes=WHAT_IF["dram_budget_bytes"] * 1000))
    assert "(GB" in big.layout.xaxis.title.text and list(big.data[0].x) == pytest.approx([5, 10, 20])
    with pytest.raises(ValueError, match="planner.whatif"):
        figures.whatif_figure(WHAT_IF.drop(columns="speedup"))


def test_note_figure():
    fig = figures.note_figure("I/O cost model", "no cost model: too few samples")
    assert not fig.data and fig.layout.annotations[0].text == "no cost model: too few samples"
