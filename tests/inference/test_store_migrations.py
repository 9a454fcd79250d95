"""The result store's migrations, on SQLite and on a fresh PostgreSQL database: the migrated schema
matches the metadata, upgrading is idempotent, and 0005 turns 0004's folded cross-path verdicts
into rows of their own. Idempotent writes are test_store_writes.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from inference.migrate import alembic_config, upgrade, upgrade_core
from inference.store import (
    make_engine,
)
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
