"""Fixtures shared by every test package.

BentoML resolves BENTOML_HOME once per process, so it is pointed at a temporary folder before
anything imports bentoml; DAGSTER_HOME and the data folder likewise. Each PostgreSQL test gets a
database of its own, created here and dropped afterwards.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.reference import REFERENCE

_SESSION_ROOT = Path(tempfile.mkdtemp(prefix="tandem-tests-"))
os.environ["BENTOML_HOME"] = str(_SESSION_ROOT / "bentoml")
os.environ["DAGSTER_HOME"] = str(_SESSION_ROOT / "dagster")
os.environ["TANDEM_DATA_DIR"] = str(_SESSION_ROOT / "data")
os.environ.pop("DATABASE_URL", None)
os.environ.setdefault("TANDEM_CODE_VERSION", "test")
(_SESSION_ROOT / "dagster").mkdir(parents=True, exist_ok=True)

import psycopg  # noqa: E402
import pytest  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402

from inference.migrate import upgrade  # noqa: E402
from inference.spec import LoadedSpec, load_spec  # noqa: E402
from inference.store import make_engine  # noqa: E402
from tests.shared import fresh_postgres_database  # noqa: E402

POSTGRES_ADMIN_URL = os.environ.get("TANDEM_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
# CI sets this so a PostgreSQL outage fails the run instead of silently skipping half the suite.
REQUIRE_POSTGRES = os.environ.get("TANDEM_REQUIRE_POSTGRES") == "1"


def _postgres_available() -> bool:
    try:
        with psycopg.connect(POSTGRES_ADMIN_URL, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


@pytest.fixture(scope="session")
def session_root() -> Path:
    return _SESSION_ROOT


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    if not _postgres_available():
        if REQUIRE_POSTGRES:
            pytest.fail(f"PostgreSQL required but not reachable at {POSTGRES_ADMIN_URL}")
        pytest.skip("PostgreSQL not reachable")
    return POSTGRES_ADMIN_URL


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty database for one test; dropped (forcibly) afterwards."""
    with fresh_postgres_database(postgres_admin_url) as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tandem.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> str:
    """Runs the test once on SQLite and once on a fresh PostgreSQL database."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(fixture))


@contextmanager
def _migrated(url: str) -> Iterator[Engine]:
    migrated = make_engine(url)
    upgrade(migrated, REFERENCE)
    try:
        yield migrated
    finally:
        migrated.dispose()


# The specs the live tests whose behaviour does not depend on the spec run for: the reference and
# one of another shape (no entity, K = 0, id `patient_id`).
SPECS: dict[str, LoadedSpec] = {"reference": REFERENCE, "diabetes": load_spec("tandem_specs.diabetes:SPEC")}


@pytest.fixture(params=list(SPECS))
def spec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> LoadedSpec:
    """Each spec in turn, TANDEM_MODEL_SPEC set to it: the entry points built in this process
    (Dagster definitions and resources) and the servers it starts follow it."""
    loaded = SPECS[request.param]
    monkeypatch.setenv("TANDEM_MODEL_SPEC", loaded.path)
    return loaded


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """A migrated database, once on SQLite and once on PostgreSQL (see `database_url`)."""
    with _migrated(database_url) as migrated:
        yield migrated


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Engine]:
    """A migrated SQLite database only: for tests whose subject is not the store (the in-process
    scorer's writer, say)."""
    with _migrated(sqlite_url) as migrated:
        yield migrated
