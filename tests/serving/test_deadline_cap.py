"""A deadline never outlives BentoML's timeout backstop: the service answers with its own 504
first. The backstop is kept short because each request's timer lives that long (settings.py)."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from serving.gate import _headers
from serving.settings import ServingSettings


def headers_of(headers: dict[str, str]) -> Headers:
    return Headers(raw=[(name.lower().encode(), value.encode()) for name, value in headers.items()])


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
    deadline_ms, key = _headers(headers_of({"X-Deadline-Ms": header}), 2000.0, 9000.0)
    assert deadline_ms == expected_ms
    assert key is None


def test_without_a_header_the_default_deadline_applies() -> None:
    assert _headers(headers_of({}), 2000.0, 9000.0) == (2000.0, None)
