"""An open-loop load generator: requests start on a fixed schedule whether or not earlier ones
finished, so a slow server shows up as latency and errors instead of a politely lower rate."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class LoadResult:
    statuses: Counter[int] = field(default_factory=Counter)
    latencies_ms: dict[int, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    bodies: list[tuple[int, Any]] = field(default_factory=list)

    def percentile(self, q: float, status: int = 200) -> float:
        values = sorted(self.latencies_ms.get(status, []))
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def goodput(self, status: int = 200) -> float:
        return self.statuses[status] / self.seconds if self.seconds else 0.0


async def open_loop(
    url: str,
    *,
    rate: float,
    seconds: float,
    body: Callable[[int], dict[str, Any]],
    headers: Callable[[int], dict[str, str]] | None = None,
    keep_bodies: bool = False,
    timeout_s: float = 10.0,
) -> LoadResult:
    result = LoadResult()
    total = int(rate * seconds)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def one(index: int) -> None:
            started = time.perf_counter()
            try:
                response = await client.post(url, json=body(index), headers=headers(index) if headers else None)
                status = response.status_code
                payload = response.json() if keep_bodies else None
            except httpx.HTTPError:
                status, payload = -1, None
            result.statuses[status] += 1
            result.latencies_ms.setdefault(status, []).append((time.perf_counter() - started) * 1000)
            if keep_bodies:
                result.bodies.append((index, payload))

        begin = time.perf_counter()
        tasks = []
        for index in range(total):
            delay = begin + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index)))
        await asyncio.gather(*tasks)
        result.seconds = time.perf_counter() - begin
    return result
