"""The challenger path through Dagster, materialized for real on SQLite: risk_model registering a
challenger, challenger_predictions replaying stored days into challenger_predictions alone, and
challenger_report's gate checks and recorded verdict. production_model_observer reporting the
challenger slot is in test_sensors.py."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from dagster import (
    AssetKey,
    AssetsDefinition,
    DagsterEventType,
    DagsterInstance,
    ExecuteInProcessResult,
    materialize,
)

from assets.model import NO_CHALLENGER
from inference.challenger import AUC_NOT_WORSE, BLOCKING_CHECKS, ENOUGH_EVIDENCE, PRECISION_NOT_WORSE
from inference.model import TrainingReport
from inference.store import (
    challenger_predictions,
    challenger_reports,
    latest_challenger_report,
    make_engine,
    predictions,
    rejected_records,
)
from orchestration.definitions import build_definitions
from tandem import modelstore
from tandem_specs.transactions.model import ModelConfig
from tests.orchestration.support import SETTINGS, batch_resources, predictions_config, run_partition
from tests.reference import RECORDS
from tests.shared import register_untrained_model

# Names of their own: nothing here may move another test's production pointer, nor see its challenger.
MODEL = "risk_model_challenger_tests"
DAYS = ("2026-11-01", "2026-11-02", "2026-11-03")
REPLAYED = DAYS[1:]
ROWS = 2000
# The champion must rank the frauds well (AUC about 0.95 on these days) for an untrained challenger
# to be clearly worse; the challenger risk_model trains need not be good.
TRAINING = {"epochs": 2}
QUICK = {"max_train_rows": 2000, "epochs": 1}
CHALLENGER_MODEL = AssetKey("challenger_model")


@dataclass
class World:
    """Three ingested demo days, a trained champion in production, its answers for the last two."""

    url: str
    assets: list[AssetsDefinition]
    resources: dict[str, Any]
    instance: DagsterInstance
    champion: str

    def count(self, table: sa.Table) -> int:
        engine = make_engine(self.url)
        try:
            with engine.connect() as conn:
                return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())
        finally:
            engine.dispose()

    def counts(self) -> dict[str, int]:
        return {t.name: self.count(t) for t in (RECORDS, predictions, rejected_records, challenger_predictions)}

    def materialize(
        self, selection: list[str], run_config: dict[str, Any] | None = None, raise_on_error: bool = True
    ) -> ExecuteInProcessResult:
        return materialize(
            self.assets,
            selection=selection,
            instance=self.instance,
            resources=self.resources,
            run_config=run_config or {},
            raise_on_error=raise_on_error,
        )

    def replay(self, days: tuple[str, ...] = REPLAYED, raise_on_error: bool = True) -> list[ExecuteInProcessResult]:
        return [
            run_partition(
                self.assets,
                self.resources,
                self.instance,
                partition_key=day,
                selection=["challenger_predictions"],
                raise_on_error=raise_on_error,
            )
            for day in days
        ]

    def report(self, raise_on_error: bool = False) -> ExecuteInProcessResult:
        return self.materialize(["challenger_report"], raise_on_error=raise_on_error)


@pytest.fixture(scope="module")
def world(assets: list[AssetsDefinition], tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    url = f"sqlite:///{tmp_path_factory.mktemp('challenger') / 'tandem.db'}"
    resources = batch_resources(url, rows_per_day=ROWS, model_name=MODEL)
    with DagsterInstance.ephemeral() as instance:
        for day in DAYS:
            run_partition(assets, resources, instance, partition_key=day, selection=["transactions"])
        trained = materialize(
            assets,
            selection=["risk_model"],
            instance=instance,
            resources=resources,
            run_config={"ops": {"risk_model": {"config": TRAINING}}},
        )
        (materialization,) = trained.asset_materializations_for_node("risk_model")
        assert materialization.metadata["decision"].value == "promoted"
        champion_auc = materialization.metadata["auc"].value
        assert isinstance(champion_auc, float) and champion_auc > 0.85, "the champion must rank frauds well"
        champion = modelstore.production_tag(MODEL)
        assert champion is not None
        for day in REPLAYED:
            run_partition(
                assets,
                resources,
                instance,
                partition_key=day,
                selection=["predictions"],
                run_config=predictions_config(parity_sample=0),
            )
        yield World(url, assets, resources, instance, champion)
    modelstore.clear_challenger(MODEL)


@pytest.fixture(autouse=True)
def empty_challenger_slot(world: World) -> Iterator[None]:
    modelstore.clear_challenger(MODEL)
    assert modelstore.production_tag(MODEL) == world.champion
    yield
    modelstore.clear_challenger(MODEL)


def copy_of(tag: str) -> str:
    """The same weights under a new tag (as if registered again)."""
    model = modelstore.load(tag)
    report = TrainingReport(0.5, 0, 0, 0, model.parameter_count, None)
    return modelstore.register(model, report, name=MODEL, code_version="test")


def untrained() -> str:
    return register_untrained_model(
        MODEL, seed=123, config=ModelConfig(history_length=SETTINGS.history_length), promote=False
    )


def checks(result: ExecuteInProcessResult) -> dict[str, Any]:
    return {evaluation.check_name: evaluation for evaluation in result.get_asset_check_evaluations()}


def failure_description(result: ExecuteInProcessResult) -> str:
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE]
    user_failure = failure.step_failure_data.user_failure_data
    assert user_failure is not None
    return str(user_failure.description)


def metadata_of(result: ExecuteInProcessResult, node: str) -> dict[str, Any]:
    (materialization,) = result.asset_materializations_for_node(node)
    return {key: value.value for key, value in materialization.metadata.items()}


def stored_reports(world: World) -> list[dict[str, Any]]:
    engine = make_engine(world.url)
    try:
        with engine.connect() as conn:
            return [dict(row) for row in conn.execute(sa.select(challenger_reports).order_by("report_id")).mappings()]
    finally:
        engine.dispose()


def test_risk_model_registered_as_challenger_leaves_production_alone(world: World) -> None:
    result = world.materialize(
        ["risk_model"], run_config={"ops": {"risk_model": {"config": {**QUICK, "register_as": "challenger"}}}}
    )
    metadata = metadata_of(result, "risk_model")
    tag = metadata["version_tag"]
    assert metadata["decision"] == "challenger"
    assert metadata["promoted"] is False
    assert tag != world.champion
    assert metadata["production_tag"] == world.champion == modelstore.production_tag(MODEL)
    assert modelstore.challenger_tag(MODEL) == tag
    observed = [
        event.asset_observation_data.asset_observation
        for event in result.all_events
        if event.event_type_value == "ASSET_OBSERVATION"
    ]
    assert [(o.asset_key, o.data_version) for o in observed] == [(CHALLENGER_MODEL, tag)], "production not observed"


def test_a_replay_writes_only_challenger_predictions(world: World) -> None:
    challenger = modelstore.challenge(untrained())
    before = world.counts()

    replays = world.replay()
    after = world.counts()
    assert {name: after[name] for name in ("transactions", "predictions", "rejected_records")} == {
        name: before[name] for name in ("transactions", "predictions", "rejected_records")
    }
    written = 0
    for day, result in zip(REPLAYED, replays, strict=True):
        metadata = metadata_of(result, "challenger_predictions")
        assert metadata["model_version"] == challenger
        assert metadata["scored"] + metadata["rejected"] == metadata["rows_in"] > 0
        assert metadata["dagster/row_count"] == metadata["scored"]
        written += metadata["scored"]
        engine = make_engine(world.url)
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    challenger_predictions.c.model_version,
                    challenger_predictions.c.path,
                    challenger_predictions.c.run_id,
                    sa.func.count(),
                )
                .where(challenger_predictions.c.partition_key == day)
                .group_by("model_version", "path", "run_id")
            ).all()
            production_answers = conn.execute(
                sa.select(sa.func.count())
                .select_from(predictions)
                .where(predictions.c.partition_key == day, predictions.c.model_version == world.champion)
            ).scalar_one()
        engine.dispose()
        assert [tuple(r) for r in rows] == [(challenger, "batch", result.run_id, metadata["scored"])]
        assert production_answers == metadata["scored"], "the challenger scores what production scored"
    assert after["challenger_predictions"] == before["challenger_predictions"] + written

    again = world.replay()  # a rerun changes nothing
    assert world.counts() == after
    assert all(metadata_of(r, "challenger_predictions")["scored"] > 0 for r in again)


def test_the_champions_own_weights_as_challenger_pass_every_blocking_check(world: World) -> None:
    challenger = modelstore.challenge(copy_of(world.champion))
    assert challenger != world.champion
    world.replay()
    reports_before = len(stored_reports(world))

    result = world.report()
    assert result.success
    evaluations = checks(result)
    assert set(evaluations) == set(BLOCKING_CHECKS)
    assert all(e.passed for e in evaluations.values()), {n: e.description for n, e in evaluations.items()}
    metadata = metadata_of(result, "challenger_report")
    assert metadata["promotable"] is True
    assert metadata["decision_flips"] == 0 and metadata["score_difference_max"] == 0.0
    assert metadata["auc_difference"] == 0.0
    assert metadata["days"] == len(REPLAYED)
    assert metadata["window"] == "2026-10-28 .. 2026-11-03", "the default: 7 days ending at the last replayed one"
    assert (metadata["champion"], metadata["challenger"]) == (world.champion, challenger)

    reports = stored_reports(world)
    assert len(reports) == reports_before + 1
    row = reports[-1]
    assert str(row["report_id"]) == metadata["report_id"]
    assert (row["champion"], row["challenger"], bool(row["passed"]), row["run_id"]) == (
        world.champion,
        challenger,
        True,
        result.run_id,
    )
    engine = make_engine(world.url)
    with engine.connect() as conn:
        latest = latest_challenger_report(conn, challenger=challenger, champion=world.champion)
    engine.dispose()
    assert latest is not None and latest.passed and str(latest.report_id) == metadata["report_id"]
    assert latest.metrics["labelled_pairs"] == metadata["labelled_pairs"] >= 500


def test_an_untrained_challenger_is_blocked_and_the_verdict_recorded(world: World) -> None:
    challenger = modelstore.challenge(untrained())
    world.replay()

    result = world.report()
    evaluations = checks(result)
    assert set(evaluations) == set(BLOCKING_CHECKS)
    assert evaluations[ENOUGH_EVIDENCE].passed
    for name in (AUC_NOT_WORSE, PRECISION_NOT_WORSE):
        assert not evaluations[name].passed
        assert evaluations[name].severity.value == "ERROR"
        assert str(evaluations[name].description).startswith("worse by ")
    # The report did its job: the run succeeds and the checks say no, which is what the gate reads
    # (a failed run would page whoever owns failed runs for a challenger that is merely worse).
    assert result.success
    metadata = metadata_of(result, "challenger_report")
    assert metadata["promotable"] is False
    assert metadata["challenger_auc"] < metadata["champion_auc"]

    row = stored_reports(world)[-1]
    assert str(row["report_id"]) == metadata["report_id"]
    assert (row["challenger"], bool(row["passed"])) == (challenger, False)
    engine = make_engine(world.url)
    with engine.connect() as conn:
        latest = latest_challenger_report(conn, challenger=challenger, champion=world.champion)
    engine.dispose()
    assert latest is not None and set(latest.failures) == {AUC_NOT_WORSE, PRECISION_NOT_WORSE}


def test_without_a_challenger_both_assets_fail_with_the_reason(world: World) -> None:
    before = world.counts()
    replay = world.replay(days=(REPLAYED[0],), raise_on_error=False)[0]
    said = failure_description(replay)
    assert said.startswith("the challenger could not be loaded: LookupError: no challenger for ")
    assert "tandem models challenge TAG" in said

    report = world.report()
    said = failure_description(report)
    assert said.startswith(f"nothing to compare: production {world.champion}, challenger None")
    assert "tandem models challenge TAG" in said
    assert world.counts() == before
    assert [e for e in report.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY] == []


def test_a_challenger_that_replayed_nothing_has_no_report(world: World) -> None:
    challenger = modelstore.challenge(untrained())  # a new tag: no day replayed with it
    reports = len(stored_reports(world))
    said = failure_description(world.report())
    assert said.startswith(f"challenger_predictions has replayed no day with {challenger}: backfill it"), said
    assert len(stored_reports(world)) == reports


def test_the_challenger_model_asset_observes_the_slot(world: World) -> None:
    (observable,) = [a for a in world.assets if CHALLENGER_MODEL in a.keys]

    def observed() -> str | None:
        # An observable source asset "materialized" is observed (dagster 1.13 has no observe()).
        result = materialize(
            [observable],
            selection=[CHALLENGER_MODEL],
            instance=world.instance,
            resources={"model_store": world.resources["model_store"]},
        )
        assert result.success
        (event,) = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
        return event.asset_observation_data.asset_observation.data_version

    assert observed() == NO_CHALLENGER
    challenger = modelstore.challenge(untrained())
    assert observed() == challenger


def test_replay_challenger_is_the_job_of_challenger_predictions_alone() -> None:
    job = build_definitions(SETTINGS).resolve_job_def("replay_challenger")
    assert job.asset_layer.executable_asset_keys == {AssetKey("challenger_predictions")}
    assert job.partitions_def is not None
