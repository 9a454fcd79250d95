"""A Tandem deployment as an operator runs it: `dagster-webserver` and `dagster-daemon` processes on a
PostgreSQL-backed Dagster instance, driven through the GraphQL API the UI uses.

Free of pytest so the pieces read as what they are: databases, processes, an HTTP client.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, suppress
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.shared import fresh_postgres_database

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ARTIFACTS = REPO / "test-artifacts"
# Screenshots are kept under each test's tmp dir; with TANDEM_E2E_ARTIFACTS set they are also copied
# here (TANDEM_E2E_ARTIFACTS=1), or into the directory it names, for a CI job to upload.
SCREENSHOTS = REPO / "tests" / "e2e" / "artifacts"

# Sized for two cores: sensors tick every 5 s (the minimum SensorSettings allows), and a demo day of
# 1000 rows keeps a run's work small next to its fixed cost while 1% poison still yields every kind.
SENSOR_INTERVAL_SECONDS = 5
DEMO_ROWS_PER_DAY = 1000
DEMO_POISON_RATE = 0.01

# A promotion rescores the scored days of the last N (TANDEM_SENSOR_PROMOTION_RESCORE_PARTITIONS).
# The deployment sets N so that the window starts here on the day it starts, whatever day that is:
# the week's first days stay stale after a promotion (outside the window), the others are rescored.
RESCORE_FROM = date(2026, 11, 4)
RESCORE_WINDOW_ENV = "TANDEM_SENSOR_PROMOTION_RESCORE_PARTITIONS"

T = TypeVar("T")


def rescore_window_days(today: date | None = None) -> int:
    """N such that the last N daily partitions (up to yesterday) start at RESCORE_FROM."""
    return ((today or datetime.now(UTC).date()) - RESCORE_FROM).days


def keep_screenshot(path: Path) -> Path | None:
    """Copies a screenshot to SCREENSHOTS (or $TANDEM_E2E_ARTIFACTS) when TANDEM_E2E_ARTIFACTS is set."""
    wanted = os.environ.get("TANDEM_E2E_ARTIFACTS", "")
    if wanted in ("", "0"):
        return None
    target_dir = SCREENSHOTS if wanted == "1" else Path(wanted)
    target_dir.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(path, target_dir / path.name))


class WebhookReceiver:
    """An alert webhook on 127.0.0.1 (a free port, a thread) that records each JSON body it is sent
    and answers `status`."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.received: list[dict[str, Any]] = []
        self.content_types: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.content_types.append(self.headers.get("Content-Type", ""))
                receiver.received.append(json.loads(body))
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return  # the test reads what was received, not an access log

        self._server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks/dagster"
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def fresh_database(admin_url: str, prefix: str) -> AbstractContextManager[str]:
    """An empty database of its own, dropped (forcibly, whoever is still connected) afterwards."""
    return fresh_postgres_database(admin_url, prefix)


@dataclass
class Service:
    """One server process, leader of its own process group: the code servers and run workers it
    starts stay in that group, so stopping the group stops everything it started."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-chars:]

    def stop(self, grace_seconds: float = 20) -> None:
        # SIGTERM first (the daemon and uvicorn shut down cleanly), then SIGKILL whatever of the
        # group is left: the leader may be gone while a run worker it spawned is not.
        self._signal_group(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_seconds)
        self._signal_group(signal.SIGKILL)
        self.process.wait(timeout=10)

    def _signal_group(self, signum: signal.Signals) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)


class GraphQLError(AssertionError):
    pass


@dataclass
class Deployment:
    url: str
    env: Mapping[str, str]
    log_dir: Path
    database_url: str
    production_tag: str
    services: list[Service] = field(default_factory=list)
    _client: httpx.Client | None = None

    @property
    def rescore_window_days(self) -> int:
        """N, the promotion's rescore window, as the code location read it when it loaded."""
        return int(self.env[RESCORE_WINDOW_ENV])

    # ------------------------------------------------------------------ processes
    def start(self, name: str, argv: list[str]) -> Service:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
                cwd=REPO,
                env=dict(self.env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        service = Service(name, process, log_path)
        self.services.append(service)
        return service

    def stop(self) -> None:
        # Every service is stopped even if stopping another one fails; the last started goes first
        # (the daemon before the webserver, so nothing launches runs while the rest shut down).
        with ExitStack() as stack:
            if self._client is not None:
                stack.callback(self._client.close)
            for service in self.services:
                stack.callback(service.stop)

    def service(self, name: str) -> Service:
        return next(service for service in self.services if service.name == name)

    def diagnostics(self) -> str:
        parts = []
        for service in self.services:
            state = "running" if service.alive() else f"exited {service.process.returncode}"
            parts.append(f"--- {service.name} ({state}), {service.log_path}:\n{service.tail()}")
        return "\n".join(parts)

    def check_alive(self) -> None:
        for service in self.services:
            if not service.alive():
                raise AssertionError(f"{service.name} exited with {service.process.returncode}\n{self.diagnostics()}")

    def wait_until(self, what: str, probe: Callable[[], T | None], *, timeout: float, interval: float = 2.0) -> T:
        """Poll `probe` until it returns something other than None; fail early if a server died."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                found = probe()
            except (httpx.HTTPError, GraphQLError) as error:
                found, last_error = None, error
            if found is not None:
                return found
            time.sleep(interval)
        raise AssertionError(
            f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error})\n{self.diagnostics()}"
        )

    # ------------------------------------------------------------------ the API the UI uses
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.url, timeout=60)
        return self._client

    def graphql(self, document: str, **variables: Any) -> dict[str, Any]:
        response = self.client.post("/graphql", json={"query": document, "variables": variables})
        if response.status_code != 200:
            raise GraphQLError(f"HTTP {response.status_code}: {response.text[:2000]}")
        body = response.json()
        if body.get("errors"):
            raise GraphQLError(f"GraphQL errors: {body['errors']}")
        return dict(body["data"])
