"""The composition root loads, and the batch path's scheduling and retry contract is what we promise."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetsDefinition,
    AutomationConditionSensorDefinition,
    BackfillPolicy,
    Backoff,
    DefaultSensorStatus,
    Definitions,
    RunRequest,
    build_schedule_context,
    instance_for_test,
)

from orchestration.definitions import SettingsRefused, checked_settings, defs

PARTITIONED = ("transactions", "predictions", "path_agreement")


def _asset(key: str) -> AssetsDefinition:
    return defs.resolve_assets_def(AssetKey(key))


def test_definitions_load() -> None:
    Definitions.validate_loadable(defs)
    repository = defs.get_repository_def()
    assert {"transactions", "risk_model", "predictions"} <= {
        key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()
    }
    assert repository.has_job("daily_scoring")


def test_path_agreement_runs_after_predictions_in_both_scoring_jobs() -> None:
    assert _asset("path_agreement").partitions_def == _asset("predictions").partitions_def
    assert AssetKey("predictions") in _asset("path_agreement").dependency_keys
    for job_name in ("daily_scoring", "rescore_predictions"):
        selected = defs.resolve_job_def(job_name).asset_layer.selected_asset_keys
        assert {AssetKey("predictions"), AssetKey("path_agreement")} <= selected, job_name


def test_nightly_schedule_scores_the_daily_job_at_two_utc() -> None:
    schedule = defs.resolve_schedule_def("daily_scoring_schedule")

    assert schedule.cron_schedule == "0 2 * * *"
    assert schedule.execution_timezone == "UTC"
    assert schedule.job_name == "daily_scoring"
    job = defs.resolve_job_def("daily_scoring")
    assert {key.to_user_string() for key in job.asset_layer.selected_asset_keys} == set(PARTITIONED)


def test_the_nightly_run_leaves_a_day_the_landing_sensor_ingested_already() -> None:
    """landing_sensor runs a day when its file lands; the schedule derived from the partitioned job
    ran it again at 02:00 (it deduplicates only against its own runs): every day scored twice."""
    schedule = defs.resolve_schedule_def("daily_scoring_schedule")
    at_two = datetime(2026, 11, 5, 2, 0, tzinfo=UTC)
    repository = defs.get_repository_def()
    with instance_for_test() as instance:  # a schedule's context takes a persistent instance
        first = schedule.evaluate_tick(
            build_schedule_context(instance=instance, scheduled_execution_time=at_two, repository_def=repository)
        )
        assert [(request.partition_key, request.run_key) for request in first.run_requests or []] == [
            ("2026-11-04", "2026-11-04")
        ]
        assert all(isinstance(request, RunRequest) for request in first.run_requests or [])

        instance.report_runless_asset_event(
            AssetMaterialization("transactions", partition="2026-11-04", metadata={"source_version": "v1"})
        )
        again = schedule.evaluate_tick(
            build_schedule_context(instance=instance, scheduled_execution_time=at_two, repository_def=repository)
        )
        assert not again.run_requests
        assert again.skip_message == "2026-11-04 was ingested already (source version v1)"


@pytest.mark.parametrize("key", PARTITIONED)
def test_partitioned_assets_backfill_one_run_per_partition_with_backoff_retries(key: str) -> None:
    asset = _asset(key)

    assert asset.partitions_def is not None
    assert asset.backfill_policy == BackfillPolicy.multi_run(1)
    policy = asset.op.retry_policy
    assert policy is not None
    assert policy.max_retries >= 1
    assert policy.backoff == Backoff.EXPONENTIAL
    assert policy.delay and policy.delay > 0


@pytest.mark.parametrize("key", [*PARTITIONED, "risk_model"])
def test_every_asset_that_holds_connections_is_in_the_database_pool(key: str) -> None:
    assert _asset(key).op.pool == "database"


@pytest.mark.parametrize("key", [*PARTITIONED, "risk_model"])
def test_every_materialized_asset_has_a_code_version_for_staleness(key: str) -> None:
    assert _asset(key).code_versions_by_key[AssetKey(key)]


def test_automation_and_alerts_are_on_by_default() -> None:
    """The daemon evaluates AutomationConditions only through a running automation sensor."""
    automation = defs.resolve_sensor_def("scoring_automation_sensor")
    assert isinstance(automation, AutomationConditionSensorDefinition)
    assert automation.default_status == DefaultSensorStatus.RUNNING
    assert _asset("predictions").automation_conditions_by_key[AssetKey("predictions")] is not None
    assert _asset("path_agreement").automation_conditions_by_key[AssetKey("path_agreement")] is not None
    for name in ("production_model_observer", "run_failure_alert_sensor"):
        assert defs.resolve_sensor_def(name).default_status == DefaultSensorStatus.RUNNING, name
    assert "model_promotion_sensor" not in {sensor.name for sensor in defs.sensors or []}


@pytest.mark.parametrize(
    ("variable", "value"),
    [("TANDEM_SOURCE_FORMAT", "xml"), ("DATABASE_URL", "sqlite://"), ("TANDEM_SCHEDULE_HOUR_UTC", "25")],
)
def test_a_refused_setting_fails_the_code_location_in_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """Dagster shows the load error; pydantic's own named the Python field over several lines."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsRefused) as refused:
        checked_settings()
    assert str(refused.value).startswith(f"{variable}={value!r}: ") and "\n" not in str(refused.value)
