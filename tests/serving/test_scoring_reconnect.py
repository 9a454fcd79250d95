"""The scoring process reads without a ping per checkout, and a connection the server dropped (a
restart) costs one retry, not a degraded batch."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from inference.store import make_engine
from serving.breaker import read_reconnecting

pytestmark = pytest.mark.postgres


def _drop_connections(admin_url: str, database_url: str) -> int:
    """Terminate every session on the test database, as a server restart would."""
    name = sa.engine.make_url(database_url).database
    with psycopg.connect(admin_url, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        ).fetchall()
    return len(rows)


def test_a_dropped_connection_is_read_again_on_a_fresh_one(postgres_admin_url: str, postgres_url: str) -> None:
    engine = make_engine(postgres_url, pool_pre_ping=False)
    try:
        assert read_reconnecting(engine, lambda conn: conn.execute(sa.text("SELECT 1")).scalar()) == 1
        assert _drop_connections(postgres_admin_url, postgres_url) >= 1
        assert read_reconnecting(engine, lambda conn: conn.execute(sa.text("SELECT 2")).scalar()) == 2
    finally:
        engine.dispose()


def test_without_the_retry_the_first_read_after_a_drop_fails(postgres_admin_url: str, postgres_url: str) -> None:
    """What `read_reconnecting` is for: with no ping, the pooled connection is dead until used."""
    engine = make_engine(postgres_url, pool_pre_ping=False)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        _drop_connections(postgres_admin_url, postgres_url)
        with pytest.raises(DBAPIError) as dropped, engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        assert dropped.value.connection_invalidated
    finally:
        engine.dispose()


def test_an_error_that_is_no_disconnect_is_not_retried(postgres_url: str) -> None:
    engine = make_engine(postgres_url, pool_pre_ping=False)
    calls: list[int] = []

    def failing(conn: sa.Connection) -> None:
        calls.append(1)
        conn.execute(sa.text("SELECT * FROM no_such_table"))

    try:
        with pytest.raises(DBAPIError):
            read_reconnecting(engine, failing)
        assert len(calls) == 1
    finally:
        engine.dispose()
