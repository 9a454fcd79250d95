"""Admission, the cost model, reservations and the breaker: no server, no database."""

from __future__ import annotations

import threading
from typing import Any

import polars as pl
import pytest

from serving.admission import AimdLimit, BatchCostModel, Decision, admit, predicted_wait
from serving.batcher import AdaptiveBatcher, Reservation
from serving.breaker import BreakerState, CircuitBreaker
from serving.metrics import ServingMetrics
from serving.refusals import Refused
from serving.scoring import GuardedHistory
from tests.reference import REFERENCE, ItemResult
from tests.serving.support import FakeClock
from tests.shared import until

# Roughly what warm-up measures here: 12 ms fixed per batch, 0.3 ms per item.
CALIBRATION = [(1, 0.0123), (64, 0.0312)] * 3


def calibrated() -> BatchCostModel:
    cost = BatchCostModel(decay=0.9)
    cost.calibrate(CALIBRATION)
    return cost


def decide(cost: BatchCostModel | None = None, **changes: Any) -> Decision:
    """`admit` for one item, nothing queued or in flight, against a 1024-deep queue, batches of 64,
    a 50 ms target and 2 s left of the deadline; `changes` on top (the cost model: `calibrated()`)."""
    arguments: dict[str, Any] = {
        "items": 1,
        "queued": 0,
        "capacity": 1024,
        "in_flight_remaining_s": 0.0,
        "max_batch": 64,
        "target_s": 0.05,
        "remaining_deadline_s": 2.0,
    }
    return admit(cost=calibrated() if cost is None else cost, **(arguments | changes))


def test_cost_model_recovers_fixed_and_per_item_cost() -> None:
    cost = calibrated()
    assert cost.fixed_s == pytest.approx(0.012, abs=1e-4)
    assert cost.per_item_s == pytest.approx(0.0003, abs=1e-5)


def test_a_long_run_of_single_item_batches_keeps_the_slope() -> None:
    cost = calibrated()
    for _ in range(500):
        cost.observe(1, 0.0123)
    # Without the calibration prior the slope would be unidentifiable and a burst would be mispriced.
    assert cost.per_item_s == pytest.approx(0.0003, rel=0.05)
    assert cost.batch_seconds(64) == pytest.approx(0.0312, rel=0.05)


def test_cost_model_follows_a_slower_machine() -> None:
    cost = calibrated()
    for _ in range(100):
        cost.observe(1, 0.0246)
        cost.observe(64, 0.0624)
    assert cost.batch_seconds(64) == pytest.approx(0.0624, rel=0.1)


def test_a_burst_of_64_below_capacity_is_admitted_item_by_item() -> None:
    cost = calibrated()
    # 64 requests arrive while one batch of one runs: each sees the ones before it queued.
    decisions = [decide(cost, queued=queued, in_flight_remaining_s=cost.batch_seconds(1)) for queued in range(64)]
    assert all(d.admitted for d in decisions)


def test_overload_is_shed_on_the_predicted_wait() -> None:
    cost = calibrated()
    decision = decide(cost, queued=200, in_flight_remaining_s=0.02)
    assert not decision.admitted
    assert decision.reason == "over_target"
    assert decision.predicted_wait_s == pytest.approx(predicted_wait(200, 0.02, 64, cost))
    assert decision.retry_after_s == 1


def test_a_tight_deadline_is_refused_before_the_target_is() -> None:
    cost = calibrated()
    decision = decide(cost, queued=64, in_flight_remaining_s=0.01, remaining_deadline_s=0.02)
    assert (decision.admitted, decision.reason) == (False, "over_deadline")


def test_a_deadline_shorter_than_the_newcomers_own_batch_is_refused_on_an_idle_service() -> None:
    """Nothing queued or in flight: the wait is 0, but the answer takes a batch (12.3 ms here). A
    10 ms deadline was admitted and answered 504 after the work was done."""
    cost = calibrated()
    assert (decide(cost, remaining_deadline_s=0.010).reason, decide(cost, remaining_deadline_s=0.015).admitted) == (
        "over_deadline",
        True,
    )
    # Its batch is the partial one it joins: 63 queued ahead fill it, the 64th starts the next one.
    assert decide(cost, queued=63, remaining_deadline_s=0.025).reason == "over_deadline"
    assert decide(cost, queued=64, in_flight_remaining_s=0.0, remaining_deadline_s=0.05).admitted


def test_the_queue_bound_holds_whatever_the_estimate() -> None:
    cost = BatchCostModel(decay=0.9)  # uncalibrated: predicts zero wait
    decision = decide(cost, items=10, queued=1020)
    assert (decision.admitted, decision.reason) == (False, "queue_full")


def test_breaker_opens_skips_then_probes_once() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, reset_s=5.0, clock=clock)
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow()
    clock.now = 5.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()
    assert not breaker.allow(), "only one probe while half-open"
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 10.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow()


class _BrokenEngine:
    """A store whose every use fails with an error that is no database's (a bug, a local fault)."""

    def connect(self) -> Any:
        raise RuntimeError("not a database error")


def test_a_probe_that_fails_for_no_database_reason_is_given_up_after_reset_s() -> None:
    """Half-open, the history read that took the probe raised something other than a database
    error and recorded neither outcome: once it has gone unanswered for reset_s, the next caller
    probes, where the probe was kept and every later batch was scored without history for good."""
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_s=5.0, clock=clock)
    breaker.record_failure()
    clock.now = 5.0
    history = GuardedHistory(REFERENCE, _BrokenEngine(), breaker)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        history.history_for(pl.DataFrame(), 8)
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow(), "the probe is out"
    clock.now = 10.0
    assert breaker.allow(), "the next caller probes"
    assert not breaker.allow(), "one probe at a time still"


def test_a_trip_opens_a_closed_breaker_at_once_and_its_probe_closes_it() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, reset_s=5.0, clock=clock)
    breaker.trip()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 5.0
    assert breaker.allow(), "the probe, as after any opening"
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


class _Probe:
    """A probe the test answers: it blocks until told how the database did."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.succeeds = True

    def __call__(self) -> None:
        self.calls += 1
        self.release.wait(10)
        if not self.succeeds:
            raise ConnectionError("the database is still silent")


def test_with_a_probe_function_no_caller_waits_on_the_half_open_probe() -> None:
    """A silent database's connect timeout (2 s) is waited out by the probe's own thread, not by
    the batch that happened to call first: callers skip the database until the probe answers."""
    clock = FakeClock()
    probe = _Probe()
    breaker = CircuitBreaker(failure_threshold=1, reset_s=5.0, clock=clock, probe=probe)
    breaker.record_failure()
    clock.now = 5.0
    assert not breaker.allow(), "half-open: the probe runs on its own thread"
    until(lambda: probe.calls == 1)
    assert not breaker.allow() and not breaker.allow()
    clock.now = 20.0  # however long the probe takes, one at a time
    assert not breaker.allow()
    assert probe.calls == 1
    probe.succeeds = False
    probe.release.set()
    until(lambda: breaker.state is BreakerState.OPEN)
    clock.now = 25.0
    probe.succeeds = True
    assert not breaker.allow()
    until(lambda: breaker.state is BreakerState.CLOSED)
    assert probe.calls == 2
    assert breaker.allow()


# ------------------------------------------------------------------ admission before the body is read
def batcher_with(cost: BatchCostModel, clock: FakeClock) -> AdaptiveBatcher:
    async def never(_: Any) -> Any:
        raise AssertionError("nothing is scored here")

    return AdaptiveBatcher(
        never,  # type: ignore[arg-type]
        executor=None,  # type: ignore[arg-type]
        max_batch=64,
        capacity=1024,
        target_s=0.05,
        cost=cost,
        metrics=ServingMetrics(code_version="test"),
        model_version="v1",
        results=ItemResult,
        clock=clock,
    )


def test_requests_admitted_before_their_bodies_are_read_count_as_queued() -> None:
    clock = FakeClock()
    batcher = batcher_with(calibrated(), clock)
    deadline = clock() + 2.0
    admitted = [batcher.reserve(deadline) for _ in range(400)]
    reservations = [r for r in admitted if isinstance(r, Reservation)]
    refused = [r for r in admitted if isinstance(r, Decision)]
    # A burst read in one turn of the loop: each later request sees the earlier ones ahead of it.
    assert reservations and refused, "a burst larger than the target allows is cut, not let in whole"
    assert all(r.reason == "over_target" for r in refused)
    assert batcher.decide(1, deadline).predicted_wait_s == pytest.approx(
        predicted_wait(len(reservations), 0.0, 64, batcher.cost)
    )
    for reservation in reservations:
        reservation.release()
        reservation.release()  # released once, however often it is given back
    assert batcher.decide(1, deadline).predicted_wait_s == 0.0
    assert isinstance(batcher.reserve(deadline), Reservation)


def test_a_burst_of_64_is_admitted_whole_before_any_body_is_read() -> None:
    clock = FakeClock()
    batcher = batcher_with(calibrated(), clock)
    assert all(isinstance(batcher.reserve(clock() + 2.0), Reservation) for _ in range(64))


def test_aimd_cuts_on_answers_over_the_target_at_most_once_per_target() -> None:
    clock = FakeClock()
    limit = AimdLimit(0.05, max_limit=100, clock=clock)
    for _ in range(5):
        assert limit.acquire()
    for _ in range(5):
        limit.release(0.2)  # five slow answers in one instant: one cut, not five
    assert limit.limit == pytest.approx(90.0)
    clock.now += 0.05
    assert limit.acquire()
    limit.release(0.2)
    assert limit.limit == pytest.approx(81.0)


def test_aimd_never_goes_below_its_floor_and_refuses_when_full() -> None:
    clock = FakeClock()
    limit = AimdLimit(0.05, max_limit=100, clock=clock)
    for _ in range(200):
        clock.now += 0.05
        assert limit.acquire()
        limit.release(1.0)
    assert limit.limit == AimdLimit.MIN_LIMIT
    assert all(limit.acquire() for _ in range(AimdLimit.MIN_LIMIT))
    assert not limit.acquire(), "full at the limit"
    limit.release(None)  # refused for its body: a slot back, nothing learnt
    assert limit.limit == AimdLimit.MIN_LIMIT and limit.acquire()


def test_aimd_grows_while_used_during_an_overload_and_back_to_its_ceiling_once_it_is_over() -> None:
    """Grown only while used, a limit cut to its floor by an overload stayed there at normal load
    (1-2 in flight): every later burst of more than 8 was refused, though answers met the target."""
    clock = FakeClock()
    limit = AimdLimit(0.05, max_limit=16, clock=clock)
    assert limit.acquire()
    limit.release(1.0)  # an answer over the target: an overload
    limit.limit = 10.0
    assert limit.acquire()
    limit.release(0.01)  # one in flight of ten, during the overload: not used, no growth
    assert limit.limit == 10.0
    for _ in range(6):
        assert limit.acquire()
    for _ in range(6):
        limit.release(0.01)
    assert 10.0 < limit.limit <= 10.5, "used: one per limit's worth of answers"
    clock.now += AimdLimit.CALM_S
    for _ in range(6):
        assert limit.acquire()
        limit.release(0.01)  # one at a time, within the target, the overload over
    assert limit.limit == 16.0, "back at its ceiling, never past it"
    assert all(limit.acquire() for _ in range(16)) and not limit.acquire()


def test_a_refusal_for_a_deadline_already_past_says_no_time_is_left_not_a_negative_one() -> None:
    """A header deadline of 0.0001 ms read "limit_ms": -0.0; one of 1e-320, -0.1."""
    for limit_s in (-0.0001, -1e-7, -0.0):
        refused = Refused.overloaded(Decision(False, 0.01, limit_s, "over_deadline"), items=1)
        assert isinstance(refused.detail, dict) and str(refused.detail["limit_ms"]) == "0.0", limit_s
