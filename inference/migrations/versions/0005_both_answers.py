"""predictions keeps every path's answer; idempotency keys; unseen vocabulary

- predictions' key becomes (transaction_id, model_version, path, answer_key): the batch answer of a
  version is one row (answer_key ''), and every distinct online answer (answer_key = input hash |
  history hash) is a row of its own, so neither path overwrites what the other recorded;
- the cross_path_* columns of 0003 are folded into rows of their own and dropped;
- the "+nohistory" suffix on degraded online input hashes becomes the `degraded` column;
- `unseen_fields`: categorical fields scored through the model's unknown bucket;
- `idempotency_keys`: one request body per client key, claimed in the store so that every
  server process and pod agrees.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_NO_HISTORY = "nohistory"
_OLD_DEGRADED_SUFFIX = "+nohistory"


def _new_predictions(name: str) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
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
        sa.CheckConstraint("path IN ('batch', 'online')", name="ck_predictions_path"),
    )


def _producer_parts(producer: str | None, path: str) -> dict[str, str | None]:
    """0003 stored the other path's producer as 'run R partition P' or 'request Q batch B'."""
    words = (producer or "").split()
    first, second = ("run", "partition") if path == "batch" else ("request", "batch")
    found: dict[str, str | None] = {first: None, second: None}
    for label, value in zip(words[::2], words[1::2], strict=False):
        if label in found and value != "?":
            found[label] = value
    if path == "batch":
        return {"run_id": found["run"], "partition_key": found["partition"], "request_id": None, "batch_id": None}
    return {"run_id": None, "partition_key": None, "request_id": found["request"], "batch_id": found["batch"]}


def upgrade() -> None:
    bind = op.get_bind()
    new = _new_predictions("predictions_0005")
    new.create(bind)
    old = sa.Table("predictions", sa.MetaData(), autoload_with=bind)
    degraded = old.c.input_hash.like(f"%{_OLD_DEGRADED_SUFFIX}")
    clean_hash = sa.case(
        (degraded, sa.func.replace(old.c.input_hash, _OLD_DEGRADED_SUFFIX, "")), else_=old.c.input_hash
    )
    history = sa.case((degraded, sa.null()), else_=old.c.history_hash)
    answer_key = sa.case(
        (old.c.path == "batch", ""),
        else_=clean_hash + "|" + sa.func.coalesce(history, _NO_HISTORY),
    )
    copied = [
        "transaction_id",
        "model_version",
        "path",
        "score",
        "run_id",
        "partition_key",
        "request_id",
        "batch_id",
        "code_version",
        "idempotency_key",
        "produced_at",
        "latency_ms",
    ]
    bind.execute(
        new.insert().from_select(
            [*copied, "input_hash", "history_hash", "answer_key", "degraded"],
            sa.select(*(old.c[name] for name in copied), clean_hash, history, answer_key, degraded),
        )
    )
    # The other path's verdict becomes that path's own row (the same input and history: 0003
    # recorded it only then). Rows are few and the producer text needs parsing, so in Python.
    for row in bind.execute(sa.select(old).where(old.c.cross_path.is_not(None))).mappings():
        path = row["cross_path"]
        input_hash = str(row["input_hash"]).removesuffix(_OLD_DEGRADED_SUFFIX)
        bind.execute(
            new.insert().values(
                transaction_id=row["transaction_id"],
                model_version=row["model_version"],
                path=path,
                answer_key="" if path == "batch" else f"{input_hash}|{row['history_hash'] or _NO_HISTORY}",
                score=row["cross_path_score"],
                code_version=row["code_version"],
                input_hash=input_hash,
                history_hash=row["history_hash"],
                produced_at=row["cross_checked_at"] or row["produced_at"],
                degraded=False,
                **_producer_parts(row["cross_path_producer"], path),
            )
        )
    op.drop_table("predictions")
    op.rename_table("predictions_0005", "predictions")
    if bind.dialect.name == "postgresql":
        op.execute("ALTER INDEX predictions_0005_pkey RENAME TO predictions_pkey")
    op.create_index("ix_predictions_partition_key", "predictions", ["partition_key"])
    op.create_index("ix_predictions_idempotency_key", "predictions", ["idempotency_key"])

    op.create_table(
        "idempotency_keys",
        sa.Column("idempotency_key", sa.Text, primary_key=True),
        sa.Column("request_hash", sa.Text, nullable=False, comment="digest of the request's transactions, in order"),
        sa.Column("request_id", sa.Text, nullable=False, comment="the request that claimed the key"),
        sa.Column("response", sa.Text, nullable=True, comment="the answers as JSON; null while in flight"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    raise NotImplementedError("0005 folds two answers into separate rows; there is no lossless way back")
