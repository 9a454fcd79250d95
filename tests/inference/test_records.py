"""Validation: every poison kind gets exactly its reason, clean rows pass, one bad row never fails a frame."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from datetime import UTC, datetime
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from inference.records import (
    format_event_time,
    has_nul,
    hash_inputs,
    raw_frame,
    raw_schema,
    received_columns,
    split_valid,
    strip_text_fields,
    validate,
)
from inference.sources.common import conform
from inference.spec import Categorical, load_spec, validation_order
from inference.spec.api import record_model
from tandem_specs.transactions.demo import EXPECTED_REASON, DemoConfig, PoisonKind, generate_day, generate_days
from tests.inference.support import CLEAN_RECORD, DAY, frame_of, record
from tests.reference import ID_MAX_LENGTH, RAW_COLUMNS, REFERENCE, Transaction

REFERENCE_REASONS = set(validation_order(REFERENCE.spec))


def reasons_of(*records: dict[str, Any]) -> list[str | None]:
    return validate(REFERENCE, frame_of(*records))["reject_reason"].to_list()


@pytest.mark.parametrize("seed", [1, 7])
def test_every_poison_kind_gets_exactly_its_expected_reason(seed: int) -> None:
    frame = generate_days(DAY, 2, DemoConfig(seed=seed, rows_per_day=800, poison_rate=0.05))
    checked = validate(REFERENCE, frame)

    poisoned = checked.filter(pl.col("poison_kind").is_not_null())
    assert set(poisoned["poison_kind"].unique()) == {kind.value for kind in PoisonKind}
    for kind, reason in zip(poisoned["poison_kind"], poisoned["reject_reason"], strict=True):
        assert reason == EXPECTED_REASON[PoisonKind(kind)], kind

    clean = checked.filter(pl.col("poison_kind").is_null())
    assert clean["reject_reason"].null_count() == clean.height
    assert clean["event_ts"].null_count() == 0


def test_split_valid_partitions_the_frame() -> None:
    frame = generate_day(DAY, DemoConfig(seed=3, rows_per_day=400, poison_rate=0.1))
    valid, rejected = split_valid(REFERENCE, frame)
    assert valid.height + rejected.height == frame.height
    assert valid["poison_kind"].null_count() == valid.height
    assert rejected["poison_kind"].null_count() == 0
    assert valid["transaction_id"].is_unique().all()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        # PostgreSQL text cannot hold NUL: in any text field the record cannot be stored.
        ({"transaction_id": "tx\x001"}, "nul_character"),
        ({"account_id": "acct\x00"}, "nul_character"),
        ({"currency": "EU\x00"}, "nul_character"),
        ({"merchant_category": "groc\x00ery"}, "nul_character"),
        ({"country": "\x00DE"}, "nul_character"),
        ({"event_time": "2026-11-01T12:00:00Z\x00"}, "nul_character"),
        ({"transaction_id": None}, "missing_field"),
        ({"transaction_id": ""}, "missing_field"),
        ({"transaction_id": "   "}, "missing_field"),
        ({"account_id": None}, "missing_field"),
        ({"account_id": ""}, "missing_field"),
        ({"transaction_id": "x" * (ID_MAX_LENGTH + 1)}, "missing_field"),
        ({"account_id": "a" * (ID_MAX_LENGTH + 1)}, "missing_field"),
        ({"transaction_id": "x" * ID_MAX_LENGTH}, None),
        ({"currency": "usd"}, "bad_currency"),
        ({"currency": "US$"}, "bad_currency"),
        ({"currency": "EURO"}, "bad_currency"),
        ({"currency": ""}, "bad_currency"),
        # Stripped first, as the request model strips it: the same value on both paths.
        ({"currency": " USD\n"}, None),
        ({"currency": None}, "bad_currency"),
        # Well-formed but outside the training vocabulary: scored, not refused.
        ({"currency": "KRW"}, None),
        ({"currency": "XXX"}, None),
        ({"amount": math.nan}, "amount_not_finite"),
        ({"amount": math.inf}, "amount_not_finite"),
        ({"amount": -math.inf}, "amount_not_finite"),
        ({"amount": None}, "amount_not_finite"),
        ({"amount": "twelve"}, "amount_not_finite"),
        ({"amount": -0.01}, "amount_negative"),
        ({"amount": 0.0}, None),
        ({"amount": 1_000_000.0}, None),
        ({"amount": 1_000_000.01}, "amount_absurd"),
        ({"merchant_category": None}, "malformed_category"),
        ({"merchant_category": ""}, "malformed_category"),
        ({"merchant_category": "   "}, "malformed_category"),
        ({"merchant_category": "<script>"}, "malformed_category"),
        ({"merchant_category": "gift\tcards"}, "malformed_category"),
        ({"merchant_category": "café"}, "malformed_category"),
        ({"merchant_category": "x" * 65}, "malformed_category"),
        ({"merchant_category": "x" * 64}, None),
        ({"merchant_category": "teleportation"}, None),
        ({"merchant_category": "ev_charging"}, None),
        ({"merchant_category": "Home & Garden / D.I.Y-2"}, None),
        ({"country": None}, "malformed_country"),
        ({"country": "usa"}, "malformed_country"),
        ({"country": "us"}, "malformed_country"),
        ({"country": "USA"}, "malformed_country"),
        ({"country": "U5"}, "malformed_country"),
        ({"country": ""}, "malformed_country"),
        ({"country": "ZZ"}, None),
        ({"country": "KR"}, None),
        ({"event_time": None}, "timestamp_missing"),
        ({"event_time": ""}, "timestamp_missing"),
        ({"event_time": "   "}, "timestamp_missing"),
        ({"event_time": "\t\n"}, "timestamp_missing"),
        ({"event_time": "2026-11-01T12:00:00"}, "timestamp_unparsable"),
        ({"event_time": "2026-11-01 12:00:00"}, "timestamp_unparsable"),
        ({"event_time": "yesterday"}, "timestamp_unparsable"),
        ({"event_time": "2026-13-45T99:00:00Z"}, "timestamp_unparsable"),
        ({"event_time": "2026-11-01T12:00:00+02:00"}, None),
        ({"event_time": "2026-11-01T12:00:00.5Z"}, None),
    ],
)
def test_hand_written_edge_cases(changes: dict[str, Any], expected: str | None) -> None:
    assert reasons_of(record(**changes)) == [expected]


def test_offsets_are_normalised_to_utc() -> None:
    checked = validate(REFERENCE, frame_of(record(event_time="2026-11-01T12:00:00+02:00")))
    assert checked["event_ts"].to_list() == [datetime(2026, 11, 1, 10, 0, tzinfo=UTC)]


def test_first_rule_in_reason_order_wins() -> None:
    assert reasons_of(record(transaction_id=None, currency="usd", amount=math.nan, event_time=None)) == [
        "missing_field"
    ]
    assert reasons_of(record(amount=-5.0, merchant_category="", event_time="bad")) == ["amount_negative"]
    assert reasons_of(record(merchant_category="", country="usa")) == ["malformed_category"]


def test_duplicated_id_keeps_the_first_occurrence() -> None:
    reasons = reasons_of(
        record(transaction_id="a", amount=1.0),
        record(transaction_id="b"),
        record(transaction_id="a", amount=2.0),
        record(transaction_id="a", amount=3.0),
    )
    assert reasons == [None, None, "duplicate_id", "duplicate_id"]
    valid, _ = split_valid(
        REFERENCE, frame_of(record(transaction_id="a", amount=1.0), record(transaction_id="a", amount=2.0))
    )
    assert valid["amount"].to_list() == [1.0]


def test_repeated_missing_ids_are_missing_not_duplicates() -> None:
    reasons = reasons_of(record(transaction_id=None), record(transaction_id=None))
    assert reasons == ["missing_field"] * 2


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
    checked = validate(REFERENCE, frame_of(*odd_values))
    reasons = checked["reject_reason"].to_list()
    assert len(reasons) == len(odd_values)
    assert reasons[0] is None
    assert reasons[-1] is None
    assert all(reason is not None for reason in reasons[1:-1])
    assert set(reasons[1:-1]) <= REFERENCE_REASONS


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
    checked = validate(REFERENCE, frame_of(*records))
    assert checked.height == len(records)
    allowed = {*REFERENCE_REASONS, None}
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
    return online, validate(REFERENCE, frame_of(record(**changes)))


def _assert_one_meaning(changes: dict[str, Any]) -> None:
    """Valid on both paths or on neither, and where valid, the same stored values and instant."""
    online, frame = _both_paths(changes)
    assert (online is not None) == (frame["reject_reason"][0] is None), changes
    if online is not None:
        as_request = validate(REFERENCE, frame_of(online))
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
    assert frame["reject_reason"].to_list() == ["timestamp_unparsable"]


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_amount_is_refused_on_both_paths(value: bool) -> None:
    """pydantic alone reads true as 1.0: a request would have been scored as a purchase of 1."""
    online, frame = _both_paths({"amount": value})
    assert online is None
    assert frame["reject_reason"].to_list() == ["amount_not_finite"]


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
    as_csv = validate(REFERENCE, conform(REFERENCE, cells, "day.csv", typed=False))
    as_sql = validate(
        REFERENCE,
        raw_frame(REFERENCE, [record(amount=text)]).with_columns(received_columns(REFERENCE, [record(amount=text)])),
    )
    assert as_sql["reject_reason"].to_list() == as_csv["reject_reason"].to_list(), text
    assert as_sql["amount"].fill_nan(-1.0).to_list() == as_csv["amount"].fill_nan(-1.0).to_list(), text
    no_number = text in ("1_000", "9_99", "\u0661\u0662", "\uff11\uff12", "12,50")
    assert (as_csv["reject_reason"].to_list() == ["amount_unparsable"]) is no_number, text


def test_the_canonical_event_time_writes_four_digit_years() -> None:
    assert format_event_time(datetime(1, 1, 1, tzinfo=UTC)) == "0001-01-01T00:00:00.000000Z"
    assert reasons_of(record(event_time=format_event_time(datetime(1, 1, 1, tzinfo=UTC)))) == [None]


def test_transaction_model_forbids_unknown_fields() -> None:
    with pytest.raises(ValidationError) as raised:
        Transaction(**record(label_fraud=1))
    assert raised.value.errors()[0]["loc"] == ("label_fraud",)


def test_the_reference_keeps_every_stored_code_in_its_order() -> None:
    assert validation_order(REFERENCE.spec) == (
        "nul_character",
        "missing_field",
        "duplicate_id",
        "bad_currency",
        "amount_unparsable",
        "amount_not_finite",
        "amount_negative",
        "amount_absurd",
        "malformed_category",
        "malformed_country",
        "timestamp_missing",
        "timestamp_unparsable",
    )


# ------------------------------------------------------------------ a spec of another shape
TINY = load_spec("tests.specs.tiny:SPEC")
Reading = record_model(TINY)
TINY_WITHOUT_RULES = dataclasses.replace(TINY, spec=dataclasses.replace(TINY.spec, rules=()))
CLEAN_READING: dict[str, Any] = {
    "reading_id": "r-1",
    "sensor_id": "s-1",
    "level": 12.5,
    "colour": "green",
    "taken_at": "2026-11-01T08:00:00Z",
}


def reading(**changes: Any) -> dict[str, Any]:
    return {**CLEAN_READING, **changes}


def tiny_reasons(*readings: dict[str, Any]) -> list[str | None]:
    frame = raw_frame(TINY, list(readings)).with_columns(received_columns(TINY, list(readings)))
    return validate(TINY, frame)["reject_reason"].to_list()


def test_the_tiny_spec_has_its_own_raw_schema_and_default_order() -> None:
    assert raw_schema(TINY) == {
        "reading_id": pl.String(),
        "sensor_id": pl.String(),
        "level": pl.Float64(),
        "colour": pl.String(),
        "taken_at": pl.String(),
    }
    # The generic checks, the fields' codes in field order, the spec's rules, the timestamps.
    assert validation_order(TINY.spec) == (
        "nul_character",
        "missing_field",
        "duplicate_id",
        "level_unparsable",
        "level_not_finite",
        "level_below_minimum",
        "level_above_maximum",
        "malformed_colour",
        "level_on_red",
        "timestamp_missing",
        "timestamp_unparsable",
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        ({"colour": "red", "level": 90.0}, None),
        ({"sensor_id": "s\x00"}, "nul_character"),
        ({"taken_at": "2026-11-01T08:00:00Z\x00"}, "nul_character"),
        ({"reading_id": None}, "missing_field"),
        ({"reading_id": "  "}, "missing_field"),
        ({"sensor_id": ""}, "missing_field"),
        ({"sensor_id": "s" * 65}, "missing_field"),
        ({"level": "12;5"}, "level_unparsable"),
        ({"level": math.nan}, "level_not_finite"),
        ({"level": None}, "level_not_finite"),
        # A request's JSON boolean, list or object is no number: its text is kept as received.
        ({"level": True}, "level_unparsable"),
        ({"level": [1]}, "level_unparsable"),
        ({"level": {"v": 1}}, "level_unparsable"),
        ({"level": -0.5}, "level_below_minimum"),
        ({"level": 100.5}, "level_above_maximum"),
        ({"colour": "Red"}, "malformed_colour"),
        ({"colour": "x" * 17}, "malformed_colour"),
        ({"colour": None}, "malformed_colour"),
        # Well-formed outside the vocabulary: scored through the unknown bucket, not refused.
        ({"colour": "purple"}, None),
        ({"colour": " blue\t"}, None),
        # The spec's own rule, after the field's codes and before the timestamps.
        ({"colour": "red", "level": 95.0}, "level_on_red"),
        ({"colour": "red", "level": 95.0, "taken_at": None}, "level_on_red"),
        ({"colour": "red", "level": 101.0}, "level_above_maximum"),
        ({"taken_at": None}, "timestamp_missing"),
        ({"taken_at": " "}, "timestamp_missing"),
        ({"taken_at": "2026-11-01 08:00:00Z"}, "timestamp_unparsable"),
        ({"taken_at": "2026-11-01T08:00:00+01:00"}, None),
    ],
)
def test_each_tiny_code_from_its_declaration(changes: dict[str, Any], expected: str | None) -> None:
    assert tiny_reasons(reading(**changes)) == [expected]


def test_a_repeated_tiny_id_is_a_duplicate() -> None:
    assert tiny_reasons(reading(), reading(level=1.0)) == [None, "duplicate_id"]


def test_tiny_input_hashes_follow_its_fields_in_order() -> None:
    frame = raw_frame(TINY, [reading(), reading(reading_id="r-2", taken_at="2026-11-01T08:00:00+00:00", level=None)])
    canonical = [
        "r-1\x1fs-1\x1f12.5\x1fgreen\x1f2026-11-01T08:00:00.000000Z",
        "r-2\x1fs-1\x1f\\N\x1fgreen\x1f2026-11-01T08:00:00.000000Z",
    ]
    expected = [hashlib.sha256(text.encode()).hexdigest()[:32] for text in canonical]
    assert hash_inputs(TINY, frame).to_list() == expected


def test_tiny_raw_frame_strips_and_keeps_what_it_received() -> None:
    readings = [reading(reading_id=" r-1 ", colour="red\n", level="12;5"), reading(reading_id="r-2", level="7")]
    frame = raw_frame(TINY, readings)
    assert frame["reading_id"].to_list() == ["r-1", "r-2"]
    assert frame["colour"].to_list() == ["red", "green"]
    assert math.isnan(frame["level"][0])
    assert frame["level"][1] == 7.0
    received = {column.name: column.to_list() for column in received_columns(TINY, readings)}
    assert received == {
        "received_reading_id": [" r-1 ", None],
        "received_colour": ["red\n", None],
        "received_level": ["12;5", None],
    }
    stripped = strip_text_fields(TINY, pl.DataFrame({name: [value] for name, value in readings[0].items()}))
    assert stripped.row(0, named=True) | {"level": None} == {**frame.row(0, named=True), "level": None}


def test_the_tiny_record_model_is_generated_from_the_spec() -> None:
    schema = Reading.model_json_schema()
    assert schema["title"] == "Reading"
    assert list(schema["properties"]) == ["reading_id", "sensor_id", "level", "colour", "taken_at"]
    assert schema["properties"]["level"] | {} == {"maximum": 100.0, "minimum": 0.0, "title": "Level", "type": "number"}
    assert schema["additionalProperties"] is False
    parsed = Reading(**reading(taken_at="2026-11-01T09:00:00+01:00", colour=" red "))
    assert parsed.to_raw() == reading(taken_at="2026-11-01T08:00:00.000000Z", colour="red")
    with pytest.raises(ValidationError) as raised:
        Reading(**reading(level="12.5", extra=1))
    assert sorted(error["loc"] for error in raised.value.errors()) == [("extra",), ("level",)]


# Mostly well-formed values (two of each field's four branches), so both answers occur often.
_ID = st.one_of(
    st.sampled_from(["r-1", "s-1", " r-2\t", "x" * 64]),
    st.sampled_from(["r-3", "s-2\u3000"]),
    st.sampled_from([None, "", "  ", "x" * 65, "\u200b", "r\x00"]),
    st.text(max_size=20),
)
_LEVEL = st.one_of(
    st.sampled_from([0.0, -0.0, 12.5, 90.0, 95.0, 100.0, 42]),
    st.sampled_from([1.0, 99.9, 50]),
    st.sampled_from([None, True, False, -0.5, 100.5, 10**400]),
    st.one_of(st.floats(), st.integers(min_value=-(10**6), max_value=10**6)),
)
_COLOUR = st.one_of(
    st.sampled_from(["red", "green", "blue", "purple", " red "]),
    st.sampled_from(["green", "x" * 16]),
    st.sampled_from([None, "", "Red", "x" * 17, "r\x00d", "gr een"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyzRED -_\t", max_size=20),
)
_TIME = st.one_of(
    st.sampled_from(["2026-11-01T08:00:00Z", "2026-11-01T08:00:00+02:00", "2026-11-01T08:00:00.25-0530"]),
    st.sampled_from(["0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z"]),
    st.sampled_from([None, " ", "2026-11-01", " 2026-11-01T08:00:00Z", "0001-01-01T00:00:00+01:00", "1764590400"]),
    st.text(max_size=30),
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    st.fixed_dictionaries({"reading_id": _ID, "sensor_id": _ID, "level": _LEVEL, "colour": _COLOUR, "taken_at": _TIME})
)
def test_the_tiny_record_model_and_validate_accept_the_same_records(candidate: dict[str, Any]) -> None:
    """A request's record is valid to pydantic exactly when `validate` finds no reason in the
    rules its fields declare; the spec's own rules are `validate`'s alone (both paths run it).
    A numeric is a JSON number or null here: text is no request's number (the model refuses it,
    test_transaction_model_rejects_the_same_bad_values), while a frame reads a source's text."""
    try:
        online: dict[str, Any] | None = Reading(**candidate).to_raw()
    except ValidationError:
        online = None
    if has_nul(candidate):  # a request with NUL anywhere is refused before the model (serving.gate)
        online = None
    reason = tiny_reasons(candidate)[0]
    without_rules = raw_frame(TINY_WITHOUT_RULES, [candidate]).with_columns(received_columns(TINY, [candidate]))
    declared_reason = validate(TINY_WITHOUT_RULES, without_rules)["reject_reason"][0]
    assert (online is not None) == (declared_reason is None), (candidate, declared_reason)
    if online is not None:
        assert tiny_reasons(online) == [reason]
        assert reason is None or reason in {rule.code for rule in TINY.spec.rules}


def test_a_pattern_that_does_not_bound_a_categorical_gets_its_bounds_checked_on_both_paths() -> None:
    """The record model's min/max length and strip hold in `validate` for any pattern, not only
    for one character class repeated within the bounds (which `validate` checks by the pattern)."""
    colour = Categorical("colour", vocabulary=("red", "dark red"), pattern=r"^[a-z ]+$", min_length=3, max_length=8)
    fields = tuple(colour if field.name == "colour" else field for field in TINY.spec.fields)
    loose = dataclasses.replace(TINY, spec=dataclasses.replace(TINY.spec, fields=fields, rules=()))
    model = record_model(loose)
    for value, valid in [("red", True), (" dark red ", True), ("   ", False), ("re", False), ("deep red x", False)]:
        frame = pl.DataFrame({name: [text] for name, text in reading(colour=value).items()})
        assert (validate(loose, frame)["reject_reason"][0] is None) is valid, value
        try:
            model(**reading(colour=value))
        except ValidationError:
            assert not valid, value
        else:
            assert valid, value
