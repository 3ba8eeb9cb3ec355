"""The dashboard's web app (``dashboard.app.create_app``) through FastAPI's TestClient, on a real
profile: the tiny GPT trained for a few steps with its state on NVMe (run 1), and a small MoE
trained by the adaptive planner, which plans, adopts and migrates (run 2), both recorded into one
SQLite file. A copy of that file gets a third run from the recorder, written while the app reads
(the live page's polling).

Checked: every API route and page answers 200 with data; unknown run and plan ids are 404 with a
message naming them; pages and limits are honoured; the database is opened read-only and not
changed; the CLI binds 127.0.0.1 unless told otherwise and fails in one line on a missing or
foreign database.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import socket
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go
import pytest
import sqlalchemy as sa
import typer.main
import zinf
from fastapi.testclient import TestClient

from conftest import SMALL_SHARDS
from test_controller import MiB, adaptive_config, skewed_moe
from test_costmodel import train_profiled
from test_profiler import run_started, step_events
from zinf import cli
from zinf.errors import ProfileError

from dashboard import views
from dashboard.app import create_app
from profiler import queries
from profiler.recorder import Recorder

GPT_STEPS = 4
MOE_STEPS = 9  # plans after steps 3 and 7 (replan_every 4), so at least one plan is adopted and lands
HAVE_WHATIF = importlib.util.find_spec("planner.whatif") is not None


# ------------------------------------------------------------------------------ fixtures
@dataclass
class Profile:
    url: str
    path: Path
    gpt: int  # run ids
    moe: int
    plan_id: int  # an adopted plan of the MoE run


_PROFILE: list[Profile] = []  # one profile per test session, shared with test_dashboard_fuzz.py


def build_profile(tmp_path_factory) -> Profile:
    if _PROFILE:
        return _PROFILE[0]
    work = tmp_path_factory.mktemp("dashboard")
    url = train_profiled(work, GPT_STEPS, shards=SMALL_SHARDS)  # run 1: work/profile.db
    moe_dir = work / "moe"
    moe_dir.mkdir()
    config = adaptive_config(moe_dir, 8 * MiB, prefetch=False, trial_band=0)  # adopts a plan also under load (test_controller)
    config["zinf"]["profiler"]["db"] = url  # run 2, in the same database
    model, _, data = skewed_moe()
    with zinf.initialize(model, config) as engine:
        for step in range(MOE_STEPS):
            x, y = data.get(step)
            engine.backward(engine(x, y))
            engine.step()
    runs = queries.list_runs(url)
    assert runs["status"].tolist() == ["finished", "finished"]
    plans = queries.plans(url, 2)
    assert plans["adopted"].any(), plans
    profile = Profile(url, Path(url[len("sqlite:///"):]), 1, 2, int(plans.loc[plans["adopted"], "plan_id"].iloc[0]))
    _PROFILE.append(profile)
    return profile


@pytest.fixture(scope="session")
def profile(tmp_path_factory) -> Profile:
    return build_profile(tmp_path_factory)


@pytest.fixture(scope="module")
def client(profile):
    with TestClient(create_app(profile.url)) as c:
        yield c


def get_ok(client: TestClient, url: str) -> dict:
    r = client.get(url)
    assert r.status_code == 200, (url, r.status_code, r.text[:500])
    return r.json()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ API routes
def test_runs_list_has_headline_numbers(client, profile):
    runs = get_ok(client, "/api/runs")["runs"]
    assert [r["run_id"] for r in runs] == [profile.moe, profile.gpt]  # newest first
    for r in runs:
        assert r["status"] == "finished"
        assert r["steps"] == (GPT_STEPS if r["run_id"] == profile.gpt else MOE_STEPS)
        assert r["median_step_s"] > 0 and r["last_loss"] > 0
        assert 0 < r["stall_fraction"] < 1  # state on NVMe: compute waited for some of it
        assert r["model"].startswith(("GPT", "MoE")) and "params" in r["model"]
        assert r["hardware"] and ("GPU" in r["hardware"] or "cores" in r["hardware"])


def test_run_detail(client, profile):
    run = get_ok(client, f"/api/runs/{profile.moe}")
    assert run["run_id"] == profile.moe and run["steps"] == MOE_STEPS and run["last_step"] == MOE_STEPS
    assert run["shards"] > 0 and run["detail"] == "shard"
    assert run["config"]["zinf.placement.policy"] == "adaptive"
    assert any(k.startswith("nvme_read") for k in run["bandwidths_GBps"])


def test_steps_and_polling_after_a_step(client, profile):
    out = get_ok(client, f"/api/runs/{profile.gpt}/steps")
    assert out["status"] == "finished" and not out["has_more"]
    steps = out["steps"]
    assert [s["step"] for s in steps] == list(range(1, GPT_STEPS + 1))
    for s in steps:  # the parts of the step-time figure add up to the wall time
        parts = s["compute_s"] + s["stall_s"] + s["optimizer_s"] + s["migration_s"] + s["other_s"]
        assert parts == pytest.approx(s["wall_s"], rel=1e-9) and s["read_nvme_bytes"] > 0
    later = get_ok(client, f"/api/runs/{profile.gpt}/steps?after_step=2")["steps"]
    assert [s["step"] for s in later] == [3, 4]
    page = get_ok(client, f"/api/runs/{profile.gpt}/steps?after_step=0&limit=3")
    assert [s["step"] for s in page["steps"]] == [1, 2, 3] and page["has_more"]
    assert client.get(f"/api/runs/{profile.gpt}/steps?limit=5001").status_code == 422


FIGURE_NAMES = list(views.FIGURES)


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_every_figure_has_data(client, profile, name):
    out = get_ok(client, f"/api/runs/{profile.moe}/figures/{name}")
    assert out["name"] == name and out["title"] == views.FIGURES[name].title
    assert out["points"] > 0, name
    fig = out["figure"]
    assert fig["data"] and fig["layout"]["title"]
    go.Figure(fig)  # valid plotly: the browser gets what plotly.py validates
    for trace in fig["data"]:  # plain JSON arrays (not base64), which the page's script can extend
        for key in ("x", "y", "z", "values"):
            assert not isinstance(trace.get(key), dict), (name, key)
    if name == "step-time":
        assert [t["name"] for t in fig["data"]] == list(views.figures.STEP_TIME_PARTS)
        assert len(fig["data"][0]["x"]) == MOE_STEPS
        marks = [s for s in fig["layout"].get("shapes", []) if s.get("type") == "line"]
        assert len(marks) == int(queries.plans(profile.url, profile.moe)["adopted"].sum())  # plan changes marked


def test_figures_of_the_static_run(client, profile):
    """Run 1 has no plans: the plan figures say so instead of failing."""
    for name in ("step-time", "loss", "bandwidth", "memory", "shard-heatmap", "shard-treemap", "cost-model"):
        assert get_ok(client, f"/api/runs/{profile.gpt}/figures/{name}")["points"] > 0, name
    out = get_ok(client, f"/api/runs/{profile.gpt}/figures/migrations")
    assert out["points"] == 0 and "no migrations" in out["figure"]["layout"]["annotations"][0]["text"]


def test_memory_per_tier_adds_up(profile):
    homed = queries.homed_bytes(profile.url, profile.moe)
    shards = queries.shards(profile.url, profile.moe)
    total = int(shards["param_bytes"].sum() + shards.loc[shards["optim_tier"] != "none", "optim_bytes"].sum())
    sums = homed[["gpu_bytes", "cpu_bytes", "nvme_bytes"]].sum(axis=1)
    assert (sums == total).all()  # migrations move bytes between tiers, never make or lose them
    assert homed["cpu_bytes"].iloc[0] == 0 and homed["cpu_bytes"].iloc[-1] > 0  # all NVMe, then some moved to DRAM


def test_shard_table_agrees_with_shard_access_stats(profile):
    """The dashboard's one-pass totals (queries.shard_totals) against the planner's statistics."""
    mine = views.shard_table(profile.url, profile.moe).set_index("name")
    theirs = queries.shard_access_stats(profile.url, profile.moe).set_index("name").loc[mine.index]
    for c in ("total_accesses", "forward_accesses", "optimizer_accesses", "read_bytes", "written_bytes", "windows"):
        assert (mine[c] == theirs[c]).all(), c
    for c in ("stall_s", "fetch_s", "accesses_per_step", "stall_s_per_step"):
        assert mine[c].to_numpy() == pytest.approx(theirs[c].to_numpy()), c
    moved = queries.migrations(profile.url, profile.moe).drop_duplicates(["shard", "state"], keep="last")
    for m in moved.itertuples():  # homes as the last migration left them
        assert mine.loc[m.shard, f"{m.state}_tier"] == m.dst_tier


def test_shards_table_sorted_and_paged(client, profile):
    n = get_ok(client, f"/api/runs/{profile.moe}")["shards"]
    first = get_ok(client, f"/api/runs/{profile.moe}/shards?limit=5")
    assert first["total"] == n and len(first["rows"]) == 5 and first["offset"] == 0
    rates = [r["accesses_per_step"] for r in first["rows"]]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0  # hottest first by default
    rest = get_ok(client, f"/api/runs/{profile.moe}/shards?limit=1000&offset=5")["rows"]
    assert len(rest) == n - 5
    everything = first["rows"] + rest
    assert sorted(r["shard_index"] for r in everything) == list(range(n))  # no row twice, none lost
    by_name = get_ok(client, f"/api/runs/{profile.moe}/shards?sort=name&order=asc&limit=1000")["rows"]
    assert [r["name"] for r in by_name] == sorted(r["name"] for r in by_name)
    cold = get_ok(client, f"/api/runs/{profile.moe}/shards?sort=stall_s_per_step&order=asc&limit=3")["rows"]
    assert cold[0]["stall_s_per_step"] <= cold[-1]["stall_s_per_step"]
    assert get_ok(client, f"/api/runs/{profile.moe}/shards?offset={n + 10}")["rows"] == []
    for bad in ("limit=0", "limit=1001", "offset=-1", "sort=shard_id;drop", "order=up", "limit=abc"):
        assert client.get(f"/api/runs/{profile.moe}/shards?{bad}").status_code == 422, bad


def test_shard_heatmap_is_binned(client, profile):
    full = get_ok(client, f"/api/runs/{profile.moe}/shard-heatmap")["bins"]
    stats = queries.shard_access_stats(profile.url, profile.moe)
    assert sum(b["accesses"] for b in full) == int(stats["total_accesses"].sum()) > 0
    small = get_ok(client, f"/api/runs/{profile.moe}/shard-heatmap?max_steps=2&max_shards=3")["bins"]
    assert len({b["step_lo"] for b in small}) <= 2 and len({b["index_lo"] for b in small}) <= 3
    assert sum(b["accesses"] for b in small) == sum(b["accesses"] for b in full)
    assert client.get(f"/api/runs/{profile.moe}/shard-heatmap?max_steps=501").status_code == 422


def test_io_samples_paged(client, profile):
    a = get_ok(client, f"/api/runs/{profile.gpt}/io-samples?limit=10")
    b = get_ok(client, f"/api/runs/{profile.gpt}/io-samples?limit=5&offset=5")
    assert a["total"] == len(queries.io_samples(profile.url, profile.gpt)) > 10
    assert len(a["rows"]) == 10 and b["rows"] == a["rows"][5:]
    assert all(r["tier"] == "nvme" and r["bytes"] > 0 and r["GBps"] > 0 for r in a["rows"])
    late = get_ok(client, f"/api/runs/{profile.gpt}/io-samples?first_step=3&limit=1000")["rows"]
    assert late and min(r["step"] for r in late) >= 3
    assert client.get(f"/api/runs/{profile.gpt}/io-samples?limit=1001").status_code == 422


def test_plans_migrations_and_assignments(client, profile):
    plans = get_ok(client, f"/api/runs/{profile.moe}/plans")
    assert plans["total"] == len(queries.plans(profile.url, profile.moe)) >= 1
    adopted = [p for p in plans["rows"] if p["adopted"]]
    assert adopted and all(p["predicted_step_s"] > 0 for p in adopted)
    assert any(p["measured_step_s"] and p["measured_steps"] > 0 and p["migrated_bytes"] > 0 for p in adopted)
    assert get_ok(client, f"/api/runs/{profile.moe}/plans?limit=1")["rows"] == plans["rows"][:1]

    migrations = get_ok(client, f"/api/runs/{profile.moe}/migrations?limit=2")
    assert migrations["total"] == len(queries.migrations(profile.url, profile.moe)) > 0 and len(migrations["rows"]) == 2
    assert all(m["src_tier"] != m["dst_tier"] and m["bytes"] > 0 for m in migrations["rows"])

    plan = get_ok(client, f"/api/plans/{profile.plan_id}")
    assert plan["run_id"] == profile.moe and plan["adopted"] and plan["assignments"] > 0
    page = get_ok(client, f"/api/plans/{profile.plan_id}/assignments?limit=3&offset=1")
    whole = get_ok(client, f"/api/plans/{profile.plan_id}/assignments?limit=1000")
    assert page["total"] == whole["total"] == plan["assignments"] and page["rows"] == whole["rows"][1:4]
    assert client.get(f"/api/plans/{profile.plan_id}/assignments?limit=1001").status_code == 422


@pytest.mark.skipif(not HAVE_WHATIF, reason="planner.whatif (the what-if planner) is not in this tree yet")
def test_what_if_replans_at_the_chosen_budget(client, profile, monkeypatch):
    curve = get_ok(client, f"/api/runs/{profile.moe}/what-if")
    assert curve["chosen"] is None and len(curve["rows"]) >= 2 and curve["figure"]["points"] > 0
    budgets = [r["dram_budget_bytes"] for r in curve["rows"]]
    budget = (budgets[0] + budgets[-1]) // 2 + 12345  # not one of the default budgets
    out = get_ok(client, f"/api/runs/{profile.moe}/what-if?budget={budget}")
    assert out["chosen_budget_bytes"] == budget and out["chosen"]["dram_budget_bytes"] == budget
    assert len(out["rows"]) == len(curve["rows"]) + 1  # the curve gained the re-planned point
    assert out["figure"]["figure"]["data"] != curve["figure"]["figure"]["data"]
    assert any(t.get("name", "").startswith("chosen ") for t in out["figure"]["figure"]["data"])
    # asked again: cached, nothing planned again (counted, not timed: this machine is shared)
    import planner.whatif as whatif

    solved = []
    table = whatif.WhatIf.table
    monkeypatch.setattr(whatif.WhatIf, "table", lambda self, *a, **k: solved.append(a) or table(self, *a, **k))
    monkeypatch.setattr(whatif.WhatIf, "from_profile", classmethod(lambda cls, *a, **k: solved.append("model")))
    assert get_ok(client, f"/api/runs/{profile.moe}/what-if?budget={budget}") == out
    assert solved == []
    for bad in ("budget=-1", "budget=abc", f"budget={2**70}"):
        assert client.get(f"/api/runs/{profile.moe}/what-if?{bad}").status_code == 422, bad


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("url", [
    "/api/runs/999", "/api/runs/999/steps", "/api/runs/999/figures/loss", "/api/runs/999/shards",
    "/api/runs/999/shard-heatmap", "/api/runs/999/io-samples", "/api/runs/999/plans", "/api/runs/999/migrations",
    "/api/runs/999/what-if",
])
def test_unknown_run_id_is_404_with_message(client, url):
    r = client.get(url)
    if r.status_code == 503 and "what-if" in url and not HAVE_WHATIF:
        pytest.skip("planner.whatif is not in this tree yet")
    assert r.status_code == 404, r.text
    detail = r.json()["detail"]
    assert detail.startswith("unknown run id 999") and "known: 1, 2" in detail and "\n" not in detail
    assert "mode=ro" not in detail  # the database as the user named it


def test_unknown_plan_id_is_404_with_message(client):
    for url in ("/api/plans/99999", "/api/plans/99999/assignments"):
        r = client.get(url)
        assert r.status_code == 404 and r.json()["detail"].startswith("unknown plan id 99999"), r.text


def test_malformed_input_is_422(client):
    for url in ("/api/runs/abc", "/api/runs/-1", f"/api/runs/{2**64}", "/api/runs/1/figures/nope",
                "/api/runs/1/steps?after_step=x", "/api/plans/1.5", "/runs/abc"):
        assert client.get(url).status_code == 422, url


def test_unknown_run_page_is_404_html(client):
    r = client.get("/runs/999/shards")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "unknown run id 999" in r.text


# ------------------------------------------------------------------------------ pages
PAGE_CHARTS = {
    "": ["chart-step-time", "chart-loss", "chart-bandwidth", "chart-memory", "chart-bytes-moved"],
    "/shards": ["chart-shard-heatmap", "chart-shard-treemap", "shards-table"],
    "/plans": ["chart-predicted-vs-measured", "chart-migrations", "chart-cost-model", "plans-table", "migrations-table"],
    "/what-if": ["chart-what-if", "whatif-budget", "whatif-table"],
}


@pytest.mark.parametrize("suffix", list(PAGE_CHARTS))
def test_run_pages(client, profile, suffix):
    r = client.get(f"/runs/{profile.moe}{suffix}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    for element_id in [*PAGE_CHARTS[suffix], "live-indicator"]:
        assert f'id="{element_id}"' in html, element_id
    assert '<script src="/static/plotly.min.js"></script>' in html
    assert "http://" not in html and "https://" not in html  # nothing from the network (no CDN)
    for label in ("Runs", "Overview", "Shards", "Plans", "What-if"):
        assert f">{label}</a>" in html


def test_runs_page_and_static_files(client):
    html = client.get("/").text
    assert 'id="runs-table"' in html and 'href="/runs/2"' in html  # the nav links the newest run
    js = client.get("/static/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000 and js.headers["content-type"].startswith("text/javascript")
    assert client.get("/static/dashboard.js").status_code == 200
    assert client.get("/static/dashboard.css").status_code == 200
    assert client.get("/favicon.ico").status_code == 200
    assert client.get("/static/../views.py").status_code == 404  # no way out of the static folder


def test_openapi_describes_every_route_and_takes_no_paths(client):
    schema = get_ok(client, "/openapi.json")
    api = {p for p in schema["paths"] if p.startswith("/api/")}
    assert api == {
        "/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/steps", "/api/runs/{run_id}/figures/{name}",
        "/api/runs/{run_id}/shards", "/api/runs/{run_id}/shard-heatmap", "/api/runs/{run_id}/io-samples",
        "/api/runs/{run_id}/plans", "/api/runs/{run_id}/migrations", "/api/runs/{run_id}/what-if",
        "/api/plans/{plan_id}", "/api/plans/{plan_id}/assignments",
    }
    for path in api:
        op = schema["paths"][path]["get"]
        assert "$ref" in str(op["responses"]["200"]["content"]["application/json"]["schema"]), path  # a model
        for param in op.get("parameters", []):
            options = param["schema"].get("anyOf", [param["schema"]])  # ids and numbers, or one of a list
            assert all(o.get("type") in ("integer", "null") or "enum" in o or "$ref" in o for o in options), (path, param)
            s = param["schema"]
            if param["name"] in ("limit", "max_steps", "max_shards"):
                assert s["maximum"] <= 5000, (path, param)


# ------------------------------------------------------------------------------ read-only
def test_database_is_read_only_and_unchanged(profile, tmp_path):
    before = file_digest(profile.path)
    app = create_app(profile.url)
    engine = app.state.data.engine
    assert engine.url.query.get("mode") == "ro"
    with TestClient(app) as c:
        for url in ("/api/runs", f"/api/runs/{profile.moe}/figures/step-time", f"/api/runs/{profile.moe}/shards",
                    f"/api/plans/{profile.plan_id}", "/", f"/runs/{profile.moe}"):
            assert c.get(url).status_code == 200
        with engine.connect() as conn, pytest.raises(sa.exc.OperationalError, match="readonly|read-only|query_only"):
            conn.exec_driver_sql("DELETE FROM steps")
    assert file_digest(profile.path) == before
    assert queries.steps(profile.url, profile.gpt).shape[0] == GPT_STEPS


def test_missing_or_foreign_database_is_one_line(tmp_path):
    missing = tmp_path / "none.db"
    with pytest.raises(ProfileError, match="no profile database") as e:
        create_app(f"sqlite:///{missing}")
    assert "\n" not in str(e.value) and not missing.exists()  # asking did not create it
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE notes (x TEXT)")
    with pytest.raises(ProfileError, match="no profile schema"):
        create_app(f"sqlite:///{foreign}")
    with sqlite3.connect(foreign) as c:  # nothing was migrated into it
        assert [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["notes"]


# ------------------------------------------------------------------------------ the CLI
def test_cli_binds_loopback_by_default(profile, monkeypatch, capsys):
    command = typer.main.get_command(cli.app).commands["dashboard"]
    defaults = {p.name: p.default for p in command.params}
    assert defaults["host"] == "127.0.0.1" and defaults["port"] == 8050
    served = {}
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli.main(["dashboard", "--db", profile.url, "--port", str(port)])
    assert served["host"] == "127.0.0.1" and served["port"] == port
    assert TestClient(served["app"]).get("/api/runs").status_code == 200
    assert f"http://127.0.0.1:{port}/" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, profile, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["dashboard", "--db", f"sqlite:///{tmp_path / 'missing.db'}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error:") and "no profile database" in err and "\n" not in err
    with socket.socket() as busy:  # a port in use
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SystemExit) as e:
            cli.main(["dashboard", "--db", profile.url, "--port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "cannot listen" in err and "\n" not in err


# ------------------------------------------------------------------------------ live
def test_live_steps_of_a_run_being_written(profile, tmp_path):
    """A recorder writes a run into a copy of the profile while the app reads it: the steps route
    returns the new steps after the last one seen, and the cached figures follow."""
    path = tmp_path / "live.db"
    shutil.copy(profile.path, path)
    url = f"sqlite:///{path}"
    r = Recorder(url, flush_interval_s=0.05)
    try:
        r.emit(run_started("live <script>alert(1)</script>"))
        for k in range(2):
            for e in step_events(k):
                r.emit(e)
        r.flush()
        with TestClient(create_app(url)) as c:
            first = get_ok(c, f"/api/runs/{r.run_id}/steps")
            assert first["status"] == "running" and [s["step"] for s in first["steps"]] == [1, 2]
            fig = get_ok(c, f"/api/runs/{r.run_id}/figures/step-time")
            assert len(fig["figure"]["data"][0]["x"]) == 2
            assert get_ok(c, f"/api/runs/{r.run_id}/steps?after_step=2")["steps"] == []
            for k in range(2, 5):
                for e in step_events(k):
                    r.emit(e)
            r.flush()
            new = get_ok(c, f"/api/runs/{r.run_id}/steps?after_step=2")
            assert [s["step"] for s in new["steps"]] == [3, 4, 5] and new["status"] == "running"
            fig = get_ok(c, f"/api/runs/{r.run_id}/figures/step-time")
            assert len(fig["figure"]["data"][0]["x"]) == 5 and fig["last_step"] == 5  # the cache saw the new steps
            page = c.get(f"/runs/{r.run_id}").text
            assert 'data-status="running"' in page and 'id="live-indicator"' in page
            assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # names are escaped
    finally:
        r.close()


# ------------------------------------------------------------------------------ the report's figures
def test_run_figures_for_the_report(profile):
    figs = views.run_figures(profile.url, profile.moe)
    assert list(figs) == [spec.title for spec in views.FIGURES.values()]
    assert all(isinstance(f, go.Figure) and f.data for f in figs.values())
    with pytest.raises(ProfileError, match="unknown run id 42"):
        views.run_figures(profile.url, 42)
