"""A deadline never outlives BentoML's timeout backstop: the service answers with its own 504
first (settings.py). A request's deadline is its X-Deadline-Ms header, else its body's
deadline_ms, else the default, cut to the longest (`ScoreCall.resolve`)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from starlette.datastructures import Headers

from serving.gate import ScoreCall, _check_one_key, _deadline_header, _key_header
from serving.refusals import Refused
from serving.schemas import api_models
from serving.settings import ServingSettings
from tests.inference.support import record
from tests.reference import REFERENCE


def headers_of(headers: dict[str, str]) -> Headers:
    return Headers(raw=[(name.lower().encode(), value.encode()) for name, value in headers.items()])


def call_with(header_deadline_ms: float | None = None, header_key: str | None = None) -> ScoreCall:
    return ScoreCall(
        request_id="r",
        arrived=100.0,
        header_deadline_ms=header_deadline_ms,
        header_key=header_key,
        default_deadline_ms=2000.0,
        max_deadline_ms=9000.0,
    )


def test_by_default_the_backstop_is_10_s_and_the_longest_deadline_9_s() -> None:
    settings = ServingSettings()
    assert (settings.backstop_timeout_s, settings.max_deadline_ms) == (10, 9000.0)


@pytest.mark.parametrize(("default_ms", "backstop_s"), [(9000.0, 10), (9001.0, 11), (20000.0, 21), (30000.0, 31)])
def test_a_longer_default_deadline_moves_the_backstop_past_it(default_ms: float, backstop_s: int) -> None:
    settings = ServingSettings(request_timeout_ms=default_ms)
    assert settings.backstop_timeout_s == backstop_s
    assert default_ms <= settings.max_deadline_ms < settings.backstop_timeout_s * 1000


@pytest.mark.parametrize(
    ("header", "expected_ms"), [("600000", 9000.0), ("9000.5", 9000.0), ("5000", 5000.0), ("0.5", 0.5)]
)
def test_a_header_deadline_past_the_cap_is_cut_to_it_and_one_within_is_kept(header: str, expected_ms: float) -> None:
    call = call_with(header_deadline_ms=_deadline_header(headers_of({"X-Deadline-Ms": header})))
    key, deadline, deadline_ms = call.resolve(None, None)
    assert deadline_ms == expected_ms
    assert deadline == pytest.approx(100.0 + expected_ms / 1000), "counted from when the gate saw the request"
    assert key is None


def test_a_body_deadline_past_the_cap_is_cut_as_a_headers_is() -> None:
    assert call_with().resolve(None, 600000.0)[2] == 9000.0
    assert call_with().resolve(None, 300.0)[2] == 300.0


def test_without_a_header_or_a_field_the_default_deadline_applies() -> None:
    assert _deadline_header(headers_of({})) is None
    assert _key_header(headers_of({})) is None
    assert call_with().resolve(None, None) == (None, 102.0, 2000.0)


def test_a_header_wins_over_its_body_field() -> None:
    call = call_with(header_deadline_ms=500.0, header_key="from-header")
    assert call.resolve("from-body", 8000.0) == ("from-header", 100.5, 500.0)
    assert call_with().resolve("from-body", 8000.0) == ("from-body", 108.0, 8000.0)


@pytest.mark.parametrize("header", ["0", "-5", "nan", "inf", "1e400", "soon", "", "1_000", "１２", "0x10"])
def test_a_deadline_header_that_is_not_a_positive_number_is_a_400(header: str) -> None:
    with pytest.raises(Refused) as refused:
        _deadline_header(headers_of({"X-Deadline-Ms": header}))
    assert (refused.value.status, refused.value.error) == (400, "bad_header")
    assert [_deadline_header(headers_of({"X-Deadline-Ms": ok})) for ok in ("250", "250.5", "2.5e2")] == [
        250,
        250.5,
        250,
    ]


@pytest.mark.parametrize("key", ["", "k" * 201])
def test_an_idempotency_key_header_out_of_bounds_is_a_400(key: str) -> None:
    with pytest.raises(Refused) as refused:
        _key_header(headers_of({"Idempotency-Key": key}))
    assert (refused.value.status, refused.value.error) == (400, "bad_header")
    assert _key_header(headers_of({"Idempotency-Key": "k" * 200})) == "k" * 200


def test_a_header_key_and_a_different_body_key_are_a_400() -> None:
    _check_one_key("same", "same", 1)
    _check_one_key("only-header", None, 1)
    _check_one_key(None, "only-body", 1)
    with pytest.raises(Refused) as refused:
        _check_one_key("one", "another", 3)
    assert (refused.value.status, refused.value.error) == (400, "bad_request")


def test_an_idempotency_key_header_is_read_as_utf_8_without_surrounding_whitespace() -> None:
    """Header bytes reach the app as latin-1: "clé" sent as UTF-8 was the key "clÃ©", another key
    than the body's "clé", so one key sent both ways was a 400 "differ"."""
    assert _key_header(headers_of({"Idempotency-Key": "clé-🔑"})) == "clé-🔑"
    assert _key_header(headers_of({"Idempotency-Key": "K9\u00a0"})) == "K9"
    with pytest.raises(Refused) as refused:
        _key_header(Headers(raw=[(b"idempotency-key", b"\xff\xfe")]))
    assert (refused.value.status, refused.value.error) == (400, "bad_header")


def test_the_body_key_is_read_as_the_header_is_and_its_deadline_must_be_finite() -> None:
    request = api_models(REFERENCE).request
    for key, expected in ((" K9\u00a0", "K9"), ("clé", "clé")):
        assert request.model_validate({"transactions": [record()], "idempotency_key": key}).idempotency_key == expected
    # The header's "inf" is a 400, its field's was accepted; true was 1 ms and "100" 100 ms.
    for deadline in ("Infinity", "NaN", "true", '"100"'):
        with pytest.raises(ValidationError):
            request.model_validate_json(f'{{"transactions": [{json.dumps(record())}], "deadline_ms": {deadline}}}')


@pytest.mark.parametrize("name", ["Idempotency-Key", "X-Deadline-Ms"])
def test_a_header_sent_twice_with_different_values_is_a_400(name: str) -> None:
    """The first value used to win silently, whatever the second said."""
    read = _key_header if name == "Idempotency-Key" else _deadline_header
    assert read(Headers(raw=[(name.lower().encode(), b"100"), (name.lower().encode(), b"100")])) in ("100", 100.0)
    with pytest.raises(Refused) as refused:
        read(Headers(raw=[(name.lower().encode(), b"100"), (name.lower().encode(), b"200")]))
    assert (refused.value.status, refused.value.error) == (400, "bad_header")
