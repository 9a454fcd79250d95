"""A database that accepts connections and never answers: a pooler whose server is gone (PgBouncer
queues a statement for two minutes), a frozen host, a silent network. Its server-side
statement_timeout cannot fire, so the service bounds each statement itself and probes the
database off the request path; requests are answered degraded meanwhile."""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.reliability.support import FAST_RECOVERY, MODEL_NAME
from tests.serving.support import LiveServer, demo_day, serve
from tests.shared import fresh_postgres_database, migrate_and_ingest, service_env

pytestmark = [pytest.mark.reliability, pytest.mark.live, pytest.mark.postgres]

HISTORY_DAY, REQUEST_DAY = date(2026, 11, 1), date(2026, 11, 2)


class SilenceableProxy:
    """A TCP proxy in front of PostgreSQL that can fall silent: while `silent`, it passes no byte
    either way and holds new connections without a word; the sockets stay open throughout."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.silent = False
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connected, "127.0.0.1", 0), self.loop
        ).result()
        self.port = int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)

    async def _connected(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        while self.silent:
            await asyncio.sleep(0.05)
        server_in, server_out = await asyncio.open_connection(*self.target)
        await asyncio.gather(self._pipe(client_in, server_out), self._pipe(server_in, client_out))

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                while self.silent:
                    await asyncio.sleep(0.05)
                sink.write(data)
                await sink.drain()
        except ConnectionError:
            pass
        finally:
            sink.close()


@pytest.fixture
def silent_database() -> Iterator[str]:
    """A PostgreSQL URL whose port accepts connections and never says a word."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    held: list[socket.socket] = []

    def hold() -> None:
        try:
            while True:
                held.append(listener.accept()[0])
        except OSError:  # the listener closed at the end
            pass

    threading.Thread(target=hold, daemon=True).start()
    try:
        yield f"postgresql+psycopg://tandem@127.0.0.1:{listener.getsockname()[1]}/silent"
    finally:
        listener.close()
        for connection in held:
            connection.close()


def _env(database_url: str, model_version: str, data_dir: Path) -> dict[str, str]:
    return (
        service_env(database_url=database_url, data_dir=data_dir, model_name=MODEL_NAME)
        | FAST_RECOVERY
        | {"TANDEM_SERVING_MODEL_TAG": model_version}
    )


def _open_loop(url: str, rows: list[dict[str, Any]], rate: float) -> list[tuple[float, int, bool | None]]:
    """(seconds after the start it was sent, status, degraded) of one request per row at `rate`."""

    async def run() -> list[tuple[float, int, bool | None]]:
        async with httpx.AsyncClient(timeout=15, limits=httpx.Limits(max_connections=500)) as client:

            async def one(row: dict[str, Any], at: float) -> tuple[float, int, bool | None]:
                await asyncio.sleep(max(start + at - time.monotonic(), 0.0))
                response = await client.post(f"{url}/score", json={"transactions": [row]})
                degraded = response.json()["results"][0]["degraded"] if response.status_code == 200 else None
                return at, response.status_code, degraded

            start = time.monotonic()
            return await asyncio.gather(*(one(row, i / rate) for i, row in enumerate(rows)))

    return asyncio.run(run())


def test_a_silent_database_at_start_costs_no_request_its_connect_timeout(
    reliability_model: str, silent_database: str, tmp_path: Path
) -> None:
    """Open loop at 20 requests a second for 8 s: each half-open probe of the breakers (every 0.5 s
    here) waits out the 2 s connect timeout. When a batch took the probe, each one held every
    request behind it for 2 s: 504s, then 503s while admission expected 2 s batches."""
    rate, seconds = 20, 8
    with serve(LiveServer, _env(silent_database, reliability_model, tmp_path), tmp_path / "serve.log") as server:
        outcomes = _open_loop(server.url, demo_day(REQUEST_DAY, rate * seconds, 20).to_dicts(), rate)
    assert collections.Counter((status, degraded) for _, status, degraded in outcomes) == {(200, True): rate * seconds}


def test_a_database_that_falls_silent_mid_run_degrades_answers_within_the_bound(
    postgres_admin_url: str, reliability_model: str, tmp_path: Path
) -> None:
    """20 requests a second for 14 s; the database silent from 3 s to 9 s. Before the statement
    bound, the read in flight waited on a socket TCP keeps for 15 minutes: the stuck-batch bound
    (9 s) stopped the scoring process, whose replacement hung the same way, and nothing was
    answered until the database spoke again."""
    rate, seconds, silent_from, silent_until = 20, 14, 3.0, 9.0
    with fresh_postgres_database(postgres_admin_url, prefix="tandem_silent") as url:
        history = demo_day(HISTORY_DAY, 400, 20)
        migrate_and_ingest(url, history, HISTORY_DAY)
        parsed = make_url(url)
        proxy = SilenceableProxy((parsed.host or "127.0.0.1", parsed.port or 5432))
        proxied = parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        try:
            with serve(LiveServer, _env(proxied, reliability_model, tmp_path), tmp_path / "serve.log") as server:
                timer = threading.Timer(silent_from, lambda: setattr(proxy, "silent", True))
                speaks = threading.Timer(silent_until, lambda: setattr(proxy, "silent", False))
                timer.start()
                speaks.start()
                outcomes = _open_loop(server.url, demo_day(REQUEST_DAY, rate * seconds, 20).to_dicts(), rate)
                log = server.log_text()
        finally:
            proxy.silent = False
            proxy.close()
    assert {status for _, status, _ in outcomes} <= {200, 503, 504}
    answered_silent = [at for at, status, degraded in outcomes if status == 200 and degraded and at < silent_until]
    # Within the statement bound (3 s) and a second's slack, answers resume, degraded.
    assert answered_silent and min(answered_silent) < silent_from + 4.5, sorted(answered_silent)[:5]
    late = [(status, degraded) for at, status, degraded in outcomes if silent_from + 4.5 <= at < silent_until]
    assert late.count((200, True)) >= 0.9 * len(late), collections.Counter(late)
    # The database speaks again: fresh answers (history read) within the breakers' probe interval.
    after = [(status, degraded) for at, status, degraded in outcomes if at >= silent_until + 2]
    assert after and all(outcome == (200, False) for outcome in after), collections.Counter(after)
    assert "stopping the stuck scoring process" not in log
