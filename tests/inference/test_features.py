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
from inference.demo import day_range
from inference.features import FeatureBatch, build_features
from inference.migrate import upgrade
from inference.records import hash_inputs, split_valid
from inference.spec import load_spec
from inference.store import StoreHistory, make_engine, warm_history_statements
from tandem_specs.transactions.demo import UNSEEN_VALUES, DemoConfig, generate_day, generate_days
from tandem_specs.transactions.features import CURRENT_CATEGORICAL, CURRENT_NUMERIC, HISTORY_NUMERIC_WIDTH, USD_PER_UNIT
from tandem_specs.transactions.model import EMBEDDING_SIZES
from tests.inference.support import DAY, frame_of, postgres_database, record
from tests.reference import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES, REFERENCE

CURRENT_CATEGORICAL_CARDINALITY, HISTORY_CATEGORICAL_CARDINALITY = EMBEDDING_SIZES

SEEDS = (21, 22)
DAYS = day_range(DAY, 3)
ARRAYS = ("current_categorical", "current_numeric", "history_categorical", "history_numeric", "history_mask")


def demo_config(seed: int) -> DemoConfig:
    # Few accounts, so most records have a full history reaching back into earlier days; more
    # unseen values than the default, so histories hold them too.
    return DemoConfig(seed=seed, rows_per_day=600, poison_rate=0.03, accounts=40, unseen_rate=0.02)


@functools.cache
def partition_valid(seed: int) -> pl.DataFrame:
    valid, _ = split_valid(REFERENCE, generate_days(DAYS[0], len(DAYS), demo_config(seed)))
    return valid.with_columns(hash_inputs(REFERENCE, valid))


@functools.cache
def partition_features(seed: int, k: int) -> FeatureBatch:
    valid = partition_valid(seed)
    return build_features(load_spec(), valid, valid, k)


def assert_same_features(left: FeatureBatch, right: FeatureBatch) -> None:
    assert left.record_ids == right.record_ids
    assert left.history_digests is not None
    assert left.history_digests == right.history_digests
    assert left.unseen == right.unseen
    for name, a, b in zip(ARRAYS, left.arrays, right.arrays, strict=True):
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
            upgrade(engines[seed], REFERENCE)
            for day in DAYS:
                ingest_day(REFERENCE, engines[seed], generate_day(day, demo_config(seed)), day)
        yield engines


def test_feature_batch_shapes_and_dtypes() -> None:
    k = 8
    features = partition_features(SEEDS[0], k)
    n = partition_valid(SEEDS[0]).height
    assert len(features) == n
    assert features.arrays[0].shape == (n, len(CURRENT_CATEGORICAL))
    assert features.arrays[1].shape == (n, len(CURRENT_NUMERIC))
    assert features.arrays[2].shape == (n, k, 2)
    assert features.arrays[3].shape == (n, k, HISTORY_NUMERIC_WIDTH)
    assert features.arrays[4].shape == (n, k)
    assert features.arrays[0].dtype == np.int64
    assert features.arrays[1].dtype == np.float32
    assert features.arrays[4].dtype == np.bool_
    assert np.isfinite(features.arrays[1]).all()
    assert np.isfinite(features.arrays[3]).all()
    # Deep histories: the fixture has ~14 rows per account per day.
    assert features.arrays[4].all(axis=1).mean() > 0.8


def test_targets_order_and_history_rows_after_targets_do_not_matter() -> None:
    valid = partition_valid(SEEDS[0])
    k = 6
    shuffled = valid.sample(fraction=1.0, shuffle=True, seed=3)
    reordered = build_features(load_spec(), shuffled, valid, k)
    positions = {tx: i for i, tx in enumerate(valid["transaction_id"])}
    assert_same_features(
        reordered, partition_features(SEEDS[0], k).take(np.array([positions[t] for t in shuffled["transaction_id"]]))
    )
    # Rows later than a target, and rows of other accounts, never change its features.
    first_day = valid.filter(pl.col("transaction_id").str.starts_with(f"tx-{DAYS[0]:%Y%m%d}"))
    only_first_day = build_features(load_spec(), first_day, first_day, k)
    assert_same_features(only_first_day, partition_features(SEEDS[0], k).slice(0, first_day.height))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data(), seed=st.sampled_from(SEEDS), k=st.integers(min_value=1, max_value=24))
def test_a_record_alone_with_store_history_matches_the_partition(
    stores: dict[int, Engine], data: st.DataObject, seed: int, k: int
) -> None:
    valid = partition_valid(seed)
    row = data.draw(st.integers(min_value=0, max_value=valid.height - 1), label="row")
    single = valid.slice(row, 1)

    fetched = StoreHistory(REFERENCE, stores[seed]).history_for(single, k)
    assert fetched.height <= k
    assert (fetched["account_id"] == single["account_id"][0]).all()

    assert_same_features(
        build_features(load_spec(), single, fetched, k), partition_features(seed, k).slice(row, row + 1)
    )


def test_frame_history_and_store_history_agree_for_a_whole_day(stores: dict[int, Engine]) -> None:
    seed, k = SEEDS[1], 16
    everything = generate_days(DAYS[0], len(DAYS), demo_config(seed))
    valid = partition_valid(seed)
    last_day = valid.filter(pl.col("transaction_id").str.starts_with(f"tx-{DAYS[-1]:%Y%m%d}"))
    # Over 500 targets: more than SQLite allows as terms of one compound SELECT.
    assert last_day.height > 500

    in_memory = build_features(load_spec(), last_day, FrameHistory(REFERENCE, everything).history_for(last_day, k), k)
    from_store = build_features(
        load_spec(), last_day, StoreHistory(REFERENCE, stores[seed]).history_for(last_day, k), k
    )
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
    corrected = corrected.with_columns(hash_inputs(REFERENCE, corrected))

    before, after = build_features(load_spec(), valid, valid, k), build_features(load_spec(), corrected, corrected, k)
    assert before.history_digests is not None and after.history_digests is not None
    differing = {
        tid
        for tid, old, new in zip(before.record_ids, before.history_digests, after.history_digests, strict=True)
        if old != new
    }
    assert differing == set(own["transaction_id"][2 : 2 + k])
    # Features without hashes (training) carry no digest.
    assert build_features(load_spec(), valid.drop("input_hash"), valid.drop("input_hash"), k).history_digests is None


def test_unseen_values_are_encoded_as_the_unknown_bucket_of_their_field() -> None:
    records = [
        record(transaction_id="a", merchant_category="ev_charging", event_time="2026-11-01T10:00:00Z"),
        record(transaction_id="b", country="KR", event_time="2026-11-01T11:00:00Z"),
        record(transaction_id="c", currency="KRW", amount=13_000.0, event_time="2026-11-01T12:00:00Z"),
        record(
            transaction_id="d",
            merchant_category="b2b/saas",
            country="ZZ",
            currency="XXX",
            event_time="2026-11-01T13:00:00Z",
        ),
        record(transaction_id="e", event_time="2026-11-01T14:00:00Z"),
    ]
    valid, rejected = split_valid(REFERENCE, frame_of(*records))
    assert rejected.is_empty()
    k = 4
    features = build_features(load_spec(), valid, valid, k)
    currency, category, country = (
        CURRENT_CATEGORICAL.index(c) for c in ("currency_idx", "merchant_category_idx", "country_idx")
    )
    encoded = features.arrays[0]
    assert encoded[:, category].tolist() == [
        len(MERCHANT_CATEGORIES),
        *[MERCHANT_CATEGORIES.index("grocery")] * 2,
        len(MERCHANT_CATEGORIES),
        MERCHANT_CATEGORIES.index("grocery"),
    ]
    assert encoded[:, country].tolist() == [
        COUNTRIES.index("DE"),
        len(COUNTRIES),
        COUNTRIES.index("DE"),
        len(COUNTRIES),
        COUNTRIES.index("DE"),
    ]
    assert encoded[:, currency].tolist() == [CURRENCIES.index("EUR")] * 2 + [len(CURRENCIES)] * 2 + [
        CURRENCIES.index("EUR")
    ]
    assert features.unseen == [
        "merchant_category",
        "country",
        "currency",
        "country,currency,merchant_category",
        None,
    ]
    # An unseen currency has no rate: its amount is taken as is (and flagged above).
    amount_log = features.arrays[1][:, CURRENT_NUMERIC.index("amount_log")]
    assert amount_log[2] == np.float32(np.log1p(13_000.0))
    assert amount_log[4] == np.float32(np.log1p(42.5 * USD_PER_UNIT["EUR"]))
    # The last record's history holds the unseen values as the unknown bucket, shifted by one.
    assert features.arrays[2][4, :, 0].tolist() == [
        len(MERCHANT_CATEGORIES) + 1,
        MERCHANT_CATEGORIES.index("grocery") + 1,
        MERCHANT_CATEGORIES.index("grocery") + 1,
        len(MERCHANT_CATEGORIES) + 1,
    ]
    assert features.arrays[2][4, :, 1].tolist() == [
        len(COUNTRIES) + 1,
        COUNTRIES.index("DE") + 1,
        len(COUNTRIES) + 1,
        COUNTRIES.index("DE") + 1,
    ]
    # Every index has an embedding row.
    assert (encoded < np.array(CURRENT_CATEGORICAL_CARDINALITY)).all()
    assert (features.arrays[2] < np.array(HISTORY_CATEGORICAL_CARDINALITY)).all()


def test_a_record_with_unseen_values_alone_matches_the_partition(stores: dict[int, Engine]) -> None:
    """The property test above draws rows at random; this one takes every row holding an unseen
    value, or reading one in its history, and scores it alone against the store."""
    k = 8
    for seed in SEEDS:
        valid = partition_valid(seed)
        features = partition_features(seed, k)
        flagged = np.array([fields is not None for fields in features.unseen])
        in_history = (features.arrays[2][:, :, 0] == len(MERCHANT_CATEGORIES) + 1).any(axis=1)
        assert {value for _, value in UNSEEN_VALUES} <= set(
            valid.filter(pl.Series(flagged))
            .select(pl.concat_list("merchant_category", "country", "currency"))
            .to_series()
            .explode()
        )
        rows = np.flatnonzero(flagged | in_history)
        assert flagged.sum() >= 3 and (in_history & ~flagged).sum() >= 1
        for row in rows.tolist():
            single = valid.slice(row, 1)
            fetched = StoreHistory(REFERENCE, stores[seed]).history_for(single, k)
            assert_same_features(build_features(load_spec(), single, fetched, k), features.slice(row, row + 1))


def test_records_sent_together_online_each_read_the_store_alone(stores: dict[int, Engine]) -> None:
    """Not-yet-stored records scored in one adaptive batch: each one's features are those it gets
    scored alone, so an answer never depends on what else shared its batch. Stored records read
    each other through the store either way."""
    seed, k = SEEDS[0], 8
    next_day = DAYS[-1] + (DAYS[1] - DAYS[0])
    arriving, _ = split_valid(REFERENCE, generate_day(next_day, demo_config(seed)))
    arriving = arriving.with_columns(hash_inputs(REFERENCE, arriving))
    busiest = arriving.group_by("account_id").len().sort(["len", "account_id"], descending=True)["account_id"][0]
    batch = pl.concat([arriving.filter(pl.col("account_id") == busiest).head(3), arriving.head(5)]).unique(
        "transaction_id", maintain_order=True
    )
    store = StoreHistory(REFERENCE, stores[seed])

    isolated = build_features(load_spec(), batch, store.history_for(batch, k), k, targets_read_each_other=False)
    for position in range(batch.height):
        alone = batch.slice(position, 1)
        assert_same_features(
            isolated.take(np.array([position])), build_features(load_spec(), alone, store.history_for(alone, k), k)
        )
    # The same batch with the targets as each other's history: the account's later records read
    # its earlier ones, which is what the online path must not do.
    together = build_features(load_spec(), batch, store.history_for(batch, k), k)
    assert together.history_digests != isolated.history_digests

    last_day = partition_valid(seed).filter(pl.col("transaction_id").str.starts_with(f"tx-{DAYS[-1]:%Y%m%d}")).head(64)
    stored_history = store.history_for(last_day, k)
    assert_same_features(
        build_features(load_spec(), last_day, stored_history, k, targets_read_each_other=False),
        build_features(load_spec(), last_day, stored_history, k),
    )


def test_a_group_of_any_size_reads_exactly_its_own_targets_history(stores: dict[int, Engine]) -> None:
    """History statements come in power-of-two sizes, a group padded with its last target: each
    group still reads exactly the rows its targets read alone, warmed statements or not."""
    seed, k = SEEDS[0], 8
    store = StoreHistory(REFERENCE, stores[seed])
    targets = partition_valid(seed).tail(13)
    alone = [store.history_for(targets.slice(i, 1), k) for i in range(targets.height)]

    def rows_of(frame: pl.DataFrame) -> list[tuple[object, ...]]:
        return sorted(frame.rows())

    with stores[seed].connect() as conn:
        warm_history_statements(REFERENCE, conn, 8)  # sizes 1, 2, 4 and 8 compiled; 16 is not
    for size in (1, 2, 3, 5, 8, 13):
        expected = pl.concat(alone[:size]).unique("transaction_id")
        assert rows_of(store.history_for(targets.head(size), k)) == rows_of(expected), f"{size} targets"
