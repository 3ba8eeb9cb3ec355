"""The dashboard's HTML pages: server-rendered shells that ``static/dashboard.js`` fills from the
JSON API (:mod:`dashboard.api`) with plotly.js.

==========================  ============================================================
page                        shows
==========================  ============================================================
``/``                       the runs: status, model, hardware, steps, median step, loss, stall
``/runs/{id}``              overview: step time by phase (plan changes marked), loss,
                            bandwidth, memory and bytes per tier; live while the run runs
``/runs/{id}/shards``       accesses heatmap, state treemap, hot/cold table (sortable, paged)
``/runs/{id}/plans``        plan history, migrations, predicted against measured, cost model
``/runs/{id}/what-if``      a DRAM-budget slider that re-plans and redraws the predicted step
==========================  ============================================================

Every chart is a ``<div id="chart-NAME">`` that gets ``data-points`` (points drawn) once drawn;
the live indicator is ``#live-indicator`` (``data-state``), the what-if slider ``#whatif-budget``.
plotly.js is served from the installed plotly package at ``/static/plotly.min.js``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import plotly
from fastapi import APIRouter, Depends, Path as PathParam, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.templating import Jinja2Templates

from dashboard.api import MAX_ID, get_data
from dashboard.views import DashboardData

router = APIRouter(tags=["pages"])
TEMPLATES = Jinja2Templates(directory=str(Path(__file__).resolve().parent / "templates"))  # autoescapes .html
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
# a tiny icon, so that no browser asks for a missing /favicon.ico (a console error)
FAVICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
               'fill="#4C78A8"/><path d="M4 4h8L4 12h8" stroke="#fff" stroke-width="2" fill="none"/></svg>')

Data = Annotated[DashboardData, Depends(get_data)]
RunId = Annotated[int, PathParam(ge=0, le=MAX_ID, description="a run id")]

NAV = (("overview", "Overview", ""), ("shards", "Shards", "/shards"), ("plans", "Plans", "/plans"),
       ("what-if", "What-if", "/what-if"))


def _render(request: Request, template: str, page: str, run: dict[str, Any] | None = None,
            nav_run_id: int | None = None, status_code: int = 200, **extra: Any) -> HTMLResponse:
    nav_id = run["run_id"] if run else nav_run_id
    nav = [(key, label, None if nav_id is None else f"/runs/{nav_id}{suffix}") for key, label, suffix in NAV]
    return TEMPLATES.TemplateResponse(request, template, {"page": page, "run": run, "nav": nav, **extra},
                                      status_code=status_code)


def error_page(request: Request, status_code: int, message: str) -> HTMLResponse:
    """The HTML answer to a page request that failed (e.g. 404 for an unknown run id)."""
    return _render(request, "error.html", "error", status_code=status_code, message=message)


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request, data: Data) -> HTMLResponse:
    """The runs of the database."""
    runs = data.runs()
    return _render(request, "runs.html", "runs", nav_run_id=runs[0]["run_id"] if runs else None)


@router.get("/runs/{run_id}", response_class=HTMLResponse, responses={404: {"description": "unknown run id"}})
def overview_page(request: Request, run_id: RunId, data: Data) -> HTMLResponse:
    """Step time, loss, bandwidth and memory of a run, live while it runs."""
    return _render(request, "overview.html", "overview", data.run(run_id))


@router.get("/runs/{run_id}/shards", response_class=HTMLResponse, responses={404: {"description": "unknown run id"}})
def shards_page(request: Request, run_id: RunId, data: Data) -> HTMLResponse:
    """Which shards are hot, and where the state lives."""
    return _render(request, "shards.html", "shards", data.run(run_id))


@router.get("/runs/{run_id}/plans", response_class=HTMLResponse, responses={404: {"description": "unknown run id"}})
def plans_page(request: Request, run_id: RunId, data: Data) -> HTMLResponse:
    """What the planner decided, moved and predicted."""
    return _render(request, "plans.html", "plans", data.run(run_id))


@router.get("/runs/{run_id}/what-if", response_class=HTMLResponse, responses={404: {"description": "unknown run id"}})
def what_if_page(request: Request, run_id: RunId, data: Data) -> HTMLResponse:
    """The predicted step time at other DRAM budgets."""
    return _render(request, "whatif.html", "what-if", data.run(run_id))


# --------------------------------------------------------------------------- static files
@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly_js() -> FileResponse:
    """plotly.js from the installed plotly Python package (the version its figures are made for)."""
    return FileResponse(PLOTLY_JS, media_type="text/javascript", headers={"Cache-Control": "public, max-age=86400"})


@router.get("/favicon.ico", include_in_schema=False)
def favicon() -> Response:
    return Response(FAVICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "public, max-age=86400"})
