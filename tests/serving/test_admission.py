"""Admission, the cost model, the loop-lag monitor and the breaker: no server, no database."""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
from typing import Any

import polars as pl
import pytest
from starlette.datastructures import Headers

from serving.admission import (
    BatchCostModel,
    ConcurrencyLimit,
    Decision,
    LoopLag,
    StandingMinimum,
    TailShape,
    admit,
    predicted_wait,
)
from serving.breaker import BreakerState, CircuitBreaker
from serving.gate import _wait_before
from serving.scoring import GuardedHistory
from tests.serving.support import FakeClock

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
    history = GuardedHistory(_BrokenEngine(), breaker)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        history.history_for(pl.DataFrame(), 8)
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow(), "the probe is out"
    clock.now = 10.0
    assert breaker.allow(), "the next caller probes"
    assert not breaker.allow(), "one probe at a time still"


# ------------------------------------------------------------------ the wait before the service sees a request
def _admit(*, waited_s: float, remaining_deadline_s: float = 1.0) -> Decision:
    return decide(
        capacity=100, in_flight_remaining_s=0.005, remaining_deadline_s=remaining_deadline_s, waited_s=waited_s
    )


def test_time_waited_before_the_service_saw_the_request_counts_against_the_target() -> None:
    assert _admit(waited_s=0.0).admitted
    late = _admit(waited_s=0.048)
    assert not late.admitted and late.reason == "over_target"
    assert late.predicted_wait_s == pytest.approx(0.053)


def test_the_deadline_is_checked_against_the_wait_ahead_only() -> None:
    # The remaining deadline already counts from the earlier arrival: waited time is not charged twice.
    assert not _admit(waited_s=0.0, remaining_deadline_s=0.004).admitted
    assert _admit(waited_s=0.02, remaining_deadline_s=0.01).admitted


def test_a_lag_counts_only_once_it_has_stood_for_the_whole_window() -> None:
    lag = LoopLag(interval_s=0.005, window_s=0.25)
    moment = 100.0
    for _ in range(60):  # 300 ms on time, then a burst: two late ticks
        moment += 0.005
        lag.observe(0.0, moment)
    for late in (0.04, 0.03):
        moment += 0.005 + late
        lag.observe(late, moment)
    assert lag.lag_s == 0.0, "a burst the loop worked through is not overload"
    for _ in range(30):  # late on every tick for longer than the window
        moment += 0.025
        lag.observe(0.02, moment)
    assert lag.lag_s == pytest.approx(0.02)


def test_loop_lag_measures_a_blocked_event_loop() -> None:
    async def scenario() -> float:
        lag = LoopLag(interval_s=0.005, window_s=0.05)
        lag.start()
        await asyncio.sleep(0.06)
        for _ in range(12):  # the loop stays busy: each request waits ~10 ms before it is read
            time.sleep(0.01)
            await asyncio.sleep(0)
        measured = lag.lag_s
        await lag.stop()
        return measured

    assert asyncio.run(scenario()) >= 0.004


def stamp_header(seconds_ago: float) -> Headers:
    return Headers(raw=[(b"x-request-start", f"t={time.time() - seconds_ago:.6f}".encode())])


def test_a_proxy_request_start_stamp_moves_the_arrival_back() -> None:
    stamped = time.time() - 0.08
    for header in (f"t={stamped:.3f}", f"t={int(stamped * 1000)}", f"t={int(stamped * 1_000_000)}"):
        headers = Headers(raw=[(b"x-request-start", header.encode())])
        waited = time.monotonic() - _wait_before(headers, 0.0, StandingMinimum(0.25)).arrived
        assert 0.075 <= waited <= 0.2, header
    for bogus in ("t=later", f"t={time.time() + 30:.3f}", f"t={time.time() - 3600:.3f}", "t=nan"):
        headers = Headers(raw=[(b"x-request-start", bogus.encode())])
        wait = _wait_before(headers, 0.01, StandingMinimum(0.25))
        assert time.monotonic() - wait.arrived == pytest.approx(0.01, abs=0.005), bogus
        assert wait.counted_from == pytest.approx(wait.arrived), bogus


def test_a_stamped_wait_counts_against_the_target_only_once_it_has_stood() -> None:
    """The stamp moves the arrival back in full at once (deadline, the limit's latency), but
    counts against the target only once every stamp of a burst interval has shown it: a proxy
    that stamps every request must not make the service refuse part of a burst."""
    proxy_wait = StandingMinimum(0.05)
    for _ in range(12):  # a proxy stamping every request, each sent on at once
        calm = _wait_before(stamp_header(0.0), 0.0, proxy_wait)
        time.sleep(0.005)
    assert time.monotonic() - calm.counted_from < 0.01
    burst = _wait_before(stamp_header(0.08), 0.0, proxy_wait)  # a burst: 80 ms behind the proxy
    assert time.monotonic() - burst.arrived >= 0.08
    assert burst.counted_from - burst.arrived >= 0.07, "the calm stamps of the last interval say it does not stand"
    time.sleep(0.06)
    for _ in range(3):  # every stamp of a whole interval shows the wait: it stands
        standing = _wait_before(stamp_header(0.08), 0.0, proxy_wait)
    assert standing.counted_from == pytest.approx(standing.arrived, abs=0.002)


def test_the_standing_minimum_is_the_smallest_sample_of_the_window() -> None:
    window = 0.25
    standing = StandingMinimum(window)
    rng = random.Random(7)
    samples: list[tuple[float, float]] = []
    moment = 100.0
    for _ in range(2_000):
        moment += rng.choice((0.0, 0.001, 0.01, 0.3))  # equal times, dense, sparse and gaps past the window
        sample = rng.choice((0.0, rng.random() * 0.1))
        samples.append((moment, sample))
        got = standing.observe(sample, moment)
        in_window = [s for t, s in samples if t >= moment - window]
        expected = min(in_window) if moment - samples[0][0] >= window else 0.0
        assert got == expected
    assert standing.value(moment + window + 0.001) == 0.0  # nothing left in the window


# ------------------------------------------------------------------ the adaptive concurrency limit
def limit_with(clock: FakeClock, **changes: Any) -> ConcurrencyLimit:
    """50 ms target, 100 ms windows, 250 ms burst interval, 1024 at most, 4 at least; the aim 40 ms
    (0.8 x the target) and the tail's shape 1 until learnt, so where every answer of a window is
    alike (`run_window`) the estimated p99 is that latency: the cut's arithmetic stays in sight."""
    settings: dict[str, Any] = {"min_limit": 4, "headroom": 0.8, "initial_shape": 1.0}
    return ConcurrencyLimit(0.05, max_limit=1024, clock=clock, **(settings | changes))


def run_window(
    limit: ConcurrencyLimit, clock: FakeClock, *, in_flight: int, latency_s: float, window_s: float = 0.1
) -> int:
    """One window: `in_flight` requests try to get in, those let in are answered in `latency_s`.
    Returns how many were let in."""
    admitted = sum(limit.acquire() for _ in range(in_flight))
    clock.now += window_s / 2
    for _ in range(admitted):
        limit.release(latency_s)
    clock.now += window_s / 2
    limit.current()  # the window is over: its correction is made
    return admitted


def test_a_burst_shorter_than_the_interval_is_let_in_whole() -> None:
    clock = FakeClock()
    limit = limit_with(clock)
    for _ in range(2):  # 200 ms over the headroom (40 ms), within the target: less than the 250 ms interval
        assert run_window(limit, clock, in_flight=64, latency_s=0.045) == 64
    assert limit.limit == 1024
    run_window(limit, clock, in_flight=8, latency_s=0.01)
    assert limit.limit == 1024, "a window within the headroom forgets the burst"


def test_a_burst_that_arrives_at_once_is_let_in_whole_even_when_it_runs_past_the_target() -> None:
    clock = FakeClock()
    limit = limit_with(clock)
    assert run_window(limit, clock, in_flight=64, latency_s=0.1) == 64
    assert limit.limit == 32, "beyond the target: cut at once, from the peak, by at most half"


def test_an_overload_that_lets_up_for_a_window_is_cut_again_without_the_interval() -> None:
    clock = FakeClock()
    limit = limit_with(clock, window_s=0.125)  # windows a float adds up exactly

    def window(in_flight: int, latency_s: float) -> None:
        run_window(limit, clock, in_flight=in_flight, latency_s=latency_s, window_s=0.125)

    window(64, 0.1)
    cut = limit.limit
    window(8, 0.02)  # a lull: not binding, grows by a quarter
    assert limit.limit == pytest.approx(cut * 1.25)
    window(20, 0.045)  # over the headroom, within the target
    assert limit.limit == pytest.approx(20 * 0.04 / 0.045), "cut within a second of the last: no interval"
    for _ in range(16):  # two seconds within the target
        window(8, 0.02)
    before = limit.limit
    window(20, 0.045)
    assert limit.limit == before, "a second and more after the last cut, the interval is granted again"


def test_standing_overload_cuts_the_limit_from_what_was_in_flight_and_it_binds() -> None:
    clock = FakeClock()
    limit = limit_with(clock)
    for _ in range(4):
        run_window(limit, clock, in_flight=60, latency_s=0.2)
    assert limit.limit < 60, "cut from the 60 in flight, not from the idle ceiling of 1024"
    cut = limit.limit
    assert run_window(limit, clock, in_flight=60, latency_s=0.2) == int(cut), "the limit now refuses the rest"
    assert limit.limit == max(4, cut * 0.5), "a binding limit is cut at once, by at most half"
    for _ in range(10):
        run_window(limit, clock, in_flight=60, latency_s=0.2)
    assert limit.limit == 4, "never below the floor: some requests are always answered"


def test_the_cut_follows_how_far_latency_is_over_the_headroom() -> None:
    clock = FakeClock()
    limit = limit_with(clock, burst_interval_s=0.0)
    run_window(limit, clock, in_flight=20, latency_s=0.05)  # 50 ms against 0.8 x 50 = 40 ms allowed
    assert limit.limit == pytest.approx(20 * 0.04 / 0.05)


def test_full_refuses_as_acquire_does_but_takes_no_slot_when_there_is_room() -> None:
    clock = FakeClock()
    limit = limit_with(clock, burst_interval_s=0.0)
    run_window(limit, clock, in_flight=16, latency_s=1.0)
    assert limit.limit == 8
    assert not any(limit.full() for _ in range(20)), "room for 8: nothing refused"
    assert limit.in_flight == 0, "and no slot taken"
    assert sum(limit.acquire() for _ in range(8)) == 8
    assert limit.full() and not limit.acquire()
    clock.now += 0.05
    for _ in range(8):
        limit.release(0.02)
    clock.now += 0.05
    limit.current()
    assert limit.limit == 8 * (1 + 0.3 * 0.25), "a window refused by full() counts as binding, as acquire's refusals do"


def test_a_binding_limit_grows_toward_the_aim_a_share_of_the_way_per_window() -> None:
    clock = FakeClock()
    limit = limit_with(clock, burst_interval_s=0.0, window_s=0.125)  # windows a float adds up exactly

    def window(in_flight: int, latency_s: float) -> None:
        run_window(limit, clock, in_flight=in_flight, latency_s=latency_s, window_s=0.125)

    window(16, 1.0)
    assert limit.limit == 8
    window(16, 0.036)
    first = 8 * (1 + 0.3 * (0.04 / 0.036 - 1))
    assert limit.limit == pytest.approx(first), "30% of the way to the ratio"
    window(16, 0.02)
    assert limit.limit == pytest.approx(first * (1 + 0.3 * 0.25)), "toward 25% more at most"
    for _ in range(40):
        window(2, 0.02)
    assert limit.limit == 1024, "not binding: a past overload is forgotten"


TAIL = 3.0 / 1.1  # `tail_of`'s p99 over its mean


def tail_of(mean_s: float, count: int = 100) -> list[float]:
    """`count` answers averaging `mean_s`: one in 20 at 3x the common latency, so that any p99 of
    them (of 20 or more) is that 3x, `TAIL` times the mean."""
    common = mean_s / (0.95 + 0.05 * 3)
    return [3 * common if i % 20 == 0 else common for i in range(count)]


def test_the_tail_shape_is_the_p99_of_answers_over_their_own_windows_mean() -> None:
    shape = TailShape(windows=10, initial=2.0)
    shape.add([0.01] * 50, 0.01)
    assert shape.ratio == 2.0, "fewer than 100 answers: the initial shape"
    for level in (0.01, 0.03, 0.01, 0.05):  # the level moves; the shape does not
        samples = tail_of(level)
        shape.add(samples, sum(samples) / len(samples))
    assert shape.ratio > 2.0
    assert shape.ratio == pytest.approx(TAIL)


def test_the_limit_holds_the_estimated_p99_not_the_windows_mean() -> None:
    """Answers 20 ms on average with a tail at 2.7x: the mean is within the 40 ms aim, the tail
    is not, and the limit is cut by how far mean x shape is over."""
    clock = FakeClock()
    limit = limit_with(clock, burst_interval_s=0.0)
    assert run_window_with(limit, clock, tail_of(0.02)) == 100
    assert limit.shape.ratio == pytest.approx(TAIL)
    assert limit.limit == pytest.approx(100 * 0.04 / (0.02 * TAIL))


def run_window_with(limit: ConcurrencyLimit, clock: FakeClock, latencies_s: list[float]) -> int:
    """One window whose admitted requests are answered in `latencies_s` (one each)."""
    admitted = sum(limit.acquire() for _ in latencies_s)
    clock.now += 0.05
    for latency in latencies_s[:admitted]:
        limit.release(latency)
    clock.now += 0.05
    limit.current()
    return admitted


def test_a_service_slow_at_any_concurrency_keeps_the_limit_it_needs() -> None:
    """A database's round trips per batch (PostgreSQL here): 27 ms on average at any concurrency
    and p99 1.4x that, within the target. A fixed aim for the mean at half the target (25 ms) cut
    such a service to its floor; the estimated p99 (37 ms against 0.8 x 50) leaves it alone."""
    clock = FakeClock()
    limit = ConcurrencyLimit(0.05, max_limit=128, min_limit=16, clock=clock)
    common = 0.027 / (0.95 + 0.05 * 1.4)
    answers = [1.4 * common if i % 20 == 0 else common for i in range(80)]  # 800 rps: 80 a window
    for _ in range(30):
        assert run_window_with(limit, clock, answers) == 80
    assert limit.shape.ratio == pytest.approx(1.4 / 1.02)
    assert limit.limit == 128


def overloaded_window(limit: ConcurrencyLimit, clock: FakeClock) -> None:
    """One window of a fake service at 1,000 answers a second offered 200 a window: those let in
    answer in (what is in flight / the rate) on average, with `tail_of`'s tail."""
    admitted = sum(limit.acquire() for _ in range(200))
    clock.now += 0.05
    for latency in tail_of(admitted / 1000, admitted):
        limit.release(latency)
    clock.now += 0.05
    limit.current()


def test_in_a_standing_overload_the_limit_settles_where_the_estimated_p99_meets_the_aim() -> None:
    """A fake service at 1,000 answers a second, offered 200 a window: the requests a window lets
    in answer in (what is in flight / the rate) on average, with `tail_of`'s tail. Little's law
    puts the limit where mean x shape is 0.8 x the target: 40 ms / 2.7 x 1,000 a second."""
    clock = FakeClock()
    limit = ConcurrencyLimit(0.05, max_limit=128, min_limit=4, clock=clock)
    settled = []
    for window in range(60):
        overloaded_window(limit, clock)
        if window >= 40:
            settled.append(limit.limit)
    expected = 0.04 / TAIL * 1000
    assert 0.85 * expected <= min(settled) and max(settled) <= 1.15 * expected


def test_an_idle_second_after_an_overload_lets_the_next_burst_in_whole() -> None:
    """A limit cut during an overload (or a database outage) is not kept through an idle stretch:
    nothing in flight and no latency is no evidence of overload, and the next burst is served."""
    clock = FakeClock()
    limit = limit_with(clock, min_limit=16)  # the default floor
    for _ in range(10):
        run_window(limit, clock, in_flight=60, latency_s=0.5)
    assert limit.limit == 16
    clock.now += 0.05  # shorter than a window: nothing is known yet
    assert run_window(limit, clock, in_flight=50, latency_s=0.01) < 50
    clock.now += 1.0
    assert run_window(limit, clock, in_flight=50, latency_s=0.01) == 50
    assert limit.acquire() and limit.in_flight == 1


def test_a_quiet_second_after_the_last_answers_of_an_overload_lets_the_next_burst_in_whole() -> None:
    """Where nothing reads the limit while the service is idle (no proxy in front), the window
    holding an overload's last answers stays open until the next request: it is judged then, and
    the quiet second after it counts as idle. Judged alone, it cut the limit at the burst's first
    request and the burst was refused past the cut (tests/serving/test_live.py, on a slow day)."""
    clock = FakeClock()
    limit = limit_with(clock, min_limit=16)
    for _ in range(10):
        run_window(limit, clock, in_flight=60, latency_s=0.5)
    assert limit.limit == 16
    admitted = [limit.acquire() for _ in range(16)]
    clock.now += 0.05
    for _ in range(sum(admitted)):
        limit.release(0.5)  # the overload's last answers: their window is not closed by anything
    clock.now += 1.0
    assert sum(limit.acquire() for _ in range(64)) == 64


def test_answers_that_end_just_before_the_next_request_are_judged_without_an_idle_pass() -> None:
    """The quiet time counts from the window's end, not from its start: a window of slow answers
    closed by the next request at once is a cut, not a cut forgiven."""
    clock = FakeClock()
    limit = limit_with(clock)
    assert sum(limit.acquire() for _ in range(64)) == 64
    clock.now += 0.09
    for _ in range(64):
        limit.release(0.2)  # beyond the target: cut at once
    clock.now += 0.02  # the window ended 10 ms ago, less than a window of quiet
    limit.acquire()
    assert limit.limit == 32


def test_a_request_refused_for_its_body_gives_its_slot_back_without_a_sample() -> None:
    clock = FakeClock()
    limit = limit_with(clock, burst_interval_s=0.0)
    assert limit.acquire()
    limit.release(None)
    clock.now += 0.1
    assert limit.current() == 1024, "no latency seen: nothing to correct"
    assert limit.in_flight == 0


def settle_an_overload(limit: ConcurrencyLimit, clock: FakeClock) -> float:
    """Six seconds of the standing overload above (1,000 answers a second, 200 offered a window),
    then a quiet two seconds; returns where the limit settled."""
    for _ in range(60):
        overloaded_window(limit, clock)
    assert limit.settled is not None
    clock.now += 2.0
    assert limit.current() == limit.max_limit, "idle: back at the ceiling"
    return limit.settled


def test_the_step_into_an_overload_drops_the_limit_to_where_the_last_one_settled() -> None:
    """An overload keeps arriving: past the concurrency the last one settled at it spends the
    burst allowance, and the limit drops there at once, in place of admitting up to the ceiling
    for a window and a burst interval before the first cut."""
    clock = FakeClock()
    limit = ConcurrencyLimit(0.05, max_limit=128, min_limit=4, burst=32, clock=clock)
    settled = settle_an_overload(limit, clock)
    peak = 0
    for _ in range(60):  # 1 ms apart, three arrive for every two answered: in flight keeps growing
        for _ in range(3):
            limit.acquire()
        peak = max(peak, limit.in_flight)
        clock.now += 0.001
        for _ in range(min(2, limit.in_flight)):
            limit.release(0.03)
    assert limit.limit == settled
    # About a third of the allowance's admissions stay in flight (the rest replace answers); with
    # only the ceiling, all 60 ms of growth would have been let in.
    assert peak <= settled + 16
    assert limit.in_flight <= settled


def test_a_burst_of_64_after_an_overload_has_settled_is_let_in_whole_and_refills_below_it() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(0.05, max_limit=128, min_limit=4, clock=clock)
    settled = settle_an_overload(limit, clock)
    background = sum(limit.acquire() for _ in range(5))
    assert sum(limit.acquire() for _ in range(64)) == 64
    assert limit.limit == 128
    spent = limit.burst - limit.burst_left
    assert spent == 64 + background - math.ceil(settled)
    for _ in range(64 + background):
        limit.release(0.02)
    clock.now += 0.3  # below the settled concurrency: 30% of the allowance back
    assert not limit.full()
    assert limit.burst_left == pytest.approx(min(limit.burst, limit.burst - spent + 0.3 * limit.burst))
    clock.now += 1.0
    assert sum(limit.acquire() for _ in range(64)) == 64, "a second burst a second later is whole again"


def test_a_healthy_load_above_where_an_old_overload_settled_grows_the_limit_to_what_it_asks() -> None:
    """After an overload settled at about 15 in flight, the service answers every request in 10 ms
    (a fifth of the target) at any concurrency, and 30 in flight are asked for: the limit grows to
    the ceiling within seconds, where it stayed at the old concurrency refusing 40% for good."""
    clock = FakeClock()
    limit = ConcurrencyLimit(0.05, max_limit=128, min_limit=4, clock=clock)
    assert settle_an_overload(limit, clock) < 20
    answering: collections.deque[tuple[int, int]] = collections.deque()  # (due ms, how many)
    refused_by_second = []
    for second in range(5):
        refused = 0
        for ms in range(second * 1000, (second + 1) * 1000):
            clock.now += 0.001
            while answering and answering[0][0] <= ms:
                for _ in range(answering.popleft()[1]):
                    limit.release(0.010)
            admitted = sum(limit.acquire() for _ in range(3))
            refused += 3 - admitted
            answering.append((ms + 10, admitted))
        refused_by_second.append(refused)
    assert refused_by_second[-1] == 0, refused_by_second
    assert limit.limit == limit.max_limit


def test_before_a_first_overload_has_settled_only_the_ceiling_stands() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(0.05, max_limit=128, min_limit=4, clock=clock)
    assert limit.settled is None
    assert sum(limit.acquire() for _ in range(200)) == 128
