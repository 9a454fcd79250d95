"""What the gate hands to the code it calls is emptied once the request is answered: BentoML's
timeout keeps a copy of the request's context alive with its timer for 10 s, and a context that
still held the parsed request kept every admitted request's payload alive that long."""

from __future__ import annotations

import asyncio
import contextvars
from pathlib import Path

import httpx
from sqlalchemy.engine import Engine
from starlette.types import Receive, Scope, Send

from serving.gate import CURRENT_CALL, ScoreGate, current_call
from serving.metrics import ServingMetrics
from serving.schemas import PARSED_REQUEST
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.serving.test_metrics import started_outcome_scorer, tx


def test_a_context_copied_during_the_call_holds_nothing_of_the_request_afterwards(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    seen: list[tuple[object, object]] = []
    copies: list[contextvars.Context] = []

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        handoff = PARSED_REQUEST.get()
        seen.append((current_call(), handoff.value if handoff is not None else None))
        copies.append(contextvars.copy_context())  # as loop.call_later does for BentoML's timer
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def scenario() -> int:
        settings = ServingSettings(p99_target_ms=60_000)
        scorer = await started_outcome_scorer(sqlite_engine, tmp_path, settings, ServingMetrics(settings=settings))
        try:
            gate = ScoreGate(endpoint, get_scorer=lambda: scorer, security=SecuritySettings())
            transport = httpx.ASGITransport(app=gate)
            async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
                response = await client.post("/score", json={"transactions": [tx("a"), tx("b")]})
            return response.status_code
        finally:
            await scorer.close()

    assert asyncio.run(scenario()) == 200
    ((call, parsed),) = seen
    assert call is not None and parsed is not None
    assert [t.transaction_id for t in parsed.transactions] == ["a", "b"]  # type: ignore[attr-defined]
    (copied,) = copies
    assert copied[CURRENT_CALL] is not None and copied[CURRENT_CALL].value is None  # type: ignore[union-attr]
    assert copied[PARSED_REQUEST] is not None and copied[PARSED_REQUEST].value is None  # type: ignore[union-attr]
