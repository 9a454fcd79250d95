"""Fixtures of the serving tests: live servers on demo data (the in-process scorer's SQLite database,
`sqlite_engine`, is tests/conftest.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from typing import Any

import pytest

from tests.serving.support import D, StartDemoServer, serve_demo
from tests.shared import fresh_postgres_database


@pytest.fixture(scope="module")
def start_demo_server(postgres_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> StartDemoServer:
    """`serve_demo` on a fresh PostgreSQL database named after `name` (dropped once the server has
    stopped), in a fresh folder of that name."""

    @contextmanager
    def start(kind: type[D], name: str, days: tuple[date, date], **options: Any) -> Iterator[D]:
        data_dir = tmp_path_factory.mktemp(name)
        with (
            fresh_postgres_database(postgres_admin_url, prefix=f"tandem_{name}") as url,
            serve_demo(kind, url, data_dir, days, **options) as server,
        ):
            yield server

    return start
