"""A run config an asset's own validation refuses fails its step at once, in one line naming the
field: never retried by the step's RetryPolicy, never a pydantic traceback."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import pytest
from dagster import AssetsDefinition, Config, ConfigurableResource, DagsterInstance, materialize

import assets as assets_package
from assets.config import AssetConfig
from tests.orchestration.support import PARTITION, batch_resources

# (asset, its run config, the step's failure); a partitioned asset runs on PARTITION.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "path_agreement",
        {"decision_threshold": 2},
        "invalid run config: decision_threshold=2.0: Input should be less than or equal to 1",
    ),
    ("challenger_report", {"days": 0}, "invalid run config: days=0: Input should be greater than or equal to 1"),
    ("risk_model", {"epochs": 0}, "invalid run config: epochs=0: Input should be greater than or equal to 1"),
    (
        "risk_model",
        {"force_promote": True, "register_as": "challenger"},
        "invalid run config: force_promote: true goes with register_as: production (a challenger is never promoted)",
    ),
    (
        "predictions",
        {"chunk_rows": 1, "reject_rate_max": 2},
        "invalid run config: chunk_rows=1: Input should be greater than or equal to 4096; "
        "reject_rate_max=2.0: Input should be less than or equal to 1",
    ),
    (
        "challenger_predictions",
        {"model_workers": 0},
        "invalid run config: model_workers=0: Input should be greater than or equal to 1",
    ),
]
PARTITIONED = {"path_agreement", "predictions", "challenger_predictions"}


@pytest.mark.parametrize(("asset", "config", "refusal"), REFUSED, ids=[f"{a}-{'-'.join(c)}" for a, c, _ in REFUSED])
def test_a_refused_config_fails_the_step_at_once_in_one_line(
    assets: list[AssetsDefinition],
    instance: DagsterInstance,
    sqlite_url: str,
    asset: str,
    config: dict[str, Any],
    refusal: str,
) -> None:
    # Accepted by Dagster's types, refused by the bounds inside the step: a plain error there is
    # retried by the RetryPolicy, then reported as "Exceeded max_retries of 3".
    result = materialize(
        assets,
        selection=[asset],
        partition_key=PARTITION if asset in PARTITIONED else None,
        instance=instance,
        resources=batch_resources(sqlite_url),
        run_config={"ops": {asset: {"config": config}}},
        raise_on_error=False,
    )

    assert not result.success
    assert not [event for event in result.all_events if event.event_type_value == "STEP_UP_FOR_RETRY"]
    (failure,) = result.get_step_failure_events()
    user_failure = failure.step_failure_data.user_failure_data
    assert user_failure is not None, failure.step_failure_data.error
    assert user_failure.description == refusal


def test_every_asset_config_refuses_through_the_one_base() -> None:
    for module in pkgutil.iter_modules(assets_package.__path__):
        importlib.import_module(f"{assets_package.__name__}.{module.name}")
    pending, configs = list(Config.__subclasses__()), []
    while pending:
        config = pending.pop()
        pending.extend(config.__subclasses__())
        ours = config.__module__.startswith(f"{assets_package.__name__}.")
        if ours and config is not AssetConfig and not issubclass(config, ConfigurableResource):
            configs.append(config)

    assert len(configs) >= 5
    assert [config.__name__ for config in configs if not issubclass(config, AssetConfig)] == []
