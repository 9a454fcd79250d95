"""What shadow scoring a challenger costs the champion: p99 and goodput at 0%, 10% and 100% sampling.

`python -m bench.shadow [--quick]` (or `python -m bench.run --shadow-only`; the full `bench.run`
runs it after the other online scenarios). One Tandem service on the embedded default (SQLite), a
champion in production and a second, untrained version as the challenger (`modelstore.challenge`),
driven open loop at fixed rates: about 50% and 90% of the champion's capacity at the p99 target.

The sample is a server setting (TANDEM_SERVING_SHADOW_SAMPLE), so every setting is a service
restart. The settings alternate (0, 0.1, 1.0, 0, 0.1, 1.0, ...) and each one's figures are the
median over its repeats; every repeat is kept, so the machine's run-to-run noise is in the result
rather than averaged away. The do-nothing ceiling runs the same rates before and after, so a level
the load generator itself could not hold is marked (`online_targets.mark`).

The issue's target, judged here: zero effect on the champion's p99 at 10%. "Met" only where the
10% median p99 stays within the spread (max) of the 0% repeats at every usable rate; with one
repeat there is no spread, and the verdict is "not measurable".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import online_targets
from bench.challenger import (
    Metrics,
    metric_sum,
    register_untrained,
    scrape,
    wait_for_challenger,
)
from bench.harness import (
    ROOT,
    TARGET_P99_MS,
    BenchEnv,
    RunningService,
    fresh_bodies,
    minutes,
    request_bodies,
    say,
    seed_history,
    service_specs,
    settle,
    start_service,
    tandem_spec,
    write_result,
)
from bench.loadgen import run_load
from bench.rollout import RolloutPlan, judge_rollout, rollout_run

SAMPLES = (0.0, 0.1, 1.0)
RATE_SHARES = (0.5, 0.9)  # of the champion's capacity at the p99 target
DEFAULT_CAPACITY_RPS = 400.0  # when no earlier online_targets.json says otherwise
SHADOW_IDLE_S = 10.0  # after a level: how long the shadow queue may take to empty
TEN_PERCENT = 0.1


@dataclass(frozen=True)
class ShadowPlan:
    quick: bool
    rounds: int
    load_seconds: float
    rows_per_day: int
    history_days: int

    @classmethod
    def for_mode(cls, quick: bool) -> ShadowPlan:
        # Full: 3 rounds x 3 settings = 9 service starts (~45 s each) and the ceiling twice; ~8 min.
        return cls(True, 1, 5.0, 2_000, 3) if quick else cls(False, 3, 8.0, 5_000, 3)

    def estimate_s(self) -> float:
        per_level = self.load_seconds + 3.0  # settle, replies in flight, the shadow queue emptying
        service = 20.0 + 2.0 + len(RATE_SHARES) * per_level  # start, warm-up load, levels
        challenger = 6.0  # the pointer poll (2 s) and the challenger's own start
        ceiling = 2 * (5.0 + 2.0 + len(RATE_SHARES) * per_level)
        rollout = RolloutPlan.for_mode(self.quick).estimate_s()
        return self.rounds * len(SAMPLES) * (service + challenger * 2 / 3) + ceiling + rollout


# ---------------------------------------------------------------- environment
def standalone_environment(rows_per_day: int, days: int) -> BenchEnv:
    """What `bench.run` prepares for its online services, without the batch path's database: a
    temporary model store with a champion in production, and a SQLite file holding the history."""
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-shadow-"))
    data_dir = root / "online"
    data_dir.mkdir(parents=True)
    os.environ["BENTOML_HOME"] = str(root / "bentoml")
    os.environ["TANDEM_DATA_DIR"] = str(data_dir)
    os.environ.setdefault("TANDEM_CODE_VERSION", "bench")
    os.environ.pop("DATABASE_URL", None)  # the embedded default, as the main Tandem bench
    sqlite_url = f"sqlite:///{(data_dir / 'tandem.db').resolve()}"
    seed_history(sqlite_url, rows_per_day, days)
    from inference.spec import configured_spec
    from tandem import modelstore

    ls = configured_spec()
    modelstore.promote(register_untrained(ls, 0))
    return BenchEnv(root, sqlite_url, dict(os.environ), lambda: None, ls)


def last_capacity(results: Path = ROOT / "bench" / "results" / "online_targets.json") -> tuple[float, str]:
    """The champion's goodput at the target from the last committed full run, and where it came from."""
    try:
        measured = json.loads(results.read_text())["goodput_at_target_rps"]["tandem"]
    except (OSError, KeyError, TypeError, ValueError):
        return DEFAULT_CAPACITY_RPS, "default (no earlier online_targets.json)"
    if not measured:
        return DEFAULT_CAPACITY_RPS, "default (the last run measured none)"
    return float(measured), f"{results.relative_to(ROOT)} (the last full run)"


def rates_for(capacity_rps: float) -> list[int]:
    return [int(round(share * capacity_rps / 10) * 10) for share in RATE_SHARES]


# ---------------------------------------------------------------- /metrics
def _by_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for (n, ls), v in metrics.items():
        key = dict(ls).get(label)
        if n == name and key is not None:
            values[key] = values.get(key, 0.0) + v
    return values


def shadow_counters(before: Metrics, after: Metrics) -> dict[str, Any]:
    """What one level added to the shadow counters."""

    def delta(name: str, label: str) -> dict[str, int]:
        first, last = _by_label(before, name, label), _by_label(after, name, label)
        return {key: round(last[key] - first.get(key, 0.0)) for key in sorted(last)}

    items = delta("tandem_shadow_items_total", "outcome")
    count = metric_sum(after, "tandem_shadow_latency_seconds_count") - metric_sum(
        before, "tandem_shadow_latency_seconds_count"
    )
    total = metric_sum(after, "tandem_shadow_latency_seconds_sum") - metric_sum(
        before, "tandem_shadow_latency_seconds_sum"
    )
    return {
        "sampled": sum(items.values()),
        "scored": items.get("scored", 0),
        "dropped": items.get("dropped", 0),
        "dropped_by_reason": {k: v for k, v in delta("tandem_shadow_dropped_total", "reason").items() if v},
        "mean_shadow_latency_ms": total / count * 1000 if count else float("nan"),
    }


def wait_shadow_idle(port: int, timeout_s: float = SHADOW_IDLE_S) -> tuple[Metrics, bool]:
    """Once the shadow queue is empty and its counters stood still between two scrapes: the
    counters, and whether that happened within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    previous: Metrics | None = None
    while True:
        now = scrape(port)
        idle = metric_sum(now, "tandem_shadow_queue_depth") == 0
        if (
            idle
            and previous is not None
            and metric_sum(now, "tandem_shadow_items_total") == metric_sum(previous, "tandem_shadow_items_total")
        ):
            return now, True
        if time.monotonic() > deadline:
            return now, False
        previous = now
        time.sleep(0.3)


# ---------------------------------------------------------------- one service, one setting
def _errors_5xx(statuses: dict[str, int]) -> int:
    """5xx answers other than the 503 of shedding (those are counted as shed)."""
    return sum(n for code, n in statuses.items() if code.startswith("5") and code != "503")


def _levels(
    service: RunningService, rates: list[int], seconds: float, body: Any, *, shadowing: bool
) -> list[dict[str, Any]]:
    run_load(service.url, 20, 2.0, body)  # warm-up, as `_sweep`
    levels = []
    for rate in rates:
        settle(service, body)
        before, _ = wait_shadow_idle(service.port) if shadowing else ({}, True)
        cpu_before = service.cpu_seconds()
        result = run_load(service.url, rate, seconds, body)
        cpu = service.cpu_seconds() - cpu_before
        level = result.summary(TARGET_P99_MS) | {
            "errors_5xx": _errors_5xx(result.statuses),
            "cpu_ms_per_request": cpu * 1000 / max(result.sent, 1),
            "rss_mb": service.rss_mb(),
            "loadavg_1m": os.getloadavg()[0],
        }
        if shadowing:
            after, settled = wait_shadow_idle(service.port)
            level["shadow"] = shadow_counters(before, after) | {"settled": settled}
        levels.append(level)
        shadow = level.get("shadow")
        say(
            f"{service.spec.name} @ {rate} rps: p50 {level['p50_ms']:.1f} p99 {level['p99_ms']:.1f} ms, "
            f"goodput {level['goodput_rps']:.0f}, shed {level['shed']}, 5xx {level['errors_5xx']}, "
            f"CPU {level['cpu_ms_per_request']:.2f} ms/req"
            + (
                f"; shadow sampled {shadow['sampled']}, scored {shadow['scored']}, "
                f"dropped {shadow['dropped_by_reason']}"
                if shadow
                else ""
            )
        )
    return levels


def _shadow_run(
    bench: BenchEnv, sample: float, round_: int, rates: list[int], seconds: float, good: list[dict[str, Any]], tag: str
) -> dict[str, Any]:
    base = tandem_spec()
    spec = type(base)(
        f"shadow_{sample:g}",
        f"Tandem, shadow sample {sample:g}",
        base.argv,
        {**base.extra_env, "TANDEM_SERVING_SHADOW_SAMPLE": str(sample)},
    )
    run: dict[str, Any] = {"round": round_, "sample": sample, "loadavg_1m_at_start": os.getloadavg()[0]}
    service = start_service(spec, bench)
    if isinstance(service, str):
        return run | {"error": service}
    try:
        if sample > 0:
            run["challenger_ready_s"] = round(wait_for_challenger(service, tag), 1)
            say(f"challenger {tag} shadowing after {run['challenger_ready_s']} s")
        body = fresh_bodies(bench.model_spec, good, f"shadow-{round_}-{sample:g}")
        run["levels"] = _levels(service, rates, seconds, body, shadowing=sample > 0)
    except RuntimeError as error:
        say(f"{spec.name}: {error}")
        run["error"] = str(error)
    finally:
        service.stop()
    return run


def _ceiling_run(bench: BenchEnv, rates: list[int], seconds: float, good: list[dict[str, Any]], n: int) -> Any:
    spec = next(s for s in service_specs() if s.name == "do_nothing")
    service = start_service(spec, bench)
    if isinstance(service, str):
        return {"error": service}
    try:
        return {
            "levels": _levels(
                service, rates, seconds, fresh_bodies(bench.model_spec, good, f"shadow-ceiling-{n}"), shadowing=False
            )
        }
    finally:
        service.stop()


# ---------------------------------------------------------------- the scenario
def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else float("nan")


def summarise(runs: list[dict[str, Any]], rates: list[int]) -> dict[str, dict[str, Any]]:
    """Per setting and rate: every repeat's figures and their median; the shadow counters summed."""
    settings: dict[str, dict[str, Any]] = {}
    for sample in SAMPLES:
        repeats = [r for r in runs if r["sample"] == sample and "levels" in r]
        per_rate: dict[str, Any] = {}
        for index, rate in enumerate(rates):
            levels = [r["levels"][index] for r in repeats]
            entry: dict[str, Any] = {
                "repeats": len(levels),
                "p50_ms_runs": [lv["p50_ms"] for lv in levels],
                "p99_ms_runs": [lv["p99_ms"] for lv in levels],
                "goodput_rps_runs": [lv["goodput_rps"] for lv in levels],
                "p50_ms": _median([lv["p50_ms"] for lv in levels]),
                "p99_ms": _median([lv["p99_ms"] for lv in levels]),
                "goodput_rps": _median([lv["goodput_rps"] for lv in levels]),
                "cpu_ms_per_request": _median([lv["cpu_ms_per_request"] for lv in levels]),
                "shed": sum(lv["shed"] for lv in levels),
                "errors_5xx": sum(lv["errors_5xx"] for lv in levels),
                "client_timeouts": sum(lv["client_timeouts"] for lv in levels),
                "connection_errors": sum(lv["connection_errors"] for lv in levels),
                "generator_limited": any(lv.get("generator_limited", True) for lv in levels),
                "loadavg_1m_runs": [round(lv["loadavg_1m"], 1) for lv in levels],
            }
            shadows = [lv["shadow"] for lv in levels if "shadow" in lv]
            if shadows:
                reasons: dict[str, int] = {}
                for s in shadows:
                    for reason, n in s["dropped_by_reason"].items():
                        reasons[reason] = reasons.get(reason, 0) + n
                entry["shadow"] = {
                    "sampled": sum(s["sampled"] for s in shadows),
                    "scored": sum(s["scored"] for s in shadows),
                    "dropped": sum(s["dropped"] for s in shadows),
                    "dropped_by_reason": reasons,
                    "ok_answers": sum(lv["ok"] for lv in levels),
                    "mean_shadow_latency_ms": _median([s["mean_shadow_latency_ms"] for s in shadows]),
                    "settled": all(s["settled"] for s in shadows),
                }
            per_rate[str(rate)] = entry
        settings[f"{sample:g}"] = per_rate
    return settings


def judge(settings: dict[str, dict[str, Any]], rates: list[int]) -> dict[str, Any]:
    """The issue's target: zero effect on the champion's p99 at 10% sampling, judged per rate as
    the 10% median p99 within the spread (at most the max) of the 0% repeats."""
    name = f"shadow sampling at {TEN_PERCENT:.0%}: zero effect on the champion's p99"
    by_rate: dict[str, Any] = {}
    parts = []
    for rate in map(str, rates):
        base, ten, full = settings["0"].get(rate, {}), settings["0.1"].get(rate, {}), settings["1"].get(rate, {})
        baseline = [v for v in base.get("p99_ms_runs", []) if not math.isnan(v)]
        limited = base.get("generator_limited", True) or ten.get("generator_limited", True)
        head = f"{rate} rps" + (" (generator-limited)" if limited else "")
        if not baseline or not ten.get("repeats"):
            by_rate[rate] = online_targets.NOT_MEASURABLE
            parts.append(f"{head}: did not run")
            continue
        spread = (min(baseline), max(baseline))
        shown = (
            f"{head}: 10% p99 {ten['p99_ms']:.1f} ms (runs {', '.join(f'{v:.1f}' for v in ten['p99_ms_runs'])}) "
            f"vs 0% {base['p99_ms']:.1f} ms (spread {spread[0]:.1f}-{spread[1]:.1f}); "
            f"100% {full.get('p99_ms', float('nan')):.1f} ms"
        )
        if limited:
            by_rate[rate] = online_targets.NOT_MEASURABLE
            parts.append(shown)
        elif len(baseline) < 2:
            by_rate[rate] = online_targets.NOT_MEASURABLE
            parts.append(shown + " (one baseline repeat: no spread)")
        else:
            by_rate[rate] = online_targets.MET if ten["p99_ms"] <= spread[1] else online_targets.MISSED
            parts.append(shown + ("" if by_rate[rate] == online_targets.MET else " (outside the spread)"))
    judged = [v for v in by_rate.values() if v != online_targets.NOT_MEASURABLE]
    if not judged:
        verdict = online_targets.NOT_MEASURABLE
    else:
        verdict = online_targets.MET if all(v == online_targets.MET for v in judged) else online_targets.MISSED
        if online_targets.NOT_MEASURABLE in by_rate.values() and verdict == online_targets.MET:
            verdict = online_targets.NOT_MEASURABLE  # met where measured, but not at every rate
    return {"target": name, "measured": "; ".join(parts), "verdict": verdict, "by_rate": by_rate}


def bench_shadow(
    bench: BenchEnv,
    out: Path,
    good: list[dict[str, Any]],
    *,
    quick: bool,
    capacity_rps: float,
    capacity_source: str,
) -> dict[str, Any]:
    """The whole scenario on `bench`'s store and database; writes results/online_shadow.json."""
    from tandem import modelstore

    plan = ShadowPlan.for_mode(quick)
    started = time.perf_counter()
    rates = rates_for(capacity_rps)
    model_name = bench.model_spec.spec.model_name
    champion = modelstore.production_tag(model_name)
    if champion is None:
        raise RuntimeError(f"no {model_name} in production to shadow")
    challenger = modelstore.challenge(register_untrained(bench.model_spec, 1))
    say(
        f"shadow scoring: champion {champion}, challenger {challenger}, rates {rates} rps "
        f"({'/'.join(f'{s:.0%}' for s in RATE_SHARES)} of {capacity_rps:.0f} rps from {capacity_source}), "
        f"{plan.rounds} round(s) of samples {list(SAMPLES)}, {plan.load_seconds:g} s per level; "
        f"estimated ~{minutes(plan.estimate_s())}"
    )
    runs: list[dict[str, Any]] = []
    ceilings = []
    try:
        ceilings.append(_ceiling_run(bench, rates, plan.load_seconds, good, 0))
        for round_ in range(plan.rounds):
            for sample in SAMPLES:
                runs.append(_shadow_run(bench, sample, round_, rates, plan.load_seconds, good, challenger))
        modelstore.clear_challenger(model_name)
        # Last, at the higher rate: it promotes a version and then puts the champion back.
        rollout = rollout_run(bench, rates[-1], good, champion, quick=quick)
        if plan.rounds > 1:
            ceilings.append(_ceiling_run(bench, rates, plan.load_seconds, good, 1))
    finally:
        modelstore.clear_challenger(model_name)
    # The worst ceiling p99 at each rate decides whether the generator vouches for that rate.
    ceiling = {
        rate: max(c["levels"][i]["p99_ms"] for c in ceilings if "levels" in c)
        for i, rate in enumerate(rates)
        if any("levels" in c for c in ceilings)
    }
    for run in runs:
        for level in run.get("levels", []):
            online_targets.mark(level, ceiling)
    settings = summarise(runs, rates)
    result: dict[str, Any] = {
        "target_p99_ms": TARGET_P99_MS,
        "quick": quick,
        "database": "sqlite (embedded default)",
        "cpu_count": os.cpu_count(),
        "champion": champion,
        "challenger": challenger,
        "capacity_rps": capacity_rps,
        "capacity_source": capacity_source,
        "rate_shares": list(RATE_SHARES),
        "rates": rates,
        "samples": list(SAMPLES),
        "rounds": plan.rounds,
        "seconds_per_level": plan.load_seconds,
        "order": [f"{r['sample']:g}" for r in runs],
        "ceiling_p99_ms_by_rate": {str(k): v for k, v in ceiling.items()},
        "ceiling_runs": ceilings,
        "runs": runs,
        "by_setting": settings,
        "verdict": judge(settings, rates),
        "rollout": rollout,
        "rollout_verdict": judge_rollout(rollout, ceiling),
        "took_s": round(time.perf_counter() - started, 1),
    }
    write_result(out, "online_shadow", result)
    from bench.report import shadow_section

    for line in shadow_section(result):
        print(line, flush=True)
    say(f"shadow scoring took {minutes(result['took_s'])}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one round, shorter levels (~3 min)")
    parser.add_argument("--out", type=Path, help="default bench/ for a full run, a new temporary directory for --quick")
    parser.add_argument(
        "--capacity", type=float, help="the champion's goodput at the target (rps); default: the last full run's"
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # the report is written last: say so before the run
        print("bench.shadow needs the bench extra: pip install -e '.[bench]' (make bench installs it)", file=sys.stderr)
        return 2
    return run_standalone(quick=args.quick, out=args.out, capacity=args.capacity)


def run_standalone(*, quick: bool, out: Path | None, capacity: float | None = None) -> int:
    plan = ShadowPlan.for_mode(quick)
    target: Path = out or (Path(tempfile.mkdtemp(prefix="tandem-bench-quick-")) if quick else ROOT / "bench")
    capacity_rps, source = (capacity, "--capacity") if capacity else last_capacity()
    say(f"output: {target}")
    bench = standalone_environment(plan.rows_per_day, plan.history_days)
    try:
        good, _ = request_bodies(bench, 20_000)
        bench_shadow(bench, target, good, quick=quick, capacity_rps=capacity_rps, capacity_source=source)
    finally:
        import shutil

        shutil.rmtree(bench.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
