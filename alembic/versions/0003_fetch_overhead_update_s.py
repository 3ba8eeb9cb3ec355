"""shard_steps.fetch_overhead_s and update_s: the parts of a fetch and of an optimizer update
that are not I/O

fetch_overhead_s:

A fetch's stall is the wait for its read (what a prefetch hides) plus the rest - resizing the
param's storage, copying out of the read buffer or launching its upload - which no prefetch
hides. The planner's simulator charges the two separately; the rest could only be guessed from
``stall_s``, which also holds the shard's gradient read-backs and write waits, and guessed wrong
in runs without prefetch (every fetch then waits for its whole read).

update_s: of ``optimizer_s`` (read + update + write), the update alone. Without it the planner
could read the update's cost only from shards with both homes in DRAM, and otherwise timed one
on the side, which other threads of a busy training process could slow several-fold.

Older profiles keep 0 in both; the planner then estimates them as it did before.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = '0003'
down_revision: Union[str, Sequence[str], None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('shard_steps') as batch_op:
        batch_op.add_column(sa.Column('fetch_overhead_s', sa.Float(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('update_s', sa.Float(), nullable=False, server_default='0'))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('shard_steps') as batch_op:
        batch_op.drop_column('update_s')
        batch_op.drop_column('fetch_overhead_s')
