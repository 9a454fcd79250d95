"""A service (re)started while its database is down: it comes up and answers, degraded, as a running
service does through an outage; once the database answers, the schema is checked (here: created,
the database never having been migrated) and the outbox drains into it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.reliability.support import FAST_RECOVERY, MODEL_NAME, database_name
from tests.serving.support import LiveServer, demo_day, serve
from tests.shared import fresh_postgres_database, service_env, set_connections_allowed, until

pytestmark = [pytest.mark.reliability, pytest.mark.live, pytest.mark.postgres]

# Past SCHEMA_RETRY_S (serving/service.py) and the outbox's drain interval, with room for a slow machine.
RECOVERY_TIMEOUT_S = 60.0
MEASURED: dict[str, Any] = {}  # printed at the end (tests/reliability/conftest.py)


@pytest.fixture
def down_database(postgres_admin_url: str) -> Iterator[str]:
    """An empty, never migrated database that refuses every connection until a test allows them."""
    with fresh_postgres_database(postgres_admin_url, prefix="tandem_down") as url:
        set_connections_allowed(postgres_admin_url, database_name(url), False)
        yield url


def _stored_request_ids(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return {row[0] for row in conn.execute(sa.text("SELECT request_id FROM predictions"))}
    except sa.exc.SQLAlchemyError:
        return set()  # not migrated yet
    finally:
        engine.dispose()


def test_a_service_started_while_its_database_is_down_answers_and_writes_once_it_is_back(
    postgres_admin_url: str, reliability_model: str, down_database: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    with serve(
        LiveServer,
        service_env(database_url=down_database, data_dir=tmp_path, model_name=MODEL_NAME)
        | FAST_RECOVERY
        | {"TANDEM_SERVING_MODEL_TAG": reliability_model},
        tmp_path / "serve.log",
    ) as server:
        MEASURED["ready_after_s"] = round(time.monotonic() - started, 1)
        rows = demo_day(date(2026, 11, 2), 3, 3).to_dicts()
        keyed = {"Idempotency-Key": "start-during-outage"}
        answered = server.score(rows, headers=keyed)
        assert answered.status_code == 200, answered.text
        results = answered.json()["results"]
        assert [r["status"] for r in results] == ["scored"] * 3
        assert all(r["degraded"] for r in results), "scored without history: the database is down"
        assert _stored_request_ids(down_database) == set()

        set_connections_allowed(postgres_admin_url, database_name(down_database), True)
        back = time.monotonic()
        item_request_ids = {r["request_id"] for r in results}
        until(
            lambda: item_request_ids <= _stored_request_ids(down_database),
            timeout_s=RECOVERY_TIMEOUT_S,
            message=lambda: f"the outbox did not drain into the database: {server.log_text()[-2000:]}",
        )
        MEASURED["rows_stored_after_s"] = round(time.monotonic() - back, 1)
        assert httpx.get(f"{server.url}/livez", timeout=10).status_code == 200
        # History can be read again: answers stop being degraded (once the scoring process's own
        # breaker has let a read through).
        later = iter(demo_day(date(2026, 11, 3), 50, 5).to_dicts())

        def undegraded() -> bool:
            response = server.score([next(later)])
            assert response.status_code == 200, response.text
            return response.json()["results"][0]["degraded"] is False

        until(undegraded, timeout_s=10, message="answers stayed degraded after the database came back")
