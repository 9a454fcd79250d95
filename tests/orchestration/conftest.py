"""Fixtures for the batch path: the assets, a production model, an ephemeral Dagster instance."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from dagster import AssetsDefinition, DagsterInstance
from sqlalchemy.engine import make_url

from tests.orchestration.support import batch_assets, register_production_model


@pytest.fixture(scope="session")
def production_tag() -> str:
    """Registered once per session (BENTOML_HOME is per session, see tests/conftest.py)."""
    return register_production_model()


@pytest.fixture(scope="session")
def assets() -> list[AssetsDefinition]:
    return batch_assets()


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with DagsterInstance.ephemeral() as ephemeral:
        yield ephemeral


@pytest.fixture
def other_database_url(database_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A second empty database on the same backend as `database_url` (for a clean reference run)."""
    if database_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path / 'reference.db'}"
        return
    admin_url = str(request.getfixturevalue("postgres_admin_url"))
    name = f"tandem_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
