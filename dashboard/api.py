"""The dashboard's JSON API (mounted under ``/api``): runs, steps, figures, shards, I/O samples,
plans, migrations and the what-if curve of the profile database the app was started on.

Every route declares a pydantic response model, so ``/openapi.json`` describes what it returns.
Tables that grow with a run (shards, I/O samples, plan assignments, migrations, plans) come in
pages: ``limit`` (capped) and ``offset``, with ``total`` the number of rows in all pages; the
shard heatmap is binned in SQL to at most ``max_steps`` x ``max_shards`` cells; the steps of a
live run are polled with ``after_step``. Ids and numbers are bounded, so a request can cause a
404 (unknown run or plan id, with a message naming it) or a 422 (malformed), never a 5xx.
The routes read only; none takes a file path.
"""

from __future__ import annotations

import json
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Generic, Literal, TypeVar

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel, Field

from dashboard.views import FIGURES, SHARD_SORT_COLUMNS, DashboardData, records

router = APIRouter(prefix="/api", tags=["api"])

MAX_ID = 2**63 - 1  # SQLite's largest integer: a larger id could not be looked up at all
MAX_COUNT = 2**62  # bound of steps, offsets and byte counts in queries

T = TypeVar("T")


def get_data(request: Request) -> DashboardData:
    """The app's :class:`DashboardData` (one read-only engine and cache per app)."""
    return request.app.state.data


Data = Annotated[DashboardData, Depends(get_data)]
RunId = Annotated[int, Path(ge=0, le=MAX_ID, description="a run id (``zinf runs`` lists them)")]
PlanId = Annotated[int, Path(ge=0, le=MAX_ID, description="a plan id (from /api/runs/{run_id}/plans)")]
Offset = Annotated[int, Query(ge=0, le=MAX_COUNT, description="rows to skip")]


# ---------------------------------------------------------------------------------- models
class ErrorOut(BaseModel):
    """An error: ``detail`` says what and, where there is one, the fix (e.g. the known ids)."""

    detail: str


ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorOut, "description": "unknown run or plan id"},
    503: {"model": ErrorOut, "description": "the profile database cannot be read"},
}


class Page(BaseModel, Generic[T]):
    """One page of a table: ``rows`` ``offset`` to ``offset + len(rows)`` of ``total``."""

    total: int = Field(description="rows in all pages")
    limit: int
    offset: int
    rows: list[T]


class RunSummary(BaseModel):
    run_id: int
    name: str
    status: str = Field(description="running, finished or crashed (a running row whose process is gone reads crashed)")
    started_at: datetime | None = None
    finished_at: datetime | None = None
    duration_s: float | None = None
    steps: int
    median_step_s: float | None = None
    total_wall_s: float | None = None
    last_loss: float | None = None
    stall_fraction: float | None = Field(None, description="stall seconds / wall seconds over the run's steps")
    model: str = ""
    hardware: str | None = None
    hostname: str | None = None


class RunsOut(BaseModel):
    runs: list[RunSummary] = Field(description="newest first")


class RunDetail(BaseModel):
    run_id: int
    name: str
    status: str
    recorded_status: str
    started_at: datetime | None = None
    finished_at: datetime | None = None
    last_heartbeat_at: datetime | None = None
    steps: int
    last_step: int | None = None
    shards: int
    detail: str | None = Field(None, description="the profiler's detail level: step or shard")
    window_steps: int | None = None
    hostname: str | None = None
    model: str = ""
    hardware: str = ""
    config: dict[str, int | float | bool | str | None] = Field(description="the settings that shape the timeline, dotted keys")
    bandwidths_GBps: dict[str, float] = Field(description="measured bandwidths, GB/s = 10^9 B/s")


class StepRow(BaseModel):
    step: int
    recorded_at: datetime | None = None
    micro_batches: int
    wall_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    stall_s: float
    migration_s: float
    compute_s: float = Field(description="forward_s + backward_s - stall_s, clipped at 0")
    other_s: float = Field(description="wall_s - the four parts, clipped at 0")
    loss: float | None = None
    read_gpu_bytes: int
    read_cpu_bytes: int
    read_nvme_bytes: int
    written_gpu_bytes: int
    written_cpu_bytes: int
    written_nvme_bytes: int
    dram_bytes: int
    pinned_bytes: int
    gpu_bytes: int
    rss_bytes: int
    plan_version: int


class StepsOut(BaseModel):
    run_id: int
    status: str = Field(description="running while the recorder writes; poll again after 2 s while it is")
    after_step: int | None
    has_more: bool = Field(description="more steps follow: ask again with after_step = the last step here")
    steps: list[StepRow]


class PlotlyFigure(BaseModel):
    """A plotly figure as ``Plotly.react(div, data, layout)`` takes it (arrays as plain JSON lists)."""

    data: list[dict[str, Any]]
    layout: dict[str, Any]


class FigureOut(BaseModel):
    run_id: int
    name: str
    title: str
    points: int = Field(description="points drawn: x values, heatmap cells or treemap boxes")
    last_step: int | None = Field(description="the run's last recorded step when the figure was built")
    figure: PlotlyFigure


FigureName = Enum("FigureName", {name.replace("-", "_"): name for name in FIGURES}, type=str)  # type: ignore[misc]


class ShardRow(BaseModel):
    shard_id: int
    shard_index: int
    name: str
    module: str
    kind: str
    numel: int
    param_bytes: int
    optim_bytes: int
    grad_bytes: int
    state_bytes: int = Field(description="param_bytes + optim_bytes")
    param_tier: str = Field(description="the param home's tier now (after the recorded migrations)")
    optim_tier: str = Field(description="the optimizer home's tier now (none: a frozen shard)")
    initial_param_tier: str
    initial_optim_tier: str
    forward_accesses: int
    backward_accesses: int
    recompute_accesses: int
    optimizer_accesses: int
    total_accesses: int
    read_bytes: int
    written_bytes: int
    fetch_s: float
    stall_s: float
    optimizer_s: float
    windows: int = Field(description="shard_steps rows (windows in which the shard was accessed)")
    accesses_per_step: float | None = None
    read_bytes_per_step: float | None = None
    fetch_s_per_step: float | None = None
    stall_s_per_step: float | None = None
    optimizer_s_per_step: float | None = None


class HeatmapBin(BaseModel):
    step_lo: int
    step_hi: int
    index_lo: int = Field(description="first shard_index of the bin")
    index_hi: int
    accesses: int
    accesses_per_shard_step: float


class HeatmapOut(BaseModel):
    run_id: int
    max_steps: int
    max_shards: int
    bins: list[HeatmapBin] = Field(description="bins with recorded accesses; missing bins had none")


class IoSampleRow(BaseModel):
    step: int
    shard: str | None = None
    op: str
    tier: str
    what: str
    bytes: int
    seconds: float
    GBps: float | None = None
    o_direct: bool | None = None
    block_size: int | None = None
    queue_depth: int | None = None
    thread_count: int | None = None
    concurrency: float | None = None


class PlanFields(BaseModel):
    """What a plan row of the profile says (shared by the plan history and one plan's detail)."""

    plan_id: int
    version: int
    created_step: int
    created_at: datetime | None = None
    policy: str
    dram_budget_bytes: int | None = None
    predicted_step_s: float | None = None
    predicted_gain_s: float | None = None
    adopted: bool
    reason: Any = None
    assignments: int


class PlanRow(PlanFields):
    measured_step_s: float | None = Field(None, description="median wall_s of the steps run under this plan (adopted ones)")
    measured_steps: int = 0
    migrated_bytes: int = 0


class PlanDetail(PlanFields):
    run_id: int


class AssignmentRow(BaseModel):
    shard: str
    shard_index: int
    param_tier: str
    optim_tier: str
    score: float | None = None


class MigrationRow(BaseModel):
    step: int
    plan_version: int | None = None
    shard: str
    state: str
    src_tier: str
    dst_tier: str
    bytes: int
    seconds: float


class WhatIfRow(BaseModel):
    dram_budget_bytes: int
    budget_fraction: float | None = Field(None, description="of the run's model state bytes")
    predicted_step_s: float | None = None
    speedup: float | None = Field(None, description="over the all-NVMe prediction")
    dram_used_bytes: int | None = None
    feasible: bool


class WhatIfOut(BaseModel):
    run_id: int
    chosen_budget_bytes: int | None
    chosen: WhatIfRow | None = Field(description="the row of the chosen budget")
    rows: list[WhatIfRow]
    figure: FigureOut


# ---------------------------------------------------------------------------------- routes
@router.get("/runs", response_model=RunsOut, responses={503: ERRORS[503]})
def list_runs(data: Data) -> Any:
    """Every run, newest first, with its headline numbers."""
    return {"runs": data.runs()}


@router.get("/runs/{run_id}", response_model=RunDetail, responses=ERRORS)
def get_run(run_id: RunId, data: Data) -> Any:
    """One run: status, model, hardware, settings, counts."""
    return data.run(run_id)


@router.get("/runs/{run_id}/steps", response_model=StepsOut, responses=ERRORS)
def get_steps(run_id: RunId, data: Data,
              after_step: Annotated[int | None, Query(ge=-MAX_COUNT, le=MAX_COUNT, description="only steps after this one")] = None,
              limit: Annotated[int, Query(ge=1, le=5000, description="steps in the answer (at most 5000)")] = 1000) -> Any:
    """The run's steps after ``after_step`` in step order: a live page polls this."""
    rows, more, status = data.steps(run_id, after_step=after_step, limit=limit)
    return {"run_id": run_id, "status": status, "after_step": after_step, "has_more": more, "steps": rows}


@router.get("/runs/{run_id}/figures/{name}", response_model=FigureOut, responses=ERRORS)
def get_figure(run_id: RunId, name: FigureName, data: Data) -> Response:  # type: ignore[valid-type]
    """One figure of the run as plotly JSON, built by :mod:`dashboard.figures` (the same as in the
    offline report)."""
    fig = data.figure(run_id, name.value)
    # the figure JSON is cached as text: assembled here rather than parsed and re-encoded
    head = json.dumps({"run_id": run_id, "name": fig["name"], "title": fig["title"], "points": fig["points"],
                       "last_step": fig["last_step"]})
    return Response(head[:-1] + ',"figure":' + fig["figure_json"] + "}", media_type="application/json")


@router.get("/runs/{run_id}/shards", response_model=Page[ShardRow], responses=ERRORS)
def get_shards(run_id: RunId, data: Data,
               sort: Annotated[Literal[SHARD_SORT_COLUMNS], Query(description="column to sort by")] = "accesses_per_step",  # type: ignore[valid-type]
               order: Annotated[Literal["desc", "asc"], Query(description="desc: hottest first")] = "desc",
               limit: Annotated[int, Query(ge=1, le=1000, description="rows in the page (at most 1000)")] = 50,
               offset: Offset = 0) -> Any:
    """The run's shards with their accesses, bytes and stall per step, sorted (hot to cold by
    default), one page at a time."""
    rows, total = data.shards_page(run_id, sort=sort, descending=order == "desc", limit=limit, offset=offset)
    return {"total": total, "limit": limit, "offset": offset, "rows": rows}


@router.get("/runs/{run_id}/shard-heatmap", response_model=HeatmapOut, responses=ERRORS)
def get_shard_heatmap(run_id: RunId, data: Data,
                      max_steps: Annotated[int, Query(ge=1, le=500, description="step bins (at most 500)")] = 200,
                      max_shards: Annotated[int, Query(ge=1, le=500, description="shard bins (at most 500)")] = 150) -> Any:
    """Accesses per shard over steps, summed into at most ``max_steps`` x ``max_shards`` bins."""
    return {"run_id": run_id, "max_steps": max_steps, "max_shards": max_shards,
            "bins": data.heatmap(run_id, max_steps=max_steps, max_shards=max_shards)}


@router.get("/runs/{run_id}/io-samples", response_model=Page[IoSampleRow], responses=ERRORS)
def get_io_samples(run_id: RunId, data: Data,
                   limit: Annotated[int, Query(ge=1, le=1000, description="rows in the page (at most 1000)")] = 100,
                   offset: Offset = 0,
                   first_step: Annotated[int | None, Query(ge=-MAX_COUNT, le=MAX_COUNT, description="only samples of this step and later")] = None) -> Any:
    """The run's recorded I/O requests (bytes, seconds, settings), in recording order."""
    rows, total = data.io_samples(run_id, limit=limit, offset=offset, first_step=first_step)
    return {"total": total, "limit": limit, "offset": offset, "rows": rows}


@router.get("/runs/{run_id}/plans", response_model=Page[PlanRow], responses=ERRORS)
def get_plans(run_id: RunId, data: Data,
              limit: Annotated[int, Query(ge=1, le=1000, description="rows in the page (at most 1000)")] = 100,
              offset: Offset = 0) -> Any:
    """The run's plans, newest first, with the measured step time of the adopted ones."""
    rows = data.plans(run_id)
    return {"total": len(rows), "limit": limit, "offset": offset, "rows": rows[offset:offset + limit]}


@router.get("/runs/{run_id}/migrations", response_model=Page[MigrationRow], responses=ERRORS)
def get_migrations(run_id: RunId, data: Data,
                   limit: Annotated[int, Query(ge=1, le=1000, description="rows in the page (at most 1000)")] = 100,
                   offset: Offset = 0) -> Any:
    """The run's shard moves between tiers, in the order they were made."""
    rows, total = data.migrations(run_id, limit=limit, offset=offset)
    return {"total": total, "limit": limit, "offset": offset, "rows": rows}


@router.get("/plans/{plan_id}", response_model=PlanDetail, responses=ERRORS)
def get_plan(plan_id: PlanId, data: Data) -> Any:
    """One plan: when, under what budget, what it predicted, whether it was adopted and why."""
    return data.plan(plan_id)


@router.get("/plans/{plan_id}/assignments", response_model=Page[AssignmentRow], responses=ERRORS)
def get_plan_assignments(plan_id: PlanId, data: Data,
                         limit: Annotated[int, Query(ge=1, le=1000, description="rows in the page (at most 1000)")] = 100,
                         offset: Offset = 0) -> Any:
    """The plan's tier for each shard's param and optimizer homes, in model order."""
    rows, total = data.plan_assignments(plan_id, limit=limit, offset=offset)
    return {"total": total, "limit": limit, "offset": offset, "rows": rows}


@router.get("/runs/{run_id}/what-if", response_model=WhatIfOut,
            responses={**ERRORS, 409: {"model": ErrorOut, "description": "the run's profile cannot be planned from"}})
def get_what_if(run_id: RunId, data: Data,
                budget: Annotated[int | None, Query(ge=0, le=MAX_COUNT, description="a DRAM budget to re-plan at, bytes")] = None) -> Any:
    """The predicted step time at a range of DRAM budgets (the planner re-plans the run's profile
    at each) and, given ``budget``, at that budget too, with the figure marking it."""
    rows, fig = data.what_if(run_id, budget)
    all_rows = records(rows)
    chosen = None
    if budget is not None and all_rows:  # the row re-planned at the budget (or, should the planner round it, the nearest)
        chosen = min(all_rows, key=lambda r: abs(r["dram_budget_bytes"] - budget))
    figure = {k: fig[k] for k in ("name", "title", "points", "last_step")}
    figure["run_id"] = run_id
    figure["figure"] = json.loads(fig["figure_json"])
    return {"run_id": run_id, "chosen_budget_bytes": budget, "chosen": chosen, "rows": all_rows, "figure": figure}
