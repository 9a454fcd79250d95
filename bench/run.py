"""`make bench` / `make bench-quick`: every measurement side by side in one run on this machine.

Writes bench/results/<scenario>.json and bench/report.md (with PNG plots). Targets are reported,
never asserted: a missed target is a finding, written down with the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET_P99_MS = float(os.environ.get("TANDEM_SERVING_P99_TARGET_MS", "50"))
START_DAY = date(2026, 11, 1)


def _say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def _write(scenario: str, data: Any) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{scenario}.json").write_text(json.dumps(data, indent=2, default=str))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- environment
@dataclass
class BenchEnv:
    root: Path
    database_url: str
    env: dict[str, str]
    drop: Callable[[], None]


def prepare_environment(rows_per_day: int, days: int) -> BenchEnv:
    """A temporary model store and a fresh database holding `days` of history."""
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    os.environ["BENTOML_HOME"] = str(root / "bentoml")
    os.environ["TANDEM_DATA_DIR"] = str(root / "data")
    os.environ.setdefault("TANDEM_CODE_VERSION", "bench")
    database_url, drop = _fresh_database(root)
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


def _fresh_database(root: Path) -> tuple[str, Callable[[], None]]:
    admin = os.environ.get("TANDEM_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        import psycopg

        name = f"tandem_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

        def drop() -> None:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

        return admin.rsplit("/", 1)[0] + f"/{name}", drop
    except Exception:  # noqa: BLE001 - no PostgreSQL: the embedded default still benchmarks
        return f"sqlite:///{root / 'bench.db'}", lambda: None


# ---------------------------------------------------------------- raw model
def bench_raw_forward(seconds: float) -> dict[str, Any]:
    import torch

    from inference.features import FeatureBatch
    from inference.model import ModelConfig, RiskModel, score_batch

    torch.manual_seed(0)
    model = RiskModel(ModelConfig()).eval()
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "items_per_second": {}}
    for size in (1, 8, 64, 1024):
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
        results["items_per_second"][str(size)] = done / (time.perf_counter() - started)
    results["parameter_count"] = model.parameter_count
    results["flops_per_item"] = model.flops_per_item()
    _say(f"raw forward items/s: { ({k: round(v) for k, v in results['items_per_second'].items()}) }")
    return results


# ---------------------------------------------------------------- batch path
def bench_batch_path(bench: BenchEnv, partition_rows: list[int]) -> dict[str, Any]:
    from inference.batch import ingest_day
    from inference.demo import DemoConfig, generate_day
    from inference.store import make_engine

    engine = make_engine(bench.database_url)
    runs = {}
    for offset, rows in enumerate(partition_rows):
        day = START_DAY + timedelta(days=30 + offset)
        ingest_day(engine, generate_day(day, DemoConfig(rows_per_day=rows, poison_rate=0.01, accounts=None)), day)
        output = (
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.batch_worker",
                    "--database-url",
                    bench.database_url,
                    "--day",
                    day.isoformat(),
                ],
                cwd=ROOT,
                env=bench.env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        runs[str(rows)] = json.loads(output)
        _say(f"batch partition {rows:,} rows: {runs[str(rows)]}")
    upsert = _bench_upsert(engine)
    engine.dispose()
    return {"partitions": runs, "upsert": upsert, "database": engine.dialect.name}


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
    _say(f"upsert {rows:,} rows on {engine.dialect.name}: { ({k: round(v) for k, v in timings.items()}) }")
    return {"rows": rows, **timings}


# ---------------------------------------------------------------- online path
@dataclass(frozen=True)
class ServiceSpec:
    name: str
    label: str
    argv: Callable[[int], list[str]]
    extra_env: dict[str, str]
    path: str = "/score"


def service_specs() -> list[ServiceSpec]:
    bin_dir = Path(sys.executable).parent
    bentoml = str(bin_dir / "bentoml")
    uvicorn = str(bin_dir / "uvicorn")
    return [
        ServiceSpec(
            "tandem",
            "(1) Tandem",
            lambda p: [bentoml, "serve", "serving.service:RiskScorer", "--port", str(p), "--host", "127.0.0.1"],
            {},
        ),
        ServiceSpec(
            "tandem_unbatched",
            "(2) Tandem, batching off",
            lambda p: [bentoml, "serve", "serving.service:RiskScorer", "--port", str(p), "--host", "127.0.0.1"],
            {"TANDEM_SERVING_MAX_BATCH_SIZE": "1"},
        ),
        ServiceSpec(
            "stock_bentoml",
            "(3) stock BentoML",
            lambda p: [
                bentoml,
                "serve",
                "bench.services.stock_bentoml:StockScorer",
                "--port",
                str(p),
                "--host",
                "127.0.0.1",
            ],
            {},
        ),
        ServiceSpec(
            "drifted",
            "(4) drifted baseline",
            lambda p: [
                uvicorn,
                "bench.services.drifted:app",
                "--port",
                str(p),
                "--host",
                "127.0.0.1",
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            {},
        ),
        ServiceSpec(
            "do_nothing",
            "(5) HTTP ceiling",
            lambda p: [
                uvicorn,
                "bench.services.do_nothing:app",
                "--port",
                str(p),
                "--host",
                "127.0.0.1",
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            {},
        ),
    ]


class RunningService:
    def __init__(self, spec: ServiceSpec, bench: BenchEnv) -> None:
        self.spec = spec
        self.port = _free_port()
        log = (bench.root / f"{spec.name}.log").open("w")
        self.process = subprocess.Popen(
            spec.argv(self.port),
            cwd=ROOT,
            env={**bench.env, **spec.extra_env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}{spec.path}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{spec.name} did not become ready; see {bench.root / f'{spec.name}.log'}")

    def cpu_seconds(self) -> float:
        total = 0.0
        try:
            parent = psutil.Process(self.process.pid)
            for process in [parent, *parent.children(recursive=True)]:
                times = process.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
        return total

    def rss_mb(self) -> float:
        try:
            parent = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)]) / 2**20
        except psutil.Error:
            return float("nan")

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


def request_bodies(bench: BenchEnv, count: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Good single-transaction bodies of known accounts (a day after the stored ones), and poison."""
    from inference.demo import DemoConfig, generate_day

    day = generate_day(START_DAY + timedelta(days=60), DemoConfig(rows_per_day=max(count, 2000), poison_rate=0.05))
    good = day.filter(pl.col("poison_kind").is_null()).head(count)
    poison = day.filter(
        pl.col("poison_kind").is_in(["bad_currency", "unknown_category", "negative_amount", "absurd_amount"])
    )
    columns = ["transaction_id", "account_id", "amount", "currency", "merchant_category", "country", "event_time"]
    return (
        [{"transactions": [row]} for row in good.select(columns).to_dicts()],
        [{"transactions": [row]} for row in poison.select(columns).to_dicts()],
    )


def bench_online(bench: BenchEnv, rates: list[int], seconds: float, quick: bool) -> dict[str, Any]:
    from bench.loadgen import run_load

    good, poison = request_bodies(bench, 20_000)
    everything: dict[str, Any] = {}
    for spec in service_specs():
        service_rates = [r for r in rates if not (spec.name == "drifted" and r > rates[1])]
        _say(f"starting {spec.label}")
        try:
            service = RunningService(spec, bench)
        except RuntimeError as error:
            everything[spec.name] = {"label": spec.label, "error": str(error)}
            _say(str(error))
            continue
        sweep = []
        try:
            # Every request carries a transaction the service has not seen, so no idempotency hit.
            body = _fresh_bodies(good)

            run_load(service.url, 20, 2.0, body)  # warm-up
            for rate in service_rates:
                cpu_before = service.cpu_seconds()
                result = run_load(service.url, rate, seconds, body)
                cpu = service.cpu_seconds() - cpu_before
                summary = result.summary(TARGET_P99_MS) | {
                    "cpu_ms_per_request": cpu * 1000 / max(result.sent, 1),
                    "rss_mb": service.rss_mb(),
                }
                sweep.append(summary)
                _say(
                    f"{spec.name} @ {rate} rps: p50 {summary['p50_ms']:.1f} p99 {summary['p99_ms']:.1f} ms, "
                    f"goodput {summary['goodput_rps']:.0f}, shed {summary['shed']}, "
                    f"timeouts {summary['client_timeouts']}"
                )
            extra: dict[str, Any] = {}
            if spec.name in ("tandem", "stock_bentoml"):

                def mixed(
                    i: int, fresh: Callable[[int], tuple[dict[str, Any], bool]] = body
                ) -> tuple[dict[str, Any], bool]:
                    return (poison[i % len(poison)], True) if i % 50 == 0 else fresh(i)

                mixed_rate = rates[1]
                result = run_load(service.url, mixed_rate, seconds, mixed)
                extra["poison_2pct"] = result.summary(TARGET_P99_MS) | {"offered_rps": mixed_rate}
                _say(f"{spec.name} with 2% poison @ {mixed_rate} rps: collateral failures {result.collateral_failures}")
            if spec.name == "tandem":
                extra["burst_64"] = _burst(service.url, body)
                # Capacity: the best goodput measured; if nothing met the target, the lowest offered load.
                capacity = max((s["goodput_rps"] for s in sweep), default=0.0) or float(service_rates[0])
                overload_rate = int(4 * capacity)
                before = service.rss_mb()
                result = run_load(service.url, overload_rate, seconds, body, timeout_s=5)
                extra["overload_4x"] = result.summary(TARGET_P99_MS) | {
                    "rss_mb_before": before,
                    "rss_mb_after": service.rss_mb(),
                }
                _say(f"overload @ {overload_rate} rps: {extra['overload_4x']}")
            everything[spec.name] = {"label": spec.label, "sweep": sweep, **extra}
        finally:
            service.stop()
        _write(f"online_{spec.name}", everything[spec.name])
    return everything


def _fresh_bodies(good: list[dict[str, Any]]) -> Callable[[int], tuple[dict[str, Any], bool]]:
    sequence = itertools.count()

    def body(_: int) -> tuple[dict[str, Any], bool]:
        n = next(sequence)
        template = good[n % len(good)]["transactions"][0]
        return {"transactions": [{**template, "transaction_id": f"{template['transaction_id']}-{n}"}]}, False

    return body


def _burst(url: str, body: Callable[[int], tuple[dict[str, Any], bool]]) -> dict[str, Any]:
    """64 requests leaving within one millisecond, below capacity on average: none may be shed."""
    from bench.loadgen import run_load

    result = run_load(url, 64_000, 0.001, body)
    summary = result.summary(TARGET_P99_MS)
    _say(f"burst of 64: statuses {summary['statuses']}, p99 {summary['p99_ms']:.1f} ms")
    return summary


# ---------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few minutes: smaller partitions, shorter load")
    parser.add_argument("--batch-only", action="store_true", help="raw forward and the batch path, no services")
    args = parser.parse_args()
    quick = args.quick
    started = time.perf_counter()
    bench = prepare_environment(rows_per_day=2_000 if quick else 5_000, days=3)
    try:
        raw = bench_raw_forward(1.0 if quick else 3.0)
        _write("raw_forward", raw)
        batch = bench_batch_path(bench, [20_000, 100_000] if quick else [100_000, 1_000_000])
        _write("batch_path", batch)
        if args.batch_only:
            return 0
        rates = [50, 100, 200] if quick else [50, 100, 200, 300, 400, 600, 800]
        online = bench_online(bench, rates, 5.0 if quick else 10.0, quick)
        from bench.report import write_report

        write_report(raw, batch, online, TARGET_P99_MS, quick=quick, seconds=time.perf_counter() - started)
        _say(f"report: {ROOT / 'bench' / 'report.md'}")
    finally:
        bench.drop()
        shutil.rmtree(bench.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
