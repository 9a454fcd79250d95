"""A challenger rolled out the way a payments team does it, on PostgreSQL against a real `bentoml serve`.

1. A week of history is ingested and scored by Dagster; the champion is trained and promoted.
2. risk_model trains a candidate with `register_as: challenger`: production does not move.
3. The service picks the challenger up and shadows every admitted request while clients send
   load: each client gets the champion's answer, exactly what the champion computes for that
   record alone; the challenger's answers land in challenger_predictions (path=shadow) only.
4. `tandem models promote --from-challenger` refuses: there is no report yet.
5. An untrained version is set as challenger instead, replayed over the week and reported on: the
   report's checks fail, and the gate refuses, naming them.
6. The trained candidate is set back, replayed over the week (a labelled backtest) and reported
   on: the checks pass, the gate promotes it, the challenger slot is empty, and the service swaps.

Through all of it, `predictions` holds only the champion's answers, unchanged by every replay.
Dagster runs in-process on an ephemeral instance (materialize), as in test_production_day.py.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest
import sqlalchemy as sa
from dagster import AssetsDefinition, DagsterInstance, ExecuteInProcessResult, materialize
from prometheus_client.parser import text_string_to_metric_families

from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from inference.contract import TorchPredictor
from inference.demo import day_range
from inference.records import validate
from inference.store import StoreHistory, challenger_predictions, latest_challenger_report, make_engine, predictions
from orchestration.definitions import build_definitions
from orchestration.settings import OrchestrationSettings
from tandem import cli, modelstore
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.orchestration.support import select_rows
from tests.reference import RAW_COLUMNS, REFERENCE
from tests.serving.support import LiveServer, serve
from tests.shared import register_untrained_model, service_env, until

pytestmark = [pytest.mark.live, pytest.mark.postgres]

MODEL_NAME = "risk_model_rollout"
WEEK = day_range(date(2026, 11, 1), 7)
LIVE_DAY = date(2026, 11, 8)
SETTINGS = OrchestrationSettings(partitions_start="2026-11-01", history_length=16)
DEMO = DemoConfig(seed=5, rows_per_day=500, poison_rate=0.02, accounts=80)
TRAINING = {"training_days": 7, "epochs": 2, "max_train_rows": 3000}
LOAD_REQUESTS = 240
CLIENTS = 4
CHECKS = {"enough_labelled_evidence", "challenger_auc_not_worse", "challenger_precision_not_worse"}


class Platform:
    """Dagster in-process over this test's database: every asset of the code location, the demo source."""

    def __init__(self, database_url: str, landing: Path) -> None:
        built = build_definitions(SETTINGS)
        self.assets = [a for a in built.assets or [] if isinstance(a, AssetsDefinition)]
        self.resources: dict[str, Any] = {
            "database": DatabaseResource(url=database_url),
            "model_store": ModelStoreResource(model_name=MODEL_NAME),
            "source": RecordSourceResource(
                kind="demo", location=str(landing), seed=DEMO.seed, rows_per_day=DEMO.rows_per_day
            ),
        }
        self.instance = DagsterInstance.ephemeral()

    def materialize(self, selection: list[str], day: date | None = None, **config: Any) -> ExecuteInProcessResult:
        run_config = {"ops": {name: {"config": values} for name, values in config.items()}}
        return materialize(
            self.assets,
            selection=selection,
            partition_key=None if day is None else day.isoformat(),
            instance=self.instance,
            resources=self.resources,
            run_config=run_config,
        )

    def replay_and_report(self) -> dict[str, bool]:
        for day in WEEK:
            assert self.materialize(["challenger_predictions"], day).success
        result = materialize(
            self.assets,
            selection=["challenger_report"],
            instance=self.instance,
            resources=self.resources,
            raise_on_error=False,
        )
        return {evaluation.check_name: evaluation.passed for evaluation in result.get_asset_check_evaluations()}


def promote_from_challenger(capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["models", "promote", "--from-challenger"])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip()


def shadow_metric(server: LiveServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def test_a_challenger_is_shadowed_replayed_judged_and_promoted_through_the_gate(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("TANDEM_MODEL_NAME", MODEL_NAME)
    platform = Platform(database_url, tmp_path / "landing")
    engine = make_engine(database_url)

    # 1. A week ingested and scored; the champion trained and promoted.
    for day in WEEK:
        assert platform.materialize(["transactions"], day).success
    assert platform.materialize(["risk_model"], risk_model=TRAINING).success
    champion = modelstore.production_tag(MODEL_NAME)
    assert champion is not None
    for day in WEEK:
        assert platform.materialize(["predictions", "path_agreement"], day).success

    # 2. A candidate registered as challenger: production stays.
    trained = platform.materialize(["risk_model"], risk_model={**TRAINING, "seed": 8, "register_as": "challenger"})
    metadata = trained.asset_materializations_for_node("risk_model")[0].metadata
    candidate = str(metadata["version_tag"].value)
    assert metadata["decision"].value == "challenger" and metadata["promoted"].value is False
    assert modelstore.production_tag(MODEL_NAME) == champion
    assert modelstore.challenger_tag(MODEL_NAME) == candidate
    champion_rows = select_rows(database_url, sa.select(predictions).order_by(*predictions.primary_key.columns))

    # 3. Clients under load while every request is shadowed.
    live = validate(REFERENCE, generate_day(LIVE_DAY, DEMO).select(RAW_COLUMNS)).filter(
        pl.col("reject_reason").is_null()
    )
    requests = live.select(RAW_COLUMNS).head(LOAD_REQUESTS).to_dicts()
    env = service_env(database_url=database_url, data_dir=tmp_path / "service", model_name=MODEL_NAME) | {
        "TANDEM_SERVING_MODEL_POLL_INTERVAL_S": "0.5",
        "TANDEM_SERVING_SHADOW_SAMPLE": "1.0",
        # Shared cores and Dagster runs beside the service: this test is about which answers clients get
        # and where the challenger's go, so nothing may be shed; the p99 cost is the benchmark's
        # (bench/shadow.py, against a service without a challenger, side by side).
        "TANDEM_SERVING_P99_TARGET_MS": "5000",
        "TANDEM_SERVING_REQUEST_TIMEOUT_MS": "20000",
    }
    with serve(LiveServer, env, tmp_path / "serve.log") as server:
        until(
            lambda: shadow_metric(server, "tandem_shadow_model_info", model_version=candidate) == 1,
            timeout_s=120,
            interval_s=0.5,
            message="the service never started shadowing the challenger",
        )

        def send(row: dict[str, Any]) -> dict[str, Any]:
            response = httpx.post(f"{server.url}/score", json={"transactions": [row]}, timeout=30)
            assert response.status_code == 200, response.text
            (result,) = response.json()["results"]
            return dict(result)

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as clients:
            answers = list(clients.map(send, requests))
        assert all(answer["status"] == "scored" for answer in answers), answers
        assert {answer["model_version"] for answer in answers} == {champion}, "every answer is the champion's"
        # Exactly the champion's answer: the record scored alone against the stored history.
        predictor = TorchPredictor(model=modelstore.load(champion), model_version=champion, spec=REFERENCE)
        history = StoreHistory(REFERENCE, engine)
        expected = pl.concat([predictor.predict(pl.DataFrame([row]), history) for row in requests[:60]])
        got = {answer["transaction_id"]: answer["score"] for answer in answers}
        worst = max(abs(got[tx] - score) for tx, score in zip(expected["record_id"], expected["score"], strict=True))
        assert worst <= 1e-5, worst

        def shadow_caught_up() -> bool:
            rows = select_rows(database_url, sa.select(challenger_predictions))
            return len(rows) + shadow_metric(server, "tandem_shadow_items_total", outcome="dropped") >= len(requests)

        until(shadow_caught_up, timeout_s=60, message="the shadow never caught up")
        shadowed = select_rows(database_url, sa.select(challenger_predictions))
        assert {row["path"] for row in shadowed} == {"shadow"} and {row["model_version"] for row in shadowed} == {
            candidate
        }
        assert {row["record_id"] for row in shadowed} <= set(got)
        dropped = shadow_metric(server, "tandem_shadow_items_total", outcome="dropped")
        scored = shadow_metric(server, "tandem_shadow_items_total", outcome="scored")
        assert scored + dropped == len(requests), (scored, dropped)

        # 4. No report yet: the gate refuses.
        code, said = promote_from_challenger(capsys)
        assert code == 1 and "no challenger_report" in said, said

        # 5. An untrained challenger: replayed, reported on, refused by the gate.
        untrained = register_untrained_model(MODEL_NAME, seed=3, promote=False)
        modelstore.challenge(untrained)
        checks = platform.replay_and_report()
        assert set(checks) == CHECKS and not checks["challenger_auc_not_worse"], checks
        code, said = promote_from_challenger(capsys)
        assert code == 1 and "challenger_auc_not_worse" in said and "--force" in said, said
        assert modelstore.production_tag(MODEL_NAME) == champion

        # 6. The trained candidate: replayed over the week, reported on, promoted through the gate.
        modelstore.challenge(candidate)
        checks = platform.replay_and_report()
        with engine.connect() as conn:
            report = latest_challenger_report(conn, challenger=candidate, champion=champion)
        assert report is not None
        assert checks == dict.fromkeys(CHECKS, True), (checks, report.failures, report.metrics)
        assert report.metrics["labelled_pairs"] > 0 and report.metrics["shadowed_answers"] >= len(shadowed)
        code, said = promote_from_challenger(capsys)
        assert code == 0 and "passed every check of the gate" in said, said
        assert modelstore.production_tag(MODEL_NAME) == candidate
        assert modelstore.challenger_tag(MODEL_NAME) is None

        def swapped() -> bool:
            probe = {**requests[0], "transaction_id": f"after-promotion-{uuid.uuid4().hex[:8]}"}
            return send(probe)["model_version"] == candidate

        until(swapped, timeout_s=120, interval_s=0.5, message="the service never swapped to the promoted challenger")
        until(
            lambda: shadow_metric(server, "tandem_shadow_model_info", model_version=candidate) == 0,
            timeout_s=30,
            interval_s=0.5,
            message="the promoted challenger is still shadowed",
        )

    # The champion's answers are what they were: every replay went to challenger_predictions.
    batch_after = select_rows(
        database_url,
        sa.select(predictions)
        .where(predictions.c.model_version == champion, predictions.c.path == "batch")
        .order_by(*predictions.primary_key.columns),
    )
    assert batch_after == [row for row in champion_rows if row["path"] == "batch"]
    with engine.connect() as conn:
        replayed = conn.execute(
            sa.select(challenger_predictions.c.model_version, sa.func.count())
            .where(challenger_predictions.c.path == "batch")
            .group_by(challenger_predictions.c.model_version)
        ).all()
    per_version: dict[str, int] = {str(version): int(count) for version, count in replayed}
    assert per_version[candidate] == per_version[untrained] == len([r for r in champion_rows if r["path"] == "batch"])
    engine.dispose()
