"""The HTTP face of the scorer: a plain Starlette app, mounted into the BentoML service.

Starlette rather than `@bentoml.api`: the per-request framework cost, not the model, sets this
service's ceiling on two cores (see the measurements in serving/README.md).

Every refusal happens before work is queued, cheapest first: bearer token (401), body size (413,
from Content-Length before reading, or counted while a chunked body streams in), JSON and schema
(422), item count (413). Every error is a JSON body `{"error", "detail"}`, never a bare 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inference.lineage import explain
from inference.records import ID_MAX_LENGTH
from inference.settings import TandemSettings
from serving.admission import Decision
from serving.batcher import SCORING_PROCESS_DIED
from serving.idempotency import IDEMPOTENCY_IN_PROGRESS, IDEMPOTENCY_REUSED, KeyInProgress, KeyReused
from serving.metrics import ServingMetrics, target_seconds
from serving.runtime import DeadlineExceeded, OnlineScorer, Shed
from serving.schemas import (
    DEADLINE_HEADER,
    IDEMPOTENCY_HEADER,
    REQUEST_ID_HEADER,
    ItemResult,
    ScoreRequest,
    ScoreResponse,
    openapi_document,
)
from serving.security import BearerAuth, BodyRefused, Refusal, SecuritySettings, read_body

logger = logging.getLogger(__name__)

MAX_IDEMPOTENCY_KEY = 200


def _error(status: int, error: str, request_id: str, detail: Any = None, **headers: str) -> JSONResponse:
    return JSONResponse(
        {"error": error, "detail": detail},
        status_code=status,
        headers={REQUEST_ID_HEADER: request_id, **headers},
    )


def _refuse(refusal: Refusal, request_id: str) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="tandem"'} if refusal.status == 401 else {}
    return _error(refusal.status, refusal.error, request_id, refusal.detail, **headers)


class _Edge:
    """Settings of the edge, resolved at service start (the app's lifespan) or on first use,
    never at import: the app object is built when serving/service.py is imported."""

    def __init__(self, settings: SecuritySettings | None) -> None:
        self._given = settings

    @cached_property
    def settings(self) -> SecuritySettings:
        return self._given if self._given is not None else SecuritySettings()

    @cached_property
    def auth(self) -> BearerAuth:
        return BearerAuth(self.settings.auth_token)

    @cached_property
    def dagster_ui_url(self) -> str:
        return TandemSettings().dagster_ui_url


def build_app(get_scorer: Callable[[], OnlineScorer], *, security: SecuritySettings | None = None) -> Starlette:
    """`get_scorer` is called per request: the scorer exists only once the service has started.

    `security` unset: SecuritySettings from the environment, read when the service starts.
    """
    edge = _Edge(security)

    async def score(request: Request) -> Response:
        started = time.perf_counter()
        scorer = get_scorer()
        metrics = scorer.metrics
        metrics.in_flight.inc()
        try:
            response = await _score(request, scorer)
        finally:
            metrics.in_flight.dec()
        elapsed = time.perf_counter() - started
        metrics.latency.labels(status=str(response.status_code)).observe(elapsed)
        # The latency SLI without depending on bucket boundaries: 200s slower than the enforced target.
        if response.status_code == 200 and elapsed > target_seconds(scorer.settings.p99_target_ms):
            metrics.over_target.inc()
        return response

    async def _score(request: Request, scorer: OnlineScorer) -> Response:
        request_id = uuid.uuid4().hex
        refusal = edge.auth.check(request.headers.get("authorization"))
        if refusal is not None:
            return _refuse(refusal, request_id)
        call = await _parse(request, scorer, request_id, edge.settings.max_body_bytes)
        if isinstance(call, Response):
            return call
        if not scorer.scoring_available():
            scorer.metrics.items.labels(outcome="failed").inc(len(call.request.transactions))
            return _unavailable(request_id)
        response, cpu = await _run(call, scorer, request_id)
        # Only synchronous stretches are timed: thread time across an await is everyone's.
        scorer.metrics.cpu_per_request.observe(call.parse_cpu + cpu)
        return response

    async def lineage(request: Request) -> Response:
        request_id = uuid.uuid4().hex
        refusal = edge.auth.check(request.headers.get("authorization"))
        if refusal is not None:
            return _refuse(refusal, request_id)
        transaction_id = str(request.path_params["transaction_id"])
        if not 0 < len(transaction_id) <= ID_MAX_LENGTH or "\x00" in transaction_id:
            return _error(
                422, "invalid_request", request_id, f"transaction_id must be 1-{ID_MAX_LENGTH} characters, no NUL"
            )
        engine = get_scorer().engine
        try:
            # A blocking query: off the event loop, which keeps answering /score meanwhile.
            found = await asyncio.to_thread(explain, engine, transaction_id, dagster_ui_url=edge.dagster_ui_url)
        except SQLAlchemyError as error:
            logger.warning("lineage query failed: %s", type(error).__name__)
            return _error(503, "store_unavailable", request_id, "the result store is unreachable; retry later")
        if not found.source_found and not found.results:
            return _error(404, "not_found", request_id, f"no record or result for transaction {transaction_id!r}")
        return JSONResponse(found.to_dict(), headers={REQUEST_ID_HEADER: request_id})

    async def openapi(_: Request) -> Response:
        return JSONResponse(openapi_document(bearer_auth=edge.auth.enabled))

    async def metrics(_: Request) -> Response:
        return Response(get_scorer().metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # BentoML runs a mounted app's lifespan at service start: a bad setting fails the start,
        # not the first request. (Without a lifespan, e.g. in some tests, the first request resolves.)
        limit = edge.settings.max_body_bytes
        logger.info("bearer auth %s; request bodies up to %d bytes", "on" if edge.auth.enabled else "off", limit)
        yield

    return Starlette(
        lifespan=lifespan,
        routes=[
            Route("/score", score, methods=["POST"]),
            # `path`: an id may contain "/", and must still name one transaction.
            Route("/lineage/{transaction_id:path}", lineage, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
    )


def _overloaded(decision: Decision, request_id: str) -> JSONResponse:
    detail = {
        "reason": decision.reason,
        "predicted_wait_ms": round(decision.predicted_wait_s * 1000, 1),
        "limit_ms": round(decision.limit_s * 1000, 1),
    }
    return _error(503, "overloaded", request_id, detail, **{"Retry-After": str(decision.retry_after_s)})


def _unavailable(request_id: str) -> JSONResponse:
    # Until the server has replaced its scoring process (lifecycle.PoolSupervisor), fail fast.
    return _error(
        503, "unavailable", request_id, "the scoring process died; a new one is starting", **{"Retry-After": "1"}
    )


@dataclass(frozen=True)
class _Call:
    request: ScoreRequest
    idempotency_key: str | None
    deadline: float
    deadline_ms: float
    parse_cpu: float


async def _parse(request: Request, scorer: OnlineScorer, request_id: str, max_body_bytes: int) -> _Call | Response:
    arrived = time.monotonic()
    headers = _preflight(request, scorer, request_id, arrived)
    if isinstance(headers, Response):
        return headers
    deadline_ms, key = headers
    try:
        body = await read_body(request, max_body_bytes)
    except BodyRefused as refused:
        return _refuse(refused.refusal, request_id)
    cpu_started = time.thread_time()
    limit = scorer.settings.max_transactions_per_request
    try:
        parsed = ScoreRequest.model_validate_json(body)
    except ValidationError as error:
        return _invalid(scorer, body, error, request_id, limit)
    if len(parsed.transactions) > limit:
        return _too_many(limit, request_id)
    problems = _request_problems(parsed)
    if problems:
        scorer.metrics.items.labels(outcome="rejected").inc(len(parsed.transactions))
        return _error(422, "invalid_request", request_id, problems)
    return _Call(parsed, key, arrived + deadline_ms / 1000, deadline_ms, time.thread_time() - cpu_started)


def _preflight(
    request: Request, scorer: OnlineScorer, request_id: str, arrived: float
) -> tuple[float, str | None] | Response:
    """The headers, and a refusal under overload before the body is read: reading and parsing it
    are most of what a refusal costs, and an event loop spending them lets the socket backlog grow
    where admission cannot see it. The full decision, with the real item count, follows the parse."""
    headers = _headers(request, scorer, request_id)
    if isinstance(headers, Response):
        return headers
    refused = scorer.refuse_early(arrived + headers[0] / 1000)
    if refused is not None:
        scorer.metrics.items.labels(outcome="shed").inc()  # at least one item; the body is never read
        return _overloaded(refused, request_id)
    return headers


def _headers(request: Request, scorer: OnlineScorer, request_id: str) -> tuple[float, str | None] | Response:
    """(deadline in ms, idempotency key), or the 400 for a malformed one."""
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
    return deadline_ms, key


async def _run(call: _Call, scorer: OnlineScorer, request_id: str) -> tuple[Response, float]:
    items = scorer.metrics.items
    count = len(call.request.transactions)
    try:
        results, batch_cpu = await scorer.score(
            call.request.transactions,
            request_id=request_id,
            idempotency_key=call.idempotency_key,
            deadline=call.deadline,
        )
    except Shed as shed:
        items.labels(outcome="shed").inc(count)
        return _overloaded(shed.decision, request_id), 0.0
    except DeadlineExceeded:
        items.labels(outcome="expired").inc(count)
        return _error(504, "deadline_exceeded", request_id, f"no answer within {call.deadline_ms:g} ms"), 0.0
    except KeyReused as reused:
        # Stripe's rule: a key names one body; answering another body under it would hand back
        # (or store) an answer computed for other inputs.
        items.labels(outcome="rejected").inc(count)
        detail = {"idempotency_key": reused.key, "message": str(reused)}
        return _error(422, IDEMPOTENCY_REUSED, request_id, detail), 0.0
    except KeyInProgress as busy:
        items.labels(outcome="shed").inc(count)
        detail = {"idempotency_key": busy.key, "message": str(busy)}
        return _error(409, IDEMPOTENCY_IN_PROGRESS, request_id, detail, **{"Retry-After": "1"}), 0.0
    if any(r.error is not None and r.error.reason == SCORING_PROCESS_DIED for r in results):
        # The batch died with the scoring process: not an answer about these items, a server fault.
        items.labels(outcome="failed").inc(count)
        return _unavailable(request_id), 0.0
    _count_answers(scorer.metrics, results)
    cpu_started = time.thread_time()
    payload = ScoreResponse(request_id=request_id, results=results).model_dump_json()
    response = Response(payload, media_type="application/json", headers={REQUEST_ID_HEADER: request_id})
    return response, batch_cpu + time.thread_time() - cpu_started


def _count_answers(metrics: ServingMetrics, results: list[ItemResult]) -> None:
    """Items of a 200, by outcome, the scores returned and the unseen vocabulary values they were
    scored with (cached answers included: the caller got them)."""
    outcomes = {"scored": 0, "degraded": 0, "rejected": 0}
    for result in results:
        if result.status != "scored" or result.score is None:
            outcomes["rejected"] += 1
            continue
        outcomes["degraded" if result.degraded else "scored"] += 1
        metrics.scores.observe(result.score)
        for name in result.unseen_fields:
            metrics.unseen_values.labels(field=name).inc()
    for outcome, count in outcomes.items():
        if count:
            metrics.items.labels(outcome=outcome).inc(count)


def _too_many(limit: int, request_id: str) -> JSONResponse:
    return _error(413, "too_many_transactions", request_id, f"at most {limit} transactions per request")


def _request_problems(parsed: ScoreRequest) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, tx in enumerate(parsed.transactions):
        for field in ("transaction_id", "account_id"):
            # PostgreSQL text cannot hold NUL: such an id would fail every write (and open the breaker).
            if "\x00" in getattr(tx, field):
                problems.append({"loc": ["transactions", index, field], "msg": "NUL characters are not allowed"})
        if tx.transaction_id in seen:
            problems.append(
                {"loc": ["transactions", index, "transaction_id"], "msg": "duplicate transaction_id in request"}
            )
        seen.add(tx.transaction_id)
    return problems


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def _invalid(scorer: OnlineScorer, body: bytes, error: ValidationError, request_id: str, limit: int) -> Response:
    """422 naming each field and reason; the invalid items are quarantined, never batched."""
    errors = [
        {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in error.errors(include_url=False, include_context=False, include_input=False)
    ]
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the stdlib parser's depth
        document = None
    items = document.get("transactions") if isinstance(document, dict) else None
    if isinstance(items, list):
        if len(items) > limit:
            return _too_many(limit, request_id)
        details: dict[int, str] = {}
        for e in errors:
            loc = e["loc"]
            if len(loc) >= 2 and loc[0] == "transactions" and isinstance(loc[1], int):
                field = ".".join(str(part) for part in loc[2:]) or "transaction"
                details.setdefault(loc[1], f"{field}: {e['msg']}")
        # NUL cannot be stored; such an item is answered 422 but not quarantined.
        details = {index: detail for index, detail in details.items() if not _has_nul(items[index])}
        # The whole request is refused: every item in it, valid or not, is answered 422.
        scorer.metrics.items.labels(outcome="rejected").inc(len(items))
        try:
            scorer.quarantine_invalid(items, details, request_id)
        except Exception:  # best effort: the client's 422 must not turn into a 500
            logger.exception("quarantining the invalid items of request %s failed", request_id)
    return _error(422, "invalid_request", request_id, errors)
