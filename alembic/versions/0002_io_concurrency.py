"""io_samples.concurrency: requests in flight on the disk while each I/O sample ran

The cost model fits how a request slows down when it shares the disk with others (a synchronous
write alone is ~2x faster than one of several in flight), which needs the concurrency of each
sample. Older profiles keep NULL there; the cost model then treats their samples as it did before.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision: str = '0002'
down_revision: Union[str, Sequence[str], None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('io_samples') as batch_op:
        batch_op.add_column(sa.Column('concurrency', sa.Float(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('io_samples') as batch_op:
        batch_op.drop_column('concurrency')
