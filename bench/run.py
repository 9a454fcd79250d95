"""`make bench` / `make bench-quick`: every measurement side by side in one run on this machine.

A full run writes bench/results/<scenario>.json and bench/report.md (with PNG plots); a quick run
writes the same layout under a fresh temporary directory, so it never overwrites the committed
full-run results (`--out` chooses either). Targets are reported, never asserted: a missed target
is a finding, written down with the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from bench import baseline, batch_baseline, online_targets
from bench.harness import (
    ROOT,
    START_DAY,
    TARGET_P99_MS,
    BenchEnv,
    fresh_database,
    minutes,
    request_bodies,
    say,
    write_result,
)
from bench.online import (
    BURST_BACKGROUND_S,
    OVERLOAD_TIMEOUT_S,
    STOCK_LOW_RATES,
    bench_online,
    bench_workers,
    online_environment,
)
from bench.precision import PrecisionPlan, bench_precision

# ---------------------------------------------------------------- plan and phases
# Rough rates for the duration estimates only, from earlier runs on this 2-core machine; nothing
# is measured or judged against them.
INGEST_ROWS_PER_S = 20_000
SCORE_ROWS_PER_S = 14_000
# Forward batch sizes: the raw model at the default torch threads, and (one thread, as the batch
# path's model workers run) the sizes the batch path is also measured at end to end.
RAW_FORWARD_SIZES = (1, 8, 64, 128, 256, 1024)
FORWARD_BATCH_SWEEP = (64, 128, 256, 1024)
PROCESS_START_S = 8.0  # a batch worker or load-generator process: interpreter, torch, model
SERVICE_START_S = 15.0  # start, readiness (model load + warm-up inference), the 2 s warm-up load, stop
LOAD_SLACK_S = 1.0  # per load run: replies still in flight when the schedule ends
STOCK_DRAIN_S = 10.0  # per stock BentoML level: its unbounded queue drains before the next one
# Steps of 100-300 rps where capacity has been (500-1,500 rps on this machine), and room above it:
# a sweep stops two levels past capacity, so the top levels cost nothing unless reached. Every level
# runs in every round of four services on two stores: a level more costs about 100 s of a full run.
FULL_RATES = [100, 200, 400, 600, 800, 1000, 1200, 1400, 1700, 2000]
# Rounds of the side-by-side comparison in a full run (one in quick mode, which only shows every
# phase works); the rounds' spread is what "within the noise" means in the capacity verdict.
FULL_ROUNDS = 3


@dataclass(frozen=True)
class Plan:
    """What one run measures; quick mode is the same scenarios, smaller and shorter."""

    quick: bool
    rows_per_day: int
    history_days: int
    forward_seconds: float
    partitions: list[int]
    rates: list[int]
    load_seconds: float
    # Worker counts of the scaling scenario; 1 is the main Tandem sweep, not run again.
    worker_counts: list[int]
    rounds: int

    @classmethod
    def for_mode(cls, quick: bool) -> Plan:
        if quick:
            return cls(True, 2_000, 3, 1.0, [20_000, 100_000], [100, 300], 4.0, [1, 2], 1)
        return cls(False, 5_000, 3, 3.0, [100_000, 1_000_000], FULL_RATES, 6.0, [1, 2, 4], FULL_ROUNDS)

    def estimates(self, batch_only: bool) -> dict[str, float]:
        load = self.load_seconds + LOAD_SLACK_S
        sweep = len(self.rates) * load
        phases = {
            "environment": 2 + self.rows_per_day * self.history_days / INGEST_ROWS_PER_S,
            "raw forward": (len(RAW_FORWARD_SIZES) + len(FORWARD_BATCH_SWEEP)) * self.forward_seconds + 2,
            "raw forward, again": (len(RAW_FORWARD_SIZES) + len(FORWARD_BATCH_SWEEP)) * self.forward_seconds + 2,
            # Each partition pipelined and sequential; the smallest also at each swept forward batch.
            "batch path": sum(
                2 * PROCESS_START_S + rows / INGEST_ROWS_PER_S + 2 * rows / SCORE_ROWS_PER_S for rows in self.partitions
            )
            + len(FORWARD_BATCH_SWEEP) * (PROCESS_START_S + min(self.partitions) / SCORE_ROWS_PER_S)
            + 100_000 * 2 / INGEST_ROWS_PER_S  # the upsert benchmark: insert, then replay
            # The baseline's worktree, then the largest partition scored again by each side in
            # turn, Tandem's first run reused (batch_baseline.side_by_side).
            + 10
            + (2 * batch_baseline.ROUNDS - 1) * (PROCESS_START_S + max(self.partitions) / SCORE_ROWS_PER_S),
            "precision": PrecisionPlan.for_mode(self.quick).estimate_s(self.rows_per_day * self.history_days),
        }
        if batch_only:
            return phases
        phases["online services"] = self._online_estimate(load)
        extra_workers = [n for n in self.worker_counts if n > 1]
        phases["workers scaling"] = sum(SERVICE_START_S * (1 + n / 4) + sweep for n in extra_workers)
        from bench.shadow import ShadowPlan

        phases["shadow scoring"] = ShadowPlan.for_mode(self.quick).estimate_s()
        phases["report"] = 5.0
        return phases

    def _online_estimate(self, load: float) -> float:
        """The rounds, past capacity and the ceiling's second run (bench/online.py)."""
        # Tandem and the baseline stop two levels past capacity: about three quarters of the sweep
        # here; stock BentoML (capacity about 100 rps) two levels past its low rates, the last
        # with a backlog to drain.
        levels = -(-3 * len(self.rates) // 4)
        stock = SERVICE_START_S + (len(STOCK_LOW_RATES) + 3) * load + STOCK_DRAIN_S
        ceiling = SERVICE_START_S / 3 + (len(STOCK_LOW_RATES) + len(self.rates)) * load
        one_round = ceiling + stock + 4 * (SERVICE_START_S + levels * load)
        overloads = len(online_targets.OVERLOAD_FACTORS)
        burst = BURST_BACKGROUND_S + LOAD_SLACK_S
        return (
            20  # the online databases: SQLite and PostgreSQL, each seeded with the history
            + 10  # the baseline's worktree
            + self.rounds * one_round
            + 2 * (2 + load)  # 2% poison: Tandem and stock BentoML, first round
            + 2 * (burst + overloads * (load + OVERLOAD_TIMEOUT_S))  # past capacity, both stores
            + SERVICE_START_S / 3
            + 2 * (overloads + 1) * load
            + 2 * burst  # the ceiling again
        )


@dataclass
class Phases:
    """Announces each phase with its estimate and records how long it took."""

    estimates: dict[str, float]
    took: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def run(self, name: str) -> Iterator[None]:
        estimate = self.estimates[name]
        say(f"== {name}: estimated ~{minutes(estimate)}")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.took[name] = time.perf_counter() - started
            say(f"== {name}: took {minutes(self.took[name])} (estimated ~{minutes(estimate)})")

    def table(self) -> list[tuple[str, float, float]]:
        return [(name, self.estimates[name], took) for name, took in self.took.items()]


# ---------------------------------------------------------------- environment
def prepare_environment(rows_per_day: int, days: int) -> BenchEnv:
    """A temporary model store and a fresh database holding `days` of history."""
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    os.environ["BENTOML_HOME"] = str(root / "bentoml")
    os.environ["TANDEM_DATA_DIR"] = str(root / "data")
    os.environ.setdefault("TANDEM_CODE_VERSION", "bench")
    database_url, drop = fresh_database(root)
    os.environ["DATABASE_URL"] = database_url
    from inference.batch import ingest_day
    from inference.demo import day_range, demo_day
    from inference.migrate import upgrade
    from inference.model import default_model, untrained_report
    from inference.spec import DemoSettings, configured_spec
    from inference.store import make_engine
    from tandem import modelstore

    spec = configured_spec()
    engine = make_engine(database_url)
    upgrade(engine, spec)
    demo = DemoSettings(rows_per_day=rows_per_day, poison_rate=0.01)
    for day in day_range(START_DAY, days):
        ingest_day(spec, engine, demo_day(spec, day, demo), day)
    engine.dispose()
    import torch

    torch.manual_seed(0)
    model = default_model(spec)
    modelstore.promote(
        modelstore.register(model, untrained_report(model), name=spec.spec.model_name, code_version="bench")
    )
    return BenchEnv(root, database_url, dict(os.environ), drop, spec)


# ---------------------------------------------------------------- raw model
def forward_inputs(rows: int) -> Any:
    """A FeatureBatch of `rows` records of the configured spec's demo (its rows repeated where a
    day holds fewer), each with its history among the day's earlier records: what the model reads."""
    from inference.demo import demo_day
    from inference.features import FeatureBatch, build_features
    from inference.records import split_valid
    from inference.spec import DemoSettings, configured_spec

    ls = configured_spec()
    settings = DemoSettings(start=START_DAY, days=1, rows_per_day=rows, poison_rate=0.0)
    valid, _ = split_valid(ls, demo_day(ls, START_DAY, settings).select(ls.field_names))
    features = build_features(ls, valid, valid, ls.spec.history_length)
    repeat = np.arange(rows) % len(features)
    return FeatureBatch([str(i) for i in range(rows)], tuple(a[repeat] for a in features.arrays), [None] * rows)


def bench_raw_forward(seconds: float) -> dict[str, Any]:
    import torch

    from inference.model import default_model, score_batch, untrained_report
    from inference.spec import configured_spec

    torch.manual_seed(0)
    model = default_model(configured_spec())
    model.module.eval()
    inputs = forward_inputs(max(RAW_FORWARD_SIZES + FORWARD_BATCH_SWEEP))
    threads = torch.get_num_threads()
    results: dict[str, Any] = {"threads": threads, "items_per_second": {}, "items_per_second_1_thread": {}}

    def rate(size: int) -> float:
        batch = inputs.slice(0, size)
        score_batch(model, batch)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            score_batch(model, batch)
            done += size
        return done / (time.perf_counter() - started)

    for size in RAW_FORWARD_SIZES:
        results["items_per_second"][str(size)] = rate(size)
    # One thread per forward: how the batch path's model workers run (inference/batch.py).
    torch.set_num_threads(1)
    try:
        for size in FORWARD_BATCH_SWEEP:
            results["items_per_second_1_thread"][str(size)] = rate(size)
    finally:
        torch.set_num_threads(threads)
    results["parameter_count"] = model.parameter_count
    results["flops_per_item"] = untrained_report(model).flops_per_item  # None: the module counts none
    say(f"raw forward items/s, {threads} threads: { ({k: round(v) for k, v in results['items_per_second'].items()}) }")
    say(f"raw forward items/s, 1 thread: { ({k: round(v) for k, v in results['items_per_second_1_thread'].items()}) }")
    return results


# ---------------------------------------------------------------- batch path
def bench_batch_path(
    bench: BenchEnv, partition_rows: list[int], checkout: Path | str | None = None, commit: str = ""
) -> dict[str, Any]:
    """Every partition pipelined and sequential, the smallest at each swept forward batch; with a
    baseline `checkout` (or why there is none), the largest also side by side with its code."""
    from inference.batch import ingest_day
    from inference.demo import demo_day
    from inference.spec import DemoSettings, configured_spec
    from inference.store import make_engine

    spec = configured_spec()
    engine = make_engine(bench.database_url)
    runs, sequential, sweep = {}, {}, {}

    def score(day: date, *options: str) -> dict[str, Any]:
        return score_in_worker(bench, engine, day, *options)

    for offset, rows in enumerate(partition_rows):
        day = START_DAY + timedelta(days=30 + offset)
        ingest_day(spec, engine, demo_day(spec, day, DemoSettings(rows_per_day=rows, poison_rate=0.01)), day)
        # Side by side on the same partition: the pipeline, then the same steps one chunk at a time.
        runs[str(rows)] = score(day)
        say(f"batch partition {rows:,} rows, pipelined: {runs[str(rows)]}")
        sequential[str(rows)] = score(day, "--sequential")
        say(f"batch partition {rows:,} rows, sequential: {sequential[str(rows)]}")
        if offset == 0:
            for size in FORWARD_BATCH_SWEEP:
                sweep[str(size)] = score(day, "--forward-batch", str(size))
                say(f"batch partition {rows:,} rows, forward batch {size}: {sweep[str(size)]}")
    comparison = None
    if checkout is not None:
        day = START_DAY + timedelta(days=30 + partition_rows.index(max(partition_rows)))
        comparison = _against_baseline(bench, engine, day, checkout, lambda: runs[str(max(partition_rows))], score)
        comparison["partition_rows"] = max(partition_rows)
        comparison["commit"] = commit
    upsert = _bench_upsert(engine)
    engine.dispose()
    return {
        **({"baseline": comparison} if comparison is not None else {}),
        "partitions": runs,
        "sequential": sequential,
        "forward_batch_sweep": {"partition_rows": min(partition_rows), "runs": sweep},
        "upsert": upsert,
        "database": engine.dialect.name,
    }


def score_in_worker(bench: BenchEnv, engine: Any, day: date, *options: str) -> dict[str, Any]:
    """One partition in its own worker process, written as new rows (the previous run's are
    deleted first, outside the measurement), so every run pays for the same inserts."""
    _clear_partition(engine, day)
    output = subprocess.run(
        batch_baseline.worker_command(bench.database_url, day.isoformat(), *options),
        cwd=ROOT,
        env=bench.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(output.strip().splitlines()[-1]))


def run_precision(bench: BenchEnv, quick: bool, rows_per_day: int, history_days: int) -> dict[str, Any]:
    """The precision phase (bench/precision.py), its end-to-end runs through the batch worker."""
    from inference.store import make_engine

    engine = make_engine(bench.database_url)
    try:
        return bench_precision(
            bench.database_url,
            PrecisionPlan.for_mode(quick),
            history_days,
            rows_per_day * history_days,
            lambda day, *options: score_in_worker(bench, engine, day, *options),
        )
    finally:
        engine.dispose()


def _against_baseline(
    bench: BenchEnv,
    engine: Any,
    day: date,
    checkout: Path | str,
    first: Callable[[], dict[str, Any]],
    score: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """`day` scored by Tandem and by the baseline checkout's own worker, in alternating order, the
    baseline on a copy of the records in a database at its own schema."""
    if isinstance(checkout, str):
        return {"tandem": [first()], "baseline": [], "error": checkout}
    from inference.store import make_engine

    url, drop = baseline.database(bench.model_spec, bench.database_url, checkout, bench.root / "baseline_batch")
    theirs_engine = make_engine(url)

    def theirs() -> dict[str, Any] | str:
        _clear_partition(theirs_engine, day)
        env = {**bench.env, "PYTHONPATH": str(checkout), "DATABASE_URL": url}
        result = batch_baseline.run_worker(batch_baseline.worker_command(url, day.isoformat()), checkout, env)
        say(f"batch partition {day}, baseline: {result}")
        return result

    try:
        return batch_baseline.side_by_side(first, lambda: score(day), theirs)
    finally:
        theirs_engine.dispose()
        drop()


def _clear_partition(engine: Any, day: date) -> None:
    """Remove a partition's batch results (its source rows and ingest rejections stay)."""
    import sqlalchemy as sa

    key = day.isoformat()
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM predictions WHERE partition_key = :key"), {"key": key})
        conn.execute(
            sa.text("DELETE FROM rejected_records WHERE partition_key = :key AND stage = 'score'"), {"key": key}
        )
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE predictions"))
            conn.execute(sa.text("VACUUM ANALYZE rejected_records"))


def _bench_upsert(engine: Any, rows: int = 100_000) -> dict[str, Any]:
    from inference.records import EVENT_TS_DTYPE
    from inference.store import upsert_predictions, utc_now

    frame = pl.DataFrame(
        {
            "record_id": [f"bench-{i}" for i in range(rows)],
            "model_version": "bench:upsert",
            "score": np.random.default_rng(0).random(rows),
            "path": "batch",
            "run_id": "bench",
            "partition_key": "bench",
            "request_id": None,
            "batch_id": None,
            "code_version": "bench",
            "input_hash": [f"h{i}" for i in range(rows)],
            "history_hash": [f"g{i}" for i in range(rows)],
            "idempotency_key": None,
            "produced_at": pl.Series([utc_now()] * rows, dtype=EVENT_TS_DTYPE),
            "latency_ms": None,
        },
        schema_overrides={
            "request_id": pl.String,
            "batch_id": pl.String,
            "idempotency_key": pl.String,
            "latency_ms": pl.Float64,
        },
    )
    timings = {}
    for label in ("insert", "replay_noop"):
        started = time.perf_counter()
        with engine.begin() as conn:
            upsert_predictions(conn, frame)
        timings[f"{label}_rows_per_second"] = rows / (time.perf_counter() - started)
    say(f"upsert {rows:,} rows on {engine.dialect.name}: { ({k: round(v) for k, v in timings.items()}) }")
    return {"rows": rows, **timings}


# ---------------------------------------------------------------- main
def precision_only(plan: Plan, out: Path) -> int:
    """`--precision-only`: the environment and the precision phase; its section of the report as a
    page of its own (precision.md), so the committed report.md stays one full run's."""
    from bench.report import precision_section

    estimates = plan.estimates(True)
    phases = Phases({name: estimates[name] for name in ("environment", "precision")})
    say(f"output: {out}; estimated ~{minutes(sum(phases.estimates.values()))} in all")
    with phases.run("environment"):
        bench = prepare_environment(plan.rows_per_day, plan.history_days)
    try:
        with phases.run("precision"):
            precision = run_precision(bench, plan.quick, plan.rows_per_day, plan.history_days)
            write_result(out, "precision", precision)
        lines = ["# Tandem benchmark: fp32 and bf16 (`bench.run --precision-only`)", "", *precision_section(precision)]
        (out / "precision.md").write_text("\n".join(lines))
        say(f"report: {out / 'precision.md'}")
    finally:
        bench.drop()
        shutil.rmtree(bench.root, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few minutes: smaller partitions, shorter load")
    parser.add_argument("--batch-only", action="store_true", help="raw forward and the batch path, no services")
    parser.add_argument(
        "--shadow-only", action="store_true", help="only the shadow-scoring scenario (bench/shadow.py), no report"
    )
    parser.add_argument(
        "--precision-only",
        action="store_true",
        help="only the fp32 / bf16 comparison (bench/precision.py): results/precision.json and precision.md",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where results/*.json, report.md and the plots go; default bench/ for a full run "
        "(the committed results), a new temporary directory for --quick",
    )
    parser.add_argument(
        "--baseline",
        default=online_targets.BASELINE_COMMIT,
        metavar="REV",
        help="the commit whose batch path and online service are measured beside this checkout's, "
        f"each from its own worktree (default {online_targets.BASELINE_COMMIT})",
    )
    args = parser.parse_args()
    if args.shadow_only:
        from bench import shadow

        return shadow.run_standalone(quick=args.quick, out=args.out)
    plan = Plan.for_mode(args.quick)
    out: Path = args.out or (Path(tempfile.mkdtemp(prefix="tandem-bench-quick-")) if plan.quick else ROOT / "bench")
    if args.precision_only:
        return precision_only(plan, out)
    phases = Phases(plan.estimates(args.batch_only))
    say(f"output: {out}; estimated ~{minutes(sum(phases.estimates.values()))} in all")
    started = time.perf_counter()
    with phases.run("environment"):
        bench = prepare_environment(plan.rows_per_day, plan.history_days)
    drops: list[Callable[[], None]] = []
    try:
        with phases.run("raw forward"):
            raw = bench_raw_forward(plan.forward_seconds)
            write_result(out, "raw_forward", raw)
        with phases.run("batch path"), baseline.checkout(args.baseline, bench.root) as checkout:
            batch = bench_batch_path(bench, plan.partitions, checkout, args.baseline)
            write_result(out, "batch_path", batch)
        with phases.run("raw forward, again"):
            # The batch path's share is judged against the faster reading (bench.report.best_raw_forward).
            raw["after_batch"] = bench_raw_forward(plan.forward_seconds)
            write_result(out, "raw_forward", raw)
        from bench.report import batch_section, batch_targets

        for line in batch_section(raw, batch):
            say(line)
        targets = [{"target": t, "measured": m, "met": ok} for t, m, ok in batch_targets(raw, batch)]
        for target in targets:
            say(f"target: {target['target']}: {target['measured']} -> {'met' if target['met'] else 'MISSED'}")
        against = batch_baseline.judge(batch.get("baseline"), args.baseline)
        say(f"target: {against['target']}: {against['measured']} -> {against['verdict']}")
        write_result(out, "batch_targets", [*targets, against])
        with phases.run("precision"):
            precision = run_precision(bench, plan.quick, plan.rows_per_day, plan.history_days)
            write_result(out, "precision", precision)
        if args.batch_only:
            return 0
        good, poison = request_bodies(bench, 20_000)
        with phases.run("online services"):
            online_env, postgres_url = online_environment(bench, plan.rows_per_day, plan.history_days)
            drops.append(online_env.drop)
            online, online_verdicts = bench_online(
                online_env, out, plan.rates, plan.load_seconds, plan.rounds, good, poison, postgres_url, args.baseline
            )
        with phases.run("workers scaling"):
            workers = bench_workers(
                online_env,
                out,
                plan.rates,
                plan.load_seconds,
                good,
                plan.worker_counts,
                online.get("tandem", {}),
                online_targets.worst_ceiling(online),
            )
        with phases.run("shadow scoring"):
            from bench.shadow import bench_shadow

            capacity = online.get("tandem", {}).get("capacity_rps")
            shadow_result = bench_shadow(
                online_env,
                out,
                good,
                quick=plan.quick,
                capacity_rps=capacity or plan.rates[-1],
                capacity_source="the median of this run's Tandem rounds"
                if capacity
                else "the top rate (no capacity measured)",
            )
        with phases.run("report"):
            from bench.report import write_report

            write_report(
                raw,
                batch,
                online,
                workers,
                TARGET_P99_MS,
                out=out,
                quick=plan.quick,
                seconds=time.perf_counter() - started,
                phases=phases.table(),
                shadow=shadow_result,
                targets=online_verdicts,
                precision=precision,
            )
        say(f"report: {out / 'report.md'}")
    finally:
        for drop in drops:
            drop()
        bench.drop()
        shutil.rmtree(bench.root, ignore_errors=True)
        say(f"took {minutes(time.perf_counter() - started)} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
