"""``zinf report`` (issue 6, item 3) on a real profile: one self-contained HTML file (plotly.js inlined
once, no network reference at all), every section there, the plan file beside it valid, existing
files kept without --force, and one-line CLI errors."""

from __future__ import annotations

import json
import re

import pytest
from plotly.offline import get_plotlyjs

from zinf.cli import main
from zinf.planfile import read_plan_file

from planner.whatif import WhatIf
from profiler import queries
from test_export import one_error_line
from test_whatif import profiled_run

SECTIONS = ("summary", "placement", "aio", "what-if", "deepspeed", "notes")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    url = profiled_run(tmp_path_factory.mktemp("report"))
    return url, WhatIf.from_profile(url)


def check_self_contained(html: str) -> None:
    """No request leaves the file: plotly.js inlined exactly once, and outside it no script or
    stylesheet source, no link, no image or frame, no web font, no import. (The bundle's own
    code holds URL strings - map tiles, the plotly logo's link - that only a map trace or a
    click would use; the browser test checks that no request is made.)"""
    bundle = get_plotlyjs()
    assert html.count(bundle) == 1, "plotly.js inlined exactly once"
    html = html.replace(bundle, "")
    assert "Plotly.newPlot(" in html
    assert re.search(r"<script[^>]*\ssrc\s*=", html, re.I) is None
    assert re.search(r"<link\b", html, re.I) is None
    assert re.search(r"<(img|iframe|source|video|audio|embed|object)\b", html, re.I) is None
    assert re.search(r"""\b(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I) is None
    assert "@import" not in html and re.search(r"url\(\s*['\"]?(https?:)?//", html) is None
    assert "cdn.plot.ly" not in html and "fonts.googleapis" not in html


def test_report_is_one_self_contained_file_with_every_section(profile, tmp_path, capsys):
    url, wi = profile
    budget = int(wi.state_bytes * 0.45)  # between the minimum (~34%) and all-DRAM (~95%)
    assert wi.min_budget_bytes < budget < wi.all_dram_budget_bytes
    out = tmp_path / "report.html"
    assert main(["report", "--db", url, "--dram-budget", "45%", "--out", str(out)]) is None
    printed = capsys.readouterr().out
    assert "predicted" in printed and "max_in_cpu" in printed and str(out) in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "report.html"]  # no temporaries left
    html = out.read_text(encoding="utf-8")
    check_self_contained(html)
    for sid in SECTIONS:
        assert re.search(rf'<section id="{sid}">\s*<h2>', html), sid
    charts = re.findall(r'<div id="(chart-[a-z0-9-]+)"', html)
    assert len(charts) >= 4 and len(set(charts)) == len(charts)
    assert html.count("Plotly.newPlot(") - get_plotlyjs().count("Plotly.newPlot(") == len(charts)
    for chart in charts:  # each chart in a section of its own, with a title
        assert re.search(rf'<section id="figure-[a-z0-9-]+">\s*<h2>[^<]+</h2>\s*(<div [^>]*>\s*)?<div id="{chart}"', html), chart
    # the what-if table has every budget, the chosen one marked; the DeepSpeed snippet is valid JSON
    assert html.count('<tr class="chosen">') == 1
    snippet = re.search(r'<section id="deepspeed">.*?<pre><code>(.*?)</code></pre>', html, re.S).group(1)
    ds = json.loads(snippet.replace("&quot;", '"').replace("&#x27;", "'").replace("&amp;", "&"))
    param = ds["zero_optimization"]["offload_param"]
    assert param["device"] == "nvme" and param["buffer_size"] >= 1 and 0 < param["max_in_cpu"] and "aio" in ds
    # the plan beside it: valid, for the budget asked
    plan = read_plan_file(tmp_path / "plan.json")
    assert plan["dram_budget_bytes"] == budget and plan["run_id"] == wi.run_id
    assert list(plan["placement"]) == queries.shards(url, wi.run_id)["name"].tolist()


def test_existing_files_are_kept_without_force(profile, tmp_path, capsys):
    url, wi = profile
    out = tmp_path / "r.html"
    out.write_text("precious")
    msg = one_error_line(capsys, ["report", "--db", url, "--out", str(out)])
    assert "--force" in msg and out.read_text() == "precious"
    assert not (tmp_path / "plan.json").exists()
    # a plan.json in the way is kept too, unless --plan-out elsewhere or --force
    out2 = tmp_path / "new.html"
    (tmp_path / "plan.json").write_text("mine")
    msg = one_error_line(capsys, ["report", "--db", url, "--out", str(out2)])
    assert "plan.json" in msg and "--force" in msg and not out2.exists()
    assert (tmp_path / "plan.json").read_text() == "mine"
    # default budget: the run has no zinf.dram_budget, so the knee of the what-if curve
    assert main(["report", "--db", url, "--out", str(out), "--plan-out", str(tmp_path / "p2.json"), "--force"]) is None
    assert "knee" in capsys.readouterr().out
    html = out.read_text()
    check_self_contained(html)
    assert "p2.json" in html and read_plan_file(tmp_path / "p2.json")["run_id"] == wi.run_id
    assert (tmp_path / "plan.json").read_text() == "mine"


def test_report_cli_errors_are_one_line(profile, tmp_path, capsys):
    url, wi = profile
    out = str(tmp_path / "r.html")
    assert "unknown run id 42" in one_error_line(capsys, ["report", "--db", url, "--run", "42", "--out", out])
    assert "--dram-budget" in one_error_line(capsys, ["report", "--db", url, "--dram-budget", "much", "--out", out])
    assert "below" in one_error_line(capsys, ["report", "--db", url, "--dram-budget", "1%", "--out", out])
    assert "is a directory" in one_error_line(capsys, ["report", "--db", url, "--out", str(tmp_path)])
    assert "does not exist" in one_error_line(capsys, ["report", "--db", url, "--out", str(tmp_path / "no" / "r.html")])
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    one_error_line(capsys, ["report", "--db", missing, "--out", out])
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written on errors"
