"""Batch/online parity: re-score a sample of batch results the way the service does."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl
from sqlalchemy.engine import Engine

from inference.contract import Predictor
from inference.spec import LoadedSpec
from inference.store import PARITY_TOLERANCE, StoreHistory, sample_batch_predictions


@dataclass(frozen=True)
class ParityReport:
    sampled: int
    max_abs_difference: float
    mismatched: list[str]  # record ids whose online score differs beyond the tolerance


def check_parity(
    ls: LoadedSpec, engine: Engine, predictor: Predictor, *, partition_key: str, sample_size: int = 64
) -> ParityReport:
    """Re-score sampled batch rows one request at a time with history from the store, exactly as
    the online path does, and compare with the stored batch scores."""
    with engine.connect() as conn:
        sample = sample_batch_predictions(
            ls, conn, partition_key=partition_key, model_version=predictor.model_version, size=sample_size
        )
    if sample.is_empty():
        return ParityReport(0, 0.0, [])
    history = StoreHistory(ls, engine)
    online = pl.concat(
        [predictor.predict(sample[i : i + 1].drop("score", "event_ts"), history) for i in range(sample.height)]
    )
    compared = (
        sample.select(record_id=ls.id.name, batch_score="score")
        .join(online.select("record_id", online_score="score"), on="record_id", how="left")
        .with_columns(difference=(pl.col("batch_score") - pl.col("online_score")).abs())
    )
    bad = compared.filter(pl.col("difference").is_null() | (pl.col("difference") > PARITY_TOLERANCE))
    worst = compared["difference"].max()
    return ParityReport(
        sampled=sample.height,
        max_abs_difference=float(worst) if isinstance(worst, int | float) else float("nan"),
        mismatched=bad["record_id"].to_list(),
    )
