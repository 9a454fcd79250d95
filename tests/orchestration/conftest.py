"""Fixtures for the batch path: the assets, a production model, an ephemeral Dagster instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import AssetsDefinition, DagsterInstance

from tests.orchestration.support import batch_assets, register_production_model
from tests.shared import fresh_postgres_database


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
    with fresh_postgres_database(str(request.getfixturevalue("postgres_admin_url"))) as url:
        yield url
