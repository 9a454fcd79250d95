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
    Config,
    DailyPartitionsDefinition,
    Failure,
    TimeWindowPartitionMapping,
    partition_loading_context,
)
from pydantic import Field, ValidationError

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
    database error, and a slot of the `database` pool."""
    return {
        "partitions_def": partitions,
        "retry_policy": TRANSIENT_RETRY,
        "backfill_policy": BackfillPolicy.multi_run(1),
        "pool": DATABASE_POOL,
    }


def partition_day(context: AssetExecutionContext) -> date:
    """The run's day, once it is known to be in the asset's partition set: the first call of every
    day-partitioned asset body, so a key outside the set fails before anything is read or written.

    Dagster checks a key where a launch names it as a partition (`materialize`, a backfill, a
    RunRequest), not where a run only carries the `dagster/partition` tag (GraphQL's launchRun,
    `dagster job launch --tags`); every launch path reaches the step. No retry makes a key valid.
    """
    partitions = context.assets_def.partitions_def
    if partitions is None or not (context.has_partition_key or context.has_partition_key_range):
        raise Failure(
            description="this asset runs one UTC day per run: launch it with a partition", allow_retries=False
        )
    keys = context.partition_key_range
    # "Now" is the run's partition loading context (Dagster's, or a test's frozen one); the set
    # grows by one day as each UTC day ends, so a key valid at launch is still valid here.
    with partition_loading_context(dynamic_partitions_store=context.instance):
        outside = [key for key in dict.fromkeys((keys.start, keys.end)) if not partitions.has_partition_key(key)]
        first, last = partitions.get_first_partition_key(), partitions.get_last_partition_key()
    if outside:
        valid = f"{first} .. {last}" if first and last else "none yet"
        raise Failure(
            description=f"partition {outside[0]!r} is not a day of this asset's partitions (valid now: {valid}, "
            "each UTC day once it has ended); nothing was read or written",
            allow_retries=False,
        )
    if keys.start != keys.end:
        raise Failure(
            description=f"this asset runs one UTC day per run, not {keys.start} .. {keys.end}: launch a backfill",
            allow_retries=False,
        )
    return date.fromisoformat(keys.start)


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


class BatchScoringConfig(Config):
    def __init__(self, **config: Any) -> None:
        # Dagster builds the config inside the step, under its RetryPolicy: a refused value would be
        # retried three times, with backoff, before the run failed on the same words.
        try:
            super().__init__(**config)
        except ValidationError as refused:
            raise Failure(description=f"invalid run config: {refused}", allow_retries=False) from refused

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
