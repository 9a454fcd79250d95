"""The result store, on SQLite and on a fresh PostgreSQL database: migrations and idempotent writes."""

from __future__ import annotations

import math
import multiprocessing
from datetime import timedelta

import polars as pl
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from inference.demo import DemoConfig, generate_day
from inference.migrate import alembic_config, upgrade
from inference.records import validate
from inference.store import (
    PREDICTION_COLUMNS,
    RejectStage,
    ResultPath,
    make_engine,
    metadata,
    quarantine,
    read_partition_rows,
    read_predictions,
    rejected_records,
    transactions,
    upsert_predictions,
    upsert_transactions,
)
from tests.inference.store_worker import PRODUCED_AT, prediction_rows, upsert_repeatedly
from tests.inference.support import DAY, frame_of, record

IDS = [f"tx-{i}" for i in range(5)]


def schema_diffs(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(context, metadata))


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def read_all(engine: Engine) -> pl.DataFrame:
    with engine.connect() as conn:
        return read_predictions(conn)


def write(engine: Engine, rows: pl.DataFrame) -> int:
    with engine.begin() as conn:
        return upsert_predictions(conn, rows)


# ------------------------------------------------------------------ migrations
def test_migrated_schema_matches_the_metadata(engine: Engine) -> None:
    assert schema_diffs(engine) == []
    assert current_revision(engine) == ScriptDirectory.from_config(alembic_config()).get_current_head()


def test_upgrade_is_idempotent(engine: Engine) -> None:
    write(engine, prediction_rows(IDS))
    before = read_all(engine)
    upgrade(engine)
    upgrade(engine)
    assert schema_diffs(engine) == []
    assert current_revision(engine) == ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert read_all(engine).equals(before)


# ------------------------------------------------------------------ predictions
def test_writing_predictions_three_times_leaves_one_row_per_key(engine: Engine) -> None:
    rows = pl.concat([prediction_rows(IDS, model_version="risk:1"), prediction_rows(IDS[:3], model_version="risk:2")])
    changed = [write(engine, rows) for _ in range(3)]
    assert changed == [rows.height, 0, 0]

    stored = read_all(engine)
    assert stored.height == rows.height
    assert stored.select("transaction_id", "model_version").is_unique().all()
    assert stored.select(PREDICTION_COLUMNS).equals(rows.sort("transaction_id", "model_version"))
    for _ in range(2):
        write(engine, rows)
        assert read_all(engine).equals(stored)


def test_same_input_hash_is_a_no_op_and_a_changed_one_updates(engine: Engine) -> None:
    write(engine, prediction_rows(IDS, score=0.25, input_hash="hash-1", run_id="run-1"))
    original = read_all(engine)

    replay = prediction_rows(
        IDS, score=0.75, input_hash="hash-1", run_id="run-2", produced_at=PRODUCED_AT + timedelta(1)
    )
    assert write(engine, replay) == 0
    assert read_all(engine).equals(original)

    corrected = prediction_rows(IDS[:1], score=0.75, input_hash="hash-2", run_id="run-3")
    assert write(engine, corrected) == 1
    stored = read_all(engine)
    assert stored.height == len(IDS)
    assert stored.select(PREDICTION_COLUMNS).row(0, named=True) == corrected.row(0, named=True)
    assert stored.slice(1).equals(original.slice(1))


def test_a_key_repeated_in_one_write_keeps_the_last_row(engine: Engine) -> None:
    rows = pl.concat(
        [
            prediction_rows(IDS[:1], input_hash="hash-1", score=0.1),
            prediction_rows(IDS[:1], input_hash="hash-2", score=0.2),
        ]
    )
    assert write(engine, rows) == 1
    stored = read_all(engine)
    assert stored["input_hash"].to_list() == ["hash-2"]
    assert stored["score"].to_list() == [0.2]


@pytest.mark.postgres
def test_concurrent_writers_leave_one_row_per_key(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    upgrade(engine)
    workers, count, repeats = 4, 300, 4
    jobs = [(postgres_url, w, w * 100, count, repeats) for w in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        changed = pool.starmap(upsert_repeatedly, jobs)

    stored = read_all(engine)
    expected_ids = {f"tx-{i:05d}" for i in range((workers - 1) * 100 + count)}
    assert set(stored["transaction_id"]) == expected_ids
    assert stored.height == len(expected_ids)
    assert stored.select("transaction_id", "model_version").is_unique().all()
    # Every writer's last round sends the last hash, so that is what each key ends with.
    assert set(stored["input_hash"]) == {f"hash-{repeats - 1}"}
    # How often a key flips depends on interleaving; it is inserted once and never written more than sent.
    assert len(expected_ids) <= sum(changed) <= workers * count * repeats
    engine.dispose()


# ------------------------------------------------------------------ quarantine
def rejected_rows(engine: Engine) -> pl.DataFrame:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(rejected_records).order_by(rejected_records.c.rejection_id)).mappings().all()
    return pl.DataFrame([dict(r) for r in rows], infer_schema_length=None)


def test_quarantine_is_idempotent_on_the_rejection_key(engine: Engine) -> None:
    bad = validate(
        frame_of(
            record(transaction_id="bad-1", currency="XXX"),
            record(transaction_id="bad-2", amount=math.nan),
            record(transaction_id="bad-3", event_time="yesterday"),
        )
    )

    def send(frame: pl.DataFrame, run_id: str) -> None:
        with engine.begin() as conn:
            quarantine(
                conn, frame, path=ResultPath.BATCH, stage=RejectStage.SCORE, partition_key="2026-11-01", run_id=run_id
            )

    send(bad, "run-1")
    first = rejected_rows(engine)
    assert first.height == 3
    assert first["reason"].to_list() == ["bad_currency", "amount_not_finite", "timestamp_unparsable"]
    assert first["seen_count"].to_list() == [1, 1, 1]

    send(bad, "run-2")
    send(bad, "run-3")
    again = rejected_rows(engine)
    assert again.height == 3
    assert again["rejection_key"].equals(first["rejection_key"])
    assert again["rejection_id"].equals(first["rejection_id"])
    assert again["seen_count"].to_list() == [3, 3, 3]
    assert again["first_seen"].equals(first["first_seen"])
    assert (again["last_seen"] >= again["first_seen"]).all()
    assert set(again["run_id"]) == {"run-3"}

    # A changed record is a new rejection, not a sighting of the old one.
    send(validate(frame_of(record(transaction_id="bad-1", currency="ZZZ"))), "run-4")
    assert rejected_rows(engine).height == 4


# ------------------------------------------------------------------ transactions
def test_upsert_transactions_changes_only_what_changed(engine: Engine) -> None:
    checked = validate(generate_day(DAY, DemoConfig(seed=6, rows_per_day=120, poison_rate=0.0)))
    with engine.begin() as conn:
        assert upsert_transactions(conn, checked, DAY) == checked.height
    with engine.begin() as conn:
        assert upsert_transactions(conn, checked, DAY) == 0

    def ingested_at() -> dict[str, object]:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(transactions.c.transaction_id, transactions.c.ingested_at)).all()
        return {transaction_id: moment for transaction_id, moment in rows}

    before = ingested_at()
    target = checked["transaction_id"][17]
    corrected = checked.with_columns(
        amount=pl.when(pl.col("transaction_id") == target).then(pl.col("amount") + 1.0).otherwise(pl.col("amount"))
    )
    with engine.begin() as conn:
        assert upsert_transactions(conn, corrected, DAY) == 1
    after = ingested_at()
    assert len(after) == checked.height
    assert [tx for tx in after if after[tx] != before[tx]] == [target]

    with engine.connect() as conn:
        stored = read_partition_rows(conn, DAY)
    assert stored.height == checked.height
    assert stored.filter(pl.col("transaction_id") == target)["amount"].to_list() == [
        checked.filter(pl.col("transaction_id") == target)["amount"][0] + 1.0
    ]
