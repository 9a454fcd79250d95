"""Why an online answer and the batch answer to the same transaction differ.

The two paths share every line of scoring code, so for the same model, record and history they
agree to float noise (PARITY_TOLERANCE). Any larger difference has a cause that the stored lineage
names; a difference with none of them is a skew bug, which the `path_agreement` check reports.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from inference.parity import PARITY_TOLERANCE

# The score from which a transaction is treated as risky. Nothing else in Tandem decides on a score
# yet (both paths hand the score out), so this is the one place that names it.
DECISION_THRESHOLD = 0.5
# Upper edges of the |online - batch| histogram: parity noise first, then decades up to the whole range.
DIFFERENCE_BIN_EDGES: tuple[float, ...] = (PARITY_TOLERANCE, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
UNEXPLAINED_LISTED = 50


class Cause(enum.StrEnum):
    AGREE = "agree"  # within PARITY_TOLERANCE
    MODEL_CHANGED = "model_changed"  # answered by different model versions
    INPUT_CORRECTED = "input_corrected"  # the record the client sent is not the one batch scored
    DEGRADED = "degraded"  # the online answer was scored without history (store unreachable)
    HISTORY_CHANGED = "history_changed"  # the account's history changed after the online answer
    UNEXPLAINED = "unexplained"


def cause_of(online: Mapping[str, Any], batch: Mapping[str, Any]) -> Cause:
    """The cause of the difference between two stored answers (rows of `predictions`), checked in
    a fixed order so that a pair always gets the same one."""
    if abs(float(online["score"]) - float(batch["score"])) <= PARITY_TOLERANCE:
        return Cause.AGREE
    if online["model_version"] != batch["model_version"]:
        return Cause.MODEL_CHANGED
    if online["input_hash"] != batch["input_hash"]:
        return Cause.INPUT_CORRECTED
    if online.get("degraded") or online.get("history_hash") is None:
        return Cause.DEGRADED
    if online.get("history_hash") != batch.get("history_hash"):
        return Cause.HISTORY_CHANGED
    return Cause.UNEXPLAINED


@dataclass(frozen=True)
class DifferenceStats:
    """The distribution of |online - batch| over the pairs."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float


@dataclass(frozen=True)
class AgreementReport:
    """How one day's online answers compare with the batch answers to the same records."""

    pairs: int  # online answers with a batch answer to compare with
    online_without_batch: int  # online answers whose transaction has no batch answer (yet)
    difference: DifferenceStats | None  # None without pairs
    histogram: list[tuple[str, int]]  # (|online - batch| bin, pairs), every bin, in order
    threshold: float
    crossed_threshold: int  # pairs whose answers fall on different sides of `threshold`
    by_cause: dict[Cause, int]  # every cause, zero included
    unexplained: list[str]  # transaction ids of unexplained pairs, at most UNEXPLAINED_LISTED

    @property
    def crossed_share(self) -> float:
        return self.crossed_threshold / self.pairs if self.pairs else 0.0

    @property
    def explained(self) -> bool:
        return self.by_cause[Cause.UNEXPLAINED] == 0


def _side(prefix: str, row: Mapping[str, Any]) -> dict[str, Any]:
    names = ("score", "model_version", "input_hash", "history_hash", "degraded")
    return {name: row.get(f"{prefix}_{name}") for name in names}


def _histogram(differences: pl.Series) -> list[tuple[str, int]]:
    bins: list[tuple[str, int]] = []
    low: float | None = None
    for high in DIFFERENCE_BIN_EDGES:
        inside = differences <= high if low is None else (differences > low) & (differences <= high)
        bins.append((f"[0, {high:g}]" if low is None else f"({low:g}, {high:g}]", int(inside.sum())))
        low = high
    return bins


def summarize(pairs: pl.DataFrame, threshold: float = DECISION_THRESHOLD) -> AgreementReport:
    """Compare every online answer with its batch answer (rows of store.answer_pairs; a null
    batch_score means there is none). Causes come from `cause_of`, one row at a time, so the
    report and `tandem lineage` can never name different causes for the same pair."""
    both = pairs.filter(pl.col("batch_score").is_not_null()).with_columns(
        difference=(pl.col("online_score") - pl.col("batch_score")).abs()
    )
    by_cause = dict.fromkeys(Cause, 0)
    unexplained: list[str] = []
    for row in both.iter_rows(named=True):
        cause = cause_of(_side("online", row), _side("batch", row))
        by_cause[cause] += 1
        if cause is Cause.UNEXPLAINED and len(unexplained) < UNEXPLAINED_LISTED:
            unexplained.append(str(row["record_id"]))
    differences = both["difference"]
    stats = None
    if both.height:
        stats = DifferenceStats(
            count=both.height,
            p50=float(differences.quantile(0.5, "nearest") or 0.0),
            p90=float(differences.quantile(0.9, "nearest") or 0.0),
            p99=float(differences.quantile(0.99, "nearest") or 0.0),
            max=float(differences.quantile(1.0, "nearest") or 0.0),
        )
    crossed = both.filter((pl.col("online_score") >= threshold) != (pl.col("batch_score") >= threshold)).height
    return AgreementReport(
        pairs=both.height,
        online_without_batch=pairs.height - both.height,
        difference=stats,
        histogram=_histogram(differences),
        threshold=threshold,
        crossed_threshold=crossed,
        by_cause=by_cause,
        unexplained=unexplained,
    )
