"""Open-loop HTTP load: requests leave on a fixed schedule whatever the server does, and latency is
counted from the scheduled send time, so queueing in the client or server is never hidden.

Written here because no open-loop generator is installable on this machine (wrk and autocannon are
closed-loop: a slow server slows the load down and hides its own queue).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np


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
        }

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("latencies_ms")
        data.pop("shed_latencies_ms")
        return data


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
    latencies: list[float] = []
    shed: list[float] = []
    statuses: dict[str, int] = {}
    timeouts = 0
    collateral = 0
    no_retry_after = 0
    connection_errors = 0
    cpu_started = time.process_time()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:

        async def one(index: int, scheduled: float) -> None:
            nonlocal timeouts, collateral, no_retry_after, connection_errors
            body, is_poison = body_for(index)
            try:
                async with session.post(url, data=json.dumps(body), headers=headers) as response:
                    await response.read()
                    status = response.status
                    retry_after = "Retry-After" in response.headers
            except TimeoutError:
                timeouts += 1
                statuses["timeout"] = statuses.get("timeout", 0) + 1
                if not is_poison:  # a good request left without an answer failed too
                    collateral += 1
                return
            except aiohttp.ClientError:
                connection_errors += 1
                statuses["conn_error"] = statuses.get("conn_error", 0) + 1
                if not is_poison:
                    collateral += 1
                return
            elapsed_ms = (time.perf_counter() - scheduled) * 1000
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == 200 and not is_poison:
                latencies.append(elapsed_ms)
            elif status in (503, 429):
                shed.append(elapsed_ms)
                no_retry_after += not retry_after
            elif not is_poison:
                collateral += 1

        # Each request is created at its send time. Creating all of them up front (each sleeping
        # until its turn) made the event loop wake thousands of timers and measured the generator
        # itself from ~400 rps; a late send still counts from its scheduled time.
        in_flight: set[asyncio.Task[None]] = set()
        start = time.perf_counter() + 0.05 + start_delay_s
        for index in range(count):
            scheduled = start + index / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(index, scheduled))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)
    return LoadResult(
        rate,
        duration_s,
        count,
        latencies,
        statuses,
        shed,
        timeouts,
        collateral,
        no_retry_after,
        connection_errors,
        generator_cpu_s=time.process_time() - cpu_started,
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
        return asyncio.run(
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
        return asyncio.run(both())
