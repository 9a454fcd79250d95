"""Fixtures of the reliability suite: its own production model, password-protected databases,
live servers of that model.

Every test here injects a fault (or audits a guarantee) against real processes: a real
`bentoml serve`, real PostgreSQL, Dagster materializations in and out of process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from datetime import date
from pathlib import Path
from typing import Any

import pytest

from tests.orchestration.support import register_production_model
from tests.reliability.support import (
    MODEL_NAME,
    SecretDatabase,
    StartSuiteServer,
    SuiteServer,
    create_secret_database,
    drop_secret_database,
    suite_server,
)
from tests.shared import fresh_postgres_database

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Belt and braces: every test under tests/reliability carries the marker CI selects on.
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture(scope="module", autouse=True)
def report_measurements(request: pytest.FixtureRequest) -> Iterator[None]:
    """Prints a module's MEASURED (what docs/reliability.md quotes) once its tests are done: autouse,
    so it is torn down after the module's other fixtures, a live server's stop included."""
    yield
    measured = getattr(request.module, "MEASURED", None)
    if measured is not None:
        print(f"\nmeasured ({request.module.__name__.rsplit('.', 1)[-1]}): {measured}")


@pytest.fixture(scope="session")
def reliability_model() -> str:
    """The model every server and run in this suite scores with (BENTOML_HOME is per session)."""
    return register_production_model(MODEL_NAME)


@pytest.fixture
def secret_db(postgres_admin_url: str) -> Iterator[SecretDatabase]:
    """A fresh database owned by a role with a password in its URL; dropped afterwards."""
    db = create_secret_database(postgres_admin_url)
    try:
        yield db
    finally:
        drop_secret_database(db)


@pytest.fixture
def reference_url(postgres_admin_url: str) -> Iterator[str]:
    """A second empty PostgreSQL database, for the clean run a faulted one is compared with."""
    with fresh_postgres_database(postgres_admin_url, prefix="tandem_ref") as url:
        yield url


@pytest.fixture(scope="module")
def start_suite_server(
    postgres_admin_url: str, reliability_model: str, tmp_path_factory: pytest.TempPathFactory
) -> StartSuiteServer:
    """`suite_server` with this session's PostgreSQL and model, in a fresh folder called `name`."""

    def start(name: str, days: tuple[date, date], **options: Any) -> AbstractContextManager[SuiteServer]:
        return suite_server(postgres_admin_url, reliability_model, tmp_path_factory.mktemp(name), days, **options)

    return start
