"""The result store's migrations, on SQLite and on a fresh PostgreSQL database: the migrated schema
matches the metadata, upgrading is idempotent, 0005 turns 0004's folded cross-path verdicts into
rows of their own, and 0008 keys the core tables by record_id. Idempotent writes are
test_store_writes.py; the record table is test_record_table.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from inference.migrate import alembic_config, upgrade, upgrade_core
from inference.store import make_engine
from tests.answers import answer, write_answers
from tests.inference.store_worker import prediction_rows
from tests.inference.support import IDS, current_revision, predictions_of, schema_diffs, write
from tests.reference import REFERENCE


def test_migrated_schema_matches_the_metadata(engine: Engine) -> None:
    assert schema_diffs(engine) == []
    assert current_revision(engine) == ScriptDirectory.from_config(alembic_config()).get_current_head()


def test_upgrade_is_idempotent(engine: Engine) -> None:
    write(engine, prediction_rows(IDS))
    before = predictions_of(engine)
    upgrade(engine, REFERENCE)
    upgrade(engine, REFERENCE)
    assert schema_diffs(engine) == []
    assert current_revision(engine) == ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert predictions_of(engine).equals(before)


# ------------------------------------------------------------------ migration 0005 from 0004 with data
T_OLD = datetime(2026, 11, 1, 3, 0, tzinfo=UTC)


def _old_row(transaction_id: str, path: str, **changes: Any) -> dict[str, Any]:
    batch = path == "batch"
    return {
        "transaction_id": transaction_id,
        "model_version": "v1",
        "score": 0.25,
        "path": path,
        "run_id": "run-old" if batch else None,
        "partition_key": "2026-11-01" if batch else None,
        "request_id": None if batch else "req-old",
        "batch_id": None if batch else "b-old",
        "code_version": "old",
        "input_hash": f"in-{transaction_id}",
        "history_hash": f"hist-{transaction_id}",
        "idempotency_key": None,
        "produced_at": T_OLD,
        "latency_ms": None if batch else 4.0,
        "cross_path": None,
        "cross_path_score": None,
        "cross_path_producer": None,
        "cross_checked_at": None,
        **changes,
    }


def test_migration_0005_splits_cross_path_verdicts_into_rows_and_marks_degraded_answers(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade_core(engine, "0004")
        old = sa.Table("predictions", sa.MetaData(), autoload_with=engine)
        assert "cross_path" in old.c and "answer_key" not in old.c
        checked_at = T_OLD + timedelta(hours=5)
        with engine.begin() as conn:
            conn.execute(
                old.insert(),
                [
                    _old_row("tx-plain", "batch"),
                    # Batch wrote first; the online answer to the same input was folded into its row.
                    _old_row(
                        "tx-both",
                        "batch",
                        cross_path="online",
                        cross_path_score=0.31,
                        cross_path_producer="request req-7 batch b-7",
                        cross_checked_at=checked_at,
                    ),
                    # Online wrote first; batch's verdict was folded in (an unknown partition: '?').
                    _old_row(
                        "tx-online-first",
                        "online",
                        cross_path="batch",
                        cross_path_score=0.27,
                        cross_path_producer="run run-9 partition ?",
                        cross_checked_at=checked_at,
                    ),
                    # A degraded online answer: the old service marked its input hash.
                    _old_row("tx-degraded", "online", input_hash="in-tx-degraded+nohistory", history_hash=None),
                ],
            )
        upgrade(engine, REFERENCE)
        assert schema_diffs(engine) == []
        columns = sa.inspect(engine).get_columns("predictions")
        assert not {c["name"] for c in columns} & {"cross_path", "cross_path_score", "cross_path_producer"}

        stored = {(row["record_id"], row["path"]): row for row in predictions_of(engine).to_dicts()}
        assert set(stored) == {
            ("tx-plain", "batch"),
            ("tx-both", "batch"),
            ("tx-both", "online"),
            ("tx-online-first", "online"),
            ("tx-online-first", "batch"),
            ("tx-degraded", "online"),
        }

        def picked(key: tuple[str, str], *names: str) -> tuple[Any, ...]:
            return tuple(stored[key][name] for name in names)

        lineage = ("score", "answer_key", "run_id", "partition_key", "request_id", "batch_id", "degraded")
        assert picked(("tx-plain", "batch"), *lineage) == (0.25, "", "run-old", "2026-11-01", None, None, False)
        assert picked(("tx-both", "batch"), *lineage) == (0.25, "", "run-old", "2026-11-01", None, None, False)
        assert picked(("tx-both", "online"), *lineage) == (
            0.31, "in-tx-both|hist-tx-both", None, None, "req-7", "b-7", False
        )  # fmt: skip
        assert stored[("tx-both", "online")]["produced_at"] == checked_at
        assert picked(("tx-online-first", "online"), *lineage) == (
            0.25, "in-tx-online-first|hist-tx-online-first", None, None, "req-old", "b-old", False
        )  # fmt: skip
        assert picked(("tx-online-first", "batch"), *lineage) == (0.27, "", "run-9", None, None, None, False)
        assert picked(("tx-degraded", "online"), "input_hash", "history_hash", "answer_key", "degraded") == (
            "in-tx-degraded",
            None,
            "in-tx-degraded|nohistory",
            True,
        )
        assert stored[("tx-plain", "batch")]["latency_ms"] is None
        assert stored[("tx-degraded", "online")]["latency_ms"] == 4.0

        # The migrated table takes new answers under the new key like a fresh one.
        same = {"model_version": "v1", "input_hash": "in-tx-plain", "history_hash": "hist-tx-plain"}
        assert write_answers(engine, answer("tx-plain", path="online", score=0.5, **same)) == 1
        assert write_answers(engine, answer("tx-plain", path="batch", score=0.25, **same)) == 0  # a replay
        assert write_answers(engine, answer("tx-plain", path="batch", score=0.25, **{**same, "input_hash": "new"})) == 1
    finally:
        engine.dispose()


# ------------------------------------------------------------------ migration 0008 from 0007 with data
KEYED = ("predictions", "challenger_predictions", "rejected_records")
STORED_RECORD = {
    "transaction_id": "tx-kept",
    "account_id": "acct-1",
    "amount": 12.5,
    "currency": "EUR",
    "merchant_category": "grocery",
    "country": "DE",
    "event_time": "2026-11-01T12:00:00Z",
    "event_ts": T_OLD,
    "partition_date": T_OLD.date(),
    "reject_reason": None,
    "label_fraud": 0,
    "input_hash": "in-tx-kept",
    "ingested_at": T_OLD,
}


def _at_0007(engine: Engine, *, records: bool) -> None:
    """A database at 0007 with a row in each keyed table, and a stored record if `records`."""
    upgrade_core(engine, "0007")
    tables = {name: sa.Table(name, sa.MetaData(), autoload_with=engine) for name in (*KEYED, "transactions")}
    answer_row = {**_old_row("tx-kept", "batch"), "answer_key": "", "degraded": False, "unseen_fields": None}
    for gone in ("cross_path", "cross_path_score", "cross_path_producer", "cross_checked_at"):
        answer_row.pop(gone)
    with engine.begin() as conn:
        conn.execute(tables["predictions"].insert(), [answer_row])
        conn.execute(tables["challenger_predictions"].insert(), [{**answer_row, "model_version": "v2"}])
        conn.execute(
            tables["rejected_records"].insert(),
            [
                {
                    "rejection_key": "k-1",
                    "transaction_id": "tx-refused",
                    "path": "batch",
                    "stage": "score",
                    "reason": "bad_currency",
                    "payload": "{}",
                    "input_hash": "in-tx-refused",
                    "first_seen": T_OLD,
                    "last_seen": T_OLD,
                }
            ],
        )
        if records:
            conn.execute(tables["transactions"].insert(), [STORED_RECORD])


def _id_columns(engine: Engine) -> dict[str, set[str]]:
    inspector = sa.inspect(engine)
    return {name: {c["name"] for c in inspector.get_columns(name)} & {"transaction_id", "record_id"} for name in KEYED}


def _keyed_ids(engine: Engine, column: str) -> dict[str, list[str]]:
    with engine.connect() as conn:
        return {name: list(conn.execute(sa.text(f"SELECT {column} FROM {name}")).scalars()) for name in KEYED}


def _downgrade(engine: Engine, revision: str) -> None:
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def test_migration_0008_renames_the_ids_keeps_the_rows_and_drops_an_empty_record_table(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        _at_0007(engine, records=False)
        upgrade_core(engine, "0008")
        assert _id_columns(engine) == {key: {"record_id"} for key in KEYED}
        assert _keyed_ids(engine, "record_id") == {
            "predictions": ["tx-kept"],
            "challenger_predictions": ["tx-kept"],
            "rejected_records": ["tx-refused"],
        }
        names = set(sa.inspect(engine).get_table_names())
        assert "transactions" not in names, "a fresh database gets its record table from its spec"
        assert "tandem_spec" in names
        upgrade_core(engine, "0009")  # withdrawn_records: a new table, the rows untouched
        assert "withdrawn_records" in set(sa.inspect(engine).get_table_names())
        assert _keyed_ids(engine, "record_id")["predictions"] == ["tx-kept"]
        assert schema_diffs(engine) == []

        _downgrade(engine, "0007")
        assert _id_columns(engine) == {key: {"transaction_id"} for key in KEYED}
        assert _keyed_ids(engine, "transaction_id")["rejected_records"] == ["tx-refused"]
        names = set(sa.inspect(engine).get_table_names())
        assert "tandem_spec" not in names and "transactions" in names
        assert "withdrawn_records" not in names
        indexes = {index["name"] for index in sa.inspect(engine).get_indexes("transactions")}
        assert "ix_transactions_account_event" in indexes, "transactions as 0007 left it"
    finally:
        engine.dispose()


def test_migration_0008_keeps_a_record_table_with_rows_and_renames_its_index(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        _at_0007(engine, records=True)
        upgrade(engine, REFERENCE)
        indexes = {index["name"] for index in sa.inspect(engine).get_indexes("transactions")}
        assert "ix_transactions_entity_event" in indexes and "ix_transactions_account_event" not in indexes
        with engine.connect() as conn:
            stored = conn.execute(sa.text("SELECT transaction_id, input_hash FROM transactions")).all()
        assert [tuple(row) for row in stored] == [("tx-kept", "in-tx-kept")]

        _downgrade(engine, "0007")
        indexes = {index["name"] for index in sa.inspect(engine).get_indexes("transactions")}
        assert "ix_transactions_account_event" in indexes and "ix_transactions_entity_event" not in indexes
        upgrade(engine, REFERENCE)
        assert _keyed_ids(engine, "record_id")["predictions"] == ["tx-kept"]
    finally:
        engine.dispose()
