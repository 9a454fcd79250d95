"""Each scenario runs on a PostgreSQL database of its own, as a deployment does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.shared import fresh_postgres_database


@pytest.fixture
def database_url(postgres_admin_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    with fresh_postgres_database(
        postgres_admin_url, prefix=f"tandem_{request.module.__name__.rsplit('.', 1)[-1]}"
    ) as url:
        yield url
