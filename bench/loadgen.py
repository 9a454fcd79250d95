"""Open-loop HTTP load: requests leave on a fixed schedule whatever the server does, and latency is
counted from the scheduled send time, so queueing in the client or server is never hidden.

Written here because no open-loop generator is installable on this machine (wrk and autocannon are
closed-loop: a slow server slows the load down and hides its own queue). It writes HTTP/1.1 itself on
uvloop, and reads the answers with httptools (uvicorn's parser, in C): the generator shares the two
cores with the service it measures, and aiohttp's client cost 0.2-0.39 ms of a core per request
(0.70-0.76 of a core at 3,000 rps), against 0.06-0.2 ms for this one (bench/findings.md). Like a
client with an unbounded pool, it sends one request at a time per keep-alive connection and opens
another connection whenever none is idle.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import httptools
import numpy as np
import uvloop

# The first half second of a level, reported apart: each load level starts from a settled service,
# so this is the step into it, where the queue fills before admission's estimate has caught up.
ONSET_S = 0.5


def _percentile(values: list[float], q: float) -> float:
    # NaN when nothing was measured (no request shed, say), without numpy's all-NaN warning.
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class LoadResult:
    offered_rps: float
    duration_s: float
    sent: int
    latencies_ms: list[float] = field(repr=False)
    statuses: dict[str, int]
    shed_latencies_ms: list[float] = field(repr=False)
    client_timeouts: int
    collateral_failures: int = 0  # good requests that failed (only counted when poison is mixed in)
    shed_without_retry_after: int = 0  # 503/429 answers that carried no Retry-After header
    connection_errors: int = 0
    # The generator process's CPU over the run (all it ran meantime): on a shared machine it comes out
    # of the service's cores, a share the do-nothing ceiling cannot show (beside it the generator has a
    # core to itself).
    generator_cpu_s: float = 0.0
    # When each answered request was due, in seconds from the level's start, in the order of
    # latencies_ms and shed_latencies_ms: what splits the onset from the rest of the level.
    latency_sent_s: list[float] = field(default_factory=list, repr=False)
    shed_sent_s: list[float] = field(default_factory=list, repr=False)

    def summary(self, target_ms: float) -> dict[str, Any]:
        within = int(np.sum(np.array(self.latencies_ms) <= target_ms)) if self.latencies_ms else 0
        return {
            "offered_rps": self.offered_rps,
            "sent": self.sent,
            "ok": len(self.latencies_ms),
            "statuses": self.statuses,
            "p50_ms": _percentile(self.latencies_ms, 50),
            "p99_ms": _percentile(self.latencies_ms, 99),
            "p999_ms": _percentile(self.latencies_ms, 99.9),
            "goodput_rps": within / self.duration_s,
            "shed": sum(v for k, v in self.statuses.items() if k in ("503", "429")),
            "shed_p99_ms": _percentile(self.shed_latencies_ms, 99),
            "shed_without_retry_after": self.shed_without_retry_after,
            "client_timeouts": self.client_timeouts,
            "connection_errors": self.connection_errors,
            "collateral_failures": self.collateral_failures,
            "generator_cores": self.generator_cpu_s / self.duration_s,
            **_onset_split("", self.latencies_ms, self.latency_sent_s),
            **_onset_split("shed_", self.shed_latencies_ms, self.shed_sent_s),
        }

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("latencies_ms")
        data.pop("shed_latencies_ms")
        data.pop("latency_sent_s")
        data.pop("shed_sent_s")
        return data


def _onset_split(prefix: str, latencies_ms: list[float], sent_s: list[float]) -> dict[str, float]:
    """p99 of the answers to requests due in the level's first ONSET_S, and of the rest."""
    onset = [latency for latency, sent in zip(latencies_ms, sent_s, strict=True) if sent < ONSET_S]
    after = [latency for latency, sent in zip(latencies_ms, sent_s, strict=True) if sent >= ONSET_S]
    return {f"{prefix}onset_p99_ms": _percentile(onset, 99), f"{prefix}after_onset_p99_ms": _percentile(after, 99)}


class _Request:
    """One request in flight: what it needs to be counted when its answer (or its failure) comes."""

    __slots__ = ("is_poison", "scheduled", "timer")

    def __init__(self, scheduled: float, is_poison: bool) -> None:
        self.scheduled = scheduled
        self.is_poison = is_poison
        self.timer: asyncio.TimerHandle | None = None


class _Tally:
    """What a load level saw, counted as the answers come."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.shed: list[float] = []
        self.started = 0.0  # when the level's first request was due (perf_counter)
        self.latency_sent: list[float] = []
        self.shed_sent: list[float] = []
        self.statuses: dict[str, int] = {}
        self.timeouts = 0
        self.collateral = 0
        self.no_retry_after = 0
        self.connection_errors = 0
        self.outstanding = 0
        self.all_sent = False
        self.finished = asyncio.Event()

    def _status(self, key: str) -> None:
        self.statuses[key] = self.statuses.get(key, 0) + 1

    def _settled(self, request: _Request) -> None:
        if request.timer is not None:
            request.timer.cancel()
        self.outstanding -= 1
        if self.all_sent and self.outstanding == 0:
            self.finished.set()

    def answered(self, request: _Request, status: int, retry_after: bool) -> None:
        elapsed_ms = (time.perf_counter() - request.scheduled) * 1000
        self._status(str(status))
        if status == 200 and not request.is_poison:
            self.latencies.append(elapsed_ms)
            self.latency_sent.append(request.scheduled - self.started)
        elif status in (503, 429):
            self.shed.append(elapsed_ms)
            self.shed_sent.append(request.scheduled - self.started)
            self.no_retry_after += not retry_after
        elif not request.is_poison:
            self.collateral += 1
        self._settled(request)

    def failed(self, request: _Request, *, timed_out: bool) -> None:
        if timed_out:
            self.timeouts += 1
            self._status("timeout")
        else:
            self.connection_errors += 1
            self._status("conn_error")
        if not request.is_poison:  # a good request left without an answer failed too
            self.collateral += 1
        self._settled(request)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time; httptools (uvicorn's parser, in
    C) reads the answers."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.request: _Request | None = None
        self.retry_after = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: _Request, data: bytes) -> None:
        assert self.transport is not None
        self.request, self.retry_after = request, False
        request.timer = self.client.loop.call_later(self.client.timeout_s, self.expire, request)
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"retry-after":
            self.retry_after = True

    def on_message_complete(self) -> None:
        request, self.request = self.request, None
        if request is None:  # an answer nobody asked for (or one that came after its timeout)
            self.close()
            return
        self.client.tally.answered(request, self.parser.get_status_code(), self.retry_after)
        if self.parser.should_keep_alive() and not self.closed:
            self.client.idle.append(self)
        else:
            self.close()

    def expire(self, request: _Request) -> None:
        if self.request is request:
            self.request = None
            request.timer = None
            self.client.tally.failed(request, timed_out=True)
            self.close()  # its answer may still come: the connection cannot carry another request

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        request, self.request = self.request, None
        if request is not None:
            self.client.tally.failed(request, timed_out=False)


class _Client:
    """Keep-alive connections without a bound, as a client with an unlimited pool behaves: a request
    takes an idle connection, or opens one when none is idle."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float, tally: _Tally) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.head = (
            f"POST {parsed.path or '/'} HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        ).encode()
        self.timeout_s = timeout_s
        self.tally = tally
        self.loop = asyncio.get_running_loop()
        self.idle: list[_Connection] = []
        self.connecting: set[asyncio.Task[None]] = set()
        self.connections: list[_Connection] = []

    def send(self, request: _Request, body: bytes) -> None:
        data = self.head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        self.tally.outstanding += 1
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                connection.send(request, data)
                return
        task = self.loop.create_task(self._open_and_send(request, data))
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)

    async def _open_and_send(self, request: _Request, data: bytes) -> None:
        try:
            _, connection = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self), self.host, self.port), self.timeout_s
            )
        except TimeoutError:
            self.tally.failed(request, timed_out=True)
            return
        except OSError:
            self.tally.failed(request, timed_out=False)
            return
        self.connections.append(connection)
        connection.send(request, data)

    def close(self) -> None:
        for connection in self.connections:
            connection.close()


async def _run(
    url: str,
    rate: float,
    duration_s: float,
    body_for: Callable[[int], tuple[dict[str, Any], bool]],
    headers: dict[str, str],
    timeout_s: float,
    start_delay_s: float = 0.0,
) -> LoadResult:
    count = round(rate * duration_s)
    cpu_started = time.process_time()
    tally = _Tally()
    client = _Client(url, headers, timeout_s, tally)
    # Each request is made at its send time: its body is built and written then. Creating all of
    # them up front (each sleeping until its turn) made the event loop wake thousands of timers and
    # measured the generator itself from ~400 rps; a late send still counts from its scheduled time.
    start = time.perf_counter() + 0.05 + start_delay_s
    tally.started = start
    for index in range(count):
        scheduled = start + index / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body, is_poison = body_for(index)
        client.send(_Request(scheduled, is_poison), json.dumps(body).encode())
    tally.all_sent = True
    if tally.outstanding:
        await tally.finished.wait()
    client.close()
    return LoadResult(
        rate,
        duration_s,
        count,
        tally.latencies,
        tally.statuses,
        tally.shed,
        tally.timeouts,
        tally.collateral,
        tally.no_retry_after,
        tally.connection_errors,
        generator_cpu_s=time.process_time() - cpu_started,
        latency_sent_s=tally.latency_sent,
        shed_sent_s=tally.shed_sent,
    )


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Run a timed client without collecting what its process held before it: its imports
    (torch, polars, BentoML), the request bodies and earlier levels' results. Unfrozen, full
    collections of that heap paused the generator for 25-114 ms here at 1,200 rps against Tandem,
    and every request in flight was charged the pause. The do-nothing ceiling never shows it: its
    requests finish before they survive a collection, so the full collections that hit the
    generator come only with a slow service's requests in flight. The live tests' clients run
    under it too: late in a full test run, a collection of the suite's imports took 350 ms."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def best_goodput(sweep: list[dict[str, Any]], target_ms: float) -> float:
    """The best goodput among the load levels of a sweep whose p99 met the target (0 when none did)."""
    return max((s["goodput_rps"] for s in sweep if s["p99_ms"] <= target_ms), default=0.0)


def run_load(
    url: str,
    rate: float,
    duration_s: float,
    body_for: Callable[[int], tuple[dict[str, Any], bool]],
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
) -> LoadResult:
    """Send `rate * duration_s` POSTs on a fixed schedule; `body_for(i)` -> (json body, is_poison)."""
    with heap_frozen():
        return uvloop.run(
            _run(url, rate, duration_s, body_for, {"Content-Type": "application/json", **(headers or {})}, timeout_s)
        )


def run_burst_under_load(
    url: str,
    background_rps: float,
    background_s: float,
    burst: int,
    body_for: Callable[[int], tuple[dict[str, Any], bool]],
    *,
    timeout_s: float = 10.0,
) -> tuple[LoadResult, LoadResult]:
    """`burst` requests leaving within one millisecond, halfway through `background_s` of open-loop
    background load at `background_rps`, from one event loop. Returns (background, burst)."""
    headers = {"Content-Type": "application/json"}

    async def both() -> tuple[LoadResult, LoadResult]:
        background = asyncio.create_task(_run(url, background_rps, background_s, body_for, headers, timeout_s))
        spike = await _run(url, burst * 1000, 0.001, body_for, headers, timeout_s, start_delay_s=background_s / 2)
        return await background, spike

    with heap_frozen():
        return uvloop.run(both())
