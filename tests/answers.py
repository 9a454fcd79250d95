"""Hand-written `predictions` rows of either path, and writing them through the store's own upsert.

Plain functions without pytest, shared by the core's and the batch path's tests.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.engine import Engine

from inference.store import prediction_frame, upsert_predictions, utc_now

VERSION = "risk_model:v1"


def answer(
    transaction_id: str,
    *,
    path: str,
    score: float,
    model_version: str = VERSION,
    input_hash: str = "input-1",
    history_hash: str | None = "history-1",
    degraded: bool = False,
    produced_at: datetime | None = None,
    request_id: str = "req-1",
    run_id: str = "run-1",
    partition_key: str | None = None,
) -> dict[str, Any]:
    """One answer as its path writes it; a degraded online answer has no history hash."""
    batch = path == "batch"
    return {
        "record_id": transaction_id,
        "model_version": model_version,
        "score": score,
        "path": path,
        "run_id": run_id if batch else None,
        "partition_key": partition_key if batch else None,
        "request_id": None if batch else request_id,
        "batch_id": None if batch else f"batch-of-{request_id}",
        "code_version": "test",
        "input_hash": input_hash,
        "history_hash": None if degraded else history_hash,
        "idempotency_key": None if batch else f"{transaction_id}:{model_version}",
        "produced_at": produced_at or utc_now(),
        "latency_ms": None if batch else 5.0,
        "degraded": degraded,
    }


def write_answers(engine: Engine, *rows: dict[str, Any]) -> int:
    """Upsert `rows` in one transaction; returns rows inserted or changed."""
    with engine.begin() as conn:
        return upsert_predictions(conn, prediction_frame(list(rows)))
