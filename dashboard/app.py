"""The dashboard web app: :func:`create_app` builds a FastAPI app over one profile database.

The app factory (as in the full-stack FastAPI template) opens the database read-only once, checks
that it holds a profile schema, and wires the routers: :mod:`dashboard.api` (JSON, ``/api``) and
:mod:`dashboard.pages` (HTML pages and their static files, plotly.js from the installed plotly
package: no CDN, these machines are often offline). ``zinf dashboard`` serves it with uvicorn;
tests call it through FastAPI's ``TestClient``. The app itself binds to nothing.

Errors: an unknown run or plan id is a 404 whose message names the id and the known ones; any
other zinf error while answering (the database went away, a run that cannot be planned) is a 503
or a 409 with the one-line message; malformed input is FastAPI's 422.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from profiler import queries
from profiler.store import current_revision, describe_url, open_readonly
from zinf.errors import ProfileError, ZinfError

from dashboard import api, pages
from dashboard.views import DashboardData, WhatIfUnavailable, is_unknown_id

__all__ = ["create_app", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"


def _check_schema(engine, shown: str) -> None:
    """Raise a one-line ProfileError unless the database holds zinf's profile tables. Nothing is
    created or migrated here: the dashboard never writes."""
    if current_revision(engine) is None:
        raise ProfileError(
            f"profile database {shown} has no profile schema (an empty or foreign database); "
            f"record a run with the profiler enabled, or create it with `zinf db upgrade --db {shown}`"
        )
    queries.latest_run_id(engine)  # a missing table fails here, naming `zinf db upgrade`


def create_app(db_url: str) -> FastAPI:
    """A FastAPI app serving the dashboard of the profile database at ``db_url`` (a SQLAlchemy
    URL), opened read-only. A missing or unreadable database, or one without a profile schema,
    raises :class:`ProfileError` (one line, naming the URL and the fix)."""
    shown = describe_url(db_url)
    engine = open_readonly(db_url)
    try:
        _check_schema(engine, shown)
    except BaseException:
        engine.dispose()
        raise
    inner = describe_url(engine.url)  # the mode=ro URI that profiler.queries' messages name

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.dispose()

    app = FastAPI(
        title="zinf dashboard",
        description=f"The profile database {shown}, read-only: runs, steps, shards, plans and what-if.",
        lifespan=lifespan,
        # the interactive docs pages load their scripts from a CDN: off (the schema stays at /openapi.json)
        docs_url=None,
        redoc_url=None,
    )
    app.state.data = DashboardData(engine)
    app.state.db_url = shown
    app.add_middleware(GZipMiddleware, minimum_size=4096, compresslevel=5)

    @app.exception_handler(ZinfError)
    async def zinf_error(request: Request, exc: ZinfError) -> Response:
        message = str(exc).replace(inner, shown)
        if is_unknown_id(exc):
            status = 404
        elif isinstance(exc, (ProfileError, WhatIfUnavailable)):
            status = 503
        else:  # e.g. CostModelError, WorkloadError: the run's profile cannot answer this
            status = 409
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": message}, status_code=status)
        return pages.error_page(request, status, message)

    app.include_router(api.router)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
