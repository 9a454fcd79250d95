"""The Predictor contract: one result row per input row, in order; a bad item fails only itself."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
import polars as pl
import pytest
import torch

from inference.contract import RESULT_SCHEMA, FrameHistory, TorchPredictor
from inference.features import FeatureBatch, build_features
from inference.model import LoadedModel, score_batch
from inference.records import hash_inputs, split_valid, validate
from tandem_specs.transactions.demo import EXPECTED_REASON, DemoConfig, PoisonKind, generate_day
from tests.inference.support import DAY, TINY_MODEL
from tests.reference import REFERENCE
from tests.shared import reference_model

pytestmark = pytest.mark.usefixtures("torch_single_thread")

K = TINY_MODEL.history_length


@functools.cache
def tiny_model() -> LoadedModel:
    torch.manual_seed(0)
    return reference_model(TINY_MODEL)


def day(rows: int, poison_rate: float, seed: int = 8) -> pl.DataFrame:
    return generate_day(DAY, DemoConfig(seed=seed, rows_per_day=rows, poison_rate=poison_rate))


def fake_scores(features: FeatureBatch) -> np.ndarray:
    """A per-item function of the features, so a score never depends on the rest of the batch."""
    amount_log = features.arrays[1][:, 0].astype(np.float64)
    return amount_log / (1.0 + amount_log) * 0.5 + features.arrays[4].mean(axis=1) * 0.25


class FakeForward:
    """A hand-written model: fails every batch holding a poison id, gives `bad_value` to others."""

    def __init__(self, raising: Iterable[str] = (), bad_values: dict[str, float] | None = None) -> None:
        self.raising = set(raising)
        self.bad_values = bad_values or {}
        self.calls = 0
        self.batch_sizes: list[int] = []

    def __call__(self, features: FeatureBatch) -> np.ndarray:
        self.calls += 1
        self.batch_sizes.append(len(features))
        present = self.raising.intersection(features.record_ids)
        if present:
            raise RuntimeError(f"cannot score {sorted(present)}")
        scores = fake_scores(features)
        for position, transaction_id in enumerate(features.record_ids):
            if transaction_id in self.bad_values:
                scores[position] = self.bad_values[transaction_id]
        return scores


def predictor(forward: FakeForward | None = None, forward_batch_size: int = 4096) -> TorchPredictor:
    return TorchPredictor(
        model=tiny_model(),
        model_version="test:1",
        spec=REFERENCE,
        forward_batch_size=forward_batch_size,
        forward=forward,
    )


def expected_fake_scores(frame: pl.DataFrame) -> dict[str, float]:
    valid, _ = split_valid(REFERENCE, frame)
    features = build_features(REFERENCE, valid, valid, K)
    return dict(zip(features.record_ids, fake_scores(features).tolist(), strict=True))


def test_one_row_per_input_row_in_input_order_with_poison_rejected() -> None:
    frame = day(400, poison_rate=0.05)
    results = predictor().predict(frame, FrameHistory(REFERENCE, frame))

    assert results.schema == pl.Schema(RESULT_SCHEMA)
    assert results.height == frame.height
    assert results["record_id"].equals(frame["transaction_id"])
    assert results["input_hash"].equals(hash_inputs(REFERENCE, validate(REFERENCE, frame)))

    for kind, reason, score, detail in zip(
        frame["poison_kind"], results["reject_reason"], results["score"], results["reject_detail"], strict=True
    ):
        if kind is None:
            assert reason is None
            assert detail is None
            assert 0.0 < score < 1.0
        else:
            assert reason == EXPECTED_REASON[PoisonKind(kind)]
            assert detail is not None
            assert detail.startswith(reason)
            assert score is None


def test_default_forward_is_the_model() -> None:
    frame = day(300, poison_rate=0.0)
    results = predictor().predict(frame, FrameHistory(REFERENCE, frame))
    valid, _ = split_valid(REFERENCE, frame)
    expected = score_batch(tiny_model(), build_features(REFERENCE, valid, valid, K))
    assert np.array_equal(results["score"].to_numpy(), expected)


def test_shuffled_input_gives_the_same_result_per_row() -> None:
    frame = day(300, poison_rate=0.05).with_row_index("row")
    shuffled = frame.sample(fraction=1.0, shuffle=True, seed=1)
    forward = FakeForward()
    in_order = predictor(forward).predict(frame.drop("row"), FrameHistory(REFERENCE, frame))
    reordered = predictor(forward).predict(shuffled.drop("row"), FrameHistory(REFERENCE, frame))

    assert reordered["record_id"].equals(shuffled["transaction_id"])
    # Duplicated ids are excluded: which copy counts as "first" changes with the order.
    unique = frame.filter(pl.col("transaction_id").is_unique())["row"].to_list()
    by_row = reordered.with_columns(row=shuffled["row"]).sort("row")
    for column in ("score", "reject_reason", "input_hash"):
        assert by_row[column].gather(unique).equals(in_order[column].gather(unique)), column


@pytest.mark.parametrize("forward_batch_size", [4096, 64, 1])
def test_a_forward_that_raises_fails_only_the_item_that_causes_it(forward_batch_size: int) -> None:
    frame = day(300, poison_rate=0.0)
    poison_id = frame["transaction_id"][137]
    forward = FakeForward(raising={poison_id})
    results = predictor(forward, forward_batch_size).predict(frame, FrameHistory(REFERENCE, frame))
    expected = expected_fake_scores(frame)

    assert results["record_id"].equals(frame["transaction_id"])
    for transaction_id, reason, detail, score in results.select(
        "record_id", "reject_reason", "reject_detail", "score"
    ).iter_rows():
        if transaction_id == poison_id:
            assert reason == "model_error"
            assert detail.startswith("RuntimeError: cannot score")
            assert score is None
        else:
            assert reason is None
            assert detail is None
            assert score == expected[transaction_id]


@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf, -0.25, 1.5])
def test_a_nonfinite_or_out_of_range_score_fails_only_its_item(bad_value: float) -> None:
    frame = day(200, poison_rate=0.0)
    odd_id = frame["transaction_id"][50]
    results = predictor(FakeForward(bad_values={odd_id: bad_value})).predict(frame, FrameHistory(REFERENCE, frame))

    reasons = dict(zip(results["record_id"], results["reject_reason"], strict=True))
    assert reasons.pop(odd_id) == "nonfinite_score"
    assert set(reasons.values()) == {None}
    assert results.filter(pl.col("record_id") == odd_id)["score"].to_list() == [None]
    assert results["score"].null_count() == 1


def test_mixed_failures_and_validation_rejects_in_one_batch() -> None:
    frame = day(400, poison_rate=0.05)
    clean = frame.filter(pl.col("poison_kind").is_null())["transaction_id"]
    raising, nan_id = {clean[10], clean[200]}, clean[300]
    forward = FakeForward(raising=raising, bad_values={nan_id: math.nan})
    results = predictor(forward).predict(frame, FrameHistory(REFERENCE, frame))

    for kind, transaction_id, reason in zip(
        frame["poison_kind"], frame["transaction_id"], results["reject_reason"], strict=True
    ):
        if kind is not None:
            assert reason == EXPECTED_REASON[PoisonKind(kind)]
        elif transaction_id in raising:
            assert reason == "model_error"
        elif transaction_id == nan_id:
            assert reason == "nonfinite_score"
        else:
            assert reason is None


@functools.cache
def large_clean_day() -> pl.DataFrame:
    return day(1024, poison_rate=0.0, seed=12)


@pytest.mark.parametrize("poison_count", [0, 1, 3])
def test_bisection_costs_k_log_n_forwards_not_n(poison_count: int) -> None:
    frame = large_clean_day()
    n = frame.height
    raising = set(frame["transaction_id"].gather([5, 500, 1000][:poison_count]))
    forward = FakeForward(raising=raising)
    results = predictor(forward).predict(frame, FrameHistory(REFERENCE, frame))

    assert set(results.filter(pl.col("reject_reason").is_not_null())["record_id"]) == raising
    assert results["score"].null_count() == poison_count
    depth = math.ceil(math.log2(n))
    if poison_count == 0:
        assert forward.calls == 1
    elif poison_count == 1:
        # One failing half per level, each split costing two forwards.
        assert forward.calls == 1 + 2 * depth
    assert forward.calls <= 1 + 2 * poison_count * depth
    assert forward.calls < n // 10
    assert max(forward.batch_sizes) == n


def test_nothing_valid_means_no_forward_at_all() -> None:
    frame = day(40, poison_rate=0.0).with_columns(currency=pl.lit("US$"))
    forward = FakeForward()
    results = predictor(forward).predict(frame, FrameHistory(REFERENCE, frame))
    assert forward.calls == 0
    assert set(results["reject_reason"]) == {"bad_currency"}
    assert results["score"].null_count() == frame.height


def test_an_empty_frame_gives_an_empty_result() -> None:
    frame = day(10, poison_rate=0.0).clear()
    results = predictor(FakeForward()).predict(frame, FrameHistory(REFERENCE, frame))
    assert results.height == 0
    assert results.schema == pl.Schema(RESULT_SCHEMA)


def with_unseen_values(frame: pl.DataFrame) -> pl.DataFrame:
    """Rows 3, 4, 5 get an unseen category, country, currency; row 6 all three."""
    row = pl.int_range(pl.len())
    return frame.with_columns(
        merchant_category=pl.when(row.is_in([3, 6])).then(pl.lit("ev_charging")).otherwise("merchant_category"),
        country=pl.when(row.is_in([4, 6])).then(pl.lit("KR")).otherwise("country"),
        currency=pl.when(row.is_in([5, 6])).then(pl.lit("KRW")).otherwise("currency"),
    )


def test_unseen_values_are_scored_finite_and_flagged_per_row() -> None:
    frame = with_unseen_values(generate_day(DAY, DemoConfig(seed=8, rows_per_day=300, poison_rate=0.05, unseen_rate=0)))
    assert frame["poison_kind"].slice(3, 4).null_count() == 4, "the rows given unseen values are clean"
    results = predictor().predict(frame, FrameHistory(REFERENCE, frame))

    flags = results["unseen_fields"].to_list()
    assert flags[3:7] == ["merchant_category", "country", "currency", "country,currency,merchant_category"]
    scored = results.filter(pl.col("reject_reason").is_null())
    assert scored["score"].is_finite().all()
    assert ((scored["score"] > 0) & (scored["score"] < 1)).all()
    assert scored["unseen_fields"].null_count() == scored.height - 4
    # A rejected row carries no flag, whatever its values.
    assert results.filter(pl.col("reject_reason").is_not_null())["unseen_fields"].null_count() == (
        results.height - scored.height
    )


def test_an_unseen_value_changes_the_score_only_through_its_bucket() -> None:
    """Two different unseen categories are one bucket: the same features, the same score."""
    frame = generate_day(DAY, DemoConfig(seed=8, rows_per_day=120, poison_rate=0.0, unseen_rate=0))
    first = frame.with_columns(merchant_category=pl.lit("ev_charging"))
    second = frame.with_columns(merchant_category=pl.lit("space tourism"))
    one = predictor().predict(first, FrameHistory(REFERENCE, first))
    other = predictor().predict(second, FrameHistory(REFERENCE, second))
    assert one["score"].equals(other["score"])
    assert set(one["unseen_fields"]) == {"merchant_category"}
    known = predictor().predict(frame, FrameHistory(REFERENCE, frame))
    assert not known["score"].equals(one["score"])
