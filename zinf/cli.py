"""The ``zinf`` command line. Errors a user can cause print as one line and exit with status 1."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from zinf.errors import ZinfError

app = typer.Typer(help="zinf: train models larger than GPU memory and DRAM, with placement decided by measurement.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
db_app = typer.Typer(help="Profile database maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")
console = Console()
err_console = Console(stderr=True)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="optimizer steps to train")] = 60,
    batch_size: Annotated[int, typer.Option(help="sequences per micro-batch")] = 8,
    workdir: Annotated[Path, typer.Option(help="where zinf-swap/, zinf-profile.db and zinf-checkpoints/ go")] = Path("."),
    dram_fraction: Annotated[float, typer.Option(help="DRAM budget as a fraction of the training state")] = 0.5,
    preset: Annotated[str, typer.Option(help="size of the built-in GPT: tiny, small or demo")] = "demo",
    profile: Annotated[bool, typer.Option(help="record into zinf-profile.db")] = True,
) -> None:
    """Train the built-in GPT with its state on DRAM and NVMe, profiled, and print a summary."""
    from zinf.demo import DemoSettings, run_demo

    run_demo(DemoSettings(steps=steps, batch_size=batch_size, workdir=workdir, dram_fraction=dram_fraction, profile=profile, preset=preset), console)


@db_app.command("upgrade")
def db_upgrade(db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database")] = "sqlite:///zinf-profile.db") -> None:
    """Create or migrate the profile database to the newest schema."""
    from profiler.store import current_revision, upgrade

    upgrade(db)
    console.print(f"{db} is at schema revision {current_revision(db)}")


@app.command("bench-io")
def bench_io(
    path: Annotated[Path, typer.Option(help="directory on the disk to measure (your nvme_path); it must exist")],
    db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database for the results")] = "sqlite:///zinf-profile.db",
    no_db: Annotated[bool, typer.Option("--no-db", help="do not write the results to the profile database")] = False,
    sizes: Annotated[str | None, typer.Option(help="shard file sizes, e.g. 1MiB,4MiB,8MiB (default 1,4,8,32 MiB)")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="a tiny sweep (4 settings, 16 MiB a point), for tests")] = False,
    baseline: Annotated[str | None, typer.Option(help="raw baseline tool: fio, dd or python (default: the first available)")] = None,
) -> None:
    """Sweep aio block size x queue depth x thread count through zinf's NVMe store, beside a raw
    baseline; print GB/s per setting, recommend an "aio" section, and store the results."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from zinf import bench_io as bench
    from zinf.errors import ConfigError

    if baseline is not None and baseline not in ("fio", "dd", "python"):
        raise ConfigError(f"--baseline {baseline!r} is not one of fio, dd, python")
    size_list = bench.parse_sizes(sizes) if sizes else (bench.QUICK_SIZES_BYTES if quick else bench.DEFAULT_SIZES_BYTES)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("bench-io", total=None)
        report = bench.run_bench(
            path, sizes_bytes=size_list, settings=bench.default_grid(quick),
            bytes_per_op=bench.QUICK_BYTES_PER_OP if quick else bench.DEFAULT_BYTES_PER_OP, baseline=baseline,
            progress=lambda done, total, label: bar.update(task, completed=done, total=total, description=label),
            warn=lambda msg: err_console.print(f"[yellow]warning:[/] {msg}", highlight=False, soft_wrap=True),
        )
    console.print(bench.results_table(report))
    for line in bench.summary_lines(report):
        console.print(line, highlight=False, soft_wrap=True)
    console.print("recommended (DeepSpeed / zinf config):")
    console.print(report.aio_snippet(), highlight=False, markup=False)
    if not no_db:
        from profiler.calibrations import save_calibrations
        from profiler.store import describe_url

        n_rows = save_calibrations(db, report.calibration_rows())
        console.print(f"wrote {n_rows} rows to the calibrations table of {describe_url(db)}", highlight=False)


@app.command()
def doctor(
    path: Annotated[Path, typer.Option(help="the swap directory to check (your nvme_path)")],
    config: Annotated[Path | None, typer.Option(help="a zinf / DeepSpeed JSON config: its aio settings, buffers and paths are used")] = None,
    params: Annotated[int | None, typer.Option(help="model parameters, to compare the NVMe state size with the free space")] = None,
    state_bytes: Annotated[str | None, typer.Option(help="bytes of state that will live on NVMe, e.g. 500GiB (instead of --params)")] = None,
    measure: Annotated[bool, typer.Option(help="measure read/write bandwidth (about a second)")] = True,
) -> None:
    """Check the NVMe setup (the seed article's checklist): one line per check, PASS / WARN /
    FAIL / SKIP with the fix. Exits 1 if any check FAILs."""
    from rich.markup import escape

    from zinf.config import load_config, parse_size
    from zinf.doctor import Status, exit_code, run_checks

    cfg = load_config(config) if config is not None else None
    results = run_checks(path, config=cfg, params=params, measure=measure,
                         state_bytes=parse_size(state_bytes) if state_bytes is not None else None)
    colour = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "red", Status.SKIP: "dim"}
    for r in results:
        fix = f" [bold]-> fix:[/] {escape(r.fix)}" if r.fix else ""
        console.print(f"[{colour[r.status]}]{r.status.value}[/] {escape(r.name)}: {escape(r.detail)}{fix}",
                      highlight=False, soft_wrap=True)
    counts = {s: sum(r.status is s for r in results) for s in Status}
    console.print(", ".join(f"{n} {s.value}" for s, n in counts.items()), highlight=False)
    if exit_code(results):
        sys.exit(exit_code(results))  # SystemExit, not typer.Exit: main() runs click without standalone mode


@app.command("export")
def export(
    out: Annotated[Path, typer.Option(help="the file (chrome) or directory (csv, parquet) to write; its folder must exist")],
    format: Annotated[str, typer.Option("--format", help="chrome (a Chrome/Perfetto trace JSON), csv or parquet (one file per table)")],
    db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database")] = "sqlite:///zinf-profile.db",
    run: Annotated[str | None, typer.Option(help="run id (default: the latest run); 'all' exports every run (csv, parquet)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing non-empty --out")] = False,
) -> None:
    """Export a run of the profile database: a Chrome trace that opens in Perfetto /
    chrome://tracing, or every table's rows as CSV or Parquet files in a directory."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from profiler import export as ex
    from profiler.store import describe_url

    fmt = ex.check_format(format)
    which = ex.parse_run(run, fmt)
    run_id = None if which in (None, "all") else int(which)
    if which is None:  # the latest run, looked up here so that the message can say which one it was
        from profiler.queries import latest_run_id
        from zinf.errors import ProfileError

        run_id = latest_run_id(db)
        if run_id is None:
            raise ProfileError(f"no run is recorded in {describe_url(db)}; record one with the profiler enabled")
    if fmt == "chrome":
        path = ex.export_chrome_trace(db, run_id, out, force=force)
        console.print(f"wrote a Chrome trace of run {run_id} of {describe_url(db)} to {path} "
                      "(open it in ui.perfetto.dev or chrome://tracing)", highlight=False, markup=False, soft_wrap=True)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tables"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(f"export {fmt}", total=len(ex.schema.TABLES))
        files = ex.export_tables(db, run_id, out, fmt, force=force,
                                 progress=lambda done, total, label: bar.update(task, completed=done, total=total,
                                                                               description=f"{fmt}: {label}"))
    what = "every run" if which == "all" else f"run {run_id}"
    console.print(f"wrote {len(files)} {fmt} files ({what}) to {out}", highlight=False, markup=False, soft_wrap=True)


@app.command("runs")
def runs(db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database")] = "sqlite:///zinf-profile.db") -> None:
    """List the runs in the profile database: status (running / finished / crashed), steps, model, last loss."""
    from rich.markup import escape
    from rich.table import Table

    from profiler.export import runs_summary
    from profiler.store import describe_url

    df = runs_summary(db)
    if df.empty:
        console.print(f"no runs recorded in {describe_url(db)}", highlight=False)
        return
    table = Table(title=f"runs in {describe_url(db)}")
    for col, kw in (("id", {"justify": "right"}), ("name", {"overflow": "fold"}), ("status", {}), ("started (UTC)", {}),
                    ("steps", {"justify": "right"}), ("model", {}), ("last loss", {"justify": "right"})):
        table.add_column(col, **kw)
    colour = {"running": "yellow", "finished": "green", "crashed": "red"}
    for r in df.itertuples(index=False):
        started = "" if r.started_at is None or str(r.started_at) == "NaT" else r.started_at.tz_convert(None).strftime("%Y-%m-%d %H:%M:%S")
        loss = "" if r.last_loss != r.last_loss or r.last_loss is None else f"{r.last_loss:.4g}"
        table.add_row(str(r.run_id), escape(str(r.name)), f"[{colour.get(r.status, 'white')}]{r.status}[/]", started,
                      str(r.steps), escape(str(r.model)), loss)
    console.print(table)


def _latest_run(db: str, run: int | None) -> int:
    """``--run``, or the newest run of ``db`` (a one-line error when there is none)."""
    if run is not None:
        return run
    from profiler.queries import latest_run_id
    from profiler.store import describe_url
    from zinf.errors import ProfileError

    latest = latest_run_id(db)
    if latest is None:
        raise ProfileError(f"no run is recorded in {describe_url(db)}; record one with the profiler enabled")
    return latest


@app.command("plan")
def plan(
    dram_budget: Annotated[str, typer.Option(help="DRAM budget: a size such as 8GiB, or a percentage of the model state such as 30%")],
    out: Annotated[Path, typer.Option(help="the plan file to write, e.g. plan.json; its folder must exist")],
    db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database")] = "sqlite:///zinf-profile.db",
    run: Annotated[int | None, typer.Option(help="run id to plan from (default: the latest run)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing --out")] = False,
) -> None:
    """Plan the placement of a profiled run under a DRAM budget and write it as a plan file; a
    training run starts from it with "zinf": {"placement": {"plan_file": "plan.json"}}."""
    from profiler.export import check_out
    from planner.whatif import WhatIf, parse_budget, write_plan
    from zinf.placement import fmt_bytes

    if not dram_budget.strip().endswith("%"):
        parse_budget(dram_budget, 0)  # a size: checked before the profile is read
    check_out(out, directory=False, force=force)
    with console.status("reading the profile and planning", spinner="dots"):
        wi = WhatIf.from_profile(db, _latest_run(db, run))
        result = wi.plan(wi.parse_budget(dram_budget))
    path = write_plan(result, out, force=force)
    in_dram, homes = result.homes_in_dram
    console.print(f"wrote {path}: run {result.run_id} at {fmt_bytes(result.dram_budget_bytes)} of DRAM, {in_dram} of {homes} "
                  f"homes in DRAM, predicted {result.predicted_step_s:.4f} s a step ({result.speedup:.2f}x all-NVMe, "
                  f"{result.all_nvme_step_s:.4f} s)", highlight=False, markup=False, soft_wrap=True)


@app.command("report")
def report(
    out: Annotated[Path, typer.Option(help="the HTML file to write, e.g. report.html; its folder must exist")],
    db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database")] = "sqlite:///zinf-profile.db",
    run: Annotated[int | None, typer.Option(help="run id (default: the latest run)")] = None,
    dram_budget: Annotated[str | None, typer.Option(help="DRAM budget to recommend for: a size such as 8GiB or a percentage "
                                                         "of the model state such as 30% (default: the run's "
                                                         "zinf.dram_budget, else the knee of the what-if curve)")] = None,
    plan_out: Annotated[Path | None, typer.Option(help="where the recommended plan goes (default: plan.json beside --out)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing --out (and plan file)")] = False,
) -> None:
    """Write one self-contained HTML report of a profiled run (figures, recommended placement,
    aio settings, a what-if table of DRAM budgets, the DeepSpeed config to stay on DeepSpeed),
    plus the recommended plan as plan.json; print a short summary."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from dashboard.report import build_report, check_outputs, summary_lines, write_report

    check_outputs(out, plan_out, force=force)  # before any work: a path in the way is one line now
    run_id = _latest_run(db, run)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("report", total=None)
        result = build_report(db, run_id, dram_budget, plan_name=(plan_out or Path("plan.json")).name,
                              progress=lambda done, total, label: bar.update(task, completed=done, total=total, description=label))
    out_path, plan_path = write_report(result, out, plan_out, force=force)
    for line in summary_lines(result):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    size_mb = out_path.stat().st_size / 1e6
    console.print(f"wrote {out_path} ({size_mb:.1f} MB, open it in a browser) and {plan_path}", highlight=False,
                  markup=False, soft_wrap=True)


@app.command("dashboard")
def dashboard(
    db: Annotated[str, typer.Option(help="SQLAlchemy URL of the profile database (opened read-only)")] = "sqlite:///zinf-profile.db",
    host: Annotated[str, typer.Option(help="address to listen on: 127.0.0.1 serves this machine only; 0.0.0.0 everyone who can reach it (no login!)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port to listen on", min=1, max=65535)] = 8050,
) -> None:
    """Serve the live web dashboard of a profile database: runs, step time, shards, plans, what-if.
    It reads the database only, and follows a run while it trains."""
    import socket

    import uvicorn

    from dashboard.app import create_app
    from profiler.store import describe_url

    web = create_app(db)  # a missing or foreign database fails here, in one line
    # a port in use fails here in one line too, rather than in uvicorn's log
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as e:
        raise ZinfError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host") from None
    shown_host = f"[{host}]" if ":" in host else host
    console.print(f"zinf dashboard of {describe_url(db)} at http://{shown_host}:{port}/ (Ctrl-C stops it)",
                  highlight=False, markup=False, soft_wrap=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(f"[yellow]warning:[/] listening on {host}: anyone who can reach this port can read the profile",
                          highlight=False, soft_wrap=True)
    uvicorn.run(web, host=host, port=port, log_level="warning")


def main(argv: list[str] | None = None) -> None:
    try:
        app(args=argv, standalone_mode=False)
    except ZinfError as exc:
        err_console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("aborted")
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click's usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
