"""Issue 46's online targets, judged from fake results: each verdict reads met, missed or not
measurable from the numbers alone, on the levels the do-nothing ceiling vouches for."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from bench.online import round_order
from bench.online_targets import (
    MET,
    MISSED,
    NOT_MEASURABLE,
    judge,
    mark_online,
    missed_in_a_row,
)

TARGET = 50.0
RATES = [100, 400, 800, 1200]
SIZE_OK = {"serving/service.py": 300, "serving/gate.py": 250}


def level(rate: float, p99: float = 20.0, *, goodput: float | None = None, cpu: float = 0.4) -> dict[str, Any]:
    return {
        "offered_rps": rate,
        "p99_ms": p99,
        "goodput_rps": rate if goodput is None else goodput,
        "ok": int(rate * 6),
        "cpu_ms_per_request": cpu,
        "cpu_ms_per_served": cpu,
    }


def sweep(capacity: float, *, cpu_at_capacity: float = 0.4, cpu_at_100: float = 1.5) -> dict[str, Any]:
    """A round whose levels meet the target up to `capacity` and miss above it."""
    levels = []
    for rate in RATES:
        cpu = cpu_at_100 if rate == 100 else cpu_at_capacity if rate == capacity else 0.6
        levels.append(level(rate, 20.0 if rate <= capacity else 80.0, goodput=min(rate, capacity), cpu=cpu))
    return {"sweep": levels}


def ceiling(p99: float = 1.0, rates: list[float] | None = None) -> dict[str, Any]:
    return {"sweep": [level(rate, p99) for rate in rates or RATES]}


def overload(
    rate: float, *, goodput: float = 900.0, p99: float = 60.0, statuses: dict[str, int] | None = None, **more: Any
) -> dict[str, Any]:
    return {
        "offered_rps": rate,
        "goodput_rps": goodput,
        "p99_ms": p99,
        "statuses": statuses or {"200": 5_000, "503": 2_000},
        "shed": 2_000,
        "shed_without_retry_after": 0,
        "client_timeouts": 0,
        "connection_errors": 0,
        "rss_mb_before": 600.0,
        "rss_mb_after": 610.0,
    } | more


def past(by_factor: dict[str, dict[str, Any]] | None = None, capacity: float = 1000.0) -> dict[str, Any]:
    """Past-capacity results within every bound, but for the levels in `by_factor`."""
    runs = {"2x": overload(2 * capacity), "4x": overload(4 * capacity)} | (by_factor or {})
    burst = {
        "background_rps": 300,
        "background": level(300),
        "burst": {"shed": 0, "ok": 64, "p99_ms": 70.0},
        "ceiling_burst_p99_ms": 8.0,
    }
    return {"capacity_rps": capacity, "overload": runs, "burst_64": burst}


def online(
    tandem: list[dict[str, Any]],
    baseline: list[dict[str, Any]] | None,
    *,
    ceilings: list[dict[str, Any]] | None = None,
    past_capacity: dict[str, Any] | None = None,
    again: list[float] | None = None,
) -> dict[str, Any]:
    """One run's results, marked; the PostgreSQL pair the same as SQLite's, the baseline None when
    it could not be checked out. Every round is a copy of its own, as a run's results are."""

    def own(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [copy.deepcopy(run) for run in runs]

    rounds = len(tandem)
    result: dict[str, Any] = {
        "do_nothing": {
            "label": "ceiling",
            "rounds": own(ceilings or [ceiling()] * rounds),
            "again": ceiling(1.0, again or [300, 2000, 4000]),
        }
    }
    for suffix in ("", "_postgres"):
        result[f"tandem{suffix}"] = {
            "label": "Tandem",
            "rounds": own(tandem),
            "past_capacity": copy.deepcopy(past_capacity or past()),
        }
        result[f"baseline{suffix}"] = (
            {"label": "972a628", "error": "972a628 could not be checked out"}
            if baseline is None
            else {"label": "972a628", "rounds": own(baseline)}
        )
    mark_online(result)
    return result


def verdict(run: dict[str, Any], name: str, store: str = "embedded SQLite") -> dict[str, Any]:
    judged = judge(run, TARGET, SIZE_OK)["targets"]
    return next(t for t in judged if t["target"] == (name if name.startswith("size") else f"{name}, {store}"))


CAPACITY = "capacity at p99 <= 50 ms"


# ---------------------------------------------------------------- capacity
def test_capacity_at_least_the_baselines_is_met() -> None:
    run = online([sweep(1200), sweep(800), sweep(1200)], [sweep(800), sweep(800), sweep(800)])
    t = verdict(run, CAPACITY)
    assert t["verdict"] == MET
    assert t["numbers"]["tandem_rps"] == [1200, 800, 1200]
    assert "Tandem 1,200 rps" in t["measured"] and "972a628 800 rps" in t["measured"]


def test_capacity_short_of_the_baseline_within_the_rounds_spread_is_met_beyond_it_missed() -> None:
    # Tandem's median 800 against 1,200, but the baseline's own rounds spread from 800 to 1,200.
    within = online([sweep(800)] * 3, [sweep(800), sweep(1200), sweep(1200)])
    assert verdict(within, CAPACITY)["verdict"] == MET
    # Both services steady: 400 short is beyond a spread of 0.
    beyond = online([sweep(800)] * 3, [sweep(1200)] * 3)
    assert verdict(beyond, CAPACITY)["verdict"] == MISSED
    assert verdict(beyond, CAPACITY)["numbers"]["spread_rps"] == pytest.approx(24)  # 2% of 1,200


def test_passing_the_same_level_with_a_few_answers_over_the_target_is_the_same_capacity() -> None:
    one_round = {"sweep": [level(100, goodput=99.5), level(400, 80.0, goodput=300.0)]}
    baseline = {"sweep": [level(100, goodput=100.0), level(400, 80.0, goodput=310.0)]}
    run = online([one_round], [baseline])
    assert verdict(run, CAPACITY)["verdict"] == MET


def test_a_level_the_ceiling_does_not_vouch_for_counts_for_no_capacity() -> None:
    # The ceiling's p99 at 1,200 rps is over the limit in every round: Tandem's best level there is
    # the generator's as much as the service's, so its capacity reads 800.
    limited = {"sweep": [level(r, 1.0 if r < 1200 else 9.0) for r in RATES]}
    run = online([sweep(1200)] * 3, [sweep(800)] * 3, ceilings=[limited] * 3)
    assert verdict(run, CAPACITY)["numbers"]["tandem_rps"] == [800, 800, 800]


def test_each_round_is_checked_against_its_own_ceiling() -> None:
    # The generator was limited at 1,200 rps in the second round only: that round reads 800.
    limited = {"sweep": [level(r, 1.0 if r < 1200 else 9.0) for r in RATES]}
    run = online([sweep(1200)] * 3, [sweep(800)] * 3, ceilings=[ceiling(), limited, ceiling()])
    assert verdict(run, CAPACITY)["numbers"]["tandem_rps"] == [1200, 800, 1200]


def test_without_the_baseline_the_comparisons_are_not_measurable() -> None:
    run = online([sweep(1200)] * 3, None)
    t = verdict(run, CAPACITY)
    assert t["verdict"] == NOT_MEASURABLE
    assert "could not be checked out" in t["measured"]
    assert verdict(run, "CPU per served request at capacity against 972a628")["verdict"] == NOT_MEASURABLE
    # The absolute bounds do not need the baseline.
    assert verdict(run, "CPU per served request at capacity")["verdict"] == MET
    assert verdict(run, "CPU per served request at 100 rps")["verdict"] == MET


def test_without_a_ceiling_nothing_is_usable_and_nothing_is_judged() -> None:
    run = online([sweep(1200)] * 3, [sweep(800)] * 3, ceilings=[{"error": "did not start"}] * 3)
    assert verdict(run, CAPACITY)["verdict"] == NOT_MEASURABLE
    assert verdict(run, "CPU per served request at 100 rps")["verdict"] == NOT_MEASURABLE


# ---------------------------------------------------------------- CPU per served request
def test_cpu_at_capacity_is_read_at_each_rounds_capacity_level() -> None:
    run = online(
        [sweep(1200, cpu_at_capacity=0.4), sweep(800, cpu_at_capacity=0.45), sweep(1200, cpu_at_capacity=0.3)],
        [sweep(800, cpu_at_capacity=1.0)] * 3,
    )
    absolute = verdict(run, "CPU per served request at capacity")
    assert absolute["numbers"]["tandem_ms"] == [0.4, 0.45, 0.3]
    assert absolute["verdict"] == MET
    relative = verdict(run, "CPU per served request at capacity against 972a628")
    assert relative["numbers"]["ratio"] == pytest.approx(0.4)
    assert relative["verdict"] == MET


def test_cpu_at_capacity_over_the_bound_or_over_half_the_baselines_is_missed() -> None:
    over = online([sweep(1200, cpu_at_capacity=0.7)] * 3, [sweep(800, cpu_at_capacity=2.0)] * 3)
    assert verdict(over, "CPU per served request at capacity")["verdict"] == MISSED
    assert verdict(over, "CPU per served request at capacity against 972a628")["verdict"] == MET  # 35%
    not_half = online([sweep(1200, cpu_at_capacity=0.45)] * 3, [sweep(800, cpu_at_capacity=0.6)] * 3)
    assert verdict(not_half, "CPU per served request at capacity")["verdict"] == MET
    assert verdict(not_half, "CPU per served request at capacity against 972a628")["verdict"] == MISSED


def test_cpu_at_100_rps_is_the_median_over_the_rounds() -> None:
    run = online([sweep(1200, cpu_at_100=v) for v in (1.5, 2.5, 1.9)], [sweep(800, cpu_at_100=8.0)] * 3)
    t = verdict(run, "CPU per served request at 100 rps")
    assert t["numbers"]["tandem_ms"] == [1.5, 2.5, 1.9]
    assert t["verdict"] == MET  # median 1.9
    assert "972a628 8.00 ms" in t["measured"]
    slow = online([sweep(1200, cpu_at_100=v) for v in (1.5, 2.5, 2.1)], [sweep(800)] * 3)
    assert verdict(slow, "CPU per served request at 100 rps")["verdict"] == MISSED


def test_each_store_is_judged_on_its_own_services() -> None:
    run = online([sweep(1200)] * 3, [sweep(800)] * 3)
    run["tandem_postgres"]["rounds"] = [sweep(400) for _ in range(3)]
    mark_online(run)
    assert verdict(run, CAPACITY)["verdict"] == MET
    assert verdict(run, CAPACITY, "PostgreSQL")["verdict"] == MISSED


# ---------------------------------------------------------------- past capacity
PAST = "past capacity: "


def test_past_capacity_within_every_bound_is_met() -> None:
    run = online([sweep(1000)] * 3, [sweep(800)] * 3)
    for name in ("goodput", "accepted p99", "refusals", "timeouts, connection errors, memory"):
        assert verdict(run, PAST + name)["verdict"] == MET, name


def test_goodput_under_80_percent_of_capacity_at_any_factor_misses() -> None:
    run = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=past({"4x": overload(4000, goodput=790.0)}))
    t = verdict(run, PAST + "goodput")
    assert t["verdict"] == MISSED
    assert t["numbers"]["by_factor"] == {"2x": MET, "4x": MISSED}


def test_accepted_p99_over_100_ms_or_nothing_accepted_misses() -> None:
    slow = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=past({"2x": overload(2000, p99=101.0)}))
    assert verdict(slow, PAST + "accepted p99")["verdict"] == MISSED
    none = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=past({"2x": overload(2000, p99=math.nan)}))
    assert verdict(none, PAST + "accepted p99")["verdict"] == MISSED


def test_a_refusal_other_than_503_or_429_or_without_retry_after_misses() -> None:
    other = overload(2000, statuses={"200": 5_000, "503": 1_000, "504": 3})
    run = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=past({"2x": other}))
    t = verdict(run, PAST + "refusals")
    assert t["verdict"] == MISSED and "504" in t["measured"]
    bare = overload(4000, statuses={"200": 5_000, "429": 1_000}, shed_without_retry_after=1)
    run = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=past({"4x": bare}))
    assert verdict(run, PAST + "refusals")["verdict"] == MISSED


@pytest.mark.parametrize(
    "fault", [{"client_timeouts": 1}, {"connection_errors": 2}, {"rss_mb_before": 600.0, "rss_mb_after": 700.0}]
)
def test_a_timeout_a_connection_error_or_growing_memory_misses(fault: dict[str, Any]) -> None:
    run = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=past({"2x": overload(2000, **fault)}))
    assert verdict(run, PAST + "timeouts, connection errors, memory")["verdict"] == MISSED


def test_a_factor_the_ceiling_does_not_vouch_for_is_left_out() -> None:
    # The ceiling's run over the past-capacity rates did not reach 4,000 rps: 4x is not judged.
    run = online(
        [sweep(1000)] * 3,
        [sweep(800)] * 3,
        past_capacity=past({"4x": overload(4000, goodput=10.0)}),
        again=[300, 2000],
    )
    t = verdict(run, PAST + "goodput")
    assert t["numbers"]["by_factor"] == {"2x": MET, "4x": NOT_MEASURABLE}
    assert t["verdict"] == MET
    assert "generator-limited" in t["measured"]


def test_past_capacity_that_did_not_run_is_not_measurable() -> None:
    run = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity={"error": "did not start"})
    assert verdict(run, PAST + "goodput")["verdict"] == NOT_MEASURABLE
    assert verdict(run, "a burst of 64 at 30% load")["verdict"] == NOT_MEASURABLE


# ---------------------------------------------------------------- burst
def test_burst_without_shedding_within_100_ms_is_met_otherwise_missed() -> None:
    run = online([sweep(1000)] * 3, [sweep(800)] * 3)
    assert verdict(run, "a burst of 64 at 30% load")["verdict"] == MET
    shedding = past()
    shedding["burst_64"]["burst"] = {"shed": 2, "ok": 62, "p99_ms": 40.0}
    run = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=shedding)
    assert verdict(run, "a burst of 64 at 30% load")["verdict"] == MISSED


def test_a_burst_the_generator_alone_cannot_answer_in_time_is_not_measurable() -> None:
    slow_ceiling = past()
    slow_ceiling["burst_64"]["ceiling_burst_p99_ms"] = 150.0
    run = online([sweep(1000)] * 3, [sweep(800)] * 3, past_capacity=slow_ceiling)
    assert verdict(run, "a burst of 64 at 30% load")["verdict"] == NOT_MEASURABLE


# ---------------------------------------------------------------- size
def test_size_counts_the_whole_package_and_its_longest_module() -> None:
    run = online([sweep(1000)] * 3, [sweep(800)] * 3)
    judged = judge(run, TARGET, {"serving/a.py": 3_100, "serving/b.py": 401})["targets"]
    by_name = {t["target"]: t for t in judged}
    assert by_name["size: serving/"]["verdict"] == MISSED
    assert by_name["size: serving/"]["numbers"]["lines"] == 3_501
    assert by_name["size: the longest module of serving/"]["verdict"] == MISSED
    assert "serving/b.py 401" in by_name["size: the longest module of serving/"]["measured"]
    assert verdict(run, "size: serving/")["verdict"] == MET
    assert verdict(run, "size: the longest module of serving/")["verdict"] == MET


def test_every_verdict_carries_a_threshold_and_a_measured_figure() -> None:
    judged = judge(online([sweep(1200)] * 3, [sweep(800)] * 3), TARGET, SIZE_OK)
    assert {t["verdict"] for t in judged["targets"]} <= {MET, MISSED, NOT_MEASURABLE}
    assert all(t["threshold"] and t["measured"] for t in judged["targets"])
    assert judged["goodput_at_target_rps"]["tandem"] == 1200  # what bench/shadow.py reads


def test_the_baseline_commit_given_names_every_comparison_and_the_default_stays() -> None:
    run = online([sweep(1200)] * 3, [sweep(800)] * 3)
    other = judge(run, TARGET, SIZE_OK, "abc1234")
    assert other["baseline_commit"] == "abc1234"
    compared = [t for t in other["targets"] if "abc1234" in t["threshold"] + t["measured"] + t["target"]]
    assert len(compared) == 6  # capacity, CPU against it, CPU at light load: each on both stores
    assert not any("972a628" in str(t) for t in other["targets"])
    assert judge(run, TARGET, SIZE_OK)["baseline_commit"] == "972a628"


# ---------------------------------------------------------------- the run's shape
def test_a_sweep_stops_after_two_misses_in_a_row() -> None:
    assert not missed_in_a_row([level(100), level(200, 80.0)], TARGET, 2)
    assert not missed_in_a_row([level(100, 80.0), level(200), level(300, 80.0)], TARGET, 2)
    assert missed_in_a_row([level(100), level(200, 80.0), level(300, math.nan)], TARGET, 2)
    assert not missed_in_a_row([level(100, 80.0)], TARGET, 2)


def test_tandem_and_the_baseline_trade_places_every_other_round() -> None:
    first, second = round_order(0), round_order(1)
    assert first[0] == second[0] == "do_nothing"  # the ceiling first: the round's levels are checked against it
    assert first.index("tandem") < first.index("baseline")
    assert second.index("baseline") < second.index("tandem")
    assert second.index("baseline_postgres") < second.index("tandem_postgres")
    assert round_order(2) == first
