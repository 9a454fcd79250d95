"""The batch path's share of the raw forward rate is judged against the faster of the two raw
readings, so a forward pass measured while the machine ran slow cannot flatter it."""

from __future__ import annotations

from typing import Any

from bench.report import batch_targets, best_raw_forward


def reading(two_threads: float, one_thread: float) -> dict[str, Any]:
    return {
        "threads": 2,
        "items_per_second": {"128": two_threads, "1024": two_threads * 0.9},
        "items_per_second_1_thread": {"128": one_thread},
    }


def batch(rows_per_second: float) -> dict[str, Any]:
    run = {"rows_per_second": rows_per_second, "cpu_ms_per_record": 0.08, "peak_rss_mb": 500.0}
    return {"partitions": {"100000": run, "1000000": run}}


def test_the_faster_reading_sets_the_best_rate_whichever_came_first() -> None:
    slow_first = {**reading(18_000, 13_000), "after_batch": reading(25_000, 14_000)}
    assert best_raw_forward(slow_first) == (25_000, "batch 128, 2 threads, after the batch path")
    slow_after = {**reading(25_000, 14_000), "after_batch": reading(18_000, 13_000)}
    assert best_raw_forward(slow_after) == (25_000, "batch 128, 2 threads")
    assert best_raw_forward(reading(18_000, 19_000)) == (19_000, "batch 128, 1 thread")


def test_a_slow_first_reading_does_not_turn_a_miss_into_a_met() -> None:
    share = batch_targets({**reading(18_000, 13_000), "after_batch": reading(25_000, 14_000)}, batch(15_000))[0]
    assert share[2] is False
    assert "60%" in share[1]
    assert batch_targets(reading(18_000, 13_000), batch(15_000))[0][2] is True
