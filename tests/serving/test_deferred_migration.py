"""The schema check a service started without its database retries (serving.lifecycle): an outage
keeps it retrying, a database that answers gets its schema, another spec's database ends it."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from inference.migrate import StoreMismatch, upgrade
from inference.spec import load_spec
from inference.store import make_engine
from serving.lifecycle import DeferredMigration
from tests.reference import REFERENCE
from tests.shared import unreachable_database_url, until_async


def test_an_unreachable_database_is_retried_without_failing(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(unreachable_database_url())

    async def scenario() -> DeferredMigration:
        migration = DeferredMigration(engine, REFERENCE, interval_s=0.01)
        migration.start()
        await asyncio.sleep(0.3)  # many refused attempts
        await migration.close()
        return migration

    try:
        assert asyncio.run(scenario()).failed is None
        assert caplog.text.count("database still unreachable") >= 2
    finally:
        engine.dispose()


def test_a_database_that_answers_gets_its_schema(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)

    async def scenario() -> None:
        migration = DeferredMigration(engine, REFERENCE, interval_s=0.01)
        migration.start()
        await until_async(lambda: "predictions" in sa.inspect(engine).get_table_names(), timeout_s=10)
        await migration.close()
        assert migration.failed is None

    try:
        asyncio.run(scenario())
    finally:
        engine.dispose()


def test_another_specs_database_ends_the_retries_as_failed(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    upgrade(engine, load_spec("tandem_specs.diabetes:SPEC"))

    async def scenario() -> DeferredMigration:
        migration = DeferredMigration(engine, REFERENCE, interval_s=0.01)
        migration.start()
        await until_async(lambda: migration.failed is not None, timeout_s=10)
        await migration.close()
        return migration

    try:
        assert isinstance(asyncio.run(scenario()).failed, StoreMismatch)
    finally:
        engine.dispose()
