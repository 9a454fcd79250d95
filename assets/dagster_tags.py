"""Dagster's own tag names that Tandem writes or reads: the one adapter for names Dagster uses on
its events and runs but does not export (docs/decisions/0010). Kept as plain strings, never
imported from Dagster's private modules; tests/test_dagster_tags.py and
tests/orchestration/test_run_tags.py fail on the upgrade that renames one."""

from __future__ import annotations

# An observation's data version, as observable source assets record it.
DATA_VERSION_TAG = "dagster/data_version"
DATA_VERSION_IS_USER_PROVIDED_TAG = "dagster/data_version_is_user_provided"
# Set on a failed run that Dagster's run retries will launch again.
WILL_RETRY_TAG = "dagster/will_retry"
# A run's partition: its day, or the range an asset backfill gives even a run of a single day.
PARTITION_TAG = "dagster/partition"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
# A run's own limit on run retries, read when it fails: "0" keeps it from being launched again.
MAX_RETRIES_TAG = "dagster/max_retries"
