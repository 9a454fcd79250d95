"""The production model pointer as Dagster sees it: an observable asset whose data version is the
tag in production.

The pointer lives in the model store (tandem/modelstore.py), beside every registered version;
the training asset (the spec's `model_name`, the reference's `risk_model`) moves it when a
version is at least as good, and so do `tandem models promote` and `rollback`. Each move is a
new data version of `production_model`, which is what makes the `predictions` partitions scored
under the previous version stale in the UI and what `rescore_after_promotion` reacts to. The
training asset reports its own moves; `production_model_observer` (orchestration/sensors.py)
sees the rest.
"""

from __future__ import annotations

from collections.abc import Iterator

from dagster import (
    AssetObservation,
    AssetsDefinition,
    AssetSpec,
    DataVersion,
    Failure,
    ObserveResult,
    multi_observable_source_asset,
)

# Dagster exports no name for these tags; they are how an observation reported outside an observe
# function (a sensor, another asset) carries a data version, exactly as ObserveResult writes it.
from assets.automation import CHALLENGER_MODEL, PRODUCTION_MODEL
from assets.dagster_tags import DATA_VERSION_IS_USER_PROVIDED_TAG, DATA_VERSION_TAG
from assets.resources import ModelStoreResource
from inference.spec import LoadedSpec

# The challenger's data version while the slot is empty.
NO_CHALLENGER = "none"


def production_model_observation(tag: str) -> AssetObservation:
    return AssetObservation(
        asset_key=PRODUCTION_MODEL,
        tags={DATA_VERSION_TAG: tag, DATA_VERSION_IS_USER_PROVIDED_TAG: "true"},
        metadata={"model_version": tag},
    )


def challenger_model_observation(tag: str | None) -> AssetObservation:
    version = tag or NO_CHALLENGER
    return AssetObservation(
        asset_key=CHALLENGER_MODEL,
        tags={DATA_VERSION_TAG: version, DATA_VERSION_IS_USER_PROVIDED_TAG: "true"},
        metadata={"model_version": version},
    )


def build_challenger_model(ls: LoadedSpec) -> AssetsDefinition:
    @multi_observable_source_asset(
        name="challenger_model",
        specs=[
            AssetSpec(
                CHALLENGER_MODEL,
                deps=[ls.spec.model_name],
                group_name="challenger",
                kinds={"bentoml"},
                description="The challenger version (`tandem models challenge TAG`, or "
                f"{ls.spec.model_name} with register_as: challenger): shadowed online, replayed by "
                f"challenger_predictions. Its data version is the tag, '{NO_CHALLENGER}' while the slot is empty.",
            )
        ],
    )
    def challenger_model(model_store: ModelStoreResource) -> Iterator[ObserveResult]:
        version = model_store.challenger_tag() or NO_CHALLENGER
        yield ObserveResult(
            asset_key=CHALLENGER_MODEL, data_version=DataVersion(version), metadata={"model_version": version}
        )

    return challenger_model


def build_production_model(ls: LoadedSpec) -> AssetsDefinition:
    @multi_observable_source_asset(
        name="production_model",
        specs=[
            AssetSpec(
                PRODUCTION_MODEL,
                deps=[ls.spec.model_name],
                group_name="model",
                kinds={"bentoml"},
                description="The model version in production (the pointer in the BentoML model store): what both "
                "paths score with. Its data version is the tag.",
            )
        ],
    )
    def production_model(model_store: ModelStoreResource) -> Iterator[ObserveResult]:
        tag = model_store.production_tag()
        if tag is None:
            raise Failure(
                description=f"no production model yet: materialize {ls.spec.model_name} or `tandem models promote`"
            )
        yield ObserveResult(asset_key=PRODUCTION_MODEL, data_version=DataVersion(tag), metadata={"model_version": tag})

    return production_model
