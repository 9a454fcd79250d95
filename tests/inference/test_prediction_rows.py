"""One builder of a `predictions` row for both paths: a frame for the batch path's chunk, a dict
for an online item, and the same row either way."""

from __future__ import annotations

from datetime import UTC, datetime

import polars as pl
import pytest

from inference.contract import RESULT_SCHEMA
from inference.store import (
    ROW_COLUMNS,
    BatchProducer,
    OnlineProducer,
    ResultPath,
    prediction_frame,
    prediction_rows,
)

PRODUCED_AT = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)
BATCH = BatchProducer(run_id="run-1", partition_key="2026-11-03", code_version="code-1")
ONLINE = OnlineProducer(request_id="req-1", batch_id="batch-1", code_version="code-1")


def scored() -> pl.DataFrame:
    """The Predictor's result for three scored rows (RESULT_SCHEMA)."""
    return pl.DataFrame(
        {
            "record_id": ["t1", "t2", "t3"],
            "score": [0.1, 0.5, 0.9],
            "reject_reason": [None, None, None],
            "reject_detail": [None, None, None],
            "input_hash": ["h1", "h2", "h3"],
            "history_hash": ["d1", "d2", "d3"],
            "unseen_fields": [None, "country", None],
        },
        schema=RESULT_SCHEMA,
    )


@pytest.mark.parametrize("producer", [BATCH, ONLINE], ids=["batch", "online"])
@pytest.mark.parametrize("degraded", [False, True])
def test_a_frame_and_its_rows_one_by_one_give_the_same_rows(
    producer: BatchProducer | OnlineProducer, degraded: bool
) -> None:
    results = scored()

    frame = prediction_rows(results, producer=producer, model_version="m:1", produced_at=PRODUCED_AT, degraded=degraded)
    one_by_one = [
        prediction_rows(row, producer=producer, model_version="m:1", produced_at=PRODUCED_AT, degraded=degraded)
        for row in results.iter_rows(named=True)
    ]

    assert frame.columns == list(ROW_COLUMNS)
    assert all(set(row) == set(ROW_COLUMNS) for row in one_by_one)
    # The writer turns online dicts into a frame: the very frame the batch path builds.
    assert prediction_frame(one_by_one).drop("answer_key").equals(frame)
    assert frame["history_hash"].to_list() == ([None] * 3 if degraded else ["d1", "d2", "d3"])


def test_each_path_fills_its_own_producer_columns_and_leaves_the_others_null() -> None:
    (batch,) = prediction_rows(
        scored().head(1), producer=BATCH, model_version="m:1", produced_at=PRODUCED_AT
    ).to_dicts()
    online = prediction_rows(
        next(scored().iter_rows(named=True)),
        producer=ONLINE,
        model_version="m:1",
        produced_at=PRODUCED_AT,
        idempotency_key="key-1",
    )

    assert (batch["path"], batch["run_id"], batch["partition_key"]) == (ResultPath.BATCH.value, "run-1", "2026-11-03")
    assert (batch["request_id"], batch["batch_id"], batch["idempotency_key"]) == (None, None, None)
    assert (online["path"], online["request_id"], online["batch_id"]) == (ResultPath.ONLINE.value, "req-1", "batch-1")
    assert (online["run_id"], online["partition_key"], online["idempotency_key"]) == (None, None, "key-1")
    for row in (batch, online):
        assert row["code_version"] == "code-1"
        assert row["produced_at"] == PRODUCED_AT
        assert row["latency_ms"] is None
        assert row["degraded"] is False
