"""Prediction rows built by hand, importable by spawned processes (kept light: no torch, no fixtures)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import polars as pl

from inference.store import PREDICTION_COLUMNS, PREDICTION_SCHEMA, make_engine, upsert_predictions

PRODUCED_AT = datetime(2026, 11, 2, 3, 4, 5, 678901, tzinfo=UTC)


def prediction_rows(
    transaction_ids: Sequence[str],
    *,
    model_version: str = "risk:1",
    score: float = 0.25,
    input_hash: str = "hash-1",
    run_id: str = "run-1",
    produced_at: datetime = PRODUCED_AT,
) -> pl.DataFrame:
    """Batch-path rows in PREDICTION_COLUMNS; columns not named here (optional lineage) are null."""
    n = len(transaction_ids)
    given: dict[str, list[Any]] = {
        "record_id": list(transaction_ids),
        "model_version": [model_version] * n,
        "score": [score + i / 10_000 for i in range(n)],
        "path": ["batch"] * n,
        "answer_key": [""] * n,
        "degraded": [False] * n,
        "run_id": [run_id] * n,
        "partition_key": ["2026-11-01"] * n,
        "code_version": ["test"] * n,
        "input_hash": [input_hash] * n,
        "history_hash": ["0" * 16] * n,
        "produced_at": [produced_at] * n,
    }
    return pl.DataFrame({name: given.get(name, [None] * n) for name in PREDICTION_COLUMNS}, schema=PREDICTION_SCHEMA)


def upsert_repeatedly(url: str, worker: int, first: int, count: int, repeats: int) -> int:
    """One writer process: upsert an overlapping id range `repeats` times, the input changing each round."""
    engine = make_engine(url)
    ids = [f"tx-{i:05d}" for i in range(first, first + count)]
    changed = 0
    try:
        for round_ in range(repeats):
            rows = prediction_rows(ids, score=worker / 10, input_hash=f"hash-{round_}", run_id=f"worker-{worker}")
            with engine.begin() as conn:
                changed += upsert_predictions(conn, rows)
    finally:
        engine.dispose()
    return changed
