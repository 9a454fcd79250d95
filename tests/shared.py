"""Helpers every test package uses: a throwaway PostgreSQL database (stocked, or cut off), a model
version in the store, polling for a condition (never a bare sleep to wait for something), a child
process run to its end, and the environment a served process starts with.

Plain functions without pytest, so child processes started by tests can import them too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import TypeVar

import httpx
import polars as pl
import psycopg
import torch
from psycopg import sql
from sqlalchemy.engine import make_url

from inference.batch import ingest_day
from inference.migrate import upgrade
from inference.model import LoadedModel, build_model, untrained_report
from inference.spec import LoadedSpec, load_spec
from inference.store import make_engine
from tandem import modelstore
from tandem_specs.transactions.model import ModelConfig
from tests.reference import REFERENCE

T = TypeVar("T")
# How long a test waits for something that normally takes milliseconds (a row written, a queue
# drained) before it fails: generous for shared, noisy machines; a pass returns at once.
WAIT_S = 10.0
POLL_S = 0.02


def until(
    condition: Callable[[], T],
    *,
    timeout_s: float = WAIT_S,
    interval_s: float = POLL_S,
    message: str | Callable[[], str] = "condition not reached",
) -> T:
    """Polls `condition` until it returns something truthy, and returns that; fails the test
    (AssertionError with `message`, or what it returns then) once `timeout_s` have passed.
    A value without a truth value (a polars frame) is returned wrapped, e.g. in a list."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        _fail_past(deadline, timeout_s, message)
        time.sleep(interval_s)
    return value


async def until_async(
    condition: Callable[[], T],
    *,
    timeout_s: float = WAIT_S,
    interval_s: float = 0.005,
    message: str | Callable[[], str] = "condition not reached",
) -> T:
    """`until` inside an event loop: sleeps with asyncio, so the loop runs what is awaited meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        _fail_past(deadline, timeout_s, message)
        await asyncio.sleep(interval_s)
    return value


def _fail_past(deadline: float, timeout_s: float, message: str | Callable[[], str]) -> None:
    if time.monotonic() > deadline:
        raise AssertionError(f"{message if isinstance(message, str) else message()} (waited {timeout_s:g} s)")


def wait_until_ready(
    url: str, process: subprocess.Popen[bytes], *, timeout_s: float, log: Callable[[], str] = lambda: ""
) -> None:
    """Returns once `url` (a readiness route) answers 200; raises RuntimeError if `process` exits
    first or `timeout_s` pass, with the end of `log` in the message."""

    def answered() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}: {log()[-3000:]}")
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(answered, timeout_s=timeout_s, interval_s=0.25)
    except AssertionError:
        raise RuntimeError(f"server never became ready: {log()[-3000:]}") from None


def run_child(
    argv: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Runs `argv` in `cwd` (with `env`, or this process's environment) and waits for it, at most
    `timeout_s`: its output captured as text, and a non-zero exit returned rather than raised, so
    that the test's own assertion fails showing what the child wrote on stdout and stderr."""
    return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def service_env(*, database_url: str, data_dir: Path, model_name: str) -> dict[str, str]:
    """The environment variables every served process (`bentoml serve`, a built Bento) a test
    starts needs: the database it records to, its data folder, the model it serves. A test adds
    its own settings with `|` (BENTOML_HOME, TANDEM_SERVING_...), each beside why it has its value."""
    return {"DATABASE_URL": database_url, "TANDEM_DATA_DIR": str(data_dir), "TANDEM_MODEL_NAME": model_name}


@contextmanager
def fresh_postgres_database(admin_url: str, prefix: str = "tandem_test", options: str = "") -> Iterator[str]:
    """An empty database of its own (`options`: CREATE DATABASE's, a locale say); dropped
    afterwards (forcibly, whoever is still connected)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" {options}')
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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


def migrate_and_ingest(url: str, frame: pl.DataFrame, day: date) -> None:
    """Brings the database at `url` to the latest schema, then stores `frame` as `day`'s records."""
    engine = make_engine(url)
    try:
        upgrade(engine, REFERENCE)
        ingest_day(REFERENCE, engine, frame, day)
    finally:
        engine.dispose()


def reference_model(config: ModelConfig | None = None) -> LoadedModel:
    """The reference spec's model (RiskModel) at `config`, in eval mode, weights as torch's seed left them."""
    model = build_model(load_spec(), dataclasses.asdict(config or ModelConfig()))
    model.module.eval()
    return model


def register_model(model: LoadedModel, name: str, *, code_version: str = "test", promote: bool = True) -> str:
    """`model` in the BentoML store with a placeholder training report (promoted by default)."""
    report = dataclasses.replace(untrained_report(model), auc=0.5)
    tag = modelstore.register(model, report, name=name, code_version=code_version)
    if promote:
        modelstore.promote(tag)
    return tag


def register_untrained_model(
    name: str, *, code_version: str = "test", seed: int = 0, config: ModelConfig | None = None, promote: bool = True
) -> str:
    """A deterministic, untrained model version in the BentoML store (promoted by default):
    what it scores is not the point of the tests that use it, that it is stored and served is."""
    torch.manual_seed(seed)
    return register_model(reference_model(config), name, code_version=code_version, promote=promote)


def register_untrained_spec_model(ls: LoadedSpec, name: str, *, seed: int = 0) -> str:
    """An untrained model of `ls` at its own K, seeded, in the BentoML store under `name` and
    promoted: any spec's counterpart of `register_untrained_model`."""
    torch.manual_seed(seed)
    model = build_model(ls, ls.spec.model_config(ls.spec.history_length))
    model.module.eval()
    report = dataclasses.replace(untrained_report(model), auc=0.5)
    tag = modelstore.register(model, report, name=name, code_version="test", spec=ls)
    modelstore.promote(tag, spec=ls)
    return tag


def free_port() -> int:
    """A loopback port just released: free for a server to bind, and refused at once while none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def unreachable_database_url() -> str:
    """A PostgreSQL URL nothing answers at (a connection is refused at once): a database that is
    really down, unlike a SQLite file without tables."""
    return f"postgresql+psycopg://tandem@127.0.0.1:{free_port()}/unreachable"
