"""Champion against challenger on the same transactions: how far their scores agree, how many
decisions would flip, how well each ranks the labelled fraud, what shadowing cost the online
answers, and the verdict that gates a promotion.

Pure functions over the frames the store reads (inference/store/challenger.py), so the numbers the
report shows, the checks that block promotion and the CLI's gate are one computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.agreement import DECISION_THRESHOLD
from inference.model import auc


class PromotionGate(BaseSettings):
    """How much worse than the champion a challenger may be and still be promoted
    (TANDEM_CHALLENGER_*). Margins are absolute: AUC 0.80 against 0.81 is 0.01 worse."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_CHALLENGER_", extra="ignore")

    auc_margin: float = Field(default=0.005, ge=0, le=1)
    precision_margin: float = Field(default=0.02, ge=0, le=1)
    alert_rate: float = Field(default=0.02, gt=0, le=1, description="share of transactions alerted on")
    min_labelled: int = Field(default=500, ge=1, description="labelled pairs needed before judging")
    min_labelled_frauds: int = Field(default=10, ge=1)
    decision_threshold: float = Field(default=DECISION_THRESHOLD, gt=0, lt=1)


# The checks that block promotion; each is an asset check on challenger_report.
ENOUGH_EVIDENCE = "enough_labelled_evidence"
AUC_NOT_WORSE = "challenger_auc_not_worse"
PRECISION_NOT_WORSE = "challenger_precision_not_worse"
BLOCKING_CHECKS = (ENOUGH_EVIDENCE, AUC_NOT_WORSE, PRECISION_NOT_WORSE)


@dataclass(frozen=True)
class Comparison:
    metrics: dict[str, Any]
    failures: dict[str, str]  # gate check -> why it fails; empty: the challenger may be promoted
    passed_checks: dict[str, str] = field(default_factory=dict)  # gate check -> what it found

    @property
    def passed(self) -> bool:
        return not self.failures


def precision_at_alert_rate(scores: np.ndarray, labels: np.ndarray, alert_rate: float) -> float:
    """The share of fraud among the `alert_rate` highest-scored transactions (at least one alert).
    Ties at the cut are broken by position, the same way for both models."""
    if len(scores) == 0:
        return float("nan")
    # The epsilon keeps float error (100 * 0.29 = 28.999...) from dropping an alert.
    alerts = max(1, math.floor(len(scores) * alert_rate + 1e-9))
    top = np.argsort(-scores, kind="stable")[:alerts]
    return float(labels[top].mean())


def _quantile(values: pl.Series, q: float) -> float | None:
    found = values.drop_nulls()
    return None if found.is_empty() else float(found.quantile(q, interpolation="higher") or 0.0)


def compare(pairs: pl.DataFrame, latencies: pl.DataFrame, gate: PromotionGate) -> Comparison:
    """`pairs`: store.COMPARISON_SCHEMA; `latencies`: store.SHADOW_SCHEMA."""
    metrics: dict[str, Any] = {"pairs": pairs.height, "days": pairs["partition_key"].n_unique()}
    difference = (pairs["challenger_score"] - pairs["champion_score"]).abs()
    threshold = gate.decision_threshold
    flips_up = pairs.filter((pl.col("champion_score") < threshold) & (pl.col("challenger_score") >= threshold)).height
    flips_down = pairs.filter((pl.col("champion_score") >= threshold) & (pl.col("challenger_score") < threshold)).height
    metrics |= {
        "score_difference_p50": _quantile(difference, 0.5),
        "score_difference_p99": _quantile(difference, 0.99),
        "score_difference_max": _quantile(difference, 1.0),
        "decision_threshold": threshold,
        "decision_flips": flips_up + flips_down,
        "decision_flips_to_alert": flips_up,
        "decision_flips_to_pass": flips_down,
        "decision_flip_share": (flips_up + flips_down) / pairs.height if pairs.height else None,
    }

    labelled = pairs.filter(pl.col("label").is_not_null())
    labels = labelled["label"].to_numpy().astype(np.int8)
    frauds = int(labels.sum())
    metrics |= {"labelled_pairs": labelled.height, "labelled_frauds": frauds, "alert_rate": gate.alert_rate}
    failures: dict[str, str] = {}
    passed: dict[str, str] = {}
    if labelled.height < gate.min_labelled or frauds < gate.min_labelled_frauds:
        failures[ENOUGH_EVIDENCE] = (
            f"{labelled.height} labelled pairs with {frauds} frauds; at least {gate.min_labelled} with "
            f"{gate.min_labelled_frauds} frauds are needed: replay more labelled days with challenger_predictions"
        )
    else:
        passed[ENOUGH_EVIDENCE] = f"{labelled.height} labelled pairs, {frauds} frauds"
        champion, challenger = labelled["champion_score"].to_numpy(), labelled["challenger_score"].to_numpy()
        aucs = auc(champion, labels), auc(challenger, labels)
        precisions = (
            precision_at_alert_rate(champion, labels, gate.alert_rate),
            precision_at_alert_rate(challenger, labels, gate.alert_rate),
        )
        metrics |= {
            "champion_auc": aucs[0],
            "challenger_auc": aucs[1],
            "auc_difference": aucs[1] - aucs[0],
            "champion_precision_at_alert_rate": precisions[0],
            "challenger_precision_at_alert_rate": precisions[1],
            "precision_difference": precisions[1] - precisions[0],
        }
        _judge(AUC_NOT_WORSE, "AUC", aucs, gate.auc_margin, failures, passed)
        _judge(
            PRECISION_NOT_WORSE,
            f"precision at a {gate.alert_rate:.1%} alert rate",
            precisions,
            gate.precision_margin,
            failures,
            passed,
        )
    for name in BLOCKING_CHECKS:  # not judged without evidence: it blocks as the evidence check does
        if name not in failures and name not in passed:
            failures[name] = "not judged: " + failures[ENOUGH_EVIDENCE]
    metrics |= _shadow_cost(latencies)
    return Comparison(metrics=metrics, failures=failures, passed_checks=passed)


def _judge(
    name: str,
    what: str,
    values: tuple[float, float],
    margin: float,
    failures: dict[str, str],
    passed: dict[str, str],
) -> None:
    champion, challenger = values
    said = f"challenger {what} {challenger:.4f} against champion {champion:.4f} (margin {margin:.4f})"
    if math.isnan(champion) or math.isnan(challenger):
        failures[name] = f"{what} undefined on these labels: {said}"
    elif challenger < champion - margin:
        failures[name] = f"worse by {champion - challenger:.4f}: {said}"
    else:
        passed[name] = said


def _shadow_cost(latencies: pl.DataFrame) -> dict[str, Any]:
    """What the shadow cost, as the stored answers show it: the champion's online service times
    while shadowing ran, and the challenger's own time per shadowed item. The cost against no
    shadowing at all is measured side by side by the benchmark (bench/shadow.py)."""
    shadowed = latencies.filter(pl.col("shadowed"))
    return {
        "online_answers": latencies.height,
        "shadowed_answers": shadowed.height,
        "shadowed_share": shadowed.height / latencies.height if latencies.height else None,
        "champion_online_p50_ms": _quantile(latencies["champion_latency_ms"], 0.5),
        "champion_online_p99_ms": _quantile(latencies["champion_latency_ms"], 0.99),
        "shadow_p50_ms": _quantile(shadowed["shadow_latency_ms"], 0.5),
        "shadow_p99_ms": _quantile(shadowed["shadow_latency_ms"], 0.99),
    }
