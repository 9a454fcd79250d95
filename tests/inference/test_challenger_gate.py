"""Champion against challenger: the pure comparison that gates a promotion (inference/challenger.py),
on frames built by hand: AUC and precision at the alert rate, evidence, decision flips at the
threshold, the gate's settings from the environment, the shadow's cost. Its tables in the result
store are test_challenger_store.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import polars as pl
import pytest

from inference.agreement import DECISION_THRESHOLD
from inference.challenger import (
    AUC_NOT_WORSE,
    BLOCKING_CHECKS,
    ENOUGH_EVIDENCE,
    PRECISION_NOT_WORSE,
    PromotionGate,
    compare,
    precision_at_alert_rate,
)
from inference.model import auc
from inference.store import (
    COMPARISON_SCHEMA,
    SHADOW_SCHEMA,
)

NO_LATENCIES = pl.DataFrame(schema=SHADOW_SCHEMA)


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
            "record_id": [f"tx-{i:05d}" for i in range(n)],
            "partition_key": [days[i % len(days)] for i in range(n)],
            "label": given_labels,
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
            "record_id": ["a", "b", "c", "d", "e"],
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
