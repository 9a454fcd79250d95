"""The batch half of the baseline comparison: Tandem's CPU per record on a partition against the
baseline commit's on the same partition, judged on each side's median; a baseline that cannot
score is a reason and a "not measurable" verdict, never a crash."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from bench.batch_baseline import MET, MISSED, NOT_MEASURABLE, judge, run_worker, section, side_by_side, worker_command
from bench.report import batch_section


def run(cpu: float) -> dict[str, Any]:
    return {"rows_per_second": 10_000.0, "cpu_ms_per_record": cpu, "peak_rss_mb": 500.0}


def comparison(mine: list[float], theirs: list[float], **extra: Any) -> dict[str, Any]:
    return {"tandem": [run(v) for v in mine], "baseline": [run(v) for v in theirs], "partition_rows": 100_000, **extra}


def test_within_ten_percent_of_the_baseline_is_met_and_beyond_it_missed() -> None:
    assert judge(comparison([0.109, 0.110], [0.100, 0.100]), "972a628")["verdict"] == MET
    assert judge(comparison([0.080], [0.100]), "972a628")["verdict"] == MET
    missed = judge(comparison([0.111, 0.112], [0.100, 0.100]), "972a628")
    assert missed["verdict"] == MISSED
    assert "vs 972a628 0.100 ms" in missed["measured"]
    assert "1.11x" in missed["measured"]


def test_each_side_is_judged_on_its_median_so_one_slow_run_cannot_decide() -> None:
    assert judge(comparison([0.100, 0.100, 0.300], [0.100, 0.100]), "abc")["verdict"] == MET
    assert judge(comparison([0.100, 0.100], [0.010, 0.080, 0.085]), "abc")["verdict"] == MISSED


def test_a_baseline_that_could_not_score_is_not_measurable_with_the_reason() -> None:
    failed = judge(comparison([0.1], [], error="the worker failed: ImportError: cannot import name 'x'"), "abc")
    assert failed["verdict"] == NOT_MEASURABLE
    assert failed["measured"] == "abc could not score: the worker failed: ImportError: cannot import name 'x'"
    assert judge(None, "abc")["verdict"] == NOT_MEASURABLE
    assert judge(comparison([0.1], []), "abc")["verdict"] == NOT_MEASURABLE
    assert judge(comparison([], [0.1]), "abc")["verdict"] == NOT_MEASURABLE


def test_the_two_sides_alternate_and_a_baseline_failure_stops_the_comparison() -> None:
    calls: list[str] = []

    def scorer(name: str, result: Any) -> Any:
        def score() -> Any:
            calls.append(name)
            return result

        return score

    runs = side_by_side(scorer("first", run(1)), scorer("tandem", run(2)), scorer("baseline", run(3)))
    assert calls == ["first", "baseline", "baseline", "tandem", "tandem", "baseline"]
    assert [r["cpu_ms_per_record"] for r in runs["tandem"]] == [1, 2, 2]
    assert [r["cpu_ms_per_record"] for r in runs["baseline"]] == [3, 3, 3]
    calls.clear()
    failed = side_by_side(scorer("first", run(1)), scorer("tandem", run(2)), scorer("baseline", "no worker"))
    assert calls == ["first", "baseline"]
    assert failed == {"tandem": [run(1)], "baseline": [], "error": "no worker"}


def test_a_checkout_without_the_worker_gives_its_error_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = run_worker(worker_command("sqlite://", "2026-11-01"), tmp_path, env)
    assert isinstance(result, str)
    assert result.startswith("the worker failed: ") and "bench.batch_worker" in result
    printed = run_worker([sys.executable, "-c", 'print("noise"); print(\'{"rows": 3}\')'], tmp_path, env)
    assert printed == {"rows": 3}


def test_the_report_shows_both_sides_run_by_run() -> None:
    lines = section(comparison([0.1, 0.2], [0.3, 0.4]), "972a628")
    assert "| Tandem | 2 | 10,000 | 0.200 | 500 |" in lines
    assert "| 972a628 | 1 | 10,000 | 0.300 | 500 |" in lines
    raw = {"threads": 2, "items_per_second": {"128": 20_000.0}}
    batch = {"database": "postgresql", "partitions": {"100000": run(0.1)}}
    assert not any("972a628" in line for line in batch_section(raw, batch))
    shown = batch_section(raw, {**batch, "baseline": comparison([0.1], [], error="gone", commit="abc1234")})
    assert shown[-1] == "abc1234 could not score: gone"
