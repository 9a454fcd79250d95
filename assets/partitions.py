"""A run of a day-partitioned asset works on one day of the asset's partitions, or nothing at all.

Dagster checks a key where a launch names it as a partition (`materialize`, a backfill, a
RunRequest), not where a run only carries the `dagster/partition` tag (GraphQL's launchRun, the
launchpad, `dagster job launch --tags`). Such a run is refused twice over: by its IO managers' setup
(`run_partition_check`), before any step starts, and by the first call of each asset body
(`partition_day`). A key outside the set is refused in the same one line by both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import date

from dagster import (
    AssetExecutionContext,
    DagsterInstance,
    DailyPartitionsDefinition,
    Failure,
    InitResourceContext,
    InputContext,
    IOManager,
    IOManagerDefinition,
    OutputContext,
    PartitionsDefinition,
    partition_loading_context,
)

from assets.dagster_tags import MAX_RETRIES_TAG, PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG


def refuse_days_outside(partitions: PartitionsDefinition, keys: Iterable[str], instance: DagsterInstance) -> None:
    """Fails, in one line naming the first of `keys` outside `partitions` and the valid range."""
    # "Now" is the run's partition loading context (Dagster's, or a test's frozen one); the set
    # grows by one day as each UTC day ends, so a key valid at launch is still valid here.
    with partition_loading_context(dynamic_partitions_store=instance):
        outside = [key for key in dict.fromkeys(keys) if not partitions.has_partition_key(key)]
        first, last = partitions.get_first_partition_key(), partitions.get_last_partition_key()
    if outside:
        valid = f"{first} .. {last}" if first and last else "none yet"
        raise Failure(
            description=f"partition {outside[0]!r} is not a day of this asset's partitions (valid now: {valid}, "
            "each UTC day once it has ended); nothing was read or written",
            allow_retries=False,
        )


def run_partition_keys(tags: Mapping[str, str]) -> tuple[str, ...]:
    """The keys a run's tags name: its day, or both ends of its range; none if it is unpartitioned."""
    if tags.get(PARTITION_TAG):
        return (tags[PARTITION_TAG],)
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    return (start, end) if start and end else ()


class OwnTables(IOManager):
    """The IO manager of an asset that writes its own tables: nothing to store, nothing to load."""

    def handle_output(self, context: OutputContext, obj: object) -> None:
        return None

    def load_input(self, context: InputContext) -> object:
        raise Failure(
            description=f"{context.asset_key.to_user_string()} is stored in Tandem's tables, not passed between steps: "
            "declare it in deps and read it through DatabaseResource",
            allow_retries=False,
        )


def run_partition_check(partitions: DailyPartitionsDefinition) -> IOManagerDefinition:
    """The IO manager of each day-partitioned asset: its setup fails the run, before any step
    starts, when the run's key is not a day of `partitions`.

    Setup, because a step works out its inputs' partitions before its body runs, and a key before
    the start trips Dagster's own invariant there. An IO manager, because Dagster refuses a
    resource bound to an asset beside resources passed as the asset's arguments.
    """

    def check_run_partition(context: InitResourceContext) -> OwnTables:
        run, instance = context.run, context.instance
        if run is not None and instance is not None:
            try:
                refuse_days_outside(partitions, run_partition_keys(run.tags), instance)
            except Failure:
                # A failed setup fails the run, which run retries launch again; no retry makes a
                # key valid, so this run is not retried.
                instance.add_run_tags(run.run_id, {MAX_RETRIES_TAG: "0"})
                raise
        return OwnTables()

    return IOManagerDefinition(
        resource_fn=check_run_partition,
        description="Stores nothing (the asset writes its own tables); fails a run whose partition key is not "
        "a day of the partitions before any step starts.",
    )


def partition_day(context: AssetExecutionContext) -> date:
    """The run's day, once it is known to be one of the asset's partitions: the first call of every
    day-partitioned asset body, so a key outside the set fails before anything is read or written.
    No retry makes a key valid.
    """
    partitions = context.assets_def.partitions_def
    if partitions is None or not (context.has_partition_key or context.has_partition_key_range):
        raise Failure(
            description="this asset runs one UTC day per run: launch it with a partition", allow_retries=False
        )
    keys = context.partition_key_range
    refuse_days_outside(partitions, (keys.start, keys.end), context.instance)
    if keys.start != keys.end:
        raise Failure(
            description=f"this asset runs one UTC day per run, not {keys.start} .. {keys.end}: launch a backfill",
            allow_retries=False,
        )
    return date.fromisoformat(keys.start)
