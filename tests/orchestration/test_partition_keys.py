"""A run whose partition key is outside the daily partitions fails before any step, however launched.

`materialize(partition_key=...)` is refused by Dagster itself; these runs carry only the
`dagster/partition` tag, as a run launched through GraphQL, the launchpad or `dagster job launch` does.
The refusal is the setup of the run's IO managers (assets/partitions.py): a step works out its
inputs' partitions before its body runs, and trips on a key before the start when an input has been
materialized.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from dagster import (
    AssetMaterialization,
    AssetsDefinition,
    DagsterInstance,
    ExecuteInProcessResult,
    materialize,
    partition_loading_context,
)

from assets.dagster_tags import MAX_RETRIES_TAG, PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG, WILL_RETRY_TAG
from inference.sources import demo_path
from inference.spec import configured_spec
from inference.store import make_engine
from orchestration.definitions import asset_jobs, build_definitions
from tests.orchestration.support import SETTINGS, batch_resources

FUTURE = "2031-01-01"
DAILY_SCORING = ("transactions", "predictions", "path_agreement")
# The first asset of each job: daily_scoring and ingest, rescore, replay_challenger; path_agreement
# runs first when the automation sensor recomputes it alone.
FIRST_STEPS = ("transactions", "predictions", "challenger_predictions", "path_agreement")
# The day before SETTINGS' first partition, and a day long before it.
BEFORE_THE_START = ("2026-10-31", "2020-01-01")


def _launch_with_tag(
    assets: list[AssetsDefinition], selection: tuple[str, ...], key: str, url: str, instance: DagsterInstance
) -> ExecuteInProcessResult:
    return materialize(
        assets,
        selection=list(selection),
        tags={"dagster/partition": key},
        instance=instance,
        resources=batch_resources(url),
        raise_on_error=False,
    )


def _refusal(result: ExecuteInProcessResult) -> str:
    """The one line the run was refused with, by its IO managers' setup, before any step started."""
    assert not result.success
    assert not [event for event in result.all_events if event.event_type_value == "STEP_START"]
    (setup,) = [event for event in result.all_events if event.event_type_value == "RESOURCE_INIT_FAILURE"]
    error = setup.engine_event_data.error
    assert error is not None and error.cls_name == "Failure", error
    line = error.message.strip().partition("Failure: ")[2]
    # The run's own failure names the same line as its cause.
    cause = result.get_run_failure_event().job_failure_data.error
    assert cause is not None and cause.cause is not None and cause.cause.message == error.message
    return line


def _materialized_upstream(instance: DagsterInstance) -> None:
    """A valid day of each asset some job's first step reads: Dagster then works out that step's
    input partitions from the run's key before the step's body runs."""
    for key in ("transactions", "predictions"):
        instance.report_runless_asset_event(AssetMaterialization(key, partition=SETTINGS.partitions_start.isoformat()))


def _valid_now() -> str:
    yesterday = date.fromordinal(datetime.now(UTC).date().toordinal() - 1).isoformat()
    return f"{SETTINGS.partitions_start.isoformat()} .. {yesterday}"


def _stored_rows(url: str) -> dict[str, int]:
    """Rows in each of Tandem's tables there is (none at all when nothing even migrated it)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            names = set(sa.inspect(conn).get_table_names()) - {"alembic_version"}
            return {name: conn.execute(sa.text(f"SELECT count(*) FROM {name}")).scalar_one() for name in names}
    finally:
        engine.dispose()


def test_a_future_day_is_refused_before_anything_is_generated_or_stored(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    result = _launch_with_tag(assets, DAILY_SCORING, FUTURE, sqlite_url, instance)

    message = _refusal(result)
    assert message == (
        f"partition '{FUTURE}' is not a day of this asset's partitions (valid now: {_valid_now()}, "
        "each UTC day once it has ended); nothing was read or written"
    )
    assert "\n" not in message
    # Nothing generated: no landing file for the landing sensor to find; nothing stored.
    files = batch_resources(sqlite_url)["source"].file_source()
    assert not demo_path(files.location, date.fromisoformat(FUTURE), files.pattern.text).exists()
    assert not any(_stored_rows(sqlite_url).values())
    assert not result.get_step_failure_events()
    assert not result.get_asset_materialization_events()


@pytest.mark.parametrize("key", [FUTURE, *BEFORE_THE_START])
@pytest.mark.parametrize("asset", FIRST_STEPS)
def test_every_day_partitioned_asset_refuses_a_key_outside_the_set(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str, asset: str, key: str
) -> None:
    _materialized_upstream(instance)

    message = _refusal(_launch_with_tag(assets, (asset,), key, sqlite_url, instance))

    assert message.startswith(f"partition '{key}' is not a day of this asset's partitions")
    assert not any(_stored_rows(sqlite_url).values())


@pytest.mark.parametrize("key", BEFORE_THE_START)
@pytest.mark.parametrize("job", [name for name, _, _ in asset_jobs(configured_spec())])
def test_every_job_refuses_a_day_before_the_start_in_one_line(
    instance: DagsterInstance, sqlite_url: str, job: str, key: str
) -> None:
    # Refused only in its first step's body, such a run fails in Dagster's own invariant first
    # ("Partition key range start ... is before the partitions definition start time").
    _materialized_upstream(instance)
    job_def = build_definitions(SETTINGS).resolve_job_def(job)

    result = job_def.execute_in_process(
        tags={PARTITION_TAG: key}, instance=instance, resources=batch_resources(sqlite_url), raise_on_error=False
    )

    assert _refusal(result) == (
        f"partition '{key}' is not a day of this asset's partitions (valid now: {_valid_now()}, "
        "each UTC day once it has ended); nothing was read or written"
    )
    assert not any(_stored_rows(sqlite_url).values())


def test_a_range_with_an_end_outside_the_set_is_refused(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    _materialized_upstream(instance)
    result = materialize(
        assets,
        selection=["predictions", "path_agreement"],
        tags={RANGE_START_TAG: "2026-11-01", RANGE_END_TAG: FUTURE},
        instance=instance,
        resources=batch_resources(sqlite_url),
        raise_on_error=False,
    )

    assert _refusal(result).startswith(f"partition '{FUTURE}' is not a day of this asset's partitions")


def test_a_refused_run_is_not_retried_by_run_retries(
    assets: list[AssetsDefinition], sqlite_url: str, tmp_path: Path
) -> None:
    # A failed setup is a run failure, which run retries (orchestration/dagster.yaml) launch again;
    # the same key would be refused again.
    settings = {"run_retries": {"enabled": True, "max_retries": 2}}
    with DagsterInstance.ephemeral(tempdir=str(tmp_path), settings=settings) as retrying:
        result = _launch_with_tag(assets, ("predictions",), BEFORE_THE_START[0], sqlite_url, retrying)
        run = retrying.get_run_by_id(result.run_id)

    _refusal(result)
    assert run is not None
    assert run.tags[MAX_RETRIES_TAG] == "0"
    assert run.tags[WILL_RETRY_TAG] == "false"


# A key that is not a date at all never gets this far: Dagster cannot create its run.
@pytest.mark.parametrize("key", ["2026-10-31", "2026-11-08", "2026-11-09"])
def test_days_before_the_start_or_not_ended_at_the_run_s_now_are_refused(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str, key: str
) -> None:
    # The run's "now" is Dagster's partition loading context: frozen here on 2026-11-08, whose day
    # has not ended, so the set is 2026-11-01 .. 2026-11-07.
    with partition_loading_context(effective_dt=datetime(2026, 11, 8, 12, tzinfo=UTC)):
        message = _refusal(_launch_with_tag(assets, ("transactions",), key, sqlite_url, instance))

    assert message == (
        f"partition '{key}' is not a day of this asset's partitions (valid now: 2026-11-01 .. 2026-11-07, "
        "each UTC day once it has ended); nothing was read or written"
    )
