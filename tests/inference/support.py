"""Helpers shared by the core's tests: hand-written records, tiny model configs, throwaway databases."""

from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import date
from typing import Any

import polars as pl

from inference.model import ModelConfig
from inference.records import raw_frame
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
