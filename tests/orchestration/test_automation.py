"""Declarative automation and staleness, evaluated as the daemon would (`evaluate_automation_conditions`)
against real materializations: a promotion or a bump of predictions' code version rescores the
scored days of the window once, path_agreement follows predictions, and the staleness the UI shows
names the cause."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, date, datetime
from typing import Any

import pytest
from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetsDefinition,
    DagsterInstance,
    Definitions,
    SensorResult,
    build_sensor_context,
    evaluate_automation_conditions,
)
from dagster._core.definitions.declarative_automation.automation_condition_tester import (
    EvaluateAutomationConditionsResult,
)

# Dagster's own helper for what the UI's staleness shows (CachingStaleStatusResolver); not exported.
from dagster._utils.test.data_versions import get_stale_status_resolver

from assets.model import production_model_observation
from assets.resources import ModelStoreResource
from orchestration.definitions import build_definitions
from tests.e2e.deployment import RESCORE_WINDOW_ENV, rescore_window_days
from tests.e2e.week import PARTITIONS, promotion_window
from tests.orchestration.support import SETTINGS, batch_resources, predictions_config, run_partition
from tests.shared import register_untrained_model

MODEL = "risk_model_automation_tests"
ROWS = 400
PREDICTIONS, PATH_AGREEMENT = AssetKey("predictions"), AssetKey("path_agreement")
# Evaluated as of 2026-11-05 03:00 UTC: the latest daily partition is 2026-11-04, so a window of two
# days is 11-03 and 11-04. 11-02 is scored but outside it; 11-04 is inside but never scored.
EVALUATED_AT = datetime(2026, 11, 5, 3, tzinfo=UTC)
WINDOW_DAYS = 2
SCORED = ("2026-11-02", "2026-11-03")
IN_WINDOW_AND_SCORED = {"2026-11-03"}
UNSCORED_IN_WINDOW = "2026-11-04"


class Deployment:
    """The code location's definitions over one SQLite database and an ephemeral instance; each
    evaluation carries the previous one's cursor, as the daemon's automation sensor does."""

    def __init__(self, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("TANDEM_SENSOR_PROMOTION_RESCORE_PARTITIONS", str(WINDOW_DAYS))
        self.monkeypatch = monkeypatch
        self.instance = DagsterInstance.ephemeral()
        self.resources = batch_resources(url, rows_per_day=ROWS, poison_rate=0.02, model_name=MODEL)
        self.defs = build_definitions(SETTINGS)
        self.cursor: Any = None

    @property
    def assets(self) -> list[AssetsDefinition]:
        return [asset for asset in self.defs.assets or [] if isinstance(asset, AssetsDefinition)]

    def rebuild(self, **module_constants: str) -> None:
        """The definitions after a deploy that changed constants of assets/batch.py (code versions)."""
        for name, value in module_constants.items():
            self.monkeypatch.setattr(f"assets.batch.{name}", value)
        self.defs = build_definitions(SETTINGS)

    def observe_production_model(self) -> SensorResult | None:
        """One tick of production_model_observer, its observations recorded as the daemon records them."""
        sensor = self.defs.get_sensor_def("production_model_observer")
        with build_sensor_context(
            instance=self.instance, resources={"model_store": ModelStoreResource(model_name=MODEL)}
        ) as context:
            result = sensor(context)
        if not isinstance(result, SensorResult):
            return None
        for event in result.asset_events:
            self.instance.report_runless_asset_event(event)
        return result

    def score(self, day: str, selection: tuple[str, ...] = ("transactions", "predictions", "path_agreement")) -> None:
        run_partition(
            self.assets,
            self.resources,
            self.instance,
            partition_key=day,
            selection=selection,
            run_config=predictions_config(parity_sample=0) if "predictions" in selection else None,
        )

    def evaluate(self) -> EvaluateAutomationConditionsResult:
        result = evaluate_automation_conditions(
            Definitions(assets=self.defs.assets, resources=self.resources),
            self.instance,
            evaluation_time=EVALUATED_AT,
            cursor=self.cursor,
        )
        self.cursor = result.cursor
        return result

    def stale(self, day: str) -> tuple[str, list[str]]:
        resolver = get_stale_status_resolver(self.instance, self.assets)
        causes = resolver.get_stale_root_causes(PREDICTIONS, day)
        return resolver.get_status(PREDICTIONS, day).value, sorted(
            f"{cause.asset_key.to_user_string()}: {cause.reason}" for cause in causes
        )


def requested(result: EvaluateAutomationConditionsResult) -> dict[str, set[str | None]]:
    return {
        key.to_user_string(): set(result.get_requested_partitions(key))
        for key in (PREDICTIONS, PATH_AGREEMENT)
        if result.get_requested_partitions(key)
    }


@pytest.fixture
def deployment(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Deployment]:
    """Two days scored under an observed production model; the automation sensor has ticked once."""
    register_untrained_model(MODEL)
    deployed = Deployment(sqlite_url, monkeypatch)
    assert deployed.observe_production_model() is not None
    for day in SCORED:
        deployed.score(day)
    assert requested(deployed.evaluate()) == {}, "a first evaluation remembers, it requests nothing"
    yield deployed
    deployed.instance.dispose()


def test_a_promotion_rescores_the_scored_days_of_the_window_once(deployment: Deployment) -> None:
    assert deployment.stale(SCORED[1]) == ("FRESH", [])

    promoted = register_untrained_model(MODEL, seed=1)  # as `tandem models promote` moves the pointer
    observed = deployment.observe_production_model()
    assert observed is not None and observed.asset_events[0].tags["dagster/data_version"] == promoted
    assert deployment.observe_production_model() is None, "an unchanged pointer is observed once"
    for day in SCORED:  # stale in the UI, the window or not: the model they were scored with moved
        assert deployment.stale(day) == ("STALE", ["production_model: has a new data version"]), day

    assert requested(deployment.evaluate()) == {
        "predictions": IN_WINDOW_AND_SCORED,
        "path_agreement": IN_WINDOW_AND_SCORED,  # in the same run: it will be requested with predictions
    }
    assert requested(deployment.evaluate()) == {}, "requested once"

    deployment.score(SCORED[1], selection=("predictions", "path_agreement"))  # the run the sensor launches
    assert deployment.stale(SCORED[1]) == ("FRESH", [])
    assert deployment.stale(SCORED[0])[0] == "STALE", "outside the window: shown stale, left alone"
    assert requested(deployment.evaluate()) == {}, "path_agreement ran with predictions: nothing follows"

    deployment.score(UNSCORED_IN_WINDOW)  # the nightly run of a day not scored when the model moved
    assert deployment.stale(UNSCORED_IN_WINDOW) == ("FRESH", [])
    assert requested(deployment.evaluate()) == {}, "scored under the new model already: not rescored"


def test_a_bumped_code_version_rescores_the_window(deployment: Deployment) -> None:
    deployment.rebuild(PREDICTIONS_CODE_VERSION="2")
    assert deployment.stale(SCORED[1]) == ("STALE", ["predictions: has a new code version"])
    assert requested(deployment.evaluate()) == {
        "predictions": IN_WINDOW_AND_SCORED,
        "path_agreement": IN_WINDOW_AND_SCORED,
    }
    assert requested(deployment.evaluate()) == {}


def test_re_ingesting_the_same_records_leaves_predictions_fresh(deployment: Deployment) -> None:
    """transactions' data version is its content: the same day again changes nothing downstream."""
    deployment.score(SCORED[1], selection=("transactions",))
    assert deployment.stale(SCORED[1]) == ("FRESH", [])


def test_path_agreement_follows_predictions_materialized_alone(deployment: Deployment) -> None:
    deployment.score(SCORED[0], selection=("predictions",))  # the UI's Materialize on predictions alone
    assert requested(deployment.evaluate()) == {"path_agreement": {SCORED[0]}}
    assert requested(deployment.evaluate()) == {}


@pytest.mark.parametrize(
    "evaluated_at",
    [datetime(2026, 12, 6, 23, 59, tzinfo=UTC), datetime(2026, 12, 7, 0, 1, tzinfo=UTC)],
    ids=["before-midnight", "after-midnight"],
)
def test_the_live_rollout_test_expects_the_window_of_the_day_automation_evaluates(
    evaluated_at: datetime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live deployment fixes the window's length on the day it starts (tests/e2e/conftest.py);
    automation counts that length back from the day it evaluates the promotion. A suite that
    crosses midnight in between rescores one day fewer, and the live test must expect that day's
    window (tests/e2e/week.promotion_window), not the one of the day it started."""
    started_on = date(2026, 12, 6)
    window = rescore_window_days(started_on)
    monkeypatch.setenv(RESCORE_WINDOW_ENV, str(window))
    defs = build_definitions(SETTINGS)
    with DagsterInstance.ephemeral() as instance:
        instance.report_runless_asset_event(production_model_observation("risk_model:before"))
        for day in PARTITIONS:  # the live test's week, scored
            for asset in ("transactions", "predictions", "path_agreement"):
                instance.report_runless_asset_event(AssetMaterialization(asset_key=asset, partition=day))
        scored = Definitions(assets=defs.assets, resources=defs.resources)
        first = evaluate_automation_conditions(scored, instance, evaluation_time=evaluated_at)
        instance.report_runless_asset_event(production_model_observation("risk_model:promoted"))
        promoted = evaluate_automation_conditions(scored, instance, evaluation_time=evaluated_at, cursor=first.cursor)

    rescored, _ = promotion_window(window, evaluated_at.date())
    assert sorted(promoted.get_requested_partitions(PREDICTIONS)) == rescored
    day_start_window, _ = promotion_window(window, started_on)
    assert (rescored == day_start_window) == (evaluated_at.date() == started_on)


def test_a_promotion_observed_while_automation_evaluates_is_rescored_once(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The observer's write can commit after a tick captured its event bound and before it reads
    production_model's events: that tick sees the move, and so does the next (the event's id is past
    the bound it stored). The window is still requested once: the next tick's reset (the days it
    just requested) outweighs a move that carries no timestamp of its own."""
    storage = deployment.instance.event_log_storage
    bound = storage.get_maximum_record_id()
    register_untrained_model(MODEL, seed=1)
    assert deployment.observe_production_model() is not None
    with monkeypatch.context() as patch:
        # The bound this tick captured before the observation committed.
        patch.setattr(storage, "get_maximum_record_id", lambda: bound)
        assert requested(deployment.evaluate()) == {
            "predictions": IN_WINDOW_AND_SCORED,
            "path_agreement": IN_WINDOW_AND_SCORED,
        }
    assert requested(deployment.evaluate()) == {}, "seen twice, requested once"


def test_two_promotions_between_two_evaluations_rescore_the_window_once(deployment: Deployment) -> None:
    register_untrained_model(MODEL, seed=1)
    assert deployment.observe_production_model() is not None
    promoted = register_untrained_model(MODEL, seed=2)
    assert deployment.observe_production_model() is not None
    assert requested(deployment.evaluate()) == {
        "predictions": IN_WINDOW_AND_SCORED,
        "path_agreement": IN_WINDOW_AND_SCORED,
    }
    assert requested(deployment.evaluate()) == {}
    deployment.score(SCORED[1], selection=("predictions", "path_agreement"))
    assert deployment.stale(SCORED[1]) == ("FRESH", []), f"scored with {promoted}, the last one promoted"
