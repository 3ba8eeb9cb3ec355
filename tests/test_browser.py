"""The dashboard and the offline report in a real headless Chromium (issue 6's browser checks).

Debian's ``chromium`` (``/usr/bin/chromium``, installed by ``scripts/bootstrap.sh``) is driven by
playwright's Python package through ``executable_path``: playwright's own browser download is
never used (it fails on these machines). Without chromium or playwright every test here FAILS
with a one-line message saying how to install them: a skip would hide a missing feature.

The data is real: the profile database of ``test_dashboard_api`` (a tiny GPT trained with its
state on NVMe, run 1, and a small MoE trained by the adaptive planner, run 2), copied, and served
by a real uvicorn server on a free port of 127.0.0.1, in a thread of this process.

Checked:

* every page loads with no console error, page error, failed request or 4xx/5xx answer, asks
  nothing of any host but the server, and every chart has data (``data-points`` > 0; a chart of
  run 1 with nothing to show must say so in a "no ..." note);
* moving the what-if slider (keyboard, then mouse) re-plans and redraws the curve;
* a live overview page picks up the steps that a second real training run (a subprocess,
  profiled into the same database) adds while the page is open, and its indicator turns from
  running to finished when the run ends;
* the report of ``zinf report`` opens from ``file://`` with every other request aborted (and none
  attempted), and every chart in it is drawn with points.

Screenshots for the README go to ``docs/img/`` (dashboard-overview.png, dashboard-whatif.png,
report.png), each written atomically; each is checked not to be blank.
"""

from __future__ import annotations

import io
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_dashboard_api import build_profile

from dashboard.app import create_app
from zinf import cli

CHROMIUM = "/usr/bin/chromium"
INSTALL_CHROMIUM = "apt-get install -y --no-install-recommends chromium (scripts/bootstrap.sh does it)"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
VIEWPORT = {"width": 1400, "height": 1000}  # CSS pixels
TIMEOUT_MS = 30_000  # the longest wait for anything a page does (2 slow cores, other tests running)

GPT, MOE = 1, 2  # run ids in the profile (test_dashboard_api.build_profile)
LIVE_FIRST, LIVE_MORE = 2, 4  # steps of the live run: before the page opens, then while it is open


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """A copy of the shared profile (this module adds a run to it), as a SQLAlchemy URL."""
    profile = build_profile(tmp_path_factory)
    path = tmp_path_factory.mktemp("browser") / "profile.db"
    with sqlite3.connect(profile.path) as src, sqlite3.connect(path) as dst:
        src.backup(dst)
    return f"sqlite:///{path}"


@pytest.fixture(scope="module")
def server(db) -> str:
    """``zinf dashboard``'s app under a real uvicorn server on a free port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with other tests
    config = uvicorn.Config(create_app(db), log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium under playwright; a one-line failure (never a skip) without them."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no chromium at {CHROMIUM}: install it with {INSTALL_CHROMIUM}", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[dev]' (scripts/bootstrap.sh does it)", pytrace=False)
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    except Exception as e:  # e.g. a chromium too old for this playwright
        pw.stop()
        pytest.fail(f"cannot start {CHROMIUM} with playwright: {str(e).splitlines()[0]}", pytrace=False)
    yield b
    b.close()
    pw.stop()


class Watched:
    """A page with everything that went wrong on it collected: console errors, uncaught
    exceptions, failed requests, 4xx/5xx answers, and requests to any host but ``allowed``."""

    def __init__(self, context, allowed: str) -> None:
        self.page = context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.problems: list[str] = []
        self.requests: list[str] = []
        p = self.page
        p.on("console", lambda m: m.type == "error" and self.problems.append(f"console: {m.text}"))
        p.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        p.on("requestfailed", lambda r: self.problems.append(f"request failed: {r.url} ({r.failure})"))
        p.on("response", lambda r: r.status >= 400 and self.problems.append(f"HTTP {r.status}: {r.url}"))
        p.on("request", lambda r: self.requests.append(r.url))
        self.allowed = allowed

    def check(self) -> None:
        foreign = [u for u in self.requests if not u.startswith(self.allowed)]
        assert not foreign, f"requests to other hosts: {foreign}"
        assert not self.problems, self.problems


@pytest.fixture(scope="module")
def context(browser):
    """One browser context for the dashboard's pages: plotly.js is fetched once, then cached."""
    c = browser.new_context(viewport=VIEWPORT)
    yield c
    c.close()


@pytest.fixture
def watched(context, server):
    w = Watched(context, server + "/")
    yield w
    w.page.close()


# ------------------------------------------------------------------------------ helpers
ALL_DRAWN = """() => [...document.querySelectorAll('.chart')].every(
    e => e.dataset.points !== undefined || e.dataset.error !== undefined)"""
TABLES_FILLED = """ids => ids.every(id => document.getElementById(id).dataset.rows !== undefined)"""
# what plotly draws a trace as: a trace group (scatter, bar), a heatmap's image, a treemap's boxes
DRAWN_SELECTOR = ".main-svg .trace, .main-svg .hm image, .main-svg .slice"
# per chart: [id, data-points, data-error, notes ("no ..." annotations), drawn trace groups in the svg]
CHART_STATE = """drawn => [...document.querySelectorAll('.chart')].map(e => [
    e.id, Number(e.dataset.points), e.dataset.error || null,
    ((e.layout && e.layout.annotations) || []).map(a => String(a.text || '')).filter(t => t.startsWith('no ')),
    e.querySelectorAll(drawn).length])"""

PAGE_TABLES = {"": [], "/shards": ["shards-table"], "/plans": ["plans-table", "migrations-table"],
               "/what-if": ["whatif-table"]}


def save_png(png: bytes, name: str) -> Path:
    """Write a screenshot into docs/img atomically (a temporary file, then a rename) and check
    that it is not blank: many colours and a spread of brightness."""
    from PIL import Image, ImageStat

    img = Image.open(io.BytesIO(png)).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 64, f"{name}: only {len(colours)} colours, a blank page?"
    assert max(ImageStat.Stat(img).stddev) > 10, f"{name}: no contrast, a blank page?"
    IMG.mkdir(parents=True, exist_ok=True)
    out = IMG / name
    tmp = out.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_bytes(png)
    os.replace(tmp, out)
    return out


def open_run_page(w: Watched, url: str, tables: list[str]) -> list[list]:
    """Open a page, wait until every chart and table is filled, and return CHART_STATE."""
    w.page.goto(url)
    w.page.wait_for_function(ALL_DRAWN)
    if tables:
        w.page.wait_for_function(TABLES_FILLED, arg=tables)
    return w.page.evaluate(CHART_STATE, DRAWN_SELECTOR)


# ------------------------------------------------------------------------------ the pages
def test_runs_page(watched, server):
    watched.page.goto(server + "/")
    watched.page.wait_for_function(TABLES_FILLED, arg=["runs-table"])
    rows = watched.page.eval_on_selector_all("#runs-table tbody tr", "rs => rs.map(r => r.cells[0].textContent)")
    assert {str(GPT), str(MOE)} <= set(rows)
    watched.page.wait_for_load_state("networkidle")
    watched.check()


@pytest.mark.parametrize("suffix", list(PAGE_TABLES))
@pytest.mark.parametrize("run_id", [MOE, GPT])
def test_run_page_draws_every_chart_without_errors(watched, server, run_id, suffix):
    charts = open_run_page(watched, f"{server}/runs/{run_id}{suffix}", PAGE_TABLES[suffix])
    assert charts, "no chart on the page"
    for chart_id, points, error, notes, drawn in charts:
        assert error is None, (chart_id, error)
        if run_id == MOE or not notes:  # the MoE run has every kind of data
            assert points > 0 and drawn > 0, (chart_id, points, drawn)
        else:  # the static GPT run has no plans or migrations: the chart says so
            assert points == 0 and notes, (chart_id, points, notes)
    for table in PAGE_TABLES[suffix]:
        rows = int(watched.page.get_attribute(f"#{table}", "data-rows"))
        assert rows > 0 or (run_id == GPT and table in ("plans-table", "migrations-table")), table
    state = watched.page.get_attribute("#live-indicator", "data-state")
    assert state == "finished"
    watched.check()
    if run_id == MOE and suffix == "":
        save_png(watched.page.screenshot(full_page=True), "dashboard-overview.png")


def test_what_if_slider_redraws_the_curve(watched, server):
    page = watched.page
    page.goto(f"{server}/runs/{MOE}/what-if")
    chart = page.locator("#chart-what-if")
    page.wait_for_function("() => document.getElementById('chart-what-if').dataset.budget")  # the first budget drawn
    slider = page.locator("#whatif-budget")
    assert slider.is_enabled()
    figure = "e => JSON.stringify(e.data)"

    def state():
        return chart.evaluate(figure), chart.get_attribute("data-budget"), page.inner_text("#whatif-result")

    def moved(before: tuple) -> tuple:
        page.wait_for_function("b => document.getElementById('chart-what-if').dataset.budget !== b", arg=before[1])
        page.wait_for_load_state("networkidle")
        after = state()
        assert after[0] != before[0], "the curve did not change"
        assert after[2] and after[2] != before[2], (before[2], after[2])
        return after

    s0 = state()
    slider.focus()
    page.keyboard.press("End")  # the largest budget: everything that fits in DRAM
    s1 = moved(s0)
    assert int(s1[1]) == int(slider.get_attribute("max"))
    box = slider.bounding_box()  # then a click a third of the way along the track
    page.mouse.click(box["x"] + box["width"] / 3, box["y"] + box["height"] / 2)
    s2 = moved(s1)
    assert 0 < int(s2[1]) < int(s1[1])
    names = [t.get("name", "") for t in chart.evaluate("e => e.data")]
    assert any(n.startswith("chosen ") for n in names), names  # the star at the chosen budget
    assert int(chart.get_attribute("data-points")) > 0
    watched.check()
    save_png(page.screenshot(full_page=True), "dashboard-whatif.png")


# ------------------------------------------------------------------------------ live
WRITER = """
import sys
from pathlib import Path
import torch
import zinf
from conftest import SMALL_SHARDS, gpt_batches, placement_config
from zinf.models import build_model

url, work, first, more = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(1)
model, cfg = build_model("gpt", "tiny")
config = placement_config("nvme", work)
config["zinf"] = {**SMALL_SHARDS, "profiler": {"enabled": True, "db": url, "flush_interval_s": 0.1}}
data = gpt_batches(cfg, seed=1)
with zinf.initialize(model, config) as engine:
    for step in range(first + more):
        if step == first:
            print("waiting", flush=True)
            sys.stdin.readline()  # the test opens the page, then says go
        x, y = data.get(step)
        engine.backward(engine(x, y))
        engine.step()
        print("step", step + 1, flush=True)
    print("waiting", flush=True)
    sys.stdin.readline()  # the run ends (RunFinished) when the test says so
print("done", flush=True)
"""


def _db_rows(path: str, sql: str, *args) -> list[tuple]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as c:
        return c.execute(sql, args).fetchall()


def test_live_page_picks_up_new_steps(watched, server, db, tmp_path):
    """A second real training run, profiled into the database the server reads, runs LIVE_FIRST
    steps, waits while the overview page of it opens, then runs LIVE_MORE more and ends."""
    path = db[len("sqlite:///"):]
    known = {r[0] for r in _db_rows(path, "SELECT id FROM runs")}
    log = open(tmp_path / "writer.log", "w+")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, db, str(tmp_path), str(LIVE_FIRST), str(LIVE_MORE)],
                              stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)

    def writer_log() -> str:
        log.flush()
        log.seek(0)
        return log.read()[-2000:]

    try:
        deadline = time.monotonic() + 60
        run_id = None
        while True:  # the new run and its first steps in the database
            assert writer.poll() is None and time.monotonic() < deadline, writer_log()
            new = [r[0] for r in _db_rows(path, "SELECT id FROM runs") if r[0] not in known]
            if new:
                run_id = new[0]
                if _db_rows(path, "SELECT count(*) FROM steps WHERE run_id = ?", run_id)[0][0] >= LIVE_FIRST:
                    break
            time.sleep(0.1)
        page = watched.page
        page.goto(f"{server}/runs/{run_id}")
        page.wait_for_function(ALL_DRAWN)
        indicator = page.locator("#live-indicator")
        assert indicator.get_attribute("data-state") == "running"
        points0 = int(page.get_attribute("#chart-step-time", "data-points"))
        assert points0 > 0 and page.inner_text("#summary-steps") == str(LIVE_FIRST)

        writer.stdin.write("go\n")  # the writer goes on while the page is open
        writer.stdin.flush()
        grown = ("p => Number(document.getElementById('chart-step-time').dataset.points) > p"
                 " && document.getElementById('live-indicator').dataset.state === 'running'")
        page.wait_for_function(grown, arg=points0)  # new steps appended while the run runs
        assert indicator.text_content() == "live"
        writer.stdin.write("end\n")  # the run ends
        writer.stdin.flush()
        assert writer.wait(60) == 0, writer_log()
        page.wait_for_function("() => document.getElementById('live-indicator').dataset.state === 'finished'")
        page.wait_for_function(f"() => document.getElementById('summary-steps').textContent === '{LIVE_FIRST + LIVE_MORE}'")
        x = page.evaluate("() => document.getElementById('chart-step-time').data[0].x")
        assert x == list(range(1, LIVE_FIRST + LIVE_MORE + 1))
        assert int(page.get_attribute("#chart-loss", "data-points")) == LIVE_FIRST + LIVE_MORE
        page.wait_for_load_state("networkidle")
        watched.check()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        log.close()


# ------------------------------------------------------------------------------ the report
REPORT_CHARTS = """drawn => [...document.querySelectorAll('div[id^="chart-"]')].map(e => {
    let points = 0;  // counted on plotly's decoded traces (the report's arrays are base64 in the file)
    for (const t of e._fullData || []) {
        if (t.z) points += Array.from(t.z).reduce((n, row) => n + (row && row.length !== undefined ? row.length : 1), 0);
        else if (t.ids || t.labels) points += Array.from(t.ids || t.labels).length;
        else if (t.x) points += Array.from(t.x).filter(v => v !== null && v !== undefined).length;
    }
    return [e.id, points, e.querySelectorAll(drawn).length];
})"""


def test_report_opens_offline_and_draws_every_chart(browser, db, tmp_path, capsys):
    out = tmp_path / "report.html"
    cli.main(["report", "--db", db, "--run", str(MOE), "--out", str(out)])  # what `zinf report` runs
    assert out.is_file() and (tmp_path / "plan.json").is_file()
    capsys.readouterr()

    context = browser.new_context(viewport={"width": 1280, "height": 1600}, offline=True)
    attempted: list[str] = []

    def block(route):  # every request that does not read a file is aborted, and remembered
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            attempted.append(route.request.url)
            route.abort()

    try:
        context.route("**/*", block)
        w = Watched(context, out.as_uri())
        w.page.goto(out.as_uri())
        w.page.wait_for_load_state("load")
        w.page.wait_for_function("() => [...document.querySelectorAll('div[id^=\"chart-\"]')]"
                                 ".every(e => e.classList.contains('js-plotly-plot') && e.querySelector('.main-svg'))")
        charts = w.page.evaluate(REPORT_CHARTS, DRAWN_SELECTOR)
        assert len(charts) >= 5, charts
        for chart_id, points, drawn in charts:
            assert points > 0 and drawn > 0, (chart_id, points, drawn)
        assert attempted == [], f"the report asked the network for {attempted}"
        w.check()
        save_png(w.page.screenshot(), "report.png")  # the top of the report: summary and first charts
    finally:
        context.close()
