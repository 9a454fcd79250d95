"""A failed run, said out loud: one JSON POST per failed run to a webhook (Slack workflow, Teams,
an incident tool's generic endpoint, ...), or one log line when none is configured.

The URL is read when the sensor evaluates (pydantic-settings), never at import, so setting or
changing TANDEM_ALERT_WEBHOOK_URL needs no code change, only a restart of the code location. A
webhook that is down or refuses the alert is logged and forgotten: an alerting outage must not
stop the sensor, and the run's failure stays on its page in the UI.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx
from dagster import DefaultSensorStatus, RunFailureSensorContext, SensorDefinition, run_failure_sensor
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from assets.dagster_tags import WILL_RETRY_TAG
from orchestration.runs import partition_label

# Enough to say what broke; the run page has the rest.
MAX_ERROR_CHARS = 2000


class AlertSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    alert_webhook_url: str | None = Field(
        default=None, description="where a failed run is POSTed as JSON; unset: logged"
    )
    alert_timeout_s: float = Field(default=5.0, gt=0, description="per POST; a slow webhook must not hold the sensor")
    dagster_ui_url: str = Field(default="http://127.0.0.1:3000", description="base of the run links in alerts")


class _ErrorInfo(Protocol):
    """What a step failure's error (Dagster's SerializableErrorInfo, not exported) is read for."""

    @property
    def cls_name(self) -> str | None: ...
    @property
    def message(self) -> str: ...
    @property
    def cause(self) -> _ErrorInfo | None: ...


def _chain(error: _ErrorInfo) -> list[_ErrorInfo]:
    found = [error]
    while (cause := found[-1].cause) is not None and len(found) < 5:
        found.append(cause)
    return found


def failure_payload(context: RunFailureSensorContext, ui_url: str) -> dict[str, Any]:
    run = context.dagster_run
    step_errors = []
    for event in context.get_step_failure_events():
        error = event.step_failure_data.error
        if error is not None:  # the message and the exception chain, without the stack
            text = "\n".join(f"{item.cls_name}: {item.message.strip()}" for item in _chain(error))
            step_errors.append({"step": event.step_key, "error": text[:MAX_ERROR_CHARS]})
    return {
        "event": "dagster_run_failure",
        "run_id": run.run_id,
        "job": run.job_name,
        "partition": partition_label(run),
        "error": (context.failure_event.message or "")[:MAX_ERROR_CHARS],
        "step_errors": step_errors,
        "trigger": run.tags.get("tandem/trigger"),
        "url": f"{ui_url.rstrip('/')}/runs/{run.run_id}",
    }


def post_alert(url: str, payload: dict[str, Any], timeout_s: float) -> str | None:
    """POSTs the alert; returns what went wrong, or None. Never raises for the webhook's failures."""
    try:
        response = httpx.post(url, json=payload, timeout=timeout_s)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        return f"{type(error).__name__}: {error}"
    if response.is_success:
        return None
    return f"HTTP {response.status_code}: {response.text[:200]}"


def build_run_failure_alert(interval_seconds: int) -> SensorDefinition:
    @run_failure_sensor(
        name="run_failure_alert_sensor",
        minimum_interval_seconds=interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        description="A failed run of any job of this code location -> a JSON POST to TANDEM_ALERT_WEBHOOK_URL "
        "(run id, job, partition, error, a link to the run); a log line when it is unset.",
    )
    def run_failure_alert_sensor(context: RunFailureSensorContext) -> None:
        settings = AlertSettings()
        payload = failure_payload(context, settings.dagster_ui_url)
        what = f"run {payload['run_id']} of {payload['job']} failed (partition {payload['partition']})"
        # Dagster marks a failure its run retries will relaunch (a run worker lost, resources that
        # failed to start); the last attempt is not marked. One page per failure, not per attempt.
        if context.dagster_run.tags.get(WILL_RETRY_TAG) == "true":
            context.log.info(f"{what}; Dagster retries it, no alert sent")
            return
        if not settings.alert_webhook_url:
            context.log.info(f"{what}; TANDEM_ALERT_WEBHOOK_URL is unset, no alert sent")
            return
        problem = post_alert(settings.alert_webhook_url, payload, settings.alert_timeout_s)
        if problem is None:
            context.log.info(f"{what}; alert sent")
        else:
            context.log.error(f"{what}; the alert webhook failed, not retried: {problem}")

    return run_failure_alert_sensor
