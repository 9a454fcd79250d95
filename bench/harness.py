"""What the bench scenarios share: the environment they run in, the services they start and the
request bodies they send. Below every scenario module (run, shadow, rollout), so that none of them
imports another for these (bench's import contract in pyproject.toml keeps them acyclic).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import psutil

from bench import online_targets
from bench.loadgen import run_load

if TYPE_CHECKING:  # the bench's own modules start without the platform's imports
    from inference.spec import LoadedSpec

ROOT = Path(__file__).resolve().parent.parent
TARGET_P99_MS = float(os.environ.get("TANDEM_SERVING_P99_TARGET_MS", "50"))
START_DAY = date(2026, 11, 1)


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def write_result(out: Path, scenario: str, data: Any) -> None:
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{scenario}.json").write_text(json.dumps(data, indent=2, default=str))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


# ---------------------------------------------------------------- environment
@dataclass
class BenchEnv:
    root: Path
    database_url: str
    env: dict[str, str]
    drop: Callable[[], None]
    model_spec: LoadedSpec  # the spec the services run (TANDEM_MODEL_SPEC): its records are the load


def fresh_database(root: Path) -> tuple[str, Callable[[], None]]:
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


def seed_history(database_url: str, rows_per_day: int, days: int) -> None:
    from inference.batch import ingest_day
    from inference.demo import day_range, demo_day
    from inference.migrate import upgrade
    from inference.spec import DemoSettings, configured_spec
    from inference.store import make_engine

    spec = configured_spec()
    engine = make_engine(database_url)
    upgrade(engine, spec)
    demo = DemoSettings(rows_per_day=rows_per_day, poison_rate=0.01)  # as bench.run.prepare_environment's
    for day in day_range(START_DAY, days):
        ingest_day(spec, engine, demo_day(spec, day, demo), day)
    engine.dispose()


# ---------------------------------------------------------------- services
@dataclass(frozen=True)
class ServiceSpec:
    name: str
    label: str
    argv: Callable[[int], list[str]]
    extra_env: dict[str, str]
    path: str = "/score"
    workers: int = 1
    cwd: Path = ROOT  # the checkout the service runs from


def _bentoml_serve(target: str) -> Callable[[int], list[str]]:
    """`bentoml serve` as `make run` and deploy/ start it: one plain server, no proxy in front."""
    bentoml = str(Path(sys.executable).parent / "bentoml")
    return lambda port: [bentoml, "serve", target, "--port", str(port), "--host", "127.0.0.1"]


def tandem_spec(workers: int = 1) -> ServiceSpec:
    return ServiceSpec(
        "tandem" if workers == 1 else f"tandem_workers_{workers}",
        "Tandem (embedded SQLite, the default)" if workers == 1 else f"Tandem, {workers} workers",
        _bentoml_serve("serving.service:TandemScorer"),
        # Explicit even for 1, so a TANDEM_SERVING_WORKERS in the caller's environment cannot leak in.
        {"TANDEM_SERVING_WORKERS": str(workers)},
        workers=workers,
    )


def baseline_spec(checkout: Path, commit: str, data_dir: Path) -> ServiceSpec:
    """The baseline commit's code, served from its own checkout as its own bench started it
    (`bentoml serve serving.service:RiskScorer`, one worker), its packages first on the path, its
    embedded database and local state under `data_dir`."""
    return ServiceSpec(
        "baseline",
        f"{online_targets.baseline_label(commit)}, embedded SQLite",
        _bentoml_serve("serving.service:RiskScorer"),
        {"TANDEM_SERVING_WORKERS": "1", "PYTHONPATH": str(checkout), "TANDEM_DATA_DIR": str(data_dir)},
        cwd=checkout,
    )


def on_postgres(spec: ServiceSpec, database_url: str, data_dir: Path) -> ServiceSpec:
    """`spec` on PostgreSQL: its own database and local state (the outbox)."""
    env = {**spec.extra_env, "DATABASE_URL": database_url, "TANDEM_DATA_DIR": str(data_dir)}
    label = spec.label.replace("embedded SQLite, the default", "PostgreSQL").replace("embedded SQLite", "PostgreSQL")
    return ServiceSpec(f"{spec.name}_postgres", label, spec.argv, env, spec.path, spec.workers, spec.cwd)


def tandem_postgres_spec(database_url: str, data_dir: Path) -> ServiceSpec:
    return on_postgres(tandem_spec(), database_url, data_dir)


def service_specs() -> list[ServiceSpec]:
    """Tandem, stock BentoML and the do-nothing ceiling; the baseline and the PostgreSQL
    variants are added by the online scenario."""
    bin_dir = Path(sys.executable).parent

    def uvicorn(app: str) -> Callable[[int], list[str]]:
        return lambda port: [
            *(str(bin_dir / "uvicorn"), app, "--port", str(port), "--host", "127.0.0.1"),
            *("--log-level", "warning", "--no-access-log"),
        ]

    return [
        tandem_spec(),
        ServiceSpec("stock_bentoml", "stock BentoML", _bentoml_serve("bench.services.stock_bentoml:StockScorer"), {}),
        ServiceSpec("do_nothing", "HTTP ceiling (do-nothing)", uvicorn("bench.services.do_nothing:app"), {}),
    ]


# BentoML logs this once per server process, after its __init__ (model load and warm-up) returns.
_WORKER_STARTED = re.compile(r"\[entry_service:[^\]]*:(\d+)\] Service \S+ initialized")


def _answers_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # refused, 503 (HTTPError) or timed out: not ready yet
        return False


def _started_workers(log: Path) -> int:
    return len(set(_WORKER_STARTED.findall(log.read_text(errors="replace"))))


def wait_until_ready(
    process: subprocess.Popen[bytes], port: int, log: Path, *, workers: int = 1, timeout_s: float = 180
) -> None:
    """Return once the server answers /readyz and, with several workers, every worker has started.

    One 200 proves only the worker that accepted the connection; the others may still be loading
    their model, and a sweep started then would measure fewer workers than it names. So with
    several workers, BentoML's log has to show each of them started as well.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with status {process.returncode} before it was ready; see {log}")
        if _answers_ready(f"http://127.0.0.1:{port}/readyz") and (workers == 1 or _started_workers(log) >= workers):
            return
        time.sleep(0.5)
    raise RuntimeError(f"not ready within {timeout_s:.0f} s; see {log}")


class RunningService:
    def __init__(self, spec: ServiceSpec, bench: BenchEnv) -> None:
        self.spec = spec
        self.port = free_port()
        log = bench.root / f"{spec.name}.log"
        with log.open("w") as sink:
            self.process = subprocess.Popen(
                spec.argv(self.port),
                cwd=spec.cwd,
                env={**bench.env, **spec.extra_env},
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}{spec.path}"
        try:
            wait_until_ready(self.process, self.port, log, workers=spec.workers)
        except RuntimeError as error:
            self.stop()
            raise RuntimeError(f"{spec.name}: {error}") from error

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


def start_service(spec: ServiceSpec, bench: BenchEnv) -> RunningService | str:
    """The running service, or why it did not start."""
    say(f"starting {spec.label}")
    try:
        return RunningService(spec, bench)
    except RuntimeError as error:
        say(str(error))
        return str(error)


def request_bodies(bench: BenchEnv, count: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Single-record bodies of the spec's demo a day after the stored ones: good records (of known
    entities, where the spec has one), and poison, records validation refuses."""
    from inference.demo import demo_day
    from inference.records import validate
    from inference.spec import DemoSettings

    ls = bench.model_spec
    day = START_DAY + timedelta(days=60)
    # A window of that one day: a demo that spreads a fixed set of records over its window lands them all.
    settings = DemoSettings(start=day, days=1, rows_per_day=max(count, 2000), poison_rate=0.05)
    records = demo_day(ls, day, settings).select(ls.field_names)
    good = records.filter(validate(ls, records)["reject_reason"].is_null())
    return (
        [{ls.spec.plural: [row]} for row in good.head(count).to_dicts()],
        [{ls.spec.plural: [row]} for row in poison_records(ls, good).to_dicts()],
    )


def poison_records(ls: LoadedSpec, good: pl.DataFrame) -> pl.DataFrame:
    """Good records broken by the generic poison (`inference.spec.poison`), each alone in its
    request; a duplicated id is kept out, as alone it is a good record."""
    from inference.spec import POISON_REASON, GenericReason, poison

    broken = poison(good, ls, np.random.default_rng(0), rate=0.05)
    reason = pl.col(POISON_REASON)
    return broken.filter(reason.is_not_null() & (reason != GenericReason.DUPLICATE_ID.value)).select(ls.field_names)


Body = Callable[[int], tuple[dict[str, Any], bool]]


def settle(service: RunningService, body: Body, *, limit_s: float = 90.0) -> float:
    """Wait until a single request is answered within a second again: a service with an unbounded
    queue is still working off the previous load level, which would otherwise be charged to the
    next one. Returns the seconds waited (the backlog's drain time)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        probe = run_load(service.url, 1, 1.0, body, timeout_s=limit_s)
        if probe.latencies_ms and probe.latencies_ms[0] < 1000:
            break
    return time.monotonic() - started


def fresh_bodies(ls: LoadedSpec, good: list[dict[str, Any]], run: str) -> Body:
    """Every request a record no service of this run has seen: neither an idempotency hit nor,
    since services share the database, a cheaper no-op upsert of a row an earlier service wrote."""
    sequence = itertools.count()
    plural, id_name = ls.spec.plural, ls.id.name

    def body(_: int) -> tuple[dict[str, Any], bool]:
        n = next(sequence)
        template = good[n % len(good)][plural][0]
        return {plural: [{**template, id_name: f"{template[id_name]}-{run}-{n}"}]}, False

    return body
