"""``zinf export`` (Chrome trace, CSV, Parquet) and ``zinf runs``, on a real profile: the tiny GPT
trained for a few steps with its params and optimizer state on NVMe files under tmp_path and the
profiler recording into SQLite. A copy of that database gets two more runs from the recorder (one
with plans, migrations, a tuning trial and calibrations; one whose process is killed)."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import SMALL_SHARDS
from test_costmodel import train_profiled
from test_profiler import full_stream, live_child_run, record, run_started, step_events
from zinf import events as ev
from zinf.cli import main

from profiler import export, queries, schema
from profiler.recorder import Recorder, record_calibration

N_STEPS = 5
PHASES = ("forward", "backward", "optimizer", "stall", "migration")
TOL_US = 0.01  # ts/dur are rounded to 0.001 us


# ------------------------------------------------------------------------------ fixtures
def db_path(url: str) -> Path:
    return Path(url[len("sqlite:///"):])


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """URL of a real 5-step profile (one finished run)."""
    url = train_profiled(tmp_path_factory.mktemp("export"), N_STEPS, shards=SMALL_SHARDS)
    assert queries.list_runs(url)["status"].tolist() == ["finished"]
    return url


@pytest.fixture(scope="module")
def multi(real, tmp_path_factory):
    """A copy of the real profile plus run 2 (recorder: plans, migrations, a trial, calibrations)
    and run 3 (its process killed: crashed). Returns (url, run ids)."""
    work = tmp_path_factory.mktemp("export-multi")
    url = f"sqlite:///{work / 'profile.db'}"
    with sqlite3.connect(db_path(real)) as src, sqlite3.connect(db_path(url)) as dst:
        src.backup(dst)
    r = Recorder(url, flush_interval_s=0.05)
    r.emit(run_started("planned"))
    for e in step_events(0):
        r.emit(e)
    r.record_plan(1, [{"shard": "s0", "param_tier": "gpu", "optim_tier": "cpu", "score": 2.5}, ("s2", "cpu", "nvme")],
                  policy="greedy", created_step=1, dram_budget_bytes=1 << 30, predicted_step_s=0.08,
                  predicted_gain_s=0.02, adopted=True, reason={"why": "s0 is hot"})
    r.emit(ev.ShardMigrated(1, "s0", "param", "cpu", "gpu", 2000, 0.004))
    r.emit(ev.ShardMigrated(1, "s0", "optim", "nvme", "cpu", 12000, 0.003))
    for e in step_events(1):
        r.emit(e)
    r.record_tuning_trial({"block_size": 1 << 20, "queue_depth": 8}, 0.12, chosen=True, step=0)
    r.record_calibration([{"path": "/nvme", "op": "read", "fstype": "ext4", "block_size": 1 << 20, "queue_depth": 8,
                           "thread_count": 1, "bytes": 1 << 30, "seconds": 0.5, "source": "recorder"}])
    r.emit(ev.RunFinished("finished", 2, time.time()))
    r.close()
    record_calibration(url, [{"path": "/nvme", "op": "write", "GBps": 1.5, "raw_baseline_GBps": 1.8, "source": "bench-io"}])
    planned = r.run_id
    # a run whose process dies with its row still 'running' (as in test_profiler)
    with live_child_run(url, work) as killed:
        pass
    assert (planned, killed) == (2, 3)
    return url, {"real": 1, "planned": planned, "killed": killed}


def trace_of(url: str, tmp_path: Path, run_id: int | None = None, **kw) -> dict:
    out = export.export_chrome_trace(url, run_id, tmp_path / "run.trace.json", **kw)
    assert out == tmp_path / "run.trace.json"
    with open(out) as f:
        return json.load(f)  # valid JSON (NaN would not parse in strict viewers: allow_nan=False on write)


def spans(trace: dict, cat: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == cat]


def inside(e: dict, outer: dict) -> bool:
    return outer["ts"] - TOL_US <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + TOL_US


def one_error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# --------------------------------------------------------------------------- Chrome trace
def test_chrome_trace_events_are_complete(real, tmp_path):
    trace = trace_of(real, tmp_path)
    assert trace["displayTimeUnit"] == "ms" and isinstance(trace["traceEvents"], list)
    for e in trace["traceEvents"]:
        for key in ("name", "ph", "ts", "pid", "tid"):
            assert key in e, (key, e)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert e["ph"] in ("X", "C", "M")
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) and math.isfinite(v) for v in e["args"].values())
    meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", 1, 0)]["name"].startswith("zinf run 1")
    threads = {a["name"] for (n, pid, _), a in meta.items() if n == "thread_name" and pid == 1}
    assert {"step", "forward", "backward", "optimizer", "stall", "migration"} <= threads
    # counters: bytes per tier, memory, bandwidth per tier
    counters = {e["name"] for e in trace["traceEvents"] if e["ph"] == "C"}
    assert {"read bytes per step by tier (cpu = DRAM)", "written bytes per step by tier (cpu = DRAM)",
            "memory (bytes)", "homed state bytes by tier (cpu = DRAM)",
            "read bandwidth by tier (GB/s)", "write bandwidth by tier (GB/s)"} <= counters
    steps = queries.steps(real, 1)
    bw = queries.bandwidth_over_time(real, 1)
    reads = [e for e in trace["traceEvents"] if e["name"] == "read bandwidth by tier (GB/s)"]
    nvme_read = bw[(bw["tier"] == "nvme") & (bw["read_samples"] > 0)].set_index("step")["read_GBps"]
    assert len(reads) == N_STEPS + 1 and reads[-1]["args"]["nvme"] == 0  # one per step, then back to 0
    got = [e["args"]["nvme"] for e in reads[:-1]]
    assert got == pytest.approx([nvme_read.get(s, 0.0) for s in steps["step"]])
    assert any(v > 0 for v in got)
    written = [e for e in trace["traceEvents"] if e["name"] == "written bytes per step by tier (cpu = DRAM)"][:-1]
    assert [e["args"]["nvme"] for e in written] == steps["written_nvme_bytes"].tolist()
    homed = [e for e in trace["traceEvents"] if e["name"] == "homed state bytes by tier (cpu = DRAM)"]
    sh = queries.shards(real, 1)
    assert homed[0]["args"]["nvme"] == int(sh["param_bytes"].sum() + sh["optim_bytes"].sum())  # all on NVMe
    other = trace["otherData"]
    assert other["run_id"] == 1 and other["steps"] == N_STEPS and other["status"] == "finished"
    assert other["model"]["class"] == "GPT" and "GPT" in other["model_summary"]
    assert other["config_summary"]["zero_optimization.offload_param.device"] == "nvme"
    assert not any("db" in k.split(".")[-1] for k in other["config_summary"])  # no database URL


def test_chrome_spans_nest_in_their_step_and_add_up(real, tmp_path):
    trace = trace_of(real, tmp_path, 1)
    steps = queries.steps(real, 1)
    walls = {e["args"]["step"]: e for e in spans(trace, "step")}
    assert sorted(walls) == steps["step"].tolist()
    ordered = [walls[s] for s in sorted(walls)]
    for a, b in zip(ordered, ordered[1:]):
        assert a["ts"] + a["dur"] <= b["ts"] + TOL_US  # steps do not overlap
    for row in steps.itertuples():
        assert walls[row.step]["dur"] == pytest.approx(row.wall_s * 1e6, abs=TOL_US)
    children = [e for cat in (*PHASES, "fetch") for e in spans(trace, cat)]
    assert len(children) > 4 * N_STEPS
    for e in children:
        assert inside(e, walls[e["args"]["step"]]), e
    # forward, backward, optimizer follow each other inside a step
    for s, wall in walls.items():
        seq = sorted((e for e in children if e["args"]["step"] == s and e["cat"] in ("forward", "backward", "optimizer")),
                     key=lambda e: e["ts"])
        assert [e["cat"] for e in seq] == ["forward", "backward", "optimizer"]
        assert seq[0]["ts"] == wall["ts"]
        for a, b in zip(seq, seq[1:]):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=2 * TOL_US)
    for phase in PHASES:
        total_s = sum(e["dur"] for e in spans(trace, phase)) / 1e6
        assert total_s == pytest.approx(steps[f"{phase}_s"].sum(), rel=0.01, abs=1e-9), phase
    # per-shard fetch spans: one per shard and step with fetch time, the measured seconds in args
    ss = queries.shard_steps(real, 1)
    fetches = spans(trace, "fetch")
    assert len(fetches) == int((ss["fetch_s"] > 0).sum()) > 0
    assert sum(e["args"]["fetch_s"] for e in fetches) == pytest.approx(ss["fetch_s"].sum())
    assert {e["pid"] for e in fetches} == {2}
    assert len({e["tid"] for e in fetches}) == ss.loc[ss["fetch_s"] > 0, "shard_id"].nunique()


def test_chrome_fetch_tracks_are_bounded(real, tmp_path):
    stats = queries.shard_access_stats(real, 1)
    top = stats.sort_values("fetch_s", ascending=False, kind="stable")["name"].head(5).tolist()
    trace = trace_of(real, tmp_path, 1, max_fetch_shards=5)
    fetches = spans(trace, "fetch")
    assert {e["args"]["shard"] for e in fetches} == set(top)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2]
    assert sorted(names) == sorted(top)
    assert trace["otherData"]["shard_fetch_tracks"] == f"the top 5 of {len(stats)} fetched shards by fetch time"
    assert export.MAX_FETCH_SHARDS == 200


def test_chrome_migration_spans(multi, tmp_path):
    url, ids = multi
    trace = trace_of(url, tmp_path, ids["planned"])
    assert trace["otherData"]["run_name"] == "planned"
    walls = {e["args"]["step"]: e for e in spans(trace, "step")}
    moves = spans(trace, "shard_migration")
    m = queries.migrations(url, ids["planned"])
    assert [(e["args"]["shard"], e["args"]["state"], e["args"]["bytes"]) for e in moves] == list(zip(m["shard"], m["state"], m["bytes"]))
    assert moves[0]["name"] == "param s0 cpu->gpu"
    for e in moves:
        assert inside(e, walls[e["args"]["step"]])
        assert e["dur"] <= e["args"]["seconds"] * 1e6 + TOL_US
    assert moves[1]["ts"] == pytest.approx(moves[0]["ts"] + moves[0]["dur"], abs=2 * TOL_US)  # end to end
    assert spans(trace, "migration") == []  # the steps' migration_s is 0: no phase span


def test_chrome_fetch_spans_of_multi_step_windows(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    record(url, full_stream(3, name="windows"), window_steps=2)  # windows: steps 1-2 and 3
    trace = trace_of(url, tmp_path, 1)
    walls = {e["args"]["step"]: e for e in spans(trace, "step")}
    fetches = spans(trace, "fetch")
    assert sorted({(e["args"]["step"], e["args"]["window_steps"]) for e in fetches}) == [(1, 2), (3, 1)]
    for e in fetches:
        first, n = e["args"]["step"], e["args"]["window_steps"]
        start, end = walls[first]["ts"], walls[first + n - 1]["ts"] + walls[first + n - 1]["dur"]
        assert start - TOL_US <= e["ts"] and e["ts"] + e["dur"] <= end + TOL_US
    assert sum(e["args"]["fetch_s"] for e in fetches) == pytest.approx(queries.shard_steps(url, 1)["fetch_s"].sum())


# -------------------------------------------------------------------------- CSV / Parquet
def db_rows(url: str, table: str, run_id: int | None) -> tuple[list[str], list[tuple]]:
    where = ""
    if run_id is not None:
        if table == "runs":
            where = f"WHERE id = {int(run_id)}"
        elif table == "plan_assignments":
            where = f"WHERE plan_id IN (SELECT id FROM plans WHERE run_id = {int(run_id)})"
        elif table != "calibrations":
            where = f"WHERE run_id = {int(run_id)}"
    with sqlite3.connect(db_path(url)) as c:
        cur = c.execute(f"SELECT * FROM {table} {where} ORDER BY id")
        return [d[0] for d in cur.description], cur.fetchall()


def norm(v):
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) or v == "":
        return None  # CSV writes NULL (and '') as an empty field
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bool):
        return int(v)
    return v


def read_back(path: Path, fmt: str) -> pd.DataFrame:
    if fmt == "csv":
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    return pd.read_parquet(path)


def check_round_trip(url: str, out: Path, files: list[Path], fmt: str, run_id: int | None) -> int:
    assert [f.name for f in files] == [f"{t}.{fmt}" for t in schema.TABLES]
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in files)
    total = 0
    for table in schema.TABLES:
        cols, rows = db_rows(url, table, run_id)
        df = read_back(out / f"{table}.{fmt}", fmt)
        assert list(df.columns) == cols, table
        assert len(df) == len(rows), table
        got = [tuple(norm(v) for v in r) for r in df.itertuples(index=False, name=None)]
        assert got == [tuple(norm(v) for v in r) for r in rows], table
        total += len(rows)
    return total


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tables_round_trip(real, tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(export, "CHUNK_ROWS", 7)  # several chunks per table
    out = tmp_path / "tables"
    files = export.export_tables(real, 1, out, fmt)
    assert check_round_trip(real, out, files, fmt, 1) > 100  # 19 shards x 5 steps, hundreds of I/O samples
    steps = read_back(out / f"steps.{fmt}", fmt)
    assert steps["wall_s"].tolist() == queries.steps(real, 1)["wall_s"].tolist()  # floats bit for bit
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        types = {f.name: f.type for f in pq.read_schema(out / "steps.parquet")}
        assert types["read_nvme_bytes"] == pa.int64() and types["wall_s"] == pa.float64() and types["step"] == pa.int64()
        assert pq.read_schema(out / "runs.parquet").field("o_direct").type == pa.bool_()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_one_run_of_many_and_run_all(multi, tmp_path, fmt):
    url, ids = multi
    one = tmp_path / "planned"
    files = export.export_tables(url, ids["planned"], one, fmt)
    check_round_trip(url, one, files, fmt, ids["planned"])
    assert len(read_back(one / f"plan_assignments.{fmt}", fmt)) == 2
    assert len(read_back(one / f"migrations.{fmt}", fmt)) == 2
    assert len(read_back(one / f"calibrations.{fmt}", fmt)) == 2  # per disk, not per run: all of them
    assert read_back(one / f"runs.{fmt}", fmt)["name"].tolist() == ["planned"]
    assert main(["export", "--db", url, "--format", fmt, "--run", "all", "--out", str(tmp_path / "all")]) is None
    files = [tmp_path / "all" / f"{t}.{fmt}" for t in schema.TABLES]
    check_round_trip(url, tmp_path / "all", files, fmt, None)
    assert read_back(tmp_path / "all" / f"runs.{fmt}", fmt)["id"].tolist() == [1, 2, 3]
    steps = read_back(tmp_path / "all" / f"steps.{fmt}", fmt)
    assert steps.groupby("run_id").size().to_dict() == {1: N_STEPS, 2: 2, 3: 3}


def test_cli_exports_latest_run_by_default(multi, tmp_path, capsys):
    url, ids = multi
    assert main(["export", "--db", url, "--format", "chrome", "--out", str(tmp_path / "t.json")]) is None
    assert f"run {ids['killed']}" in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())["otherData"]["run_id"] == ids["killed"]
    assert main(["export", "--db", url, "--format", "csv", "--out", str(tmp_path / "c")]) is None
    assert pd.read_csv(tmp_path / "c" / "runs.csv")["id"].tolist() == [ids["killed"]]


# ----------------------------------------------------------------------------- crash safety
def test_existing_out_is_not_clobbered_without_force(real, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    msg = one_error_line(capsys, ["export", "--db", real, "--format", "csv", "--out", str(out)])
    assert "--force" in msg and str(out) in msg
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert main(["export", "--db", real, "--format", "parquet", "--out", str(out), "--force"]) is None
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{t}.parquet" for t in schema.TABLES)
    trace = tmp_path / "t.json"
    trace.write_text("precious")
    one_error_line(capsys, ["export", "--db", real, "--format", "chrome", "--out", str(trace)])
    assert trace.read_text() == "precious"
    assert main(["export", "--db", real, "--format", "chrome", "--out", str(trace), "--force"]) is None
    assert json.loads(trace.read_text())["otherData"]["run_id"] == 1
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is not in the way
    assert main(["export", "--db", real, "--format", "csv", "--out", str(empty)]) is None
    assert len(list(empty.iterdir())) == len(schema.TABLES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out", "t.json"]  # no temporaries left


def test_a_failed_export_leaves_the_old_output(real, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export.export_tables(real, 1, out, "csv")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_write = export._write_table

    def failing(conn, table, run_id, file, fmt, **kw):
        if table.name == "io_samples":
            raise OSError(28, "No space left on device")
        return real_write(conn, table, run_id, file, fmt, **kw)

    monkeypatch.setattr(export, "_write_table", failing)
    with pytest.raises(export.ExportError, match="No space left"):
        export.export_tables(real, 1, out, "parquet", force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(export.ExportError):
        export.export_tables(real, 1, tmp_path / "new", "csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing half-written, no temporaries


# ----------------------------------------------------------------------------------- errors
def test_cli_errors_are_one_line(real, tmp_path, capsys):
    missing = f"sqlite:///{tmp_path / 'nope.db'}"
    base = ["export", "--db", real, "--out", str(tmp_path / "x")]
    msg = one_error_line(capsys, [*base, "--format", "chrome", "--run", "42"])
    assert msg == f"error: unknown run id 42 in {real}; known: 1"
    msg = one_error_line(capsys, [*base, "--format", "csv", "--run", "42"])
    assert "unknown run id 42" in msg and "known: 1" in msg
    msg = one_error_line(capsys, ["export", "--db", missing, "--format", "csv", "--out", str(tmp_path / "x")])
    assert "no profile database" in msg and "nope.db" in msg
    assert not (tmp_path / "nope.db").exists()
    msg = one_error_line(capsys, [*base, "--format", "xlsx"])
    assert "unknown export format 'xlsx'" in msg and "chrome, csv, parquet" in msg
    for fmt in ("chrome", "csv"):
        msg = one_error_line(capsys, ["export", "--db", real, "--format", fmt, "--out", str(tmp_path / "no" / "such" / "x")])
        assert "does not exist" in msg and str(tmp_path / "no" / "such") in msg
    msg = one_error_line(capsys, [*base, "--format", "chrome", "--run", "all"])
    assert "--run all" in msg
    msg = one_error_line(capsys, [*base, "--format", "csv", "--run", "latest"])
    assert "not a run id" in msg
    msg = one_error_line(capsys, ["export", "--db", real, "--format", "chrome", "--out", str(tmp_path)])
    assert "is a directory" in msg
    msg = one_error_line(capsys, ["runs", "--db", missing])
    assert "no profile database" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written by a failed command


# ------------------------------------------------------------------------------------- runs
def test_runs_lists_finished_and_crashed(multi, capsys):
    url, ids = multi
    summary = export.runs_summary(url)
    assert summary["run_id"].tolist() == [1, 2, 3]
    assert summary["status"].tolist() == ["finished", "finished", "crashed"]
    assert summary["steps"].tolist() == [N_STEPS, 2, 3]
    assert summary["last_loss"].tolist() == pytest.approx([queries.steps(url, 1)["loss"].iloc[-1], 2.9, 2.8])
    assert summary.loc[0, "model"].startswith("GPT, ") and "params" in summary.loc[0, "model"]
    assert main(["runs", "--db", url]) is None
    out = capsys.readouterr().out
    assert "finished" in out and "crashed" in out and "planned" in out and "killed" in out
    assert f"{summary.loc[0, 'last_loss']:.4g}" in out and "2.8" in out
    lines = [ln for ln in out.splitlines() if "crashed" in ln]
    assert len(lines) == 1 and "3" in lines[0]
