"""transactions, predictions, rejected_records

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "transactions",
        sa.Column("transaction_id", sa.Text, primary_key=True),
        sa.Column("account_id", sa.Text, nullable=True),
        sa.Column("amount", sa.Float(precision=53), nullable=True),
        sa.Column("currency", sa.Text, nullable=True),
        sa.Column("merchant_category", sa.Text, nullable=True),
        sa.Column("country", sa.Text, nullable=True),
        sa.Column("event_time", sa.Text, nullable=True, comment="as received from the source"),
        sa.Column("event_ts", sa.DateTime(timezone=True), nullable=True, comment="event_time parsed, UTC"),
        sa.Column("partition_date", sa.Date, nullable=False, comment="the source day; the Dagster partition"),
        sa.Column("reject_reason", sa.Text, nullable=True, comment="validation result at ingest; null = valid"),
        sa.Column("label_fraud", sa.SmallInteger, nullable=True, comment="ground truth where known (demo data)"),
        sa.Column("input_hash", sa.Text, nullable=False),
        sa.Column("ingested_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_transactions_partition_date", "transactions", ["partition_date"])
    op.create_index("ix_transactions_account_event", "transactions", ["account_id", "event_ts", "transaction_id"])

    op.create_table(
        "predictions",
        sa.Column("transaction_id", sa.Text, primary_key=True),
        sa.Column("model_version", sa.Text, primary_key=True),
        sa.Column("score", sa.Float(precision=53), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("run_id", sa.Text, nullable=True, comment="Dagster run (batch)"),
        sa.Column("partition_key", sa.Text, nullable=True, comment="Dagster partition (batch)"),
        sa.Column("request_id", sa.Text, nullable=True, comment="HTTP request (online)"),
        sa.Column("batch_id", sa.Text, nullable=True, comment="adaptive batch (online)"),
        sa.Column("code_version", sa.Text, nullable=False),
        sa.Column("input_hash", sa.Text, nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=True),
        sa.Column("produced_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("path IN ('batch', 'online')", name="ck_predictions_path"),
    )
    op.create_index("ix_predictions_partition_key", "predictions", ["partition_key"])
    op.create_index("ix_predictions_idempotency_key", "predictions", ["idempotency_key"])

    op.create_table(
        "rejected_records",
        sa.Column("rejection_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("rejection_key", sa.Text, nullable=False, unique=True),
        sa.Column("transaction_id", sa.Text, nullable=True),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("stage", sa.Text, nullable=False),
        sa.Column("partition_key", sa.Text, nullable=True),
        sa.Column("run_id", sa.Text, nullable=True),
        sa.Column("request_id", sa.Text, nullable=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("detail", sa.Text, nullable=True),
        sa.Column("payload", sa.Text, nullable=False, comment="the record as received, JSON"),
        sa.Column("input_hash", sa.Text, nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_count", sa.Integer, nullable=False, server_default="1"),
        sa.Column("resolved", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("path IN ('batch', 'online')", name="ck_rejected_records_path"),
    )
    op.create_index("ix_rejected_records_partition", "rejected_records", ["partition_key", "stage"])


def downgrade() -> None:
    op.drop_table("rejected_records")
    op.drop_table("predictions")
    op.drop_table("transactions")
