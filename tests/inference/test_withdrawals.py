"""A re-sent day is the day: a stored record it no longer holds (missing from the corrected file,
or sent as a row ingest refuses) leaves the store with its batch answers, and the days whose
features read it as history are rescheduled. A re-send with nothing storable is refused."""

from __future__ import annotations

from datetime import date, timedelta

import polars as pl
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.batch import ingest_day
from inference.lineage import explain
from inference.records import raw_frame
from inference.store import (
    OnlineProducer,
    WithdrawalRefused,
    prediction_rows,
    predictions,
    read_partition_rows,
    rejected_records,
    stale_scored_partitions,
    upsert_predictions,
    utc_now,
    withdrawn_records,
)
from tandem_specs.transactions.model import ModelConfig
from tests.inference.support import DAY, record, score_day, untrained_predictor
from tests.reference import REFERENCE

pytestmark = pytest.mark.usefixtures("torch_single_thread")

HISTORY = ModelConfig().history_length
LATER = DAY + timedelta(days=1)
KEPT = record(transaction_id="kept", account_id="acct-k", event_time=f"{DAY}T08:00:00Z")
DROPPED = record(transaction_id="dropped", account_id="acct", amount=900.0, event_time=f"{DAY}T10:00:00Z")
FOLLOWER = record(transaction_id="follower", account_id="acct", event_time=f"{LATER}T10:00:00Z")


def _ingest(engine: Engine, day: date, *rows: dict[str, object]) -> int:
    return ingest_day(REFERENCE, engine, raw_frame(REFERENCE, list(rows)), day, run_id="run-ingest").rows_withdrawn


def _scored_days(engine: Engine) -> None:
    """DAY holds `kept` and `dropped`; LATER `follower`, whose history is `dropped`; both scored,
    and `dropped` answered online too."""
    _ingest(engine, DAY, KEPT, DROPPED)
    _ingest(engine, LATER, FOLLOWER)
    for day in (DAY, LATER):
        score_day(engine, day, untrained_predictor(), run_id=f"run-{day}")
    with engine.begin() as conn:
        rows = conn.execute(sa.select(predictions).where(predictions.c.record_id == "dropped")).mappings().one()
        upsert_predictions(
            conn,
            prediction_rows(
                pl.DataFrame(
                    {
                        "record_id": ["dropped"],
                        "score": [rows["score"]],
                        "input_hash": [rows["input_hash"]],
                        "history_hash": [rows["history_hash"]],
                        "unseen_fields": pl.Series([None], dtype=pl.String),
                    }
                ),
                producer=OnlineProducer(request_id="req-1", batch_id="batch-1", code_version="test"),
                model_version=rows["model_version"],
                produced_at=utc_now(),
            ),
        )


def _ids(engine: Engine, day: date) -> list[str]:
    with engine.connect() as conn:
        return sorted(read_partition_rows(REFERENCE, conn, day)["transaction_id"].to_list())


def _answers(engine: Engine, record_id: str) -> list[str]:
    with engine.connect() as conn:
        p = predictions.c
        return sorted(conn.execute(sa.select(p.path).where(p.record_id == record_id)).scalars())


def _withdrawn(engine: Engine) -> dict[str, tuple[str, str | None]]:
    with engine.connect() as conn:
        w = withdrawn_records.c
        return {row[0]: (row[1], row[2]) for row in conn.execute(sa.select(w.record_id, w.reason, w.entity))}


def test_a_record_missing_from_the_re_sent_day_leaves_the_store_and_its_followers_are_rescheduled(
    engine: Engine,
) -> None:
    _scored_days(engine)
    with engine.connect() as conn:
        before_history = conn.execute(
            sa.select(predictions.c.history_hash).where(predictions.c.record_id == "follower")
        ).scalar_one()
    before = utc_now()

    assert _ingest(engine, DAY, KEPT) == 1

    assert _ids(engine, DAY) == ["kept"]
    # Its batch answer goes with it; what a caller was told online stays.
    assert _answers(engine, "dropped") == ["online"]
    assert _withdrawn(engine) == {"dropped": ("not_resent", "acct")}
    lineage = explain(REFERENCE, engine, "dropped", dagster_ui_url="http://dagster")
    assert lineage.found and not lineage.source_found
    assert lineage.withdrawn is not None
    assert (lineage.withdrawn.partition_key, lineage.withdrawn.reason) == (DAY.isoformat(), "not_resent")
    assert lineage.withdrawn.dagster_run_url == "http://dagster/runs/run-ingest"
    assert [result.path for result in lineage.results] == ["online"]
    assert lineage.current is None  # what the caller was told, standing for nothing now
    with engine.connect() as conn:
        stale = stale_scored_partitions(REFERENCE, conn, changed_after=before, history_length=HISTORY)
    assert [change.partition_key for change in stale] == [DAY.isoformat(), LATER.isoformat()]
    assert all(change.unanswered for change in stale)

    score_day(engine, LATER, untrained_predictor(), run_id="rescore")
    with engine.connect() as conn:
        after_history = conn.execute(
            sa.select(predictions.c.history_hash).where(predictions.c.record_id == "follower")
        ).scalar_one()
    assert after_history != before_history  # no longer read as history


def test_a_stored_record_the_re_sent_day_sends_unreadable_is_withdrawn_beside_its_rejection(engine: Engine) -> None:
    _scored_days(engine)
    unreadable = {**DROPPED, "merchant_category": "gro\x00cery"}

    assert _ingest(engine, DAY, KEPT, unreadable) == 1

    assert _ids(engine, DAY) == ["kept"]
    assert _withdrawn(engine) == {"dropped": ("refused_at_ingest", "acct")}
    with engine.connect() as conn:
        r = rejected_records.c
        open_rejection = conn.execute(
            sa.select(r.stage, r.reason).where(r.record_id == "dropped", r.resolved.is_(False))
        ).one()
    assert tuple(open_rejection) == ("ingest", "nul_character")


def test_a_withdrawn_record_sent_again_is_stored_again(engine: Engine) -> None:
    _scored_days(engine)
    _ingest(engine, DAY, KEPT)
    before = utc_now()

    assert _ingest(engine, DAY, KEPT, DROPPED) == 0

    assert _ids(engine, DAY) == ["dropped", "kept"]
    assert _withdrawn(engine) == {}
    with engine.connect() as conn:
        stale = stale_scored_partitions(REFERENCE, conn, changed_after=before, history_length=HISTORY)
    # Back, with no batch answer: its day and its follower's are stale again.
    assert [change.partition_key for change in stale] == [DAY.isoformat(), LATER.isoformat()]


@pytest.mark.parametrize("rows", [[], [{**KEPT, "country": "D\x00E"}]], ids=["empty", "all-refused"])
def test_a_re_sent_day_with_nothing_storable_is_refused_and_changes_nothing(
    engine: Engine, rows: list[dict[str, object]]
) -> None:
    _scored_days(engine)

    with pytest.raises(WithdrawalRefused, match="refusing to withdraw its 2 stored records"):
        _ingest(engine, DAY, *rows)

    assert _ids(engine, DAY) == ["dropped", "kept"]
    assert _answers(engine, "dropped") == ["batch", "online"]
    assert _withdrawn(engine) == {}
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(rejected_records)).scalar_one() == 0
