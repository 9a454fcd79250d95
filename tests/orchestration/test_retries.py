"""Step retries: a transient database error is retried by the RetryPolicy, a bug is not."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from dagster import AssetsDefinition, DagsterEvent, DagsterEventType, DagsterInstance, ExecuteInProcessResult
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from assets.resources import DatabaseResource
from tests.orchestration.support import batch_resources, run_partition

pytestmark = pytest.mark.reliability


class FlakyDatabase(DatabaseResource):
    """The real resource, except that the first `failures` requests for the engine raise `error`.

    Attempts are counted in a file, so the count survives however Dagster rebuilds the resource
    between step attempts.
    """

    attempts_file: str
    failures: int = 1
    error: Literal["connection_lost", "bug"] = "connection_lost"

    @property
    def engine(self) -> Engine:
        counter = Path(self.attempts_file)
        attempt = (int(counter.read_text()) if counter.exists() else 0) + 1
        counter.write_text(str(attempt))
        if attempt <= self.failures:
            if self.error == "bug":
                raise ValueError("a bug fails identically on every attempt")
            raise OperationalError("SELECT 1", {}, ConnectionResetError("server closed the connection unexpectedly"))
        return super().engine


def _events(result: ExecuteInProcessResult, kind: DagsterEventType) -> list[DagsterEvent]:
    return [event for event in result.all_events if event.event_type == kind]


def test_transient_database_error_is_retried_and_the_run_succeeds(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str, tmp_path: Path
) -> None:
    attempts = tmp_path / "attempts"
    flaky = FlakyDatabase(url=sqlite_url, attempts_file=str(attempts))

    # The production policy (delay 2 s, exponential, +/- jitter): the first retry waits 0-4 s.
    result = run_partition(
        assets, batch_resources(sqlite_url, rows_per_day=500, database=flaky), instance, selection=["transactions"]
    )

    assert result.success
    assert attempts.read_text() == "2"
    assert len(_events(result, DagsterEventType.STEP_UP_FOR_RETRY)) == 1
    assert len(_events(result, DagsterEventType.STEP_RESTARTED)) == 1
    (materialization,) = result.asset_materializations_for_node("transactions")
    rows_stored = materialization.metadata["rows_stored"].value
    assert isinstance(rows_stored, int) and rows_stored > 0


def test_a_database_down_when_the_run_starts_is_a_step_retried_with_backoff(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    """Connecting (and migrating) when the resources started made a database outage at run start
    a failure of the run before any step: no RetryPolicy saw it, and run retries relaunched it at
    once, without backoff. Now it is the step's transient error, retried with backoff."""
    down = DatabaseResource(url="postgresql://postgres@127.0.0.1:9/nothing-listens-here")
    result = run_partition(
        assets,
        batch_resources(sqlite_url, rows_per_day=500, database=down),
        instance,
        selection=["transactions"],
        raise_on_error=False,
    )

    assert not result.success
    assert len(_events(result, DagsterEventType.STEP_UP_FOR_RETRY)) == 3
    assert _events(result, DagsterEventType.STEP_FAILURE)


def test_non_transient_error_fails_at_once_without_retry(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str, tmp_path: Path
) -> None:
    attempts = tmp_path / "attempts"
    broken = FlakyDatabase(url=sqlite_url, attempts_file=str(attempts), failures=10, error="bug")

    result = run_partition(
        assets,
        batch_resources(sqlite_url, rows_per_day=500, database=broken),
        instance,
        selection=["transactions"],
        raise_on_error=False,
    )

    assert not result.success
    assert attempts.read_text() == "1"
    assert _events(result, DagsterEventType.STEP_UP_FOR_RETRY) == []
    (failure,) = _events(result, DagsterEventType.STEP_FAILURE)
    user_failure = failure.step_failure_data.user_failure_data
    assert user_failure is not None and "ValueError: a bug fails identically" in str(user_failure.description)


def test_a_model_that_does_not_load_fails_predictions_at_once_without_retry(
    assets: list[AssetsDefinition], instance: DagsterInstance, sqlite_url: str
) -> None:
    # No production version of this name: the store on disk says so on every attempt alike.
    resources = batch_resources(sqlite_url, rows_per_day=500, model_name="risk_model_never_registered")

    result = run_partition(assets, resources, instance, selection=["predictions"], raise_on_error=False)

    assert not result.success
    assert _events(result, DagsterEventType.STEP_UP_FOR_RETRY) == []
    (failure,) = _events(result, DagsterEventType.STEP_FAILURE)
    user_failure = failure.step_failure_data.user_failure_data
    assert user_failure is not None
    assert str(user_failure.description).startswith("the production model could not be loaded: LookupError: ")
