"""index transactions.ingested_at; record who resolved a rejection

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_transactions_ingested_at", "transactions", ["ingested_at"])
    with op.batch_alter_table("rejected_records") as batch:
        batch.add_column(
            sa.Column("resolution", sa.Text, nullable=True, comment="operator (fixed upstream) | superseded")
        )


def downgrade() -> None:
    with op.batch_alter_table("rejected_records") as batch:
        batch.drop_column("resolution")
    op.drop_index("ix_transactions_ingested_at", "transactions")
