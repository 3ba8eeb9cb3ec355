"""The profile database's tables, as SQLAlchemy Core metadata.

This module describes the schema for the code that reads and writes it; the database itself is
created and changed only by the Alembic migrations in the top-level ``alembic/`` folder (shipped
inside the package as ``profiler/_migrations``). ``tests/test_profiler.py`` checks that a database
migrated to head matches this metadata, so a change here needs a new migration
(``alembic revision --autogenerate -m "..."`` from the repository root, see ``alembic.ini``).

Conventions: times are seconds (``_s``) or Unix epoch seconds (``_at``, ``last_heartbeat``); sizes
are bytes (``_bytes``); tiers are ``"gpu"``, ``"cpu"`` (DRAM), ``"nvme"`` (or ``"none"`` for the
optimizer state of a frozen shard). Per-tier byte counts are columns ``read_<tier>_bytes`` and
``written_<tier>_bytes``.
"""

from __future__ import annotations

import sqlalchemy as sa

TIERS = ("gpu", "cpu", "nvme")
RUN_STATUSES = ("running", "finished", "crashed")

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING)


# Row ids of the high-volume tables: 64-bit where the database has it (SQLite's INTEGER PRIMARY KEY
# is already 64-bit and must stay spelled INTEGER to be the rowid).
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _tier_bytes(prefix: str) -> list[sa.Column]:
    return [sa.Column(f"{prefix}_{t}_bytes", sa.BigInteger, nullable=False, server_default="0") for t in TIERS]


def _run_fk(nullable: bool = False) -> sa.Column:
    return sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=nullable)


def _shard_fk(nullable: bool = False) -> sa.Column:
    return sa.Column("shard_id", sa.Integer, sa.ForeignKey("shards.id", ondelete="CASCADE"), nullable=nullable)


runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("status", sa.String(16), nullable=False, server_default="running"),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float),
    sa.Column("last_heartbeat", sa.Float),
    sa.Column("config", sa.JSON),
    sa.Column("model", sa.JSON),
    sa.Column("hardware", sa.JSON),
    sa.Column("bandwidths", sa.JSON),  # measured bandwidths (bench-io / startup probe), GB/s by tier/op
    sa.Column("swap_dir", sa.Text),
    sa.Column("o_direct", sa.Boolean),
    sa.Column("hostname", sa.String(255)),
    sa.Column("pid", sa.Integer),
    sa.Column("pid_start_ticks", sa.BigInteger),  # /proc/<pid>/stat start time, against pid reuse
    sa.Column("detail", sa.String(16)),  # the recorder's detail level: "step" or "shard"
    sa.Column("window_steps", sa.Integer),
    sa.Column("dropped_events", sa.JSON),  # {"ShardFetched": n, ...}: events the recorder dropped
    sa.CheckConstraint("status IN ('running', 'finished', 'crashed')", name="status"),
)
sa.Index(None, runs.c.status)

shards = sa.Table(
    "shards",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    _run_fk(),
    sa.Column("shard_index", sa.Integer, nullable=False),  # position in RunStarted.shards
    sa.Column("name", sa.String(500), nullable=False),
    sa.Column("module", sa.String(500), nullable=False, server_default=""),
    sa.Column("kind", sa.String(16), nullable=False),  # param, chunk, embedding, expert, frozen
    sa.Column("numel", sa.BigInteger, nullable=False),
    sa.Column("param_bytes", sa.BigInteger, nullable=False),
    sa.Column("optim_bytes", sa.BigInteger, nullable=False),
    sa.Column("grad_bytes", sa.BigInteger, nullable=False),
    sa.Column("members", sa.JSON),
    sa.Column("param_tier", sa.String(8), nullable=False),  # at the start of the run
    sa.Column("optim_tier", sa.String(8), nullable=False),
    sa.UniqueConstraint("run_id", "shard_index"),
    sa.UniqueConstraint("run_id", "name"),
)

steps = sa.Table(
    "steps",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    _run_fk(),
    sa.Column("step", sa.Integer, nullable=False),  # StepFinished.step (engine.global_steps after it)
    sa.Column("recorded_at", sa.Float),
    sa.Column("micro_batches", sa.Integer, nullable=False),
    sa.Column("wall_s", sa.Float, nullable=False),
    sa.Column("forward_s", sa.Float, nullable=False),
    sa.Column("backward_s", sa.Float, nullable=False),
    sa.Column("optimizer_s", sa.Float, nullable=False),
    sa.Column("stall_s", sa.Float, nullable=False),
    sa.Column("migration_s", sa.Float, nullable=False),
    sa.Column("loss", sa.Float),
    *_tier_bytes("read"),
    *_tier_bytes("written"),
    sa.Column("dram_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("pinned_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("gpu_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("rss_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("plan_version", sa.Integer, nullable=False, server_default="0"),
)
sa.Index(None, steps.c.run_id, steps.c.step)

shard_steps = sa.Table(
    "shard_steps",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    _run_fk(),
    sa.Column("step", sa.Integer, nullable=False),  # first step of the window
    sa.Column("window_steps", sa.Integer, nullable=False, server_default="1"),
    _shard_fk(),
    sa.Column("forward_accesses", sa.Integer, nullable=False, server_default="0"),
    sa.Column("backward_accesses", sa.Integer, nullable=False, server_default="0"),
    sa.Column("recompute_accesses", sa.Integer, nullable=False, server_default="0"),
    sa.Column("optimizer_accesses", sa.Integer, nullable=False, server_default="0"),
    *_tier_bytes("read"),
    *_tier_bytes("written"),
    sa.Column("fetch_s", sa.Float, nullable=False, server_default="0"),
    sa.Column("stall_s", sa.Float, nullable=False, server_default="0"),
    sa.Column("optimizer_s", sa.Float, nullable=False, server_default="0"),  # read + update + write
    sa.Column("param_tier", sa.String(8)),  # tier at the end of the window
    sa.Column("optim_tier", sa.String(8)),
    # of stall_s: the fetches' time beyond waiting for their reads (resize, copy out, upload
    # launch); last, where migration 0003 added them
    sa.Column("fetch_overhead_s", sa.Float, nullable=False, server_default="0"),
    sa.Column("update_s", sa.Float, nullable=False, server_default="0"),  # of optimizer_s: the update alone
)
sa.Index(None, shard_steps.c.run_id, shard_steps.c.step)
sa.Index(None, shard_steps.c.run_id, shard_steps.c.shard_id)

io_samples = sa.Table(
    "io_samples",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    _run_fk(),
    sa.Column("step", sa.Integer, nullable=False),  # the step the I/O happened in
    _shard_fk(nullable=True),
    sa.Column("op", sa.String(8), nullable=False),  # "read" or "write"
    sa.Column("tier", sa.String(8), nullable=False),
    sa.Column("what", sa.String(32), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("seconds", sa.Float, nullable=False),
    sa.Column("o_direct", sa.Boolean),
    sa.Column("block_size", sa.Integer),
    sa.Column("queue_depth", sa.Integer),
    sa.Column("thread_count", sa.Integer),
    # mean requests in flight on the disk while it ran, itself included (>= 1; NULL: not measured)
    sa.Column("concurrency", sa.Float),
)
sa.Index(None, io_samples.c.run_id, io_samples.c.step)

plans = sa.Table(
    "plans",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    _run_fk(),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_step", sa.Integer, nullable=False, server_default="0"),
    sa.Column("created_at", sa.Float),
    sa.Column("policy", sa.String(64), nullable=False),
    sa.Column("dram_budget_bytes", sa.BigInteger),
    sa.Column("predicted_step_s", sa.Float),
    sa.Column("predicted_gain_s", sa.Float),
    sa.Column("adopted", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("reason", sa.JSON),
)
sa.Index(None, plans.c.run_id, plans.c.version)

plan_assignments = sa.Table(
    "plan_assignments",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("plan_id", sa.Integer, sa.ForeignKey("plans.id", ondelete="CASCADE"), nullable=False),
    _shard_fk(),
    sa.Column("param_tier", sa.String(8), nullable=False),
    sa.Column("optim_tier", sa.String(8), nullable=False),
    sa.Column("score", sa.Float),
)
sa.Index(None, plan_assignments.c.plan_id)

migrations = sa.Table(
    "migrations",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    _run_fk(),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("plan_version", sa.Integer),
    _shard_fk(),
    sa.Column("state", sa.String(8), nullable=False),  # "param" or "optim"
    sa.Column("src_tier", sa.String(8), nullable=False),
    sa.Column("dst_tier", sa.String(8), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("seconds", sa.Float, nullable=False),
)
sa.Index(None, migrations.c.run_id, migrations.c.step)

tuning_trials = sa.Table(
    "tuning_trials",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    _run_fk(nullable=True),  # NULL for a trial run before any training run was recorded
    sa.Column("step", sa.Integer),
    sa.Column("created_at", sa.Float),
    sa.Column("setting", sa.JSON, nullable=False),
    sa.Column("step_s", sa.Float),
    sa.Column("chosen", sa.Boolean, nullable=False, server_default=sa.false()),
)
sa.Index(None, tuning_trials.c.run_id)

calibrations = sa.Table(
    "calibrations",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("fstype", sa.String(32)),
    sa.Column("op", sa.String(8), nullable=False),
    sa.Column("block_size", sa.Integer),
    sa.Column("queue_depth", sa.Integer),
    sa.Column("thread_count", sa.Integer),
    sa.Column("bytes", sa.BigInteger),
    sa.Column("GBps", sa.Float),
    sa.Column("raw_baseline_GBps", sa.Float),
    sa.Column("source", sa.String(64)),
)
sa.Index(None, calibrations.c.path, calibrations.c.op)

TABLES = (
    "runs", "shards", "steps", "shard_steps", "io_samples", "plans", "plan_assignments",
    "migrations", "tuning_trials", "calibrations",
)
