"""breaker.StatementBound on a live PostgreSQL: a statement that outlasts the bound fails as a
dropped connection, within the bound, and nothing else is touched."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from inference.store import make_engine
from serving.breaker import StatementBound

BOUND_S = 0.5


@pytest.mark.postgres
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_statement_past_the_bound_fails_within_it_and_the_engine_serves_on(postgres_url: str, driver: str) -> None:
    url = make_url(postgres_url).set(drivername=f"postgresql+{driver}")
    engine = make_engine(url.render_as_string(hide_password=False))  # no statement_timeout: only the bound ends it
    assert engine.dialect.driver == driver
    StatementBound(BOUND_S).watch(engine)
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError), engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_sleep(30)"))
        assert BOUND_S <= time.monotonic() - started < BOUND_S + 2
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_statements_within_the_bound_are_never_cut_later(postgres_url: str) -> None:
    engine = make_engine(postgres_url, pool_size=1, max_overflow=0)
    StatementBound(BOUND_S).watch(engine)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1 FROM pg_sleep(0.2)")).scalar() == 1
            time.sleep(3 * BOUND_S)  # past the deadline the first statement was armed with
            assert conn.execute(sa.text("SELECT 2")).scalar() == 2
        with engine.connect() as conn:  # the same pooled connection, still whole
            assert conn.execute(sa.text("SELECT 3")).scalar() == 3
        assert engine.pool.checkedin() == 1
    finally:
        engine.dispose()


def test_a_sqlite_engine_is_left_alone(tmp_path: Path) -> None:
    """SQLite has no socket to cut (a file always answers): its statements run unwatched."""
    engine = make_engine(f"sqlite:///{tmp_path / 'tandem.db'}")
    StatementBound(BOUND_S).watch(engine)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()
