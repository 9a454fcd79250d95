"""The batch path without Dagster: ingest a day, score the stored partition, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import date, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.batch import IngestReport, ingest_day
from inference.contract import FrameHistory, TorchPredictor
from inference.demo import day_range
from inference.features import FeatureBatch
from inference.migrate import upgrade
from inference.model import score_batch
from inference.parity import PARITY_TOLERANCE
from inference.records import hash_inputs, raw_frame, validate
from inference.sources import FileSource, SqlSource
from inference.store import (
    StoreHistory,
    make_engine,
    mark_rejections_fixed,
    partition_counts,
    read_partition_rows,
    rejected_records,
    stale_scored_partitions,
    upsert_records,
    utc_now,
)
from tandem_specs.transactions.demo import EXPECTED_REASON, DemoConfig, PoisonKind, generate_day
from tandem_specs.transactions.model import ModelConfig
from tests.inference.support import (
    DAY,
    ingest_days,
    predictions_of,
    record,
    rejections,
    score_day,
    untrained_model,
    untrained_predictor,
)
from tests.reference import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES, RAW_COLUMNS, RECORDS, REFERENCE, Transaction
from tests.shared import fresh_postgres_database, until

pytestmark = pytest.mark.usefixtures("torch_single_thread")

CONFIG = DemoConfig(seed=5, rows_per_day=600, poison_rate=0.05)
DAYS = day_range(DAY, 2)
HISTORY = ModelConfig().history_length


def test_every_row_is_scored_or_quarantined_with_its_reason(engine: Engine) -> None:
    ingested = ingest_days(engine, CONFIG, DAYS)
    for day in DAYS:
        source = generate_day(day, CONFIG)
        report = score_day(engine, day)
        stored = ingested[day].rows_stored

        assert ingested[day].rows_received == CONFIG.rows_per_day
        assert report.rows_in == stored
        assert report.scored + report.rejected == stored
        assert stored + ingested[day].rejected_at_ingest == CONFIG.rows_per_day

        scored_ids = set(predictions_of(engine, partition_key=day.isoformat())["record_id"])
        clean_ids = set(source.filter(pl.col("poison_kind").is_null())["transaction_id"])
        assert scored_ids == clean_ids
        assert len(scored_ids) == report.scored

        quarantined = rejections(engine).filter(pl.col("partition_key") == day.isoformat())
        seen = set(quarantined.select("record_id", "reason").iter_rows())
        poisoned = source.filter(pl.col("poison_kind").is_not_null())
        for transaction_id, kind in poisoned.select("transaction_id", "poison_kind").iter_rows():
            assert (transaction_id, EXPECTED_REASON[PoisonKind(kind)]) in seen, (transaction_id, kind)
        assert quarantined.height == poisoned.height
        # Repeated ids cannot even be stored, so they are quarantined at ingest; the rest at scoring.
        by_stage = Counter(quarantined["stage"])
        assert by_stage["ingest"] == ingested[day].rejected_at_ingest
        assert by_stage["score"] == report.rejected

        expected_reasons = Counter(
            EXPECTED_REASON[PoisonKind(kind)]
            for kind in poisoned["poison_kind"]
            if kind != PoisonKind.DUPLICATE_ID.value
        )
        assert report.rejected_by_reason == expected_reasons

    scores = predictions_of(engine)["score"]
    assert ((scores > 0) & (scores < 1)).all()


def test_rescoring_a_partition_changes_nothing(engine: Engine) -> None:
    ingest_days(engine, CONFIG, DAYS)
    day = DAYS[-1]
    first = score_day(engine, day, run_id="run-1")
    predictions = predictions_of(engine)
    quarantined = rejections(engine)
    assert first.rows_written == first.scored

    for rerun in (2, 3):
        again = score_day(engine, day, run_id=f"run-{rerun}")
        assert again.rows_written == 0
        assert (again.scored, again.rejected) == (first.scored, first.rejected)
        # Rows and values identical, lineage included: a replay of the same input writes nothing.
        assert predictions_of(engine).equals(predictions)
        now = rejections(engine)
        assert now.drop("seen_count", "last_seen").equals(quarantined.drop("seen_count", "last_seen"))
        scoring = pl.col("stage") == "score"
        assert set(now.filter(scoring)["seen_count"]) == {rerun}


def test_small_chunks_give_the_same_scores_as_one_chunk(engine: Engine) -> None:
    """Small chunks split accounts across chunk boundaries, so only a correct history carry-over
    reproduces the single-chunk features. One item per forward pass keeps the model's own
    arithmetic out of the comparison: a float32 GEMM may round an item differently depending on
    how many rows share its batch (the parity check tolerates that, see inference/parity.py)."""
    ingest_days(engine, CONFIG, DAYS)
    day = DAYS[-1]
    for version, chunk_rows in (("one-chunk", 100_000), ("small-chunks", 97)):
        scorer = untrained_predictor(version, forward_batch_size=1)
        report = score_day(engine, day, scorer, chunk_rows=chunk_rows)
        assert report.chunks == (1 if chunk_rows > CONFIG.rows_per_day else -(-report.rows_in // chunk_rows))
    whole = predictions_of(engine, model_version="one-chunk")
    chunked = predictions_of(engine, model_version="small-chunks")
    assert whole["record_id"].equals(chunked["record_id"])
    assert np.array_equal(whole["score"].to_numpy(), chunked["score"].to_numpy())
    assert whole["input_hash"].equals(chunked["input_hash"])

    # With the usual large forward batches the same holds to within float32 rounding.
    score_day(engine, day, scorer=untrained_predictor("batched-chunks"), chunk_rows=97)
    batched = predictions_of(engine, model_version="batched-chunks")
    assert batched["record_id"].equals(whole["record_id"])
    assert np.allclose(batched["score"].to_numpy(), whole["score"].to_numpy(), rtol=0, atol=1e-6)


def test_unseen_values_are_scored_flagged_and_counted(engine: Engine) -> None:
    drifting = DemoConfig(seed=5, rows_per_day=600, poison_rate=0.05, unseen_rate=0.02)
    for day in DAYS:
        ingest_day(REFERENCE, engine, generate_day(day, drifting), day)
    day = DAYS[-1]
    clean = generate_day(day, drifting).filter(pl.col("poison_kind").is_null())
    vocabularies = {"country": COUNTRIES, "currency": CURRENCIES, "merchant_category": MERCHANT_CATEGORIES}
    expected = {
        row["transaction_id"]: ",".join(name for name, known in vocabularies.items() if row[name] not in known) or None
        for row in clean.iter_rows(named=True)
    }
    assert sum(flag is not None for flag in expected.values()) == round(600 * 0.02)

    report = score_day(engine, day)

    stored = predictions_of(engine, partition_key=day.isoformat())
    assert dict(zip(stored["record_id"], stored["unseen_fields"], strict=True)) == expected
    assert stored["score"].is_finite().all()
    flags = [flag for flag in expected.values() if flag is not None]
    assert report.scored_with_unseen == len(flags)
    assert report.unseen_by_field == Counter(name for flag in flags for name in flag.split(","))
    assert set(report.unseen_by_field) == set(vocabularies)


def test_a_padded_file_row_is_stored_and_scored_as_the_request_naming_it(engine: Engine) -> None:
    """A file's cells arrive as written: ingest strips the text fields as a request's model does,
    so the batch path stores, hashes and scores the transaction a request would name, under the
    same account. A time that is the year 0 in UTC is quarantined and never stored as a time:
    before, that one row failed the day's ingest on PostgreSQL (which has no year 0) and every
    scoring of the day on SQLite."""
    day = DAYS[0]
    rows = generate_day(day, DemoConfig(seed=5, rows_per_day=40, poison_rate=0.0)).select(RAW_COLUMNS).head(3)
    as_sent = rows.to_dicts()
    padded = rows.with_columns(
        transaction_id=" " + pl.col("transaction_id") + "\t",
        account_id="\u00a0" + pl.col("account_id"),
        currency=pl.col("currency") + " ",
        country=" " + pl.col("country"),
        merchant_category=pl.col("merchant_category") + "\n",
    )
    before_year_1 = rows.head(1).with_columns(
        transaction_id=pl.lit("year-0"), event_time=pl.lit("0001-01-01T00:00:00+01:00")
    )
    ingest_day(REFERENCE, engine, pl.concat([padded, before_year_1]), day)

    with engine.connect() as conn:
        stored = read_partition_rows(REFERENCE, conn, day)
        hashes = dict(conn.execute(sa.select(RECORDS.c.transaction_id, RECORDS.c.input_hash)).all())
    assert sorted(stored["transaction_id"]) == sorted([*rows["transaction_id"], "year-0"])
    assert stored.filter(pl.col("transaction_id") == "year-0")["event_ts"].to_list() == [None]
    for sent in as_sent:
        request = Transaction(**{**sent, "transaction_id": f" {sent['transaction_id']} "}).to_raw()
        assert (
            hashes[sent["transaction_id"]]
            == hash_inputs(REFERENCE, validate(REFERENCE, raw_frame(REFERENCE, [request])))[0]
        )

    report = score_day(engine, day)
    assert (report.scored, report.rejected) == (3, 1)
    answers = predictions_of(engine, partition_key=day.isoformat())
    assert sorted(answers["record_id"]) == sorted(rows["transaction_id"])
    quarantined = rejections(engine).filter(pl.col("record_id") == "year-0")
    assert quarantined["reason"].to_list() == ["timestamp_unparsable"]


def test_a_row_its_source_could_not_read_is_quarantined_at_ingest_with_why(engine: Engine, tmp_path: Path) -> None:
    """A `false` where a category belongs, or a line that is not JSON, is quarantined at ingest as
    `malformed_row` with the line and the why; it is neither stored nor scored, and the day goes on."""
    day = DAYS[0]
    rows = generate_day(day, DemoConfig(seed=5, rows_per_day=40, poison_rate=0.0)).select(RAW_COLUMNS).head(3)
    lines = [json.dumps(row) for row in rows.to_dicts()]
    lines[1] = json.dumps({**rows.row(1, named=True), "merchant_category": False})
    (tmp_path / f"{day}.ndjson").write_text("\n".join([*lines, "{not json"]) + "\n")

    frame = FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}.ndjson").read(day).frame
    report = ingest_day(REFERENCE, engine, frame, day)

    assert (report.rows_received, report.rows_stored, report.rejected_at_ingest) == (4, 2, 2)
    with engine.connect() as conn:
        assert sorted(read_partition_rows(REFERENCE, conn, day)["transaction_id"]) == sorted([rows[0, 0], rows[2, 0]])
        r = rejected_records.c
        quarantined = conn.execute(sa.select(r.record_id, r.reason, r.stage, r.detail).order_by(r.detail)).all()
    assert [tuple(row) for row in quarantined] == [
        (rows[1, 0], "malformed_row", "ingest", "line 2: merchant_category: false is a JSON boolean, not text"),
        (
            None,
            "malformed_row",
            "ingest",
            "line 4: not JSON (key must be a string at line 1 column 2): {not json",
        ),
    ]


# The README's own bad row, with its id and currency padded as a hand-made export pads them.
AS_RECEIVED = {
    "transaction_id": " bad-1 ",
    "account_id": "a-1",
    "amount": "12;50",
    "currency": " USD",
    "merchant_category": "grocery",
    "country": "US",
    "event_time": "2026-11-03T09:30:00Z",
}


def _day_as(kind: str, tmp_path: Path, rows: list[dict[str, str]]) -> FileSource | SqlSource:
    """`rows` (every value text) as a user's CSV file, NDJSON file or SQL table of text columns."""
    if kind == "csv":
        pl.DataFrame(rows, schema=dict.fromkeys(RAW_COLUMNS, pl.String)).write_csv(tmp_path / f"{DAY}.csv")
        return FileSource(REFERENCE, str(tmp_path))
    if kind == "ndjson":
        # A JSON number where the text is one; the bad amount can only be a JSON string.
        numbers = {row["amount"]: float(row["amount"]) for row in rows if row["amount"] != AS_RECEIVED["amount"]}
        lines = [json.dumps({**row, "amount": numbers.get(row["amount"], row["amount"])}) for row in rows]
        (tmp_path / f"{DAY}.ndjson").write_text("\n".join(lines) + "\n")
        return FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}.ndjson")
    url = f"sqlite:///{tmp_path / 'source.db'}"
    source_engine = sa.create_engine(url)
    try:
        with source_engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE payments ({', '.join(f'{name} TEXT' for name in RAW_COLUMNS)})"))
            conn.execute(
                sa.text(f"INSERT INTO payments VALUES ({', '.join(f':{name}' for name in RAW_COLUMNS)})"), rows
            )
    finally:
        source_engine.dispose()
    return SqlSource(REFERENCE, url, f"SELECT {', '.join(RAW_COLUMNS)} FROM payments")


@pytest.mark.parametrize(
    ("kind", "reason", "amount", "detail"),
    [
        ("csv", "amount_unparsable", "12;50", None),
        ("sql", "amount_unparsable", "12;50", None),
        # A JSON string amount breaks the file's typing first, as a request's is a 422.
        ("ndjson", "malformed_row", '"12;50"', 'line 2: amount: "12;50" is a JSON string, not a number'),
    ],
)
def test_a_quarantined_row_keeps_every_field_as_received_under_its_first_broken_rule(
    engine: Engine, tmp_path: Path, kind: str, reason: str, amount: str, detail: str | None
) -> None:
    """`12;50` is an amount that is no number, not a non-finite one, and the quarantine keeps the
    text: before, it was `amount_not_finite` with no amount at all in its payload."""
    good = {**AS_RECEIVED, "transaction_id": "good-1", "amount": "12.50", "currency": "USD"}
    source = _day_as(kind, tmp_path, [good, AS_RECEIVED])

    report = ingest_day(REFERENCE, engine, source.read(DAY).frame, DAY)

    assert (report.rows_received, report.rows_stored, report.rejected_at_ingest) == (2, 1, 1)
    with engine.connect() as conn:
        assert read_partition_rows(REFERENCE, conn, DAY)["transaction_id"].to_list() == ["good-1"]
        r = rejected_records.c
        (row,) = conn.execute(sa.select(r.record_id, r.stage, r.reason, r.detail, r.payload)).all()
    assert (row.record_id, row.stage, row.reason, row.detail) == ("bad-1", "ingest", reason, detail)
    assert json.loads(row.payload) == {**AS_RECEIVED, "amount": amount}


def test_rows_refused_at_ingest_count_against_the_day_until_its_source_stops_sending_them(
    engine: Engine, tmp_path: Path
) -> None:
    """A file of decimal-comma amounts is refused at ingest, row by row: before, nothing was stored,
    the reject rate read 0 of 0 and the day passed. A corrected file resolves the rejections."""
    good = {**AS_RECEIVED, "transaction_id": "good-1", "amount": "12.50", "currency": "USD"}
    source = _day_as("csv", tmp_path, [good, AS_RECEIVED])

    def counts() -> tuple[int, int, float]:
        with engine.connect() as conn:
            read = partition_counts(
                REFERENCE, conn, partition_date=DAY, partition_key=DAY.isoformat(), model_version="none"
            )
        return read.input_rows, read.rejected_at_ingest, read.reject_rate

    ingest_day(REFERENCE, engine, source.read(DAY).frame, DAY)
    ingest_day(REFERENCE, engine, source.read(DAY).frame, DAY)  # the same file again: still refused, seen twice
    assert counts() == (1, 1, 0.5)
    with engine.connect() as conn:
        assert conn.execute(sa.select(rejected_records.c.seen_count)).scalar_one() == 2

    corrected = _day_as("csv", tmp_path, [good, {**AS_RECEIVED, "amount": "12.50"}])
    ingest_day(REFERENCE, engine, corrected.read(DAY).frame, DAY)

    assert counts() == (2, 0, 0.0)
    with engine.connect() as conn:
        r = rejected_records.c
        assert conn.execute(sa.select(r.resolved, r.resolution)).one() == (True, "superseded")


@pytest.mark.parametrize(("chunk_rows", "pipelined"), [(8192, True), (2, True), (1, False)])
def test_a_late_record_reads_the_history_the_online_path_reads(
    engine: Engine, chunk_rows: int, pipelined: bool
) -> None:
    """A late record (the day before's event, in this day's file) comes before most of that day's
    rows of its account. Before, the batch path took only the account's K latest rows of earlier
    days, all after the record, and scored it as if the account had no history, where the online
    path read its three real predecessors: a wrong score stored silently, `history_changed` in
    path_agreement. Every row of the day must read what the store says precedes it, whatever
    the chunks (two or one row here, so the account spans them)."""
    day, before = DAY, DAY - timedelta(days=1)

    def row(transaction_id: str, at: str, amount: float, category: str = "grocery") -> dict[str, object]:
        return {
            "transaction_id": transaction_id,
            "account_id": "acct-late",
            "amount": amount,
            "currency": "EUR",
            "merchant_category": category,
            "country": "DE",
            "event_time": at,
        }

    morning = [row(f"morning-{i}", f"{before}T0{i + 1}:00:00Z", 20.0 + i) for i in range(3)]
    evening = [row(f"evening-{i:02d}", f"{before}T20:{i:02d}:00Z", 900.0 + i, "jewelry") for i in range(HISTORY)]
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, morning + evening), before)
    late = [row("late-1", f"{before}T10:00:00Z", 25.0), row("late-2", f"{before}T21:30:00Z", 30.0, "fuel")]
    today = [row(f"today-{i}", f"{day}T0{i + 1}:00:00Z", 40.0 + i) for i in range(3)]
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, late + today), day)
    scorer = untrained_predictor(forward_batch_size=1)
    score_day(engine, day, scorer, chunk_rows=chunk_rows, pipelined=pipelined)

    batch = predictions_of(engine, partition_key=day.isoformat()).sort("record_id")
    online = scorer.predict(raw_frame(REFERENCE, late + today), StoreHistory(REFERENCE, engine)).sort("record_id")
    assert batch["record_id"].to_list() == sorted(r["transaction_id"] for r in late + today)
    assert batch["history_hash"].to_list() == online["history_hash"].to_list()
    assert np.allclose(batch["score"].to_numpy(), online["score"].to_numpy(), rtol=0, atol=PARITY_TOLERANCE)
    no_history = scorer.predict(raw_frame(REFERENCE, late[:1]), FrameHistory(REFERENCE, raw_frame(REFERENCE, late[:1])))
    assert batch["history_hash"][0] != no_history["history_hash"][0]


def open_rejections(engine: Engine, day: date) -> list[tuple[str, str, bool, str | None]]:
    r = rejected_records.c
    stmt = (
        sa.select(r.record_id, r.reason, r.resolved, r.resolution)
        .where(r.partition_key == day.isoformat(), r.stage == "score")
        .order_by(r.rejection_id)
    )
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(stmt)]


def accounted_for(engine: Engine, day: date, model_version: str) -> tuple[int, int, int]:
    with engine.connect() as conn:
        counts = partition_counts(
            REFERENCE, conn, partition_date=day, partition_key=day.isoformat(), model_version=model_version
        )
    return counts.input_rows, counts.scored, counts.rejected


def test_a_record_one_model_refused_is_no_longer_rejected_once_another_scores_it(engine: Engine) -> None:
    """v1 cannot score a record (a non-finite score), the promoted v2 can: the record's answer is
    now its score. Before, v1's rejection stayed open and the record counted as scored AND
    rejected (the rows_accounted_for check failed, the reject rate stayed up)."""

    def overflows_on_large_amounts(features: FeatureBatch) -> np.ndarray:
        scores = score_batch(untrained_model(), features)
        scores[features.arrays[1][:, 0] > np.log1p(5000.0)] = np.nan  # amount_log
        return scores

    v1 = TorchPredictor(
        model=untrained_model(),
        model_version="risk:v1",
        spec=REFERENCE,
        forward_batch_size=1,
        forward=overflows_on_large_amounts,
    )
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [record(), record(transaction_id="tx-2", amount=9000.0)]), DAY)

    score_day(engine, DAY, scorer=v1, run_id="nightly")
    assert open_rejections(engine, DAY) == [("tx-2", "nonfinite_score", False, None)]
    assert accounted_for(engine, DAY, "risk:v1") == (2, 1, 1)

    report = score_day(engine, DAY, scorer=untrained_predictor("risk:v2"), run_id="after-promotion")
    assert (report.scored, report.rejected) == (2, 0)
    assert open_rejections(engine, DAY) == [("tx-2", "nonfinite_score", True, "superseded")]
    assert accounted_for(engine, DAY, "risk:v2") == (2, 2, 0)

    score_day(engine, DAY, scorer=v1, run_id="after-rollback")  # refused again: open again
    assert open_rejections(engine, DAY) == [("tx-2", "nonfinite_score", False, None)]
    assert accounted_for(engine, DAY, "risk:v1") == (2, 1, 1)


def test_a_record_refused_again_is_open_again(engine: Engine) -> None:
    """A resolved rejection whose record is refused again is reopened: counted against its
    partition and shown open in quarantine. Before, it stayed resolved, so the record was neither
    scored nor rejected (scored + rejected < input): an operator marked it fixed while the source
    still sent it, or the old bad version was re-sent after its correction."""
    bad, good = record(transaction_id="tx-2", currency="EURO"), record(transaction_id="tx-2", amount=7.0)
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [record(), bad]), DAY)
    score_day(engine, DAY, run_id="nightly")
    with engine.begin() as conn:
        ids = conn.execute(sa.select(rejected_records.c.rejection_id)).scalars().all()
        assert mark_rejections_fixed(conn, ids) == 1

    ingest_day(
        REFERENCE, engine, raw_frame(REFERENCE, [record(), bad]), DAY
    )  # the fixed-rejects rerun; the source is not fixed
    score_day(engine, DAY, run_id="fixed-rerun")
    assert open_rejections(engine, DAY) == [("tx-2", "bad_currency", False, None)]
    assert accounted_for(engine, DAY, "risk:untrained") == (2, 1, 1)

    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [record(), good]), DAY)
    score_day(engine, DAY, run_id="corrected")
    assert open_rejections(engine, DAY) == [("tx-2", "bad_currency", True, "superseded")]
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [record(), bad]), DAY)  # the old version re-sent
    score_day(engine, DAY, run_id="bad-again")
    assert open_rejections(engine, DAY) == [("tx-2", "bad_currency", False, None)]
    assert accounted_for(engine, DAY, "risk:untrained") == (2, 1, 1)


def test_a_nul_in_a_text_field_quarantines_its_row_at_ingest_and_the_day_is_stored(engine: Engine) -> None:
    """PostgreSQL text cannot hold NUL: before, one such row failed the whole day's COPY at every
    retry (0 rows stored, 0 quarantined) while SQLite stored it."""
    nul_rows = [
        record(transaction_id="nul\x00id"),
        record(transaction_id="tx-2", account_id="acct\x00"),
        record(transaction_id="tx-3", merchant_category="groc\x00ery"),
        record(transaction_id="tx-4", event_time="2026-11-01T12:00:00Z\x00"),
    ]
    report = ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [record(), *nul_rows]), DAY)
    assert (report.rows_stored, report.rejected_at_ingest) == (1, 4)

    r = rejected_records.c
    with engine.connect() as conn:
        quarantined = conn.execute(sa.select(r.record_id, r.reason, r.stage, r.payload).order_by(r.record_id)).all()
    assert [(row.record_id, row.reason, row.stage) for row in quarantined] == [
        ("nul\\x00id", "nul_character", "ingest"),
        ("tx-2", "nul_character", "ingest"),
        ("tx-3", "nul_character", "ingest"),
        ("tx-4", "nul_character", "ingest"),
    ]
    assert "acct\\u0000" in quarantined[1].payload  # the record as received, NUL escaped
    scored = score_day(engine, DAY)
    assert (scored.scored, scored.rejected) == (1, 0)


def test_payments_of_one_second_are_ordered_by_the_bytes_of_their_ids_on_both_paths(postgres_admin_url: str) -> None:
    """Two payments of one account at the same second: which is the other's history is decided by
    transaction_id. Polars orders bytes (`B-2` before `a-1`); PostgreSQL ordered by the database's
    collation, and under en-US (the official image's default locale) `a-1` came first: the batch
    answer read `B-2` as history and the online path, on the same store, did not."""
    linguistic = "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
    with fresh_postgres_database(postgres_admin_url, options=linguistic) as url:
        engine = make_engine(url)
        try:
            upgrade(engine, REFERENCE)
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT 'a-1' < 'B-2'")).scalar_one()  # the collation at work
            ingest_day(
                REFERENCE,
                engine,
                raw_frame(REFERENCE, [record(transaction_id="p-1", account_id="acct", event_time=f"{DAY}T08:00:00Z")]),
                DAY,
            )
            later = DAY + timedelta(days=1)
            same_second = [
                record(transaction_id="B-2", account_id="acct", amount=10.0, event_time=f"{later}T12:00:00Z"),
                record(transaction_id="a-1", account_id="acct", amount=900.0, event_time=f"{later}T12:00:00Z"),
            ]
            ingest_day(REFERENCE, engine, raw_frame(REFERENCE, same_second), later)
            scorer = untrained_predictor(forward_batch_size=1)
            score_day(engine, later, scorer)

            batch = predictions_of(engine, partition_key=later.isoformat()).sort("record_id")
            online = pl.concat(
                [scorer.predict(raw_frame(REFERENCE, [row]), StoreHistory(REFERENCE, engine)) for row in same_second]
            )
            online = online.sort("record_id")
            assert batch["history_hash"].to_list() == online["history_hash"].to_list()
            assert np.allclose(batch["score"].to_numpy(), online["score"].to_numpy(), rtol=0, atol=PARITY_TOLERANCE)
        finally:
            engine.dispose()


@pytest.mark.parametrize("amount", [10.0, 99.0], ids=["same-content", "other-content"])
def test_an_id_another_day_holds_is_quarantined_not_moved_or_lost(engine: Engine, amount: float) -> None:
    """A later day's source repeats an id a stored day holds. Stored, it vanished (the same
    content: a no-op, yet counted as stored) or moved the record out of its day (other content):
    no rejection either way. It stays where it is, and the copy is quarantined saying where."""
    later = DAY + timedelta(days=1)
    first = record(transaction_id="t-1", amount=10.0, event_time=f"{DAY}T09:00:00Z")
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [first]), DAY)

    repeat = {**first, "amount": amount}
    report = ingest_day(
        REFERENCE,
        engine,
        raw_frame(REFERENCE, [repeat, record(transaction_id="t-2", event_time=f"{later}T09:00:00Z")]),
        later,
    )

    assert (report.rows_stored, report.rejected_at_ingest) == (1, 1)
    with engine.connect() as conn:
        assert read_partition_rows(REFERENCE, conn, DAY)["amount"].to_list() == [10.0]
        assert read_partition_rows(REFERENCE, conn, later)["transaction_id"].to_list() == ["t-2"]
        r = rejected_records.c
        quarantined = conn.execute(sa.select(r.record_id, r.reason, r.detail, r.partition_key)).all()
    assert [tuple(row) for row in quarantined] == [
        ("t-1", "duplicate_id", f"already stored under partition {DAY}", later.isoformat())
    ]
    # Its own day's correction still lands.
    assert ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [{**first, "amount": 12.0}]), DAY).rows_changed == 1


def test_an_id_two_days_ingested_at_once_both_hold_is_stored_once_and_quarantined_once(postgres_url: str) -> None:
    """A backfill ingests two days at once whose sources share an id: the second day's upsert waits
    for the first's commit and leaves the row in its day. Checked before the upsert, the second
    day saw nothing stored elsewhere and counted the row as its own: neither stored nor quarantined."""
    engine = make_engine(postgres_url)
    try:
        upgrade(engine, REFERENCE)
        later = DAY + timedelta(days=1)
        row = record(transaction_id="t-both", event_time=f"{DAY}T10:00:00Z")
        first = engine.connect()
        transaction = first.begin()
        upsert_records(
            REFERENCE, first, validate(REFERENCE, raw_frame(REFERENCE, [row])), DAY
        )  # DAY's ingest, not yet committed
        reports: list[IngestReport] = []
        second = threading.Thread(
            target=lambda: reports.append(ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [row]), later))
        )
        second.start()
        until(lambda: _waiting_on_a_lock(engine), message="the second ingest never waited on the first")
        transaction.commit()
        first.close()
        second.join(timeout=30)

        assert [(report.rows_stored, report.rejected_at_ingest) for report in reports] == [(0, 1)]
        with engine.connect() as conn:
            t, r = RECORDS.c, rejected_records.c
            assert conn.execute(sa.select(t.transaction_id, t.partition_date)).all() == [("t-both", DAY)]
            assert conn.execute(sa.select(r.record_id, r.reason, r.partition_key)).all() == [
                ("t-both", "duplicate_id", later.isoformat())
            ]
    finally:
        engine.dispose()


def _waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        waiting = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
    return bool(waiting)


@pytest.mark.parametrize(
    "correction",
    [{"account_id": "acct-other"}, {"event_time": f"{DAY + timedelta(days=2)}T12:00:00Z"}],
    ids=["to-another-account", "to-a-later-time"],
)
def test_a_correction_that_moves_a_record_reschedules_the_records_that_followed_its_old_place(
    engine: Engine, correction: dict[str, str]
) -> None:
    """`moved` was the history of `follower`, the next day's record of its account. Corrected to
    another account, or to a time after `follower`, it is no longer: `follower`'s answer is stale,
    but only the records after its new place were scheduled (the old place was not stored)."""
    later = DAY + timedelta(days=1)
    moved = record(transaction_id="moved", account_id="acct", amount=900.0, event_time=f"{DAY}T10:00:00Z")
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [moved]), DAY)
    ingest_day(
        REFERENCE,
        engine,
        raw_frame(REFERENCE, [record(transaction_id="follower", account_id="acct", event_time=f"{later}T10:00:00Z")]),
        later,
    )
    scorer = untrained_predictor(forward_batch_size=1)
    for day in (DAY, later):
        score_day(engine, day, scorer, run_id=f"run-{day}")
    before = utc_now()

    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [{**moved, **correction}]), DAY)

    with engine.connect() as conn:
        stale = stale_scored_partitions(REFERENCE, conn, changed_after=before, history_length=HISTORY)
    assert [change.partition_key for change in stale] == [DAY.isoformat(), later.isoformat()]


def test_an_invalid_record_is_no_follower_of_a_change(engine: Engine) -> None:
    """An invalid record is nobody's history and is quarantined whatever its history, so a change
    before it in its account does not make its day stale. Placed among the followers (it was
    ingested in the same interval), it made a late day's first ingest rescore a scored later day."""
    later, last = DAY + timedelta(days=1), DAY + timedelta(days=2)
    before = utc_now()
    invalid = record(transaction_id="invalid", account_id="acct", amount=-1.0, event_time=f"{later}T10:00:00Z")
    scored = record(transaction_id="scored", account_id="c", event_time=f"{later}T09:00:00Z")
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [invalid, scored]), later)
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [record(transaction_id="other", account_id="b")]), last)
    for day in (later, last):
        score_day(engine, day, untrained_predictor(forward_batch_size=1), run_id=f"run-{day}")

    late = record(transaction_id="late", account_id="acct", event_time=f"{DAY}T10:00:00Z")
    ingest_day(REFERENCE, engine, raw_frame(REFERENCE, [late]), DAY)

    with engine.connect() as conn:
        stale = stale_scored_partitions(REFERENCE, conn, changed_after=before, history_length=HISTORY)
    # `later` is still judged by when it was scored (it holds a change), never stale outright.
    assert [change.partition_key for change in stale if change.unanswered] == []
