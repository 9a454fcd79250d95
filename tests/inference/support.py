"""Helpers shared by the core's tests: hand-written records, tiny model configs, throwaway databases,
and the result store as its tests read and write it (schema against the metadata, predictions)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import date
from typing import Any

import polars as pl
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Engine

from inference.model import ModelConfig
from inference.records import raw_frame
from inference.store import metadata, read_predictions, upsert_predictions
from tests.shared import fresh_postgres_database

DAY = date(2026, 11, 1)
# Small enough to train in well under a second, wide enough to exercise every layer.
TINY_MODEL = ModelConfig(history_length=8, embedding_dim=4, history_dim=32, hidden_dim=64, head_tail_dim=16)

CLEAN_RECORD: dict[str, Any] = {
    "transaction_id": "tx-1",
    "account_id": "acct-1",
    "amount": 42.5,
    "currency": "EUR",
    "merchant_category": "grocery",
    "country": "DE",
    "event_time": "2026-11-01T12:00:00.000000Z",
}


def record(**changes: Any) -> dict[str, Any]:
    """A valid record with some fields replaced."""
    return {**CLEAN_RECORD, **changes}


def frame_of(*records: dict[str, Any]) -> pl.DataFrame:
    return raw_frame(list(records))


def postgres_database(admin_url: str) -> AbstractContextManager[str]:
    """A fresh database that outlives one test (for module-scoped fixtures); dropped afterwards."""
    return fresh_postgres_database(admin_url)


# ------------------------------------------------------------------ the result store
IDS = [f"tx-{i}" for i in range(5)]  # transaction ids of hand-built prediction rows


def schema_diffs(engine: Engine) -> list[object]:
    """What autogenerate finds between the database and the metadata, types included: [] if none."""
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(context, metadata))


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def read_all(engine: Engine) -> pl.DataFrame:
    with engine.connect() as conn:
        return read_predictions(conn)


def write(engine: Engine, rows: pl.DataFrame) -> int:
    """Upserts prediction rows in a transaction of their own; returns how many rows changed."""
    with engine.begin() as conn:
        return upsert_predictions(conn, rows)
