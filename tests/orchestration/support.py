"""Helpers for the batch-path tests.

Free of pytest and of environment side effects, so a child process (the SIGKILL test) can import
it too and build exactly the same assets and resources as the test that started it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from dagster import AssetsDefinition, DagsterInstance, ExecuteInProcessResult, materialize

from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from inference.settings import TandemSettings
from inference.store import make_engine, predictions, rejected_records
from orchestration.definitions import build_definitions
from orchestration.settings import OrchestrationSettings
from tandem_specs.transactions.model import ModelConfig
from tests.shared import register_untrained_model

# A model name of our own, so that no other test package promoting a "risk_model" in the same
# BentoML home can change the production model under these tests.
MODEL_NAME = "risk_model_orchestration_tests"
PARTITION = "2026-11-03"
SETTINGS = OrchestrationSettings(partitions_start="2026-11-01", history_length=16)
PARTITIONED = ("transactions", "predictions")
DEMO_SEED = 7

# Columns that legitimately move when the same rejection is seen again.
REJECTION_BOOKKEEPING = ("last_seen", "seen_count", "run_id")


def register_production_model(name: str = MODEL_NAME) -> str:
    return register_untrained_model(name, config=ModelConfig(history_length=SETTINGS.history_length))


def batch_assets() -> list[AssetsDefinition]:
    defs = build_definitions(SETTINGS)
    return [asset for asset in defs.assets or [] if isinstance(asset, AssetsDefinition)]


def batch_resources(
    url: str | None,
    *,
    rows_per_day: int = 2000,
    poison_rate: float = 0.01,
    database: DatabaseResource | None = None,
    model_name: str = MODEL_NAME,
) -> dict[str, Any]:
    """`url` None: the DatabaseResource reads DATABASE_URL when the run starts, as in production."""
    return {
        "database": database if database is not None else DatabaseResource(url=url),
        "model_store": ModelStoreResource(model_name=model_name),
        "source": demo_source(rows_per_day=rows_per_day, poison_rate=poison_rate),
    }


def demo_source(*, rows_per_day: int, poison_rate: float) -> RecordSourceResource:
    """The demo source, landing in a folder of its own per demo config.

    The demo writes a day only if its file is not there yet, and these tests share one data
    folder per session, so days of another size must not land where this one reads.
    """
    landing = TandemSettings().data_dir / "landing" / f"demo-{DEMO_SEED}-{rows_per_day}-{poison_rate}"
    return RecordSourceResource(
        kind="demo", location=str(landing), seed=DEMO_SEED, rows_per_day=rows_per_day, poison_rate=poison_rate
    )


def predictions_config(**config: Any) -> dict[str, Any]:
    """run_config for the predictions asset (chunk_rows, parity_sample, ...)."""
    return {"ops": {"predictions": {"config": config}}}


def run_partition(
    assets: list[AssetsDefinition],
    resources: Mapping[str, Any],
    instance: DagsterInstance,
    *,
    partition_key: str = PARTITION,
    selection: Iterable[str] = PARTITIONED,
    run_config: Mapping[str, Any] | None = None,
    raise_on_error: bool = True,
) -> ExecuteInProcessResult:
    return materialize(
        assets,
        selection=list(selection),
        partition_key=partition_key,
        instance=instance,
        resources=dict(resources),
        run_config=dict(run_config or {}),
        raise_on_error=raise_on_error,
    )


def table_rows(
    url: str,
    table: sa.Table,
    *,
    partition_key: str,
    order_by: Iterable[str],
    columns: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """One partition's rows of `table` as dicts (`columns`, or all but `exclude`), in a stable order."""
    skipped = set(exclude)
    chosen = [table.c[name] for name in columns] if columns is not None else list(table.columns)
    stmt = (
        sa.select(*(c for c in chosen if c.name not in skipped))
        .where(table.c.partition_key == partition_key)
        .order_by(*(table.c[name] for name in order_by))
    )
    return select_rows(url, stmt)


def select_rows(url: str, statement: sa.Select[Any]) -> list[dict[str, Any]]:
    """What `statement` selects in the database at `url`, one dict a row."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(statement)]
    finally:
        engine.dispose()


def prediction_rows(url: str, partition_key: str = PARTITION, **kwargs: Any) -> list[dict[str, Any]]:
    return table_rows(url, predictions, partition_key=partition_key, order_by=("record_id", "model_version"), **kwargs)


def rejection_rows(url: str, partition_key: str = PARTITION, **kwargs: Any) -> list[dict[str, Any]]:
    return table_rows(url, rejected_records, partition_key=partition_key, order_by=("rejection_key",), **kwargs)
