"""`python -m serving.front`: a real `bentoml serve` behind a real HAProxy, over HTTP, on a fresh
PostgreSQL database; the service publishes its concurrency limit to HAProxy's runtime API."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import httpx
import pytest
import torch

from inference.model import ModelConfig, RiskModel
from tests.serving.support import REPO, DemoServer, StartDemoServer
from tests.shared import register_model, until

pytestmark = [pytest.mark.live, pytest.mark.postgres]

HISTORY_DAY = date(2026, 11, 1)
REQUEST_DAY = date(2026, 11, 2)
LIMIT = 3  # the service's concurrency limit, and so HAProxy's maxconn
SERVER = "tandem/score"

needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None and not os.environ.get("TANDEM_RUN_E2E"),
    reason="HAProxy is not installed (.ci/run installs it)",
)


@dataclass
class FrontedServer(DemoServer):
    runtime_socket: Path

    def runtime(self, command: str) -> str:
        """One command to HAProxy's runtime API."""
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(self.runtime_socket))
            conn.sendall(command.encode() + b"\n")
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        return answer.decode()

    def proxy_maxconn(self) -> int:
        """The session limit (`slim`) of the server line in HAProxy's `show stat`."""
        header, *rows = self.runtime("show stat").splitlines()
        columns = header.removeprefix("# ").split(",")
        for row in rows:
            values = dict(zip(columns, row.split(","), strict=False))
            if f"{values.get('pxname')}/{values.get('svname')}" == SERVER:
                return int(values["slim"])
        raise AssertionError(f"no {SERVER} in show stat")


@pytest.fixture(scope="module")
def fronted(start_demo_server: StartDemoServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontedServer]:
    runtime_socket = tmp_path_factory.mktemp("haproxy") / "runtime.sock"
    torch.manual_seed(0)
    register_model(RiskModel(ModelConfig()).eval(), "risk_model")
    env = {
        "TANDEM_SERVING_P99_TARGET_MS": "200",  # two shared cores, as tests/serving/test_live.py
        "TANDEM_SERVING_MAX_CONCURRENCY": str(LIMIT),
        "TANDEM_SERVING_MIN_CONCURRENCY": str(LIMIT),
    }
    with start_demo_server(
        FrontedServer,
        "front",
        (HISTORY_DAY, REQUEST_DAY),
        rows=600,
        accounts=60,
        env=env,
        launcher=("-m", "serving.front", "--runtime-socket", str(runtime_socket)),
        runtime_socket=runtime_socket,
    ) as live:
        yield live


@needs_haproxy
def test_requests_through_the_proxy_are_scored(fronted: FrontedServer) -> None:
    rows = fronted.requests.slice(0, 2).to_dicts()
    answer = fronted.score(rows)
    assert answer.status_code == 200, answer.text
    assert [item["status"] for item in answer.json()["results"]] == ["scored", "scored"]
    assert httpx.get(f"{fronted.url}/metrics", timeout=10).status_code == 200


@needs_haproxy
def test_the_service_publishes_its_limit_and_restores_it(fronted: FrontedServer) -> None:
    until(lambda: fronted.proxy_maxconn() == LIMIT, timeout_s=10)
    # As if HAProxy had restarted with another value: the service's own comes back within seconds.
    assert fronted.runtime(f"set maxconn server {SERVER} 77").strip() == ""
    assert fronted.proxy_maxconn() == 77
    until(lambda: fronted.proxy_maxconn() == LIMIT, timeout_s=15)


@needs_haproxy
def test_over_the_limit_the_proxy_refuses_with_retry_after(fronted: FrontedServer) -> None:
    rows = fronted.requests.slice(100, 60).to_dicts()

    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(rows))
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            return await asyncio.gather(
                *(client.post(f"{fronted.url}/score", json={"transactions": [row]}) for row in rows)
            )

    answers = asyncio.run(flood())
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 503}, statuses
    refused = [answer for answer in answers if answer.status_code == 503]
    by_proxy = [answer for answer in refused if answer.json()["detail"]["reason"] == "proxy"]
    assert by_proxy, [answer.json() for answer in refused]
    assert all(answer.headers.get("retry-after") == "1" for answer in by_proxy)
    assert all(answer.json()["error"] == "overloaded" for answer in refused)
    scored = [answer.json()["results"][0]["status"] for answer in answers if answer.status_code == 200]
    assert scored and set(scored) == {"scored"}


def _front(*arguments: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "serving.front", *arguments],
        cwd=REPO,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_bad_port_is_one_line() -> None:
    result = _front("--port", "70000")
    assert result.returncode == 2
    assert "--port must be a port number" in result.stderr and "Traceback" not in result.stderr


@needs_haproxy
def test_bad_settings_are_one_line() -> None:
    result = _front(TANDEM_SERVING_MAX_CONCURRENCY="many")
    assert result.returncode == 2
    assert "max_concurrency" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_without_haproxy_it_says_so_in_one_line(tmp_path: Path) -> None:
    result = _front(PATH=str(tmp_path))
    assert result.returncode == 2
    assert "haproxy is not installed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
