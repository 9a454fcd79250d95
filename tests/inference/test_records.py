"""Validation: every poison kind gets exactly its reason, clean rows pass, one bad row never fails a frame."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from inference.demo import EXPECTED_REASON, DemoConfig, PoisonKind, generate_day, generate_days
from inference.records import (
    ID_MAX_LENGTH,
    RAW_COLUMNS,
    RejectReason,
    Transaction,
    format_event_time,
    split_valid,
    validate,
)
from tests.inference.support import CLEAN_RECORD, DAY, frame_of, record


def reasons_of(*records: dict[str, Any]) -> list[str | None]:
    return validate(frame_of(*records))["reject_reason"].to_list()


@pytest.mark.parametrize("seed", [1, 7])
def test_every_poison_kind_gets_exactly_its_expected_reason(seed: int) -> None:
    frame = generate_days(DAY, 2, DemoConfig(seed=seed, rows_per_day=800, poison_rate=0.05))
    checked = validate(frame)

    poisoned = checked.filter(pl.col("poison_kind").is_not_null())
    assert set(poisoned["poison_kind"].unique()) == {kind.value for kind in PoisonKind}
    for kind, reason in zip(poisoned["poison_kind"], poisoned["reject_reason"], strict=True):
        assert reason == EXPECTED_REASON[PoisonKind(kind)].value, kind

    clean = checked.filter(pl.col("poison_kind").is_null())
    assert clean["reject_reason"].null_count() == clean.height
    assert clean["event_ts"].null_count() == 0


def test_split_valid_partitions_the_frame() -> None:
    frame = generate_day(DAY, DemoConfig(seed=3, rows_per_day=400, poison_rate=0.1))
    valid, rejected = split_valid(frame)
    assert valid.height + rejected.height == frame.height
    assert valid["poison_kind"].null_count() == valid.height
    assert rejected["poison_kind"].null_count() == 0
    assert valid["transaction_id"].is_unique().all()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        ({"transaction_id": None}, RejectReason.MISSING_FIELD),
        ({"transaction_id": ""}, RejectReason.MISSING_FIELD),
        ({"transaction_id": "   "}, RejectReason.MISSING_FIELD),
        ({"account_id": None}, RejectReason.MISSING_FIELD),
        ({"account_id": ""}, RejectReason.MISSING_FIELD),
        ({"transaction_id": "x" * (ID_MAX_LENGTH + 1)}, RejectReason.MISSING_FIELD),
        ({"account_id": "a" * (ID_MAX_LENGTH + 1)}, RejectReason.MISSING_FIELD),
        ({"transaction_id": "x" * ID_MAX_LENGTH}, None),
        ({"currency": "usd"}, RejectReason.BAD_CURRENCY),
        ({"currency": "US$"}, RejectReason.BAD_CURRENCY),
        ({"currency": "EURO"}, RejectReason.BAD_CURRENCY),
        ({"currency": ""}, RejectReason.BAD_CURRENCY),
        ({"currency": "USD\n"}, RejectReason.BAD_CURRENCY),
        ({"currency": None}, RejectReason.BAD_CURRENCY),
        # Well-formed but outside the training vocabulary: scored, not refused.
        ({"currency": "KRW"}, None),
        ({"currency": "XXX"}, None),
        ({"amount": math.nan}, RejectReason.AMOUNT_NOT_FINITE),
        ({"amount": math.inf}, RejectReason.AMOUNT_NOT_FINITE),
        ({"amount": -math.inf}, RejectReason.AMOUNT_NOT_FINITE),
        ({"amount": None}, RejectReason.AMOUNT_NOT_FINITE),
        ({"amount": "twelve"}, RejectReason.AMOUNT_NOT_FINITE),
        ({"amount": -0.01}, RejectReason.AMOUNT_NEGATIVE),
        ({"amount": 0.0}, None),
        ({"amount": 1_000_000.0}, None),
        ({"amount": 1_000_000.01}, RejectReason.AMOUNT_ABSURD),
        ({"merchant_category": None}, RejectReason.MALFORMED_CATEGORY),
        ({"merchant_category": ""}, RejectReason.MALFORMED_CATEGORY),
        ({"merchant_category": "   "}, RejectReason.MALFORMED_CATEGORY),
        ({"merchant_category": "<script>"}, RejectReason.MALFORMED_CATEGORY),
        ({"merchant_category": "gift\tcards"}, RejectReason.MALFORMED_CATEGORY),
        ({"merchant_category": "café"}, RejectReason.MALFORMED_CATEGORY),
        ({"merchant_category": "x" * 65}, RejectReason.MALFORMED_CATEGORY),
        ({"merchant_category": "x" * 64}, None),
        ({"merchant_category": "teleportation"}, None),
        ({"merchant_category": "ev_charging"}, None),
        ({"merchant_category": "Home & Garden / D.I.Y-2"}, None),
        ({"country": None}, RejectReason.MALFORMED_COUNTRY),
        ({"country": "usa"}, RejectReason.MALFORMED_COUNTRY),
        ({"country": "us"}, RejectReason.MALFORMED_COUNTRY),
        ({"country": "USA"}, RejectReason.MALFORMED_COUNTRY),
        ({"country": "U5"}, RejectReason.MALFORMED_COUNTRY),
        ({"country": ""}, RejectReason.MALFORMED_COUNTRY),
        ({"country": "ZZ"}, None),
        ({"country": "KR"}, None),
        ({"event_time": None}, RejectReason.TIMESTAMP_MISSING),
        ({"event_time": ""}, RejectReason.TIMESTAMP_MISSING),
        ({"event_time": "   "}, RejectReason.TIMESTAMP_MISSING),
        ({"event_time": "\t\n"}, RejectReason.TIMESTAMP_MISSING),
        ({"event_time": "2026-11-01T12:00:00"}, RejectReason.TIMESTAMP_UNPARSABLE),
        ({"event_time": "2026-11-01 12:00:00"}, RejectReason.TIMESTAMP_UNPARSABLE),
        ({"event_time": "yesterday"}, RejectReason.TIMESTAMP_UNPARSABLE),
        ({"event_time": "2026-13-45T99:00:00Z"}, RejectReason.TIMESTAMP_UNPARSABLE),
        ({"event_time": "2026-11-01T12:00:00+02:00"}, None),
        ({"event_time": "2026-11-01T12:00:00.5Z"}, None),
    ],
)
def test_hand_written_edge_cases(changes: dict[str, Any], expected: RejectReason | None) -> None:
    assert reasons_of(record(**changes)) == [None if expected is None else expected.value]


def test_offsets_are_normalised_to_utc() -> None:
    checked = validate(frame_of(record(event_time="2026-11-01T12:00:00+02:00")))
    assert checked["event_ts"].to_list() == [datetime(2026, 11, 1, 10, 0, tzinfo=UTC)]


def test_first_rule_in_reason_order_wins() -> None:
    assert reasons_of(record(transaction_id=None, currency="usd", amount=math.nan, event_time=None)) == [
        RejectReason.MISSING_FIELD.value
    ]
    assert reasons_of(record(amount=-5.0, merchant_category="", event_time="bad")) == [
        RejectReason.AMOUNT_NEGATIVE.value
    ]
    assert reasons_of(record(merchant_category="", country="usa")) == [RejectReason.MALFORMED_CATEGORY.value]


def test_duplicated_id_keeps_the_first_occurrence() -> None:
    reasons = reasons_of(
        record(transaction_id="a", amount=1.0),
        record(transaction_id="b"),
        record(transaction_id="a", amount=2.0),
        record(transaction_id="a", amount=3.0),
    )
    assert reasons == [None, None, RejectReason.DUPLICATE_ID.value, RejectReason.DUPLICATE_ID.value]
    valid, _ = split_valid(frame_of(record(transaction_id="a", amount=1.0), record(transaction_id="a", amount=2.0)))
    assert valid["amount"].to_list() == [1.0]


def test_repeated_missing_ids_are_missing_not_duplicates() -> None:
    reasons = reasons_of(record(transaction_id=None), record(transaction_id=None))
    assert reasons == [RejectReason.MISSING_FIELD.value] * 2


def test_one_bad_row_never_fails_the_frame() -> None:
    odd_values: list[dict[str, Any]] = [
        record(transaction_id="ok-1"),
        record(transaction_id="b1", amount=object()),
        record(transaction_id="b2", amount=True),
        record(transaction_id="b3", amount=[1, 2]),
        record(transaction_id="b4", event_time=1_700_000_000),
        record(transaction_id="b5", country={"nested": "dict"}),
        {"transaction_id": "b6"},
        {},
        record(transaction_id="ok-2"),
    ]
    checked = validate(frame_of(*odd_values))
    reasons = checked["reject_reason"].to_list()
    assert len(reasons) == len(odd_values)
    assert reasons[0] is None
    assert reasons[-1] is None
    assert all(reason is not None for reason in reasons[1:-1])
    assert set(reasons[1:-1]) <= {reason.value for reason in RejectReason}


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                name: st.one_of(
                    st.none(),
                    st.text(max_size=80),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.integers(),
                    st.just(CLEAN_RECORD[name]),
                )
                for name in RAW_COLUMNS
            }
        ),
        min_size=1,
        max_size=20,
    )
)
def test_validation_never_raises_and_gives_one_reason_per_row(records: list[dict[str, Any]]) -> None:
    checked = validate(frame_of(*records))
    assert checked.height == len(records)
    allowed = {reason.value for reason in RejectReason} | {None}
    assert set(checked["reject_reason"].to_list()) <= allowed
    valid = checked.filter(pl.col("reject_reason").is_null())
    assert valid["event_ts"].null_count() == 0
    assert valid["transaction_id"].is_unique().all()


# ------------------------------------------------------------------ the single-record model
def test_transaction_accepts_a_clean_record_and_normalises_time() -> None:
    parsed = Transaction(**record(event_time="2026-11-01T14:00:00+02:00"))
    assert parsed.event_time == datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    assert parsed.to_raw()["event_time"] == format_event_time(parsed.event_time) == "2026-11-01T12:00:00.000000Z"
    assert reasons_of(parsed.to_raw()) == [None]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"transaction_id": ""}, "transaction_id"),
        ({"transaction_id": "   "}, "transaction_id"),
        ({"transaction_id": None}, "transaction_id"),
        ({"account_id": None}, "account_id"),
        ({"transaction_id": "x" * (ID_MAX_LENGTH + 1)}, "transaction_id"),
        ({"account_id": "a" * (ID_MAX_LENGTH + 1)}, "account_id"),
        ({"currency": "US$"}, "currency"),
        ({"currency": "usd"}, "currency"),
        ({"currency": ""}, "currency"),
        ({"amount": math.nan}, "amount"),
        ({"amount": math.inf}, "amount"),
        ({"amount": "inf"}, "amount"),
        ({"amount": -0.01}, "amount"),
        ({"amount": 3.7e9}, "amount"),
        ({"merchant_category": ""}, "merchant_category"),
        ({"merchant_category": "   "}, "merchant_category"),
        ({"merchant_category": "<script>"}, "merchant_category"),
        ({"merchant_category": "x" * 65}, "merchant_category"),
        ({"country": "usa"}, "country"),
        ({"country": "us"}, "country"),
        ({"event_time": None}, "event_time"),
        ({"event_time": "   "}, "event_time"),
        ({"event_time": "yesterday"}, "event_time"),
        ({"event_time": "31/11/2026 25:61"}, "event_time"),
        ({"event_time": "2026-11-01T12:00:00"}, "event_time"),
        ({"event_time": datetime(2026, 11, 1, 12, 0)}, "event_time"),
    ],
)
def test_transaction_model_rejects_the_same_bad_values(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        Transaction(**record(**changes))
    assert [error["loc"] for error in raised.value.errors()] == [(field,)]


@pytest.mark.parametrize(
    "changes",
    [
        {"merchant_category": "ev_charging"},
        {"merchant_category": "Home & Garden"},
        {"country": "KR"},
        {"currency": "KRW"},
        {"merchant_category": "ev_charging", "country": "KR", "currency": "KRW"},
    ],
)
def test_well_formed_unseen_values_are_accepted_by_both_validators(changes: dict[str, Any]) -> None:
    parsed = Transaction(**record(**changes))
    assert {name: getattr(parsed, name) for name in changes} == changes
    assert reasons_of(parsed.to_raw()) == [None]
    assert reasons_of(record(**changes)) == [None]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    field=st.sampled_from(["merchant_category", "country", "currency"]),
    value=st.one_of(
        st.text(max_size=70),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 _-&/.\t$", max_size=70),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=4),
    ),
)
def test_the_record_model_and_the_frame_validator_agree_on_every_value(field: str, value: str) -> None:
    """One rule, two implementations (pydantic for a request, polars for a frame): a value one
    accepts the other accepts, so the paths refuse the same inputs."""
    try:
        Transaction(**record(**{field: value}))
    except ValidationError:
        accepted_online = False
    else:
        accepted_online = True
    # The model strips surrounding whitespace before checking; the frame is given the same stripped value.
    accepted_in_batch = reasons_of(record(**{field: value.strip()})) == [None]
    assert accepted_online == accepted_in_batch, (field, value)


def test_transaction_model_forbids_unknown_fields() -> None:
    with pytest.raises(ValidationError) as raised:
        Transaction(**record(label_fraud=1))
    assert raised.value.errors()[0]["loc"] == ("label_fraud",)
