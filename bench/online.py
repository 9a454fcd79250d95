"""The online scenario of `make bench`: the do-nothing ceiling, stock BentoML, Tandem and the
baseline (the code before issue 46, `online_targets.BASELINE_COMMIT`), in rounds, Tandem and the
baseline on the embedded default and on PostgreSQL; then Tandem past its capacity, deployed as
`deploy/` ships it (one plain `bentoml serve`), and more server processes.

Each round starts every service afresh and runs its sweep; the ceiling goes first, so every level
of the round is checked against the ceiling's p99 at the same rate in the same round. Tandem and
the baseline swap places from one round to the next, so a machine that drifts during a round
favours neither. The judging is in `bench.online_targets`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import baseline, online_targets
from bench.harness import (
    ROOT,
    TARGET_P99_MS,
    BenchEnv,
    Body,
    RunningService,
    ServiceSpec,
    baseline_spec,
    fresh_bodies,
    fresh_database,
    on_postgres,
    say,
    seed_history,
    service_specs,
    settle,
    start_service,
    tandem_spec,
    write_result,
)
from bench.loadgen import run_burst_under_load, run_load

# A sweep stops after this many levels in a row missed the target: more load only queues longer.
STOP_AFTER_MISSES = 2
# Stock BentoML also runs below the common sweep: it may miss the target at 50 rps already.
STOCK_LOW_RATES = [25, 50]
BURST_BACKGROUND_S = 4.0  # the background load the 64-request burst lands in the middle of
OVERLOAD_TIMEOUT_S = 5.0  # the client timeout of the overload runs ("0 timeouts" is against this)
# The order within a round; each (Tandem, baseline) pair swaps places every other round.
ROUND_ORDER = ("do_nothing", "stock_bentoml", "tandem", "baseline", "tandem_postgres", "baseline_postgres")


# ---------------------------------------------------------------- one service over the rates
def sweep(
    service: RunningService, rates: list[int], seconds: float, body: Body, *, stop_after_misses: int | None = None
) -> list[dict[str, Any]]:
    """A warm-up, then one open-loop run per offered load, with the service's CPU and memory;
    each level starts once the previous one's backlog is gone. With `stop_after_misses`, the sweep
    ends once that many levels in a row missed the p99 target."""
    run_load(service.url, 20, 2.0, body)
    levels: list[dict[str, Any]] = []
    for rate in rates:
        if stop_after_misses and online_targets.missed_in_a_row(levels, TARGET_P99_MS, stop_after_misses):
            say(f"{service.spec.name}: {stop_after_misses} levels in a row missed the target, stops before {rate} rps")
            break
        drained_s = settle(service, body)
        cpu_before = service.cpu_seconds()
        result = run_load(service.url, rate, seconds, body)
        cpu = service.cpu_seconds() - cpu_before
        summary = result.summary(TARGET_P99_MS) | {
            "cpu_ms_per_request": cpu * 1000 / max(result.sent, 1),
            "cpu_ms_per_served": cpu * 1000 / max(len(result.latencies_ms), 1),
            "rss_mb": service.rss_mb(),
            "previous_backlog_drain_s": round(drained_s, 1),
        }
        levels.append(summary)
        say(
            f"{service.spec.name} @ {rate} rps: p50 {summary['p50_ms']:.1f} p99 {summary['p99_ms']:.1f} ms, "
            f"goodput {summary['goodput_rps']:.0f}, shed {summary['shed']}, "
            f"timeouts {summary['client_timeouts']}, conn errors {summary['connection_errors']}, "
            f"CPU {summary['cpu_ms_per_served']:.2f} ms/served, "
            f"RSS {summary['rss_mb']:.0f} MB, generator {summary['generator_cores']:.2f} cores"
        )
    return levels


# ---------------------------------------------------------------- environment and services
def online_environment(bench: BenchEnv, rows_per_day: int, days: int) -> tuple[BenchEnv, str | None]:
    """The online services' own databases, apart from the batch path's, holding the same history:
    the embedded default (no DATABASE_URL: a SQLite file under TANDEM_DATA_DIR), and a fresh
    PostgreSQL database for the PostgreSQL services (None when no PostgreSQL is reachable). The
    returned environment's `drop` drops the PostgreSQL one."""
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
    return BenchEnv(bench.root, sqlite_url, env, drop, bench.model_spec), postgres_url


def _specs(
    bench: BenchEnv, postgres_url: str | None, checkout: Path | str, commit: str, drops: list[Callable[[], None]]
) -> dict[str, ServiceSpec | str]:
    """Every service of the rounds by name, or why it cannot run. The baseline's databases are
    copies of Tandem's records at its own schema (`baseline.copy_records`); `drops` gets theirs."""
    root = bench.root
    specs: dict[str, ServiceSpec | str] = {spec.name: spec for spec in service_specs()}
    if isinstance(checkout, str):
        specs["baseline"] = checkout
    else:
        data_dir = root / "online_baseline"
        data_dir.mkdir(parents=True, exist_ok=True)
        sqlite_url = f"sqlite:///{(data_dir / 'tandem.db').resolve()}"  # as its TandemSettings resolves it
        baseline.copy_records(bench.model_spec, bench.database_url, sqlite_url, checkout)
        specs["baseline"] = baseline_spec(checkout, commit, data_dir)
    for name in ("tandem", "baseline"):
        spec = specs[name]
        if postgres_url is None:
            specs[f"{name}_postgres"] = "no PostgreSQL reachable"
        elif isinstance(spec, str):
            specs[f"{name}_postgres"] = spec
        else:
            url = postgres_url
            if name == "baseline" and isinstance(checkout, Path):
                url, drop = baseline.database(bench.model_spec, postgres_url, checkout, root / "online_baseline_pg")
                drops.append(drop)
            specs[f"{name}_postgres"] = on_postgres(spec, url, root / f"online_{name}_postgres")
    return specs


def _label(name: str, spec: ServiceSpec | str, commit: str) -> str:
    if isinstance(spec, ServiceSpec):
        return spec.label
    store = "PostgreSQL" if name.endswith("_postgres") else "embedded SQLite"
    return f"{online_targets.baseline_label(commit)}, {store}" if "baseline" in name else name


def _entry(name: str, spec: ServiceSpec | str, commit: str) -> dict[str, Any]:
    """A service's results before its first round: its rounds to come, or why it has none."""
    if isinstance(spec, str):
        return {"label": _label(name, spec, commit), "error": spec}
    return {"label": spec.label, "rounds": []}


def round_order(index: int) -> list[str]:
    """The services of round `index`, in the order they run."""
    order = list(ROUND_ORDER)
    if index % 2:
        for pair in (("tandem", "baseline"), ("tandem_postgres", "baseline_postgres")):
            i, j = order.index(pair[0]), order.index(pair[1])
            order[i], order[j] = order[j], order[i]
    return order


# ---------------------------------------------------------------- the scenario
def bench_online(
    bench: BenchEnv,
    out: Path,
    rates: list[int],
    seconds: float,
    rounds: int,
    good: list[dict[str, Any]],
    poison: list[dict[str, Any]],
    postgres_url: str | None = None,
    commit: str = online_targets.BASELINE_COMMIT,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every service in `rounds` rounds over `rates`, Tandem past its capacity in the last round,
    and the ceiling again over the rates that chose; returns every result (marked) and the verdicts."""
    drops: list[Callable[[], None]] = []
    with baseline.checkout(commit, bench.root) as checkout:
        try:
            specs = _specs(bench, postgres_url, checkout, commit, drops)
            online: dict[str, Any] = {name: _entry(name, specs[name], commit) for name in ROUND_ORDER}
            for index in range(rounds):
                say(f"-- round {index + 1} of {rounds}")
                for name in round_order(index):
                    spec = specs[name]
                    if isinstance(spec, ServiceSpec):
                        last = index == rounds - 1
                        _service_round(bench, online, spec, index, rates, seconds, good, poison, last=last)
        finally:
            for drop in drops:
                drop()
    _ceiling_again(bench, online, good, seconds)
    online_targets.mark_online(online)
    for name, service in online.items():
        if "rounds" in service:
            service["capacity_rps"] = online_targets.median_capacity(service, TARGET_P99_MS)
        write_result(out, f"online_{name}", service)
    verdicts = online_targets.judge(online, TARGET_P99_MS, online_targets.package_size(ROOT / "serving"), commit)
    write_result(out, "online_targets", verdicts)
    for t in verdicts["targets"]:
        say(f"target {t['target']} ({t['threshold']}): {t['verdict']} ({t['measured']})")
    return online, verdicts


def _service_round(
    bench: BenchEnv,
    online: dict[str, Any],
    spec: ServiceSpec,
    index: int,
    rates: list[int],
    seconds: float,
    good: list[dict[str, Any]],
    poison: list[dict[str, Any]],
    *,
    last: bool,
) -> None:
    """One service's round: a fresh start, its sweep; in the first round the poison mix, in the
    last Tandem's runs past capacity, on the same process."""
    entry = online[spec.name]
    service = start_service(spec, bench)
    if isinstance(service, str):
        entry["rounds"].append({"error": service})
        return
    try:
        body = fresh_bodies(bench.model_spec, good, f"{spec.name}-{index}")
        if index == 0 and spec.name in ("tandem", "stock_bentoml"):
            entry["poison_2pct"] = _poison(service, body, poison, online_targets.LIGHT_LOAD_RPS, seconds)
        service_rates = {
            "do_nothing": sorted({*STOCK_LOW_RATES, *rates}),
            "stock_bentoml": sorted({*STOCK_LOW_RATES, *rates}),
        }.get(spec.name, rates)
        stop = None if spec.name == "do_nothing" else STOP_AFTER_MISSES
        levels = sweep(service, service_rates, seconds, body, stop_after_misses=stop)
        entry["rounds"].append({"sweep": levels, "loadavg_1m": os.getloadavg()[0]})
        if last and spec.name in online_targets.DEPLOYED:
            entry["past_capacity"] = _past_capacity(service, body, online, seconds)
    finally:
        service.stop()


def _poison(
    service: RunningService, body: Body, poison: list[dict[str, Any]], rate: int, seconds: float
) -> dict[str, Any]:
    """2% poison among good requests, on the fresh service: after a sweep an unbounded queue may
    still be working off its overload, and the good requests' failures would not be poison's."""
    run_load(service.url, 20, 2.0, body)

    def mixed(i: int) -> tuple[dict[str, Any], bool]:
        return (poison[i % len(poison)], True) if i % 50 == 0 else body(i)

    result = run_load(service.url, rate, seconds, mixed)
    say(f"{service.spec.name} with 2% poison @ {rate} rps: collateral failures {result.collateral_failures}")
    return result.summary(TARGET_P99_MS) | {"offered_rps": rate}


# ---------------------------------------------------------------- past capacity
def _past_capacity(service: RunningService, body: Body, online: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The burst at 30% load and the overload runs, at rates set by the median capacity over the
    rounds so far (their usable levels only); the lowest rate when no round measured one."""
    online_targets.mark_online(online)
    rounds = online[service.spec.name]["rounds"]
    measured = online_targets.median_capacity(online[service.spec.name], TARGET_P99_MS)
    lowest = min((s["offered_rps"] for r in rounds for s in r.get("sweep", [])), default=50.0)
    capacity = float(measured) if measured else float(lowest)
    say(f"{service.spec.name} capacity at p99 <= {TARGET_P99_MS:.0f} ms, median of the rounds: {capacity:.0f} rps")
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
        f"statuses {burst_64['burst']['statuses']}, p99 {burst_64['burst']['p99_ms']:.1f} ms"
    )
    overload = {}
    for factor, rate in online_targets.overload_rates(capacity).items():
        settle(service, body)
        before = service.rss_mb()
        result = run_load(service.url, rate, seconds, body, timeout_s=OVERLOAD_TIMEOUT_S)
        o = overload[factor] = result.summary(TARGET_P99_MS) | {
            "client_timeout_s": OVERLOAD_TIMEOUT_S,
            "rss_mb_before": before,
            "rss_mb_after": service.rss_mb(),
        }
        say(
            f"{service.spec.name}: overload {factor} @ {rate} rps: "
            f"accepted p99 {o['p99_ms']:.1f} ms, goodput {o['goodput_rps']:.0f}, statuses {o['statuses']}, "
            f"{o['shed_without_retry_after']} refusals without Retry-After, "
            f"RSS {o['rss_mb_before']:.0f} -> {o['rss_mb_after']:.0f} MB, generator {o['generator_cores']:.2f} cores"
        )
    return {
        "capacity_rps": capacity,
        "capacity_source": "median of the rounds" if measured else "the lowest rate: no round met the target",
        "burst_64": burst_64,
        "overload": overload,
    }


def _ceiling_again(bench: BenchEnv, online: dict[str, Any], good: list[dict[str, Any]], seconds: float) -> None:
    """The do-nothing ceiling over the rates the past-capacity runs chose (overload, burst
    background), and the same bursts, kept as its `again` reading."""
    ceiling = online.get("do_nothing", {})
    runs = [
        online[name]["past_capacity"] for name in online_targets.DEPLOYED if "past_capacity" in online.get(name, {})
    ]
    if "rounds" not in ceiling or not runs:
        return
    rates = sorted(
        {
            online_targets.rate_key(r)
            for run in runs
            for r in (run["burst_64"]["background_rps"], *(o["offered_rps"] for o in run["overload"].values()))
        }
    )
    spec = next(s for s in service_specs() if s.name == "do_nothing")
    service = start_service(spec, bench)
    if isinstance(service, str):
        ceiling["again"] = {"error": service}
        return
    bursts: dict[str, dict[str, Any]] = {}
    try:
        body = fresh_bodies(bench.model_spec, good, "do_nothing_again")
        levels = sweep(service, rates, seconds, body)
        for background_rps in dict.fromkeys(run["burst_64"]["background_rps"] for run in runs):
            settle(service, body)
            background, burst = run_burst_under_load(
                service.url, background_rps, BURST_BACKGROUND_S, online_targets.BURST_SIZE, body
            )
            bursts[str(background_rps)] = {
                "background": background.summary(TARGET_P99_MS),
                "burst": burst.summary(TARGET_P99_MS),
            }
    finally:
        service.stop()
    ceiling["again"] = {"sweep": levels, "bursts": bursts}
    for run in runs:
        background_rps = run["burst_64"]["background_rps"]
        run["burst_64"]["ceiling_burst_p99_ms"] = bursts[str(background_rps)]["burst"]["p99_ms"]
        say(f"ceiling, same burst over {background_rps} rps: p99 {run['burst_64']['ceiling_burst_p99_ms']:.1f} ms")


# ---------------------------------------------------------------- server processes
def bench_workers(
    bench: BenchEnv,
    out: Path,
    rates: list[int],
    seconds: float,
    good: list[dict[str, Any]],
    worker_counts: list[int],
    tandem: dict[str, Any],
    ceiling: dict[int, float],
) -> dict[str, Any]:
    """Tandem over the same sweep with more server processes; the 1-worker entry is the first
    round of `tandem` (the online scenario's, already marked). The other levels are marked against
    `ceiling` (the ceiling's worst p99 by rate); goodput counts the usable ones only."""
    counts: dict[str, Any] = {}
    for workers in worker_counts:
        if workers == 1:
            first = next(iter(tandem.get("rounds", [])), {"error": tandem.get("error", "no sweep")})
            entry: dict[str, Any] = {"source": "online_tandem.json, round 1"} | (
                {"sweep": first["sweep"]} if "sweep" in first else {"error": first.get("error", "no sweep")}
            )
        else:
            entry = _workers_run(bench, workers, rates, seconds, good)
        if "sweep" in entry:
            levels = entry["sweep"]
            if workers != 1:
                for level in levels:
                    online_targets.mark(level, ceiling)
            entry |= {
                "goodput_rps": online_targets.goodput_at_target(levels, TARGET_P99_MS) or 0.0,
                "p99_ms_by_rate": {str(int(s["offered_rps"])): s["p99_ms"] for s in levels},
                "rss_mb_peak": max((s["rss_mb"] for s in levels), default=float("nan")),
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


def _workers_run(
    bench: BenchEnv, workers: int, rates: list[int], seconds: float, good: list[dict[str, Any]]
) -> dict[str, Any]:
    spec = tandem_spec(workers)
    service = start_service(spec, bench)
    if isinstance(service, str):
        return {"error": service}
    try:
        idle_rss = service.rss_mb()
        body = fresh_bodies(bench.model_spec, good, spec.name)
        return {
            "rss_mb_idle": idle_rss,
            "sweep": sweep(service, rates, seconds, body, stop_after_misses=STOP_AFTER_MISSES),
        }
    finally:
        service.stop()
