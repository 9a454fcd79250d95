"""The result store's idempotent writes, on SQLite and on a fresh PostgreSQL database: predictions
(replays, corrections, concurrent writers), both paths' answers to one key and the pairs that compare
them, quarantined records, transactions. Migrations are test_store_migrations.py.
"""

from __future__ import annotations

import math
import multiprocessing
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.migrate import upgrade
from inference.records import validate
from inference.store import (
    PREDICTION_COLUMNS,
    RejectStage,
    ResultPath,
    answer_pairs,
    make_engine,
    quarantine,
    read_partition_rows,
    rejected_records,
    stream_partition_rows,
    upsert_records,
)
from inference.store.merge import POSTGRES_ROWS_WITHOUT_STAGING
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.answers import answer, write_answers
from tests.inference.store_worker import PRODUCED_AT, prediction_rows, upsert_repeatedly
from tests.inference.support import DAY, IDS, frame_of, predictions_of, record, write
from tests.reference import RECORDS, REFERENCE


# ------------------------------------------------------------------ predictions
def test_writing_predictions_three_times_leaves_one_row_per_key(engine: Engine) -> None:
    rows = pl.concat([prediction_rows(IDS, model_version="risk:1"), prediction_rows(IDS[:3], model_version="risk:2")])
    changed = [write(engine, rows) for _ in range(3)]
    assert changed == [rows.height, 0, 0]

    stored = predictions_of(engine)
    assert stored.height == rows.height
    assert stored.select("record_id", "model_version").is_unique().all()
    assert stored.select(PREDICTION_COLUMNS).equals(rows.sort("record_id", "model_version"))
    for _ in range(2):
        write(engine, rows)
        assert predictions_of(engine).equals(stored)


def test_same_input_hash_is_a_no_op_and_a_changed_one_updates(engine: Engine) -> None:
    write(engine, prediction_rows(IDS, score=0.25, input_hash="hash-1", run_id="run-1"))
    original = predictions_of(engine)

    # A rerun's float noise (another forward batch size) is the same answer.
    replay = prediction_rows(
        IDS, score=0.25 + 1e-7, input_hash="hash-1", run_id="run-2", produced_at=PRODUCED_AT + timedelta(1)
    )
    assert write(engine, replay) == 0
    assert predictions_of(engine).equals(original)

    corrected = prediction_rows(IDS[:1], score=0.75, input_hash="hash-2", run_id="run-3")
    assert write(engine, corrected) == 1
    stored = predictions_of(engine)
    assert stored.height == len(IDS)
    assert stored.select(PREDICTION_COLUMNS).row(0, named=True) == corrected.row(0, named=True)
    assert stored.slice(1).equals(original.slice(1))


def test_a_rescore_by_changed_code_rewrites_the_batch_answer_it_changed(engine: Engine) -> None:
    """The rescore a bumped PREDICTIONS_CODE_VERSION asks for: same model, record and history, new
    feature or scoring code. Its scores must replace the old code's; they used to be discarded."""
    write(engine, prediction_rows(IDS, score=0.25, input_hash="hash-1", run_id="run-1"))
    original = predictions_of(engine)

    rescored = prediction_rows(IDS[:1], score=0.75, input_hash="hash-1", run_id="rescore")
    assert write(engine, rescored) == 1
    stored = predictions_of(engine)
    assert stored.select(PREDICTION_COLUMNS).row(0, named=True) == rescored.row(0, named=True)
    assert stored.slice(1).equals(original.slice(1))


def test_a_key_repeated_in_one_write_keeps_the_last_row(engine: Engine) -> None:
    rows = pl.concat(
        [
            prediction_rows(IDS[:1], input_hash="hash-1", score=0.1),
            prediction_rows(IDS[:1], input_hash="hash-2", score=0.2),
        ]
    )
    assert write(engine, rows) == 1
    stored = predictions_of(engine)
    assert stored["input_hash"].to_list() == ["hash-2"]
    assert stored["score"].to_list() == [0.2]


@pytest.mark.parametrize("count", [POSTGRES_ROWS_WITHOUT_STAGING, POSTGRES_ROWS_WITHOUT_STAGING + 1])
def test_a_write_with_or_without_staging_stores_and_counts_alike(engine: Engine, count: int) -> None:
    """PostgreSQL upserts a few rows as parameters and more through a staging table: the rows
    stored and the changes counted must not tell the two apart (nor SQLite's one way)."""
    ids = [f"tx-{i:03d}" for i in reversed(range(count))]  # out of key order
    first = prediction_rows(ids, input_hash="hash-1")
    assert write(engine, first) == count
    assert write(engine, first) == 0  # a replay changes nothing

    corrected = prediction_rows(ids[: count // 2], input_hash="hash-2", run_id="run-2")
    assert write(engine, pl.concat([corrected, first.slice(count // 2)])) == count // 2
    expected = pl.concat([corrected, first.slice(count // 2)]).sort("record_id")
    assert predictions_of(engine).select(PREDICTION_COLUMNS).equals(expected)


@pytest.mark.postgres
def test_concurrent_writers_leave_one_row_per_key(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    upgrade(engine, REFERENCE)
    workers, count, repeats = 4, 300, 4
    jobs = [(postgres_url, w, w * 100, count, repeats) for w in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        changed = pool.starmap(upsert_repeatedly, jobs)

    stored = predictions_of(engine)
    expected_ids = {f"tx-{i:05d}" for i in range((workers - 1) * 100 + count)}
    assert set(stored["record_id"]) == expected_ids
    assert stored.height == len(expected_ids)
    assert stored.select("record_id", "model_version").is_unique().all()
    # Every writer's last round sends the last hash, so that is what each key ends with.
    assert set(stored["input_hash"]) == {f"hash-{repeats - 1}"}
    # How often a key flips depends on interleaving; it is inserted once and never written more than sent.
    assert len(expected_ids) <= sum(changed) <= workers * count * repeats
    engine.dispose()


# ------------------------------------------------------------------ both paths' answers
def _rows_by_path(engine: Engine) -> dict[str, list[dict[str, Any]]]:
    stored = predictions_of(engine).to_dicts()
    return {path: [row for row in stored if row["path"] == path] for path in ("batch", "online")}


@pytest.mark.parametrize("first", ["online", "batch"])
def test_both_paths_answers_to_the_same_key_are_kept(engine: Engine, first: str) -> None:
    """Same transaction, model version, input and history: before 0005 the second writer was folded
    into the first's row; now each path's answer is a row of its own, and neither changes the other."""
    answers = {
        "online": answer("tx-1", path="online", score=0.25, produced_at=PRODUCED_AT),
        "batch": answer("tx-1", path="batch", score=0.26, partition_key="2026-11-01", produced_at=PRODUCED_AT),
    }
    second = "batch" if first == "online" else "online"
    assert write_answers(engine, answers[first]) == 1
    (kept,) = _rows_by_path(engine)[first]
    assert write_answers(engine, answers[second]) == 1

    rows = _rows_by_path(engine)
    assert rows[first] == [kept]
    (other,) = rows[second]
    expected_key = "" if second == "batch" else "input-1|history-1"
    assert (other["score"], other["answer_key"]) == (answers[second]["score"], expected_key)
    # Replays of either answer change nothing: an online one even with another score (an answer a
    # client received stands), a batch one with the same score (a rerun of unchanged code).
    replays = [
        {**answers["online"], "score": 0.99, "request_id": "req-retry"},
        {**answers["batch"], "run_id": "run-retry"},
    ]
    assert write_answers(engine, *replays) == 0
    assert predictions_of(engine).height == 2


def test_every_distinct_online_answer_is_a_row_and_degraded_ones_are_marked(engine: Engine) -> None:
    write_answers(
        engine,
        answer("tx-1", path="online", score=0.2),
        answer("tx-1", path="online", score=0.3, history_hash="history-2"),
        answer("tx-1", path="online", score=0.4, input_hash="input-2"),
        answer("tx-1", path="online", score=0.5, degraded=True),
    )
    stored = sorted(_rows_by_path(engine)["online"], key=lambda row: row["score"])
    assert [(row["answer_key"], row["degraded"]) for row in stored] == [
        ("input-1|history-1", False),
        ("input-1|history-2", False),
        ("input-2|history-1", False),
        ("input-1|nohistory", True),
    ]


def test_answer_pairs_compare_each_online_answer_with_the_right_batch_answer(engine: Engine) -> None:
    with engine.begin() as conn:
        upsert_records(
            REFERENCE,
            conn,
            validate(REFERENCE, frame_of(*(record(transaction_id=tx) for tx in ("tx-a", "tx-b", "tx-c")))),
            DAY,
        )
        upsert_records(
            REFERENCE, conn, validate(REFERENCE, frame_of(record(transaction_id="tx-other-day"))), DAY + timedelta(1)
        )
    t0 = datetime(2026, 11, 2, tzinfo=UTC)
    key = DAY.isoformat()
    write_answers(
        engine,
        # tx-a: batch answers under v1 and (newer) v2; online answers under v1 and v3.
        answer("tx-a", path="batch", score=0.1, model_version="v1", partition_key=key, produced_at=t0),
        answer("tx-a", path="batch", score=0.2, model_version="v2", partition_key=key, produced_at=t0 + timedelta(1)),
        answer("tx-a", path="online", score=0.11, model_version="v1", produced_at=t0 - timedelta(hours=2)),
        answer("tx-a", path="online", score=0.33, model_version="v3", produced_at=t0 - timedelta(hours=1)),
        # tx-b: two online answers (a retry with a changed body), one batch answer.
        answer("tx-b", path="batch", score=0.5, model_version="v1", partition_key=key, produced_at=t0),
        answer("tx-b", path="online", score=0.5, model_version="v1", produced_at=t0 - timedelta(hours=2)),
        answer("tx-b", path="online", score=0.6, model_version="v1", input_hash="input-2", produced_at=t0),
        # tx-c: answered online only (say batch rejected it).
        answer("tx-c", path="online", score=0.7, model_version="v1", produced_at=t0),
        # Another day's transaction, and an online answer to a transaction never stored.
        answer("tx-other-day", path="online", score=0.7, model_version="v1", produced_at=t0),
        answer("tx-never-stored", path="online", score=0.7, model_version="v1", produced_at=t0),
    )
    with engine.connect() as conn:
        pairs = answer_pairs(REFERENCE, conn, DAY)
    compared = ("online_model_version", "online_score", "online_input_hash", "batch_model_version", "batch_score")
    got = pairs.select("record_id", *compared).rows()
    assert got == [
        ("tx-a", "v1", 0.11, "input-1", "v1", 0.1),  # the same version's batch answer
        ("tx-a", "v3", 0.33, "input-1", "v2", 0.2),  # none under v3: the newest batch answer
        ("tx-b", "v1", 0.5, "input-1", "v1", 0.5),
        ("tx-b", "v1", 0.6, "input-2", "v1", 0.5),
        ("tx-c", "v1", 0.7, "input-1", None, None),
    ]
    assert pairs["online_produced_at"].dtype == pl.Datetime("us", "UTC")
    assert pairs.filter(pl.col("batch_run_id").is_not_null())["batch_run_id"].unique().to_list() == ["run-1"]


# ------------------------------------------------------------------ quarantine
def rejected_rows(engine: Engine) -> pl.DataFrame:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(rejected_records).order_by(rejected_records.c.rejection_id)).mappings().all()
    return pl.DataFrame([dict(r) for r in rows], infer_schema_length=None)


def test_quarantine_is_idempotent_on_the_rejection_key(engine: Engine) -> None:
    bad = validate(
        REFERENCE,
        frame_of(
            record(transaction_id="bad-1", currency="US$"),
            record(transaction_id="bad-2", amount=math.nan),
            record(transaction_id="bad-3", event_time="yesterday"),
        ),
    )

    def send(frame: pl.DataFrame, run_id: str) -> None:
        with engine.begin() as conn:
            quarantine(
                REFERENCE,
                conn,
                frame,
                path=ResultPath.BATCH,
                stage=RejectStage.SCORE,
                partition_key="2026-11-01",
                run_id=run_id,
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
    send(validate(REFERENCE, frame_of(record(transaction_id="bad-1", currency="EURO"))), "run-4")
    assert rejected_rows(engine).height == 4


# ------------------------------------------------------------------ transactions
def test_upsert_records_changes_only_what_changed(engine: Engine) -> None:
    checked = validate(REFERENCE, generate_day(DAY, DemoConfig(seed=6, rows_per_day=120, poison_rate=0.0)))
    with engine.begin() as conn:
        assert upsert_records(REFERENCE, conn, checked, DAY) == checked.height
    with engine.begin() as conn:
        assert upsert_records(REFERENCE, conn, checked, DAY) == 0

    def ingested_at() -> dict[str, object]:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(RECORDS.c.transaction_id, RECORDS.c.ingested_at)).all()
        return {transaction_id: moment for transaction_id, moment in rows}

    before = ingested_at()
    target = checked["transaction_id"][17]
    corrected = checked.with_columns(
        amount=pl.when(pl.col("transaction_id") == target).then(pl.col("amount") + 1.0).otherwise(pl.col("amount"))
    )
    with engine.begin() as conn:
        assert upsert_records(REFERENCE, conn, corrected, DAY) == 1
    after = ingested_at()
    assert len(after) == checked.height
    assert [tx for tx in after if after[tx] != before[tx]] == [target]

    with engine.connect() as conn:
        stored = read_partition_rows(REFERENCE, conn, DAY)
    assert stored.height == checked.height
    assert stored.filter(pl.col("transaction_id") == target)["amount"].to_list() == [
        checked.filter(pl.col("transaction_id") == target)["amount"][0] + 1.0
    ]


def test_a_streamed_partition_reads_back_every_stored_value_exactly(engine: Engine) -> None:
    """The batch path's chunked read (COPY's CSV on PostgreSQL) against the row-by-row read: text
    that CSV must quote, NULL against the empty string and against the text NULL, non-finite
    amounts, microseconds, and an account spread over several chunks."""
    awkward_text = ["a,b", 'say "hi"', "line\nbreak", "cr\rlf", "\\N", "NULL", "", "  padded  ", "naïve ☃"]
    records = [
        record(transaction_id=f"tx-{i:02d}", account_id="acct-1", merchant_category=text, event_time=None)
        for i, text in enumerate(awkward_text)
    ]
    records += [
        record(transaction_id="tx-20", account_id="acct-2", amount=math.nan),
        record(transaction_id="tx-21", account_id="acct-2", amount=math.inf),
        record(transaction_id="tx-22", account_id="acct-2", amount=-math.inf, currency=None),
        record(transaction_id="tx-23", account_id="acct-2", amount=5e-324, event_time="2026-11-01T12:00:00.000001Z"),
        record(transaction_id="tx-24", account_id="acct-2", amount=None, event_time="not a time"),
        record(transaction_id="tx-25", account_id="acct-3", amount=0.1, event_time="1969-12-31T23:59:59.999999Z"),
    ]
    with engine.begin() as conn:
        upsert_records(REFERENCE, conn, validate(REFERENCE, frame_of(*records)), DAY)

    chunks = list(stream_partition_rows(REFERENCE, engine, DAY, chunk_rows=4))
    with engine.connect() as conn:
        row_by_row = read_partition_rows(REFERENCE, conn, DAY)
        stored_hashes = dict(conn.execute(sa.select(RECORDS.c.transaction_id, RECORDS.c.input_hash)).all())

    assert [chunk.height for chunk in chunks] == [4, 4, 4, 3]
    streamed = pl.concat(chunks)
    assert streamed.drop("input_hash").equals(row_by_row, null_equal=True)
    assert dict(zip(streamed["transaction_id"], streamed["input_hash"], strict=True)) == stored_hashes
    texts = streamed.filter(pl.col("account_id") == "acct-1")["merchant_category"].to_list()
    # Stored stripped: `raw_frame` strips the text fields, as a request's model does.
    assert sorted(texts) == sorted(text.strip() for text in awkward_text)
