"""The online path in process, for a spec of another shape (tiny, its model at K = 0): the gate,
the scorer and the answer follow the spec's plural and id; warm-up scores the spec's example; and
no history is read from the store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest
import torch
from sqlalchemy.engine import Engine

from inference.contract import TorchPredictor
from inference.model import build_model
from inference.spec import load_spec
from serving.breaker import CircuitBreaker
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.runtime import OnlineScorer
from serving.scoring import ScoringCore
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.serving.score_route import with_score_route

TINY = load_spec("tests.specs.tiny:SPEC")
MODEL_VERSION = "reading_model:v1"


def reading(reading_id: str, **changes: Any) -> dict[str, Any]:
    return {**TINY.spec.example(), "reading_id": reading_id, **changes}


@pytest.fixture
def no_history_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Fails any store read of history: a model at K = 0 must not make one."""
    reads: list[int] = []

    def refused(conn: object, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        reads.append(history_length)
        raise AssertionError("history read at K = 0")

    monkeypatch.setattr("serving.scoring.fetch_history", refused)
    yield reads


@asynccontextmanager
async def tiny_client(engine: Engine, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, OnlineScorer]]:
    torch.manual_seed(0)
    model = build_model(TINY, {"history_length": 0})
    predictor = TorchPredictor(model=model, model_version=MODEL_VERSION, spec=TINY)
    core = ScoringCore(TINY, predictor, engine, CircuitBreaker(3, 1.0), code_version="test")
    settings = ServingSettings(max_records_per_request=3, p99_target_ms=60_000, max_batch_size=4)
    scorer = OnlineScorer(
        spec=TINY,
        process=core.score,
        executor=ThreadPoolExecutor(max_workers=1),
        model_version=MODEL_VERSION,
        engine=engine,
        settings=settings,
        outbox=Outbox(tmp_path / "outbox.sqlite3"),
        metrics=ServingMetrics(settings=settings),
    )
    await asyncio.to_thread(scorer.warm_up, 1)
    await scorer.start()
    app = with_score_route(lambda: scorer, security=SecuritySettings(auth_token=None))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tandem.test") as client:
            yield client, scorer
    finally:
        await scorer.close()
        scorer.executor.shutdown(wait=True)


def run(engine: Engine, tmp_path: Path, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async def scenario() -> list[httpx.Response]:
        async with tiny_client(engine, tmp_path) as (client, _):
            return [await client.post("/score", json=body) for body in bodies]

    return asyncio.run(scenario())


def test_records_are_answered_by_their_id_and_rules_fail_their_item_alone(
    sqlite_engine: Engine, tmp_path: Path, no_history_reads: list[int]
) -> None:
    (answer,) = run(
        sqlite_engine,
        tmp_path,
        [{"readings": [reading("r-1"), reading("r-2", colour="red", level=95.0), reading("r-3", colour="mauve")]}],
    )
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["reading_id"] for r in results] == ["r-1", "r-2", "r-3"]
    assert "transaction_id" not in results[0]
    assert [r["status"] for r in results] == ["scored", "error", "scored"]
    assert results[1]["error"]["reason"] == "level_on_red"
    assert results[2]["unseen_fields"] == ["colour"]
    assert all(r["degraded"] is False for r in results)
    assert no_history_reads == []


def test_refusals_name_the_specs_plural_and_fields(sqlite_engine: Engine, tmp_path: Path) -> None:
    too_many, duplicate, invalid, other_plural = run(
        sqlite_engine,
        tmp_path,
        [
            {"readings": [reading(f"r-{i}") for i in range(4)]},
            {"readings": [reading("r-1"), reading("r-1")]},
            {"readings": [reading("r-1", level=-1.0)]},
            {"transactions": [reading("r-1")]},
        ],
    )
    assert too_many.status_code == 413 and too_many.json()["error"] == "too_many_readings"
    assert "at most 3 readings" in too_many.json()["detail"]
    assert duplicate.status_code == 422
    assert duplicate.json()["detail"] == [
        {"loc": ["readings", 1, "reading_id"], "msg": "duplicate reading_id in request"}
    ]
    assert invalid.status_code == 422
    assert [e["loc"] for e in invalid.json()["detail"]] == [["readings", 0, "level"]]
    assert other_plural.status_code == 422
    assert {tuple(e["loc"]) for e in other_plural.json()["detail"]} == {("readings",), ("transactions",)}
