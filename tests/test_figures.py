"""The dashboard's figures, built from a real profile: the tiny GPT trained for a few steps with its
params and optimizer state on NVMe files under tmp_path and the profiler recording into SQLite."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

from conftest import SMALL_SHARDS
from test_costmodel import train_profiled
from dashboard import figures
from planner import CostModel
from profiler import queries

N_STEPS = 5


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """(steps, bandwidth_over_time, io_samples) frames of a real 5-step run."""
    url = train_profiled(tmp_path_factory.mktemp("figures"), N_STEPS, shards=SMALL_SHARDS)
    run_id = queries.latest_run_id(url)
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
