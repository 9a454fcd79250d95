"""Why an online and a batch answer differ (`cause_of`) and one day's report of it (`summarize`)."""

from __future__ import annotations

from typing import Any

import polars as pl
import pytest

from inference.agreement import DECISION_THRESHOLD, UNEXPLAINED_LISTED, Cause, cause_of, summarize
from inference.store import ANSWER_PAIR_SCHEMA

BATCH: dict[str, Any] = {
    "score": 0.40,
    "model_version": "risk_model:v2",
    "input_hash": "input-1",
    "history_hash": "history-1",
    "degraded": False,
}


def online(**changes: Any) -> dict[str, Any]:
    return {**BATCH, "score": 0.45, **changes}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"score": 0.40 + 1e-6}, Cause.AGREE),
        # Within float noise nothing else matters, however different the lineage.
        ({"score": 0.40 - 1e-6, "model_version": "risk_model:v1", "input_hash": "x"}, Cause.AGREE),
        ({"model_version": "risk_model:v1"}, Cause.MODEL_CHANGED),
        ({"input_hash": "the-body-before-correction"}, Cause.INPUT_CORRECTED),
        ({"degraded": True, "history_hash": None}, Cause.DEGRADED),
        ({"history_hash": None}, Cause.DEGRADED),
        ({"history_hash": "history-before-a-late-record"}, Cause.HISTORY_CHANGED),
        ({}, Cause.UNEXPLAINED),
        # The first cause in the fixed order wins, so a pair always gets the same one.
        ({"model_version": "risk_model:v1", "input_hash": "x", "history_hash": None}, Cause.MODEL_CHANGED),
        ({"input_hash": "x", "degraded": True, "history_hash": None}, Cause.INPUT_CORRECTED),
    ],
)
def test_cause_of(changes: dict[str, Any], expected: Cause) -> None:
    assert cause_of(online(**changes), BATCH) is expected


def test_a_difference_just_above_the_tolerance_needs_a_cause() -> None:
    assert cause_of(online(score=0.40 + 2e-5), BATCH) is Cause.UNEXPLAINED


def pair(record_id: str, online_score: float, batch_score: float | None, **online_changes: Any) -> dict[str, Any]:
    side = {**BATCH, **online_changes}
    row: dict[str, Any] = dict.fromkeys(ANSWER_PAIR_SCHEMA)
    row.update(
        record_id=record_id,
        online_score=online_score,
        online_model_version=side["model_version"],
        online_input_hash=side["input_hash"],
        online_history_hash=side["history_hash"],
        online_degraded=side["degraded"],
    )
    if batch_score is not None:
        row.update(
            batch_score=batch_score,
            batch_model_version=BATCH["model_version"],
            batch_input_hash=BATCH["input_hash"],
            batch_history_hash=BATCH["history_hash"],
        )
    return row


def pairs_frame(*rows: dict[str, Any]) -> pl.DataFrame:
    return pl.DataFrame(list(rows), schema=ANSWER_PAIR_SCHEMA)


def test_summarize_counts_every_cause_and_names_the_unexplained() -> None:
    report = summarize(
        pairs_frame(
            pair("agree", 0.30 + 1e-7, 0.30),
            pair("model", 0.70, 0.30, model_version="risk_model:v1"),
            pair("corrected", 0.35, 0.30, input_hash="before"),
            pair("degraded", 0.20, 0.30, degraded=True, history_hash=None),
            pair("history", 0.3005, 0.30, history_hash="before"),
            pair("skew", 0.52, 0.48),
            pair("online-only", 0.5, None),
        )
    )
    assert report.pairs == 6
    assert report.online_without_batch == 1
    assert report.by_cause == {
        Cause.AGREE: 1,
        Cause.MODEL_CHANGED: 1,
        Cause.INPUT_CORRECTED: 1,
        Cause.DEGRADED: 1,
        Cause.HISTORY_CHANGED: 1,
        Cause.UNEXPLAINED: 1,
    }
    assert report.unexplained == ["skew"]
    assert not report.explained
    # 0.70 vs 0.30 and 0.52 vs 0.48 fall on different sides of 0.5; the others do not.
    assert (report.threshold, report.crossed_threshold) == (DECISION_THRESHOLD, 2)
    assert report.crossed_share == pytest.approx(2 / 6)

    assert report.difference is not None
    assert report.difference.count == 6
    assert report.difference.max == pytest.approx(0.40)
    assert report.difference.p50 == pytest.approx(0.05)  # nearest rank of 1e-7, 5e-4, 0.04, 0.05, 0.1, 0.4
    assert report.difference.p90 == pytest.approx(0.40)
    assert dict(report.histogram) == {
        "[0, 1e-05]": 1,
        "(1e-05, 0.0001]": 0,
        "(0.0001, 0.001]": 1,
        "(0.001, 0.01]": 0,
        "(0.01, 0.1]": 3,
        "(0.1, 1]": 1,
    }


def test_summarize_threshold_is_a_parameter() -> None:
    frame = pairs_frame(pair("a", 0.70, 0.30, model_version="risk_model:v1"), pair("b", 0.62, 0.58))
    assert summarize(frame, threshold=0.5).crossed_threshold == 1
    assert summarize(frame, threshold=0.6).crossed_threshold == 2
    assert summarize(frame, threshold=0.65).crossed_threshold == 1
    assert summarize(frame, threshold=0.0).crossed_threshold == 0


def test_all_explained_and_the_unexplained_list_is_bounded() -> None:
    explained = summarize(pairs_frame(pair("a", 0.3, 0.3), pair("b", 0.9, 0.3, input_hash="before")))
    assert explained.explained and explained.unexplained == []

    many = summarize(pairs_frame(*(pair(f"tx-{i:03d}", 0.9, 0.3) for i in range(UNEXPLAINED_LISTED + 10))))
    assert many.by_cause[Cause.UNEXPLAINED] == UNEXPLAINED_LISTED + 10
    assert many.unexplained == [f"tx-{i:03d}" for i in range(UNEXPLAINED_LISTED)]


def test_no_pairs() -> None:
    report = summarize(pairs_frame(pair("online-only", 0.5, None)))
    assert (report.pairs, report.online_without_batch, report.difference) == (0, 1, None)
    assert report.explained and report.crossed_share == 0.0
    assert sum(count for _, count in report.histogram) == 0
    assert summarize(pairs_frame()).pairs == 0
