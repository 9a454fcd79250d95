"""A day in production, in the order production lives it, on PostgreSQL against a real `bentoml serve`.

1. Three days of history land as CSV files, are ingested and scored by Dagster; a model is trained.
2. During day D the service scores most of D's payments online: client retries (some with a changed
   body, with and without an Idempotency-Key), and a few poison requests.
3. D's file lands afterwards with the late records and a few corrections of answered payments.
4. The nightly run (what the landing sensor requests) ingests and scores D: every check passes.
5. A corrected file for D-1 lands: the sensors rerun exactly the partitions it changed, and only
   the rows whose record or history changed are rewritten.
6. A model is promoted: the service swaps to it, declarative automation rescores, and a backfill
   of the week changes nothing more.

At the end every answer a client received is still recorded, every transaction has its batch
answer, path_agreement explains every disagreement, and nothing is duplicated or lost.

Dagster runs in-process on an ephemeral instance; the sensors and the automation conditions are
evaluated by the test and what they request executed as the daemon would, so that the test can say
which runs they asked for.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest
import sqlalchemy as sa
from dagster import (
    AssetKey,
    AssetsDefinition,
    DagsterInstance,
    Definitions,
    ExecuteInProcessResult,
    RunRequest,
    SensorResult,
    SkipReason,
    build_sensor_context,
    evaluate_automation_conditions,
    materialize,
)

from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from assets.scoring import records_key
from inference.agreement import Cause, summarize
from inference.records import validate
from inference.sources import demo_path
from inference.store import answer_pairs, make_engine, predictions
from orchestration.definitions import build_definitions
from orchestration.sensors import DAILY_JOB, RESCORE_JOB, ingest_job_name
from orchestration.settings import OrchestrationSettings
from tandem import modelstore
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.orchestration.support import select_rows
from tests.reference import RAW_COLUMNS, RECORDS, REFERENCE
from tests.serving.support import LiveServer, serve
from tests.shared import service_env, until

INGEST_JOB = ingest_job_name(records_key(REFERENCE))

pytestmark = [pytest.mark.live, pytest.mark.postgres]

MODEL_NAME = "risk_model_production_day"
HISTORY = [date(2026, 11, 5), date(2026, 11, 6), date(2026, 11, 7)]
DAY = date(2026, 11, 8)
SETTINGS = OrchestrationSettings(partitions_start="2026-11-01", history_length=16)
DEMO = DemoConfig(seed=11, rows_per_day=600, poison_rate=0.02, accounts=80)
TRAINING = {"ops": {"risk_model": {"config": {"training_days": 3, "epochs": 1, "max_train_rows": 2000}}}}
# The automation sensor evaluates in the night after DAY: its window (the last 7 days) holds the week.
ONLINE_ROWS = sa.select(predictions).where(predictions.c.path == "online")
AUTOMATION_TIME = datetime.combine(DAY + timedelta(days=1), datetime.min.time(), tzinfo=UTC) + timedelta(hours=3)


@dataclass(frozen=True)
class Answer:
    """One answer a client received in a 200."""

    transaction_id: str
    request_id: str
    score: float
    model_version: str
    input_hash: str


class Day:
    """The Dagster side: definitions over this test's database and landing folder, an instance,
    and each sensor's cursor as the daemon would keep it."""

    def __init__(self, database_url: str, landing: Path) -> None:
        built = build_definitions(SETTINGS)
        self.resources: dict[str, Any] = {
            "database": DatabaseResource(url=database_url),
            "model_store": ModelStoreResource(model_name=MODEL_NAME),
            "source": RecordSourceResource(kind="files", location=str(landing)),
        }
        self.defs = Definitions(
            assets=built.assets,
            asset_checks=built.asset_checks,
            jobs=built.jobs,
            sensors=built.sensors,
            resources=self.resources,
        )
        self.assets = [a for a in built.assets or [] if isinstance(a, AssetsDefinition)]
        self.instance = DagsterInstance.ephemeral()
        self.cursors: dict[str, str | None] = {}
        self.automation_cursor: Any = None

    def tick(self, sensor_name: str) -> list[RunRequest]:
        sensor = self.defs.get_sensor_def(sensor_name)
        with build_sensor_context(
            instance=self.instance, cursor=self.cursors.get(sensor_name), resources=self.resources
        ) as context:
            result = sensor(context)
        if isinstance(result, SkipReason):
            return []
        assert isinstance(result, SensorResult)
        for event in result.asset_events:  # observations, recorded as the daemon records them
            self.instance.report_runless_asset_event(event)
        self.cursors[sensor_name] = result.cursor
        return list(result.run_requests or [])

    def automation(self) -> list[RunRequest]:
        """One evaluation of the conditions scoring_automation_sensor evaluates; each predictions
        partition it requests as the run it launches (predictions and path_agreement together)."""
        result = evaluate_automation_conditions(
            Definitions(assets=self.defs.assets, resources=self.resources),
            self.instance,
            evaluation_time=AUTOMATION_TIME,
            cursor=self.automation_cursor,
        )
        self.automation_cursor = result.cursor
        keys = result.get_requested_partitions(AssetKey("predictions"))
        assert result.get_requested_partitions(AssetKey("path_agreement")) == keys, "path_agreement in the same run"
        return [RunRequest(partition_key=key, tags={"tandem/trigger": "automation"}) for key in sorted(keys)]

    def run(self, request: RunRequest, default_job: str | None = None) -> ExecuteInProcessResult:
        job = self.defs.get_job_def(request.job_name or default_job or "")
        assert request.partition_key is not None
        return job.execute_in_process(
            partition_key=request.partition_key, instance=self.instance, tags=dict(request.tags)
        )

    def run_job(self, job_name: str, day: date) -> ExecuteInProcessResult:
        return self.run(RunRequest(partition_key=day.isoformat(), job_name=job_name))

    def train(self, **config: Any) -> ExecuteInProcessResult:
        run_config = {"ops": {"risk_model": {"config": {**TRAINING["ops"]["risk_model"]["config"], **config}}}}
        return materialize(
            self.assets,
            selection=["risk_model"],
            instance=self.instance,
            resources=self.resources,
            run_config=run_config,
        )


def checks_of(result: ExecuteInProcessResult) -> dict[str, bool]:
    return {evaluation.check_name: evaluation.passed for evaluation in result.get_asset_check_evaluations()}


def assert_every_check_passed(result: ExecuteInProcessResult) -> None:
    checks = checks_of(result)
    assert result.success and checks and all(checks.values()), checks


def write_day(landing: Path, day: date, frame: pl.DataFrame) -> None:
    path = demo_path(landing, day)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    frame.drop("poison_kind", strict=False).write_csv(temporary)
    temporary.replace(path)


def post(server: LiveServer, client: httpx.Client, row: Mapping[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(f"{server.url}/score", json={"transactions": [dict(row)]}, headers=headers, timeout=30)


def answered(response: httpx.Response) -> Answer:
    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    assert result["status"] == "scored" and not result["degraded"], result
    return Answer(
        result["transaction_id"], result["request_id"], result["score"], result["model_version"], result["input_hash"]
    )


def test_a_day_in_production(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    landing = tmp_path / "landing"
    day = Day(database_url, landing)

    # 1. History lands, is ingested and scored; the first model is trained and promoted.
    for history_day in HISTORY:
        write_day(landing, history_day, generate_day(history_day, DEMO))
    requests = day.tick("landing_sensor")
    assert sorted((r.job_name, r.partition_key) for r in requests) == [(DAILY_JOB, d.isoformat()) for d in HISTORY]
    # Ingest every day first: a day's features read the days before it.
    for history_day in HISTORY:
        assert day.run_job(INGEST_JOB, history_day).success
    assert day.train().success
    first_model = modelstore.production_tag(MODEL_NAME)
    assert first_model is not None
    assert day.tick("production_model_observer") == []  # risk_model reported its promotion itself
    assert day.automation() == []  # the first evaluation remembers, it requests nothing
    for request in requests:
        assert_every_check_passed(day.run(request))
    assert day.automation() == []  # the daemon ticks between runs: scoring a day asks for nothing more

    # 2. Day D online, as payments happen.
    source_day = generate_day(DAY, DEMO)
    valid = validate(REFERENCE, source_day.select(RAW_COLUMNS)).filter(pl.col("reject_reason").is_null())
    online = valid.filter(pl.int_range(pl.len()) % 10 < 7).select(RAW_COLUMNS).to_dicts()
    received: list[Answer] = []
    env = service_env(database_url=database_url, data_dir=tmp_path / "service", model_name=MODEL_NAME) | {
        "TANDEM_SERVING_MODEL_POLL_INTERVAL_S": "0.5",
        # Two shared cores and a Dagster run beside the service: this test is about what is
        # recorded, not latency, so nothing may be shed.
        "TANDEM_SERVING_P99_TARGET_MS": "5000",
        "TANDEM_SERVING_REQUEST_TIMEOUT_MS": "20000",
    }
    with serve(LiveServer, env, tmp_path / "serve.log") as server, httpx.Client() as client:
        reused_keys = 0
        for index, row in enumerate(online):
            key = f"pay-{row['transaction_id']}" if index % 3 == 0 else None
            first = answered(post(server, client, row, key))
            received.append(first)
            if index % 10 == 0:  # a client retry: the same body gets the same answer
                assert answered(post(server, client, row, key)) == first
            if index % 20 == 3 and key is not None:  # the same key with another body: refused
                refused = post(server, client, {**row, "amount": row["amount"] + 1}, key)
                assert refused.status_code == 422 and refused.json()["error"] == "idempotency_key_reused"
                reused_keys += 1
            if index % 20 == 7 and key is None:  # a changed body without a key: a fresh answer
                fresh = answered(post(server, client, {**row, "amount": round(row["amount"] * 3 + 1, 2)}))
                assert fresh.input_hash != first.input_hash and fresh.request_id != first.request_id
                received.append(fresh)
        assert reused_keys > 0
        poison = [
            {**online[0], "transaction_id": "poison-country", "country": "u1"},
            {**online[0], "transaction_id": "poison-category", "merchant_category": ""},
            {**online[0], "transaction_id": "poison-time", "event_time": "yesterday"},
        ]
        for row in poison:
            response = post(server, client, row)
            assert response.status_code == 422, response.text

        def recorded() -> bool:
            """Every answer a client received is stored: the service's writer lands them behind the answers."""
            stored = {(row["record_id"], row["request_id"]) for row in select_rows(database_url, ONLINE_ROWS)}
            return {(a.transaction_id, a.request_id) for a in received} <= stored

        # The night comes hours after the day's last payment, long after the writer has caught up.
        until(recorded, message="answers a client received are not recorded")

        # 3. D's file lands: the late records (never seen online) and corrections of answered ones.
        corrected_ids = {row["transaction_id"] for row in online[::33]}
        landed = source_day.with_columns(
            amount=pl.when(pl.col("transaction_id").is_in(list(corrected_ids)))
            .then(pl.col("amount") + 0.5)
            .otherwise(pl.col("amount"))
        )
        write_day(landing, DAY, landed)

        # 4. The nightly run: exactly D, ingested and scored; every check passes.
        (nightly,) = day.tick("landing_sensor")
        assert (nightly.job_name, nightly.partition_key) == (DAILY_JOB, DAY.isoformat())
        result = day.run(nightly)
        assert_every_check_passed(result)
        assert day.automation() == []
        ingested = result.asset_materializations_for_node("transactions")[0].metadata
        scored = result.asset_materializations_for_node("predictions")[0].metadata
        assert ingested["rows_received"].value == source_day.height
        assert scored["rows_in"].value == ingested["rows_stored"].value  # the rest quarantined at ingest
        assert scored["answered_online"].value == len({a.transaction_id for a in received})

        # 5. A corrected file for D-1: the sensors rerun exactly what it changed.
        previous = HISTORY[-1]
        before = select_rows(database_url, sa.select(predictions).where(predictions.c.path == "batch"))
        old_day = generate_day(previous, DEMO)
        clean = validate(REFERENCE, old_day.select(RAW_COLUMNS)).filter(pl.col("reject_reason").is_null())
        changed_ids = set(clean["transaction_id"].head(400)[::100].to_list())
        write_day(
            landing,
            previous,
            old_day.with_columns(
                amount=pl.when(pl.col("transaction_id").is_in(list(changed_ids)))
                .then(pl.col("amount") * 2)
                .otherwise(pl.col("amount"))
            ),
        )
        (reingest,) = day.tick("landing_sensor")
        assert (reingest.job_name, reingest.partition_key) == (INGEST_JOB, previous.isoformat())
        assert day.run(reingest).success
        affected, expected_partitions = _affected_by(database_url, changed_ids)
        reruns = day.tick("late_records_sensor")
        assert {r.partition_key for r in reruns} == expected_partitions
        for request in reruns:
            assert_every_check_passed(day.run(request, RESCORE_JOB))
        assert day.tick("late_records_sensor") == [], "nothing left to rerun"
        assert day.automation() == [], "the reruns computed path_agreement too: nothing follows"
        after = select_rows(database_url, sa.select(predictions).where(predictions.c.path == "batch"))
        rewritten = {
            row["record_id"]
            for row in after
            if (row["input_hash"], row["history_hash"])
            != next(
                (b["input_hash"], b["history_hash"])
                for b in before
                if (b["record_id"], b["model_version"]) == (row["record_id"], row["model_version"])
            )
        }
        assert rewritten <= affected and changed_ids <= rewritten, (rewritten - affected, changed_ids - rewritten)

        # 6. A model is promoted: the service swaps to it, automation rescores, a backfill changes nothing.
        assert day.train(seed=8, force_promote=True).success
        second_model = modelstore.production_tag(MODEL_NAME)
        assert second_model not in (None, first_model)

        def swapped() -> bool:
            probe = {**online[1], "transaction_id": f"after-promotion-{uuid.uuid4().hex[:8]}"}
            received.append(answered(post(server, client, probe)))
            return received[-1].model_version == second_model

        until(swapped, timeout_s=120, interval_s=0.5, message="the service never swapped to the promoted model")
        again = answered(post(server, client, online[2]))  # the same payment, now under the new model
        assert again.model_version == second_model
        received.append(again)
        rescores = day.automation()
        assert {r.partition_key for r in rescores} == {d.isoformat() for d in [*HISTORY, DAY]}
        assert day.automation() == [], "requested once"
        for request in rescores:
            assert_every_check_passed(day.run(request, RESCORE_JOB))
        settled = select_rows(database_url, sa.select(predictions))
        for backfilled in [*HISTORY, DAY]:
            assert_every_check_passed(day.run_job(DAILY_JOB, backfilled))
        assert select_rows(database_url, sa.select(predictions)) == settled, "a backfill of the week changes nothing"
        until(recorded, message="answers a client received are not recorded")  # the last ones, after the swap

    # Every answer a client received is recorded, with its lineage; nothing else is.
    online_rows = select_rows(database_url, ONLINE_ROWS)
    by_request = {(row["record_id"], row["request_id"]): row for row in online_rows}
    for answer in received:
        row = by_request.get((answer.transaction_id, answer.request_id))
        assert row is not None, f"the answer {answer} is not recorded"
        assert (row["score"], row["model_version"], row["input_hash"]) == (
            answer.score,
            answer.model_version,
            answer.input_hash,
        )
        assert row["history_hash"] is not None and not row["degraded"]
    assert set(by_request) == {(a.transaction_id, a.request_id) for a in received}, "no answer nobody received"

    # Every transaction has its batch answer under the production model, for its current content.
    stored = select_rows(
        database_url, sa.select(RECORDS.c.transaction_id, RECORDS.c.input_hash, RECORDS.c.reject_reason)
    )
    batch = {
        row["record_id"]: row["input_hash"]
        for row in select_rows(
            database_url,
            sa.select(predictions).where(predictions.c.path == "batch", predictions.c.model_version == second_model),
        )
    }
    valid_stored = {row["transaction_id"]: row["input_hash"] for row in stored if row["reject_reason"] is None}
    assert valid_stored and {tx: batch.get(tx) for tx in valid_stored} == valid_stored

    # path_agreement explains every disagreement, and the causes are the ones this day had.
    engine = make_engine(database_url)
    with engine.connect() as conn:
        report = summarize(answer_pairs(REFERENCE, conn, DAY))
    engine.dispose()
    causes = report.by_cause
    assert causes.get(Cause.UNEXPLAINED.value, 0) == 0, report.unexplained
    assert causes.get(Cause.INPUT_CORRECTED.value, 0) >= len(corrected_ids)
    assert causes.get(Cause.HISTORY_CHANGED.value, 0) > 0


def _affected_by(database_url: str, changed_ids: set[str]) -> tuple[set[str], set[str]]:
    """The records whose batch answer a change of `changed_ids` may rewrite (themselves and the
    next 16 valid records of the account), and the partitions that hold them, computed here
    from the stored records, independently of the sensor's SQL."""
    t = RECORDS.c
    rows = select_rows(
        database_url,
        sa.select(t.transaction_id, t.account_id, t.event_ts, t.partition_date, t.reject_reason).order_by(
            t.account_id, t.event_ts, t.transaction_id
        ),
    )
    affected: set[str] = set()
    partitions: set[str] = set()
    by_account: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_account.setdefault(row["account_id"], []).append(row)
    for timeline in by_account.values():
        valid = [row for row in timeline if row["reject_reason"] is None or row["transaction_id"] in changed_ids]
        for position, row in enumerate(valid):
            if row["transaction_id"] in changed_ids:
                for touched in valid[position : position + 1 + SETTINGS.history_length]:
                    affected.add(touched["transaction_id"])
                    partitions.add(str(touched["partition_date"]))
    return affected, partitions
