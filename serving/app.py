"""The HTTP face of the scorer: a plain Starlette app, mounted into the BentoML service.

Starlette rather than `@bentoml.api`: the per-request framework cost, not the model, sets this
service's ceiling on two cores (see the measurements in serving/README.md).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.runtime import DeadlineExceeded, OnlineScorer, Shed
from serving.schemas import (
    DEADLINE_HEADER,
    IDEMPOTENCY_HEADER,
    REQUEST_ID_HEADER,
    ScoreRequest,
    ScoreResponse,
    openapi_document,
)

MAX_IDEMPOTENCY_KEY = 200


def _error(status: int, error: str, request_id: str, detail: Any = None, **headers: str) -> JSONResponse:
    return JSONResponse(
        {"error": error, "detail": detail},
        status_code=status,
        headers={REQUEST_ID_HEADER: request_id, **headers},
    )


def build_app(get_scorer: Callable[[], OnlineScorer]) -> Starlette:
    """`get_scorer` is called per request: the scorer exists only once the service has started."""

    async def score(request: Request) -> Response:
        started = time.perf_counter()
        scorer = get_scorer()
        request_id = uuid.uuid4().hex
        call = await _parse(request, scorer, request_id)
        if isinstance(call, Response):
            response = call
        else:
            response, cpu = await _run(call, scorer, request_id)
            # Only synchronous stretches are timed: thread time across an await is everyone's.
            scorer.metrics.cpu_per_request.observe(call.parse_cpu + cpu)
        scorer.metrics.latency.labels(status=str(response.status_code)).observe(time.perf_counter() - started)
        return response

    async def openapi(_: Request) -> Response:
        return JSONResponse(openapi_document())

    async def metrics(_: Request) -> Response:
        return Response(get_scorer().metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(
        routes=[
            Route("/score", score, methods=["POST"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


@dataclass(frozen=True)
class _Call:
    request: ScoreRequest
    idempotency_key: str | None
    deadline: float
    deadline_ms: float
    parse_cpu: float


async def _parse(request: Request, scorer: OnlineScorer, request_id: str) -> _Call | Response:
    arrived = time.monotonic()
    deadline_ms = scorer.settings.request_timeout_ms
    if (raw_deadline := request.headers.get(DEADLINE_HEADER)) is not None:
        try:
            deadline_ms = float(raw_deadline)
        except ValueError:
            deadline_ms = math.nan
        if not math.isfinite(deadline_ms) or deadline_ms <= 0:
            return _error(400, "bad_header", request_id, f"{DEADLINE_HEADER} must be a positive number of ms")
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is not None and not 0 < len(key) <= MAX_IDEMPOTENCY_KEY:
        return _error(400, "bad_header", request_id, f"{IDEMPOTENCY_HEADER} must be 1-{MAX_IDEMPOTENCY_KEY} chars")
    body = await request.body()
    cpu_started = time.thread_time()
    try:
        parsed = ScoreRequest.model_validate_json(body)
    except ValidationError as error:
        return _invalid(scorer, body, error, request_id)
    problems = _request_problems(parsed, scorer.settings.max_transactions_per_request)
    if problems:
        return _error(422, "invalid_request", request_id, problems)
    return _Call(parsed, key, arrived + deadline_ms / 1000, deadline_ms, time.thread_time() - cpu_started)


async def _run(call: _Call, scorer: OnlineScorer, request_id: str) -> tuple[Response, float]:
    try:
        results, batch_cpu = await scorer.score(
            call.request.transactions,
            request_id=request_id,
            idempotency_key=call.idempotency_key,
            deadline=call.deadline,
        )
    except Shed as shed:
        decision = shed.decision
        detail = {
            "reason": decision.reason,
            "predicted_wait_ms": round(decision.predicted_wait_s * 1000, 1),
            "limit_ms": round(decision.limit_s * 1000, 1),
        }
        return _error(503, "overloaded", request_id, detail, **{"Retry-After": str(decision.retry_after_s)}), 0.0
    except DeadlineExceeded:
        return _error(504, "deadline_exceeded", request_id, f"no answer within {call.deadline_ms:g} ms"), 0.0
    cpu_started = time.thread_time()
    payload = ScoreResponse(request_id=request_id, results=results).model_dump_json()
    response = Response(payload, media_type="application/json", headers={REQUEST_ID_HEADER: request_id})
    return response, batch_cpu + time.thread_time() - cpu_started


def _request_problems(parsed: ScoreRequest, limit: int) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    if len(parsed.transactions) > limit:
        problems.append({"loc": ["transactions"], "msg": f"at most {limit} transactions per request"})
    seen: set[str] = set()
    for index, tx in enumerate(parsed.transactions):
        if tx.transaction_id in seen:
            problems.append(
                {"loc": ["transactions", index, "transaction_id"], "msg": "duplicate transaction_id in request"}
            )
        seen.add(tx.transaction_id)
    return problems


def _invalid(scorer: OnlineScorer, body: bytes, error: ValidationError, request_id: str) -> Response:
    """422 naming each field and reason; the invalid items are quarantined, never batched."""
    errors = [
        {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in error.errors(include_url=False, include_context=False, include_input=False)
    ]
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    items = document.get("transactions") if isinstance(document, dict) else None
    if isinstance(items, list):
        details: dict[int, str] = {}
        for e in errors:
            loc = e["loc"]
            if len(loc) >= 2 and loc[0] == "transactions" and isinstance(loc[1], int):
                field = ".".join(str(part) for part in loc[2:]) or "transaction"
                details.setdefault(loc[1], f"{field}: {e['msg']}")
        scorer.quarantine_invalid(items, details, request_id)
    return _error(422, "invalid_request", request_id, errors)
