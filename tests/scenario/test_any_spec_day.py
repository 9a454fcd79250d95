"""The production day's core for each spec (the `spec` fixture: the reference and diabetes), on
PostgreSQL against a real `bentoml serve` of that spec and Dagster over the same database.

1. History lands through the spec's demo hook, is ingested and a model is trained through Dagster.
2. During day D the service scores records one request each: client retries get the same answer,
   an Idempotency-Key reused with another body is refused, a changed body without a key gets a
   fresh answer.
3. Poison isolation: records broken by `inference.spec.poison`, sent among good ones at the same
   time, are each refused with a 422 naming their field; the good ones are scored. A request
   holding one poisoned record among good ones is refused naming that record alone.
4. The nightly run ingests and scores D and compares the paths: every check passes, batch scores
   equal the online scores wherever both paths saw the same input and history (parity), and
   path_agreement explains every disagreement.

What tests/scenario/test_production_day.py adds for the reference alone (it depends on accounts and
history): corrected files rerunning the partitions whose history they changed, and the promotion
swap with declarative automation's rescore.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import polars as pl
import pytest
import sqlalchemy as sa
from dagster import AssetsDefinition, DagsterInstance, ExecuteInProcessResult, materialize

from assets.resources import DatabaseResource, ModelStoreResource, RecordSourceResource
from inference.agreement import Cause, summarize
from inference.demo import demo_day
from inference.records import raw_columns, validate
from inference.spec import POISON_REASON, LoadedSpec, poison
from inference.spec.fields import GenericReason
from inference.store import answer_pairs, make_engine, predictions
from orchestration.definitions import build_definitions
from orchestration.settings import OrchestrationSettings
from tandem import modelstore
from tests.orchestration.support import run_partition, select_rows
from tests.serving.support import LiveServer, serve
from tests.shared import service_env, until

pytestmark = [pytest.mark.live, pytest.mark.postgres]

HISTORY = ("2026-11-01", "2026-11-02", "2026-11-03")
DAY = date(2026, 11, 4)
ONLINE = 30
ONLINE_ROWS = sa.select(predictions).where(predictions.c.path == "online")


@dataclass(frozen=True)
class Answer:
    """One answer a client received in a 200."""

    record_id: str
    request_id: str
    score: float
    model_version: str
    input_hash: str


class Batch:
    """The Dagster side for `ls`: its definitions over this test's database, the demo landing in
    this test's folder, a model name of this test's own, an ephemeral instance."""

    def __init__(self, ls: LoadedSpec, database_url: str, landing: Path) -> None:
        self.ls = ls
        self.model_name = f"{ls.spec.model_name}_any_spec_day"
        built = build_definitions(OrchestrationSettings(partitions_start=date.fromisoformat(HISTORY[0])))
        self.assets = [a for a in built.assets or [] if isinstance(a, AssetsDefinition)]
        self.source = RecordSourceResource(
            kind="demo", location=str(landing), seed=11, rows_per_day=300, poison_rate=0.02
        )
        self.resources: dict[str, Any] = {
            "database": DatabaseResource(url=database_url),
            "model_store": ModelStoreResource(model_name=self.model_name),
            "source": self.source,
        }
        self.instance = DagsterInstance.ephemeral()

    def run(self, day: str, *selection: str) -> ExecuteInProcessResult:
        return run_partition(self.assets, self.resources, self.instance, partition_key=day, selection=selection)

    def train(self) -> str:
        """The spec's model trained on the history and promoted; its version."""
        config = {"training_days": len(HISTORY), "epochs": 2, "max_train_rows": 2000, "force_promote": True}
        trained = materialize(
            self.assets,
            selection=[self.ls.spec.model_name],
            instance=self.instance,
            resources=self.resources,
            run_config={"ops": {self.ls.spec.model_name: {"config": config}}},
        )
        assert trained.success
        version = modelstore.production_tag(self.model_name)
        assert version is not None
        return version

    def valid_records(self, day: date) -> list[dict[str, Any]]:
        """`day`'s records the demo lands that validation accepts, as a client sends them."""
        landed = demo_day(self.ls, day, self.source.demo_settings()).select(raw_columns(self.ls))
        valid = validate(self.ls, landed).filter(pl.col("reject_reason").is_null())
        return valid.select(raw_columns(self.ls)).to_dicts()


def assert_every_check_passed(result: ExecuteInProcessResult) -> None:
    checks = {evaluation.check_name: evaluation.passed for evaluation in result.get_asset_check_evaluations()}
    assert result.success and checks and all(checks.values()), checks


def post(
    server: LiveServer, ls: LoadedSpec, client: httpx.Client, rows: list[Mapping[str, Any]], key: str | None = None
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(
        f"{server.url}/score", json={ls.spec.plural: [dict(row) for row in rows]}, headers=headers, timeout=30
    )


def answered(ls: LoadedSpec, response: httpx.Response) -> Answer:
    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    assert result["status"] == "scored" and not result["degraded"], result
    return Answer(
        result[ls.id.name], result["request_id"], result["score"], result["model_version"], result["input_hash"]
    )


def changed(ls: LoadedSpec, row: Mapping[str, Any]) -> dict[str, Any]:
    """`row` with its first numeric moved by one: another body of the same record, still valid."""
    numeric = ls.numerics[0].name
    return {**row, numeric: row[numeric] + 1.0}


def test_a_day_in_production_for_each_spec(spec: LoadedSpec, database_url: str, tmp_path: Path) -> None:
    batch = Batch(spec, database_url, tmp_path / "landing")
    for day in HISTORY:
        assert batch.run(day, spec.spec.name).success
    version = batch.train()

    env = service_env(database_url=database_url, data_dir=tmp_path / "service", model_name=batch.model_name) | {
        "TANDEM_MODEL_SPEC": spec.path,
        # Two shared cores and Dagster beside the service: this test is about what is answered
        # and recorded, not latency, so nothing may be shed.
        "TANDEM_SERVING_P99_TARGET_MS": "5000",
        "TANDEM_SERVING_REQUEST_TIMEOUT_MS": "20000",
    }
    records = batch.valid_records(DAY)
    with serve(LiveServer, env, tmp_path / "serve.log") as server, httpx.Client() as client:
        received = _online_day(spec, server, client, records[:ONLINE])
        received += _poison_is_refused_alone(spec, server, records[ONLINE : 2 * ONLINE])

        def recorded() -> bool:
            stored = {(row["record_id"], row["request_id"]) for row in select_rows(database_url, ONLINE_ROWS)}
            return {(a.record_id, a.request_id) for a in received} <= stored

        until(recorded, message="answers a client received are not recorded")

    assert {a.model_version for a in received} == {version}
    nightly = batch.run(DAY.isoformat(), spec.spec.name, "predictions", "path_agreement")
    assert_every_check_passed(nightly)
    scored = nightly.asset_materializations_for_node("predictions")[0].metadata
    assert scored["answered_online"].value == len({a.record_id for a in received})
    _batch_agrees_with_online(spec, database_url, received, version)
    _every_disagreement_is_explained(spec, database_url, len(received))


def _online_day(ls: LoadedSpec, server: LiveServer, client: httpx.Client, online: list[dict[str, Any]]) -> list[Answer]:
    """Each record in its own request, some with an Idempotency-Key; retries, a key reused with
    another body, changed bodies without a key. The answers received."""
    received: list[Answer] = []
    reused = fresh = 0
    for index, row in enumerate(online):
        key = f"visit-{uuid.uuid4().hex}" if index % 3 == 0 else None
        first = answered(ls, post(server, ls, client, [row], key))
        received.append(first)
        if index % 4 == 0:  # a client retry: the same body gets the same answer
            assert answered(ls, post(server, ls, client, [row], key)) == first
        if index % 6 == 3 and key is not None:  # the same key with another body: refused
            refused = post(server, ls, client, [changed(ls, row)], key)
            assert refused.status_code == 422 and refused.json()["error"] == "idempotency_key_reused", refused.text
            assert refused.json()["detail"]["idempotency_key"] == key and "results" not in refused.json()
            reused += 1
        if index % 5 == 1 and key is None:  # a changed body without a key: a fresh answer
            again = answered(ls, post(server, ls, client, [changed(ls, row)]))
            assert again.input_hash != first.input_hash and again.request_id != first.request_id
            received.append(again)
            fresh += 1
    assert reused > 0 and fresh > 0
    return received


def _poison_is_refused_alone(ls: LoadedSpec, server: LiveServer, good: list[dict[str, Any]]) -> list[Answer]:
    """`good` broken at a third of its rows by `inference.spec.poison` (a duplicated id is a batch
    fault only: online each request stands alone, so those rows count as good), each row sent in
    a request of its own, all at once. The answers to the good ones."""
    broken = poison(pl.DataFrame(good), ls, np.random.default_rng(3), 0.34).to_dicts()
    faults = {
        index: _broken_field(good[index], row)
        for index, row in enumerate(broken)
        if row[POISON_REASON] not in (None, GenericReason.DUPLICATE_ID.value)
    }
    sent = [{k: v for k, v in row.items() if k != POISON_REASON} for row in broken]
    assert len(faults) >= 4, faults

    async def fire() -> list[httpx.Response]:
        return await asyncio.gather(*(_send(server, ls, [row]) for row in sent))

    scored = []
    for index, response in enumerate(asyncio.run(fire())):
        if index in faults:
            _assert_refused_naming(ls, response, 0, faults[index])
        else:
            scored.append(answered(ls, response))
            assert scored[-1].record_id == sent[index][ls.id.name]
    poisoned = next(iter(faults))
    clean = [row for index, row in enumerate(sent) if index not in faults][:2]
    together = asyncio.run(_send(server, ls, [clean[0], sent[poisoned], clean[1]]))
    _assert_refused_naming(ls, together, 1, faults[poisoned])
    return scored


async def _send(server: LiveServer, ls: LoadedSpec, rows: list[dict[str, Any]]) -> httpx.Response:
    # Encoded here: json.dumps writes NaN and Infinity, which a poisoned numeric carries.
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{server.url}/score",
            content=json.dumps({ls.spec.plural: rows}),
            headers={"Content-Type": "application/json"},
        )


def _broken_field(clean: Mapping[str, Any], broken: Mapping[str, Any]) -> str:
    (field,) = [name for name, value in clean.items() if json.dumps(broken[name]) != json.dumps(value)]
    return field


def _assert_refused_naming(ls: LoadedSpec, response: httpx.Response, position: int, field: str) -> None:
    """A 422 whose every problem is `field` of the record at `position`, with a reason."""
    assert response.status_code == 422, (field, response.text)
    problems = response.json()["detail"]
    assert problems and all(p["loc"][:3] == [ls.spec.plural, position, field] and p["msg"] for p in problems), (
        field,
        problems,
    )


def _batch_agrees_with_online(ls: LoadedSpec, database_url: str, received: list[Answer], version: str) -> None:
    """Parity: where the batch answer saw the same input and history as an online one, the same score."""
    batch_rows = select_rows(
        database_url,
        sa.select(predictions).where(predictions.c.path == "batch", predictions.c.model_version == version),
    )
    online_rows = {(row["record_id"], row["request_id"]): row for row in select_rows(database_url, ONLINE_ROWS)}
    batch_by_id = {row["record_id"]: row for row in batch_rows}
    same_inputs = 0
    for answer in received:
        online = online_rows[(answer.record_id, answer.request_id)]
        assert (online["score"], online["model_version"], online["input_hash"]) == (
            answer.score,
            answer.model_version,
            answer.input_hash,
        )
        assert answer.record_id in batch_by_id, f"{ls.id.name} {answer.record_id} has no batch answer"
        offline = batch_by_id[answer.record_id]
        if (offline["input_hash"], offline["history_hash"]) == (online["input_hash"], online["history_hash"]):
            assert offline["score"] == pytest.approx(online["score"], abs=1e-5), answer
            same_inputs += 1
    assert same_inputs > 0, "no online answer saw what its batch answer saw"


def _every_disagreement_is_explained(ls: LoadedSpec, database_url: str, answers: int) -> None:
    """path_agreement's comparison: every answer a client received is paired with a batch answer,
    and every pair that differs has its cause."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            report = summarize(answer_pairs(ls, conn, DAY))
    finally:
        engine.dispose()
    assert (report.pairs, report.online_without_batch) == (answers, 0), report
    assert report.by_cause[Cause.UNEXPLAINED] == 0, report.unexplained
    assert report.by_cause[Cause.AGREE] > 0, report.by_cause
