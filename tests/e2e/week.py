"""The week every e2e module works on, and how a backfill of it is launched and accounted for:
the days, the automation window, and the UI's "Materialize -> Launch backfill" over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

from inference.demo import day_range
from tests.e2e.deployment import Deployment
from tests.e2e.graphql import (
    BACKFILL,
    LAUNCH_BACKFILL,
    MATERIALIZATIONS,
    STALENESS,
    asset_key_text,
    list_runs,
    raise_for_failed_runs,
    run_tags,
)

PARTITIONS = [day.isoformat() for day in day_range(date(2026, 11, 1), 7)]
LOCATION = "tandem"  # workspace.yaml
SCORING_ASSETS = ["path_agreement", "predictions"]  # docs/batch.md's UI backfill (sorted, as assets_of lists them)
BACKFILL_TIMEOUT_S = 420


def promotion_window(window_days: int, evaluated_on: date) -> tuple[list[str], list[str]]:
    """The week's days a promotion rescores and those it leaves stale, when automation evaluates it
    on `evaluated_on` (UTC) with a window of `window_days`. The window counts back from that day and
    the deployment fixed its length when it started: after midnight it holds one day fewer."""
    first = evaluated_on - timedelta(days=window_days)
    rescored = [key for key in PARTITIONS if date.fromisoformat(key) >= first]
    return rescored, [key for key in PARTITIONS if key not in rescored]


@dataclass(frozen=True)
class BackfillOutcome:
    backfill_id: str
    runs: list[dict[str, Any]]
    materialized_by: dict[str, dict[str, str]]  # asset -> partition key -> the run that materialized it


def materialized_partitions(deployment: Deployment, asset: str) -> dict[str, set[str]]:
    result = deployment.graphql(MATERIALIZATIONS, assetKey={"path": [asset]}, partitions=PARTITIONS)["assetOrError"]
    assert result["__typename"] == "Asset", result
    found: dict[str, set[str]] = {}
    for event in result["assetMaterializations"]:
        found.setdefault(event["partition"], set()).add(event["runId"])
    return found


def run_asset_backfill(deployment: Deployment, assets: list[str], title: str) -> BackfillOutcome:
    launched = deployment.graphql(
        LAUNCH_BACKFILL,
        backfillParams={
            "assetSelection": [{"path": [asset]} for asset in assets],
            "partitionNames": PARTITIONS,
            "title": title,
        },
    )["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    backfill_id = launched["backfillId"]
    backfill_tag = [{"key": "dagster/backfill", "value": backfill_id}]

    def finished() -> dict[str, Any] | None:
        state = deployment.graphql(BACKFILL, backfillId=backfill_id)["partitionBackfillOrError"]
        assert state["__typename"] == "PartitionBackfill" and state["isAssetBackfill"], state
        raise_for_failed_runs(deployment, list_runs(deployment, tags=backfill_tag), f"backfill {backfill_id}")
        return None if state["status"] in ("REQUESTED", "CANCELING", "FAILING") else dict(state)

    state = deployment.wait_until(f"backfill {backfill_id}", finished, timeout=BACKFILL_TIMEOUT_S, interval=3)
    assert state["status"] == "COMPLETED_SUCCESS", f"{state}\n{deployment.diagnostics()}"
    materialized_by = {}
    backfill_runs = list_runs(deployment, tags=backfill_tag)
    ours = {run["runId"] for run in backfill_runs}
    # The demo's ingest writes each day's file while its run is in flight: the landing sensor sees
    # the asset backfill's run (tagged with a partition range, not dagster/partition) and waits.
    landing_runs = list_runs(deployment, tags=[{"key": "tandem/trigger", "value": "landing"}])
    assert not landing_runs, [run_tags(run) for run in landing_runs]
    for asset in assets:
        materialized = materialized_partitions(deployment, asset)
        assert sorted(materialized) == PARTITIONS, f"{asset}: {sorted(materialized)}"
        assert all(len(run_ids) == 1 and run_ids <= ours for run_ids in materialized.values()), (
            f"{asset}: {materialized}"
        )
        materialized_by[asset] = {partition: run_ids.pop() for partition, run_ids in materialized.items()}
    return BackfillOutcome(backfill_id, backfill_runs, materialized_by)


def partition_staleness(deployment: Deployment) -> dict[str, tuple[str, list[str]]]:
    (node,) = deployment.graphql(STALENESS, partitions=PARTITIONS)["assetNodes"]
    return {
        partition: (status, sorted(f"{asset_key_text(cause['key'])}: {cause['reason']}" for cause in causes))
        for partition, status, causes in zip(
            PARTITIONS, node["staleStatusByPartition"], node["staleCausesByPartition"], strict=True
        )
    }
