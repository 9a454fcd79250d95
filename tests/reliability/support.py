"""Helpers for the reliability suite, free of pytest so child processes can import them too.

A child process inherits BENTOML_HOME, DAGSTER_HOME and TANDEM_DATA_DIR from the test session
(tests/conftest.py sets them before anything imports bentoml), so it sees the same model store.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import polars as pl
import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.orchestration.support import DEMO_SEED, SETTINGS, prediction_rows, predictions_config, rejection_rows
from tests.serving.support import DemoServer, serve_demo
from tests.shared import migrate_and_ingest

ROOT = Path(__file__).resolve().parents[2]
# A model name of this suite's own: no other package promoting "risk_model" can swap it.
MODEL_NAME = "risk_model_reliability"
# An outage's end is noticed within a second: the breakers' probe every 0.5 s, the outbox every 0.2 s.
FAST_RECOVERY = {"TANDEM_SERVING_BREAKER_RESET_S": "0.5", "TANDEM_SERVING_OUTBOX_DRAIN_INTERVAL_S": "0.2"}
HISTORY_LENGTH = SETTINGS.history_length
# Smallest chunk the asset allows, so a partition of a few thousand rows spans several chunks.
CHUNK_ROWS = 4096
RUN_CONFIG = predictions_config(chunk_rows=CHUNK_ROWS, parity_sample=8)


# ------------------------------------------------------------------ databases
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


PREDICTION_FACTS = ("record_id", "model_version", "score", "input_hash", "path")
REJECTION_FACTS = ("record_id", "path", "stage", "partition_key", "reason", "detail", "payload", "input_hash")


def prediction_facts(url: str, partition_key: str) -> list[dict[str, Any]]:
    return prediction_rows(url, partition_key, columns=PREDICTION_FACTS)


def rejection_facts(url: str, partition_key: str) -> list[dict[str, Any]]:
    return rejection_rows(url, partition_key, columns=REJECTION_FACTS)


# ------------------------------------------------------------------ the batch fault tests' partition
# One demo day on PostgreSQL, shared by test_batch_crash_and_race.py and test_batch_connection_and_poison.py.
DAY = date(2026, 11, 3)
KEY = DAY.isoformat()
ROWS = 9_000


def _source(rows: int = ROWS, poison_rate: float = 0.01) -> pl.DataFrame:
    return generate_day(DAY, DemoConfig(seed=DEMO_SEED, rows_per_day=rows, poison_rate=poison_rate))


def _ingest(url: str, frame: pl.DataFrame) -> None:
    migrate_and_ingest(url, frame, DAY)


def _count(url: str, sql_text: str, *params: Any) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql_text, params).fetchone()
    assert row is not None
    return int(row[0])


# ------------------------------------------------------------------ a live `bentoml serve`
@dataclass
class SuiteServer(DemoServer):
    """A server of this suite's model on a SecretDatabase."""

    metrics_must_exist = True
    db: SecretDatabase
    model_version: str
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


@contextmanager
def suite_server(
    admin_url: str,
    model_version: str,
    data_dir: Path,
    days: tuple[date, date],
    *,
    rows: int,
    accounts: int,
    env: Mapping[str, str] | None = None,
) -> Iterator[SuiteServer]:
    """`serve_demo` on a fresh SecretDatabase (dropped afterwards), pinned to `model_version`, `env`
    on top of this suite's settings."""
    settings = {
        "TANDEM_MODEL_NAME": MODEL_NAME,
        "TANDEM_SERVING_MODEL_TAG": model_version,
        "TANDEM_SERVING_BREAKER_RESET_S": "0.5",
        "TANDEM_SERVING_P99_TARGET_MS": "200",
        "TANDEM_SERVING_OUTBOX_DRAIN_INTERVAL_S": "0.2",
        **(env or {}),
    }
    db = create_secret_database(admin_url)
    try:
        with serve_demo(
            SuiteServer,
            db.url,
            data_dir,
            days,
            rows=rows,
            accounts=accounts,
            env=settings,
            db=db,
            model_version=model_version,
            token=settings.get("TANDEM_SERVING_AUTH_TOKEN"),
        ) as server:
            yield server
    finally:
        drop_secret_database(db)


# What the `start_suite_server` fixture hands out (tests/reliability/conftest.py).
StartSuiteServer = Callable[..., AbstractContextManager[SuiteServer]]


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
