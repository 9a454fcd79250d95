"""Helpers shared by the core's tests: hand-written records, tiny model configs, throwaway databases."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from typing import Any

import polars as pl
import psycopg
from sqlalchemy.engine import make_url

from inference.model import ModelConfig
from inference.records import raw_frame

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


@contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    """A fresh database that outlives one test (for module-scoped fixtures); dropped afterwards."""
    name = f"tandem_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
