"""A deadline never outlives BentoML's timeout backstop: the service answers with its own 504
first. The backstop is kept short because each request's timer lives that long (settings.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from starlette.requests import Request

from serving.gate import _headers
from serving.settings import BACKSTOP_TIMEOUT_S, MAX_DEADLINE_MS, ServingSettings


def request_with(headers: dict[str, str]) -> Request:
    raw = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/score", "headers": raw})


def test_the_longest_deadline_ends_before_the_backstop() -> None:
    assert MAX_DEADLINE_MS < BACKSTOP_TIMEOUT_S * 1000


@pytest.mark.parametrize(
    ("header", "expected_ms"),
    [("600000", MAX_DEADLINE_MS), (str(MAX_DEADLINE_MS + 1), MAX_DEADLINE_MS), ("5000", 5000.0), ("0.5", 0.5)],
)
def test_a_header_deadline_past_the_cap_is_cut_to_it_and_one_within_is_kept(header: str, expected_ms: float) -> None:
    deadline_ms, key = _headers(request_with({"X-Deadline-Ms": header}), 2000.0)
    assert deadline_ms == expected_ms
    assert key is None


def test_without_a_header_the_default_deadline_applies() -> None:
    assert _headers(request_with({}), 2000.0) == (2000.0, None)


def test_a_default_deadline_past_the_cap_fails_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SERVING_REQUEST_TIMEOUT_MS", str(MAX_DEADLINE_MS + 1))
    with pytest.raises(ValidationError, match="request_timeout_ms"):
        ServingSettings()
