"""transactions: where a corrected record stood before its correction (account and event time),
so the records that followed its old position, which read it as history, are rescored too

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("transactions") as batch:
        batch.add_column(
            sa.Column(
                "previous_account_id",
                sa.Text,
                nullable=True,
                comment="before the last correction of this record; null = never corrected",
            )
        )
        batch.add_column(
            sa.Column(
                "previous_event_ts",
                sa.DateTime(timezone=True),
                nullable=True,
                comment="before the last correction of this record; null = never corrected",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("transactions") as batch:
        batch.drop_column("previous_event_ts")
        batch.drop_column("previous_account_id")
