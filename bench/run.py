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

from bench import online_targets
from bench.harness import (
    FRONTED,
    ROOT,
    START_DAY,
    TARGET_P99_MS,
    BenchEnv,
    Body,
    RunningService,
    fresh_bodies,
    fresh_database,
    minutes,
    request_bodies,
    say,
    seed_history,
    service_specs,
    settle,
    start_service,
    tandem_postgres_spec,
    tandem_spec,
    write_result,
)
from bench.loadgen import run_burst_under_load, run_load

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
# Up to 1,500 rps so the 800 rps goodput target can be met with room above it, in steps of at most
# 100 rps up to 1,000 so capacity (and the native/mounted comparison) is read finely enough.
FULL_RATES = [50, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1500]
# Stock BentoML also runs below the common sweep: it may miss the target at 50 rps already, and its
# goodput at the target is the denominator of a ratio. The do-nothing ceiling covers these too.
STOCK_LOW_RATES = [25]
# A service without admission gets slower with every level past this p99; its sweep stops there.
STOCK_STOP_P99_MS = 10 * TARGET_P99_MS
BURST_BACKGROUND_S = 4.0  # the background load the 64-request burst lands in the middle of
OVERLOAD_TIMEOUT_S = 5.0  # the client timeout of the overload runs ("0 timeouts" is against this)


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

    @classmethod
    def for_mode(cls, quick: bool) -> Plan:
        if quick:
            return cls(True, 2_000, 3, 1.0, [20_000, 100_000], [50, 100, 200], 5.0, [1, 2])
        return cls(False, 5_000, 3, 3.0, [100_000, 1_000_000], FULL_RATES, 6.0, [1, 2, 4])

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
            + 100_000 * 2 / INGEST_ROWS_PER_S,  # the upsert benchmark: insert, then replay
        }
        if batch_only:
            return phases
        drifted_rates = len([r for r in self.rates if r <= self.rates[1]])
        # Stock BentoML stops once p99 passes 10x the target: about half the sweep on this machine.
        stock_levels = len(STOCK_LOW_RATES) + (len(self.rates) + 1) // 2
        overloads = len(online_targets.OVERLOAD_FACTORS)
        burst = BURST_BACKGROUND_S + LOAD_SLACK_S
        phases["online services"] = (
            20  # the online databases: SQLite and PostgreSQL, each seeded with the history
            + 9 * SERVICE_START_S  # 8 services, and the ceiling a second time for the rates found on the way
            + 5 * sweep  # Tandem on SQLite and on PostgreSQL, the mounted route, unbatched Tandem, one more
            + sweep
            + (len(STOCK_LOW_RATES) + 2 * overloads + 2) * load  # the ceiling over every rate judged
            + stock_levels * (load + STOCK_DRAIN_S)
            + drifted_rates * (load + 10)  # its replies run into the 10 s client timeout
            + 2 * load  # 2% poison: Tandem and stock BentoML
            + 4 * burst  # 64-request burst at moderate load: Tandem on both stores, the ceiling for each
            + 2 * overloads * (load + OVERLOAD_TIMEOUT_S)  # past capacity, both; replies up to the timeout
        )
        extra_workers = [n for n in self.worker_counts if n > 1]
        phases["workers scaling"] = sum(SERVICE_START_S * (1 + n / 4) + sweep for n in extra_workers)
        from bench.shadow import ShadowPlan

        phases["shadow scoring"] = ShadowPlan.for_mode(self.quick).estimate_s()
        phases["report"] = 5.0
        return phases


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
    from inference.demo import DemoConfig, day_range, generate_day
    from inference.migrate import upgrade
    from inference.model import ModelConfig, TrainingReport
    from inference.store import make_engine
    from tandem import modelstore

    engine = make_engine(database_url)
    upgrade(engine)
    demo = DemoConfig(rows_per_day=rows_per_day, poison_rate=0.01)
    for day in day_range(START_DAY, days):
        ingest_day(engine, generate_day(day, demo), day)
    engine.dispose()
    import torch

    from inference.model import RiskModel

    torch.manual_seed(0)
    model = RiskModel(ModelConfig())
    report = TrainingReport(float("nan"), 0, 0, 0, model.parameter_count, model.flops_per_item())
    modelstore.promote(modelstore.register(model, report, name="risk_model", code_version="bench"))
    return BenchEnv(root, database_url, dict(os.environ), drop)


# ---------------------------------------------------------------- raw model
def bench_raw_forward(seconds: float) -> dict[str, Any]:
    import torch

    from inference.features import FeatureBatch
    from inference.model import ModelConfig, RiskModel, score_batch

    torch.manual_seed(0)
    model = RiskModel(ModelConfig()).eval()
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    results: dict[str, Any] = {"threads": threads, "items_per_second": {}, "items_per_second_1_thread": {}}

    def rate(size: int) -> float:
        batch = FeatureBatch(
            [str(i) for i in range(size)],
            rng.integers(0, 5, (size, 5)).astype(np.int64),
            rng.random((size, 8), dtype=np.float32),
            rng.integers(0, 5, (size, 16, 2)).astype(np.int64),
            rng.random((size, 16, 4), dtype=np.float32),
            np.ones((size, 16), dtype=bool),
        )
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
    results["flops_per_item"] = model.flops_per_item()
    say(f"raw forward items/s, {threads} threads: { ({k: round(v) for k, v in results['items_per_second'].items()}) }")
    say(f"raw forward items/s, 1 thread: { ({k: round(v) for k, v in results['items_per_second_1_thread'].items()}) }")
    return results


# ---------------------------------------------------------------- batch path
def bench_batch_path(bench: BenchEnv, partition_rows: list[int]) -> dict[str, Any]:
    from inference.batch import ingest_day
    from inference.demo import DemoConfig, generate_day
    from inference.store import make_engine

    engine = make_engine(bench.database_url)
    runs, sequential, sweep = {}, {}, {}

    def score(day: date, *options: str) -> dict[str, Any]:
        """One partition in its own worker process, written as new rows (the previous run's are
        deleted first, outside the measurement), so every run pays for the same inserts."""
        _clear_partition(engine, day)
        output = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.batch_worker",
                "--database-url",
                bench.database_url,
                "--day",
                day.isoformat(),
                *options,
            ],
            cwd=ROOT,
            env=bench.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return dict(json.loads(output.strip().splitlines()[-1]))

    for offset, rows in enumerate(partition_rows):
        day = START_DAY + timedelta(days=30 + offset)
        ingest_day(engine, generate_day(day, DemoConfig(rows_per_day=rows, poison_rate=0.01, accounts=None)), day)
        # Side by side on the same partition: the pipeline, then the same steps one chunk at a time.
        runs[str(rows)] = score(day)
        say(f"batch partition {rows:,} rows, pipelined: {runs[str(rows)]}")
        sequential[str(rows)] = score(day, "--sequential")
        say(f"batch partition {rows:,} rows, sequential: {sequential[str(rows)]}")
        if offset == 0:
            for size in FORWARD_BATCH_SWEEP:
                sweep[str(size)] = score(day, "--forward-batch", str(size))
                say(f"batch partition {rows:,} rows, forward batch {size}: {sweep[str(size)]}")
    upsert = _bench_upsert(engine)
    engine.dispose()
    return {
        "partitions": runs,
        "sequential": sequential,
        "forward_batch_sweep": {"partition_rows": min(partition_rows), "runs": sweep},
        "upsert": upsert,
        "database": engine.dialect.name,
    }


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
            "transaction_id": [f"bench-{i}" for i in range(rows)],
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


# ---------------------------------------------------------------- online path
def _sweep(
    service: RunningService, rates: list[int], seconds: float, body: Body, *, stop_above_p99_ms: float | None = None
) -> list[dict[str, Any]]:
    """A warm-up, then one open-loop run per offered load, with the service's CPU and memory;
    each level starts once the previous one's backlog is gone. With `stop_above_p99_ms`, the sweep
    ends after the first level whose p99 passed it."""
    run_load(service.url, 20, 2.0, body)
    sweep: list[dict[str, Any]] = []
    for rate in rates:
        if stop_above_p99_ms is not None and sweep and not sweep[-1]["p99_ms"] <= stop_above_p99_ms:
            say(f"{service.spec.name}: p99 {sweep[-1]['p99_ms']:.0f} ms, sweep stops before {rate} rps")
            break
        drained_s = settle(service, body)
        cpu_before = service.cpu_seconds()
        result = run_load(service.url, rate, seconds, body)
        cpu = service.cpu_seconds() - cpu_before
        summary = result.summary(TARGET_P99_MS) | {
            "cpu_ms_per_request": cpu * 1000 / max(result.sent, 1),
            "rss_mb": service.rss_mb(),
            "previous_backlog_drain_s": round(drained_s, 1),
        }
        sweep.append(summary)
        say(
            f"{service.spec.name} @ {rate} rps: p50 {summary['p50_ms']:.1f} p99 {summary['p99_ms']:.1f} ms, "
            f"goodput {summary['goodput_rps']:.0f}, shed {summary['shed']}, "
            f"timeouts {summary['client_timeouts']}, conn errors {summary['connection_errors']}, "
            f"CPU {summary['cpu_ms_per_request']:.2f} ms/req, "
            f"RSS {summary['rss_mb']:.0f} MB, generator {summary['generator_cores']:.2f} cores"
        )
    return sweep


def online_environment(bench: BenchEnv, rows_per_day: int, days: int) -> tuple[BenchEnv, str | None]:
    """The online services' own databases, apart from the batch path's, holding the same history:
    the embedded default (no DATABASE_URL: a SQLite file under TANDEM_DATA_DIR), and a fresh
    PostgreSQL database for `tandem_postgres` (None when no PostgreSQL is reachable). The returned
    environment's `drop` drops the PostgreSQL one."""
    data_dir = bench.root / "online"
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in bench.env.items() if k != "DATABASE_URL"} | {"TANDEM_DATA_DIR": str(data_dir)}
    sqlite_url = f"sqlite:///{(data_dir / 'tandem.db').resolve()}"  # as TandemSettings resolves it
    seed_history(sqlite_url, rows_per_day, days)
    postgres_url: str | None
    postgres_url, drop = fresh_database(bench.root / "online_postgres")
    if postgres_url.startswith("postgresql"):
        seed_history(postgres_url, rows_per_day, days)
    else:
        postgres_url = None
    say(f"online databases: {sqlite_url}, {postgres_url or 'no PostgreSQL'}")
    return BenchEnv(bench.root, sqlite_url, env, drop), postgres_url


def bench_online(
    bench: BenchEnv,
    out: Path,
    rates: list[int],
    seconds: float,
    good: list[dict[str, Any]],
    poison: list[dict[str, Any]],
    postgres_url: str | None = None,
) -> dict[str, Any]:
    """Every service over the sweep, the do-nothing ceiling first and again at the end over the
    rates found on the way (Tandem's overload and burst background rates), so every level of
    every service is checked against the ceiling at its own rate (`online_targets`)."""
    specs = service_specs()
    if postgres_url is not None:
        specs.insert(1, tandem_postgres_spec(postgres_url, bench.root / "online_postgres"))
    everything: dict[str, Any] = {}
    if postgres_url is None:
        unreachable = tandem_postgres_spec("", bench.root)
        everything[unreachable.name] = {"label": unreachable.label, "error": "no PostgreSQL reachable"}
    ceiling_rates = sorted({*rates, *STOCK_LOW_RATES})
    for spec in sorted(specs, key=lambda s: s.name != "do_nothing"):  # the ceiling first
        # At the higher rates every drifted request loads the model: minutes of timeouts, nothing learnt.
        service_rates = {
            "drifted": [r for r in rates if r <= rates[1]],
            "stock_bentoml": sorted({*STOCK_LOW_RATES, *rates}),
            "do_nothing": ceiling_rates,
        }.get(spec.name, rates)
        service = start_service(spec, bench)
        if isinstance(service, str):
            everything[spec.name] = {"label": spec.label, "error": service}
            continue
        try:
            body = fresh_bodies(good, spec.name)
            extra: dict[str, Any] = {}
            if spec.name in ("tandem", "stock_bentoml"):
                # First, on the fresh service: after the sweep an unbounded queue may still be
                # working off its overload, and the good requests' failures would not be poison's.
                run_load(service.url, 20, 2.0, body)

                def mixed(i: int, fresh: Body = body) -> tuple[dict[str, Any], bool]:
                    return (poison[i % len(poison)], True) if i % 50 == 0 else fresh(i)

                mixed_rate = rates[1]
                result = run_load(service.url, mixed_rate, seconds, mixed)
                extra["poison_2pct"] = result.summary(TARGET_P99_MS) | {"offered_rps": mixed_rate}
                say(f"{spec.name} with 2% poison @ {mixed_rate} rps: collateral failures {result.collateral_failures}")
            stop = STOCK_STOP_P99_MS if spec.name == "stock_bentoml" else None
            sweep = _sweep(service, service_rates, seconds, body, stop_above_p99_ms=stop)
            if len(sweep) < len(service_rates):
                extra["sweep_stopped"] = (
                    f"stopped after {sweep[-1]['offered_rps']:.0f} rps: p99 over {STOCK_STOP_P99_MS:.0f} ms, "
                    "and without admission every higher level only queues longer"
                )
            if spec.name in FRONTED:
                extra |= _past_capacity(service, body, sweep, seconds, online_targets.ceiling_p99_by_rate(everything))
            everything[spec.name] = {"label": spec.label, "sweep": sweep, **extra}
        finally:
            service.stop()
        write_result(out, f"online_{spec.name}", everything[spec.name])
    _ceiling_again(bench, everything, good, seconds)
    ceiling = online_targets.ceiling_p99_by_rate(everything)
    ordered = {spec.name: everything[spec.name] for spec in specs if spec.name in everything}
    everything = ordered | everything  # the declared order, for the report
    for name, service in everything.items():
        online_targets.mark_service(service, ceiling)
        if "sweep" in service:
            write_result(out, f"online_{name}", service)
    verdicts = online_targets.judge(everything, TARGET_P99_MS)
    write_result(out, "online_targets", verdicts)
    for t in verdicts["targets"]:
        say(f"target {t['target']}: {t['verdict']} ({t['measured']})")
    return everything


def _past_capacity(
    service: RunningService, body: Body, sweep: list[dict[str, Any]], seconds: float, ceiling: dict[int, float]
) -> dict[str, Any]:
    """Tandem's burst at moderate load and its overload runs, at rates set by the capacity the
    sweep measured (its usable levels only: those the ceiling so far vouches for)."""
    for entry in sweep:
        online_targets.mark(entry, ceiling)
    capacity = online_targets.capacity({"sweep": sweep}, TARGET_P99_MS)
    say(f"{service.spec.name} capacity at p99 <= {TARGET_P99_MS:.0f} ms: {capacity:.0f} rps")
    settle(service, body)
    background_rps = online_targets.burst_background_rps(capacity)
    background, burst = run_burst_under_load(
        service.url, background_rps, BURST_BACKGROUND_S, online_targets.BURST_SIZE, body
    )
    burst_64: dict[str, Any] = {
        "background_rps": background_rps,
        "background": background.summary(TARGET_P99_MS),
        "burst": burst.summary(TARGET_P99_MS),
    }
    say(
        f"{service.spec.name}: burst of {online_targets.BURST_SIZE} over {background_rps} rps: "
        f"statuses {burst_64['burst']['statuses']}, "
        f"p99 {burst_64['burst']['p99_ms']:.1f} ms"
    )
    overload = {}
    for factor, rate in online_targets.overload_rates(capacity).items():
        settle(service, body)
        before = service.rss_mb()
        result = run_load(service.url, rate, seconds, body, timeout_s=OVERLOAD_TIMEOUT_S)
        overload[factor] = result.summary(TARGET_P99_MS) | {
            "client_timeout_s": OVERLOAD_TIMEOUT_S,
            "rss_mb_before": before,
            "rss_mb_after": service.rss_mb(),
        }
        o = overload[factor]
        say(
            f"{service.spec.name}: overload {factor} @ {rate} rps: "
            f"accepted p99 {o['p99_ms']:.1f} ms, goodput {o['goodput_rps']:.0f}, "
            f"shed {o['shed']} (p99 {o['shed_p99_ms']:.1f} ms, {o['shed_without_retry_after']} no Retry-After), "
            f"timeouts {o['client_timeouts']}, conn errors {o['connection_errors']}, "
            f"generator {o['generator_cores']:.2f} cores"
        )
    return {"capacity_rps": capacity, "burst_64": burst_64, "overload": overload}


def _ceiling_again(bench: BenchEnv, everything: dict[str, Any], good: list[dict[str, Any]], seconds: float) -> None:
    """The do-nothing ceiling over the rates the past-capacity runs chose (overload, burst
    background) of Tandem on both stores, and the same bursts, merged into its results."""
    ceiling = everything.get("do_nothing", {})
    runs = [everything[name] for name in FRONTED if "overload" in everything.get(name, {})]
    if "sweep" not in ceiling or not runs:
        return
    measured = {online_targets.rate_key(s["offered_rps"]) for s in ceiling["sweep"]}
    wanted = {
        r
        for run in runs
        for r in (run["burst_64"]["background_rps"], *(o["offered_rps"] for o in run["overload"].values()))
    }
    rates = sorted({online_targets.rate_key(r) for r in wanted} - measured)
    spec = next(s for s in service_specs() if s.name == "do_nothing")
    service = start_service(spec, bench)
    if isinstance(service, str):
        return
    bursts: dict[int, dict[str, Any]] = {}
    try:
        body = fresh_bodies(good, "do_nothing_again")
        more = _sweep(service, rates, seconds, body) if rates else []
        for background_rps in dict.fromkeys(run["burst_64"]["background_rps"] for run in runs):
            settle(service, body)
            background, burst = run_burst_under_load(
                service.url, background_rps, BURST_BACKGROUND_S, online_targets.BURST_SIZE, body
            )
            bursts[background_rps] = {
                "background_rps": background_rps,
                "background": background.summary(TARGET_P99_MS),
                "burst": burst.summary(TARGET_P99_MS),
            }
    finally:
        service.stop()
    ceiling["sweep"] = sorted([*ceiling["sweep"], *more], key=lambda s: s["offered_rps"])
    ceiling["burst_64"] = bursts[runs[0]["burst_64"]["background_rps"]]
    for run in runs:
        background_rps = run["burst_64"]["background_rps"]
        run["burst_64"]["ceiling_burst_p99_ms"] = bursts[background_rps]["burst"]["p99_ms"]
        say(f"ceiling, same burst over {background_rps} rps: p99 {run['burst_64']['ceiling_burst_p99_ms']:.1f} ms")


def bench_workers(
    bench: BenchEnv,
    out: Path,
    rates: list[int],
    seconds: float,
    good: list[dict[str, Any]],
    worker_counts: list[int],
    single: dict[str, Any],
    ceiling: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Tandem over the same sweep with more server processes; `single` is the 1-worker Tandem result.
    Levels are marked against the do-nothing `ceiling`; goodput counts the usable ones only."""
    counts: dict[str, Any] = {}
    for workers in worker_counts:
        if workers == 1:
            # The main Tandem sweep, same rates and procedure: measuring it twice only costs time.
            entry: dict[str, Any] = {"source": "online_tandem.json"} | (
                {"sweep": single["sweep"]} if "sweep" in single else {"error": single.get("error", "no sweep")}
            )
        else:
            spec = tandem_spec(workers)
            say(f"starting {spec.label}")
            try:
                service = RunningService(spec, bench)
            except RuntimeError as error:
                say(str(error))
                counts[str(workers)] = {"error": str(error)}
                continue
            try:
                idle_rss = service.rss_mb()
                entry = {
                    "rss_mb_idle": idle_rss,
                    "sweep": _sweep(service, rates, seconds, fresh_bodies(good, spec.name)),
                }
            finally:
                service.stop()
        if "sweep" in entry:
            sweep = entry["sweep"]
            for level in sweep:
                online_targets.mark(level, ceiling or {})
            entry |= {
                "goodput_rps": online_targets.goodput_at_target(sweep, TARGET_P99_MS) or 0.0,
                "p99_ms_by_rate": {str(int(s["offered_rps"])): s["p99_ms"] for s in sweep},
                "cpu_ms_per_request_by_rate": {str(int(s["offered_rps"])): s["cpu_ms_per_request"] for s in sweep},
                "rss_mb_peak": max((s["rss_mb"] for s in sweep), default=float("nan")),
            }
            say(f"{workers} worker(s): goodput at p99 <= {TARGET_P99_MS:.0f} ms: {entry['goodput_rps']:.0f} rps")
        counts[str(workers)] = entry
    result = {
        "target_p99_ms": TARGET_P99_MS,
        "cpu_count": os.cpu_count(),
        "offered_rps": rates,
        "seconds_per_rate": seconds,
        "workers": counts,
    }
    write_result(out, "online_workers", result)
    return result


# ---------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few minutes: smaller partitions, shorter load")
    parser.add_argument("--batch-only", action="store_true", help="raw forward and the batch path, no services")
    parser.add_argument(
        "--shadow-only", action="store_true", help="only the shadow-scoring scenario (bench/shadow.py), no report"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where results/*.json, report.md and the plots go; default bench/ for a full run "
        "(the committed results), a new temporary directory for --quick",
    )
    args = parser.parse_args()
    if args.shadow_only:
        from bench import shadow

        return shadow.run_standalone(quick=args.quick, out=args.out)
    plan = Plan.for_mode(args.quick)
    out: Path = args.out or (Path(tempfile.mkdtemp(prefix="tandem-bench-quick-")) if plan.quick else ROOT / "bench")
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
        with phases.run("batch path"):
            batch = bench_batch_path(bench, plan.partitions)
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
        write_result(out, "batch_targets", targets)
        if args.batch_only:
            return 0
        good, poison = request_bodies(bench, 20_000)
        with phases.run("online services"):
            online_env, postgres_url = online_environment(bench, plan.rows_per_day, plan.history_days)
            drops.append(online_env.drop)
            online = bench_online(online_env, out, plan.rates, plan.load_seconds, good, poison, postgres_url)
        with phases.run("workers scaling"):
            workers = bench_workers(
                online_env,
                out,
                plan.rates,
                plan.load_seconds,
                good,
                plan.worker_counts,
                online.get("tandem", {}),
                online_targets.ceiling_p99_by_rate(online),
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
                capacity_source="this run's Tandem sweep" if capacity else "the top rate (no capacity measured)",
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
