"""initial schema

Tables: runs, shards, steps, shard_steps, io_samples, plans, plan_assignments, migrations,
tuning_trials, calibrations.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

Written from ``profiler/schema.py`` (autogenerate, then tidied). A migration is frozen once it is
released: change the schema with a new revision, never by editing this one.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# 64-bit row ids where the database has them; SQLite keeps INTEGER so the column is the rowid.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# revision identifiers, used by Alembic.
revision: str = '0001'
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table('calibrations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('fstype', sa.String(length=32), nullable=True),
    sa.Column('op', sa.String(length=8), nullable=False),
    sa.Column('block_size', sa.Integer(), nullable=True),
    sa.Column('queue_depth', sa.Integer(), nullable=True),
    sa.Column('thread_count', sa.Integer(), nullable=True),
    sa.Column('bytes', sa.BigInteger(), nullable=True),
    sa.Column('GBps', sa.Float(), nullable=True),
    sa.Column('raw_baseline_GBps', sa.Float(), nullable=True),
    sa.Column('source', sa.String(length=64), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_calibrations'))
    )
    op.create_index(op.f('ix_calibrations_path_op'), 'calibrations', ['path', 'op'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=16), server_default='running', nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.Column('last_heartbeat', sa.Float(), nullable=True),
    sa.Column('config', sa.JSON(), nullable=True),
    sa.Column('model', sa.JSON(), nullable=True),
    sa.Column('hardware', sa.JSON(), nullable=True),
    sa.Column('bandwidths', sa.JSON(), nullable=True),
    sa.Column('swap_dir', sa.Text(), nullable=True),
    sa.Column('o_direct', sa.Boolean(), nullable=True),
    sa.Column('hostname', sa.String(length=255), nullable=True),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('pid_start_ticks', sa.BigInteger(), nullable=True),
    sa.Column('detail', sa.String(length=16), nullable=True),
    sa.Column('window_steps', sa.Integer(), nullable=True),
    sa.Column('dropped_events', sa.JSON(), nullable=True),
    sa.CheckConstraint("status IN ('running', 'finished', 'crashed')", name=op.f('ck_runs_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs'))
    )
    op.create_index(op.f('ix_runs_status'), 'runs', ['status'], unique=False)

    op.create_table('plans',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('created_step', sa.Integer(), server_default='0', nullable=False),
    sa.Column('created_at', sa.Float(), nullable=True),
    sa.Column('policy', sa.String(length=64), nullable=False),
    sa.Column('dram_budget_bytes', sa.BigInteger(), nullable=True),
    sa.Column('predicted_step_s', sa.Float(), nullable=True),
    sa.Column('predicted_gain_s', sa.Float(), nullable=True),
    sa.Column('adopted', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.Column('reason', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_plans_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_plans'))
    )
    op.create_index(op.f('ix_plans_run_id_version'), 'plans', ['run_id', 'version'], unique=False)

    op.create_table('shards',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('shard_index', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=500), nullable=False),
    sa.Column('module', sa.String(length=500), server_default='', nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('numel', sa.BigInteger(), nullable=False),
    sa.Column('param_bytes', sa.BigInteger(), nullable=False),
    sa.Column('optim_bytes', sa.BigInteger(), nullable=False),
    sa.Column('grad_bytes', sa.BigInteger(), nullable=False),
    sa.Column('members', sa.JSON(), nullable=True),
    sa.Column('param_tier', sa.String(length=8), nullable=False),
    sa.Column('optim_tier', sa.String(length=8), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_shards_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_shards')),
    sa.UniqueConstraint('run_id', 'name', name=op.f('uq_shards_run_id_name')),
    sa.UniqueConstraint('run_id', 'shard_index', name=op.f('uq_shards_run_id_shard_index'))
    )
    op.create_table('steps',
    sa.Column('id', BigId, autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('recorded_at', sa.Float(), nullable=True),
    sa.Column('micro_batches', sa.Integer(), nullable=False),
    sa.Column('wall_s', sa.Float(), nullable=False),
    sa.Column('forward_s', sa.Float(), nullable=False),
    sa.Column('backward_s', sa.Float(), nullable=False),
    sa.Column('optimizer_s', sa.Float(), nullable=False),
    sa.Column('stall_s', sa.Float(), nullable=False),
    sa.Column('migration_s', sa.Float(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('read_gpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('read_cpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('read_nvme_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('written_gpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('written_cpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('written_nvme_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('dram_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('pinned_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('gpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('rss_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('plan_version', sa.Integer(), server_default='0', nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_steps_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_steps'))
    )
    op.create_index(op.f('ix_steps_run_id_step'), 'steps', ['run_id', 'step'], unique=False)

    op.create_table('tuning_trials',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=True),
    sa.Column('step', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=True),
    sa.Column('setting', sa.JSON(), nullable=False),
    sa.Column('step_s', sa.Float(), nullable=True),
    sa.Column('chosen', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_tuning_trials_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tuning_trials'))
    )
    op.create_index(op.f('ix_tuning_trials_run_id'), 'tuning_trials', ['run_id'], unique=False)

    op.create_table('io_samples',
    sa.Column('id', BigId, autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('shard_id', sa.Integer(), nullable=True),
    sa.Column('op', sa.String(length=8), nullable=False),
    sa.Column('tier', sa.String(length=8), nullable=False),
    sa.Column('what', sa.String(length=32), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.Column('o_direct', sa.Boolean(), nullable=True),
    sa.Column('block_size', sa.Integer(), nullable=True),
    sa.Column('queue_depth', sa.Integer(), nullable=True),
    sa.Column('thread_count', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_io_samples_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], name=op.f('fk_io_samples_shard_id_shards'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_io_samples'))
    )
    op.create_index(op.f('ix_io_samples_run_id_step'), 'io_samples', ['run_id', 'step'], unique=False)

    op.create_table('migrations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('plan_version', sa.Integer(), nullable=True),
    sa.Column('shard_id', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=8), nullable=False),
    sa.Column('src_tier', sa.String(length=8), nullable=False),
    sa.Column('dst_tier', sa.String(length=8), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('seconds', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_migrations_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], name=op.f('fk_migrations_shard_id_shards'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_migrations'))
    )
    op.create_index(op.f('ix_migrations_run_id_step'), 'migrations', ['run_id', 'step'], unique=False)

    op.create_table('plan_assignments',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('plan_id', sa.Integer(), nullable=False),
    sa.Column('shard_id', sa.Integer(), nullable=False),
    sa.Column('param_tier', sa.String(length=8), nullable=False),
    sa.Column('optim_tier', sa.String(length=8), nullable=False),
    sa.Column('score', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['plan_id'], ['plans.id'], name=op.f('fk_plan_assignments_plan_id_plans'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], name=op.f('fk_plan_assignments_shard_id_shards'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_plan_assignments'))
    )
    op.create_index(op.f('ix_plan_assignments_plan_id'), 'plan_assignments', ['plan_id'], unique=False)

    op.create_table('shard_steps',
    sa.Column('id', BigId, autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('window_steps', sa.Integer(), server_default='1', nullable=False),
    sa.Column('shard_id', sa.Integer(), nullable=False),
    sa.Column('forward_accesses', sa.Integer(), server_default='0', nullable=False),
    sa.Column('backward_accesses', sa.Integer(), server_default='0', nullable=False),
    sa.Column('recompute_accesses', sa.Integer(), server_default='0', nullable=False),
    sa.Column('optimizer_accesses', sa.Integer(), server_default='0', nullable=False),
    sa.Column('read_gpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('read_cpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('read_nvme_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('written_gpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('written_cpu_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('written_nvme_bytes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('fetch_s', sa.Float(), server_default='0', nullable=False),
    sa.Column('stall_s', sa.Float(), server_default='0', nullable=False),
    sa.Column('optimizer_s', sa.Float(), server_default='0', nullable=False),
    sa.Column('param_tier', sa.String(length=8), nullable=True),
    sa.Column('optim_tier', sa.String(length=8), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_shard_steps_run_id_runs'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], name=op.f('fk_shard_steps_shard_id_shards'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_shard_steps'))
    )
    op.create_index(op.f('ix_shard_steps_run_id_shard_id'), 'shard_steps', ['run_id', 'shard_id'], unique=False)
    op.create_index(op.f('ix_shard_steps_run_id_step'), 'shard_steps', ['run_id', 'step'], unique=False)



def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index(op.f('ix_shard_steps_run_id_step'), table_name='shard_steps')
    op.drop_index(op.f('ix_shard_steps_run_id_shard_id'), table_name='shard_steps')
    op.drop_table('shard_steps')
    op.drop_index(op.f('ix_plan_assignments_plan_id'), table_name='plan_assignments')
    op.drop_table('plan_assignments')
    op.drop_index(op.f('ix_migrations_run_id_step'), table_name='migrations')
    op.drop_table('migrations')
    op.drop_index(op.f('ix_io_samples_run_id_step'), table_name='io_samples')
    op.drop_table('io_samples')
    op.drop_index(op.f('ix_tuning_trials_run_id'), table_name='tuning_trials')
    op.drop_table('tuning_trials')
    op.drop_index(op.f('ix_steps_run_id_step'), table_name='steps')
    op.drop_table('steps')
    op.drop_table('shards')
    op.drop_index(op.f('ix_plans_run_id_version'), table_name='plans')
    op.drop_table('plans')
    op.drop_index(op.f('ix_runs_status'), table_name='runs')
    op.drop_table('runs')
    op.drop_index(op.f('ix_calibrations_path_op'), table_name='calibrations')
    op.drop_table('calibrations')
