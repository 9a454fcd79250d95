"""The batch half of the baseline comparison: the same partition scored by this checkout's code and
by the baseline commit's, each in its own process on the same database, in alternating order.

The baseline runs its own `bench/batch_worker.py` (cwd and PYTHONPATH its worktree), so only the
worker's command line has to hold across both checkouts. A baseline that cannot score (no such
worker, an API it lacks, a crash) is a reason in the result, and its verdict reads "not measurable".
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Target of docs/decisions/0012-model-spec.md, step 0: more CPU per record than the baseline's by
# at most this share; less is never a miss.
CPU_PER_RECORD_MARGIN = 0.10
MET, MISSED, NOT_MEASURABLE = "met", "missed", "not measurable"
# Runs per side: one side's own runs of a 1M-row partition spread up to 17% on the 2-core machine
# (bench/results/spec-boundary/), wider than the margin, so a median of two decided little.
ROUNDS = 3

Score = Callable[[], dict[str, Any]]


def worker_command(database_url: str, day: str, *options: str) -> list[str]:
    """`bench.batch_worker`'s command line, the same for this checkout and the baseline's."""
    return [sys.executable, "-m", "bench.batch_worker", "--database-url", database_url, "--day", day, *options]


def run_worker(command: list[str], cwd: Path, env: dict[str, str]) -> dict[str, Any] | str:
    """The worker's JSON result, or why there is none (the last line it wrote to stderr)."""
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except OSError as error:
        return f"the worker could not start: {error}"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        try:
            return dict(json.loads(lines[-1]))
        except ValueError:
            pass
    tail = done.stderr.strip().splitlines() or [f"exit status {done.returncode}, no result"]
    return f"the worker failed: {tail[-1]}"


def side_by_side(first: Score, tandem: Score, baseline: Callable[[], dict[str, Any] | str]) -> dict[str, Any]:
    """ROUNDS rounds, Tandem first in even rounds and the baseline first in odd ones (ABBAAB), so a
    machine drifting during the comparison favours neither. `first` is Tandem's run already made
    just before, reused as round 0's. Stops at the baseline's first failure, keeping its reason."""
    runs: dict[str, list[Any]] = {"tandem": [], "baseline": []}
    for index in range(ROUNDS):
        if index % 2 == 0:
            runs["tandem"].append(first() if index == 0 else tandem())
        theirs = baseline()
        if isinstance(theirs, str):
            return {**runs, "error": theirs}
        runs["baseline"].append(theirs)
        if index % 2 == 1:
            runs["tandem"].append(tandem())
    return runs


def judge(comparison: dict[str, Any] | None, commit: str) -> dict[str, Any]:
    """The verdict on the median CPU per record of each side's runs on one partition."""
    name = f"batch CPU per record within {CPU_PER_RECORD_MARGIN:.0%} of {commit}'s"
    threshold = f"<= {1 + CPU_PER_RECORD_MARGIN:.2f}x {commit}'s, same partition, same run"
    verdict = {"target": name, "threshold": threshold}
    if not comparison:
        return {**verdict, "measured": "no comparison ran", "verdict": NOT_MEASURABLE}
    rows = comparison.get("partition_rows")
    if comparison.get("error"):
        return {**verdict, "measured": f"{commit} could not score: {comparison['error']}", "verdict": NOT_MEASURABLE}
    mine = [r["cpu_ms_per_record"] for r in comparison.get("tandem", [])]
    theirs = [r["cpu_ms_per_record"] for r in comparison.get("baseline", [])]
    if not mine or not theirs or min(theirs) <= 0:
        return {**verdict, "measured": "no runs on one side", "verdict": NOT_MEASURABLE}
    ours, base = statistics.median(mine), statistics.median(theirs)
    measured = (
        f"Tandem {ours:.3f} ms (runs {', '.join(f'{v:.3f}' for v in mine)}) vs {commit} {base:.3f} ms "
        f"(runs {', '.join(f'{v:.3f}' for v in theirs)}): {ours / base:.2f}x"
        + (f", {int(rows):,} rows" if rows else "")
    )
    ok = ours <= (1 + CPU_PER_RECORD_MARGIN) * base
    return {**verdict, "measured": measured, "verdict": MET if ok else MISSED, "ratio": ours / base}


def section(comparison: dict[str, Any] | None, commit: str) -> list[str]:
    """The side-by-side table of the report's batch section."""
    if not comparison:
        return []
    rows = comparison.get("partition_rows", 0)
    lines = [
        "",
        f"Against {commit}, {int(rows):,}-row partition, pipelined, each side's own `bench.batch_worker` in "
        "alternating order:",
        "",
        "| code | run | rows/s | CPU ms / record | peak RSS MB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for side, label in (("tandem", "Tandem"), ("baseline", commit)):
        for index, r in enumerate(comparison.get(side, []), 1):
            lines.append(
                f"| {label} | {index} | {r['rows_per_second']:,.0f} | {r['cpu_ms_per_record']:.3f} "
                f"| {r['peak_rss_mb']:,.0f} |"
            )
    if comparison.get("error"):
        lines += ["", f"{commit} could not score: {comparison['error']}"]
    return lines
