"""withdrawn_records: records a re-sent day no longer holds, deleted from the record table and
kept here for the rescoring sensor (the records that read them as history are stale)

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "withdrawn_records",
        sa.Column("record_id", sa.Text, primary_key=True),
        sa.Column("partition_date", sa.Date, nullable=False, comment="the day that held it"),
        sa.Column(
            "entity", sa.Text, nullable=True, comment="its entity, where it stood in history; null without one"
        ),
        sa.Column("event_ts", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text, nullable=False, comment="not_resent | refused_at_ingest"),
        sa.Column("run_id", sa.Text, nullable=True, comment="the ingest that withdrew it"),
        sa.Column("withdrawn_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_withdrawn_records_withdrawn_at", "withdrawn_records", ["withdrawn_at"])
    op.create_index("ix_withdrawn_records_partition_date", "withdrawn_records", ["partition_date"])


def downgrade() -> None:
    op.drop_table("withdrawn_records")
