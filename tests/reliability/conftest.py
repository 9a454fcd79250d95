"""Fixtures of the reliability suite: its own production model, password-protected databases.

Every test here injects a fault (or audits a guarantee) against real processes: a real
`bentoml serve`, real PostgreSQL, Dagster materializations in and out of process.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from tests.reliability.support import SecretDatabase, create_secret_database, drop_secret_database, register_model

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Belt and braces: every test under tests/reliability carries the marker CI selects on.
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture(scope="session")
def reliability_model() -> str:
    """The model every server and run in this suite scores with (BENTOML_HOME is per session)."""
    return register_model()


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
    name = f"tandem_ref_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_admin_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(postgres_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(postgres_admin_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
