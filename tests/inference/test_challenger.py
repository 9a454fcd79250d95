"""Champion against challenger: the pure comparison that gates a promotion (inference/challenger.py),
and the challenger's tables in the result store (inference/store/challenger.py) on SQLite and on a
fresh PostgreSQL database."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

import numpy as np
import polars as pl
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from inference.agreement import DECISION_THRESHOLD
from inference.batch import ingest_day
from inference.challenger import (
    AUC_NOT_WORSE,
    BLOCKING_CHECKS,
    ENOUGH_EVIDENCE,
    PRECISION_NOT_WORSE,
    PromotionGate,
    compare,
    precision_at_alert_rate,
)
from inference.demo import DemoConfig, generate_day
from inference.migrate import alembic_config, upgrade
from inference.model import auc
from inference.store import (
    COMPARISON_SCHEMA,
    SHADOW_SCHEMA,
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
from tests.answers import answer

NO_LATENCIES = pl.DataFrame(schema=SHADOW_SCHEMA)
CHAMPION, CHALLENGER = "risk_model:champion", "risk_model:challenger"


# ------------------------------------------------------------------ frames built by hand
def pairs_frame(
    champion: np.ndarray | Sequence[float],
    challenger: np.ndarray | Sequence[float],
    labels: np.ndarray | Sequence[int | None] | None = None,
    days: tuple[str, ...] = ("2026-11-01",),
) -> pl.DataFrame:
    n = len(champion)
    given_labels = [None] * n if labels is None else [None if v is None else int(v) for v in labels]
    return pl.DataFrame(
        {
            "transaction_id": [f"tx-{i:05d}" for i in range(n)],
            "partition_key": [days[i % len(days)] for i in range(n)],
            "label_fraud": given_labels,
            "champion_score": [float(v) for v in champion],
            "challenger_score": [float(v) for v in challenger],
        },
        schema=COMPARISON_SCHEMA,
    )


def labelled_population(n: int = 4000, fraud_rate: float = 0.05, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    """Labels, and a champion that ranks them well but not perfectly."""
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < fraud_rate).astype(np.int64)
    champion = np.clip(0.15 + 0.6 * labels + rng.normal(0, 0.15, n), 0.0, 1.0)
    return labels, champion


def gate(**settings: Any) -> PromotionGate:
    return PromotionGate(**settings)


# ------------------------------------------------------------------ compare()
def test_a_challenger_identical_to_the_champion_passes_every_check_without_a_flip() -> None:
    labels, champion = labelled_population()
    result = compare(pairs_frame(champion, champion, labels, days=("2026-11-01", "2026-11-02")), NO_LATENCIES, gate())

    assert result.passed and result.failures == {}
    assert set(result.passed_checks) == set(BLOCKING_CHECKS)
    metrics = result.metrics
    assert metrics["pairs"] == metrics["labelled_pairs"] == len(labels)
    assert metrics["labelled_frauds"] == int(labels.sum())
    assert metrics["days"] == 2
    assert metrics["decision_flips"] == metrics["decision_flips_to_alert"] == metrics["decision_flips_to_pass"] == 0
    assert metrics["decision_flip_share"] == 0.0
    assert metrics["score_difference_p50"] == metrics["score_difference_max"] == 0.0
    assert metrics["auc_difference"] == 0.0 and metrics["precision_difference"] == 0.0
    assert metrics["champion_auc"] == pytest.approx(auc(champion, labels))
    assert metrics["champion_auc"] > 0.9, "the hand-made champion ranks the frauds well"


def test_a_randomly_scoring_challenger_fails_auc_and_precision_with_the_numbers() -> None:
    labels, champion = labelled_population()
    challenger = np.random.default_rng(3).random(len(labels))
    result = compare(pairs_frame(champion, challenger, labels), NO_LATENCIES, gate())

    assert not result.passed
    assert set(result.failures) == {AUC_NOT_WORSE, PRECISION_NOT_WORSE}
    assert ENOUGH_EVIDENCE in result.passed_checks
    metrics = result.metrics
    champion_auc, challenger_auc = auc(champion, labels), auc(challenger, labels)
    assert metrics["champion_auc"] == pytest.approx(champion_auc)
    assert metrics["challenger_auc"] == pytest.approx(challenger_auc)
    assert 0.4 < challenger_auc < 0.6
    assert champion_auc > 0.9

    why_auc = result.failures[AUC_NOT_WORSE]
    assert f"worse by {champion_auc - challenger_auc:.4f}" in why_auc
    assert f"challenger AUC {challenger_auc:.4f}" in why_auc
    assert f"champion {champion_auc:.4f}" in why_auc
    assert "(margin 0.0050)" in why_auc

    champion_precision = precision_at_alert_rate(champion, labels, 0.02)
    challenger_precision = precision_at_alert_rate(challenger, labels, 0.02)
    assert metrics["champion_precision_at_alert_rate"] == champion_precision
    assert metrics["challenger_precision_at_alert_rate"] == challenger_precision
    why_precision = result.failures[PRECISION_NOT_WORSE]
    assert "precision at a 2.0% alert rate" in why_precision
    assert f"{challenger_precision:.4f}" in why_precision and f"{champion_precision:.4f}" in why_precision
    assert "(margin 0.0200)" in why_precision
    # And decisions flip both ways at the threshold.
    assert metrics["decision_flips_to_alert"] > 0 and metrics["decision_flips_to_pass"] > 0


@pytest.mark.parametrize(
    ("labelled", "frauds", "what"),
    [(100, 20, "too few labelled pairs"), (1000, 5, "too few frauds among many labelled pairs")],
)
def test_too_little_evidence_fails_the_evidence_check_and_leaves_the_others_not_judged(
    labelled: int, frauds: int, what: str
) -> None:
    n = 1200
    labels: list[int | None] = [1] * frauds + [0] * (labelled - frauds) + [None] * (n - labelled)
    scores = np.linspace(0.0, 1.0, n)
    result = compare(pairs_frame(scores, scores, labels), NO_LATENCIES, gate())

    assert set(result.failures) == set(BLOCKING_CHECKS), what
    assert result.passed_checks == {}
    evidence = result.failures[ENOUGH_EVIDENCE]
    assert evidence.startswith(f"{labelled} labelled pairs with {frauds} frauds; at least 500 with 10 frauds")
    for name in (AUC_NOT_WORSE, PRECISION_NOT_WORSE):
        assert result.failures[name] == "not judged: " + evidence
    assert result.metrics["labelled_pairs"] == labelled and result.metrics["labelled_frauds"] == frauds
    assert result.metrics["pairs"] == n
    assert "champion_auc" not in result.metrics


def test_no_pairs_at_all_is_a_comparison_with_nothing_judged() -> None:
    result = compare(pl.DataFrame(schema=COMPARISON_SCHEMA), NO_LATENCIES, gate())
    assert set(result.failures) == set(BLOCKING_CHECKS)
    assert result.metrics["pairs"] == 0 and result.metrics["decision_flips"] == 0
    assert result.metrics["decision_flip_share"] is None
    assert result.metrics["score_difference_p99"] is None
    assert result.metrics["shadowed_share"] is None


def test_auc_undefined_on_labels_of_one_class_blocks() -> None:
    scores = [0.1, 0.2, 0.3, 0.4, 0.5]
    result = compare(
        pairs_frame(scores, scores, [1, 1, 1, 1, 1]), NO_LATENCIES, gate(min_labelled=5, min_labelled_frauds=1)
    )
    assert set(result.failures) == {AUC_NOT_WORSE}
    assert result.failures[AUC_NOT_WORSE].startswith("AUC undefined on these labels")
    assert math.isnan(result.metrics["champion_auc"])


def test_decision_flips_are_counted_in_both_directions_at_the_threshold() -> None:
    t = 0.5
    below = np.nextafter(t, 0.0)
    champion = [0.10, 0.90, 0.40, 0.60, t, below, 0.20, 0.80]
    challenger = [0.90, 0.10, 0.45, 0.70, below, t, 0.20, 0.80]
    # up: 0 (0.1->0.9), 5 (just below -> exactly t: at the threshold alerts)
    # down: 1 (0.9->0.1), 4 (exactly t -> just below); 2, 3, 6, 7 stay on their side.
    result = compare(pairs_frame(champion, challenger), NO_LATENCIES, gate(decision_threshold=t))
    metrics = result.metrics
    assert metrics["decision_threshold"] == t
    assert metrics["decision_flips_to_alert"] == 2
    assert metrics["decision_flips_to_pass"] == 2
    assert metrics["decision_flips"] == 4
    assert metrics["decision_flip_share"] == 0.5
    assert metrics["score_difference_max"] == pytest.approx(0.8)
    assert metrics["labelled_pairs"] == 0  # unlabelled: flips are counted all the same

    moved = compare(pairs_frame(champion, challenger), NO_LATENCIES, gate(decision_threshold=0.85))
    assert (moved.metrics["decision_flips_to_alert"], moved.metrics["decision_flips_to_pass"]) == (1, 1)


def test_the_default_threshold_is_the_path_agreement_one() -> None:
    assert PromotionGate().decision_threshold == DECISION_THRESHOLD


def test_precision_at_alert_rate_on_a_hand_computed_example() -> None:
    scores = np.array([0.05, 0.9, 0.3, 0.7, 0.1, 0.8, 0.4, 0.2, 0.6, 0.5])
    labels = np.array([1, 1, 0, 1, 0, 0, 1, 0, 0, 0])
    # Ranked: 0.9 (1), 0.8 (0), 0.7 (1), 0.6 (0), 0.5 (0), 0.4 (1), ...
    assert precision_at_alert_rate(scores, labels, 0.1) == 1.0  # 1 alert: 0.9
    assert precision_at_alert_rate(scores, labels, 0.2) == 0.5  # 0.9, 0.8
    assert precision_at_alert_rate(scores, labels, 0.3) == pytest.approx(2 / 3)  # 0.9, 0.8, 0.7
    assert precision_at_alert_rate(scores, labels, 0.6) == 0.5  # + 0.6, 0.5, 0.4
    assert precision_at_alert_rate(scores, labels, 1.0) == 0.4
    assert precision_at_alert_rate(scores, labels, 0.01) == 1.0, "at least one alert"
    # Ties at the cut are broken by position.
    assert precision_at_alert_rate(np.full(4, 0.5), np.array([0, 1, 1, 1]), 0.5) == 0.5
    assert math.isnan(precision_at_alert_rate(np.array([]), np.array([]), 0.5))


def _slightly_worse(labels: np.ndarray, champion: np.ndarray) -> np.ndarray:
    """The champion's scores with the frauds outside its top alerts pushed down to the middle of the
    negatives: AUC drops, the alerts (and so precision) stay the same."""
    alerts = max(1, math.floor(len(champion) * 0.02))
    top = set(np.argsort(-champion, kind="stable")[:alerts].tolist())
    challenger = champion.copy()
    floor_of_alerts = champion[sorted(top)].min()
    lowered = [i for i in np.flatnonzero(labels == 1) if i not in top][::3]
    challenger[lowered] = np.minimum(np.median(champion[labels == 0]), floor_of_alerts - 1e-6)
    return challenger


def test_the_auc_margin_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    labels, champion = labelled_population()
    challenger = _slightly_worse(labels, champion)
    pairs = pairs_frame(champion, challenger, labels)

    strict = compare(pairs, NO_LATENCIES, PromotionGate())
    worse_by = strict.metrics["champion_auc"] - strict.metrics["challenger_auc"]
    assert 0.01 < worse_by < 0.1, worse_by
    assert strict.metrics["precision_difference"] == 0.0
    assert set(strict.failures) == {AUC_NOT_WORSE}

    monkeypatch.setenv("TANDEM_CHALLENGER_AUC_MARGIN", "0.2")
    lenient = compare(pairs, NO_LATENCIES, PromotionGate())
    assert lenient.passed, lenient.failures
    assert "(margin 0.2000)" in lenient.passed_checks[AUC_NOT_WORSE]

    monkeypatch.setenv("TANDEM_CHALLENGER_AUC_MARGIN", f"{worse_by / 2:.6f}")
    assert set(compare(pairs, NO_LATENCIES, PromotionGate()).failures) == {AUC_NOT_WORSE}


def test_the_other_gate_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CHALLENGER_MIN_LABELLED", "5")
    monkeypatch.setenv("TANDEM_CHALLENGER_MIN_LABELLED_FRAUDS", "1")
    monkeypatch.setenv("TANDEM_CHALLENGER_ALERT_RATE", "0.5")
    monkeypatch.setenv("TANDEM_CHALLENGER_PRECISION_MARGIN", "0.3")
    settings = PromotionGate()
    assert (settings.min_labelled, settings.min_labelled_frauds, settings.alert_rate) == (5, 1, 0.5)
    scores = [0.9, 0.8, 0.2, 0.1, 0.3, 0.4]
    labels = [1, 0, 0, 0, 1, 0]
    result = compare(pairs_frame(scores, scores, labels), NO_LATENCIES, settings)
    assert result.passed, result.failures
    assert result.metrics["alert_rate"] == 0.5
    assert "precision at a 50.0% alert rate" in result.passed_checks[PRECISION_NOT_WORSE]
    assert "(margin 0.3000)" in result.passed_checks[PRECISION_NOT_WORSE]
    monkeypatch.setenv("TANDEM_CHALLENGER_AUC_MARGIN", "1.5")
    with pytest.raises(ValueError, match="auc_margin"):
        PromotionGate()


def test_shadow_cost_is_read_from_the_stored_latencies() -> None:
    at = datetime(2026, 11, 2, tzinfo=UTC)
    latencies = pl.DataFrame(
        {
            "transaction_id": ["a", "b", "c", "d", "e"],
            "champion_latency_ms": [10.0, 20.0, 30.0, 40.0, 50.0],
            "shadowed": [True, False, True, False, True],
            "shadow_latency_ms": [3.0, None, 5.0, None, 4.0],
            "produced_at": [at] * 5,
        },
        schema=SHADOW_SCHEMA,
    )
    metrics = compare(pl.DataFrame(schema=COMPARISON_SCHEMA), latencies, gate()).metrics
    assert metrics["online_answers"] == 5 and metrics["shadowed_answers"] == 3
    assert metrics["shadowed_share"] == 0.6
    # Quantiles are taken at the next observed value up ("higher"): always a latency that happened.
    assert metrics["champion_online_p50_ms"] == 30.0 and metrics["champion_online_p99_ms"] == 50.0
    assert metrics["shadow_p50_ms"] == 4.0 and metrics["shadow_p99_ms"] == 5.0


# ------------------------------------------------------------------ the store
def schema_diffs(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        return list(compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata))


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


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
        ingest_day(engine, frame, day)
        stored[day] = frame.select("transaction_id", "label_fraud")
    return stored


def test_the_migrated_schema_has_the_challenger_tables_at_head(engine: Engine) -> None:
    assert schema_diffs(engine) == []
    assert current_revision(engine) == ScriptDirectory.from_config(alembic_config()).get_current_head() == "0006"
    assert {"challenger_predictions", "challenger_reports"} <= set(sa.inspect(engine).get_table_names())
    assert [c.name for c in challenger_predictions.columns] == [c.name for c in predictions.columns]
    assert "challenger_reports" in metadata.tables


def test_upgrade_from_0005_adds_the_challenger_tables_and_keeps_the_answers(database_url: str) -> None:
    migrated = make_engine(database_url)
    try:
        upgrade(migrated, "0005")
        assert "challenger_predictions" not in sa.inspect(migrated).get_table_names()
        write_production(migrated, answer("tx-1", path="batch", score=0.5, partition_key="2026-11-01"))
        upgrade(migrated)
        assert current_revision(migrated) == "0006"
        assert schema_diffs(migrated) == []
        assert count(migrated, predictions) == 1
        assert count(migrated, challenger_predictions) == 0
    finally:
        migrated.dispose()


def test_downgrading_0006_drops_only_the_challenger_tables(database_url: str) -> None:
    migrated = make_engine(database_url)
    try:
        upgrade(migrated)
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
        upgrade(migrated)
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
                challenger_predictions.c.transaction_id == "tx-0", challenger_predictions.c.path == "batch"
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
            conn, champion=CHAMPION, challenger=CHALLENGER, first_day=DAY_1, last_day=DAY_1
        )
        both = champion_challenger_pairs(
            conn, champion=CHAMPION, challenger=CHALLENGER, first_day=DAY_1, last_day=DAY_2
        )
        other_champion = champion_challenger_pairs(
            conn, champion="risk_model:none", challenger=CHALLENGER, first_day=DAY_1, last_day=DAY_2
        )
    assert day_1.schema == pl.Schema(COMPARISON_SCHEMA)
    assert day_1["transaction_id"].to_list() == sorted(ids_1[:-5])
    assert set(day_1["partition_key"].to_list()) == {"2026-11-01"}
    assert both.height == len(ids_1) - 5 + len(ids_2)
    assert both["transaction_id"].is_unique().all()
    expected_champion = {r["transaction_id"]: r["score"] for r in champion_rows}
    expected_challenger = {r["transaction_id"]: r["score"] for r in replayed}
    for row in both.iter_rows(named=True):
        assert row["champion_score"] == expected_champion[row["transaction_id"]]
        assert row["challenger_score"] == expected_challenger[row["transaction_id"]]
    labels = {
        tid: label
        for frame in days.values()
        for tid, label in zip(frame["transaction_id"], frame["label_fraud"], strict=True)
    }
    assert dict(zip(both["transaction_id"], both["label_fraud"], strict=True)) == {
        tid: labels[tid] for tid in both["transaction_id"]
    }
    assert other_champion.is_empty()


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
    assert frame.sort("transaction_id").select("transaction_id", "shadowed", "shadow_latency_ms").rows() == [
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
