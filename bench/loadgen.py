"""Open-loop HTTP load: requests leave on a fixed schedule whatever the server does, and latency is
counted from the scheduled send time, so queueing in the client or server is never hidden.

Written here because no open-loop generator is installable on this machine (wrk and autocannon are
closed-loop: a slow server slows the load down and hides its own queue).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
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
            "client_timeouts": self.client_timeouts,
            "collateral_failures": self.collateral_failures,
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
) -> LoadResult:
    count = int(rate * duration_s)
    latencies: list[float] = []
    shed: list[float] = []
    statuses: dict[str, int] = {}
    timeouts = 0
    collateral = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
        start = time.perf_counter() + 0.05

        async def one(index: int) -> None:
            nonlocal timeouts, collateral
            scheduled = start + index / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body, is_poison = body_for(index)
            try:
                async with session.post(url, data=json.dumps(body), headers=headers) as response:
                    await response.read()
                    status = response.status
            except TimeoutError:
                timeouts += 1
                statuses["timeout"] = statuses.get("timeout", 0) + 1
                if not is_poison:  # a good request left without an answer failed too
                    collateral += 1
                return
            except aiohttp.ClientError:
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
            elif not is_poison:
                collateral += 1

        await asyncio.gather(*(one(i) for i in range(count)))
    return LoadResult(rate, duration_s, count, latencies, statuses, shed, timeouts, collateral)


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
    return asyncio.run(
        _run(url, rate, duration_s, body_for, {"Content-Type": "application/json", **(headers or {})}, timeout_s)
    )
