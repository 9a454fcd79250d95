"""Helpers shared by the core's tests: hand-written records, tiny model configs, throwaway databases,
the result store as its tests read and write it (schema against the metadata, predictions,
rejections), and the batch path as its tests run it (an untrained model, days ingested and scored)."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from datetime import date
from typing import Any

import polars as pl
import sqlalchemy as sa
import torch
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Engine

from inference.batch import BatchProducer, IngestReport, PartitionReport, ingest_day, score_partition
from inference.contract import Predictor, TorchPredictor
from inference.model import LoadedModel
from inference.records import raw_frame
from inference.store import metadata, read_predictions, rejected_records, upsert_predictions
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tandem_specs.transactions.model import ModelConfig
from tests.reference import REFERENCE
from tests.shared import fresh_postgres_database, reference_model

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
    return raw_frame(REFERENCE, list(records))


def postgres_database(admin_url: str) -> AbstractContextManager[str]:
    """A fresh database that outlives one test (for module-scoped fixtures); dropped afterwards."""
    return fresh_postgres_database(admin_url)


# ------------------------------------------------------------------ the result store
IDS = [f"tx-{i}" for i in range(5)]  # transaction ids of hand-built prediction rows


def schema_diffs(engine: Engine) -> list[object]:
    """What autogenerate finds between the database and the core metadata, types included: [] if
    none. The spec's record table is not the migrations' (test_record_table.py compares it)."""

    def core(name: str | None, type_: str, parent_names: object) -> bool:
        return type_ != "table" or name in metadata.tables

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True, "include_name": core})
        return list(compare_metadata(context, metadata))


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def predictions_of(engine: Engine, **equal_to: object) -> pl.DataFrame:
    """The stored predictions whose columns equal `equal_to` (all of them without it)."""
    with engine.connect() as conn:
        return read_predictions(conn, **equal_to)


def write(engine: Engine, rows: pl.DataFrame) -> int:
    """Upserts prediction rows in a transaction of their own; returns how many rows changed."""
    with engine.begin() as conn:
        return upsert_predictions(conn, rows)


def rejections(engine: Engine) -> pl.DataFrame:
    """The quarantine as the tests compare it, in rejection_key order (stable across reruns)."""
    r = rejected_records.c
    columns = [
        *(r.rejection_key, r.record_id, r.partition_key, r.stage, r.reason, r.detail, r.input_hash),
        *(r.seen_count, r.last_seen),
    ]
    with engine.connect() as conn:
        rows = conn.execute(sa.select(*columns).order_by(r.rejection_key)).all()
    text = {column.name: pl.String for column in columns[:-2]}
    # An empty quarantine keeps its column types, so the tests' filters work on it as on a full one.
    return pl.DataFrame(
        [tuple(row) for row in rows],
        schema=[column.name for column in columns],
        schema_overrides={**text, "seen_count": pl.Int64},
        orient="row",
    )


# ------------------------------------------------------------------ the batch path
@functools.cache
def untrained_model() -> LoadedModel:
    """The reference model with seeded, untrained weights: deterministic scores, no training run."""
    torch.manual_seed(0)
    return reference_model()


def untrained_predictor(model_version: str = "risk:untrained", forward_batch_size: int = 4096) -> TorchPredictor:
    return TorchPredictor(
        model=untrained_model(), model_version=model_version, spec=REFERENCE, forward_batch_size=forward_batch_size
    )


def ingest_days(engine: Engine, config: DemoConfig, days: list[date]) -> dict[date, IngestReport]:
    """The demo generator's `days` ingested as the nightly run ingests them."""
    return {day: ingest_day(REFERENCE, engine, generate_day(day, config), day) for day in days}


def score_day(
    engine: Engine, day: date, scorer: Predictor | None = None, *, run_id: str = "run-1", **options: Any
) -> PartitionReport:
    """score_partition of `day` as a batch run `run_id` with the reference history length;
    `options` are score_partition's (chunk_rows, pipelined, model_workers, on_chunk, ...)."""
    return score_partition(
        REFERENCE,
        engine,
        scorer or untrained_predictor(),
        day,
        producer=BatchProducer(run_id=run_id, partition_key=day.isoformat(), code_version="test"),
        history_length=ModelConfig().history_length,
        **options,
    )
