"""The profiler: Alembic schema, shipped migrations, the background recorder and the queries.

Everything runs on real SQLite files under tmp_path.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import queue
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

from zinf import events as ev
from zinf.errors import ProfileError

import profiler
from profiler import queries, schema, store
from profiler.recorder import Recorder, record_calibration

REPO = Path(__file__).resolve().parent.parent
N_STEPS = 5


# ------------------------------------------------------------------------------ helpers
def db_url(tmp_path, name="profile.db") -> str:
    return f"sqlite:///{tmp_path / name}"


def count(url: str, table: str, where: str = "") -> int:
    path = url[len("sqlite:///"):]
    with sqlite3.connect(path) as c:
        return c.execute(f"SELECT count(*) FROM {table} {where}").fetchone()[0]


def rows(url: str, sql: str) -> list[tuple]:
    with sqlite3.connect(url[len("sqlite:///"):]) as c:
        return c.execute(sql).fetchall()


SHARDS = (
    ev.ShardInfo("s0", "blocks.0", "param", 1000, 2000, 12000, 4000, ("blocks.0.w",), "cpu", "nvme"),
    ev.ShardInfo("s1", "blocks.1", "chunk", 500, 1000, 6000, 2000, ("blocks.1.a", "blocks.1.b"), "cpu", "nvme"),
    ev.ShardInfo("s2", "head", "param", 2000, 4000, 24000, 8000, ("head.w",), "nvme", "nvme"),
)


def run_started(name="run") -> ev.RunStarted:
    return ev.RunStarted(name, {"train_batch_size": 4, "zinf": {"profiler": {"enabled": True}}}, {"class": "GPT", "params": 3500},
                         {"cpu": "test", "bandwidths": {"nvme_read_GBps": 2.5}}, SHARDS, "/tmp/swap", True, time.time())


def step_events(k: int) -> list:
    """The events of optimizer step k (0-based), numbered as the engine numbers them."""
    out: list = []
    for i, s in enumerate(SHARDS):
        tier = s.param_tier
        out.append(ev.ShardFetched(k, k, s.name, "forward", tier, 100 * (i + 1), 0.001 * (i + 1), 0.0005 * (i + 1)))
    out.append(ev.ShardFetched(k, k, "s0", "recompute", "cpu", 100, 0.001, 0.0005))
    for i, s in reversed(list(enumerate(SHARDS))):
        out.append(ev.ShardFetched(k, k, s.name, "backward", s.param_tier, 100 * (i + 1), 0.001 * (i + 1), 0.0005 * (i + 1)))
    out.append(ev.IoDone("read", "nvme", "param", "s2", 4096, 0.002, True, 1 << 20, 8, 2))
    for s in SHARDS:
        out.append(ev.OptimizerShardDone(k, s.name, s.optim_tier, 1000, 2000, 0.01, 0.02, 0.03, len(s.members)))
        out.append(ev.IoDone("write", "nvme", "master", s.name, 8192, 0.004, True, 1 << 20, 8, 2))
    out.append(ev.StepFinished(k + 1, 2, 0.1 * (k + 1), 0.03, 0.04, 0.02, 0.005, 0.0, 3.0 - 0.1 * k,
                               {"cpu": 600, "nvme": 1200 + 3000}, {"nvme": 6000}, dram_bytes=10_000, rss_bytes=1 << 20, plan_version=0))
    return out


def full_stream(n_steps=N_STEPS, name="run") -> list:
    out: list = [run_started(name)]
    for k in range(n_steps):
        out += step_events(k)
    out.append(ev.RunFinished("finished", n_steps, time.time()))
    return out


@contextmanager
def live_child_run(url: str, cwd) -> Iterator[int]:
    """A child process that records three steps of a run into ``url`` and sleeps; yields its run
    id while it lives, then SIGKILLs it, so the run row stays 'running' (a crashed run)."""
    child_code = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from test_profiler import run_started, step_events
        from profiler import Recorder
        r = Recorder({url!r}, flush_interval_s=0.05)
        r.emit(run_started("killed"))
        for k in range(3):
            for e in step_events(k):
                r.emit(e)
        r.flush()
        print(r.run_id, flush=True)
        time.sleep(120)
    """)
    with subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=cwd) as child:
        try:
            line = child.stdout.readline()
            assert line.strip(), child.stderr.read()
            yield int(line)
        finally:
            child.send_signal(signal.SIGKILL)  # dies with its run row still 'running'
            child.wait(10)


def record(url, events, **kw) -> Recorder:
    r = Recorder(url, flush_interval_s=kw.pop("flush_interval_s", 0.05), **kw)
    for e in events:
        r.emit(e)
    r.flush()
    r.close()
    return r


# ------------------------------------------------------------------------ schema / migrations
def test_upgrade_creates_all_tables_with_wal(tmp_path):
    url = db_url(tmp_path / "new" / "dir")  # parent folders are created
    assert store.upgrade(url) == store.head_revision() == "0003"
    assert store.current_revision(url) == "0003"
    assert store.upgrade(url) == "0003"  # idempotent
    with sqlite3.connect(tmp_path / "new" / "dir" / "profile.db") as c:
        tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        indexes = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert set(schema.TABLES) | {"alembic_version"} <= tables
    assert {"ix_shard_steps_run_id_step", "ix_shard_steps_run_id_shard_id", "ix_steps_run_id_step",
            "ix_io_samples_run_id_step"} <= indexes
    engine = store.make_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == store.BUSY_TIMEOUT_MS
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        cols = {c["name"] for c in sa.inspect(conn).get_columns("steps")}
        assert {"read_gpu_bytes", "read_cpu_bytes", "read_nvme_bytes", "written_nvme_bytes", "wall_s", "loss"} <= cols
    engine.dispose()


def test_a_profile_of_the_first_schema_upgrades_and_keeps_its_samples(tmp_path):
    """0001 -> 0002 adds io_samples.concurrency, 0003 shard_steps.fetch_overhead_s; the samples
    already there stay, with NULL in the new column."""
    url = db_url(tmp_path)
    assert store.upgrade(url, "0001") == "0001"
    with sqlite3.connect(tmp_path / "profile.db") as c:
        assert "concurrency" not in {r[1] for r in c.execute("PRAGMA table_info(io_samples)")}
        c.execute("INSERT INTO runs (id, name, status, started_at) VALUES (1, 'old', 'finished', 0)")
        c.execute("INSERT INTO io_samples (run_id, step, op, tier, what, bytes, seconds) "
                  "VALUES (1, 3, 'read', 'nvme', 'param', 4096, 0.001)")
    assert store.upgrade(url) == "0003"
    df = queries.io_samples(url, 1)
    assert len(df) == 1 and df["bytes"].iat[0] == 4096 and df["concurrency"].isna().all()
    with sqlite3.connect(tmp_path / "profile.db") as c:
        assert "fetch_overhead_s" in {r[1] for r in c.execute("PRAGMA table_info(shard_steps)")}


def test_migrations_match_schema_module(tmp_path):
    """A database migrated to head has exactly the tables, columns and indexes of profiler.schema."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    url = db_url(tmp_path)
    store.upgrade(url)
    engine = store.make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), schema.metadata)
    engine.dispose()
    assert diff == [], "profiler/schema.py and alembic/versions disagree; add a migration"


def test_migrations_folder_is_found():
    d = store.migrations_dir()
    assert (d / "env.py").is_file() and (d / "versions" / "0001_initial.py").is_file()
    shipped = Path(str(importlib.resources.files("profiler"))) / "_migrations"
    if shipped.is_dir():  # an installed (non-editable) profiler: the packaged copy
        assert d == shipped
    else:  # a checkout or an editable install: the repository's alembic/ folder
        assert d == REPO / "alembic"
    # the top-level alembic/ folder must never become an importable package that shadows Alembic
    assert not (REPO / "alembic" / "__init__.py").exists()
    import alembic

    assert Path(alembic.__file__).parent != REPO / "alembic"


@pytest.mark.slow
def test_wheel_ships_migrations_and_installed_copy_migrates(tmp_path):
    """A non-editable build carries alembic/ as profiler/_migrations, and that copy can migrate."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("pip is not available in this environment: cannot build a wheel")
    # offline with the installed setuptools when it can build wheels by itself (>= 70.1, or with the
    # wheel package); else in pip's isolated build environment, which fetches setuptools
    try:
        import setuptools

        offline = tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1) or bool(importlib.util.find_spec("wheel"))
    except (ImportError, ValueError):
        offline = False
    src = tmp_path / "src"  # what a build reads: pyproject's files and the packages it finds, plus alembic/
    import tomllib

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    tops = {p.split(".")[0].rstrip("*") for p in find.get("include", [])} | {"alembic"}
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.db", "*.db-wal", "*.db-shm")
    src.mkdir()
    for entry in REPO.iterdir():
        if entry.is_dir() and entry.name in tops:
            shutil.copytree(entry, src / entry.name, ignore=skip)
        elif entry.is_file() and entry.name.startswith(("pyproject.toml", "README", "LICENSE", "setup.", "MANIFEST")):
            shutil.copy2(entry, src / entry.name)
    if not (src / "README.md").exists():  # pyproject names it; not ours to write, and not what is tested here
        (src / "README.md").write_text("zinf\n")
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *(["--no-build-isolation"] if offline else []), "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"building the wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = out.glob("zinf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"profiler/_migrations/env.py", "profiler/_migrations/script.py.mako"}
    expected |= {f"profiler/_migrations/versions/{p.name}" for p in (REPO / "alembic" / "versions").glob("*.py")}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert not any(n.startswith("alembic/") for n in names), "a top-level alembic/ would shadow the Alembic library"

    site = tmp_path / "site"  # a pure-Python wheel installed by unpacking it
    zipfile.ZipFile(wheel).extractall(site)
    db = tmp_path / "installed.db"
    code = textwrap.dedent(f"""
        import alembic, importlib.resources, pathlib, profiler
        from profiler import store
        site = pathlib.Path({str(site)!r})
        assert pathlib.Path(profiler.__file__).is_relative_to(site), profiler.__file__
        assert not pathlib.Path(alembic.__file__).is_relative_to(site), alembic.__file__
        d = store.migrations_dir()
        assert d == pathlib.Path(str(importlib.resources.files("profiler"))) / "_migrations", d
        print(store.upgrade("sqlite:///{db}"))
    """)
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == store.head_revision()


# ------------------------------------------------------------------------------- recording
def test_event_stream_exact_counts(tmp_path):
    url = db_url(tmp_path)
    r = record(url, full_stream())
    assert r.dropped == {}
    run_id = r.run_id
    assert run_id == 1
    assert count(url, "runs") == 1
    assert count(url, "shards") == 3
    assert count(url, "steps") == N_STEPS
    assert count(url, "shard_steps") == 3 * N_STEPS
    assert count(url, "io_samples") == 4 * N_STEPS
    assert rows(url, "SELECT DISTINCT step FROM shard_steps ORDER BY step") == [(k,) for k in range(1, N_STEPS + 1)]
    assert rows(url, "SELECT DISTINCT window_steps FROM shard_steps") == [(1,)]
    assert rows(url, "SELECT step, count(*) FROM io_samples GROUP BY step") == [(k, 4) for k in range(1, N_STEPS + 1)]
    recent = queries.io_samples(url, run_id, first_step=N_STEPS - 1)  # what a planner refits from
    assert sorted(set(recent["step"])) == [N_STEPS - 1, N_STEPS] and len(recent) == 8

    runs = queries.list_runs(url)
    assert list(runs["run_id"]) == [1]
    row = runs.iloc[0]
    assert (row["name"], row["status"], row["steps"]) == ("run", "finished", N_STEPS)
    assert row["median_step_s"] == pytest.approx(0.3)
    assert row["started_at"].tzinfo is not None

    st = queries.steps(url, run_id)
    assert list(st["step"]) == list(range(1, N_STEPS + 1))
    assert list(st["loss"]) == pytest.approx([3.0, 2.9, 2.8, 2.7, 2.6])
    assert list(st["read_nvme_bytes"]) == [4200] * N_STEPS
    assert list(st["written_nvme_bytes"]) == [6000] * N_STEPS
    assert set(st["read_gpu_bytes"]) == {0}
    assert {"wall_s", "stall_s", "forward_s", "rss_bytes", "plan_version"} <= set(st.columns)

    stats = queries.shard_access_stats(url, run_id).set_index("name")
    assert list(stats.index) == ["s0", "s1", "s2"]
    assert list(stats["forward_accesses"]) == [5, 5, 5]
    assert list(stats["backward_accesses"]) == [5, 5, 5]
    assert list(stats["recompute_accesses"]) == [5, 0, 0]
    assert list(stats["optimizer_accesses"]) == [5, 5, 5]
    assert list(stats["total_accesses"]) == [20, 15, 15]
    assert list(stats["accesses_per_step"]) == pytest.approx([4.0, 3.0, 3.0])
    assert set(stats["steps"]) == {N_STEPS}
    # s0: three cpu fetches of 100 B per step; optimizer 1000 B read / 2000 B written on nvme
    assert stats.loc["s0", "read_cpu_bytes"] == 1500
    assert stats.loc["s0", "read_nvme_bytes"] == 5000
    assert stats.loc["s0", "written_nvme_bytes"] == 10_000
    assert stats.loc["s2", "read_nvme_bytes"] == 5 * (300 + 300) + 5000
    assert stats.loc["s1", "stall_s_per_step"] == pytest.approx(2 * 0.001)
    assert stats.loc["s0", "fetch_s"] == pytest.approx(5 * 3 * 0.001)
    assert stats.loc["s0", "optimizer_s"] == pytest.approx(5 * 0.06)
    assert list(stats["param_tier"]) == ["cpu", "cpu", "nvme"]
    assert list(stats["optim_tier"]) == ["nvme"] * 3
    assert stats.loc["s1", "module"] == "blocks.1" and stats.loc["s1", "kind"] == "chunk"
    assert stats.loc["s2", "param_bytes"] == 4000

    part = queries.shard_access_stats(url, run_id, first_step=2, last_step=3).set_index("name")
    assert list(part["forward_accesses"]) == [2, 2, 2] and set(part["steps"]) == {2}

    bw = queries.bandwidth_over_time(url, run_id)
    assert len(bw) == N_STEPS and set(bw["tier"]) == {"nvme"}
    assert list(bw["read_GBps"]) == pytest.approx([4096 / 0.002 / 1e9] * N_STEPS)
    assert list(bw["write_GBps"]) == pytest.approx([3 * 8192 / (3 * 0.004) / 1e9] * N_STEPS)
    assert list(bw["write_samples"]) == [3] * N_STEPS

    io = queries.io_samples(url, run_id)
    assert len(io) == 4 * N_STEPS
    assert set(io["shard"]) == {"s0", "s1", "s2"} and set(io["op"]) == {"read", "write"}
    assert set(io["block_size"]) == {1 << 20} and set(io["queue_depth"]) == {8}

    assert queries.latest_run_id(url) == run_id
    info = queries.run_info(url, run_id)
    assert info["status"] == "finished" and info["steps"] == N_STEPS and info["shards"] == 3
    assert info["config"]["train_batch_size"] == 4 and info["model"]["class"] == "GPT"
    # the given bandwidth wins over the one measured from every IoDone of the run; the rest is measured
    assert info["bandwidths"] == {
        "nvme_read_GBps": 2.5, "nvme_read_bytes": N_STEPS * 4096, "nvme_read_s": pytest.approx(N_STEPS * 0.002),
        "nvme_write_bytes": N_STEPS * 3 * 8192, "nvme_write_s": pytest.approx(N_STEPS * 3 * 0.004),
        "nvme_write_GBps": pytest.approx(8192 / 0.004 / 1e9)}
    assert info["o_direct"] is True and info["swap_dir"] == "/tmp/swap"
    assert info["pid"] == os.getpid() and info["dropped_events"] == {}
    assert info["finished_at"] >= info["started_at"]


def test_window_steps_aggregates(tmp_path):
    url = db_url(tmp_path)
    r = record(url, full_stream(), window_steps=2)
    # windows start at steps 1, 3 and 5; the last holds one step (the run ended)
    assert rows(url, "SELECT step, window_steps, count(*) FROM shard_steps GROUP BY step, window_steps ORDER BY step") == [
        (1, 2, 3), (3, 2, 3), (5, 1, 3)]
    assert count(url, "steps") == N_STEPS  # steps are never windowed
    assert rows(url, "SELECT forward_accesses, recompute_accesses, read_cpu_bytes FROM shard_steps s "
                     "JOIN shards h ON h.id = s.shard_id WHERE h.name = 's0' ORDER BY step") == [(2, 2, 600), (2, 2, 600), (1, 1, 300)]
    stats = queries.shard_access_stats(url, r.run_id).set_index("name")
    assert list(stats["total_accesses"]) == [20, 15, 15]
    assert list(stats["accesses_per_step"]) == pytest.approx([4.0, 3.0, 3.0])
    assert stats.loc["s0", "read_cpu_bytes"] == 1500
    # a range selects whole windows by their first step and divides by the steps they cover
    part = queries.shard_access_stats(url, r.run_id, first_step=3, last_step=3).set_index("name")
    assert list(part["forward_accesses"]) == [2, 2, 2] and set(part["steps"]) == {2}


def test_detail_step_records_steps_only(tmp_path):
    url = db_url(tmp_path)
    r = record(url, full_stream(), detail="step")
    assert count(url, "steps") == N_STEPS
    assert count(url, "shard_steps") == 0 and count(url, "io_samples") == 0
    assert r.dropped == {}
    assert queries.shard_access_stats(url, r.run_id)["total_accesses"].sum() == 0


def test_events_after_last_step_and_close_without_finish(tmp_path):
    url = db_url(tmp_path)
    events = full_stream(2)[:-1]  # no RunFinished
    events += [ev.ShardFetched(2, 2, "s0", "forward", "cpu", 100, 0.001, 0.001),
               ev.IoDone("write", "nvme", "param", "s1", 100, 0.001, True, 4096, 1, 1)]
    r = record(url, events)
    info = queries.run_info(url, r.run_id)
    assert info["recorded_status"] == "crashed" and info["status"] == "crashed"  # closed without RunFinished
    assert info["dropped_events"] == {"unattributed": 1}
    assert count(url, "shard_steps") == 3 * 2
    assert rows(url, "SELECT step FROM io_samples WHERE shard_id = (SELECT id FROM shards WHERE name='s1') AND op='write' "
                     "AND bytes = 100") == [(3,)]
    r.emit(ev.StepFinished(9, 1, 0.1, 0, 0, 0, 0, 0, None))  # after close: ignored, no error
    assert count(url, "steps") == 2


def test_io_samples_subsampled_beyond_cap(tmp_path):
    url = db_url(tmp_path)
    events = [run_started()] + [ev.IoDone("read", "nvme", "param", "s2", 1000, 0.001, True, 4096, 1, 1)] * 50
    events += [ev.StepFinished(1, 1, 0.1, 0, 0, 0, 0, 0, 1.0), ev.RunFinished("finished", 1, time.time())]
    r = record(url, events, io_samples_per_step=10)
    assert count(url, "io_samples") == 10
    info = queries.run_info(url, r.run_id)
    assert info["dropped_events"] == {"IoDone:subsampled": 40}
    assert info["bandwidths"]["nvme_read_bytes"] == 50 * 1000  # measured from every sample, kept or not
    assert info["bandwidths"]["nvme_read_s"] == pytest.approx(50 * 0.001)


def test_an_io_batch_is_recorded_as_its_requests(tmp_path):
    """The engine sends a step's I/O as one IoBatch: the same rows, totals and subsampling as
    one IoDone per request."""
    rows_ = tuple(("read", "param", "s2", 1000 + i, 0.001, 1.0) for i in range(30))
    rows_ += tuple(("write", "master", "s1", 2000, 0.002, 2.0) for _ in range(20))
    batch = ev.IoBatch(rows_, "nvme", True, 4096, 1, 1)
    assert [e.bytes for e in batch.items()][:2] == [1000, 1001] and batch.items()[-1].concurrency == 2.0
    done = [run_started(), ev.StepFinished(1, 1, 0.1, 0, 0, 0, 0, 0, 1.0), ev.RunFinished("finished", 1, time.time())]
    url_batch, url_single = db_url(tmp_path / "b"), db_url(tmp_path / "s")
    (tmp_path / "b").mkdir(), (tmp_path / "s").mkdir()
    record(url_batch, done[:1] + [batch] + done[1:], io_samples_per_step=10)
    record(url_single, done[:1] + batch.items() + done[1:], io_samples_per_step=10)
    for url in (url_batch, url_single):
        assert count(url, "io_samples") == 10
        info = queries.run_info(url, 1)
        assert info["dropped_events"] == {"IoDone:subsampled": 40}
        assert info["bandwidths"]["nvme_read_bytes"] == sum(1000 + i for i in range(30))
        assert info["bandwidths"]["nvme_write_bytes"] == 20 * 2000
    # a batch that cannot be recorded counts as the requests it carries
    r = Recorder(db_url(tmp_path), flush_interval_s=0.05)
    r.emit(batch)  # no run open
    r.close()
    assert r.dropped == {"no_run:IoDone": 50}


def test_shard_transfers_and_given_bandwidths(tmp_path):
    url = db_url(tmp_path)
    r = Recorder(url, flush_interval_s=0.05)
    r.emit(ev.RunStarted("run", {}, {}, {"cpu": "test"}, SHARDS, None, True, time.time()))
    r.emit(ev.ShardTransfer(0, "s1", "grad", "write", "nvme", 2000, 0.0))
    r.emit(ev.ShardTransfer(0, "s1", "grad", "read", "nvme", 2000, 0.003))
    r.emit(ev.ShardTransfer(0, "s2", "param", "write", "nvme", 4000, 0.0))
    r.emit(ev.IoDone("write", "nvme", "grad", "s1", 2000, 0.001, True, 4096, 1, 1))
    r.emit(ev.StepFinished(1, 2, 0.1, 0, 0, 0, 0.003, 0, 1.0))
    r.record_bandwidths({"nvme_write_GBps": 1.5, "source": "bench-io"})
    r.emit(ev.RunFinished("finished", 1, time.time()))
    r.close()
    assert rows(url, "SELECT s.name, read_nvme_bytes, written_nvme_bytes, stall_s, forward_accesses FROM shard_steps "
                     "JOIN shards s ON s.id = shard_id ORDER BY s.name") == [("s1", 2000, 2000, 0.003, 0), ("s2", 0, 4000, 0.0, 0)]
    assert queries.run_info(url, r.run_id)["bandwidths"] == {
        "nvme_write_bytes": 2000, "nvme_write_s": 0.001, "nvme_write_GBps": 1.5, "source": "bench-io"}


def test_queue_overflow_drops_detail_first_and_counts(tmp_path):
    url = db_url(tmp_path)
    r = Recorder(url, queue_max=5, flush_interval_s=0.0, essential_wait_s=0.01)
    r.emit(run_started())
    run_id = r.wait_run_id(10)
    blocker = sqlite3.connect(tmp_path / "profile.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # holds the write lock: the writer blocks on its next write
    try:
        r.emit(ev.StepFinished(1, 1, 0.1, 0, 0, 0, 0, 0, 1.0))
        deadline = time.monotonic() + 5
        while r._q.qsize() and time.monotonic() < deadline:  # the writer took it and is now waiting for the lock
            time.sleep(0.01)
        time.sleep(0.2)
        slowest = 0.0
        for _ in range(50):
            t0 = time.perf_counter()
            r.emit(ev.ShardFetched(1, 1, "s0", "forward", "cpu", 100, 0.001, 0.001))
            slowest = max(slowest, time.perf_counter() - t0)
        assert r.dropped == {"ShardFetched": 45}
        assert slowest < 0.05, "emit must not block the training thread"
        # per-step events still fit into the reserve above queue_max, then they are dropped too
        reserve = r._q.maxsize - 5
        for i in range(reserve + 3):
            r.emit(ev.StepFinished(2 + i, 1, 0.1, 0, 0, 0, 0, 0, 1.0))
        assert r.dropped == {"ShardFetched": 45, "StepFinished": 3}
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    r.flush()
    r.emit(ev.RunFinished("finished", 1, time.time()))
    r.close()
    assert count(url, "steps") == 1 + reserve
    assert rows(url, "SELECT step, forward_accesses FROM shard_steps") == [(2, 5)]
    info = queries.run_info(url, run_id)
    assert info["dropped_events"] == {"ShardFetched": 45, "StepFinished": 3}
    assert info["status"] == "finished"


def test_failed_writes_are_kept_and_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "BUSY_TIMEOUT_MS", 100)
    url = db_url(tmp_path)
    r = Recorder(url, flush_interval_s=0.0)
    r.emit(run_started())
    r.wait_run_id(10)
    blocker = sqlite3.connect(tmp_path / "profile.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        for e in step_events(0):
            r.emit(e)
        with pytest.raises(ProfileError, match="locked"):
            r.flush(timeout=10)
        assert "locked" in r.last_error
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    r.flush(timeout=10)  # the rows were kept and go in now
    r.close()
    assert count(url, "steps") == 1 and count(url, "shard_steps") == 3 and count(url, "io_samples") == 4
    assert r.dropped == {}


def test_heartbeat_idle_cost_and_runs_in_one_recorder(tmp_path):
    import resource

    url = db_url(tmp_path)
    r = Recorder(url, flush_interval_s=0.02, heartbeat_s=0.1)
    r.emit(run_started("first"))
    first = r.wait_run_id(10)
    beat = lambda rid: rows(url, f"SELECT last_heartbeat FROM runs WHERE id = {rid}")[0][0]  # noqa: E731
    b0 = beat(first)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    time.sleep(0.3)
    assert beat(first) > b0  # heartbeats while the run is open, with no events
    r.emit(run_started("second"))  # a new run without RunFinished: the first one is over
    second = r.wait_run_id(10)
    assert second == first + 1
    r.emit(ev.RunFinished("finished", 0, time.time()))
    r.flush()
    time.sleep(0.3)  # nothing to do now: the writer must sleep, not spin
    assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu0 < 0.3
    r.close()
    assert rows(url, "SELECT name, status FROM runs ORDER BY id") == [("first", "crashed"), ("second", "finished")]


def test_emit_is_cheap(tmp_path):
    url = db_url(tmp_path)
    r = Recorder(url, queue_max=100_000)
    r.emit(run_started())
    e = ev.ShardFetched(0, 0, "s0", "forward", "cpu", 100, 0.001, 0.001)
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        r.emit(e)
    per_emit = (time.perf_counter() - t0) / n
    r.emit(ev.StepFinished(1, 1, 0.1, 0, 0, 0, 0, 0, 1.0))
    r.emit(ev.RunFinished("finished", 1, time.time()))
    r.close()
    assert r.dropped == {}
    assert per_emit < 50e-6, f"emit took {per_emit * 1e6:.1f} us"
    assert rows(url, "SELECT forward_accesses FROM shard_steps") == [(n,)]


def test_reader_reads_while_recorder_writes(tmp_path):
    url = db_url(tmp_path)
    r = Recorder(url, flush_interval_s=0.01)
    r.emit(run_started())
    run_id = r.wait_run_id(10)
    reader = store.open_readonly(url)
    with reader.connect() as conn:
        conn.begin()  # a long read transaction: in WAL it neither blocks the writer nor sees its later commits
        before = conn.execute(sa.text("SELECT count(*) FROM steps")).scalar()
        stop = threading.Event()
        seen: list[int] = []

        def poll():  # another reader, polling through the query API while steps are written
            while not stop.is_set():
                seen.append(len(queries.steps(reader, run_id)))
                time.sleep(0.005)

        t = threading.Thread(target=poll)
        t.start()
        try:
            for k in range(20):
                for e in step_events(k):
                    r.emit(e)
                time.sleep(0.002)
            t0 = time.monotonic()
            r.flush(timeout=10)
            assert time.monotonic() - t0 < 5
        finally:
            stop.set()
            t.join()
        assert conn.execute(sa.text("SELECT count(*) FROM steps")).scalar() == before == 0
        conn.rollback()
        assert conn.execute(sa.text("SELECT count(*) FROM steps")).scalar() == 20
    with pytest.raises(sa.exc.OperationalError):  # the reader is read-only
        with reader.begin() as c:
            c.execute(sa.text("DELETE FROM steps"))
    reader.dispose()
    r.close()
    assert seen and seen == sorted(seen) and seen[-1] <= 20
    assert queries.list_runs(url)["status"].tolist() == ["crashed"]  # closed without RunFinished


@pytest.mark.slow
def test_two_runs_with_a_crashed_one(tmp_path):
    url = db_url(tmp_path)
    record(url, full_stream(2, name="good"))
    with live_child_run(url, tmp_path) as child_run:
        assert queries.list_runs(url).set_index("run_id").loc[child_run, "status"] == "running"  # alive
    assert queries.run_info(url, child_run)["recorded_status"] == "running"
    with Recorder(url) as third:  # a live run in this process
        third.emit(run_started("live"))
        live_id = third.wait_run_id(10)
        runs = queries.list_runs(url).set_index("run_id")
        assert list(runs.index) == [1, child_run, live_id] == [1, 2, 3]
        assert runs["name"].tolist() == ["good", "killed", "live"]
        assert runs["status"].tolist() == ["finished", "crashed", "running"]
        assert runs["recorded_status"].tolist() == ["finished", "running", "running"]
        assert runs["steps"].tolist() == [2, 3, 0]
        assert runs.loc[child_run, "median_step_s"] == pytest.approx(0.2)
        assert queries.run_info(url, child_run)["status"] == "crashed"
        assert queries.latest_run_id(url) == live_id


def test_effective_status_by_heartbeat():
    now = 1_000_000.0
    other = dict(hostname="elsewhere", pid=123, pid_start_ticks=None, started_at=now - 500, now=now, stale_after_s=60)
    assert queries.effective_status("running", last_heartbeat=now - 5, **other) == "running"
    assert queries.effective_status("running", last_heartbeat=now - 120, **other) == "crashed"
    assert queries.effective_status("finished", last_heartbeat=now - 1e6, **other) == "finished"
    here = dict(hostname=socket.gethostname(), pid_start_ticks=None, started_at=now, last_heartbeat=now, now=now)
    assert queries.effective_status("running", pid=os.getpid(), **here) == "running"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert queries.effective_status("running", pid=dead.pid, **here) == "crashed"
    # same pid, but another process started since (pid reuse): its start time differs
    mine = store.pid_start_ticks(os.getpid())
    if mine is not None:
        assert queries.effective_status("running", pid=os.getpid(), **{**here, "pid_start_ticks": mine + 1}) == "crashed"


def test_plans_migrations_trials_calibrations(tmp_path):
    url = db_url(tmp_path)
    r = Recorder(url, flush_interval_s=0.05)
    r.emit(run_started())
    for e in step_events(0):
        r.emit(e)
    r.record_plan(1, [{"shard": "s0", "param_tier": "gpu", "optim_tier": "cpu", "score": 2.5}, ("s2", "cpu", "nvme")],
                  policy="greedy", created_step=1, dram_budget_bytes=1 << 30, predicted_step_s=0.08,
                  predicted_gain_s=0.02, adopted=True, reason={"why": "s0 is hot"})
    r.emit(ev.ShardMigrated(1, "s0", "param", "cpu", "gpu", 2000, 0.001))
    r.emit(ev.ShardMigrated(1, "s0", "optim", "nvme", "cpu", 12000, 0.01))
    for e in step_events(1):
        r.emit(e)
    r.record_tuning_trial({"block_size": 1 << 20, "queue_depth": 8}, 0.12, chosen=True, step=0)
    r.record_calibration([{"path": "/nvme", "op": "read", "fstype": "ext4", "block_size": 1 << 20, "queue_depth": 8,
                           "thread_count": 1, "bytes": 1 << 30, "seconds": 0.5, "source": "recorder"}])
    r.emit(ev.RunFinished("finished", 2, time.time()))
    r.close()
    assert record_calibration(url, [{"path": "/nvme", "op": "write", "GBps": 1.5, "raw_baseline_GBps": 1.8,
                                     "source": "bench-io", "created_at": time.time() + 10}]) == 1

    p = queries.plans(url, r.run_id)
    assert p[["version", "policy", "adopted", "assignments"]].values.tolist() == [[1, "greedy", True, 2]]
    assert p.loc[0, "reason"] == {"why": "s0 is hot"}
    a = queries.plan_assignments(url, int(p.loc[0, "plan_id"]))
    assert a[["shard", "param_tier", "optim_tier"]].values.tolist() == [["s0", "gpu", "cpu"], ["s2", "cpu", "nvme"]]
    assert a["score"].tolist()[0] == 2.5
    m = queries.migrations(url, r.run_id)
    assert m[["step", "plan_version", "shard", "state", "src_tier", "dst_tier"]].values.tolist() == [
        [1, 1, "s0", "param", "cpu", "gpu"], [1, 1, "s0", "optim", "nvme", "cpu"]]
    tt = queries.tuning_trials(url, r.run_id)
    assert tt[["setting", "step_s", "chosen"]].values.tolist() == [[{"block_size": 1 << 20, "queue_depth": 8}, 0.12, True]]
    cal = queries.calibrations(url, "/nvme")
    assert cal["op"].tolist() == ["write", "read"]  # newest first
    assert cal["GBps"].tolist() == pytest.approx([1.5, (1 << 30) / 0.5 / 1e9])


def test_a_migration_between_steps_relabels_the_next_steps_rows_not_the_one_it_followed(tmp_path):
    """The planner migrates after a step's work but before its StepFinished: that step's row keeps
    the tiers its accesses ran on (a DRAM param's row labelled NVMe made the planner read its
    optimizer reads as NVMe param fetches), and the rows after it get the new ones; a migration
    made after a StepFinished (by hand, between steps) labels the next step's row."""
    url = db_url(tmp_path)
    r = Recorder(url, flush_interval_s=0.05)
    r.emit(run_started())

    def step(k: int, migrate: list = ()) -> None:  # s2 touched only by a gradient write: no event names its tier
        r.emit(ev.ShardFetched(k, k, "s0", "forward", "cpu", 100, 0.001, 0.0005))
        r.emit(ev.ShardTransfer(k, "s2", "grad", "write", "nvme", 800, 0.0))
        for m in migrate:
            r.emit(m)
        r.emit(ev.StepFinished(k + 1, 1, 0.1, 0.03, 0.04, 0.02, 0.005, 0.0, 1.0, {"cpu": 100}, {"nvme": 800}))

    step(0, [ev.ShardMigrated(1, "s2", "param", "nvme", "cpu", 8000, 0.01)])  # the planner's, inside step 1
    step(1)
    r.emit(ev.ShardMigrated(2, "s2", "optim", "nvme", "cpu", 48000, 0.01))  # after step 2's StepFinished
    step(2)
    r.emit(ev.RunFinished("finished", 3, time.time()))
    r.close()
    got = rows(url, "SELECT ss.step, ss.param_tier, ss.optim_tier FROM shard_steps ss JOIN shards s ON s.id = ss.shard_id "
                    "WHERE s.name = 's2' ORDER BY ss.step")
    assert got == [(1, "nvme", "nvme"), (2, "cpu", "nvme"), (3, "cpu", "cpu")]


# ---------------------------------------------------------------------------------- errors
def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def test_profile_errors(tmp_path):
    # a directory
    with pytest.raises(ProfileError) as e:
        store.upgrade(f"sqlite:///{tmp_path}")
    assert "directory" in one_line(e) and str(tmp_path) in str(e.value) and "zinf-profile.db" in str(e.value)
    with pytest.raises(ProfileError):
        Recorder(f"sqlite:///{tmp_path}")
    # a file that is not a database
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a sqlite database at all" * 100)
    for call in (lambda: store.upgrade(f"sqlite:///{junk}"), lambda: queries.list_runs(f"sqlite:///{junk}"),
                 lambda: store.open_readonly(f"sqlite:///{junk}")):
        with pytest.raises(ProfileError) as e:
            call()
        assert "not a SQLite database" in one_line(e) and str(junk) in str(e.value)
    # unreachable: a folder that cannot be created, a server that does not answer or whose driver is missing
    with pytest.raises(ProfileError) as e:
        store.upgrade("sqlite:////proc/zinf-no/such/dir/p.db")
    assert "/proc/zinf-no" in one_line(e)
    with pytest.raises(ProfileError) as e:
        store.make_engine("postgresql://user:s3cret@127.0.0.1:1/zinf")
    msg = one_line(e)
    assert "127.0.0.1" in msg and "s3cret" not in msg
    with pytest.raises(ProfileError) as e:
        store.make_engine("not a url")
    assert "sqlite:///" in one_line(e)
    # reading what is not there
    with pytest.raises(ProfileError) as e:
        queries.list_runs(f"sqlite:///{tmp_path / 'missing.db'}")
    assert "zinf db upgrade" in one_line(e)
    assert not (tmp_path / "missing.db").exists()
    assert store.current_revision(f"sqlite:///{tmp_path / 'missing.db'}") is None
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    with pytest.raises(ProfileError) as e:
        queries.list_runs(f"sqlite:///{empty}")
    assert "zinf db upgrade" in one_line(e)
    # unknown run ids
    url = db_url(tmp_path)
    record(url, full_stream(1))
    for call in (queries.run_info, queries.steps, queries.shard_access_stats, queries.bandwidth_over_time, queries.io_samples):
        with pytest.raises(ProfileError) as e:
            call(url, 99)
        assert one_line(e) == f"unknown run id 99 in {url}; known: 1"
    # a database from a newer schema than this zinf knows
    newer = db_url(tmp_path, "newer.db")
    store.upgrade(newer)
    with sqlite3.connect(tmp_path / "newer.db") as c:
        c.execute("UPDATE alembic_version SET version_num = 'ffff_future'")
    with pytest.raises(ProfileError) as e:
        Recorder(newer)
    assert "newer zinf" in one_line(e) and "newer.db" in str(e.value)
    # bad recorder settings
    with pytest.raises(Exception, match="detail"):
        Recorder(url, detail="everything")


def test_package_exports():
    assert profiler.Recorder is Recorder and profiler.queries is queries
    assert callable(profiler.upgrade) and callable(profiler.record_calibration)
    assert isinstance(Recorder.__new__(Recorder), ev.Recorder)  # the engine's protocol: enabled, emit, close
    assert Recorder.enabled is True


def test_event_buffer_wakes_the_writer_only_when_asked_or_filling():
    from profiler.recorder import _EventBuffer

    b = _EventBuffer(4, wake_at=3)
    b.put_nowait("detail-1", wake=False)
    b.put_nowait("detail-2", wake=False)
    assert not b._ready.is_set(), "a detail event must not wake the writer"
    b.put_nowait("detail-3", wake=False)
    assert b._ready.is_set(), "a buffer filled to wake_at must wake the writer"
    b._ready.clear()
    b.put_nowait("step")
    assert b._ready.is_set()
    with pytest.raises(queue.Full):
        b.put_nowait("one too many", wake=False)
    t0 = time.monotonic()
    with pytest.raises(queue.Full):
        b.put("essential", timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    assert [b.get(timeout=0) for _ in range(4)] == ["detail-1", "detail-2", "detail-3", "step"]
    with pytest.raises(queue.Empty):
        b.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        b.get_nowait()


# ------------------------------------------------------------------------ sampled shard detail
def test_sampled_shard_detail_rows_stand_for_the_steps_since_the_last_sample(tmp_path):
    """One step in k: the sampled step's row spans the steps since the previous sample (counts x
    span), unsampled steps' detail events are ignored, and a smaller k takes effect with the next
    step without overlapping or leaving a gap."""
    url = db_url(tmp_path)
    r = Recorder(url, flush_interval_s=0.05)
    r.emit(run_started())
    sampled = []
    for k in range(9):  # rows 1..9
        if k == 1:
            assert r.set_shard_detail_every(3) == 3  # during step 2 (a step hook): from step 3 on
        if k == 5:
            r.set_shard_detail_every(1)  # during step 6, not sampled: step 7 is, standing for 6-7
        sampled.append(r.shard_detail_now)
        for e in step_events(k):  # a recorder user that ignores shard_detail_now: filtered here
            r.emit(e)
    r.emit(ev.RunFinished("finished", 9, time.time()))
    r.flush()
    r.close()
    assert sampled == [True, True, False, False, True, False, True, True, True]
    assert rows(url, "SELECT step, window_steps, count(*) FROM shard_steps GROUP BY step, window_steps ORDER BY step") == [
        (1, 1, 3), (2, 1, 3), (3, 3, 3), (6, 2, 3), (8, 1, 3), (9, 1, 3)]  # steps 1-9, each once
    assert rows(url, "SELECT forward_accesses, read_cpu_bytes FROM shard_steps s JOIN shards h ON h.id = s.shard_id "
                     "WHERE h.name = 's0' ORDER BY step") == [(1, 300), (1, 300), (3, 900), (2, 600), (1, 300), (1, 300)]
    assert count(url, "steps") == 9  # every step's own row
    assert [s for (s,) in rows(url, "SELECT DISTINCT step FROM io_samples ORDER BY step")] == [1, 2, 5, 7, 8, 9]
    stats = queries.shard_access_stats(url, r.run_id).set_index("name")
    assert list(stats["accesses_per_step"]) == pytest.approx([4.0, 3.0, 3.0])  # as recorded every step
    assert set(stats["steps"]) == {9}
    # a reader of a step range gets the rows that reach into it only when it asks (covering)
    assert list(queries.shard_steps(url, r.run_id, first_step=4, last_step=9)["step"].unique()) == [6, 8, 9]
    assert list(queries.shard_steps(url, r.run_id, first_step=4, last_step=9, covering=True)["step"].unique()) == [3, 6, 8, 9]
    assert r.dropped == {}


def test_shard_detail_sampling_needs_single_step_windows(tmp_path):
    r = Recorder(db_url(tmp_path), window_steps=2)
    try:
        assert r.set_shard_detail_every(4) == 1 and r.shard_detail_every == 1
    finally:
        r.close()
    r = Recorder(db_url(tmp_path, "b.db"), detail="step")
    try:
        assert r.set_shard_detail_every(4) == 1 and not r.shard_detail_now
    finally:
        r.close()
