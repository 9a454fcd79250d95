"""record_id: the core tables keyed by a spec's record id; the record table the spec's own

- `transaction_id` becomes `record_id` in predictions, challenger_predictions and rejected_records
  (a rename: metadata only in PostgreSQL, RENAME COLUMN in SQLite).
- `tandem_spec` names the spec a database belongs to (one row, written with its record table).
- `transactions` is now the reference spec's record table, created from the spec on start
  (inference.migrate.ensure_record_table): dropped here when it holds no rows; a table with rows
  stays, its entity index renamed as the spec names it.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_KEYED = ("predictions", "challenger_predictions", "rejected_records")
_CORRECTED = "before the last correction of this record; null = never corrected"


def upgrade() -> None:
    for table in _KEYED:
        op.execute(f"ALTER TABLE {table} RENAME COLUMN transaction_id TO record_id")
    op.create_table(
        "tandem_spec",
        sa.Column("name", sa.Text, primary_key=True, comment="ModelSpec.name"),
        sa.Column("spec_path", sa.Text, nullable=False, comment="the import path it was loaded by"),
        sa.Column("record_table", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
    )
    held = op.get_bind().execute(sa.text("SELECT EXISTS (SELECT 1 FROM transactions)")).scalar()
    if not held:
        op.drop_table("transactions")
        return
    op.drop_index("ix_transactions_account_event", "transactions")
    op.create_index("ix_transactions_entity_event", "transactions", ["account_id", "event_ts", "transaction_id"])


def downgrade() -> None:
    if "transactions" in sa.inspect(op.get_bind()).get_table_names():
        op.drop_index("ix_transactions_entity_event", "transactions")
        op.create_index("ix_transactions_account_event", "transactions", ["account_id", "event_ts", "transaction_id"])
    else:
        _create_transactions()
    op.drop_table("tandem_spec")
    for table in _KEYED:
        op.execute(f"ALTER TABLE {table} RENAME COLUMN record_id TO transaction_id")


def _create_transactions() -> None:
    """`transactions` as 0007 left it."""
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
        sa.Column("previous_account_id", sa.Text, nullable=True, comment=_CORRECTED),
        sa.Column("previous_event_ts", sa.DateTime(timezone=True), nullable=True, comment=_CORRECTED),
    )
    op.create_index("ix_transactions_partition_date", "transactions", ["partition_date"])
    op.create_index("ix_transactions_account_event", "transactions", ["account_id", "event_ts", "transaction_id"])
    op.create_index("ix_transactions_ingested_at", "transactions", ["ingested_at"])
