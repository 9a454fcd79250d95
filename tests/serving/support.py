"""What the serving tests share: a real `bentoml serve` (its mechanics only: port, start, readiness,
stop, log, process tree), the demo database it scores against, and the transactions and result
rows the in-process tests feed the scorer.

Free of pytest, so the reliability suite's child processes can import it too. What a server is
started with (environment, model, database) stays in each test module.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx
import polars as pl
import psutil
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from inference.spec import LoadedSpec
from inference.store import utc_now
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.runtime import OnlineScorer
from serving.schemas import api_models
from serving.scoring import BatchResult, ItemSpec
from serving.settings import ServingSettings
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.reference import RAW_COLUMNS, REFERENCE, Transaction
from tests.shared import free_port, migrate_and_ingest, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
# Generous for two shared cores: start-up imports torch in two processes (more with workers), and
# a graceful stop drains the outbox first.
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


# ------------------------------------------------------------------ a live `bentoml serve`
@dataclass
class LiveServer:
    """A running server; test modules subclass it (a dataclass) with what their tests read."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    # Under `bentoml serve` a labelled metric has no sample until some label set is counted, so an
    # absent name reads as 0; a subclass whose checks read only metrics that are always exported
    # sets this, so that a typo fails instead of passing vacuously.
    metrics_must_exist: ClassVar[bool] = False

    def auth(self) -> dict[str, str]:
        """Headers every /score call carries: none unless a subclass holds a token."""
        return {}

    def score(self, rows: list[dict[str, Any]], headers: Mapping[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.url}/score", json={"transactions": rows}, headers={**self.auth(), **(headers or {})}, timeout=10
        )

    def score_at_once(
        self, requests: list[list[dict[str, Any]]], headers: Mapping[str, str] | None = None
    ) -> list[httpx.Response]:
        """Every request in flight at the same time, each answer in the order of `requests`."""

        async def send() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=10, headers=self.auth()) as client:
                return await asyncio.gather(
                    *(
                        client.post(f"{self.url}/score", json={"transactions": rows}, headers=dict(headers or {}))
                        for rows in requests
                    )
                )

        return asyncio.run(send())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels`."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
        if self.metrics_must_exist and not any(sample.name == name for sample in samples):
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


S = TypeVar("S", bound=LiveServer)


@contextmanager
def serve(
    kind: type[S],
    env: Mapping[str, str],
    log_path: Path,
    *,
    target: str = "serving.service:TandemScorer",
    **fields: Any,
) -> Iterator[S]:
    """`bentoml serve <target>` (the service, or a built Bento's tag) on a free port, this
    process's environment updated by `env`, answered as a `kind` built with `fields`; stopped
    however the block ends.

    No --host: the service's own default bind address is part of what is checked. A session of
    its own, so that stopping reaches the server's worker and scoring processes too.
    """
    port = free_port()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "bentoml", "serve", target, "--port", str(port)],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = kind(url=f"http://127.0.0.1:{port}", port=port, process=process, log_path=log_path, **fields)
    try:
        wait_until_ready(f"{server.url}/readyz", process, timeout_s=READY_TIMEOUT_S, log=server.log_text)
        yield server
    finally:
        _stop(server)


def _stop(server: LiveServer) -> None:
    """SIGTERM the whole process group (server, its workers, the scoring processes); SIGKILL stragglers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=10)


# ------------------------------------------------------------------ a live server on demo data
def demo_day(day: date, rows: int, accounts: int) -> pl.DataFrame:
    """A day of valid demo records (no poison), RAW columns."""
    return generate_day(day, DemoConfig(rows_per_day=rows, poison_rate=0.0, accounts=accounts)).select(RAW_COLUMNS)


@dataclass
class DemoServer(LiveServer):
    database_url: str
    history: pl.DataFrame  # the stored day, RAW columns
    requests: pl.DataFrame  # the next day's records of the same accounts, all valid, not stored


D = TypeVar("D", bound=DemoServer)


@contextmanager
def serve_demo(
    kind: type[D],
    database_url: str,
    data_dir: Path,
    days: tuple[date, date],
    *,
    rows: int,
    accounts: int,
    env: Mapping[str, str],
    **fields: Any,
) -> Iterator[D]:
    """`serve`, on the empty database at `database_url` once it holds the first of `days` (`rows`
    records of `accounts` accounts) as history; the second day's records are the requests."""
    history_day, request_day = days
    history, requests = demo_day(history_day, rows, accounts), demo_day(request_day, rows, accounts)
    migrate_and_ingest(database_url, history, history_day)
    full_env = {"DATABASE_URL": database_url, "TANDEM_DATA_DIR": str(data_dir), **env}
    log_path = data_dir / "serve.log"
    with serve(
        kind, full_env, log_path, database_url=database_url, history=history, requests=requests, **fields
    ) as server:
        yield server


# What the serving tests' `start_demo_server` fixture hands out (tests/serving/conftest.py).
StartDemoServer = Callable[..., AbstractContextManager[DemoServer]]


# ------------------------------------------------------------------ one idempotency key, many requests at once
DUPLICATES = 50


def check_one_answer_per_key(
    answers: list[list[dict[str, Any]]], retry: list[dict[str, Any]], stored: list[dict[str, Any]], key: str
) -> None:
    """What DUPLICATES requests sent at once under one idempotency key must leave, in-process or
    over HTTP (answers as JSON): one answer for all of them and for a retry after them, and one
    stored row, with the key and that answer's score."""
    assert len(answers) == DUPLICATES, len(answers)
    assert all(answer == answers[0] for answer in answers), "every duplicate gets the one stored answer"
    assert retry == answers[0], ("a retry afterwards replays it", retry, answers[0])
    assert [row["idempotency_key"] for row in stored] == [key], stored
    assert math.isclose(stored[0]["score"], answers[0][0]["score"], rel_tol=1e-6, abs_tol=1e-12), stored


# ------------------------------------------------------------------ in-process: a scorer, inputs and results
async def started_scorer(
    process: Callable[[list[ItemSpec]], BatchResult],
    engine: Engine,
    outbox: Path,
    *,
    model_version: str,
    settings: ServingSettings | None = None,
    metrics: ServingMetrics | None = None,
    spec: LoadedSpec = REFERENCE,
    **overrides: Any,
) -> OnlineScorer:
    """A started scorer of `spec` around a hand-written scoring step (one thread of its own), its
    batch cost calibrated and marked warm as if warm-up had run; results go to `engine`, spills to
    `outbox`. `settings`, or the defaults with `overrides`."""
    scorer = OnlineScorer(
        spec=spec,
        process=process,
        executor=ThreadPoolExecutor(max_workers=1),
        model_version=model_version,
        engine=engine,
        settings=settings or ServingSettings(**overrides),
        outbox=Outbox(outbox),
        metrics=metrics or ServingMetrics(),
    )
    scorer.cost.calibrate([(1, 0.002), (64, 0.01)])
    scorer.warm = True
    await scorer.start()
    return scorer


@dataclass
class FakeClock:
    """A monotonic clock that moves only when a test sets `now`."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def transaction(tx: str) -> Transaction:
    return Transaction(
        transaction_id=tx,
        account_id="acct-1",
        amount=12.5,
        currency="USD",
        merchant_category="grocery",
        country="US",
        event_time=datetime(2026, 11, 2, 10, tzinfo=UTC),
    )


def prediction_row(
    transaction_id: str,
    model_version: str,
    *,
    score: float = 0.5,
    request_id: str = "r",
    batch_id: str = "b",
    idempotency_key: str | None = None,
    produced_at: datetime | None = None,
) -> dict[str, Any]:
    """One online predictions row, as the scoring step hands it to the writer."""
    return {
        "record_id": transaction_id,
        "model_version": model_version,
        "score": score,
        "path": "online",
        "run_id": None,
        "partition_key": None,
        "request_id": request_id,
        "batch_id": batch_id,
        "code_version": "test",
        "input_hash": "h",
        "idempotency_key": idempotency_key,
        "produced_at": utc_now() if produced_at is None else produced_at,
    }


def prediction_rows(count: int, model_version: str) -> list[dict[str, Any]]:
    """Rows t0, t1, ... with one production time, as one batch spilled to the outbox leaves them."""
    now = utc_now()
    return [prediction_row(f"t{i}", model_version, produced_at=now) for i in range(count)]


def score_or_hang(specs: list[ItemSpec]) -> BatchResult:
    """A scoring step that never returns for a batch holding the record "hang" (a wedged native
    call); module-level, so a scoring process can unpickle it."""
    if any(spec.record_id == "hang" for spec in specs):
        threading.Event().wait()
    return scored_batch(specs, model_version="risk_model:fake", batch_id="b")


def scored_batch(
    specs: list[ItemSpec],
    *,
    model_version: str,
    batch_id: str,
    score: float = 0.5,
    grade: Callable[[ItemSpec], tuple[float, str]] | None = None,
    ls: LoadedSpec = REFERENCE,
) -> BatchResult:
    """Every item of the batch scored: `score` with input hash "h", or the (score, input hash)
    `grade` gives the item. Its answers (`ls`'s item results) and its rows."""
    now = utc_now()
    graded = [(spec.record_id, spec, *(grade(spec) if grade else (score, "h"))) for spec in specs]
    results = [
        api_models(ls).item_result(
            **{ls.id.name: tx},
            status="scored",
            score=value,
            model_version=model_version,
            path="online",
            request_id=spec.request_id,
            batch_id=batch_id,
            produced_at=now,
            input_hash=digest,
        )
        for tx, spec, value, digest in graded
    ]
    rows = [
        {
            **prediction_row(
                tx,
                model_version,
                score=value,
                request_id=spec.request_id,
                batch_id=batch_id,
                idempotency_key=spec.idempotency_key,
                produced_at=now,
            ),
            "input_hash": digest,
        }
        for tx, spec, value, digest in graded
    ]
    return BatchResult(results=results, rows=rows)
