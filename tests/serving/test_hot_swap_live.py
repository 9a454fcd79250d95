"""Model promotion without a restart, against a real `bentoml serve` under steady load: promote,
then roll back, with nothing failed or stalled, the new version's own scores, and lineage rows
naming the version that answered. The swap's mechanics, with fakes in-process, are
test_hot_swap_in_process.py.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import httpx
import numpy as np
import polars as pl
import pytest
import torch

from bench.loadgen import heap_frozen
from inference.contract import FrameHistory, TorchPredictor
from inference.lineage import RecordLineage, explain
from inference.model import LoadedModel
from inference.store import make_engine
from tandem import modelstore
from tests.reference import RAW_COLUMNS, REFERENCE
from tests.serving.support import DemoServer, StartDemoServer
from tests.shared import reference_model, register_model, until

MODEL_NAME = "risk_model"
HISTORY_DAY = date(2026, 12, 1)
REQUEST_DAY = date(2026, 12, 2)
RATE = 30.0  # requests per second, one distinct transaction each
POLL_S = 0.25
# Generous for two shared, noisy cores: the point is that nothing fails or stalls during the swap,
# not the 50 ms production target (admission at that target is unit-tested in-process).
TARGET_MS = 1000
# Under the 2 s default request deadline: with default settings no client would have timed out.
# Measured with neighbours' test runs on the same two cores: 0.12-0.3 s, about the p99 before the
# change; up to 1.2 s when the promotion overlapped the server's first seconds under load.
SWAP_P99_BOUND_MS = 1500.0
DAGSTER_UI = "http://127.0.0.1:3000"


@dataclass
class SwapServer(DemoServer):
    v1: str
    v2: str
    models: dict[str, LoadedModel]


@dataclass(frozen=True)
class Answer:
    transaction_id: str
    sent_at: float  # seconds since the load started
    latency_ms: float
    status: int
    result: dict[str, Any] | None  # the one ItemResult, when the status is 200

    @property
    def version(self) -> str | None:
        return None if self.result is None else str(self.result["model_version"])


def _seeded_model(seed: int) -> LoadedModel:
    torch.manual_seed(seed)
    return reference_model()


@pytest.fixture(scope="module")
def swap_server(start_demo_server: StartDemoServer) -> Iterator[SwapServer]:
    models = {}
    tags = []
    for seed in (0, 1):
        model = _seeded_model(seed)
        tag = register_model(model, MODEL_NAME, promote=False)
        models[tag] = model
        tags.append(tag)
    v1, v2 = tags
    modelstore.promote(v1)

    env = {
        "TANDEM_SERVING_P99_TARGET_MS": str(TARGET_MS),
        "TANDEM_SERVING_REQUEST_TIMEOUT_MS": "10000",
        "TANDEM_SERVING_MODEL_POLL_INTERVAL_S": str(POLL_S),
        "TANDEM_SERVING_OUTBOX_DRAIN_INTERVAL_S": "0.2",
    }
    days = (HISTORY_DAY, REQUEST_DAY)
    with start_demo_server(
        SwapServer, "swap", days, rows=2000, accounts=150, env=env, v1=v1, v2=v2, models=models
    ) as live:
        yield live


async def steady_load(
    server: SwapServer,
    rows: Iterator[dict[str, Any]],
    *,
    change: Callable[[], Awaitable[None]],
    change_after_s: float,
    expect: str,
    settle_s: float,
    max_s: float,
) -> tuple[list[Answer], float]:
    """Open-loop load at RATE, one fresh transaction per request; `change` (a promotion or a
    rollback) runs `change_after_s` in. Stops `settle_s` after the first answer from `expect`,
    or at `max_s`. Returns the answers and when the change was made (seconds since the start)."""
    answers: list[Answer] = []
    changed_at = math.inf
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(timeout=15, limits=limits) as client:
        begin = time.perf_counter()

        async def one(row: dict[str, Any]) -> None:
            sent = time.perf_counter()
            try:
                response = await client.post(f"{server.url}/score", json={"transactions": [row]})
                status = response.status_code
                result = response.json()["results"][0] if status == 200 else None
            except httpx.HTTPError:
                status, result = -1, None
            done = time.perf_counter()
            answers.append(Answer(row["transaction_id"], sent - begin, (done - sent) * 1000, status, result))

        async def make_change() -> None:
            nonlocal changed_at
            await asyncio.sleep(change_after_s)
            await change()
            changed_at = time.perf_counter() - begin

        changing = asyncio.create_task(make_change())
        tasks = []
        for index, row in enumerate(rows):
            elapsed = time.perf_counter() - begin
            first = min((a.sent_at + a.latency_ms / 1000 for a in answers if a.version == expect), default=None)
            if elapsed > max_s or (first is not None and elapsed > first + settle_s):
                break
            delay = begin + index / RATE - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(row)))
        await changing
        await asyncio.gather(*tasks)
    return answers, changed_at


def _check_switch(answers: list[Answer], old: str, new: str, changed_at: float) -> list[Answer]:
    """No failures, and in the server's order (produced_at) the old version, then only the new one."""
    failed = [
        (a.status, a.result) for a in answers if a.status != 200 or a.result is None or a.result["status"] != "scored"
    ]
    assert not failed, failed[:5]
    ordered = sorted(answers, key=lambda a: datetime.fromisoformat(str(a.result["produced_at"])) if a.result else 0)
    versions = [a.version for a in ordered]
    assert set(versions) == {old, new}, set(versions)
    switch = versions.index(new)
    assert versions[:switch] == [old] * switch and versions[switch:] == [new] * (len(versions) - switch), (
        "answers went back to the old version after the new one"
    )
    assert min(a.sent_at for a in answers if a.version == new) >= changed_at - 0.5, "new version before the change"
    return ordered


def _p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99)) if latencies else math.nan


def _swap_latency(answers: list[Answer], changed_at: float, new: str, what: str) -> str:
    """p99 in the 2 s before the change and while it is picked up (change to first new answer, + 1 s)."""
    first_new = min(a.sent_at for a in answers if a.version == new)
    before = [a.latency_ms for a in answers if changed_at - 2.0 <= a.sent_at < changed_at]
    during = [a.latency_ms for a in answers if changed_at <= a.sent_at <= first_new + 1.0]
    report = (
        f"{what}: {len(answers)} requests at {RATE:.0f} rps; p99 before {_p99(before):.0f} ms; "
        f"{first_new - changed_at:.1f} s to the first answer of the new version; p99 during the swap "
        f"{_p99(during):.0f} ms (max {max(during):.0f} ms, n={len(during)})"
    )
    print(report)
    assert _p99(during) < SWAP_P99_BOUND_MS, report
    return report


def _rows_for_lineage(server: SwapServer, answers: list[Answer]) -> None:
    engine = make_engine(server.database_url)

    def stored(transaction_id: str) -> RecordLineage | None:
        found = explain(REFERENCE, engine, transaction_id, dagster_ui_url=DAGSTER_UI)
        return found if found.results else None

    try:
        for answer in answers:
            assert answer.result is not None
            found = until(
                functools.partial(stored, answer.transaction_id), timeout_s=15, interval_s=0.1, message=repr(answer)
            )
            assert len(found.results) == 1, found
            row = found.results[0]
            assert row.model_version == answer.version
            assert row.path == "online"
            assert row.request_id == answer.result["request_id"]
            assert row.batch_id == answer.result["batch_id"]
            assert row.producer == f"request {row.request_id} batch {row.batch_id}"
            assert row.score == pytest.approx(answer.result["score"])
            assert row.dagster_run_url is None
            assert found.source_found is False, "online requests are not source records"
    finally:
        engine.dispose()


@pytest.mark.live
@pytest.mark.postgres
def test_promotion_and_rollback_under_load_fail_nothing(swap_server: SwapServer) -> None:
    server = swap_server
    started = time.perf_counter()
    rows = iter(server.requests.to_dicts())
    assert server.metric("tandem_serving_model_info", model_version=server.v1) == 1

    # The client's own pauses would be charged to the swap (bench.loadgen.heap_frozen): late in a
    # full test run on a slow day, the rollback's window read three answers at 1.6-1.8 s and only
    # five requests sent in 1.2 s at 30 rps, a stalled client; alone the same test read 54-61 ms.
    with heap_frozen():
        answers, promoted_at = asyncio.run(
            steady_load(
                server,
                rows,
                change=lambda: asyncio.to_thread(modelstore.promote, server.v2),
                # Past the first seconds after readiness, which are slower whatever happens (measured:
                # p99 ~2x), so the swap's own cost is what the window shows.
                change_after_s=6.0,
                expect=server.v2,
                settle_s=3.0,
                max_s=45.0,
            )
        )
    if not any(a.version == server.v2 for a in answers):
        pytest.fail(f"v2 never answered; server log: {server.log_text()[-3000:]}")
    ordered = _check_switch(answers, server.v1, server.v2, promoted_at)
    _swap_latency(answers, promoted_at, server.v2, "promotion")

    # The new version's answers are its own scores, not the old model's with a new label: each
    # record of its first batches re-scored alone against the stored history (records of one batch
    # never read each other).
    by_id = {str(row["transaction_id"]): row for row in server.requests.to_dicts()}
    predictor = TorchPredictor(server.models[server.v2], server.v2, spec=REFERENCE)
    history = FrameHistory(REFERENCE, server.history)
    first_batches = list(
        dict.fromkeys(str(a.result["batch_id"]) for a in ordered if a.result and a.version == server.v2)
    )
    for batch_id in first_batches[:3]:
        for answer in (a for a in answers if a.result and a.result["batch_id"] == batch_id):
            assert answer.result is not None
            alone = pl.DataFrame([by_id[answer.transaction_id]]).select(RAW_COLUMNS)
            expected = predictor.predict(alone, history)["score"][0]
            assert answer.result["score"] == pytest.approx(expected, abs=1e-5)

    assert server.metric("tandem_serving_model_info", model_version=server.v2, code_version="test") == 1
    assert server.metric("tandem_serving_model_info", model_version=server.v1) == 0
    assert server.metric("tandem_serving_model_swaps_total", outcome="succeeded") == 1
    assert server.metric("tandem_serving_model_swaps_total", outcome="failed") == 0

    switch = [a.version for a in ordered].index(server.v2)
    around = ordered[switch - 3 : switch + 3]
    assert [a.version for a in around] == [server.v1] * 3 + [server.v2] * 3
    _rows_for_lineage(server, around)

    with heap_frozen():
        answers, rolled_back_at = asyncio.run(
            steady_load(
                server,
                rows,
                change=lambda: asyncio.to_thread(assert_rolled_back_to, server.v1),
                change_after_s=2.0,
                expect=server.v1,
                settle_s=1.0,
                max_s=40.0,
            )
        )
    _check_switch(answers, server.v2, server.v1, rolled_back_at)
    _swap_latency(answers, rolled_back_at, server.v1, "rollback")
    assert server.metric("tandem_serving_model_info", model_version=server.v1) == 1
    assert server.metric("tandem_serving_model_info", model_version=server.v2) == 0
    assert server.metric("tandem_serving_model_swaps_total", outcome="succeeded") == 2
    print(f"hot swap live test: {time.perf_counter() - started:.1f} s after the server was ready")


def assert_rolled_back_to(expected: str) -> None:
    assert modelstore.rollback(MODEL_NAME) == expected
