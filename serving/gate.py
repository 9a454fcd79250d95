"""The gate in front of `POST /score`, an ASGI middleware: it refuses what it can before BentoML
sees the request, cheapest first (token, headers and media type, admission before the body is
read, body size and time, schema with the invalid items quarantined, item count, a dead scoring
process). The admitted call rides in the ASGI scope's `state` (`call_in`); every refusal is a
`Refused`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inference.records import WHITESPACE, has_nul
from inference.spec import LoadedSpec
from serving.admission import Decision
from serving.batcher import Reservation
from serving.metrics import target_seconds
from serving.refusals import Refused
from serving.runtime import OnlineScorer
from serving.schemas import DEADLINE_HEADER, IDEMPOTENCY_HEADER, ScoreRequestBase
from serving.security import BearerAuth, SecuritySettings, drain_before_close, read_body

logger = logging.getLogger(__name__)

MAX_IDEMPOTENCY_KEY = 200
SCORE_PATH = "/score"
# The key of the admitted call in the ASGI scope's `state` (Starlette's `request.state`).
CALL_STATE = "tandem_score_call"
# A JSON number, as the body's deadline_ms is: float() alone also took "1_000" and "１２".
DEADLINE_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")


@dataclass
class ScoreCall:
    """One admitted /score request, as the gate saw its headers; the body's own fields (key,
    deadline) are the API method's parameters, combined with these by `resolve`."""

    request_id: str
    arrived: float  # monotonic: when the gate first saw it; its deadline counts from here
    header_deadline_ms: float | None
    header_key: str | None
    default_deadline_ms: float
    max_deadline_ms: float
    reservation: Reservation | None = None
    parse_cpu: float = 0.0

    def resolve(self, body_key: str | None, body_deadline_ms: float | None) -> tuple[str | None, float, float]:
        """(idempotency key, monotonic deadline, deadline in ms): a header wins over its body field,
        and a deadline longer than the service's longest is cut to it."""
        key = self.header_key if self.header_key is not None else body_key
        deadline_ms = self.header_deadline_ms if self.header_deadline_ms is not None else body_deadline_ms
        deadline_ms = min(deadline_ms if deadline_ms is not None else self.default_deadline_ms, self.max_deadline_ms)
        return key, self.arrived + deadline_ms / 1000, deadline_ms


def call_in(scope: MutableMapping[str, Any]) -> ScoreCall:
    """The call the gate admitted for this request (its ASGI scope, or `ctx.request.scope` in BentoML)."""
    call = scope.get("state", {}).get(CALL_STATE)
    if not isinstance(call, ScoreCall):
        raise RuntimeError("POST /score was not admitted by the gate (serving.gate.ScoreGate)")
    return call


class _RequestIds:
    """Request ids unique across processes and restarts: 64 random bits drawn once per process (and
    per forked child), then a counter; cheaper than `uuid4` for every refusal past capacity."""

    def __init__(self) -> None:
        self._draw()
        os.register_at_fork(after_in_child=self._draw)

    def _draw(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


# 32 hex digits: lineage rows and the Idempotency-Key's owner carry them.
new_request_id = _RequestIds()


class Edge:
    """Settings of the edge (token, body limit), resolved on first use, never at import: `bentoml
    build` and tests import the service without the serving environment."""

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
            # The latency SLI, independent of bucket boundaries.
            if status == 200 and elapsed > target_seconds(scorer.settings.p99_target_ms):
                metrics.over_target.inc()

    async def _score(self, scope: Scope, receive: Receive, send: Send, scorer: OnlineScorer) -> int:
        request_id = new_request_id()
        request = Request(scope, receive)
        try:
            call, body = await self._admit(request, scorer, request_id)
        except Refused as refused:
            response = refused.response(scorer.metrics, request_id)
            await response(scope, receive, send)
            return response.status_code
        status = 500

        replayed = False

        async def replay() -> Message:
            # The body once, then the client's stream, so a disconnect still reaches its listeners.
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

        state = scope.setdefault("state", {})
        state[CALL_STATE] = call
        # BentoML picks its parser by Content-Type: the JSON the gate validated reaches it declared as such.
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [
            (b"content-type", b"application/json")
        ]
        try:
            await self.app(scope, replay, sending)
        finally:
            state.pop(CALL_STATE, None)
            if call.reservation is not None:
                call.reservation.release()
            # Only answers teach the limit: a 409 or a 422 says nothing about the load.
            scorer.finished(time.monotonic() - call.arrived if status == 200 else None)
        return status

    async def _admit(self, request: Request, scorer: OnlineScorer, request_id: str) -> tuple[ScoreCall, bytes]:
        arrived = time.monotonic()
        refusal = self.edge.auth.check(request.headers.get("authorization"))
        if refusal is not None:
            raise refusal
        _check_json_body(request.headers)
        settings = scorer.settings
        call = ScoreCall(
            request_id=request_id,
            arrived=arrived,
            header_deadline_ms=_deadline_header(request.headers),
            header_key=_key_header(request.headers),
            default_deadline_ms=settings.request_timeout_ms,
            max_deadline_ms=settings.max_deadline_ms,
        )
        _, deadline, _ = call.resolve(None, None)
        admitted = scorer.admit(deadline)
        if isinstance(admitted, Decision):
            raise Refused.overloaded(admitted, items=1)  # at least one item; the body is never read
        call.reservation = admitted
        try:
            body = await self._read_and_parse(request, scorer, call)
        except BaseException as error:
            admitted.release()  # refused for its body (or the client left): no latency to learn from
            scorer.finished(None)
            if isinstance(error, Refused) and error.drain_body:  # its place let go: a slow sender holds none
                await drain_before_close(request, within_s=deadline - time.monotonic())
            raise
        return call, body

    async def _read_and_parse(self, request: Request, scorer: OnlineScorer, call: ScoreCall) -> bytes:
        _, deadline, deadline_ms = call.resolve(None, None)
        try:
            # A body that never ends must not hold its place in the queue.
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                body = await read_body(request, self.edge.settings.max_body_bytes)
        except TimeoutError as late:
            raise Refused(
                408,
                "body_timeout",
                f"the body did not arrive within the request's deadline ({deadline_ms:.0f} ms)",
                headers={"Connection": "close"},
            ) from late
        cpu_started = time.thread_time()
        limit = scorer.settings.max_records_per_request
        plural = scorer.spec.spec.plural
        try:
            parsed = scorer.api.request.model_validate_json(body)
        except ValidationError as error:
            raise await _invalid(scorer, body, error, call.request_id, limit) from error
        count = len(getattr(parsed, plural))
        if count > limit:
            raise _too_many(plural, limit)
        _check_one_key(call.header_key, parsed.idempotency_key, count)
        problems = _request_problems(scorer.spec, parsed)
        if problems:
            raise Refused(422, "invalid_request", problems, outcome="rejected", items=count)
        if not scorer.scoring_available():
            raise Refused.unavailable(items=count)
        call.parse_cpu = time.thread_time() - cpu_started
        return body


def _one_header(headers: Headers, name: str) -> str | None:
    """A header sent once, or repeated with one value; two values are a 400, not the first one's."""
    values = headers.getlist(name)
    if len(set(values)) > 1:
        raise Refused(400, "bad_header", f"{name} sent twice with different values")
    return values[0] if values else None


def _deadline_header(headers: Headers) -> float | None:
    """X-Deadline-Ms in ms, None when absent, or a 400 when it is not a positive number."""
    raw = _one_header(headers, DEADLINE_HEADER)
    if raw is None:
        return None
    deadline_ms = float(raw) if DEADLINE_NUMBER.fullmatch(raw) else math.nan
    if not math.isfinite(deadline_ms) or deadline_ms <= 0:
        raise Refused(400, "bad_header", f"{DEADLINE_HEADER} must be a positive number of ms")
    return deadline_ms


def _check_json_body(headers: Headers) -> None:
    """415 unless the body is declared JSON (or not declared) and uncompressed: a form or text type
    is what a browser may send cross-site unasked, and a compressed body would read as bad JSON."""
    media_type = (_one_header(headers, "content-type") or "").partition(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not _is_json_suffix(media_type):
        shown = media_type[:100]  # the client's own header, echoed only so far
        raise Refused(415, "unsupported_media_type", f"the body must be JSON (application/json), not {shown}")
    coding = (_one_header(headers, "content-encoding") or "").strip().lower()
    if coding not in ("", "identity"):
        raise Refused(
            415,
            "unsupported_content_encoding",
            f"the body must be sent uncompressed, not as {coding[:100]}",
            headers={"Accept-Encoding": "identity"},
        )


def _is_json_suffix(media_type: str) -> bool:
    """A structured syntax suffix (RFC 6839), e.g. application/vnd.acme+json."""
    return media_type.startswith("application/") and media_type.endswith("+json")


def _key_header(headers: Headers) -> str | None:
    """Idempotency-Key as the client wrote it: UTF-8 (HTTP hands header bytes over as latin-1) and
    without surrounding whitespace, as the body's `idempotency_key` is read, so a key is one key
    whichever way it is sent."""
    raw = _one_header(headers, IDEMPOTENCY_HEADER)
    if raw is None:
        return None
    try:
        key = raw.encode("latin-1").decode("utf-8").strip(WHITESPACE)
    except UnicodeDecodeError:
        raise Refused(400, "bad_header", f"{IDEMPOTENCY_HEADER} must be UTF-8 text") from None
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY:
        raise Refused(400, "bad_header", f"{IDEMPOTENCY_HEADER} must be 1-{MAX_IDEMPOTENCY_KEY} chars")
    return key


def _check_one_key(header: str | None, body: str | None, items: int) -> None:
    if header is not None and body is not None and header != body:
        raise Refused(
            400, "bad_request", f"{IDEMPOTENCY_HEADER} and idempotency_key differ", outcome="rejected", items=items
        )


def _too_many(plural: str, limit: int) -> Refused:
    return Refused(413, f"too_many_{plural}", f"at most {limit} {plural} per request")


def _request_problems(spec: LoadedSpec, parsed: ScoreRequestBase) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    # PostgreSQL text cannot hold NUL: a failed key claim would count against the breaker.
    if has_nul(parsed.idempotency_key):
        problems.append({"loc": ["idempotency_key"], "msg": "NUL characters are not allowed"})
    plural, id_name = spec.spec.plural, spec.id.name
    keys = [key.name for key in (spec.id, spec.entity) if key is not None]
    seen: set[str] = set()
    for index, record in enumerate(getattr(parsed, plural)):
        for name in keys:
            # PostgreSQL text cannot hold NUL: such an id would fail every write.
            if "\x00" in getattr(record, name):
                problems.append({"loc": [plural, index, name], "msg": "NUL characters are not allowed"})
        record_id = getattr(record, id_name)
        if record_id in seen:
            problems.append({"loc": [plural, index, id_name], "msg": f"duplicate {id_name} in request"})
        seen.add(record_id)
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
    plural = scorer.spec.spec.plural
    items = document.get(plural) if isinstance(document, dict) else None
    if not isinstance(items, list):
        return Refused(422, "invalid_request", errors)
    if len(items) > limit:
        return _too_many(plural, limit)
    details: dict[int, str] = {}
    for e in errors:
        loc = e["loc"]
        if len(loc) >= 2 and loc[0] == plural and isinstance(loc[1], int):
            name = ".".join(str(part) for part in loc[2:]) or scorer.spec.spec.record_name.lower()
            details.setdefault(loc[1], f"{name}: {e['msg']}")
    # NUL cannot be stored: such an item is answered 422 but not quarantined.
    details = {index: detail for index, detail in details.items() if not has_nul(items[index])}
    try:
        await asyncio.to_thread(scorer.writer.submit_invalid, items, details, request_id)
    except Exception:  # best effort: the client's 422 must not turn into a 500
        logger.exception("quarantining the invalid items of request %s failed", request_id)
    return Refused(422, "invalid_request", errors, outcome="rejected", items=len(items))
