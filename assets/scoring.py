"""What the day-partitioned assets share: how each one runs (`daily_database_step`), and for
`predictions` and `challenger_predictions` the batch path's knobs and one stored day scored through
it by a loaded model. Only where the answers go, and what is checked, differs."""

# No `from __future__ import annotations`: Dagster reads a Config subclass's annotations.
from collections.abc import Callable
from datetime import date
from typing import Any

from dagster import (
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    BackfillPolicy,
    DailyPartitionsDefinition,
    TimeWindowPartitionMapping,
)
from pydantic import Field

from assets.config import AssetConfig
from assets.partitions import run_partition_check
from assets.resources import DatabaseResource
from assets.retries import TRANSIENT_RETRY
from inference.batch import (
    FORWARD_BATCH_SIZE,
    MODEL_WORKERS,
    BatchProducer,
    ChunkProgress,
    PartitionReport,
    score_partition,
)
from inference.contract import TorchPredictor
from inference.model import LoadedModel
from inference.spec import LoadedSpec
from tandem.version import code_version

# Concurrency pool shared by every asset that holds database connections (limit: dagster.yaml).
DATABASE_POOL = "database"


def daily_database_step(partitions: DailyPartitionsDefinition) -> dict[str, Any]:
    """The @asset arguments of every day-partitioned asset that reads or writes Tandem's database:
    one run per day in a backfill (a failed day reruns alone), Dagster's retry on a transient
    database error, a slot of the `database` pool, and the run's key checked before any step."""
    return {
        "partitions_def": partitions,
        "retry_policy": TRANSIENT_RETRY,
        "backfill_policy": BackfillPolicy.multi_run(1),
        "pool": DATABASE_POOL,
        # Bound to the asset, not listed in Definitions: every run of it checks its key, whoever
        # supplies the other resources (a job, a test's materialize).
        "io_manager_def": run_partition_check(partitions),
    }


def records_key(ls: LoadedSpec) -> AssetKey:
    """The records asset: the spec's name (the reference's `transactions`)."""
    return AssetKey(ls.spec.name)


def model_key(ls: LoadedSpec) -> AssetKey:
    """The training asset: the spec's model name (the reference's `risk_model`)."""
    return AssetKey(ls.spec.model_name)


def records_with_history(ls: LoadedSpec) -> AssetDep:
    """A day's stored records and the day before: a record's features read its entity's earlier
    records, so the day before must be ingested too (asset backfills then order ingestion ahead of
    scoring across days)."""
    return AssetDep(
        records_key(ls),
        partition_mapping=TimeWindowPartitionMapping(start_offset=-1, allow_nonexistent_upstream_partitions=True),
    )


class BatchScoringConfig(AssetConfig):
    chunk_rows: int = Field(default=8192, ge=4096, description="rows streamed and scored per chunk")
    forward_batch_size: int = Field(
        default=FORWARD_BATCH_SIZE,
        ge=1,
        le=65_536,
        description="rows per forward pass (measured, see bench/findings.md)",
    )
    model_workers: int = Field(
        default=MODEL_WORKERS,
        ge=1,
        le=64,
        description="threads running the forward passes; the torch threads are split",
    )


def score_day(
    context: AssetExecutionContext,
    day: date,
    database: DatabaseResource,
    loaded: tuple[LoadedModel, str],
    config: BatchScoringConfig,
    *,
    as_challenger: bool = False,
    on_chunk: Callable[[ChunkProgress], None] | None = None,
) -> tuple[PartitionReport, TorchPredictor]:
    """The run's partition scored by `loaded` (model, version); returns the report and the predictor."""
    model, version = loaded
    # Scored with the K the model was trained with (predictor.history_length), not a setting.
    predictor = TorchPredictor(
        model=model, model_version=version, spec=database.spec, forward_batch_size=config.forward_batch_size
    )
    producer = BatchProducer(
        run_id=context.run.run_id, partition_key=context.partition_key, code_version=code_version()
    )
    report = score_partition(
        database.spec,
        database.engine,
        predictor,
        day,
        producer=producer,
        history_length=predictor.history_length,
        chunk_rows=config.chunk_rows,
        on_chunk=on_chunk,
        model_workers=config.model_workers,
        as_challenger=as_challenger,
    )
    return report, predictor
