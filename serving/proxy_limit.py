"""The adaptive concurrency limit, published to HAProxy in front of this server as its maxconn, so
that past capacity the proxy refuses what the limit would refuse, in C, before a refused request
costs this server's event loop anything.

A refusal made here still costs the event loop a request's socket I/O (about 0.12 ms, most of it
uvloop and the kernel, bench/findings.md): at 4x capacity, three refusals per admitted request take
the share of the one core the loop can use that the admitted requests needed. HAProxy counts a
request from when it forwards it, so its count also holds what waits in this server's socket
backlog, which no counter in Python sees. Requests over the limit wait in HAProxy's queue for at
most `timeout queue`, then get its 503 with Retry-After (deploy/haproxy/haproxy.cfg).

Written by hand: HAProxy's runtime API is one text line over a Unix socket, and no maintained Python
client of it publishes a changing value with the coalescing and the failure handling below.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from serving.background import BackgroundTask

logger = logging.getLogger(__name__)

# HAProxy forgets a runtime maxconn when it restarts (back to the config's value): the value is
# sent again at this age even when it has not changed.
_RESEND_S = 5.0


class ProxyLimitPublisher:
    """Sends `set maxconn server <server> <n>` to HAProxy's runtime API whenever the limit's whole
    part changes, at most once per `interval_s`; `scale` multiplies it (one server line stands for
    all the workers behind one listening socket, each running its own limit)."""

    def __init__(
        self,
        socket_path: str,
        server: str,
        limit: Callable[[], float],
        *,
        scale: int = 1,
        interval_s: float = 0.05,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self.server = server
        self.limit = limit
        self.scale = scale
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.published: int | None = None  # what HAProxy last acknowledged
        self.failures = 0  # in a row
        self._published_at = 0.0
        self._nudged = asyncio.Event()
        self._task = BackgroundTask("tandem-proxy-limit")

    def start(self) -> None:
        self._task.start(self._run)

    async def stop(self) -> None:
        await self._task.stop()

    def wanted(self) -> int:
        return max(1, int(self.limit()) * self.scale)

    def nudge(self) -> None:
        """Publish now, not at the next interval: the limit was cut, and until HAProxy holds the cut
        every request past it is refused by this server's event loop, at 4x capacity thousands a
        second (bench/findings.md, seventeenth session)."""
        self._nudged.set()

    async def _run(self) -> None:
        while True:
            await self.publish_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), self.interval_s)
            self._nudged.clear()

    async def publish_once(self) -> bool:
        """Send the limit if it changed (or went unconfirmed for a while); True when HAProxy holds it now."""
        value = self.wanted()
        if value == self.published and self.clock() - self._published_at < _RESEND_S:
            return True
        try:
            answer = await asyncio.wait_for(self._send(f"set maxconn server {self.server} {value}"), self.timeout_s)
        except (OSError, TimeoutError) as error:
            answer = f"{type(error).__name__}: {error}"
        if answer:
            # A refusal (an unknown server, a socket without admin level) or no HAProxy at all:
            # admission here still holds the limit, at the event loop's cost. Said once per streak.
            if self.failures == 0:
                logger.warning("could not set the proxy's maxconn to %d at %s: %s", value, self.socket_path, answer)
            self.failures += 1
            self.published = None
            return False
        if self.failures:
            logger.info("the proxy's maxconn is published again (%d after %d failures)", value, self.failures)
        self.failures = 0
        self.published = value
        self._published_at = self.clock()
        return True

    async def _send(self, command: str) -> str:
        """One command per connection, HAProxy's non-interactive mode: it answers, then closes.
        An empty answer is success; anything else is HAProxy's error message."""
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        try:
            writer.write(command.encode("ascii") + b"\n")
            await writer.drain()
            return (await reader.read()).decode("utf-8", "replace").strip()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
