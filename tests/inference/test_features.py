"""One feature pipeline: a record's features are bit-identical inside a partition or alone.

The batch path computes features over a whole partition frame; the online path computes them for
one record with history fetched from the store. Both must produce the same bits, on both backends.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine

from inference.batch import ingest_day
from inference.contract import FrameHistory
from inference.demo import DemoConfig, day_range, generate_day, generate_days
from inference.features import (
    CURRENT_CATEGORICAL,
    CURRENT_NUMERIC,
    HISTORY_NUMERIC_WIDTH,
    FeatureBatch,
    build_features,
)
from inference.migrate import upgrade
from inference.records import hash_inputs, split_valid
from inference.store import StoreHistory, make_engine
from tests.inference.support import DAY, postgres_database

SEEDS = (21, 22)
DAYS = day_range(DAY, 3)
ARRAYS = ("current_categorical", "current_numeric", "history_categorical", "history_numeric", "history_mask")


def demo_config(seed: int) -> DemoConfig:
    # Few accounts, so most records have a full history reaching back into earlier days.
    return DemoConfig(seed=seed, rows_per_day=600, poison_rate=0.03, accounts=40)


@functools.cache
def partition_valid(seed: int) -> pl.DataFrame:
    valid, _ = split_valid(generate_days(DAYS[0], len(DAYS), demo_config(seed)))
    return valid.with_columns(hash_inputs(valid))


@functools.cache
def partition_features(seed: int, k: int) -> FeatureBatch:
    valid = partition_valid(seed)
    return build_features(valid, valid, k)


def assert_same_features(left: FeatureBatch, right: FeatureBatch) -> None:
    assert left.transaction_ids == right.transaction_ids
    assert left.history_digests is not None
    assert left.history_digests == right.history_digests
    for name in ARRAYS:
        a, b = getattr(left, name), getattr(right, name)
        assert a.dtype == b.dtype, name
        assert np.array_equal(a, b), name


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stores(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Engine]]:
    """One store per seed (ids repeat across seeds), holding every generated day; built once per module."""
    with ExitStack() as cleanup:
        if request.param == "sqlite":
            folder = tmp_path_factory.mktemp("feature-stores")
            urls = [f"sqlite:///{folder / f'seed{seed}.db'}" for seed in SEEDS]
        else:
            admin_url = str(request.getfixturevalue("postgres_admin_url"))
            urls = [cleanup.enter_context(postgres_database(admin_url)) for _ in SEEDS]
        engines: dict[int, Engine] = {}
        for seed, url in zip(SEEDS, urls, strict=True):
            engines[seed] = make_engine(url)
            cleanup.callback(engines[seed].dispose)
            upgrade(engines[seed])
            for day in DAYS:
                ingest_day(engines[seed], generate_day(day, demo_config(seed)), day)
        yield engines


def test_feature_batch_shapes_and_dtypes() -> None:
    k = 8
    features = partition_features(SEEDS[0], k)
    n = partition_valid(SEEDS[0]).height
    assert len(features) == n
    assert features.current_categorical.shape == (n, len(CURRENT_CATEGORICAL))
    assert features.current_numeric.shape == (n, len(CURRENT_NUMERIC))
    assert features.history_categorical.shape == (n, k, 2)
    assert features.history_numeric.shape == (n, k, HISTORY_NUMERIC_WIDTH)
    assert features.history_mask.shape == (n, k)
    assert features.current_categorical.dtype == np.int64
    assert features.current_numeric.dtype == np.float32
    assert features.history_mask.dtype == np.bool_
    assert np.isfinite(features.current_numeric).all()
    assert np.isfinite(features.history_numeric).all()
    # Deep histories: the fixture has ~14 rows per account per day.
    assert features.history_mask.all(axis=1).mean() > 0.8


def test_targets_order_and_history_rows_after_targets_do_not_matter() -> None:
    valid = partition_valid(SEEDS[0])
    k = 6
    shuffled = valid.sample(fraction=1.0, shuffle=True, seed=3)
    reordered = build_features(shuffled, valid, k)
    positions = {tx: i for i, tx in enumerate(valid["transaction_id"])}
    assert_same_features(
        reordered, partition_features(SEEDS[0], k).take(np.array([positions[t] for t in shuffled["transaction_id"]]))
    )
    # Rows later than a target, and rows of other accounts, never change its features.
    first_day = valid.filter(pl.col("transaction_id").str.starts_with(f"tx-{DAYS[0]:%Y%m%d}"))
    only_first_day = build_features(first_day, first_day, k)
    assert_same_features(only_first_day, partition_features(SEEDS[0], k).slice(0, first_day.height))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data(), seed=st.sampled_from(SEEDS), k=st.integers(min_value=1, max_value=24))
def test_a_record_alone_with_store_history_matches_the_partition(
    stores: dict[int, Engine], data: st.DataObject, seed: int, k: int
) -> None:
    valid = partition_valid(seed)
    row = data.draw(st.integers(min_value=0, max_value=valid.height - 1), label="row")
    single = valid.slice(row, 1)

    fetched = StoreHistory(stores[seed]).history_for(single, k)
    assert fetched.height <= k
    assert (fetched["account_id"] == single["account_id"][0]).all()

    assert_same_features(build_features(single, fetched, k), partition_features(seed, k).slice(row, row + 1))


def test_frame_history_and_store_history_agree_for_a_whole_day(stores: dict[int, Engine]) -> None:
    seed, k = SEEDS[1], 16
    everything = generate_days(DAYS[0], len(DAYS), demo_config(seed))
    valid = partition_valid(seed)
    last_day = valid.filter(pl.col("transaction_id").str.starts_with(f"tx-{DAYS[-1]:%Y%m%d}"))
    # Over 500 targets: more than SQLite allows as terms of one compound SELECT.
    assert last_day.height > 500

    in_memory = build_features(last_day, FrameHistory(everything).history_for(last_day, k), k)
    from_store = build_features(last_day, StoreHistory(stores[seed]).history_for(last_day, k), k)
    assert_same_features(in_memory, from_store)
    assert_same_features(in_memory, partition_features(seed, k).slice(valid.height - last_day.height, valid.height))


def test_a_changed_history_record_changes_the_digest_of_exactly_the_records_that_read_it() -> None:
    seed, k = SEEDS[0], 4
    valid = partition_valid(seed).sort("account_id", "event_ts", "transaction_id")
    account = valid["account_id"][0]
    own = valid.filter(pl.col("account_id") == account)
    assert own.height > k + 2
    changed_id = own["transaction_id"][1]
    corrected = valid.with_columns(
        amount=pl.when(pl.col("transaction_id") == changed_id).then(pl.col("amount") + 1).otherwise(pl.col("amount"))
    ).drop("input_hash")
    corrected = corrected.with_columns(hash_inputs(corrected))

    before, after = build_features(valid, valid, k), build_features(corrected, corrected, k)
    assert before.history_digests is not None and after.history_digests is not None
    differing = {
        tid
        for tid, old, new in zip(before.transaction_ids, before.history_digests, after.history_digests, strict=True)
        if old != new
    }
    assert differing == set(own["transaction_id"][2 : 2 + k])
    # Features without hashes (training) carry no digest.
    assert build_features(valid.drop("input_hash"), valid.drop("input_hash"), k).history_digests is None
