"""The call the gate admits rides in the ASGI scope's state for the code it calls, and is gone
from it once the request is answered: whatever keeps the scope alive past the answer (a timer, a
task, a log record) holds nothing of the request, and its place in the queue is given back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import Engine
from starlette.types import Receive, Scope, Send

from serving.gate import CALL_STATE, ScoreCall, ScoreGate, call_in
from serving.metrics import ServingMetrics
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.serving.test_metrics import started_outcome_scorer, tx


@pytest.mark.parametrize("fails", [False, True], ids=["answered", "app_raises"])
def test_the_admitted_call_does_not_outlive_its_request_in_the_scope_state(
    sqlite_engine: Engine, tmp_path: Path, fails: bool
) -> None:
    seen: list[ScoreCall] = []
    scopes: list[Scope] = []

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(call_in(scope))
        scopes.append(scope)  # kept past the answer, as a timer or a task may keep it
        if fails:
            raise RuntimeError("the app failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def scenario() -> tuple[int | None, dict[str, Any]]:
        settings = ServingSettings(p99_target_ms=60_000)
        scorer = await started_outcome_scorer(sqlite_engine, tmp_path, settings, ServingMetrics(settings=settings))
        try:
            gate = ScoreGate(endpoint, get_scorer=lambda: scorer, security=SecuritySettings())
            transport = httpx.ASGITransport(app=gate, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
                response = await client.post(
                    "/score", json={"transactions": [tx("a"), tx("b")]}, headers={"X-Deadline-Ms": "1500"}
                )
            assert scorer.batcher is not None
            return response.status_code, {"reserved": scorer.batcher._reserved}
        finally:
            await scorer.close()

    status, queue = asyncio.run(scenario())
    assert status == (500 if fails else 200)
    (call,) = seen
    assert call.header_deadline_ms == 1500.0 and call.reservation is not None
    (scope,) = scopes
    assert CALL_STATE not in scope["state"], "popped once the request is answered"
    with pytest.raises(RuntimeError):
        call_in(scope)
    assert queue == {"reserved": 0}, "its place in the queue given back"


def test_a_request_that_skipped_the_gate_is_not_taken_for_an_admitted_one() -> None:
    with pytest.raises(RuntimeError):
        call_in({"type": "http", "state": {}})
    with pytest.raises(RuntimeError):
        call_in({"type": "http"})
