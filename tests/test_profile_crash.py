"""A training process killed with SIGKILL leaves a sound profile database.

A real training run (``zinf.initialize`` with the profiler on, params and optimizer state on NVMe)
runs in a child process and prints each optimizer step as it ends. The test polls the database
read-only until steps are flushed, kills the child, then checks: the file passes
``PRAGMA integrity_check``; every row seen before the kill is still there with the same values;
every step that ended longer ago than the recorder's documented bound (``flush_interval_s`` plus
the time of one write) is stored; the run reads as not finished; a new run can be recorded after.
"""

from __future__ import annotations

import inspect
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

import zinf
from zinf.models import build_model
from zinf.models.data import TokenBatches, markov_tokens

from profiler import queries
from profiler.recorder import Recorder

REPO = Path(__file__).resolve().parent.parent
MIN_FLUSHED_STEPS = 5
TRAIN_AT_LEAST_S = 3.0  # before the kill, so that some steps are older than the loss bound
WRITE_SLACK_S = 2.0  # one batch write on a busy 2-core machine, on top of flush_interval_s
RECORDER_DEFAULTS = {k: p.default for k, p in inspect.signature(Recorder).parameters.items()}

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    import torch, zinf
    from zinf.models import build_model
    from zinf.models.data import TokenBatches, markov_tokens

    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny", n_layer=2, block_size=32)
    config = {config!r}
    batches = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=0), 2, 32, seed=0)
    engine = zinf.initialize(model, config)
    for i in range(100_000):
        x, y = batches.get(i)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        print(engine.global_steps, time.time(), flush=True)  # step ended (its StepFinished is emitted)
""")


def train_config(url: str, nvme: Path, run_name: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
        "zinf": {"device": "cpu", "chunk_size": "64KiB", "shard_min_bytes": "16KiB", "run_name": run_name,
                 "profiler": {"enabled": True, "db": url}},
    }


def read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)


def snapshot(path: Path, run_id: int = 1) -> tuple[dict[int, tuple], dict[tuple[int, int], tuple]]:
    """One run's steps rows by step and shard_steps rows by (step, shard_id), as stored now."""
    with read_only(path) as c:
        # one read transaction: both tables as of one commit (two bare SELECTs can straddle a
        # flush and see shard rows of steps whose steps rows they missed)
        c.execute("BEGIN")
        steps = {r[0]: r for r in c.execute("SELECT step, * FROM steps WHERE run_id = ? ORDER BY id", (run_id,))}
        shard_steps = {(r[0], r[1]): r for r in c.execute(
            "SELECT step, shard_id, * FROM shard_steps WHERE run_id = ? ORDER BY id", (run_id,))}
        c.rollback()
    return steps, shard_steps


def test_sigkill_mid_run_keeps_every_flushed_step(tmp_path):
    db = tmp_path / "profile.db"
    url = f"sqlite:///{db}"
    code = CHILD.format(repo=str(REPO), config=train_config(url, tmp_path / "nvme", "killed"))
    ended: list[tuple[int, float]] = []  # (step, time it ended) as the child printed them

    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=tmp_path) as child:
        reader = threading.Thread(target=lambda: ended.extend((int(a), float(b)) for a, b in
                                                              (line.split() for line in child.stdout)), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 90
            seen_steps: dict = {}
            while time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.1)
                if not db.exists():
                    continue
                try:
                    seen_steps, seen_shards = snapshot(db)
                except sqlite3.OperationalError:  # not created or migrated yet
                    continue
                if len(seen_steps) >= MIN_FLUSHED_STEPS and ended and time.time() - ended[0][1] >= TRAIN_AT_LEAST_S:
                    break
            assert child.poll() is None, f"the training process ended early: {child.stderr.read()[-3000:]}"
            assert len(seen_steps) >= MIN_FLUSHED_STEPS, "no steps flushed in 90 s"
        finally:
            child.send_signal(signal.SIGKILL)
            killed_at = time.time()
            child.wait(10)
        reader.join(10)
    assert child.returncode == -signal.SIGKILL

    # the file is sound and opens for reading and writing
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert c.execute("PRAGMA foreign_key_check").fetchall() == []
    after_steps, after_shards = snapshot(db)

    # what the test saw before the kill is there, unchanged (a step's shard rows came with it)
    assert {s: after_steps[s] for s in seen_steps} == seen_steps
    assert {k: after_shards[k] for k in seen_shards} == seen_shards
    assert {s for s, _ in seen_shards} == set(seen_steps)

    # what may be lost: only steps that ended within flush_interval_s (+ one write) of the kill
    stored = sorted(after_steps)
    assert stored == list(range(1, len(stored) + 1))  # no hole
    printed = [s for s, _ in ended]
    assert printed == list(range(1, len(printed) + 1))
    assert stored[-1] <= printed[-1] + 1  # a step may be stored before the child got to print it
    bound_s = RECORDER_DEFAULTS["flush_interval_s"] + WRITE_SLACK_S
    old_enough = [s for s, t in ended if t < killed_at - bound_s]
    assert old_enough, "the child did not train long enough for the bound to mean anything"
    assert set(old_enough) <= set(stored), f"lost steps {sorted(set(old_enough) - set(stored))} older than {bound_s} s"
    per_step = {s: sum(1 for k in after_shards if k[0] == s) for s in stored}
    assert len(set(per_step.values())) == 1, per_step  # every stored step has all of its shard rows

    # not finished: the row still says running; the dead pid makes it crashed on this host
    runs = queries.list_runs(url)
    assert runs[["name", "recorded_status", "status"]].values.tolist() == [["killed", "running", "crashed"]]
    assert runs["finished_at"].isna().all()
    info = queries.run_info(url, int(runs["run_id"][0]))
    assert info["steps"] == len(stored)
    # from another host only the heartbeat tells: running until it is stale_after_s old, then crashed
    beat = info["last_heartbeat"]
    assert killed_at - beat <= RECORDER_DEFAULTS["heartbeat_s"] + WRITE_SLACK_S
    status = lambda now: queries.effective_status(  # noqa: E731
        "running", hostname=info["hostname"], pid=info["pid"], pid_start_ticks=info["pid_start_ticks"],
        last_heartbeat=beat, started_at=info["started_at"], now=now, stale_after_s=60,
        this_host="not-" + socket.gethostname())
    assert status(beat + 59) == "running" and status(beat + 61) == "crashed"

    # the same database records the next run
    torch.manual_seed(0)
    model, cfg = build_model("gpt", "tiny", n_layer=2, block_size=32)
    batches = TokenBatches(markov_tokens(cfg.vocab_size, 20_000, seed=0), 2, 32, seed=0)
    config = train_config(url, tmp_path / "nvme2", "second")
    config["zinf"]["profiler"].update(flush_interval_s=0.2, heartbeat_s=1.5)
    with zinf.initialize(model, config) as engine:
        assert (engine.recorder.flush_interval_s, engine.recorder.heartbeat_s) == (0.2, 1.5)  # config reaches it
        for i in range(3):
            x, y = batches.get(i)
            engine.backward(engine(x, y))
            engine.step()
    runs = queries.list_runs(url)
    assert runs[["run_id", "name", "status", "steps"]].values.tolist() == [
        [1, "killed", "crashed", len(stored)], [2, "second", "finished", 3]]
    assert snapshot(db, 1) == (after_steps, after_shards)  # the killed run's rows are untouched
    assert len(snapshot(db, 2)[0]) == 3
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
