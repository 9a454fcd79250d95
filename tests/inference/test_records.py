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
    raw_frame,
    received_columns,
    split_valid,
    validate,
)
from inference.sources.common import conform
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
        # PostgreSQL text cannot hold NUL: in any text field the record cannot be stored.
        ({"transaction_id": "tx\x001"}, RejectReason.NUL_CHARACTER),
        ({"account_id": "acct\x00"}, RejectReason.NUL_CHARACTER),
        ({"currency": "EU\x00"}, RejectReason.NUL_CHARACTER),
        ({"merchant_category": "groc\x00ery"}, RejectReason.NUL_CHARACTER),
        ({"country": "\x00DE"}, RejectReason.NUL_CHARACTER),
        ({"event_time": "2026-11-01T12:00:00Z\x00"}, RejectReason.NUL_CHARACTER),
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
        # Stripped first, as the request model strips it: the same value on both paths.
        ({"currency": " USD\n"}, None),
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
        ({"amount": "12.5"}, "amount"),
        ({"amount": "1_000"}, "amount"),
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


def _both_paths(changes: dict[str, Any]) -> tuple[dict[str, Any] | None, pl.DataFrame]:
    """The record as a request reads it (its raw form, None if refused) and as a frame does."""
    try:
        online = Transaction(**record(**changes)).to_raw()
    except ValidationError:
        online = None
    return online, validate(frame_of(record(**changes)))


def _assert_one_meaning(changes: dict[str, Any]) -> None:
    """Valid on both paths or on neither, and where valid, the same stored values and instant."""
    online, frame = _both_paths(changes)
    assert (online is not None) == (frame["reject_reason"][0] is None), changes
    if online is not None:
        as_request = validate(frame_of(online))
        columns = [*RAW_COLUMNS[:-1], "event_ts"]  # event_time's text is canonical on one side only
        assert as_request.select(columns).row(0) == frame.select(columns).row(0), changes


# U+001C is whitespace to Python's `str.strip` alone; U+200B (zero width) is whitespace to none.
_PADDING = st.sampled_from(["", " ", "\t", "\n", " \r\n", "\u00a0", "\u3000", "\x1c", "\u200b"])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    field=st.sampled_from(["transaction_id", "account_id", "merchant_category", "country", "currency"]),
    value=st.one_of(
        st.text(max_size=70),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 _-&/.\t$", max_size=70),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=4),
    ),
    before=_PADDING,
    after=_PADDING,
)
def test_the_record_model_and_the_frame_validator_agree_on_every_value(
    field: str, value: str, before: str, after: str
) -> None:
    """One rule, two implementations (pydantic for a request, polars for a frame): a value one
    accepts the other accepts, whitespace around it included, and both keep it stripped, so an
    id padded in a file is the same transaction and account as in a request."""
    _assert_one_meaning({field: before + value + after})


_DIGITS = st.text(alphabet="0123456789", min_size=1, max_size=4)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    parts=st.tuples(
        st.sampled_from(["2026", "0001", "9999", "0000", "1970", "+2026", "202", "٢٠٢٦"]),
        st.sampled_from(["-11-01", "-02-29", "-13-01", "-1-01", "-12-31"]),
        st.sampled_from(["T", "t", " ", ""]),
        st.sampled_from(["12:00:00", "00:00:00", "23:59:59", "23:59:60", "24:00:00", "1:00:00", "12:00", "120000"]),
        st.one_of(st.just(""), st.just("."), st.just(",5"), _DIGITS.map(lambda digits: "." + digits)),
        st.sampled_from(["Z", "z", "+02:00", "-0530", "+01", "+14:00", "-01:00", "+24:00", "", " +01:00", "UTC"]),
        _PADDING,
    )
)
def test_both_validators_read_the_same_event_times(parts: tuple[str, ...]) -> None:
    """RFC 3339 text, near misses included: one answer on both paths, and the same instant.
    Each parser alone took forms the other refused (an hour of one digit in polars, a space for
    the `T` in pydantic), and "0001-01-01T00:00:00+01:00", before the year 1 in UTC, crashed
    the request model's validation."""
    *text, padding = parts
    _assert_one_meaning({"event_time": "".join(text) + padding})


@pytest.mark.parametrize("value", [1764590400, 1764590400.5, True, "1764590400"])
def test_an_event_time_that_is_not_rfc_3339_text_is_refused_on_both_paths(value: object) -> None:
    """An epoch number: pydantic alone would read it as one (in seconds or ms, by its size)."""
    online, frame = _both_paths({"event_time": value})
    assert online is None
    assert frame["reject_reason"].to_list() == [RejectReason.TIMESTAMP_UNPARSABLE.value]


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_amount_is_refused_on_both_paths(value: bool) -> None:
    """pydantic alone reads true as 1.0: a request would have been scored as a purchase of 1."""
    online, frame = _both_paths({"amount": value})
    assert online is None
    assert frame["reject_reason"].to_list() == [RejectReason.AMOUNT_NOT_FINITE.value]


@pytest.mark.parametrize(
    "text",
    [
        "12.5",
        " 12.5\u00a0",
        "+.5e3",
        "1E2",
        "00012",
        "1_000",
        "9_99",
        "\u0661\u0662",
        "\uff11\uff12",
        "12,50",
        "",
        "inf",
        "NaN",
    ],
)
def test_an_amount_given_as_text_reads_as_a_csv_cell_does(text: str) -> None:
    """A SQL source's text amount (`raw_frame`) is read as a CSV cell is (the polars cast): before,
    Python's float() read "1_000" as 1000 and Arabic-Indic or fullwidth digits as 12, amounts the
    same file quarantined.
    A request's amount is a JSON number (test_transaction_model_rejects_the_same_bad_values).
    Text that is no number is `amount_unparsable` from either source, not `amount_not_finite`."""
    cells = pl.DataFrame({name: [str(value)] for name, value in record(amount=text).items()})
    as_csv = validate(conform(cells, "day.csv", typed=False))
    as_sql = validate(raw_frame([record(amount=text)]).with_columns(received_columns([record(amount=text)])))
    assert as_sql["reject_reason"].to_list() == as_csv["reject_reason"].to_list(), text
    assert as_sql["amount"].fill_nan(-1.0).to_list() == as_csv["amount"].fill_nan(-1.0).to_list(), text
    no_number = text in ("1_000", "9_99", "\u0661\u0662", "\uff11\uff12", "12,50")
    assert (as_csv["reject_reason"].to_list() == [RejectReason.AMOUNT_UNPARSABLE.value]) is no_number, text


def test_the_canonical_event_time_writes_four_digit_years() -> None:
    assert format_event_time(datetime(1, 1, 1, tzinfo=UTC)) == "0001-01-01T00:00:00.000000Z"
    assert reasons_of(record(event_time=format_event_time(datetime(1, 1, 1, tzinfo=UTC)))) == [None]


def test_transaction_model_forbids_unknown_fields() -> None:
    with pytest.raises(ValidationError) as raised:
        Transaction(**record(label_fraud=1))
    assert raised.value.errors()[0]["loc"] == ("label_fraud",)
