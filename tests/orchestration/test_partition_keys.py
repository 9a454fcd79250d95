"""A run whose partition key is outside the daily partitions fails before any work, however launched.

`materialize(partition_key=...)` is refused by Dagster itself; these runs carry only the
`dagster/partition` tag, as a run launched through GraphQL, the launchpad or `dagster job launch` does.
"""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest
import sqlalchemy as sa
from dagster import AssetsDefinition, DagsterInstance, ExecuteInProcessResult, materialize, partition_loading_context

from inference.sources import demo_path
from inference.store import make_engine
from tests.orchestration.support import SETTINGS, batch_resources

FUTURE = "2031-01-01"
DAILY_SCORING = ("transactions", "predictions", "path_agreement")
# The first asset of each job: daily_scoring and ingest, rescore, replay_challenger; path_agreement
# runs first when the automation sensor recomputes it alone.
FIRST_STEPS = ("transactions", "predictions", "challenger_predictions", "path_agreement")


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
    assert not result.success
    (failure,) = result.get_step_failure_events()
    assert failure.step_failure_data.user_failure_data is not None, failure.step_failure_data.error
    return str(failure.step_failure_data.user_failure_data.description)


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
    today = datetime.now(UTC).date()
    yesterday = date.fromordinal(today.toordinal() - 1).isoformat()
    assert message == (
        f"partition '{FUTURE}' is not a day of this asset's partitions (valid now: "
        f"{SETTINGS.partitions_start.isoformat()} .. {yesterday}, each UTC day once it has ended); "
        "nothing was read or written"
    )
    assert "\n" not in message
    # Nothing generated: no landing file for the landing sensor to find; nothing stored.
    files = batch_resources(sqlite_url)["source"].file_source()
    assert not demo_path(files.location, date.fromisoformat(FUTURE), files.pattern.text).exists()
    assert not any(_stored_rows(sqlite_url).values())
    assert [step.step_key for step in result.get_step_failure_events()] == ["transactions"]
    assert not result.get_asset_materialization_events()


@pytest.mark.parametrize("asset", FIRST_STEPS)
def test_every_day_partitioned_asset_refuses_a_key_outside_the_set(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str, asset: str
) -> None:
    message = _refusal(_launch_with_tag(assets, (asset,), FUTURE, sqlite_url, instance))

    assert message.startswith(f"partition '{FUTURE}' is not a day of this asset's partitions")
    assert not any(_stored_rows(sqlite_url).values())


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
