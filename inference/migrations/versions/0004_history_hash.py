"""predictions: a digest of the account history each score read, so a changed history rescores

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("predictions") as batch:
        batch.add_column(
            sa.Column(
                "history_hash",
                sa.Text,
                nullable=True,
                comment="digest of the stored records the features read as history; null before migration 0004",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("predictions") as batch:
        batch.drop_column("history_hash")
