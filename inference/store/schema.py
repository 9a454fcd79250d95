"""The data contract in SQLAlchemy Core: the core tables, their enums, and the polars schemas of
their rows. The record table is the spec's own (`inference.store.record_table`).

Alembic's migrations are generated against `metadata`; names here are part of the product
(extend, do not rename).
"""

from __future__ import annotations

import enum
from typing import Any

import polars as pl
import sqlalchemy as sa

from inference.records import EVENT_TS_DTYPE

metadata = sa.MetaData()


# ------------------------------------------------------------------ enums
class ResultPath(enum.StrEnum):
    BATCH = "batch"
    ONLINE = "online"
    # A challenger's answer to an admitted online request, never returned to the client
    # (challenger_predictions only).
    SHADOW = "shadow"


class Resolution(enum.StrEnum):
    OPERATOR = "operator"  # someone fixed the source; the partition should be re-ingested and rescored
    # The record changed and was rescored, or a later production run scored it (another model
    # version); nothing left to do.
    SUPERSEDED = "superseded"


class RejectStage(enum.StrEnum):
    INGEST = "ingest"  # could not even be stored as a source record (no id, repeated id)
    SCORE = "score"  # stored, then refused by validation or the model
    WRITE = "write"  # scored, but the result store refused the result row itself (a data error)


# The reason of a WRITE-stage rejection; validation's reasons are the spec's codes
# (`inference.spec.validation_order`).
UNWRITABLE_RESULT = "unwritable_result"


# ------------------------------------------------------------------ tables
predictions = sa.Table(
    "predictions",
    metadata,
    sa.Column("record_id", sa.Text, primary_key=True),
    sa.Column("model_version", sa.Text, primary_key=True),
    sa.Column("path", sa.Text, primary_key=True),
    # Both paths' answers are kept side by side (docs/decisions/0002): a version's batch answer is
    # one row, rewritten when its input or history changes; every distinct online answer is a row
    # of its own that nothing rewrites, because a client received it.
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
    sa.CheckConstraint("path IN ('batch', 'online')", name="ck_predictions_path"),
    sa.Index("ix_predictions_partition_key", "partition_key"),
    sa.Index("ix_predictions_idempotency_key", "idempotency_key"),
)

# The challenger's answers, apart from `predictions`: nothing that serves, replays or compares the
# production answers can read one by mistake. The same columns and keys as `predictions`; path is
# 'batch' (a replay of a stored day) or 'shadow' (beside an online answer).
challenger_predictions = sa.Table(
    "challenger_predictions",
    metadata,
    *(
        sa.Column(
            c.name,
            c.type,
            primary_key=c.primary_key,
            nullable=c.nullable,
            server_default=sa.false() if c.name == "degraded" else None,
            comment=c.comment,
        )
        for c in predictions.columns
    ),
    sa.CheckConstraint("path IN ('batch', 'shadow')", name="ck_challenger_predictions_path"),
    sa.Index("ix_challenger_predictions_partition_key", "partition_key"),
    sa.Index("ix_challenger_predictions_model_version", "model_version", "path"),
)

# Every materialization of challenger_report: the verdict `tandem models promote --from-challenger`
# reads, for the champion and challenger it compared.
challenger_reports = sa.Table(
    "challenger_reports",
    metadata,
    sa.Column("report_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("champion", sa.Text, nullable=False),
    sa.Column("challenger", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("run_id", sa.Text, nullable=True, comment="the Dagster run that materialized the report"),
    sa.Column("passed", sa.Boolean, nullable=False, comment="every check of the promotion gate passed"),
    sa.Column("failures", sa.Text, nullable=False, comment="JSON: the failed checks and why"),
    sa.Column("metrics", sa.Text, nullable=False, comment="JSON: the report's numbers"),
    sa.Index("ix_challenger_reports_pair", "challenger", "champion", "report_id"),
)

idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("request_hash", sa.Text, nullable=False, comment="digest of the request's transactions, in order"),
    sa.Column("request_id", sa.Text, nullable=False, comment="the request that claimed the key"),
    sa.Column("response", sa.Text, nullable=True, comment="the answers as JSON; null while in flight"),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
)

rejected_records = sa.Table(
    "rejected_records",
    metadata,
    sa.Column("rejection_id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("rejection_key", sa.Text, nullable=False, unique=True),
    sa.Column("record_id", sa.Text, nullable=True),
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
    sa.Column("resolution", sa.Text, nullable=True, comment="operator (fixed upstream) | superseded"),
    sa.CheckConstraint("path IN ('batch', 'online')", name="ck_rejected_records_path"),
    sa.Index("ix_rejected_records_partition", "partition_key", "stage"),
)

# Records a re-sent day no longer holds: deleted from the record table (no longer history, no
# longer scored), kept here so that the records that read them as history are rescored too.
withdrawn_records = sa.Table(
    "withdrawn_records",
    metadata,
    sa.Column("record_id", sa.Text, primary_key=True),
    sa.Column("partition_date", sa.Date, nullable=False, comment="the day that held it"),
    sa.Column("entity", sa.Text, nullable=True, comment="its entity, where it stood in history; null without one"),
    sa.Column("event_ts", sa.DateTime(timezone=True), nullable=True),
    sa.Column("reason", sa.Text, nullable=False, comment="not_resent | refused_at_ingest"),
    sa.Column("run_id", sa.Text, nullable=True, comment="the ingest that withdrew it"),
    sa.Column("withdrawn_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_withdrawn_records_withdrawn_at", "withdrawn_at"),
    sa.Index("ix_withdrawn_records_partition_date", "partition_date"),
)

# The spec a database belongs to: one row, written when its record table is created, so a process
# configured with another spec is refused instead of writing its records beside this one's.
tandem_spec = sa.Table(
    "tandem_spec",
    metadata,
    sa.Column("name", sa.Text, primary_key=True, comment="ModelSpec.name"),
    sa.Column("spec_path", sa.Text, nullable=False, comment="the import path it was loaded by"),
    sa.Column("record_table", sa.Text, nullable=False),
    sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
)

# ------------------------------------------------------------------ frame schemas and columns
PREDICTION_COLUMNS: tuple[str, ...] = tuple(c.name for c in predictions.columns)


# The history part of an online answer_key when the answer read no history (degraded).
NO_HISTORY = "nohistory"


def _polars_type(column: sa.Column[Any]) -> pl.DataType:
    if isinstance(column.type, sa.Float):
        return pl.Float64()
    if isinstance(column.type, sa.DateTime):
        return EVENT_TS_DTYPE
    if isinstance(column.type, sa.Boolean):
        return pl.Boolean()
    return pl.String()


PREDICTION_SCHEMA: dict[str, pl.DataType] = {c.name: _polars_type(c) for c in predictions.columns}
