"""A challenger beside production: its answers (batch replays and online shadows) and the reports
that gate its promotion

- `challenger_predictions`: the columns and key of `predictions`; path 'batch' or 'shadow';
- `challenger_reports`: each challenger_report materialization's verdict and numbers.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "challenger_predictions",
        sa.Column("transaction_id", sa.Text, primary_key=True),
        sa.Column("model_version", sa.Text, primary_key=True),
        sa.Column("path", sa.Text, primary_key=True),
        sa.Column(
            "answer_key",
            sa.Text,
            primary_key=True,
            comment="batch: ''; online: input_hash|history_hash, one row per distinct answer",
        ),
        sa.Column("score", sa.Float(precision=53), nullable=False),
        sa.Column("run_id", sa.Text, nullable=True, comment="Dagster run (batch)"),
        sa.Column("partition_key", sa.Text, nullable=True, comment="Dagster partition (batch)"),
        sa.Column("request_id", sa.Text, nullable=True, comment="HTTP request (online)"),
        sa.Column("batch_id", sa.Text, nullable=True, comment="adaptive batch (online)"),
        sa.Column("code_version", sa.Text, nullable=False),
        sa.Column("input_hash", sa.Text, nullable=False),
        sa.Column(
            "history_hash",
            sa.Text,
            nullable=True,
            comment="digest of the stored records the features read as history; null when degraded",
        ),
        sa.Column("idempotency_key", sa.Text, nullable=True),
        sa.Column("produced_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("latency_ms", sa.Float, nullable=True, comment="online: service time of the producing request"),
        sa.Column(
            "degraded",
            sa.Boolean,
            nullable=False,
            server_default=sa.false(),
            comment="online: scored without account history (the store was unreachable)",
        ),
        sa.Column(
            "unseen_fields",
            sa.Text,
            nullable=True,
            comment="comma-separated fields scored through the unknown bucket; null = none",
        ),
        sa.CheckConstraint("path IN ('batch', 'shadow')", name="ck_challenger_predictions_path"),
    )
    op.create_index("ix_challenger_predictions_partition_key", "challenger_predictions", ["partition_key"])
    op.create_index("ix_challenger_predictions_model_version", "challenger_predictions", ["model_version", "path"])
    op.create_table(
        "challenger_reports",
        sa.Column("report_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("champion", sa.Text, nullable=False),
        sa.Column("challenger", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.Text, nullable=True, comment="the Dagster run that materialized the report"),
        sa.Column("passed", sa.Boolean, nullable=False, comment="every check of the promotion gate passed"),
        sa.Column("failures", sa.Text, nullable=False, comment="JSON: the failed checks and why"),
        sa.Column("metrics", sa.Text, nullable=False, comment="JSON: the report's numbers"),
    )
    op.create_index("ix_challenger_reports_pair", "challenger_reports", ["challenger", "champion", "report_id"])


def downgrade() -> None:
    op.drop_table("challenger_reports")
    op.drop_table("challenger_predictions")
