"""The service's metrics in-process: SLO gauges and latency buckets from the settings, what each
/score outcome counts (items by outcome, scores, requests over the target, requests in flight),
and the bounded outbox drain at shutdown. HTTP through the real Starlette app on an in-process
ASGI transport, so one event loop runs the app and the scorer."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import Engine

from inference.store import utc_now
from serving.admission import Decision
from serving.batcher import Reservation
from serving.metrics import ITEM_OUTCOMES, SCORE_BUCKETS, ServingMetrics, latency_buckets
from serving.runtime import DeadlineExceeded, OnlineScorer, Shed
from serving.schemas import ItemError, api_models
from serving.scoring import BatchResult, ItemSpec
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.reference import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES, REFERENCE, ItemResult
from tests.serving.score_route import with_score_route
from tests.serving.support import started_scorer

MODEL = "risk_model:metrics"


def sample(metrics: ServingMetrics, name: str, **labels: str) -> float:
    """The value of the sample `name` with exactly these labels, from the exposition (0 if absent)."""
    text = metrics.exposition().decode()
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return 0.0


def items(metrics: ServingMetrics) -> dict[str, float]:
    return {outcome: sample(metrics, "tandem_serving_items_total", outcome=outcome) for outcome in ITEM_OUTCOMES}


def tx(transaction_id: str) -> dict[str, Any]:
    return {
        "transaction_id": transaction_id,
        "account_id": "acct-1",
        "amount": 12.5,
        "currency": "USD",
        "merchant_category": "grocery",
        "country": "US",
        "event_time": "2026-11-02T10:00:00Z",
    }


# ------------------------------------------------------------------ registry, from the settings
def test_slo_gauges_come_from_the_settings() -> None:
    metrics = ServingMetrics(settings=ServingSettings(p99_target_ms=75, availability_target=0.995, slo_window_days=7))
    assert sample(metrics, "tandem_serving_p99_target_seconds") == 0.075
    assert sample(metrics, "tandem_serving_availability_target") == 0.995
    assert sample(metrics, "tandem_serving_slo_window_seconds") == 7 * 86_400


def test_defaults_without_settings_are_the_declared_slo(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment is not read: tests and tools get the documented defaults.
    monkeypatch.setenv("TANDEM_SERVING_AVAILABILITY_TARGET", "0.5")
    metrics = ServingMetrics()
    assert sample(metrics, "tandem_serving_availability_target") == 0.999
    assert sample(metrics, "tandem_serving_slo_window_seconds") == 28 * 86_400
    assert sample(metrics, "tandem_serving_p99_target_seconds") == 0.05


@pytest.mark.parametrize(
    ("target_ms", "le"), [(50, "0.05"), (75, "0.075"), (120, "0.12"), (33.3, "0.0333"), (5000, "5.0")]
)
def test_latency_histogram_has_a_bucket_exactly_at_the_target(target_ms: float, le: str) -> None:
    metrics = ServingMetrics(settings=ServingSettings(p99_target_ms=target_ms))
    metrics.latency.labels(status="200").observe(target_ms / 1000)  # on the boundary: counted as within
    assert sample(metrics, "tandem_serving_request_latency_seconds_bucket", status="200", le=le) == 1
    # The standard buckets are all still there.
    standard = latency_buckets(50)
    assert set(standard) <= set(latency_buckets(target_ms))
    assert set(latency_buckets(target_ms)) - set(standard) <= {round(target_ms / 1000, 6)}


def test_default_buckets_are_unchanged() -> None:
    assert latency_buckets(50) == (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


def test_every_item_outcome_is_exported_from_zero() -> None:
    metrics = ServingMetrics()
    assert items(metrics) == dict.fromkeys(ITEM_OUTCOMES, 0.0)
    text = metrics.exposition().decode()
    for outcome in ("scored", "rejected", "degraded", "shed", "expired"):
        assert f'tandem_serving_items_total{{outcome="{outcome}"}} 0.0' in text
    assert "tandem_serving_requests_over_target_total 0.0" in text
    assert "tandem_serving_requests_in_flight 0.0" in text
    assert SCORE_BUCKETS[0] == 0.05 and SCORE_BUCKETS[-1] == 1.0 and len(SCORE_BUCKETS) == 20


def test_multiprocess_modes_sum_in_flight_and_agree_on_targets() -> None:
    metrics = ServingMetrics()
    assert metrics.in_flight._multiprocess_mode == "livesum"
    for gauge in (metrics.availability_target, metrics.slo_window, metrics.p99_target):
        assert gauge._multiprocess_mode == "max"


# ------------------------------------------------------------------ /score through a real OnlineScorer
VOCABULARIES = {"country": COUNTRIES, "currency": CURRENCIES, "merchant_category": MERCHANT_CATEGORIES}


class OutcomeScoring:
    """Scores 0.25; ids starting `bad` get a per-item input error, `deg` a degraded score; values
    outside the vocabularies are flagged as the real scoring step flags them."""

    def __call__(self, specs: list[ItemSpec]) -> BatchResult:
        now = utc_now()
        results = []
        for spec in specs:
            tx_id = spec.record_id
            common: dict[str, Any] = {
                "transaction_id": tx_id,
                "model_version": MODEL,
                "path": "online",
                "request_id": spec.request_id,
                "batch_id": "b",
                "produced_at": now,
            }
            if tx_id.startswith("bad"):
                results.append(ItemResult(status="error", error=ItemError(reason="bad_currency"), **common))
            else:
                unseen = [name for name, known in VOCABULARIES.items() if spec.raw[name] not in known]
                results.append(
                    ItemResult(
                        status="scored",
                        score=0.25,
                        degraded=tx_id.startswith("deg"),
                        unseen_fields=unseen,
                        **common,
                    )
                )
        return BatchResult(results=results)


async def started_outcome_scorer(
    engine: Engine, tmp_path: Path, settings: ServingSettings, metrics: ServingMetrics
) -> OnlineScorer:
    """A started scorer whose scoring step is OutcomeScoring (an answer per id prefix)."""
    return await started_scorer(
        OutcomeScoring(), engine, tmp_path / "outbox.sqlite3", model_version=MODEL, settings=settings, metrics=metrics
    )


@asynccontextmanager
async def client_for(scorer: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = with_score_route(lambda: scorer, security=SecuritySettings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tandem.test") as client:
        yield client


def test_score_counts_items_by_outcome_and_observes_scores(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> ServingMetrics:
        # A target no test machine misses: nothing is over it.
        settings = ServingSettings(p99_target_ms=60_000)
        metrics = ServingMetrics(settings=settings)
        scorer = await started_outcome_scorer(sqlite_engine, tmp_path, settings, metrics)
        try:
            async with client_for(scorer) as client:
                answer = await client.post(
                    "/score", json={"transactions": [tx("a"), tx("b"), tx("bad-1"), tx("deg-1")]}
                )
                assert answer.status_code == 200
                # A retry still answers, and counts, its items.
                again = await client.post("/score", json={"transactions": [tx("a")]})
                assert again.status_code == 200
                invalid = await client.post("/score", json={"transactions": [tx("c"), {**tx("d"), "amount": -1}]})
                assert invalid.status_code == 422
                duplicate = await client.post("/score", json={"transactions": [tx("e"), tx("e")]})
                assert duplicate.status_code == 422
                # Refused before its items are read: counts none.
                assert (await client.post("/score", content=b"[", headers={"X-Deadline-Ms": "0"})).status_code == 400
        finally:
            await scorer.close()
        return metrics

    metrics = asyncio.run(scenario())
    assert items(metrics) == {"scored": 3, "degraded": 1, "rejected": 1 + 2 + 2, "shed": 0, "expired": 0, "failed": 0}
    # Every returned score, degraded ones included; none for the error.
    assert sample(metrics, "tandem_serving_score_count") == 4
    assert sample(metrics, "tandem_serving_score_bucket", le="0.25") == 4
    assert sample(metrics, "tandem_serving_score_bucket", le="0.2") == 0
    assert sample(metrics, "tandem_serving_request_latency_seconds_count", status="200") == 2
    assert sample(metrics, "tandem_serving_requests_over_target_total") == 0
    assert sample(metrics, "tandem_serving_requests_in_flight") == 0


def test_unseen_values_are_counted_per_scored_item_and_field(sqlite_engine: Engine, tmp_path: Path) -> None:
    async def scenario() -> tuple[ServingMetrics, list[dict[str, Any]]]:
        settings = ServingSettings(p99_target_ms=60_000)
        metrics = ServingMetrics(settings=settings)
        assert {name: unseen(metrics, name) for name in VOCABULARIES} == dict.fromkeys(VOCABULARIES, 0.0)
        scorer = await started_outcome_scorer(sqlite_engine, tmp_path, settings, metrics)
        try:
            async with client_for(scorer) as client:
                body = [
                    tx("a"),
                    {**tx("new-1"), "merchant_category": "ev_charging"},
                    {**tx("new-2"), "merchant_category": "ev_charging", "country": "KR"},
                    # An error answer counts no unseen value, whatever its fields hold.
                    {**tx("bad-1"), "currency": "KRW"},
                ]
                answer = await client.post("/score", json={"transactions": body})
                assert answer.status_code == 200
                # Malformed is not unseen: refused with the request, counted as rejected only.
                refused = await client.post("/score", json={"transactions": [{**tx("m"), "country": "usa"}]})
                assert refused.status_code == 422
        finally:
            await scorer.close()
        return metrics, answer.json()["results"]

    metrics, results = asyncio.run(scenario())
    assert [r["unseen_fields"] for r in results] == [[], ["merchant_category"], ["country", "merchant_category"], []]
    assert {name: unseen(metrics, name) for name in VOCABULARIES} == {
        "country": 1.0,
        "currency": 0.0,
        "merchant_category": 2.0,
    }


def unseen(metrics: ServingMetrics, field: str) -> float:
    return sample(metrics, "tandem_unseen_values_total", field=field)


# ------------------------------------------------------------------ /score with a scripted scorer
class CountingQueue:
    """Stands for the batcher behind a `Reservation`: how many places are still held."""

    def __init__(self) -> None:
        self.reserved = 0

    def unreserve(self) -> None:
        self.reserved -= 1


class ScriptedScorer:
    """What build_app reads from an OnlineScorer, with `score` replaced by a script; `admit`
    admits everything (or refuses with `refusal`), each admission a real `Reservation`."""

    def __init__(
        self,
        script: Callable[[], Any],
        *,
        scoring: bool = True,
        target_ms: float = 50,
        refusal: Decision | None = None,
    ) -> None:
        self.spec = REFERENCE
        self.api = api_models(REFERENCE)
        self.settings = ServingSettings(p99_target_ms=target_ms)
        self.metrics = ServingMetrics(settings=self.settings)
        self._script = script
        self._scoring = scoring
        self._refusal = refusal
        self.queue = CountingQueue()
        self.admitted: list[Reservation] = []
        self.finished_latencies: list[float | None] = []
        self.scored_with: list[Reservation | None] = []

    def scoring_available(self) -> bool:
        return self._scoring

    def admit(self, deadline: float) -> Reservation | Decision:
        assert deadline > time.monotonic()
        if self._refusal is not None:
            return self._refusal
        self.queue.reserved += 1
        reservation = Reservation(self.queue)  # type: ignore[arg-type]
        self.admitted.append(reservation)
        return reservation

    def finished(self, latency_s: float | None) -> None:
        self.finished_latencies.append(latency_s)

    async def score(
        self, transactions: list[Any], *, reservation: Reservation | None = None, **_: Any
    ) -> tuple[list[ItemResult], float]:
        self.scored_with.append(reservation)
        result = self._script()
        if asyncio.iscoroutine(result):
            result = await result
        answers = [
            ItemResult(
                transaction_id=t.transaction_id,
                status="scored",
                score=0.9,
                model_version=MODEL,
                path="online",
                request_id="r",
                produced_at=utc_now(),
            )
            for t in transactions
        ]
        return answers, 0.0


def _post(scorer: ScriptedScorer, count: int) -> int:
    async def go() -> int:
        async with client_for(scorer) as client:
            answer = await client.post("/score", json={"transactions": [tx(f"t{i}") for i in range(count)]})
            return answer.status_code

    return asyncio.run(go())


def test_shed_expired_and_failed_requests_count_all_their_items() -> None:
    def shed() -> None:
        raise Shed(Decision(admitted=False, predicted_wait_s=0.5, limit_s=0.05, reason="over_target"))

    def expire() -> None:
        raise DeadlineExceeded

    shedding = ScriptedScorer(shed)
    assert _post(shedding, 3) == 503
    assert items(shedding.metrics)["shed"] == 3

    expiring = ScriptedScorer(expire)
    assert _post(expiring, 2) == 504
    assert items(expiring.metrics)["expired"] == 2

    dead = ScriptedScorer(lambda: None, scoring=False)
    assert _post(dead, 4) == 503
    assert items(dead.metrics) == {**dict.fromkeys(ITEM_OUTCOMES, 0.0), "failed": 4}
    for scorer in (shedding, expiring, dead):
        assert sample(scorer.metrics, "tandem_serving_requests_over_target_total") == 0, "only 200s count"
        assert sample(scorer.metrics, "tandem_serving_score_count") == 0


def test_a_200_slower_than_the_target_is_counted_over_it() -> None:
    async def slow() -> None:
        await asyncio.sleep(0.1)  # at least 100 ms, whatever the machine: over a 20 ms target

    scorer = ScriptedScorer(slow, target_ms=20)
    assert _post(scorer, 1) == 200
    assert sample(scorer.metrics, "tandem_serving_requests_over_target_total") == 1
    assert sample(scorer.metrics, "tandem_serving_request_latency_seconds_bucket", status="200", le="0.02") == 0

    patient = ScriptedScorer(slow, target_ms=60_000)
    assert _post(patient, 1) == 200
    assert sample(patient.metrics, "tandem_serving_requests_over_target_total") == 0


def test_requests_in_flight_rises_while_a_request_waits_and_falls_after() -> None:
    async def scenario() -> tuple[float, float, int]:
        release = asyncio.Event()
        entered = asyncio.Event()

        async def wait() -> None:
            entered.set()
            await release.wait()

        scorer = ScriptedScorer(wait)
        async with client_for(scorer) as client:
            pending = asyncio.create_task(client.post("/score", json={"transactions": [tx("a")]}))
            await entered.wait()
            during = sample(scorer.metrics, "tandem_serving_requests_in_flight")
            release.set()
            status = (await pending).status_code
        return during, sample(scorer.metrics, "tandem_serving_requests_in_flight"), status

    during, after, status = asyncio.run(scenario())
    assert (during, after, status) == (1, 0, 200)


def test_every_admitted_request_gives_its_place_in_the_queue_back() -> None:
    """Admitted before its body is read, a request holds a place in the queue until it is
    answered or refused for its body; a place never given back would shrink admission for good."""
    scorer = ScriptedScorer(lambda: None)

    async def go() -> list[int]:
        async with client_for(scorer) as client:
            answered = await client.post("/score", json={"transactions": [tx("a")]})
            invalid = await client.post("/score", json={"transactions": [{"transaction_id": "b"}]})
            not_json = await client.post("/score", content=b"{", headers={"content-type": "application/json"})
            return [answered.status_code, invalid.status_code, not_json.status_code]

    assert asyncio.run(go()) == [200, 422, 422]
    assert len(scorer.admitted) == 3
    assert scorer.scored_with == [scorer.admitted[0]], "the answered request scored under its own reservation"
    assert scorer.queue.reserved == 0, "each place given back once"


def test_only_answered_requests_teach_the_concurrency_limit_their_latency() -> None:
    """Each admitted request ends once for the limit: a 200 with its latency; a 422 or a 504 (a
    key's wait, a deadline) with none, since it says nothing of how loaded the service is."""
    outcomes = iter([None, DeadlineExceeded()])

    def script() -> None:
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    scorer = ScriptedScorer(script)

    async def go() -> list[int]:
        async with client_for(scorer) as client:
            answered = await client.post("/score", json={"transactions": [tx("a")]})
            late = await client.post("/score", json={"transactions": [tx("b")]})
            invalid = await client.post("/score", json={"transactions": [{"transaction_id": "c"}]})
            return [answered.status_code, late.status_code, invalid.status_code]

    assert asyncio.run(go()) == [200, 504, 422]
    answered, late, invalid = scorer.finished_latencies
    assert answered is not None and answered > 0
    assert (late, invalid) == (None, None)


def test_a_request_refused_at_admission_is_shed_before_its_body_is_read() -> None:
    refusal = Decision(admitted=False, predicted_wait_s=0.4, limit_s=0.05, reason="over_target")
    scorer = ScriptedScorer(lambda: None, refusal=refusal)

    async def go() -> httpx.Response:
        async with client_for(scorer) as client:
            # Not even JSON: admission answers before the body is looked at.
            return await client.post("/score", content=b"{", headers={"content-type": "application/json"})

    answer = asyncio.run(go())
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == str(refusal.retry_after_s)
    assert answer.json() == {
        "error": "overloaded",
        "detail": {"reason": "over_target", "predicted_wait_ms": 400.0, "limit_ms": 50.0},
    }
    assert scorer.scored_with == []
    assert items(scorer.metrics)["shed"] == 1, "one item at least: the body is never read"


def test_metrics_are_rendered_off_the_event_loop() -> None:
    """A scrape reads every worker's files in multiprocess mode; in the event loop's thread every
    request in flight would wait it out."""
    rendered_in: list[threading.Thread] = []

    class Recording(ServingMetrics):
        def exposition(self) -> bytes:
            rendered_in.append(threading.current_thread())
            return super().exposition()

    class Scorer:
        metrics = Recording(settings=ServingSettings())

    async def scrape() -> tuple[httpx.Response, threading.Thread]:
        async with client_for(Scorer()) as client:
            return await client.get("/metrics"), threading.current_thread()

    response, loop_thread = asyncio.run(scrape())
    assert response.status_code == 200 and "tandem_serving_p99_target_seconds" in response.text
    assert rendered_in and rendered_in[0] is not loop_thread
