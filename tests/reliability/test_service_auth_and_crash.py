"""A second real server, started with TANDEM_SERVING_AUTH_TOKEN: the bearer token, then the
scoring process SIGKILLed under load, and replaced by the server itself."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from typing import Any

import httpx
import pytest

from tests.reliability.support import StartSuiteServer, SuiteServer
from tests.shared import until

pytestmark = [pytest.mark.reliability, pytest.mark.live, pytest.mark.postgres]

HISTORY_DAY = date(2026, 11, 1)
REQUEST_DAY = date(2026, 11, 2)
TOKEN = f"tok-{uuid.uuid4().hex}"
CLIENT_TIMEOUT_S = 10.0
RATE = 50  # requests per second, open loop, across the kill
MEASURED: dict[str, Any] = {}  # printed at the end (tests/reliability/conftest.py)


@pytest.fixture(scope="module")
def server(start_suite_server: StartSuiteServer) -> Iterator[SuiteServer]:
    env = {"TANDEM_SERVING_AUTH_TOKEN": TOKEN}
    with start_suite_server("serving-auth", (HISTORY_DAY, REQUEST_DAY), rows=600, accounts=60, env=env) as live:
        yield live


def _post(server: SuiteServer, rows: list[dict[str, Any]], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.url}/score", json={"transactions": rows}, headers=headers, timeout=10)


def test_score_needs_the_bearer_token(server: SuiteServer) -> None:
    row = server.take(1)[0]
    refused = {
        "no header": {},
        "wrong token": {"Authorization": "Bearer not-the-token"},
        "token prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
        "wrong scheme": {"Authorization": f"Basic {TOKEN}"},
        "bare scheme": {"Authorization": "Bearer"},
    }
    for name, headers in refused.items():
        response = _post(server, [row], headers)
        assert response.status_code == 401, (name, response.status_code, response.text)
        assert response.headers["WWW-Authenticate"].startswith("Bearer"), name
        body = response.json()
        assert body["error"] == "unauthorized" and body["detail"], (name, body)
        assert TOKEN not in response.text
    accepted = _post(server, [row], {"Authorization": f"Bearer {TOKEN}"})
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["results"][0]["status"] == "scored"
    # The scheme name is case-insensitive (RFC 7235).
    assert _post(server, server.take(1), {"Authorization": f"bearer {TOKEN}"}).status_code == 200
    # Refused before the body is read: an unauthenticated client cannot make the server parse anything.
    assert httpx.post(f"{server.url}/score", content=b"x" * (2 * 1024 * 1024), timeout=10).status_code == 401
    MEASURED["auth"] = {"refused_401": len(refused) + 1, "accepted_200": 2}


def test_lineage_needs_the_token_and_probes_do_not(server: SuiteServer) -> None:
    assert httpx.get(f"{server.url}/lineage/anything", timeout=10).status_code == 401
    with_token = httpx.get(f"{server.url}/lineage/no-such-id", headers=server.auth(), timeout=10)
    assert with_token.status_code == 404
    # Probes, metrics and the API description stay open: orchestrators and scrapers hold no token.
    for path in ("/readyz", "/livez", "/metrics", "/openapi.json"):
        assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200, path
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert document["paths"]["/score"]["post"]["security"] == [{"bearer": []}]
    assert "401" in document["paths"]["/lineage/{transaction_id}"]["get"]["responses"]


@dataclass(frozen=True)
class Outcome:
    sent: float
    seconds: float
    status: int | None
    body: dict[str, Any] | None
    error: str | None = None


def test_scoring_process_sigkilled_under_load_fails_fast_then_is_replaced(server: SuiteServer) -> None:
    (scoring,) = server.scoring_processes()
    rows = server.take(150)
    outcomes: list[Outcome] = []
    killed_at: list[float] = []
    liveness_during_outage: list[int] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, headers=server.auth()) as client:

            async def one(row: dict[str, Any]) -> None:
                sent = time.perf_counter()
                try:
                    response = await client.post(
                        f"{server.url}/score", json={"transactions": [row]}, headers={"X-Deadline-Ms": "5000"}
                    )
                except httpx.HTTPError as error:
                    outcomes.append(Outcome(sent, time.perf_counter() - sent, None, None, type(error).__name__))
                    return
                outcomes.append(Outcome(sent, time.perf_counter() - sent, response.status_code, response.json()))

            async def kill() -> None:
                await asyncio.sleep(1.0)
                os.kill(scoring.pid, signal.SIGKILL)
                killed_at.append(time.perf_counter())
                await asyncio.sleep(0.3)
                liveness_during_outage.append((await client.get(f"{server.url}/livez")).status_code)

            tasks = []
            start = time.perf_counter()
            killer = asyncio.create_task(kill())
            for index, row in enumerate(rows):
                await asyncio.sleep(max(0.0, start + index / RATE - time.perf_counter()))
                tasks.append(asyncio.create_task(one(row)))
            await asyncio.gather(killer, *tasks)

    asyncio.run(run())

    errors = [o.error for o in outcomes if o.error is not None]
    assert not errors, f"clients saw transport errors or hung until their timeout: {errors[:5]}"
    slowest = max(o.seconds for o in outcomes)
    assert slowest < CLIENT_TIMEOUT_S / 2, f"a request took {slowest:.2f} s: someone waited on a dead process"
    statuses = [o.status for o in outcomes]
    assert set(statuses) <= {200, 503}, sorted(map(str, set(statuses)))
    failed = [o.body for o in outcomes if o.status == 503]
    assert failed, "requests right after the kill must fail"
    # Before the kill a 503 can only be admission shedding; from the kill on, "unavailable".
    assert all(body and body["error"] in {"unavailable", "overloaded"} for body in failed), failed[:3]
    for o in outcomes:
        if o.status == 200:
            assert o.body and o.body["results"][0]["status"] == "scored", o.body  # never an item-level internal error
    just_after_kill = [o for o in outcomes if killed_at[0] + 0.05 < o.sent < killed_at[0] + 0.3]
    assert just_after_kill and {o.status for o in just_after_kill} == {503}, "a dead process answers nothing"
    assert {o.body["error"] for o in just_after_kill if o.body} == {"unavailable"}
    # Repair is in-process: liveness holds, so an orchestrator does not restart the pod for it.
    assert liveness_during_outage == [200]

    answers: list[httpx.Response] = []

    def served() -> bool:
        answers.append(server.score(server.take(1)))
        return answers[-1].status_code == 200

    until(served, timeout_s=60, interval_s=0.2, message=lambda: f"never served again: {answers[-1].text}")
    response = answers[-1]
    assert response.json()["results"][0]["status"] == "scored"
    (replacement,) = server.scoring_processes()
    assert replacement.pid != scoring.pid
    assert httpx.get(f"{server.url}/livez", timeout=5).status_code == 200
    assert httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200
    served_again = [o.sent for o in outcomes if o.status == 200 and o.sent > killed_at[0]]
    MEASURED["worker_kill"] = {
        "requests": len(outcomes),
        "status_counts": {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)},
        "slowest_s": round(slowest, 3),
        "livez_during_outage": liveness_during_outage[0],
        "first_200_after_kill_s": round(min(served_again) - killed_at[0], 2) if served_again else None,
    }


def test_a_stuck_scoring_process_is_stopped_and_replaced(server: SuiteServer) -> None:
    """A scoring process that is alive but never answers (SIGSTOP stands in for a wedged native
    call): requests get their 504s and /readyz its 503, then the server stops it and serves again
    from a new one."""
    (stuck,) = server.scoring_processes()
    os.kill(stuck.pid, signal.SIGSTOP)
    stopped_at = time.perf_counter()
    try:
        late = server.score(server.take(1), headers={"X-Deadline-Ms": "1000"})
        assert late.status_code == 504, late.text
        # Past the default deadline (2 s) the stuck batch takes the pod out of rotation.
        until(
            lambda: httpx.get(f"{server.url}/readyz", timeout=5).status_code == 503,
            timeout_s=6,
            interval_s=0.2,
            message="/readyz stayed 200 while the batch was stuck",
        )
        answers: list[httpx.Response] = []

        def served() -> bool:
            answers.append(server.score(server.take(1), headers={"X-Deadline-Ms": "2000"}))
            return answers[-1].status_code == 200

        until(served, timeout_s=90, interval_s=0.5, message=lambda: f"never served again: {answers[-1].text}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stuck.pid, signal.SIGCONT)
    assert {response.status_code for response in answers} <= {200, 503, 504}
    assert answers[-1].json()["results"][0]["status"] == "scored"
    (replacement,) = server.scoring_processes()
    assert replacement.pid != stuck.pid and not stuck.is_running(), "the stuck process was stopped"
    assert httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200
    MEASURED["stuck_worker"] = {"served_again_after_s": round(time.perf_counter() - stopped_at, 1)}
    assert "ran past" in server.log_text()


def test_the_token_and_the_database_password_never_reach_the_log(server: SuiteServer) -> None:
    log = server.log_text()
    assert "scoring process died" in log, "the crash was logged (so the check below means something)"
    assert TOKEN not in log
    assert server.db.password not in log
    assert server.listening_addresses() == {"127.0.0.1"}
