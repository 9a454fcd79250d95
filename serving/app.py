"""The online path's routes beside BentoML's own (`/lineage/{id}`, `/openapi.json`, `/metrics`), and
`answer`, which the `POST /score` API method calls once the gate has admitted the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import cached_property

from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inference.lineage import explain
from inference.records import WHITESPACE
from inference.settings import TandemSettings
from inference.spec.api import RecordBase
from serving.batcher import SCORING_PROCESS_DIED
from serving.gate import Edge, ScoreCall, new_request_id
from serving.idempotency import IDEMPOTENCY_IN_PROGRESS, IDEMPOTENCY_REUSED, KeyInProgress, KeyReused
from serving.metrics import ServingMetrics
from serving.openapi import service_document
from serving.refusals import Refused
from serving.runtime import DeadlineExceeded, OnlineScorer, Shed
from serving.schemas import REQUEST_ID_HEADER, ItemResult
from serving.security import SecuritySettings

logger = logging.getLogger(__name__)


class AnyText(Convertor[str]):
    """A path segment of any characters: `path`'s ".*" stops at a newline, and an id scored with
    one must still be looked up."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("tandem_any_text", AnyText())


class _Edge(Edge):
    @cached_property
    def dagster_ui_url(self) -> str:
        return TandemSettings().dagster_ui_url


def build_app(get_scorer: Callable[[], OnlineScorer], *, security: SecuritySettings | None = None) -> Starlette:
    """`get_scorer` is called per request: the scorer exists only once the service has started.

    `security` unset: SecuritySettings from the environment, read when the service starts.
    """
    edge = _Edge(security)

    async def lineage(request: Request) -> Response:
        request_id = new_request_id()
        try:
            return await _lineage(request, request_id, edge, get_scorer())
        except Refused as refused:
            return refused.response(None, request_id)

    async def openapi(_: Request) -> Response:
        scorer = get_scorer()
        return JSONResponse(service_document(scorer.spec, scorer.settings, edge.settings, scorer.model_version))

    async def metrics(_: Request) -> Response:
        # Off the event loop: in multiprocess mode it reads every worker's files.
        exposition = await asyncio.to_thread(get_scorer().metrics.exposition)
        return Response(exposition, media_type="text/plain; version=0.0.4; charset=utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # BentoML runs a mounted app's lifespan at service start: a bad setting fails the start.
        limit = edge.settings.max_body_bytes
        logger.info("bearer auth %s; request bodies up to %d bytes", "on" if edge.auth.enabled else "off", limit)
        yield

    routes = [
        # Any text: an id may contain "/" or a newline, and must still name one record. The
        # documents name the parameter by the spec's id field; the URL is the same.
        Route("/lineage/{record_id:tandem_any_text}", lineage, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(lifespan=lifespan, routes=routes)


async def _lineage(request: Request, request_id: str, edge: _Edge, scorer: OnlineScorer) -> Response:
    """Every answer, and every rejection, of one record; Refused for a bad id or an unreachable store."""
    refusal = edge.auth.check(request.headers.get("authorization"))
    if refusal is not None:
        raise refusal
    # Stripped as a request's ids are where records come in: " x " was scored and stored as "x".
    record_id = str(request.path_params["record_id"]).strip(WHITESPACE)
    longest = scorer.spec.id.max_length
    if not 0 < len(record_id) <= longest or "\x00" in record_id:
        raise Refused(422, "invalid_request", f"{scorer.spec.id.name} must be 1-{longest} characters, no NUL")
    try:
        # A blocking query: off the event loop, which keeps answering /score meanwhile.
        found = await asyncio.to_thread(
            explain,
            scorer.spec,
            scorer.engine,
            record_id,
            dagster_ui_url=edge.dagster_ui_url,
            production_version=scorer.model_version,
        )
    except SQLAlchemyError as error:
        logger.warning("lineage query failed: %s", type(error).__name__)
        raise Refused(
            503,
            "store_unavailable",
            "the result store is unreachable; retry later",
            headers={"Retry-After": "1"},
        ) from error
    if not found.found:
        record = scorer.spec.spec.record_name.lower()
        raise Refused(404, "not_found", f"no record, result or rejection for {record} {record_id!r}")
    return JSONResponse(found.to_dict(), headers={REQUEST_ID_HEADER: request_id})


async def answer(
    call: ScoreCall,
    scorer: OnlineScorer,
    records: list[RecordBase],
    idempotency_key: str | None,
    deadline_ms: float | None,
) -> Response:
    """Score an admitted request: one answer per record, or the request's refusal. The key
    and deadline are the body's fields, which the request's headers override (`ScoreCall.resolve`)."""
    try:
        return await _answer(call, scorer, records, idempotency_key, deadline_ms)
    except Refused as refused:
        return refused.response(scorer.metrics, call.request_id)


async def _answer(
    call: ScoreCall,
    scorer: OnlineScorer,
    records: list[RecordBase],
    body_key: str | None,
    body_deadline_ms: float | None,
) -> Response:
    count = len(records)
    key, deadline, deadline_ms = call.resolve(body_key, body_deadline_ms)
    try:
        results, batch_cpu = await scorer.score(
            records,
            request_id=call.request_id,
            idempotency_key=key,
            deadline=deadline,
            reservation=call.reservation,
        )
    except Shed as shed:
        raise Refused.overloaded(shed.decision, items=count) from shed
    except DeadlineExceeded as late:
        raise Refused(
            504, "deadline_exceeded", f"no answer within {deadline_ms:g} ms", outcome="expired", items=count
        ) from late
    except KeyReused as reused:
        # Stripe's rule: a key names one body.
        detail = {"idempotency_key": reused.key, "message": str(reused)}
        raise Refused(422, IDEMPOTENCY_REUSED, detail, outcome="rejected", items=count) from reused
    except KeyInProgress as busy:
        detail = {"idempotency_key": busy.key, "message": str(busy)}
        raise Refused(
            409, IDEMPOTENCY_IN_PROGRESS, detail, outcome="shed", items=count, headers={"Retry-After": "1"}
        ) from busy
    if any(r.error is not None and r.error.reason == SCORING_PROCESS_DIED for r in results):
        # The batch died with the scoring process: not an answer about these items, a server fault.
        raise Refused.unavailable(items=count)
    _count_answers(scorer.metrics, results)
    cpu_started = time.thread_time()
    payload = scorer.api.response(request_id=call.request_id, results=results).model_dump_json()
    response = Response(payload, media_type="application/json", headers={REQUEST_ID_HEADER: call.request_id})
    # Only synchronous stretches are timed: thread time across an await is everyone's.
    scorer.metrics.cpu_per_request.observe(call.parse_cpu + batch_cpu + time.thread_time() - cpu_started)
    return response


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
            metrics.unseen_values[name].inc()
    for outcome, count in outcomes.items():
        if count:
            metrics.items_by_outcome[outcome].inc(count)
