"""predictions: online latency, and the other path's verdict on the same transaction, version, input

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("predictions") as batch:
        batch.add_column(
            sa.Column("latency_ms", sa.Float, nullable=True, comment="online: service time of the producing request")
        )
        batch.add_column(sa.Column("cross_path", sa.Text, nullable=True))
        batch.add_column(sa.Column("cross_path_score", sa.Float(precision=53), nullable=True))
        batch.add_column(sa.Column("cross_path_producer", sa.Text, nullable=True))
        batch.add_column(sa.Column("cross_checked_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("predictions") as batch:
        for name in ("cross_checked_at", "cross_path_producer", "cross_path_score", "cross_path", "latency_ms"):
            batch.drop_column(name)
