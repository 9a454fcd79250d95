"""The gate in front of `POST /score`: an ASGI middleware (BentoML's `add_asgi_middleware`, served
outside BentoML's own: `serving.middleware_order`) that refuses what it can before BentoML sees
the request, cheapest first.

Bearer token (401), headers (400), overload from the headers alone (503, before the body is read:
reading and parsing are most of what a refusal costs, and an event loop spending them lets the
socket backlog grow where admission cannot see it), body size (413), a body slower than the
request's deadline (408), JSON and schema (422, with
the field and the reason; the invalid items are quarantined), item count (413), a dead scoring
process (503). What passes is parsed once and handed to the `@bentoml.api` method through
`schemas.PARSED_REQUEST`, so BentoML neither parses it again nor answers a schema error with its
own 400. Every refusal is a `Refused`, rendered and counted in one place.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inference.records import has_nul
from serving.admission import Decision, StandingMinimum
from serving.http_protocol import RawHeaders, screen_on_headers
from serving.metrics import target_seconds
from serving.runtime import OnlineScorer
from serving.schemas import (
    DEADLINE_HEADER,
    IDEMPOTENCY_HEADER,
    PARSED_REQUEST,
    REQUEST_ID_HEADER,
    Handoff,
    ScoreRequest,
)
from serving.security import BearerAuth, BodyRefused, Refusal, SecuritySettings, drain_before_close, read_body

logger = logging.getLogger(__name__)

MAX_IDEMPOTENCY_KEY = 200
SCORE_PATH = "/score"
REQUEST_START_HEADER = "X-Request-Start"
MAX_PROXY_WAIT_S = 60.0


class Refused(Exception):
    """A request refused with a status, an error code and a reason; `items` of it are counted
    under `outcome` (rejected, shed, expired, failed)."""

    def __init__(
        self,
        status: int,
        error: str,
        detail: Any = None,
        *,
        outcome: str | None = None,
        items: int = 1,
        headers: dict[str, str] | None = None,
        drain_body: bool = False,
    ) -> None:
        super().__init__(error)
        self.drain_body = drain_body  # a body refused for its size, the rest of it still arriving
        self.status = status
        self.error = error
        self.detail = detail
        self.outcome = outcome
        self.items = items
        self.headers = headers or {}

    @classmethod
    def at_edge(cls, refusal: Refusal, *, drain_body: bool = False) -> Refused:
        headers = {"WWW-Authenticate": 'Bearer realm="tandem"'} if refusal.status == 401 else {}
        return cls(refusal.status, refusal.error, refusal.detail, headers=headers, drain_body=drain_body)

    @classmethod
    def overloaded(cls, decision: Decision, *, items: int) -> Refused:
        detail = {
            "reason": decision.reason,
            "predicted_wait_ms": round(decision.predicted_wait_s * 1000, 1),
            "limit_ms": round(decision.limit_s * 1000, 1),
        }
        return cls(
            503,
            "overloaded",
            detail,
            outcome="shed",
            items=items,
            headers={"Retry-After": str(decision.retry_after_s)},
        )

    @classmethod
    def unavailable(cls, *, items: int) -> Refused:
        # Until the server has replaced its scoring process (lifecycle.PoolSupervisor), fail fast.
        return cls(
            503,
            "unavailable",
            "the scoring process died; a new one is starting",
            outcome="failed",
            items=items,
            headers={"Retry-After": "1"},
        )

    def response(self, scorer: OnlineScorer | None, request_id: str) -> JSONResponse:
        """The one rendering of a refusal: JSON `{"error", "detail"}`, and its items counted."""
        if scorer is not None and self.outcome is not None:
            scorer.metrics.items_by_outcome[self.outcome].inc(self.items)
        return JSONResponse(
            {"error": self.error, "detail": self.detail},
            status_code=self.status,
            headers={REQUEST_ID_HEADER: request_id, **self.headers},
        )


@dataclass
class ScoreCall:
    """One admitted /score request as the API method sees it."""

    request_id: str
    request: ScoreRequest
    idempotency_key: str | None
    deadline: float  # monotonic, counted from when the request began to wait (`Wait.arrived`)
    deadline_ms: float
    counted_from: float  # monotonic: where its latency starts against the target at admission (`Wait`)
    arrived: float  # monotonic: when it began to wait (`Wait.arrived`); the concurrency limit's latency starts here
    parse_cpu: float = 0.0


class _RequestIds:
    """Request ids unique across processes and restarts: 64 random bits drawn once per process,
    then a counter. `uuid4` reads the OS's randomness for every request, 1.6 us against 0.2 us,
    paid by every refusal past capacity. A forked child draws its own prefix."""

    def __init__(self) -> None:
        self._draw()
        os.register_at_fork(after_in_child=self._draw)

    def _draw(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


# 32 hex digits, as uuid4().hex was: lineage rows and the Idempotency-Key's owner carry them.
new_request_id = _RequestIds()

# The call the gate admitted, for the API method, which runs inside the gate's call (and any task
# started meanwhile starts with a copy of this context).
CURRENT_CALL: ContextVar[Handoff[ScoreCall] | None] = ContextVar("tandem_score_call", default=None)


def current_call() -> ScoreCall | None:
    """The call the gate admitted and is answering now, in the code the gate called."""
    handoff = CURRENT_CALL.get()
    return handoff.value if handoff is not None else None


class Edge:
    """Settings of the edge (token, body limit), resolved on first use or at service start, never
    at import: the service module (and so this gate) is imported by `bentoml build` and by tests
    without the serving environment."""

    def __init__(self, settings: SecuritySettings | None) -> None:
        self._given = settings

    @cached_property
    def settings(self) -> SecuritySettings:
        return self._given if self._given is not None else SecuritySettings()

    @cached_property
    def auth(self) -> BearerAuth:
        return BearerAuth(self.settings.auth_token)


class ScoreGate:
    def __init__(
        self, app: ASGIApp, *, get_scorer: Callable[[], OnlineScorer], security: SecuritySettings | None = None
    ) -> None:
        self.app = app
        self.get_scorer = get_scorer
        self.edge = Edge(security)
        screen_on_headers(SCORE_PATH, self.refusal_on_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != SCORE_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        scorer = self.get_scorer()
        metrics = scorer.metrics
        metrics.in_flight.inc()
        status = 500
        try:
            status = await self._score(scope, receive, send, scorer)
        finally:
            metrics.in_flight.dec()
            elapsed = time.perf_counter() - started
            metrics.latency_by_status[str(status)].observe(elapsed)
            # The latency SLI without depending on bucket boundaries: 200s slower than the enforced target.
            if status == 200 and elapsed > target_seconds(scorer.settings.p99_target_ms):
                metrics.over_target.inc()

    async def _score(self, scope: Scope, receive: Receive, send: Send, scorer: OnlineScorer) -> int:
        request_id = new_request_id()
        request = Request(scope, receive)
        try:
            call, body = await self._admit(request, scorer, request_id)
        except Refused as refused:
            if refused.drain_body:  # after _admit let go of its place: a slow sender holds none
                await drain_before_close(request)
            response = refused.response(scorer, request_id)
            await response(scope, receive, send)
            return response.status_code
        status = 500

        replayed = False

        async def replay() -> Message:
            # The body once (the gate has read it); after that the client's own stream, so that
            # a disconnect still reaches whoever listens for it.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        call_handoff, parsed_handoff = Handoff(call), Handoff(call.request)
        call_token, parsed_token = CURRENT_CALL.set(call_handoff), PARSED_REQUEST.set(parsed_handoff)
        try:
            await self.app(scope, replay, sending)
        finally:
            CURRENT_CALL.reset(call_token)
            PARSED_REQUEST.reset(parsed_token)
            call_handoff.value = parsed_handoff.value = None
            # From when the request began to wait, a proxy's stamped wait in full: the limit holds
            # the p99 the client sees, and HAProxy's queue (5 ms at most) and the socket behind it
            # are part of that. Counted only as far as it stood, the limit's latency read about 10
            # ms under the client's past capacity, and at an aim of 0.9 x the target it settled
            # where the client's p99 was 54-66 ms (bench/findings.md, fifteenth session).
            # Admission still counts only what stood.
            scorer.finished(time.monotonic() - call.arrived)
        return status

    def refusal_on_headers(self, raw_headers: RawHeaders) -> tuple[int, RawHeaders, bytes] | None:
        """The 503 `_admit` would give this request for overload, decided from its headers alone
        (status, headers, body), or None: every other request, admitted or refused for anything
        else, is left for `__call__` to answer as always. Called by the HTTP protocol before it
        starts the request's task (`serving.http_protocol`): past capacity most requests are
        refused, and the task, the ASGI stack and Starlette's response were most of their cost."""
        started = time.perf_counter()
        scorer = self.get_scorer()
        try:
            # Without the loop's lag: this runs in the parser's callback, and right after a stall
            # the lag sampler has not run yet, so the lag reads the whole stall, which a burst
            # arriving at its end never waited. The gate reads the lag once the sampler has caught
            # up; a proxy's X-Request-Start still counts here.
            wait, deadline_ms, _ = self._screen(Headers(raw=raw_headers), scorer, loop_lag_s=0.0)
        except Refused:
            return None
        waited_s = time.monotonic() - wait.counted_from
        early = scorer.refuse_early(wait.arrived + deadline_ms / 1000, waited_s=waited_s, take_slot=False)
        if early is None:
            return None
        response = Refused.overloaded(early, items=1).response(scorer, new_request_id())
        scorer.metrics.shed_on_headers.inc()
        scorer.metrics.latency_by_status[str(response.status_code)].observe(time.perf_counter() - started)
        return response.status_code, response.raw_headers, bytes(response.body)

    def _screen(self, headers: Headers, scorer: OnlineScorer, *, loop_lag_s: float) -> tuple[Wait, float, str | None]:
        """(the wait before the service saw it, deadline in ms, idempotency key) from a /score
        request's headers; Refused for its token (401) or a malformed header (400)."""
        stamps = scorer.proxy_wait if scorer.settings.trust_request_start else None
        wait = _wait_before(headers, loop_lag_s, stamps)
        refusal = self.edge.auth.check(headers.get("authorization"))
        if refusal is not None:
            raise Refused.at_edge(refusal)
        deadline_ms, key = _headers(headers, scorer.settings.request_timeout_ms, scorer.settings.max_deadline_ms)
        return wait, deadline_ms, key

    async def _admit(self, request: Request, scorer: OnlineScorer, request_id: str) -> tuple[ScoreCall, bytes]:
        wait, deadline_ms, key = self._screen(request.headers, scorer, loop_lag_s=scorer.loop_lag.lag_s)
        early = scorer.refuse_early(wait.arrived + deadline_ms / 1000, waited_s=time.monotonic() - wait.counted_from)
        if early is not None:
            raise Refused.overloaded(early, items=1)  # at least one item; the body is never read
        try:
            return await self._read_and_parse(request, scorer, request_id, wait, deadline_ms, key)
        except BaseException:
            scorer.finished(None)  # refused for its body (or the client left): no latency to learn from
            raise

    async def _read_and_parse(
        self,
        request: Request,
        scorer: OnlineScorer,
        request_id: str,
        wait: Wait,
        deadline_ms: float,
        key: str | None,
    ) -> tuple[ScoreCall, bytes]:
        try:
            # BentoML's timeout starts only once the gate passes the request on (middleware_order.py):
            # without this bound a body that never ends would hold a concurrency slot for good.
            async with asyncio.timeout(max(wait.arrived + deadline_ms / 1000 - time.monotonic(), 0.0)):
                body = await read_body(request, self.edge.settings.max_body_bytes)
        except BodyRefused as refused:
            raise Refused.at_edge(refused.refusal, drain_body=refused.body_left) from refused
        except TimeoutError as late:
            raise Refused(
                408,
                "body_timeout",
                f"the body did not arrive within the request's deadline ({deadline_ms:.0f} ms)",
                headers={"Connection": "close"},
            ) from late
        cpu_started = time.thread_time()
        limit = scorer.settings.max_transactions_per_request
        try:
            parsed = ScoreRequest.model_validate_json(body)
        except ValidationError as error:
            raise await _invalid(scorer, body, error, request_id, limit) from error
        count = len(parsed.transactions)
        if count > limit:
            raise _too_many(limit)
        key = _one_key(key, parsed.idempotency_key, count)
        if parsed.deadline_ms is not None and request.headers.get(DEADLINE_HEADER) is None:
            deadline_ms = min(parsed.deadline_ms, scorer.settings.max_deadline_ms)
        problems = _request_problems(parsed)
        if problems:
            raise Refused(422, "invalid_request", problems, outcome="rejected", items=count)
        if not scorer.scoring_available():
            raise Refused.unavailable(items=count)
        call = ScoreCall(
            request_id=request_id,
            request=parsed,
            idempotency_key=key,
            deadline=wait.arrived + deadline_ms / 1000,
            deadline_ms=deadline_ms,
            counted_from=wait.counted_from,
            arrived=wait.arrived,
            parse_cpu=time.thread_time() - cpu_started,
        )
        return call, body


@dataclass(frozen=True)
class Wait:
    """When a request began to wait, before the service read it (the socket backlog, a busy event
    loop and a proxy's queue, which no queue of ours sees), and how much of that counts."""

    # Monotonic: when it began to wait; the client waited from here, its deadline and the concurrency
    # limit's latency count from here.
    arrived: float
    # Monotonic: the service's read less the part of the wait before it that has stood for a burst
    # interval; its latency counts from here against the target at admission.
    counted_from: float


def _wait_before(headers: Headers, loop_lag_s: float, proxy_wait: StandingMinimum | None) -> Wait:
    """The request's wait, from the event loop's standing lag and a proxy's X-Request-Start stamp,
    whichever says it waited longer. A stamp moves the arrival back in full (the deadline and the
    concurrency limit's latency count from there), but counts against the target at admission only
    as far as such waits have stood (`StandingMinimum`), as the loop's lag does: a proxy that
    stamps every request would otherwise make the service refuse part of a burst that drains
    within the interval. A stamp in the future, unparsable, or more than a minute old
    (clock skew) is ignored; so is every stamp without `proxy_wait` (no trusted proxy stamps them)."""
    now = time.monotonic()
    waited, standing = loop_lag_s, loop_lag_s
    if proxy_wait is not None and (stamp := headers.get(REQUEST_START_HEADER)) is not None:
        started = _epoch_seconds(stamp)
        stamped_wait = None if started is None else time.time() - started
        if stamped_wait is not None and 0.0 <= stamped_wait <= MAX_PROXY_WAIT_S:
            waited = max(waited, stamped_wait)
            standing = max(standing, proxy_wait.observe(stamped_wait, now))
    return Wait(arrived=now - waited, counted_from=now - standing)


def _epoch_seconds(stamp: str) -> float | None:
    """`t=1732700000.123` (nginx, seconds), `t=1732700000123` (ms) or `t=1732700000123456` (µs)."""
    try:
        value = float(stamp.strip().removeprefix("t="))
    except ValueError:
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    for scale in (1e6, 1e3):
        if value > scale * 1e9:  # past 2001 in that unit
            return value / scale
    return value


def _headers(headers: Headers, default_deadline_ms: float, max_deadline_ms: float) -> tuple[float, str | None]:
    """(deadline in ms, idempotency key), or a 400 for a malformed one. A deadline longer than
    `max_deadline_ms` is cut to it: past that, BentoML's backstop would answer in Tandem's place."""
    deadline_ms = default_deadline_ms
    if (raw_deadline := headers.get(DEADLINE_HEADER)) is not None:
        try:
            deadline_ms = float(raw_deadline)
        except ValueError:
            deadline_ms = math.nan
        if not math.isfinite(deadline_ms) or deadline_ms <= 0:
            raise Refused(400, "bad_header", f"{DEADLINE_HEADER} must be a positive number of ms")
        deadline_ms = min(deadline_ms, max_deadline_ms)
    key = headers.get(IDEMPOTENCY_HEADER)
    if key is not None and not 0 < len(key) <= MAX_IDEMPOTENCY_KEY:
        raise Refused(400, "bad_header", f"{IDEMPOTENCY_HEADER} must be 1-{MAX_IDEMPOTENCY_KEY} chars")
    return deadline_ms, key


def _one_key(header: str | None, body: str | None, items: int) -> str | None:
    if header is not None and body is not None and header != body:
        raise Refused(
            400, "bad_request", f"{IDEMPOTENCY_HEADER} and idempotency_key differ", outcome="rejected", items=items
        )
    return header if header is not None else body


def _too_many(limit: int) -> Refused:
    return Refused(413, "too_many_transactions", f"at most {limit} transactions per request")


def _request_problems(parsed: ScoreRequest) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    # Claimed in idempotency_keys: PostgreSQL text cannot hold NUL, and the failed claim counted
    # against the breaker, so two such requests opened it for every client. (A header cannot carry NUL.)
    if has_nul(parsed.idempotency_key):
        problems.append({"loc": ["idempotency_key"], "msg": "NUL characters are not allowed"})
    seen: set[str] = set()
    for index, tx in enumerate(parsed.transactions):
        for name in ("transaction_id", "account_id"):
            # PostgreSQL text cannot hold NUL: such an id would fail every write (and open the breaker).
            if "\x00" in getattr(tx, name):
                problems.append({"loc": ["transactions", index, name], "msg": "NUL characters are not allowed"})
        if tx.transaction_id in seen:
            problems.append(
                {"loc": ["transactions", index, "transaction_id"], "msg": "duplicate transaction_id in request"}
            )
        seen.add(tx.transaction_id)
    return problems


async def _invalid(scorer: OnlineScorer, body: bytes, error: ValidationError, request_id: str, limit: int) -> Refused:
    """422 naming each field and reason; the invalid items are quarantined (off the event loop:
    validation runs polars), never batched."""
    errors = [
        {"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in error.errors(include_url=False, include_context=False, include_input=False)
    ]
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the stdlib parser's depth
        document = None
    items = document.get("transactions") if isinstance(document, dict) else None
    if not isinstance(items, list):
        return Refused(422, "invalid_request", errors)
    if len(items) > limit:
        return _too_many(limit)
    details: dict[int, str] = {}
    for e in errors:
        loc = e["loc"]
        if len(loc) >= 2 and loc[0] == "transactions" and isinstance(loc[1], int):
            name = ".".join(str(part) for part in loc[2:]) or "transaction"
            details.setdefault(loc[1], f"{name}: {e['msg']}")
    # NUL cannot be stored (the batch path's `nul_character`); such an item is answered 422 but not
    # quarantined.
    details = {index: detail for index, detail in details.items() if not has_nul(items[index])}
    try:
        await asyncio.to_thread(scorer.quarantine_invalid, items, details, request_id)
    except Exception:  # best effort: the client's 422 must not turn into a 500
        logger.exception("quarantining the invalid items of request %s failed", request_id)
    # The whole request is refused: every item in it, valid or not, is answered 422.
    return Refused(422, "invalid_request", errors, outcome="rejected", items=len(items))
