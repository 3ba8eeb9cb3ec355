"""Property-based fuzzing of the dashboard's HTTP surface: no request, well-formed or not, gets a
5xx. Two fuzzers over the real profile of ``test_dashboard_api`` (two finished runs, plans):

* schemathesis reads ``/openapi.json`` and generates requests for every operation from its
  schema, valid ones and ones that break it (wrong types, out-of-range numbers, odd strings);
* a hypothesis test over every path in ``app.openapi()`` that mixes the real run and plan ids,
  unknown ones and garbage into the path and query, so that valid ids (which schemathesis seldom
  guesses) reach the code that reads the database.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings, strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from test_dashboard_api import build_profile

from dashboard import api, pages
from dashboard.app import create_app

FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def routes_only() -> FastAPI:
    """The dashboard's routers without a database: enough for schemathesis to read the OpenAPI
    schema when the tests are collected (the real app needs the profile, which a fixture trains;
    schemathesis' lazy ``from_fixture`` loader does not run under this pytest). The requests go to
    the real app (``case.call(app=...)``), whose schema is checked to be the same."""
    skeleton = FastAPI(docs_url=None, redoc_url=None)
    skeleton.include_router(api.router)
    skeleton.include_router(pages.router)
    return skeleton


schema = schemathesis.openapi.from_asgi("/openapi.json", routes_only())
KNOWN_IDS: dict[str, list[int]] = {}  # the profile's run and plan ids, once the app fixture has built it


@schema.hook
def flatmap_path_parameters(context, path_parameters):
    """Now and then swap a generated integer id for a real one: schemathesis seldom guesses them,
    and only real ids reach the code that reads a run."""
    options = [st.just(path_parameters)]
    if not path_parameters:  # an operation without path parameters
        return options[0]
    for name, ids in KNOWN_IDS.items():
        if isinstance(path_parameters.get(name), int):
            options.append(st.sampled_from(ids).map(lambda v, n=name: {**path_parameters, n: v}))
    return st.one_of(options)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    profile = build_profile(tmp_path_factory)
    real = create_app(profile.url)
    assert real.openapi()["paths"] == routes_only().openapi()["paths"]
    KNOWN_IDS.update(run_id=[profile.gpt, profile.moe], plan_id=[profile.plan_id])
    return real


@schema.parametrize()
@FUZZ
def test_schema_fuzz_no_server_errors(case, app):
    """Every operation of the OpenAPI schema, positive and negative cases: never a 5xx, and a 2xx
    body matches its documented model."""
    case.call_and_validate(app=app, checks=[not_a_server_error, response_schema_conformance])


# ----------------------------------------------------------------------------- targeted fuzz
GARBAGE = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.text(alphabet=st.characters(exclude_categories=("Cs", "Cc")), max_size=12),
    st.sampled_from(["", "-1", "1e3", "0x10", "NaN", "inf", "1.5", "../../etc/passwd", "%00", "null", "true"]),
)


def _values(name: str, profile, *, broken: bool) -> st.SearchStrategy:
    """Values for a parameter: meaningful ones (the real ids most of all; numbers in range), or,
    when ``broken``, now and then garbage instead."""
    meaningful = {
        "run_id": st.sampled_from([profile.gpt, profile.moe, profile.moe, profile.moe, 0, 999, 2**63 - 1]),
        "plan_id": st.sampled_from([profile.plan_id, profile.plan_id, 0, 99999]),
        "name": st.sampled_from(["step-time", "loss", "bandwidth", "memory", "bytes-moved", "shard-heatmap",
                                 "shard-treemap", "migrations", "predicted-vs-measured", "cost-model"]),
        "sort": st.sampled_from(["accesses_per_step", "name", "stall_s_per_step", "state_bytes", "kind", "param_tier"]),
        "order": st.sampled_from(["asc", "desc"]),
        "limit": st.integers(1, 1000),
        "offset": st.integers(0, 60),
        "max_steps": st.integers(1, 500),
        "max_shards": st.integers(1, 500),
        # a few budgets only: each new one is a re-plan (~0.1 s)
        "budget": st.sampled_from([0, 1, 4 << 20, 1 << 40]),
    }.get(name, st.integers(min_value=-2, max_value=12))  # after_step, first_step
    if not broken or name == "budget":
        return meaningful.map(str)
    return st.one_of(meaningful.map(str), GARBAGE)


def _get_paths() -> list[str]:
    return sorted(p for p, ops in routes_only().openapi()["paths"].items() if "get" in ops)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("path", _get_paths())
@given(data=st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_targeted_fuzz_no_server_errors(client, app, tmp_path_factory, path, data):
    """Each path with the real run and plan ids most of the time, unknown and malformed ones
    otherwise, and each query parameter sent or not, meaningful or garbage: never a 5xx; an API
    error is JSON with a message."""
    profile = build_profile(tmp_path_factory)
    broken = data.draw(st.booleans(), label="malformed")
    url = path
    query = {}
    for param in app.openapi()["paths"][path]["get"].get("parameters", []):
        name = param["name"]
        if param["in"] == "path":
            url = url.replace("{" + name + "}", quote(data.draw(_values(name, profile, broken=broken), label=name), safe=""))
        elif data.draw(st.booleans(), label=f"send {name}"):
            query[name] = data.draw(_values(name, profile, broken=broken), label=name)
    response = client.get(url, params=query)
    assert response.status_code < 500, (url, query, response.status_code, response.text[:300])
    if url.startswith("/api/"):
        body = response.json()  # JSON always, errors too
        if response.status_code >= 400:
            assert isinstance(body.get("detail"), (str, list)) and body["detail"]
