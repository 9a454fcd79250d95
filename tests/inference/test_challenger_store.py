"""The challenger's tables in the result store (inference/store/challenger.py), on SQLite and on a
fresh PostgreSQL database: migration 0006 up and down, challenger answers kept apart from the
production ones and idempotent, the champion-challenger pairs and latencies the comparison reads,
and its reports. The comparison itself is test_challenger_gate.py.
"""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, timedelta
from typing import Any

import polars as pl
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from inference.batch import ingest_day
from inference.challenger import (
    AUC_NOT_WORSE,
    ENOUGH_EVIDENCE,
)
from inference.migrate import alembic_config, upgrade, upgrade_core
from inference.store import (
    COMPARISON_SCHEMA,
    challenger_predictions,
    challenger_reports,
    champion_challenger_pairs,
    latest_challenger_report,
    latest_replayed_day,
    make_engine,
    metadata,
    online_latencies,
    prediction_frame,
    predictions,
    record_challenger_report,
    upsert_challenger_predictions,
    upsert_predictions,
)
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.answers import answer
from tests.inference.support import current_revision, schema_diffs
from tests.reference import REFERENCE

CHAMPION, CHALLENGER = "risk_model:champion", "risk_model:challenger"


DAY_1, DAY_2 = date(2026, 11, 1), date(2026, 11, 2)


def count(engine: Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def write_challenger(engine: Engine, *rows: dict[str, Any]) -> int:
    with engine.begin() as conn:
        return upsert_challenger_predictions(conn, prediction_frame(list(rows)))


def write_production(engine: Engine, *rows: dict[str, Any]) -> int:
    with engine.begin() as conn:
        return upsert_predictions(conn, prediction_frame(list(rows)))


def ingest_two_days(engine: Engine) -> dict[date, pl.DataFrame]:
    """Two small demo days, labelled, without poison: transaction ids and labels per day."""
    stored = {}
    for day in (DAY_1, DAY_2):
        frame = generate_day(day, DemoConfig(seed=5, rows_per_day=40, poison_rate=0.0))
        ingest_day(REFERENCE, engine, frame, day)
        stored[day] = frame.select("transaction_id", "label_fraud")
    return stored


def test_the_migrated_schema_has_the_challenger_tables_at_head(engine: Engine) -> None:
    assert schema_diffs(engine) == []
    assert current_revision(engine) == ScriptDirectory.from_config(alembic_config()).get_current_head() == "0009"
    assert {"challenger_predictions", "challenger_reports"} <= set(sa.inspect(engine).get_table_names())
    assert [c.name for c in challenger_predictions.columns] == [c.name for c in predictions.columns]
    assert "challenger_reports" in metadata.tables


def test_upgrade_from_0005_adds_the_challenger_tables_and_keeps_the_answers(database_url: str) -> None:
    migrated = make_engine(database_url)
    try:
        upgrade_core(migrated, "0005")
        assert "challenger_predictions" not in sa.inspect(migrated).get_table_names()
        # Written as 0005's table holds it: keyed by transaction_id.
        old = sa.Table("predictions", sa.MetaData(), autoload_with=migrated)
        row = answer("tx-1", path="batch", score=0.5, partition_key="2026-11-01")
        with migrated.begin() as conn:
            conn.execute(old.insert().values(answer_key="", transaction_id=row.pop("record_id"), **row))
        upgrade(migrated, REFERENCE)
        assert current_revision(migrated) == "0009"  # 0006, 0007, record_id, then withdrawn_records
        assert schema_diffs(migrated) == []
        assert count(migrated, predictions) == 1
        assert count(migrated, challenger_predictions) == 0
    finally:
        migrated.dispose()


def test_downgrading_0006_drops_only_the_challenger_tables(database_url: str) -> None:
    migrated = make_engine(database_url)
    try:
        upgrade(migrated, REFERENCE)
        write_production(migrated, answer("tx-1", path="batch", score=0.5, partition_key="2026-11-01"))
        write_challenger(migrated, answer("tx-1", path="shadow", score=0.5, model_version=CHALLENGER))
        config = alembic_config()
        with migrated.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0005")
        names = set(sa.inspect(migrated).get_table_names())
        assert not names & {"challenger_predictions", "challenger_reports"}
        assert current_revision(migrated) == "0005"
        assert count(migrated, predictions) == 1
        upgrade(migrated, REFERENCE)
        assert schema_diffs(migrated) == []
    finally:
        migrated.dispose()


def test_challenger_answers_are_batch_or_shadow_never_online(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"'batch' or 'shadow', not \['online'\]"):
        write_challenger(
            engine,
            answer("tx-1", path="batch", score=0.1, model_version=CHALLENGER, partition_key="2026-11-01"),
            answer("tx-2", path="online", score=0.2, model_version=CHALLENGER),
        )
    assert count(engine, challenger_predictions) == 0
    assert write_challenger(engine, answer("tx-1", path="shadow", score=0.3, model_version=CHALLENGER)) == 1
    online_row = {**answer("tx-9", path="online", score=0.2, model_version=CHALLENGER), "answer_key": "x"}
    # The table's own constraint, below the function's check.
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.insert(challenger_predictions).values(**online_row))
    assert count(engine, challenger_predictions) == 1
    assert count(engine, predictions) == 0


def test_replaying_the_same_challenger_answers_is_idempotent(engine: Engine) -> None:
    rows = [
        answer(f"tx-{i}", path="batch", score=i / 10, model_version=CHALLENGER, partition_key="2026-11-01")
        for i in range(5)
    ]
    shadow = answer("tx-0", path="shadow", score=0.05, model_version=CHALLENGER)
    assert [write_challenger(engine, *rows, shadow) for _ in range(3)] == [6, 0, 0]
    assert count(engine, challenger_predictions) == 6
    assert count(engine, predictions) == 0, "nothing of the challenger's reaches the production answers"

    corrected = {**rows[0], "score": 0.99, "input_hash": "input-2", "run_id": "run-2"}
    assert write_challenger(engine, corrected) == 1
    with engine.connect() as conn:
        stored = conn.execute(
            sa.select(challenger_predictions.c.score, challenger_predictions.c.run_id).where(
                challenger_predictions.c.record_id == "tx-0", challenger_predictions.c.path == "batch"
            )
        ).one()
    assert tuple(stored) == (0.99, "run-2")
    with engine.connect() as conn:
        assert latest_replayed_day(conn, CHALLENGER) == DAY_1
        assert latest_replayed_day(conn, CHAMPION) is None


def test_pairs_join_only_batch_answers_of_the_named_versions(engine: Engine) -> None:
    days = ingest_two_days(engine)
    ids_1 = days[DAY_1]["transaction_id"].to_list()
    ids_2 = days[DAY_2]["transaction_id"].to_list()
    champion_rows, other_rows = [], []
    for day, ids in ((DAY_1, ids_1), (DAY_2, ids_2)):
        for i, tid in enumerate(ids):
            key = day.isoformat()
            champion_rows.append(answer(tid, path="batch", score=i / 100, model_version=CHAMPION, partition_key=key))
            # Noise the join must not pick up: the champion's online answers, another version's batch ones.
            other_rows.append(answer(tid, path="online", score=0.999, model_version=CHAMPION, request_id=f"r-{tid}"))
            other_rows.append(answer(tid, path="batch", score=0.998, model_version="risk_model:old", partition_key=key))
    write_production(engine, *champion_rows, *other_rows)
    # The challenger replayed day 1 but for its last 5 records, and day 2 entirely; it also shadowed
    # online answers and another challenger replayed day 1.
    replayed = [
        answer(tid, path="batch", score=0.5 + i / 1000, model_version=CHALLENGER, partition_key=day.isoformat())
        for day, ids in ((DAY_1, ids_1[:-5]), (DAY_2, ids_2))
        for i, tid in enumerate(ids)
    ]
    write_challenger(
        engine,
        *replayed,
        *(answer(tid, path="shadow", score=0.997, model_version=CHALLENGER) for tid in ids_1),
        *(
            answer(tid, path="batch", score=0.996, model_version="risk_model:rival", partition_key="2026-11-01")
            for tid in ids_1
        ),
    )

    with engine.connect() as conn:
        day_1 = champion_challenger_pairs(
            REFERENCE, conn, champion=CHAMPION, challenger=CHALLENGER, first_day=DAY_1, last_day=DAY_1
        )
        both = champion_challenger_pairs(
            REFERENCE, conn, champion=CHAMPION, challenger=CHALLENGER, first_day=DAY_1, last_day=DAY_2
        )
        other_champion = champion_challenger_pairs(
            REFERENCE, conn, champion="risk_model:none", challenger=CHALLENGER, first_day=DAY_1, last_day=DAY_2
        )
    assert day_1.schema == pl.Schema(COMPARISON_SCHEMA)
    assert day_1["record_id"].to_list() == sorted(ids_1[:-5])
    assert set(day_1["partition_key"].to_list()) == {"2026-11-01"}
    assert both.height == len(ids_1) - 5 + len(ids_2)
    assert both["record_id"].is_unique().all()
    expected_champion = {r["record_id"]: r["score"] for r in champion_rows}
    expected_challenger = {r["record_id"]: r["score"] for r in replayed}
    for row in both.iter_rows(named=True):
        assert row["champion_score"] == expected_champion[row["record_id"]]
        assert row["challenger_score"] == expected_challenger[row["record_id"]]
    labels = {
        tid: label
        for frame in days.values()
        for tid, label in zip(frame["transaction_id"], frame["label_fraud"], strict=True)
    }
    assert dict(zip(both["record_id"], both["label"], strict=True)) == {tid: labels[tid] for tid in both["record_id"]}
    assert other_champion.is_empty()


def test_a_pair_needs_both_answers_to_the_same_inputs(engine: Engine) -> None:
    """A correction after the replay: the champion's rescore read the new record (or a changed
    history), the challenger's replay the old one. Comparing those would judge the challenger on
    another input than the champion's, so the pair waits for the next replay."""
    ids = ingest_two_days(engine)[DAY_1]["transaction_id"].to_list()[:3]
    key = DAY_1.isoformat()
    write_production(
        engine,
        answer(ids[0], path="batch", score=0.1, model_version=CHAMPION, partition_key=key),
        answer(ids[1], path="batch", score=0.2, model_version=CHAMPION, partition_key=key, input_hash="input-2"),
        answer(ids[2], path="batch", score=0.3, model_version=CHAMPION, partition_key=key, history_hash="history-2"),
    )
    write_challenger(
        engine, *(answer(tid, path="batch", score=0.5, model_version=CHALLENGER, partition_key=key) for tid in ids)
    )
    with engine.connect() as conn:
        pairs = champion_challenger_pairs(
            REFERENCE, conn, champion=CHAMPION, challenger=CHALLENGER, first_day=DAY_1, last_day=DAY_1
        )
        # Versions of different K digest different history records: only the record can be matched.
        across_k = champion_challenger_pairs(
            REFERENCE,
            conn,
            champion=CHAMPION,
            challenger=CHALLENGER,
            first_day=DAY_1,
            last_day=DAY_1,
            same_history_length=False,
        )
    assert pairs["record_id"].to_list() == [ids[0]]
    assert across_k["record_id"].to_list() == sorted([ids[0], ids[2]])


def test_online_latencies_mark_the_shadowed_answers(engine: Engine) -> None:
    now = datetime.now(UTC)
    online = [
        {
            **answer(f"tx-{i}", path="online", score=0.1, model_version=CHAMPION, request_id=f"r-{i}", produced_at=now),
            "latency_ms": 10.0 + i,
        }
        for i in range(4)
    ]
    old = {**answer("tx-old", path="online", score=0.1, model_version=CHAMPION, produced_at=now - timedelta(days=2))}
    write_production(engine, *online, old)
    write_challenger(
        engine,
        {
            **answer("tx-1", path="shadow", score=0.2, model_version=CHALLENGER, request_id="r-1", produced_at=now),
            "latency_ms": 2.5,
        },
        {
            **answer(
                "tx-2", path="shadow", score=0.2, model_version="risk_model:rival", request_id="r-2", produced_at=now
            ),
            "latency_ms": 9.0,
        },
    )
    with engine.connect() as conn:
        frame = online_latencies(conn, champion=CHAMPION, challenger=CHALLENGER, since=now - timedelta(hours=1))
    assert frame.sort("record_id").select("record_id", "shadowed", "shadow_latency_ms").rows() == [
        ("tx-0", False, None),
        ("tx-1", True, 2.5),
        ("tx-2", False, None),
        ("tx-3", False, None),
    ]


def test_reports_round_trip_and_the_newest_of_the_exact_pair_is_read(engine: Engine) -> None:
    at = datetime(2026, 11, 8, 9, 30, 15, 123456, tzinfo=UTC)
    metrics = {"pairs": 1200, "challenger_auc": 0.8125, "first_day": "2026-11-01", "champion_auc": float("nan")}
    with engine.begin() as conn:
        first = record_challenger_report(
            conn, champion=CHAMPION, challenger=CHALLENGER, created_at=at, run_id="run-1", failures={}, metrics=metrics
        )
        failed = record_challenger_report(
            conn,
            champion=CHAMPION,
            challenger=CHALLENGER,
            # An earlier clock than the first: "newest" is the one recorded last.
            created_at=at - timedelta(minutes=5),
            run_id=None,
            failures={AUC_NOT_WORSE: "worse by 0.1000", ENOUGH_EVIDENCE: "12 labelled pairs"},
            metrics={"pairs": 12},
        )
        other_champion = record_challenger_report(
            conn, champion="risk_model:other", challenger=CHALLENGER, created_at=at, run_id="r", failures={}, metrics={}
        )
        other_challenger = record_challenger_report(
            conn, champion=CHAMPION, challenger="risk_model:rival", created_at=at, run_id="r", failures={}, metrics={}
        )
    assert len({first, failed, other_champion, other_challenger}) == 4

    with engine.connect() as conn:
        newest = latest_challenger_report(conn, challenger=CHALLENGER, champion=CHAMPION)
        other = latest_challenger_report(conn, challenger=CHALLENGER, champion="risk_model:other")
        swapped = latest_challenger_report(conn, challenger=CHAMPION, champion=CHALLENGER)
        missing = latest_challenger_report(conn, challenger=CHALLENGER, champion="")
    assert newest is not None and other is not None
    assert newest.report_id == failed
    assert (newest.champion, newest.challenger, newest.run_id, newest.passed) == (CHAMPION, CHALLENGER, None, False)
    assert newest.failures == {AUC_NOT_WORSE: "worse by 0.1000", ENOUGH_EVIDENCE: "12 labelled pairs"}
    assert newest.metrics == {"pairs": 12}
    assert newest.created_at == at - timedelta(minutes=5)
    assert newest.created_at.tzinfo is not None
    assert other.report_id == other_champion and other.passed
    assert swapped is None and missing is None

    with engine.begin() as conn:
        conn.execute(sa.delete(challenger_reports).where(challenger_reports.c.report_id == failed))
    with engine.connect() as conn:
        passed = latest_challenger_report(conn, challenger=CHALLENGER, champion=CHAMPION)
    assert passed is not None and passed.report_id == first and passed.passed and passed.failures == {}
    assert passed.run_id == "run-1" and passed.created_at == at
    assert passed.metrics["pairs"] == 1200 and passed.metrics["challenger_auc"] == 0.8125
    assert math.isnan(passed.metrics["champion_auc"])
