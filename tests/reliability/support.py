"""Helpers for the reliability suite, free of pytest so child processes can import them too.

A child process inherits BENTOML_HOME, DAGSTER_HOME and TANDEM_DATA_DIR from the test session
(tests/conftest.py sets them before anything imports bentoml), so it sees the same model store.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import psutil
import psycopg
import sqlalchemy as sa
import torch
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from sqlalchemy.engine import make_url

from inference.demo import DemoConfig, generate_day
from inference.model import ModelConfig, RiskModel, TrainingReport
from inference.records import RAW_COLUMNS
from inference.store import make_engine, predictions, rejected_records
from tandem import modelstore

ROOT = Path(__file__).resolve().parents[2]
# A model name of this suite's own: no other package promoting "risk_model" can swap it.
MODEL_NAME = "risk_model_reliability"
HISTORY_LENGTH = 16
PARTITIONS_START = "2026-11-01"


# ------------------------------------------------------------------ model and databases
def register_model() -> str:
    """An untrained, deterministic model, registered and promoted under MODEL_NAME."""
    torch.manual_seed(0)
    model = RiskModel(ModelConfig(history_length=HISTORY_LENGTH)).eval()
    report = TrainingReport(0.5, 0, 0, 0, model.parameter_count, model.flops_per_item())
    tag = modelstore.register(model, report, name=MODEL_NAME, code_version="test")
    modelstore.promote(tag)
    return tag


@dataclass(frozen=True)
class SecretDatabase:
    """A database owned by a role that logs in with a password (ignored by `trust` auth, but
    present in the URL, which is what the leak checks need)."""

    name: str
    role: str
    password: str
    url: str
    admin_url: str


def create_secret_database(admin_url: str) -> SecretDatabase:
    suffix = uuid.uuid4().hex[:10]
    name, role = f"tandem_rel_{suffix}", f"tandem_rel_role_{suffix}"
    password = f"Pw-{uuid.uuid4().hex}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        # Identifiers are generated above, never input; the password goes as a literal via quote.
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(password)))
        admin.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(role)))
    url = make_url(admin_url).set(username=role, password=password, database=name)
    return SecretDatabase(name, role, password, url.render_as_string(hide_password=False), admin_url)


def drop_secret_database(db: SecretDatabase) -> None:
    with psycopg.connect(db.admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db.name)))
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(db.role)))


def set_connections_allowed(admin_url: str, database: str, allowed: bool) -> None:
    """The outage switch: refuse new connections and cut the existing ones (or allow again)."""
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
                sql.Identifier(database), sql.SQL("true" if allowed else "false")
            )
        )
        if not allowed:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))


def backends(admin_url: str, database: str) -> list[dict[str, Any]]:
    """pg_stat_activity rows of client backends connected to `database`."""
    with psycopg.connect(admin_url, autocommit=True) as admin:
        cursor = admin.execute(
            "SELECT pid, state, query, xact_start FROM pg_stat_activity "
            "WHERE datname = %s AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
            (database,),
        )
        names = [column.name for column in cursor.description or []]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def database_name(url: str) -> str:
    return str(make_url(url).database)


def partition_rows(url: str, table: sa.Table, partition_key: str, columns: tuple[str, ...]) -> list[dict[str, Any]]:
    keys = ("transaction_id", "model_version") if table is predictions else ("rejection_key",)
    stmt = (
        sa.select(*(table.c[name] for name in columns))
        .where(table.c.partition_key == partition_key)
        .order_by(*(table.c[k] for k in keys))
    )
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(stmt)]
    finally:
        engine.dispose()


PREDICTION_FACTS = ("transaction_id", "model_version", "score", "input_hash", "path")
REJECTION_FACTS = ("transaction_id", "path", "stage", "partition_key", "reason", "detail", "payload", "input_hash")


def prediction_facts(url: str, partition_key: str) -> list[dict[str, Any]]:
    return partition_rows(url, predictions, partition_key, PREDICTION_FACTS)


def rejection_facts(url: str, partition_key: str) -> list[dict[str, Any]]:
    return partition_rows(url, rejected_records, partition_key, REJECTION_FACTS)


# ------------------------------------------------------------------ a live `bentoml serve`
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    db: SecretDatabase
    model_version: str
    requests: pl.DataFrame  # unstored records of the stored accounts, all valid, RAW columns
    token: str | None = None
    _next: int = field(default=0)

    def take(self, count: int) -> list[dict[str, Any]]:
        """Fresh request records, never handed out twice in one server's life."""
        rows = self.requests.slice(self._next, count).to_dicts()
        if len(rows) < count:
            raise RuntimeError("out of request records; raise REQUEST_ROWS")
        self._next += count
        return rows

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def score(self, rows: list[dict[str, Any]], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.url}/score", json={"transactions": rows}, headers={**self.auth(), **(headers or {})}, timeout=10
        )

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels`; a name the
        service does not export is an error, not 0 (a typo must not pass a check vacuously)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
        if not any(sample.name == name for sample in samples):
            raise KeyError(f"the service exports no metric {name!r}")
        return sum(
            sample.value for sample in samples if sample.name == name and labels.items() <= sample.labels.items()
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]

    def scoring_processes(self) -> list[psutil.Process]:
        """The scoring process(es) of serving/worker.py, whatever multiprocessing start method the
        pool uses: a `spawn_main` child (spawn), a child of the fork server (forkserver), or a
        forked copy of the server's worker (fork). Helpers (resource tracker, the fork server
        itself) are not scoring processes."""
        tree = self.tree()
        command = {}
        for process in tree:
            with contextlib.suppress(psutil.Error):
                command[process.pid] = " ".join(process.cmdline())
        found = []
        for process in tree[1:]:
            with contextlib.suppress(psutil.Error):
                mine, parents = command.get(process.pid, ""), command.get(process.ppid(), "")
                if "resource_tracker" in mine:
                    continue
                spawned = "spawn_main" in mine
                from_fork_server = "multiprocessing.forkserver" in parents
                forked = mine == parents and process.ppid() != tree[0].pid
                if spawned or from_fork_server or forked:
                    found.append(process)
        return found

    def listening_addresses(self) -> set[str]:
        addresses = set()
        for process in self.tree():
            with contextlib.suppress(psutil.Error):
                for conn in process.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        addresses.add(conn.laddr.ip)
        return addresses


def start_server(
    db: SecretDatabase, model_version: str, requests: pl.DataFrame, data_dir: Path, env: dict[str, str]
) -> LiveServer:
    """`bentoml serve serving.service:RiskScorer` as test_live starts it (no --host: the service's
    own default bind address is part of what is checked)."""
    port = free_port()
    full_env = {
        **os.environ,
        "DATABASE_URL": db.url,
        "TANDEM_DATA_DIR": str(data_dir),
        "TANDEM_MODEL_NAME": MODEL_NAME,
        "TANDEM_SERVING_MODEL_TAG": model_version,
        "TANDEM_SERVING_BREAKER_RESET_S": "0.5",
        "TANDEM_SERVING_P99_TARGET_MS": "200",
        "TANDEM_SERVING_OUTBOX_DRAIN_INTERVAL_S": "0.2",
        **env,
    }
    log_path = data_dir / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "bentoml", "serve", "serving.service:RiskScorer", "--port", str(port)],
            cwd=ROOT,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = LiveServer(
        f"http://127.0.0.1:{port}",
        port,
        process,
        log_path,
        db,
        model_version,
        requests,
        env.get("TANDEM_SERVING_AUTH_TOKEN"),
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {server.log_text()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/readyz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"server never became ready: {server.log_text()[-3000:]}")


def stop_server(server: LiveServer) -> None:
    """SIGTERM the whole process group (server, its worker, the scoring process); SIGKILL stragglers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=10)


# ------------------------------------------------------------------ raw HTTP, for bodies httpx won't send
def raw_exchange(port: int, head: bytes, chunks: Iterator[bytes], timeout: float = 10) -> tuple[int, bytes, int]:
    """Send `head` then `chunks` until the server answers; returns (status, raw response, bytes sent).

    The server may answer (and close) before the body is complete, which is the point: the
    answer is read as soon as it is there, and a reset on send is not an error.
    """
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        answered = False
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                answered = True
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                answered = True
                break
            sent += len(chunk)
        if not answered:
            select.select([sock], [], [], timeout)
        response = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while b"\r\n\r\n" not in response or not _complete(response):
                data = sock.recv(65536)
                if not data:
                    break
                response += data
    status = int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/") else 0
    return status, response, sent


def _complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def response_json(response: bytes) -> Any:
    return json.loads(response.partition(b"\r\n\r\n")[2])


def history_day_frame(day: date, rows: int, accounts: int) -> pl.DataFrame:
    return generate_day(day, DemoConfig(rows_per_day=rows, poison_rate=0.0, accounts=accounts)).select(RAW_COLUMNS)
