"""TANDEM_SERVING_WORKERS=2 against a real `bentoml serve`: two server processes answer /score
behind one port, and /metrics sums what both of them counted.

Which process answered is read from the Prometheus multiprocess files, not from a debug endpoint:
under `bentoml serve` every worker writes its counters to `counter_<pid>.db` in
$BENTOML_HOME/prometheus_multiproc_dir, so the pids whose files counted scored items are exactly the
processes that answered. The test's own BENTOML_HOME keeps that folder private to this server.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import bentoml
import httpx
import psutil
import pytest
from prometheus_client.mmap_dict import MmapedDict

from tests.reference import MERCHANT_CATEGORIES
from tests.serving.support import LiveServer, serve
from tests.shared import fresh_postgres_database, register_untrained_model, service_env

pytestmark = [pytest.mark.live, pytest.mark.postgres]

MODEL_NAME = "workers_test_model"
WORKERS = 2
REQUESTS = 100
# If the kernel handed every connection of the first round to one process (one worker still
# warming up, say), more rounds follow; this many requests in all at most.
MAX_REQUESTS = 600


@dataclass
class Server(LiveServer):
    multiproc_dir: Path

    def scored_by_pid(self) -> dict[int, float]:
        """Items counted `scored` in each process's own counter file."""
        counted: dict[int, float] = {}
        for path in self.multiproc_dir.glob("counter_*.db"):
            pid = int(path.stem.rsplit("_", 1)[1])
            for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
                _, sample, labels, _ = json.loads(key)
                if sample == "tandem_serving_items_total" and labels.get("outcome") == "scored" and value > 0:
                    counted[pid] = counted.get(pid, 0.0) + value
        return counted


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, postgres_admin_url: str) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("workers")
    # The model is registered in the session's store, then copied into a store of this server's
    # own: its BENTOML_HOME also holds the multiprocess metric files, which `bentoml serve` wipes
    # at start, so no other server may share it.
    tag = register_untrained_model(MODEL_NAME, promote=False)
    home = root / "bentoml"
    version_dir = Path(bentoml.models.get(tag).path)
    shutil.copytree(version_dir.parent, home / "models" / version_dir.parent.name)

    with fresh_postgres_database(postgres_admin_url, prefix="tandem_workers") as database_url:
        env = service_env(database_url=database_url, data_dir=root / "data", model_name=MODEL_NAME) | {
            "BENTOML_HOME": str(home),
            # Pinned: no production pointer in this store, and no hot-swap polling.
            "TANDEM_SERVING_MODEL_TAG": tag,
            "TANDEM_SERVING_WORKERS": str(WORKERS),
            # Two shared cores, two workers, two scoring processes and a load generator: this test is
            # about where answers come from, not latency, so nothing may be shed or time out.
            "TANDEM_SERVING_P99_TARGET_MS": "10000",
            "TANDEM_SERVING_REQUEST_TIMEOUT_MS": "30000",
        }
        with serve(Server, env, root / "serve.log", multiproc_dir=home / "prometheus_multiproc_dir") as live:
            yield live


def _request(index: int) -> list[dict[str, Any]]:
    """1 to 3 transactions with ids no other request uses (no idempotent replays)."""
    moment = datetime(2026, 11, 2, 10, tzinfo=UTC) + timedelta(seconds=index)
    return [
        {
            "transaction_id": f"w-{index}-{item}",
            "account_id": f"acct-{index % 17}",
            "amount": 10.0 + index,
            "currency": "USD",
            "merchant_category": MERCHANT_CATEGORIES[index % len(MERCHANT_CATEGORIES)],
            "country": "US",
            "event_time": (moment + timedelta(milliseconds=item)).isoformat(),
        }
        for item in range(1 + index % 3)
    ]


def _send(server: Server, indexes: range) -> tuple[list[int], int]:
    """Status codes, and items sent; each request on a connection of its own, several at a time."""

    def one(index: int) -> int:
        response = httpx.post(f"{server.url}/score", json={"transactions": _request(index)}, timeout=60)
        return response.status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(one, indexes))
    return statuses, sum(len(_request(index)) for index in indexes)


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process under `pid`; a helper that exits (or is a zombie
    not yet reaped) while it is listed is skipped, not an error."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found.append((child.pid, " ".join(child.cmdline())))
        except psutil.Error:
            continue
    return found


def test_two_workers_answer_and_metrics_add_up(server: Server) -> None:
    workers = {pid for pid, cmdline in _descendants(server.process.pid) if "_bentoml_impl.worker.service" in cmdline}
    assert len(workers) == WORKERS, f"server processes under `bentoml serve`: {workers}"

    statuses, items = _send(server, range(REQUESTS))
    sent = REQUESTS
    while len(server.scored_by_pid()) < WORKERS and sent < MAX_REQUESTS:
        more, more_items = _send(server, range(sent, sent + REQUESTS))
        statuses += more
        items += more_items
        sent += REQUESTS

    assert statuses == [200] * sent
    answered_by = server.scored_by_pid()
    assert set(answered_by) == workers, f"answers came from {answered_by}, workers are {workers}"
    assert sum(answered_by.values()) == items
    # /metrics, answered by one worker, sums both workers' files.
    assert server.metric("tandem_serving_items_total", outcome="scored") == items
    for outcome in ("degraded", "rejected", "shed", "expired", "failed"):
        assert server.metric("tandem_serving_items_total", outcome=outcome) == 0, outcome
    assert server.metric("tandem_serving_request_latency_seconds_count", status="200") == sent
    assert server.metric("tandem_serving_score_count") == items
    assert server.metric("tandem_serving_requests_in_flight") == 0
    # Gauges that every worker sets to the same value are not summed ("max").
    assert server.metric("tandem_serving_availability_target") == 0.999
    assert server.metric("tandem_serving_p99_target_seconds") == 10.0


def test_one_key_with_two_bodies_at_once_gets_one_answer_across_workers(server: Server) -> None:
    """Pairs of requests, one key and two bodies each, sent at once on connections of their own:
    the kernel spreads them over both processes, and the store lets exactly one of each pair in."""

    def one(key: str, amount: float) -> httpx.Response:
        body = _request(10_000)[:1]
        body[0]["amount"] = amount
        return httpx.post(
            f"{server.url}/score", json={"transactions": body}, headers={"Idempotency-Key": key}, timeout=60
        )

    pairs = 20
    with ThreadPoolExecutor(max_workers=2 * pairs) as pool:
        answers = list(
            pool.map(lambda args: one(*args), [(f"pair-{i}", amount) for i in range(pairs) for amount in (1.0, 2.0)])
        )
    for i in range(pairs):
        statuses = sorted(response.status_code for response in answers[2 * i : 2 * i + 2])
        assert statuses == [200, 422], (i, [r.text for r in answers[2 * i : 2 * i + 2]])
