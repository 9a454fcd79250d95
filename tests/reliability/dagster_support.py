"""The production Dagster assets and resources, pointed at this suite's model and databases.

Free of pytest, so the two racing child processes build exactly what the tests build.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dagster import AssetsDefinition, DagsterInstance, ExecuteInProcessResult, materialize

from orchestration.definitions import build_definitions
from orchestration.resources import DatabaseResource, DemoSourceResource, ModelStoreResource
from orchestration.settings import OrchestrationSettings
from tests.reliability.support import HISTORY_LENGTH, MODEL_NAME, PARTITIONS_START

SETTINGS = OrchestrationSettings(partitions_start=PARTITIONS_START, history_length=HISTORY_LENGTH)
DEMO_SEED = 7
# Smallest chunk the asset allows, so a partition of a few thousand rows spans several chunks.
RUN_CONFIG = {"ops": {"predictions": {"config": {"chunk_rows": 4096, "parity_sample": 8}}}}


def batch_assets() -> list[AssetsDefinition]:
    defs = build_definitions(SETTINGS)
    return [asset for asset in defs.assets or [] if isinstance(asset, AssetsDefinition)]


def batch_resources(url: str | None, *, rows_per_day: int = 12_000, poison_rate: float = 0.01) -> dict[str, Any]:
    """`url` None: the DatabaseResource reads DATABASE_URL when the run starts, as in production."""
    return {
        "database": DatabaseResource(url=url),
        "model_store": ModelStoreResource(model_name=MODEL_NAME),
        "source": DemoSourceResource(seed=DEMO_SEED, rows_per_day=rows_per_day, poison_rate=poison_rate),
    }


def materialize_partition(
    assets: list[AssetsDefinition],
    resources: Mapping[str, Any],
    instance: DagsterInstance,
    partition_key: str,
    *,
    selection: Iterable[str] = ("transactions", "predictions"),
    raise_on_error: bool = True,
) -> ExecuteInProcessResult:
    return materialize(
        assets,
        selection=list(selection),
        partition_key=partition_key,
        instance=instance,
        resources=dict(resources),
        run_config=RUN_CONFIG if "predictions" in selection else {},
        raise_on_error=raise_on_error,
    )


def materialize_predictions(
    assets: list[AssetsDefinition],
    resources: Mapping[str, Any],
    instance: DagsterInstance,
    partition_key: str,
    *,
    raise_on_error: bool = True,
) -> ExecuteInProcessResult:
    return materialize_partition(
        assets, resources, instance, partition_key, selection=("predictions",), raise_on_error=raise_on_error
    )
