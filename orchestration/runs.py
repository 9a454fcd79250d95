"""Which partitions a Dagster run works on, whichever way it was launched.

A sensor's run, a job backfill's run and a run launched by hand name their day in
`dagster/partition`. An asset backfill names a range instead
(`dagster/asset_partition_range_start` and `..._end`), even a `BackfillPolicy.multi_run(1)` run
of a single day, so a check on `dagster/partition` alone misses every run of the README's backfill.
"""

from __future__ import annotations

from dagster import (
    DagsterInstance,
    DagsterInvalidInvocationError,
    DagsterRun,
    DagsterRunStatus,
    PartitionKeyRange,
    PartitionsDefinition,
    RunsFilter,
)

from assets.dagster_tags import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG

IN_FLIGHT = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]


def partition_label(run: DagsterRun) -> str | None:
    """The run's day, or its range as `start...end` (the UI's notation); None if unpartitioned."""
    if run.tags.get(PARTITION_TAG):
        return run.tags[PARTITION_TAG]
    start, end = run.tags.get(RANGE_START_TAG), run.tags.get(RANGE_END_TAG)
    if start and end:
        return start if start == end else f"{start}...{end}"
    return None


def run_partitions(run: DagsterRun, partitions: PartitionsDefinition) -> set[str]:
    """The partition keys the run works on: its day, or every key of its range."""
    if run.tags.get(PARTITION_TAG):
        return {run.tags[PARTITION_TAG]}
    start, end = run.tags.get(RANGE_START_TAG), run.tags.get(RANGE_END_TAG)
    if not (start and end):
        return set()
    try:
        return set(partitions.get_partition_keys_in_range(PartitionKeyRange(start, end)))
    except (DagsterInvalidInvocationError, ValueError):
        # A range of another partition set (a day partition set parses the keys as dates): none of ours.
        return set()


def partitions_in_flight(instance: DagsterInstance, partitions: PartitionsDefinition) -> set[str]:
    """Every partition key some queued or running run works on."""
    busy: set[str] = set()
    for run in instance.get_runs(RunsFilter(statuses=IN_FLIGHT)):
        busy |= run_partitions(run, partitions)
    return busy
