"""The gate's screen for the HTTP protocol (`ScoreGate.refusal_on_headers`) answers exactly the
overload refusal the gate itself would give, and nothing else: what it lets through holds no
concurrency slot, and a request refused for its token or a header is left to the gate."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
from sqlalchemy.engine import Engine
from starlette.types import Receive, Scope, Send

from serving.gate import ScoreGate
from serving.metrics import ServingMetrics
from serving.runtime import OnlineScorer
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.serving.test_metrics import sample, started_outcome_scorer, tx


async def never_called(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("an overloaded request reached the API")


def stamped(seconds_ago: float, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """A proxy's X-Request-Start `seconds_ago`: within the 2 s default deadline, past the 50 ms target."""
    return [(b"x-request-start", f"t={time.time() - seconds_ago:.6f}".encode()), *extra]


def proxy_has_reported(scorer: OnlineScorer, seconds: float, *, since_s: float) -> None:
    """The proxy's stamps have shown a wait of `seconds` since `since_s` ago (and none before)."""
    moment = time.monotonic() - since_s
    while moment < time.monotonic():
        scorer.proxy_wait.observe(seconds, moment)
        moment += 0.01


def test_the_screen_gives_the_gates_own_overload_refusal(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[tuple[int, dict[str, str], dict[str, object]], httpx.Response, ServingMetrics]:
        settings = ServingSettings(p99_target_ms=50, trust_request_start=True)
        metrics = ServingMetrics(settings=settings)
        scorer = await started_outcome_scorer(sqlite_engine, tmp_path, settings, metrics)
        try:
            gate = ScoreGate(never_called, get_scorer=lambda: scorer, security=SecuritySettings())
            # A wait that stands: every stamp for longer than the burst interval has shown it.
            proxy_has_reported(scorer, 0.5, since_s=settings.burst_interval_ms / 1000 + 0.05)
            screened = gate.refusal_on_headers(stamped(0.5))
            assert screened is not None
            status, raw, body = screened
            headers = {name.decode(): value.decode() for name, value in raw}
            transport = httpx.ASGITransport(app=gate)
            async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
                own = await client.post(
                    "/score",
                    json={"transactions": [tx("a")]},
                    headers={"X-Request-Start": f"t={time.time() - 0.5:.3f}"},
                )
            return (status, headers, json.loads(body)), own, metrics
        finally:
            await scorer.close()

    (status, headers, body), own, metrics = asyncio.run(scenario())
    assert status == own.status_code == 503
    assert body["error"] == own.json()["error"] == "overloaded"
    assert body["detail"]["reason"] == own.json()["detail"]["reason"] == "over_target"  # type: ignore[index]
    assert headers["retry-after"] == own.headers["retry-after"]
    assert headers["content-type"] == own.headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(json.dumps(body, separators=(",", ":")))
    assert len(headers["x-request-id"]) == 32 and headers["x-request-id"] != own.headers["x-request-id"]
    assert sample(metrics, "tandem_serving_items_total", outcome="shed") == 2
    assert sample(metrics, "tandem_serving_shed_total", reason="over_target") == 2
    assert sample(metrics, "tandem_serving_shed_on_headers_total") == 1
    assert sample(metrics, "tandem_serving_request_latency_seconds_count", status="503") == 2


def check_left_to_the_gate(
    sqlite_engine: Engine, tmp_path: Path, headers: list[tuple[bytes, bytes]], security: SecuritySettings
) -> OnlineScorer:
    async def scenario() -> OnlineScorer:
        settings = ServingSettings(p99_target_ms=50)
        scorer = await started_outcome_scorer(sqlite_engine, tmp_path, settings, ServingMetrics(settings=settings))
        try:
            gate = ScoreGate(never_called, get_scorer=lambda: scorer, security=security)
            assert gate.refusal_on_headers(headers) is None
        finally:
            await scorer.close()
        return scorer

    return asyncio.run(scenario())


def test_a_request_it_would_admit_is_let_through_holding_no_slot(sqlite_engine: Engine, tmp_path: Path) -> None:
    scorer = check_left_to_the_gate(sqlite_engine, tmp_path, [], SecuritySettings())
    assert scorer.concurrency.in_flight == 0


def test_a_request_without_the_token_is_left_to_the_gate_for_its_401(sqlite_engine: Engine, tmp_path: Path) -> None:
    check_left_to_the_gate(sqlite_engine, tmp_path, stamped(0.5), SecuritySettings(auth_token="secret-token-1234"))


def test_a_malformed_header_is_left_to_the_gate_for_its_400(sqlite_engine: Engine, tmp_path: Path) -> None:
    check_left_to_the_gate(sqlite_engine, tmp_path, stamped(0.5, (b"x-deadline-ms", b"soon")), SecuritySettings())


def test_behind_a_proxy_that_stamps_every_request_a_burst_is_let_in_and_a_standing_wait_refused(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    """A proxy that stamps every request (nginx, a load balancer): a burst's momentary wait past
    the target is not overload, as the event loop's momentary lag is not; a wait that every stamp
    of a whole burst interval shows is, and is refused from the headers."""

    async def scenario() -> tuple[list[bool], list[bool], OnlineScorer]:
        settings = ServingSettings(p99_target_ms=50, trust_request_start=True)
        scorer = await started_outcome_scorer(sqlite_engine, tmp_path, settings, ServingMetrics(settings=settings))
        interval_s = settings.burst_interval_ms / 1000
        try:
            gate = ScoreGate(never_called, get_scorer=lambda: scorer, security=SecuritySettings())
            proxy_has_reported(scorer, 0.0005, since_s=interval_s + 0.05)  # calm: sent on at once
            burst = [gate.refusal_on_headers(stamped(0.08)) is None for _ in range(64)]
            await asyncio.sleep(interval_s + 0.05)
            proxy_has_reported(scorer, 0.08, since_s=interval_s + 0.01)  # the wait stands
            standing = [gate.refusal_on_headers(stamped(0.08)) is None for _ in range(3)]
        finally:
            await scorer.close()
        return burst, standing, scorer

    burst, standing, scorer = asyncio.run(scenario())
    assert all(burst), f"{burst.count(False)} of a 64-request burst refused"
    assert not any(standing)
    assert scorer.concurrency.in_flight == 0
