"""Two replicas of the online path on one PostgreSQL database, the topology of issue 46 (one
`bentoml serve serving.service:TandemScorer` per pod, no proxy: docs/decisions/0009): two real server
processes on two ports, each with a data folder (outbox) of its own, sharing the database and the
BentoML model store.

- Stripe's idempotency rules hold across replicas because the store decides: one key sent to both
  with two bodies (at once, and one after the other) gets one answer and one 422; the winning body
  replayed at the other replica gets the stored answer, and the store holds that body's rows only.
- A promotion in the shared store reaches both replicas without a restart.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import date
from typing import Any

import httpx
import polars as pl
import pytest
import sqlalchemy as sa
import torch

from inference.contract import FrameHistory, TorchPredictor
from inference.model import LoadedModel
from inference.store import make_engine
from inference.store.schema import predictions
from tandem import modelstore
from tests.reference import RAW_COLUMNS, REFERENCE
from tests.serving.support import LiveServer, demo_day, serve
from tests.shared import (
    fresh_postgres_database,
    migrate_and_ingest,
    reference_model,
    register_model,
    service_env,
    until,
)

pytestmark = [pytest.mark.live, pytest.mark.postgres]

# A name of its own: the production pointer this module moves is no other module's.
MODEL_NAME = "risk_model_replicas"
HISTORY_DAY = date(2026, 12, 8)
REQUEST_DAY = date(2026, 12, 9)
POLL_S = 0.2  # how often each replica reads the production pointer
# Generous for two shared, noisy cores: admission is not the subject here, so nothing is shed.
TARGET_MS = 2000
# How long a refused-for-now request (409 key in flight, 503 overloaded) is retried until its
# answer is final, and how long both replicas get to serve a promoted version.
FINAL_WITHIN_S = 30.0
SWAP_WITHIN_S = 60.0
TIMEOUT_S = 15.0  # each HTTP call


@dataclass
class Replica(LiveServer):
    name: str

    def post(self, rows: list[dict[str, Any]], key: str | None = None) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key else {}
        return httpx.post(f"{self.url}/score", json={"transactions": rows}, headers=headers, timeout=TIMEOUT_S)


@dataclass
class Pair:
    a: Replica
    b: Replica
    database_url: str
    history: pl.DataFrame
    requests: pl.DataFrame  # the next day's records, not stored
    models: dict[str, LoadedModel]
    v1: str
    v2: str
    taken: int = 0  # request rows handed out so far: every scenario scores transactions of its own

    def rows(self, count: int) -> list[dict[str, Any]]:
        rows = self.requests.slice(self.taken, count).to_dicts()
        assert len(rows) == count, "the request day ran out of records"
        self.taken += count
        return rows


def _seeded_model(seed: int) -> LoadedModel:
    torch.manual_seed(seed)
    return reference_model()


@pytest.fixture(scope="module")
def pair(postgres_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    models = {}
    for seed in (0, 1):
        model = _seeded_model(seed)
        models[register_model(model, MODEL_NAME, promote=False)] = model
    v1, v2 = models
    modelstore.promote(v1)

    history, requests = demo_day(HISTORY_DAY, 1000, 100), demo_day(REQUEST_DAY, 2000, 100)
    root = tmp_path_factory.mktemp("replicas")
    with ExitStack() as stack:
        url = stack.enter_context(fresh_postgres_database(postgres_admin_url, prefix="tandem_replicas"))
        migrate_and_ingest(url, history, HISTORY_DAY)  # once: both replicas read the same history
        replicas = []
        for name in ("a", "b"):
            data_dir = root / name
            data_dir.mkdir()
            env = service_env(database_url=url, data_dir=data_dir, model_name=MODEL_NAME) | {
                # The same model store for both (tests/conftest.py's, which this process uses too).
                "BENTOML_HOME": os.environ["BENTOML_HOME"],
                "TANDEM_SERVING_MODEL_POLL_INTERVAL_S": str(POLL_S),
                "TANDEM_SERVING_P99_TARGET_MS": str(TARGET_MS),
                "TANDEM_SERVING_REQUEST_TIMEOUT_MS": "5000",
                "TANDEM_SERVING_OUTBOX_DRAIN_INTERVAL_S": "0.2",
            }
            # Entered last, so stopped first: the database is dropped once both servers are down.
            replicas.append(stack.enter_context(serve(Replica, env, data_dir / "serve.log", name=name)))
        a, b = replicas
        assert a.port != b.port
        yield Pair(a=a, b=b, database_url=url, history=history, requests=requests, models=models, v1=v1, v2=v2)


# ------------------------------------------------------------------ answers
@dataclass
class Outcome:
    replica: Replica
    body: list[dict[str, Any]]
    final: httpx.Response
    statuses: list[int]  # every status received, the final one last


def until_final(replica: Replica, rows: list[dict[str, Any]], key: str, first: httpx.Response) -> Outcome:
    """Retries a request answered "not yet" (409 key in flight, 503 overloaded: both with
    Retry-After) after Retry-After until its answer is final, for at most FINAL_WITHIN_S."""
    response, statuses = first, [first.status_code]
    deadline = time.monotonic() + FINAL_WITHIN_S
    while response.status_code in (409, 503):
        if response.status_code == 409:
            assert response.json()["error"] == "idempotency_key_in_progress", response.text
        retry_after = float(response.headers["Retry-After"])
        assert time.monotonic() + retry_after < deadline, f"no final answer within {FINAL_WITHIN_S} s: {statuses}"
        time.sleep(retry_after)
        response = replica.post(rows, key)
        statuses.append(response.status_code)
    return Outcome(replica, rows, response, statuses)


def send_at_once(sends: list[tuple[Replica, list[dict[str, Any]]]], key: str) -> list[Outcome]:
    """Each (replica, body) under `key` from a thread of its own, released together on warm
    connections; each retried until final. Outcomes in the order of `sends`."""
    barrier = threading.Barrier(len(sends))

    def one(replica: Replica, rows: list[dict[str, Any]]) -> Outcome:
        with httpx.Client(timeout=TIMEOUT_S) as client:
            assert client.get(f"{replica.url}/readyz").status_code == 200  # the connection is open
            barrier.wait(timeout=TIMEOUT_S)
            first = client.post(f"{replica.url}/score", json={"transactions": rows}, headers={"Idempotency-Key": key})
        return until_final(replica, rows, key, first)

    with ThreadPoolExecutor(max_workers=len(sends)) as pool:
        futures = [pool.submit(one, replica, rows) for replica, rows in sends]
        # Every call is bounded (HTTP timeouts, the barrier's, until_final's deadline).
        return [future.result(timeout=FINAL_WITHIN_S + 3 * TIMEOUT_S) for future in futures]


def expected(pair: Pair, tag: str, rows: list[dict[str, Any]]) -> dict[str, tuple[float, str]]:
    """Each record scored alone by `tag` against the stored history, as the service answers it:
    (score, input hash) by transaction id."""
    predictor = TorchPredictor(pair.models[tag], tag, spec=REFERENCE)
    history = FrameHistory(REFERENCE, pair.history)
    frame = pl.DataFrame(rows).select(RAW_COLUMNS)
    scored = pl.concat([predictor.predict(frame.slice(i, 1), history) for i in range(frame.height)])
    return {
        str(tx): (float(score), str(digest))
        for tx, score, digest in zip(scored["record_id"], scored["score"], scored["input_hash"], strict=True)
    }


def two_bodies(pair: Pair, count: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two bodies of the same `count` transactions, the amounts changed in the second: another
    request under the same ids (other input hashes, other scores)."""
    first = pair.rows(count)
    second = [{**row, "amount": round(float(row["amount"]) * 40 + 1234.5, 2)} for row in first]
    one, other = expected(pair, pair.v1, first), expected(pair, pair.v1, second)
    assert all(one[tx][1] != other[tx][1] for tx in one), (one, other)
    # The untrained model's scores barely move with the amount: some must, so that a score alone
    # tells the bodies' answers apart too.
    assert any(abs(one[tx][0] - other[tx][0]) > 1e-4 for tx in one), (one, other)
    return first, second


def stored_rows(pair: Pair, transaction_ids: list[str]) -> list[dict[str, Any]]:
    engine = make_engine(pair.database_url)
    try:
        with engine.connect() as conn:
            query = sa.select(predictions).where(predictions.c.record_id.in_(transaction_ids))
            return [dict(row._mapping) for row in conn.execute(query)]
    finally:
        engine.dispose()


def check_one_winner(pair: Pair, key: str, outcomes: list[Outcome]) -> None:
    """One 200 and one final 422 `idempotency_key_reused`; the 200 is its own body's answer; the
    winning body replayed at the other replica is the same item-level answer; the losing body is
    refused at both; the store holds one row per transaction, the winner's."""
    report = [(o.replica.name, o.statuses, o.final.text[:300]) for o in outcomes]
    for outcome in outcomes:
        if outcome.final.status_code == 200:
            assert "error" not in outcome.final.json(), ("HTTP 200 carrying a refusal", report)
    finals = sorted(outcome.final.status_code for outcome in outcomes)
    assert finals == [200, 422], report
    (won,) = (o for o in outcomes if o.final.status_code == 200)
    (lost,) = (o for o in outcomes if o.final.status_code == 422)
    assert won.statuses == [200], ("the winner is answered at once", report)
    refused = lost.final.json()
    assert refused["error"] == "idempotency_key_reused", refused
    assert refused["detail"]["idempotency_key"] == key, refused

    answer = won.final.json()["results"]
    ids = [str(row["transaction_id"]) for row in won.body]
    assert [item["transaction_id"] for item in answer] == ids
    version = modelstore.production_tag(MODEL_NAME)
    mine, other = expected(pair, version, won.body), expected(pair, version, lost.body)
    for item in answer:
        assert item["status"] == "scored" and item["model_version"] == version and not item["degraded"], item
        score, digest = mine[item["transaction_id"]]
        assert item["input_hash"] == digest != other[item["transaction_id"]][1], ("not its own body's", item)
        assert item["score"] == pytest.approx(score, abs=1e-5), ("not its own body's", item)

    # The winning body at the other replica (the one that refused the other body): the stored
    # answer, item for item (the item-level request_id is the request that produced it).
    replay = until_final(lost.replica, won.body, key, lost.replica.post(won.body, key))
    assert replay.final.status_code == 200, (replay.statuses, replay.final.text)
    assert replay.final.json()["results"] == answer
    assert replay.final.headers["X-Request-ID"] != won.final.headers["X-Request-ID"], "a request of its own"
    again = until_final(won.replica, won.body, key, won.replica.post(won.body, key))
    assert again.final.status_code == 200 and again.final.json()["results"] == answer, again.final.text
    # The losing body stays refused at both replicas.
    for replica in (pair.a, pair.b):
        still = until_final(replica, lost.body, key, replica.post(lost.body, key))
        assert still.final.status_code == 422, (replica.name, still.statuses, still.final.text)
        assert still.final.json()["error"] == "idempotency_key_reused"

    # The store: exactly one row per transaction of these ids, each the winner's answer; nothing
    # for the refused body (whose items share the ids, with other amounts: other input hashes).
    def written() -> list[dict[str, Any]]:
        rows = stored_rows(pair, ids)
        return rows if len(rows) >= len(ids) else []

    rows = until(written, timeout_s=15, interval_s=0.1, message=lambda: f"rows never written: {stored_rows(pair, ids)}")
    time.sleep(0.5)  # a late second row would be a write already submitted: the writer coalesces for 50 ms
    rows = stored_rows(pair, ids)
    by_id = {item["transaction_id"]: item for item in answer}
    assert sorted(row["record_id"] for row in rows) == sorted(ids), rows
    for row in rows:
        item = by_id[row["record_id"]]
        assert row["idempotency_key"] == key, row
        assert row["path"] == "online" and row["model_version"] == item["model_version"], row
        assert (row["request_id"], row["batch_id"]) == (item["request_id"], item["batch_id"]), (row, item)
        assert row["input_hash"] == item["input_hash"], (row, item)
        assert row["score"] == pytest.approx(item["score"], rel=1e-6), (row, item)
        assert not row["degraded"], row
    print(f"key {key}: {won.replica.name} answered {won.statuses}, {lost.replica.name} got {lost.statuses}")


# ------------------------------------------------------------------ the tests
def test_one_key_two_bodies_two_replicas_one_answer(pair: Pair) -> None:
    # At (nearly) the same time: body 1 to replica a, body 2 to replica b. Repeated under fresh
    # keys, so the race goes either way; every round must leave one winner.
    for _ in range(3):
        first, second = two_bodies(pair, 3)
        key = f"race-{uuid.uuid4().hex}"
        check_one_winner(pair, key, send_at_once([(pair.a, first), (pair.b, second)], key))

    # One after the other, the bodies reversed: body 2 to replica a first, then body 1 to b.
    first, second = two_bodies(pair, 3)
    key = f"sequential-{uuid.uuid4().hex}"
    earlier = until_final(pair.a, second, key, pair.a.post(second, key))
    later = until_final(pair.b, first, key, pair.b.post(first, key))
    check_one_winner(pair, key, [earlier, later])
    assert (earlier.statuses, later.statuses) == ([200], [422]), "the first to arrive wins"


def test_a_promotion_reaches_both_replicas(pair: Pair) -> None:
    for replica in (pair.a, pair.b):
        assert replica.metric("tandem_serving_model_info", model_version=pair.v1) == 1, replica.name
    # A keyed answer from before the promotion: its key names that answer, whichever version serves.
    kept_body = pair.rows(2)
    kept_key = f"kept-{uuid.uuid4().hex}"
    kept = pair.a.post(kept_body, kept_key)
    assert kept.status_code == 200, kept.text
    assert {item["model_version"] for item in kept.json()["results"]} == {pair.v1}

    promoted_at = time.monotonic()
    modelstore.promote(pair.v2)
    moved_after: dict[str, float] = {}
    answers: dict[str, dict[str, Any]] = {}

    def both_moved() -> bool:
        for replica in (pair.a, pair.b):
            if replica.name in moved_after:
                continue
            rows = pair.rows(1)  # a fresh transaction: never an earlier answer
            response = replica.post(rows)
            assert response.status_code in (200, 503), (replica.name, response.status_code, response.text)
            if response.status_code == 200:
                (item,) = response.json()["results"]
                assert item["model_version"] in (pair.v1, pair.v2), item
                if item["model_version"] == pair.v2:
                    moved_after[replica.name] = time.monotonic() - promoted_at
                    answers[replica.name] = {**rows[0], "answer": item}
        return len(moved_after) == 2

    until(
        both_moved,
        timeout_s=SWAP_WITHIN_S,
        interval_s=POLL_S,
        message=lambda: f"moved: {moved_after}; logs: a {pair.a.log_text()[-1500:]} b {pair.b.log_text()[-1500:]}",
    )
    print(f"v2 answered after: { {name: round(s, 2) for name, s in moved_after.items()} } s")

    for replica in (pair.a, pair.b):
        assert replica.metric("tandem_serving_model_info", model_version=pair.v2) == 1, replica.name
        assert replica.metric("tandem_serving_model_info", model_version=pair.v1) == 0, replica.name
        assert replica.metric("tandem_serving_model_swaps_total", outcome="succeeded") == 1, replica.name
        assert replica.metric("tandem_serving_model_swaps_total", outcome="failed") == 0, replica.name
        # v2's own score, not v1's relabelled.
        row = answers[replica.name]
        item = row.pop("answer")
        ((score, _),) = expected(pair, pair.v2, [row]).values()
        assert item["score"] == pytest.approx(score, abs=1e-5), (replica.name, item)
        # The key answered before the promotion still replays that answer, at either replica.
        replay = until_final(replica, kept_body, kept_key, replica.post(kept_body, kept_key))
        assert replay.final.status_code == 200, (replica.name, replay.statuses, replay.final.text)
        assert replay.final.json()["results"] == kept.json()["results"], replica.name
