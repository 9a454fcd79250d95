"""Driving the deployment as the UI does, through Dagster's GraphQL API: the queries, and the
waits an operator does by eye (runs to finish, a sensor's next tick, automation to settle).
Shared by the e2e tests; nothing here knows which week or model they use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.e2e.deployment import SENSOR_INTERVAL_SECONDS, Deployment

SENSOR_RUNS_TIMEOUT_S = 180


FAILED_RUN_STATUSES = {"FAILURE", "CANCELED"}


REPOSITORIES = """
query Repositories {
  repositoriesOrError {
    __typename
    ... on RepositoryConnection {
      nodes { name location { name } sensors { name sensorState { status } } }
    }
    ... on PythonError { message }
  }
}
"""


# What the UI's "Materialize… -> Launch backfill" sends for assets: a selection and partition names.
LAUNCH_BACKFILL = """
mutation LaunchBackfill($backfillParams: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $backfillParams) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on Error { message }
    ... on PythonError { stack }
  }
}
"""


BACKFILL = """
query Backfill($backfillId: String!) {
  partitionBackfillOrError(backfillId: $backfillId) {
    __typename
    ... on PartitionBackfill { id status isAssetBackfill error { message } }
    ... on Error { message }
  }
}
"""


RUNS = """
query Runs($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs {
      results {
        runId jobName status creationTime startTime endTime
        tags { key value }
        assetSelection { path }
        stepStats { stepKey status startTime endTime }
      }
    }
    ... on Error { message }
  }
}
"""


RUN_EVENTS = """
query RunEvents($runId: ID!) {
  logsForRun(runId: $runId) {
    __typename
    ... on EventConnection { events { __typename ... on MessageEvent { message level stepKey timestamp } } }
    ... on Error { message }
  }
}
"""


LAUNCH_RUN = """
mutation LaunchRun($executionParams: ExecutionParams!) {
  launchRun(executionParams: $executionParams) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on Error { message }
    ... on PythonError { message }
  }
}
"""


MATERIALIZATIONS = """
query Materializations($assetKey: AssetKeyInput!, $partitions: [String!]) {
  assetOrError(assetKey: $assetKey) {
    __typename
    ... on Asset { assetMaterializations(partitions: $partitions) { partition runId } }
    ... on Error { message }
  }
}
"""


STALENESS = """
query Staleness($partitions: [String!]!) {
  assetNodes(assetKeys: [{path: ["predictions"]}]) {
    staleStatusByPartition(partitions: $partitions)
    staleCausesByPartition(partitions: $partitions) { reason category key { path } }
  }
}
"""


DATA_VERSION = """
query DataVersion($path: [String!]!) { assetNodes(assetKeys: [{path: $path}]) { dataVersion } }
"""


SENSOR_TICKS = """
query SensorTicks($sensorSelector: SensorSelector!, $afterTimestamp: Float) {
  sensorOrError(sensorSelector: $sensorSelector) {
    __typename
    ... on Sensor {
      sensorState { status ticks(afterTimestamp: $afterTimestamp, limit: 10) { status timestamp runIds skipReason } }
    }
    ... on Error { message }
  }
}
"""


SENSOR_TICK = """
query SensorTick($sensorSelector: SensorSelector!, $tickId: ID!) {
  sensorOrError(sensorSelector: $sensorSelector) {
    __typename
    ... on Sensor { sensorState { tick(tickId: $tickId) { timestamp } } }
    ... on Error { message }
  }
}
"""


ASSET_GRAPH = """
query AssetGraph {
  assetNodes {
    assetKey { path }
    groupName
    isExecutable
    isObservable
    isPartitioned
    dependencyKeys { path }
    dependedByKeys { path }
  }
}
"""


@dataclass(frozen=True)
class Repository:
    location: str
    name: str
    sensors: dict[str, str]  # name -> status

    def selector(self) -> dict[str, str]:
        return {"repositoryLocationName": self.location, "repositoryName": self.name}


def asset_key_text(asset_key: dict[str, Any]) -> str:
    return "/".join(asset_key["path"])


def run_tags(run: dict[str, Any]) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in run["tags"]}


def assets_of(run: dict[str, Any]) -> list[str]:
    return sorted(asset_key_text(key) for key in run["assetSelection"] or [])


def list_runs(deployment: Deployment, **run_filter: Any) -> list[dict[str, Any]]:
    result = deployment.graphql(RUNS, filter=run_filter)["runsOrError"]
    assert result["__typename"] == "Runs", result
    return list(result["results"])


def run_events(deployment: Deployment, run_id: str) -> list[dict[str, Any]]:
    logs = deployment.graphql(RUN_EVENTS, runId=run_id)["logsForRun"]
    assert logs["__typename"] == "EventConnection", logs
    return list(logs["events"])


def run_errors(deployment: Deployment, run_ids: list[str]) -> str:
    """The ERROR-level events of each run: what an operator reads on the run page."""
    lines = []
    for run_id in run_ids:
        for event in run_events(deployment, run_id):
            if event.get("level") == "ERROR":
                lines.append(f"{run_id} {event.get('stepKey') or ''}: {event['message'][:1500]}")
    return "\n".join(lines) or "(no error events)"


def raise_for_failed_runs(deployment: Deployment, runs: list[dict[str, Any]], what: str) -> None:
    failed = [run["runId"] for run in runs if run["status"] in FAILED_RUN_STATUSES]
    if failed:
        raise AssertionError(
            f"{what}: runs {failed} failed\n{run_errors(deployment, failed)}\n{deployment.diagnostics()}"
        )


def sensor_ticks_after(
    deployment: Deployment, repository: Repository, sensor: str, after: float, *, timeout: float
) -> list[dict[str, Any]]:
    """The sensor's evaluations that ended after `after`, once there is at least one."""
    selector = {**repository.selector(), "sensorName": sensor}

    def ticks_after() -> list[dict[str, Any]] | None:
        state = deployment.graphql(SENSOR_TICKS, sensorSelector=selector, afterTimestamp=after)["sensorOrError"]
        assert state["__typename"] == "Sensor", state
        ticks = [tick for tick in state["sensorState"]["ticks"] if tick["status"] != "STARTED"]
        return ticks or None

    return deployment.wait_until(f"a {sensor} tick after {after:.0f}", ticks_after, timeout=timeout, interval=1)


def requested_at(deployment: Deployment, repository: Repository, sensor: str, run: dict[str, Any]) -> float:
    """When the tick of `sensor` that requested `run` evaluated (the run's dagster/tick tag)."""
    selector = {**repository.selector(), "sensorName": sensor}
    state = deployment.graphql(SENSOR_TICK, sensorSelector=selector, tickId=run_tags(run)["dagster/tick"])
    assert state["sensorOrError"]["__typename"] == "Sensor", state
    return float(state["sensorOrError"]["sensorState"]["tick"]["timestamp"])


def wait_for_first_run(
    deployment: Deployment,
    repository: Repository,
    sensor: str,
    find_runs: Callable[[], list[dict[str, Any]]],
    after: float,
) -> list[dict[str, Any]]:
    """Wait until `find_runs` lists a run; on a timeout, say what each tick of `sensor` since
    `after` requested, which tells a sensor that requested nothing from runs that went missing."""
    try:
        return deployment.wait_until(
            f"a run requested by {sensor}", lambda: find_runs() or None, timeout=SENSOR_RUNS_TIMEOUT_S
        )
    except AssertionError as timed_out:
        selector = {**repository.selector(), "sensorName": sensor}
        state = deployment.graphql(SENSOR_TICKS, sensorSelector=selector, afterTimestamp=after)["sensorOrError"]
        ticks = [(tick["timestamp"] - after, tick["status"], tick["runIds"]) for tick in state["sensorState"]["ticks"]]
        raise AssertionError(f"{sensor}'s latest ticks since then (s, status, runs): {ticks}\n{timed_out}") from None


def wait_for_runs_covering(
    deployment: Deployment,
    find_runs: Callable[[], list[dict[str, Any]]],
    partitions: list[str],
    what: str,
) -> list[dict[str, Any]]:
    """Wait until the runs `find_runs` lists have all succeeded and cover `partitions` (any failed
    one fails the test at once, with its logs); returns them."""

    def covered() -> list[dict[str, Any]] | None:
        runs = find_runs()
        raise_for_failed_runs(deployment, runs, what)
        done = all(run["status"] == "SUCCESS" for run in runs)
        return runs if done and {run_tags(run).get("dagster/partition") for run in runs} >= set(partitions) else None

    try:
        return deployment.wait_until(what, covered, timeout=SENSOR_RUNS_TIMEOUT_S)
    except AssertionError as timed_out:
        # The servers' log tails show the last seconds only; which runs exist says what went missing.
        found = sorted((run_tags(run).get("dagster/partition") or "", run["status"]) for run in find_runs())
        raise AssertionError(f"wanted runs covering {partitions}, found {found}\n{timed_out}") from None


def assert_nothing_requested_after(
    deployment: Deployment, repository: Repository, sensor: str, runs: list[dict[str, Any]], *, timeout: float
) -> None:
    """One more evaluation of `sensor` after `runs` ended requests nothing: each change is requested once."""
    ticks = sensor_ticks_after(deployment, repository, sensor, max(run["endTime"] for run in runs), timeout=timeout)
    assert all(not tick["runIds"] for tick in ticks), ticks


def wait_until_settled(deployment: Deployment, repository: Repository, sensor: str) -> float:
    """Every run over and one evaluation of `sensor` since then that requested nothing: what the
    earlier tests set going (path_agreement after a late-records rescore) is done. Returns that time."""

    def settled() -> float | None:
        runs = list_runs(deployment)
        if any(run["endTime"] is None for run in runs):
            return None
        quiet_since = max((run["endTime"] for run in runs), default=0.0)
        selector = {**repository.selector(), "sensorName": sensor}
        state = deployment.graphql(SENSOR_TICKS, sensorSelector=selector, afterTimestamp=quiet_since)
        ticks = [tick for tick in state["sensorOrError"]["sensorState"]["ticks"] if tick["status"] != "STARTED"]
        return time.time() if ticks and all(not tick["runIds"] for tick in ticks) else None

    return deployment.wait_until(f"no run left for {sensor} to start", settled, timeout=SENSOR_RUNS_TIMEOUT_S)


def wait_for_production_model(deployment: Deployment, tag: str) -> None:
    def observed() -> bool | None:
        (node,) = deployment.graphql(DATA_VERSION, path=["production_model"])["assetNodes"]
        return True if node["dataVersion"] == tag else None

    deployment.wait_until(f"production_model observed at {tag}", observed, timeout=20 * SENSOR_INTERVAL_SECONDS)
