"""``zinf report``: one self-contained HTML file about a profiled run, to open from disk or attach to a ticket.

What it holds, each in a ``<section>`` with an ``<h2>`` (in this order):

1. a summary: the run, its measured step, the DRAM budget the report is for and the plan's
   predicted step and speed-up over all-NVMe;
2. the run's figures - those of the live dashboard (``dashboard.views.run_figures``; until that
   module exists, the figures of :mod:`dashboard.figures`), each chart a ``<div>`` with an id;
3. the recommended placement at the budget (also written as ``plan.json``, which a training run
   starts from with ``"zinf": {"placement": {"plan_file": "plan.json"}}``);
4. the recommended ``aio`` settings (:func:`planner.recommend.recommend_aio`);
5. the what-if table: DRAM budget -> predicted step time and speed-up (:mod:`planner.whatif`);
6. the DeepSpeed config for a user who stays on DeepSpeed (:func:`planner.recommend.recommend_deepspeed`);
7. how the numbers were made (cost model, calibration, assumptions).

Self-contained: plotly.js is inlined once in ``<head>`` (``plotly.offline.get_plotlyjs()``, from
the installed package) and every figure is drawn by an inline script; there is no ``<script
src>``, no stylesheet link, no web font - the file renders from ``file://`` with no network.

The DRAM budget: ``--dram-budget`` (a size, or a percentage of the model state such as ``30%``);
else the run's own ``zinf.dram_budget``; else the *knee* of the what-if curve: the smallest
budget whose predicted step is within :data:`KNEE_FRACTION` of the fastest.

Files are written atomically (temporary file, fsync, rename: :mod:`profiler.export`'s helpers);
an existing report or plan file is replaced only with ``force``.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

import zinf
from zinf.placement import fmt_bytes

from profiler import queries
from profiler.export import ExportError, _atomic_write_file, check_out, model_summary
from profiler.store import describe_url

from planner.recommend import Recommendation, recommend_aio, recommend_deepspeed
from planner.whatif import BudgetPlan, WhatIf, parse_budget

__all__ = ["Report", "build_report", "check_outputs", "write_report", "render_html", "summary_lines", "KNEE_FRACTION",
           "MAX_PLACEMENT_ROWS"]

KNEE_FRACTION = 0.05
"""Default budget: the smallest whose predicted step is within this fraction of the fastest."""
MAX_PLACEMENT_ROWS = 200
"""Shards listed in the placement table (the hottest first); every shard is in plan.json."""
CHART_HEIGHT = "460px"

Progress = Callable[[int, int, str], None]  # (done, total, what comes next)


@dataclass
class Report:
    """Everything ``zinf report`` shows, and the HTML of it."""

    run_id: int
    whatif: WhatIf
    """The planner's model of the run (workload, cost model, calibration)."""
    what_if: pd.DataFrame
    """:func:`planner.whatif.what_if`'s table (the chosen budget included)."""
    plan: BudgetPlan
    """The placement at :attr:`dram_budget_bytes`."""
    recommendation: Recommendation
    dram_budget_bytes: int
    budget_source: str
    """Where the budget came from: "--dram-budget", "the run's zinf.dram_budget" or "the what-if knee"."""
    figures: dict[str, go.Figure]
    """Title -> figure, in page order."""
    plan_name: str = "plan.json"
    """The plan file's name as the page mentions it."""
    created_at: str = ""
    """UTC time the report was made (ISO 8601)."""
    build_s: float = 0.0
    html: str = field(default="", repr=False)


# ------------------------------------------------------------------------------ building
def build_report(src, run_id: int | None = None, dram_budget: str | int | None = None, *,
                 progress: Progress | None = None, plan_name: str = "plan.json") -> Report:
    """Read run ``run_id`` (None: the newest) of the profile database ``src``, plan it at the
    budget (see the module docstring) and across the what-if budgets, and render the HTML.
    ``progress(done, total, label)`` is called as the work goes (for a progress bar)."""
    t0 = time.perf_counter()
    if dram_budget is not None and not str(dram_budget).strip().endswith("%"):
        parse_budget(dram_budget, 0)  # a size: checked before the profile is read
    tell = progress or (lambda done, total, label: None)
    tell(0, 1, "reading the profile and fitting the cost model")
    wi = WhatIf.from_profile(src, run_id)
    budgets = wi.default_budgets()
    total = len(budgets) + 4
    chosen, source = None, "the what-if knee"
    if dram_budget is not None:
        chosen, source = wi.parse_budget(dram_budget), "--dram-budget"
        wi.plan(chosen)  # below the minimum: the error now, before the what-if
    elif wi.config.zinf.dram_budget is not None and wi.config.zinf.dram_budget >= wi.min_budget_bytes:
        chosen, source = int(wi.config.zinf.dram_budget), "the run's zinf.dram_budget"
    if chosen is not None:
        budgets = sorted(set(budgets) | {chosen})
        total = len(budgets) + 4
    table = wi.table(budgets, progress=lambda i, n, label: tell(1 + i, total, label))
    if chosen is None:
        chosen = _knee(table)
    plan = wi.plan(chosen)
    tell(len(budgets) + 1, total, "recommending aio and DeepSpeed settings")
    aio = recommend_aio(src, wi.run_id, info=wi.info, config=wi.config)
    rec = Recommendation(run_id=wi.run_id, aio=aio, deepspeed=recommend_deepspeed(wi, chosen, aio))
    tell(len(budgets) + 2, total, "drawing the figures")
    figures = run_figures(src, wi.run_id, table, wi)
    tell(len(budgets) + 3, total, "rendering the page")
    report = Report(run_id=wi.run_id, whatif=wi, what_if=table, plan=plan, recommendation=rec, dram_budget_bytes=chosen,
                    budget_source=source, figures=figures, plan_name=plan_name,
                    created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    report.html = render_html(report, shown_db=describe_url(src) if isinstance(src, str) else str(src))
    report.build_s = time.perf_counter() - t0
    tell(total, total, "done")
    return report


def _knee(table: pd.DataFrame) -> int:
    """The smallest feasible budget whose predicted step is within KNEE_FRACTION of the fastest."""
    ok = table[table["feasible"]]
    best = float(ok["predicted_step_s"].min())
    good = ok[ok["predicted_step_s"] <= best * (1 + KNEE_FRACTION)]
    return int(good["dram_budget_bytes"].min())


def run_figures(src, run_id: int, what_if: pd.DataFrame, wi: WhatIf) -> dict[str, go.Figure]:
    """The run's figures, title -> figure: the live dashboard's (``dashboard.views.run_figures``)
    once that module exists, else those of :mod:`dashboard.figures`."""
    if importlib.util.find_spec("dashboard.views") is not None:
        from dashboard.views import run_figures as dashboard_figures

        return dict(dashboard_figures(src, run_id, what_if=what_if))
    from dashboard import figures

    steps = queries.steps(src, run_id)
    return {
        "Step time by phase": figures.step_time_figure(steps),
        "Training loss": figures.loss_figure(steps),
        "Bytes moved per tier": figures.bytes_per_tier_figure(steps),
        "I/O bandwidth per tier": figures.bandwidth_figure(queries.bandwidth_over_time(src, run_id)),
        "I/O cost model": figures.cost_model_figure(queries.io_samples(src, run_id), wi.cost_model),
    }


# ------------------------------------------------------------------------------ writing
def check_outputs(out: str | Path, plan_out: str | Path | None, *, force: bool) -> tuple[Path, Path]:
    """The report's and the plan's paths, checked before any work: their folders exist, neither
    is a directory, and neither exists unless ``force``. ``plan_out`` None: plan.json beside the report."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a directory; give the report's file name, such as report.html")
    out_path = check_out(out, directory=False, force=force)
    plan_path = Path(plan_out).expanduser() if plan_out is not None else out_path.absolute().parent / "plan.json"
    if plan_path.is_dir():
        raise ExportError(f"--plan-out {str(plan_path)!r} is a directory; give the plan's file name, such as plan.json")
    if not plan_path.absolute().parent.is_dir():
        raise ExportError(f"the folder of --plan-out {str(plan_path)!r} does not exist; create it or choose another --plan-out")
    if plan_path.absolute() == out_path.absolute():
        raise ExportError(f"--plan-out and --out are the same file {str(out_path)!r}; give them different names")
    if plan_path.exists() and not force:
        raise ExportError(f"the plan file {str(plan_path)!r} (written beside the report) exists; choose another "
                          f"--plan-out or pass --force to replace it")
    return out_path, plan_path


def write_report(report: Report, out: str | Path, plan_out: str | Path | None = None, *, force: bool = False) -> tuple[Path, Path]:
    """Write the plan file, then the report, each atomically; returns (report path, plan path)."""
    out_path, plan_path = check_outputs(out, plan_out, force=force)
    plan_text = json.dumps(report.plan.to_document(report.created_at), indent=2, allow_nan=False) + "\n"
    _atomic_write_file(plan_path, lambda f: f.write(plan_text), binary=False)
    _atomic_write_file(out_path, lambda f: f.write(report.html), binary=False)
    return out_path, plan_path


# ------------------------------------------------------------------------------ the page
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       margin: 0 auto; max-width: 1200px; padding: 1em 2em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
section { margin: 1.5em 0; }
table { border-collapse: collapse; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
tr.chosen td { background: #fff6d5; font-weight: 600; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; font-size: .85em; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; } dt { font-weight: 600; }
.note { color: #555; font-size: .9em; }
"""


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "figure"


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _s(seconds: float) -> str:
    return "" if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)) else f"{seconds:.4f}"


def _table(headers: list[str], rows: list[list[Any]], *, text_columns: int = 1, classes: list[str] | None = None) -> str:
    head = "".join(f'<th class="text">{_e(h)}</th>' if i < text_columns else f"<th>{_e(h)}</th>" for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cls = f' class="{classes[r]}"' if classes and classes[r] else ""
        cells = "".join(f'<td class="text">{_e(v)}</td>' if i < text_columns else f"<td>{_e(v)}</td>" for i, v in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{_e(sid)}">\n<h2>{_e(title)}</h2>\n{body}\n</section>'


def render_html(report: Report, *, shown_db: str = "") -> str:
    """The report as one HTML document (see the module docstring)."""
    wi, plan, rec = report.whatif, report.plan, report.recommendation
    info = wi.info
    parts = [_summary(report, shown_db)]
    for title, fig in report.figures.items():
        slug = _slug(title)
        div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=f"chart-{slug}",
                          default_height=CHART_HEIGHT, config={"displaylogo": False, "responsive": True})
        parts.append(_section(f"figure-{slug}", title, div))
    parts += [_placement(report), _aio(rec), _what_if(report), _deepspeed(report), _notes(report)]
    title = f"zinf report: run {report.run_id} ({info.get('name') or ''})"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n"
        f"<script type=\"text/javascript\">{get_plotlyjs()}</script>\n</head>\n<body>\n"
        f"<h1>{_e(title)}</h1>\n"
        f"<p class=\"note\">made by zinf {_e(zinf.__version__)} at {_e(report.created_at)} from {_e(shown_db)}</p>\n"
        + "\n".join(parts) + "\n</body>\n</html>\n"
    )


def _summary(report: Report, shown_db: str) -> str:
    wi, plan = report.whatif, report.plan
    info = wi.info
    wl = wi.workload
    in_dram, homes = plan.homes_in_dram
    frac = report.dram_budget_bytes / wi.state_bytes if wi.state_bytes else math.nan
    items = [
        ("run", f"{report.run_id} ({info.get('name')}), {info.get('status')}, {info.get('steps')} optimizer steps"),
        ("model", model_summary(info.get("model")) or "?"),
        ("database", shown_db),
        ("measured median step", f"{_s(wl.measured_step_s)} s (steps {wl.source['steps'][0]}-{wl.source['steps'][1]})"),
        ("DRAM budget", f"{fmt_bytes(report.dram_budget_bytes)} ({frac:.0%} of the {fmt_bytes(wi.state_bytes)} model state; "
                        f"from {report.budget_source})"),
        ("predicted step at that budget", f"{_s(plan.predicted_step_s)} s, {plan.speedup:.2f}x the all-NVMe placement "
                                          f"({_s(plan.all_nvme_step_s)} s)"),
        ("homes in DRAM", f"{in_dram} of {homes} ({fmt_bytes(plan.home_dram_bytes)}; overlap buffers: {plan.buffers})"),
        ("smallest budget the engine accepts", fmt_bytes(wi.min_budget_bytes)),
    ]
    body = "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items) + "</dl>"
    return _section("summary", "Summary", body)


def _placement(report: Report) -> str:
    plan, wi = report.plan, report.whatif
    df = wi.workload.shards.set_index("shard")
    rate = df["fwd_accesses_per_step"] + df["bwd_accesses_per_step"] + df["opt_accesses_per_step"]
    counts: dict[tuple[str, str], int] = {}
    for tiers in plan.placement.values():
        for state in ("param", "optim"):
            counts[(state, tiers[state])] = counts.get((state, tiers[state]), 0) + 1
    totals = ", ".join(f"{state} homes on {tier}: {n}" for (state, tier), n in sorted(counts.items()) if tier != "none")
    order = rate.sort_values(ascending=False, kind="stable").index[:MAX_PLACEMENT_ROWS]
    rows = [[name, plan.placement[name]["param"], plan.placement[name]["optim"], f"{df.at[name, 'param_bytes'] / 1e6:.3f}",
             f"{(df.at[name, 'optim_bytes'] + df.at[name, 'grad_bytes']) / 1e6:.3f}", f"{rate[name]:.2f}"] for name in order]
    shown = "" if len(plan.placement) <= MAX_PLACEMENT_ROWS else (
        f" The {MAX_PLACEMENT_ROWS} most used of {len(plan.placement)} shards are listed; all are in the plan file.")
    body = (f"<p>Written as <code>{_e(report.plan_name)}</code>; start a run from it with "
            f"<code>{_e(json.dumps({'zinf': {'placement': {'plan_file': report.plan_name}}}))}</code> "
            f"(same model, shard settings and precision). {_e(totals)}.{_e(shown)}</p>"
            + _table(["shard", "param home", "optimizer home", "param (MB)", "optimizer + grad (MB)", "accesses / step"], rows,
                     text_columns=3))
    return _section("placement", f"Recommended placement at {fmt_bytes(report.dram_budget_bytes)} of DRAM", body)


def _aio(rec: Recommendation) -> str:
    a = rec.aio
    rows = [["block_size", f"{a.block_size} B ({fmt_bytes(a.block_size)})"], ["queue_depth", a.queue_depth],
            ["thread_count", a.thread_count], ["single_submit", a.single_submit], ["overlap_events", a.overlap_events]]
    if a.prefetch_bytes:
        rows.append(["prefetch window (autotuned)", fmt_bytes(a.prefetch_bytes)])
    snippet = '"aio": ' + json.dumps(a.as_deepspeed(), indent=2)
    body = (f"<p>From <b>{_e(a.source)}</b>: {_e(a.note)}.</p>" + _table(["setting", "value"], rows)
            + f"<pre><code>{_e(snippet)}</code></pre>")
    return _section("aio", "Recommended aio settings", body)


def _what_if(report: Report) -> str:
    t = report.what_if
    rows, classes = [], []
    for r in t.itertuples(index=False):
        used = "" if not r.feasible else fmt_bytes(r.dram_used_bytes)
        rows.append([fmt_bytes(r.dram_budget_bytes), f"{r.budget_fraction:.0%}",
                     _s(r.predicted_step_s) if r.feasible else "below the minimum",
                     f"{r.speedup:.2f}x" if r.feasible else "", used])
        classes.append("chosen" if int(r.dram_budget_bytes) == report.dram_budget_bytes else "")
    body = ("<p>The planner's predicted step time at each DRAM budget (the placement solved again at each), and the "
            "speed-up over all of the state on NVMe with the config's buffers. The highlighted row is this report's budget.</p>"
            + _table(["DRAM budget", "of model state", "predicted step (s)", "speed-up", "DRAM used"], rows, classes=classes))
    return _section("what-if", "What if: DRAM budget to predicted step time", body)


def _deepspeed(report: Report) -> str:
    d = report.recommendation.deepspeed
    snippet = json.dumps(d.config(), indent=2)
    params = (f"the first {d.max_in_cpu:,} parameter elements in DRAM (<code>max_in_cpu</code>), {d.buffer_count} param "
              f"buffers of {d.buffer_size:,} elements" if d.offload_param_device == "nvme" else "every parameter in DRAM")
    body = (f"<p>For a DRAM budget of {_e(fmt_bytes(d.dram_budget_bytes))}: {params}, the optimizer state on "
            f"<b>{_e(d.offload_optimizer_device)}</b>. zinf's simulator predicts "
            f"{_e(_s(d.predicted_step_s))} s a step for this placement in zinf (DeepSpeed's own time will differ), "
            f"against {_e(_s(report.plan.predicted_step_s))} s for zinf's plan. DRAM needed as zinf counts it: "
            f"{_e(fmt_bytes(d.dram_need_bytes))}.</p>"
            + (f"<p class=\"note\">{_e(d.note)}</p>" if d.note else "")
            + f"<pre><code>{_e(snippet)}</code></pre>")
    return _section("deepspeed", "Staying on DeepSpeed", body)


def _notes(report: Report) -> str:
    wi, plan = report.whatif, report.plan
    wl = wi.workload
    items = [
        f"Cost model: {wi.cost_model!r}.",
        f"Workload from steps {wl.source['steps'][0]}-{wl.source['steps'][1]} of the run ({wl.source['n_steps']} steps; "
        f"the first step records the prefetch trace and is left out); update cost: {wl.source.get('update')}; "
        f"fetch overhead: {wl.source.get('fetch_overhead')}.",
        f"The simulator is calibrated on the run's measured step: {wl.overhead_s * 1e3:+.1f} ms a step it does not model.",
        f"Each budget is solved for {len(wi.splits)} ways of sharing it between homes and the engine's overlap buffers "
        "(prefetch window, write-behind, read-ahead, updates during backward), as the adaptive controller does; the fastest "
        f"predicted is shown. The working set and staging ({fmt_bytes(wi.base_bytes)}) are the engine's at the all-NVMe "
        "placement, the most any placement needs.",
        f"Plan at the chosen budget: {plan.plan.method}, {plan.plan.evaluations} simulations, {plan.plan.solve_s:.2f} s"
        + (f"; {plan.plan.note}" if plan.plan.note else "") + ".",
        *wi.notes,
    ]
    body = "<ul>" + "".join(f"<li>{_e(x)}</li>" for x in items) + "</ul>"
    return _section("notes", "How these numbers were made", body)


# ------------------------------------------------------------------------------ the terminal
def summary_lines(report: Report) -> list[str]:
    """A few plain lines for the terminal."""
    wi, plan, rec = report.whatif, report.plan, report.recommendation
    in_dram, homes = plan.homes_in_dram
    a, d = rec.aio, rec.deepspeed
    frac = report.dram_budget_bytes / wi.state_bytes if wi.state_bytes else math.nan
    return [
        f"run {report.run_id}: measured median step {_s(wi.workload.measured_step_s)} s; model state {fmt_bytes(wi.state_bytes)}",
        f"at {fmt_bytes(report.dram_budget_bytes)} of DRAM ({frac:.0%} of the state, from {report.budget_source}): "
        f"predicted {_s(plan.predicted_step_s)} s a step, {plan.speedup:.2f}x all-NVMe; {in_dram} of {homes} homes in DRAM",
        f"aio: block {fmt_bytes(a.block_size)}, queue depth {a.queue_depth}, {a.thread_count} threads (from {a.source})",
        "staying on DeepSpeed: " + (f"max_in_cpu {d.max_in_cpu:,}, {d.buffer_count} x {d.buffer_size:,}-element param buffers"
                                    if d.offload_param_device == "nvme" else "every param in DRAM (offload_param.device cpu)")
        + f", optimizer on {d.offload_optimizer_device}",
    ]
