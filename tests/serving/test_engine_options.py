"""The online path's PostgreSQL connections carry their bounds to the socket: a database that goes
silent mid-read is found out by the kernel, not after TCP's 15 minutes of retransmissions."""

from __future__ import annotations

import socket

import pytest
import sqlalchemy as sa

from inference.store import make_engine
from serving.settings import DB_SILENCE_BOUND, ServingSettings

pytestmark = pytest.mark.postgres


def test_a_serving_connection_has_keepalives_and_a_user_timeout_on_its_socket(postgres_url: str) -> None:
    engine = make_engine(postgres_url, **ServingSettings().engine_options(postgres_url))
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "2s"
            fd = conn.connection.driver_connection.pgconn.socket  # type: ignore[union-attr]
            with socket.socket(fileno=socket.dup(fd)) as sock:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == DB_SILENCE_BOUND["keepalives_idle"]
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == DB_SILENCE_BOUND["keepalives_count"]
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2000
    finally:
        engine.dispose()


def test_sqlite_gets_no_postgresql_options() -> None:
    assert ServingSettings().engine_options("sqlite:///tandem.db") == {}
