"""The run-failure alert: a run that really failed, a webhook that really listens (http.server on a
free local port), and the two ways it must not break: no URL set, a webhook that is down or refuses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import (
    AssetsDefinition,
    DagsterInstance,
    DagsterRun,
    ExecuteInProcessResult,
    RunFailureSensorContext,
    build_run_status_sensor_context,
    materialize,
)
from dagster._core.storage.tags import WILL_RETRY_TAG

from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from orchestration.alerts import build_run_failure_alert
from tests.e2e.deployment import WebhookReceiver
from tests.shared import free_port

DAY = "2026-11-03"
UI_URL = "http://dagster.example:3000"


@pytest.fixture
def failed_run(
    assets: list[AssetsDefinition], tmp_path: Path
) -> Iterator[tuple[DagsterInstance, ExecuteInProcessResult]]:
    """An ingest that fails for real: the day's file is not in the landing folder."""
    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            assets,
            selection=["transactions"],
            partition_key=DAY,
            instance=instance,
            resources={
                "database": DatabaseResource(url=f"sqlite:///{tmp_path / 'tandem.db'}"),
                "model_store": ModelStoreResource(model_name="risk_model"),
                "source": RecordSourceResource(kind="files", location=str(tmp_path / "empty-landing")),
            },
            raise_on_error=False,
        )
        assert not result.success
        yield instance, result


def _sensor_log(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What the sensor logged: a sensor context's logger writes to stderr, not through `logging`'s root."""
    return [line for line in capsys.readouterr().err.splitlines() if "dagster" in line]


def _evaluate(instance: DagsterInstance, result: ExecuteInProcessResult, run: DagsterRun | None = None) -> None:
    sensor = build_run_failure_alert(interval_seconds=5)
    context = build_run_status_sensor_context(
        sensor_name=sensor.name,
        dagster_event=result.get_run_failure_event(),
        dagster_instance=instance,
        dagster_run=run or result.dagster_run,
    ).for_run_failure()
    assert isinstance(context, RunFailureSensorContext)
    sensor(context)


def test_a_failed_run_is_posted_as_json_with_a_link_to_it(
    failed_run: tuple[DagsterInstance, ExecuteInProcessResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    instance, result = failed_run
    with WebhookReceiver() as receiver:
        # Read when the sensor evaluates, not when the module was imported.
        monkeypatch.setenv("TANDEM_ALERT_WEBHOOK_URL", receiver.url)
        monkeypatch.setenv("TANDEM_DAGSTER_UI_URL", UI_URL)
        _evaluate(instance, result)
    (body,) = receiver.received
    assert receiver.content_types == ["application/json"]
    assert body["run_id"] == result.run_id
    assert body["job"] == result.dagster_run.job_name
    assert body["partition"] == DAY
    assert body["url"] == f"{UI_URL}/runs/{result.run_id}"
    assert "transactions" in body["error"]
    (step,) = body["step_errors"]
    assert step["step"] == "transactions"
    assert f"no file for {DAY}" in step["error"], step


def test_a_failure_dagster_relaunches_is_not_paged_its_last_attempt_is(
    failed_run: tuple[DagsterInstance, ExecuteInProcessResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that failed before any step (resources that could not start: the database down) is
    relaunched by run retries; each attempt paged before, up to three pages for one outage."""
    instance, result = failed_run
    attempt = result.dagster_run.with_tags({**result.dagster_run.tags, WILL_RETRY_TAG: "true"})
    last = result.dagster_run.with_tags({**result.dagster_run.tags, WILL_RETRY_TAG: "false"})
    with WebhookReceiver() as receiver:
        monkeypatch.setenv("TANDEM_ALERT_WEBHOOK_URL", receiver.url)
        _evaluate(instance, result, attempt)
        assert receiver.received == []
        _evaluate(instance, result, last)
    assert [body["run_id"] for body in receiver.received] == [result.run_id]


def test_without_a_url_the_failure_is_logged_in_one_line(
    failed_run: tuple[DagsterInstance, ExecuteInProcessResult],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    instance, result = failed_run
    monkeypatch.delenv("TANDEM_ALERT_WEBHOOK_URL", raising=False)
    capsys.readouterr()
    _evaluate(instance, result)
    lines = [line for line in _sensor_log(capsys) if result.run_id in line]
    assert len(lines) == 1 and "TANDEM_ALERT_WEBHOOK_URL is unset" in lines[0], lines


@pytest.mark.parametrize("webhook", ["refuses", "down"])
def test_a_failing_webhook_is_logged_and_never_breaks_the_sensor(
    failed_run: tuple[DagsterInstance, ExecuteInProcessResult],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    webhook: str,
) -> None:
    instance, result = failed_run
    capsys.readouterr()
    with WebhookReceiver(status=500) as receiver:
        url = receiver.url if webhook == "refuses" else f"http://127.0.0.1:{free_port()}/nobody-listens"
        monkeypatch.setenv("TANDEM_ALERT_WEBHOOK_URL", url)
        monkeypatch.setenv("TANDEM_ALERT_TIMEOUT_S", "2")
        _evaluate(instance, result)  # does not raise
    assert len(receiver.received) == (1 if webhook == "refuses" else 0)
    (line,) = [line for line in _sensor_log(capsys) if "alert webhook failed" in line]
    assert ("HTTP 500" if webhook == "refuses" else "ConnectError") in line, line
