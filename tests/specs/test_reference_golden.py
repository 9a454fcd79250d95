"""Golden outputs of the reference model: what Tandem answers today, pinned so a refactoring can
prove it changed nothing (docs/decisions/0012-model-spec.md, step 1).

Input: demo day 2026-11-01 (2,000 rows, the default poison and unseen rates, so rejections and
unseen fields are exercised) scored as the batch path scores a partition (`TorchPredictor.prepare`
then `complete`, the day its own history), and 24 records of the next day (among them a rejected
one and one with each unseen field) scored one at a time as the service scores them (validated,
hashed, then `predict` with a history source that is not the targets, read alone per target), over
the stored first day. The model is the default `RiskModel`, untrained, seeded; torch runs on one
thread.

Strings and integers (reject reasons and details, input hashes, history digests, unseen fields,
categorical features, the history mask) are compared exactly, as sha256 digests of their ordered
lists plus readable counts. Floats (numeric features, scores) are compared with a tolerance, never
hashed: their last bits may differ between CPUs. The /score request and response schemas of the
service's OpenAPI document are stored verbatim.

Regenerate with `TANDEM_REGENERATE_GOLDEN=1 pytest tests/specs/test_reference_golden.py`. A diff in
golden/reference.json is a change in what Tandem answers: the commit that makes it must explain it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

from inference.contract import FrameHistory, TorchPredictor
from inference.features import FeatureBatch
from inference.records import hash_inputs, raw_columns, raw_frame, validate
from inference.spec import load_spec
from serving.openapi import service_document
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.shared import reference_model

REFERENCE = load_spec()
RAW_COLUMNS = raw_columns(REFERENCE)
GOLDEN = Path(__file__).parent / "golden" / "reference.json"
REGENERATE = os.environ.get("TANDEM_REGENERATE_GOLDEN") == "1"

DAY = date(2026, 11, 1)
NEXT_DAY = DAY + timedelta(days=1)
DEMO = DemoConfig(rows_per_day=2000)
MODEL_SEED = 0
# Rows of the next day scored online, one request each: spread over the day and its accounts,
# plus a poisoned row (bad currency) and one row with each unseen field (category, country, currency).
ONLINE_ROWS = (*range(0, DEMO.rows_per_day, DEMO.rows_per_day // 20), 240, 404, 772, 979)
SHOWN_ROWS = 20  # leading rows whose values are stored one by one, for a readable diff
RTOL = 1e-5
ATOL = 1e-6


class StoredHistory:
    """The online path's history source without a database: valid stored rows with their input
    hashes. It does not say `targets_are_history`, so each target reads it alone, as a request does."""

    def __init__(self, stored: pl.DataFrame) -> None:
        self.valid_rows = FrameHistory(REFERENCE, stored).valid_rows

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        return self.valid_rows.join(targets.select("account_id").unique(), on="account_id", how="semi")


def digest(values: list[Any]) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()


def reference_predictor() -> TorchPredictor:
    torch.manual_seed(MODEL_SEED)
    return TorchPredictor(reference_model(), model_version="golden", spec=REFERENCE)


def float_summary(values: np.ndarray) -> dict[str, Any]:
    """Per-column mean and mean absolute value (float64) of a [rows, ...] array, and its first rows."""
    as_float = values.astype(np.float64)
    return {
        "mean": as_float.mean(axis=0).tolist(),
        "mean_abs": np.abs(as_float).mean(axis=0).tolist(),
        "first_rows": as_float[:SHOWN_ROWS].tolist(),
    }


def feature_summary(features: FeatureBatch) -> dict[str, Any]:
    history = features.arrays[3].astype(np.float64)
    return {
        "exact": {
            "rows": len(features),
            "transaction_ids": digest(features.record_ids),
            "current_categorical": digest(features.arrays[0].tolist()),
            "history_categorical": digest(features.arrays[2].tolist()),
            "history_mask": digest(features.arrays[4].tolist()),
            "history_mask_per_lag": features.arrays[4].sum(axis=0).tolist(),
        },
        "current_numeric": float_summary(features.arrays[1]),
        # Per lag and channel over all rows, then the last row's lags in full (the first rows of
        # the day have no history yet).
        "history_numeric": {
            "mean": history.mean(axis=0).tolist(),
            "mean_abs": np.abs(history).mean(axis=0).tolist(),
            "last_row": history[-1].tolist(),
        },
    }


def result_exact(result: pl.DataFrame) -> dict[str, Any]:
    reasons = result["reject_reason"].to_list()
    unseen = result["unseen_fields"].to_list()
    return {
        "rows": result.height,
        "reject_reason_counts": dict(sorted(Counter(r for r in reasons if r is not None).items())),
        "unseen_field_counts": dict(sorted(Counter(u for u in unseen if u is not None).items())),
        "scored": int(result["score"].is_not_null().sum()),
        "transaction_ids": digest(result["record_id"].to_list()),
        "reject_reasons": digest(reasons),
        "reject_details": digest(result["reject_detail"].to_list()),
        "input_hashes": digest(result["input_hash"].to_list()),
        "history_hashes": digest(result["history_hash"].to_list()),
        "unseen_fields": digest(unseen),
        # The result's id column is `record_id` (0012 step 5); the fixture names it as it was recorded.
        "first_rows": result.head(SHOWN_ROWS).drop("score").rename({"record_id": "transaction_id"}).to_dicts(),
    }


def scores_summary(scores: pl.Series) -> dict[str, Any]:
    values = scores.to_numpy()  # NaN for a row without a score
    scored = values[np.isfinite(values)]
    return {
        "mean": float(scored.mean()),
        "min": float(scored.min()),
        "max": float(scored.max()),
        # Every row's score (null where rejected), twenty to a line.
        "all": [
            [None if np.isnan(value) else value for value in values[start : start + SHOWN_ROWS].tolist()]
            for start in range(0, values.size, SHOWN_ROWS)
        ],
    }


def batch_section(predictor: TorchPredictor, day: pl.DataFrame) -> dict[str, Any]:
    """The day scored as the batch path scores a partition: validated once, its own history."""
    checked = validate(REFERENCE, day.select(RAW_COLUMNS))
    checked = checked.with_columns(hash_inputs(REFERENCE, checked))
    prepared = predictor.prepare(checked, FrameHistory(REFERENCE, checked))
    result = predictor.complete(prepared)
    assert prepared.features is not None
    return {
        "result": result_exact(result),
        "features": feature_summary(prepared.features),
        "scores": scores_summary(result["score"]),
    }


def online_section(predictor: TorchPredictor, stored: pl.DataFrame, next_day: pl.DataFrame) -> list[dict[str, Any]]:
    """Single records scored one request at a time, as `ScoringCore._score_round` calls the core."""
    history = StoredHistory(stored)
    answers = []
    for position in ONLINE_ROWS:
        record = next_day.select(RAW_COLUMNS).row(position, named=True)
        checked = validate(REFERENCE, raw_frame(REFERENCE, [record]))
        checked = checked.hstack([hash_inputs(REFERENCE, checked)])
        # Named as the fixture recorded the id (see `result_exact`).
        answer = predictor.predict(checked, history).rename({"record_id": "transaction_id"})
        answers.append(answer.row(0, named=True))
    return answers


def score_schemas() -> dict[str, Any]:
    """The component schemas /score's request body and responses reach, by $ref, verbatim."""
    document = service_document(REFERENCE, ServingSettings(), SecuritySettings(), "golden")
    schemas = document["components"]["schemas"]
    score = document["paths"]["/score"]["post"]
    pending = _refs({"request": score["requestBody"], "responses": score["responses"]})
    reached: dict[str, Any] = {}
    while pending:
        name = pending.pop()
        if name not in reached:
            reached[name] = schemas[name]
            pending |= _refs(schemas[name])
    return dict(sorted(reached.items()))


def _refs(node: Any) -> set[str]:
    prefix = "#/components/schemas/"
    if isinstance(node, dict):
        own = {node["$ref"].removeprefix(prefix)} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node))
    return set()


@functools.cache
def observed() -> dict[str, Any]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        predictor = reference_predictor()
        day = generate_day(DAY, DEMO)
        return {
            "input": {"day": DAY.isoformat(), "next_day": NEXT_DAY.isoformat(), "demo": repr(DEMO)},
            "batch": batch_section(predictor, day),
            "online": online_section(predictor, day, generate_day(NEXT_DAY, DEMO)),
            "openapi_score_schemas": score_schemas(),
        }
    finally:
        torch.set_num_threads(previous)


def to_json(node: Any, depth: int = 0) -> str:
    """Indented JSON with each list of plain values on one line: a diff shows the rows that moved."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(node, dict) and node:
        items = [f"{inner}{json.dumps(key)}: {to_json(node[key], depth + 1)}" for key in sorted(node)]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(node, list) and any(isinstance(value, dict | list) for value in node):
        return "[\n" + ",\n".join(f"{inner}{to_json(value, depth + 1)}" for value in node) + f"\n{pad}]"
    return json.dumps(node)


@pytest.fixture(scope="module")
def golden() -> Iterator[dict[str, Any]]:
    if REGENERATE:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(to_json(observed()) + "\n")
    yield json.loads(GOLDEN.read_text())


def assert_close(actual: Any, expected: Any) -> None:
    np.testing.assert_allclose(
        np.array(actual, dtype=np.float64), np.array(expected, dtype=np.float64), rtol=RTOL, atol=ATOL
    )


def test_input_is_the_pinned_demo_day(golden: dict[str, Any]) -> None:
    assert observed()["input"] == golden["input"]


def test_batch_rejections_hashes_digests_and_unseen_fields(golden: dict[str, Any]) -> None:
    assert observed()["batch"]["result"] == golden["batch"]["result"]
    # The fixture exercises what it pins.
    assert golden["batch"]["result"]["reject_reason_counts"]
    assert golden["batch"]["result"]["unseen_field_counts"]


def test_batch_features(golden: dict[str, Any]) -> None:
    actual, expected = observed()["batch"]["features"], golden["batch"]["features"]
    assert actual["exact"] == expected["exact"]
    for name in ("current_numeric", "history_numeric"):
        assert actual[name].keys() == expected[name].keys()
        for key in actual[name]:
            assert_close(actual[name][key], expected[name][key])


def test_batch_scores(golden: dict[str, Any]) -> None:
    actual, expected = observed()["batch"]["scores"], golden["batch"]["scores"]
    assert actual.keys() == expected.keys()
    for key in actual:
        assert_close(actual[key], expected[key])


def test_online_single_records(golden: dict[str, Any]) -> None:
    actual, expected = observed()["online"], golden["online"]
    assert [{k: v for k, v in a.items() if k != "score"} for a in actual] == [
        {k: v for k, v in e.items() if k != "score"} for e in expected
    ]
    assert_close([a["score"] for a in actual], [e["score"] for e in expected])
    # The records exercise what they pin: stored history, a rejection, each unseen field.
    assert any(e["history_hash"] not in (None, "0" * 16) for e in expected)
    assert any(e["reject_reason"] is not None for e in expected)
    assert {e["unseen_fields"] for e in expected} >= {"country", "currency", "merchant_category"}


def test_openapi_score_schemas(golden: dict[str, Any]) -> None:
    assert observed()["openapi_score_schemas"] == golden["openapi_score_schemas"]
