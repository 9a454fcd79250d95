"""The online targets of issue 14 (and the native-API check of issue 15), judged from one run.

Every load level is checked against the do-nothing ceiling at the same offered rate: where the
ceiling's p99 exceeds GENERATOR_LIMIT_P99_MS (or the ceiling did not run that rate) the level is
*generator-limited*: the figure is the load generator's as much as the service's, so it is kept
out of every verdict. A verdict that has nothing left to stand on reads "not measurable", never
met or missed. Nothing here is asserted anywhere: a missed target is a finding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

GENERATOR_LIMIT_P99_MS = 5.0
GOODPUT_TARGET_RPS = 800.0
OVERLOAD_FACTORS = (1.5, 2.0, 4.0)
OVERLOAD_GOODPUT_SHARE = 0.9  # of the best goodput at the target
SHED_P99_MS = 10.0
BURST_SIZE = 64
BURST_BACKGROUND_SHARE = 0.3  # "moderate load": background at this share of capacity
BURST_P99_MS = 100.0
STOCK_RATIO = 8.0
NATIVE_COST_LIMIT = 0.10  # issue 15: the native @bentoml.api may cost at most this share of goodput

MET, MISSED, NOT_MEASURABLE = "met", "missed", "not measurable"


def rate_key(rate: float) -> int:
    return round(rate)


def ceiling_p99_by_rate(online: dict[str, Any]) -> dict[int, float]:
    """The do-nothing ceiling's p99 at each offered rate it ran."""
    return {rate_key(s["offered_rps"]): s["p99_ms"] for s in online.get("do_nothing", {}).get("sweep", [])}


def mark(entry: dict[str, Any], ceiling: dict[int, float]) -> None:
    """Add `generator_p99_ms` (None: the ceiling did not run this rate) and `generator_limited`."""
    p99 = ceiling.get(rate_key(entry["offered_rps"]))
    entry["generator_p99_ms"] = p99
    entry["generator_limited"] = p99 is None or not p99 <= GENERATOR_LIMIT_P99_MS  # NaN: limited


def mark_service(service: dict[str, Any], ceiling: dict[int, float]) -> None:
    """Mark every load level of a service's results, wherever it sits."""
    for entry in service.get("sweep", []):
        mark(entry, ceiling)
    for entry in service.get("overload", {}).values():
        mark(entry, ceiling)
    burst = service.get("burst_64")
    if burst:
        # The burst rides on background load: the rate the ceiling is checked at is the background's.
        mark(burst["background"], ceiling)
        burst["generator_limited"] = burst["background"]["generator_limited"]
    if "poison_2pct" in service:
        mark(service["poison_2pct"], ceiling)


def usable(levels: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in levels if not s.get("generator_limited", True)]


def goodput_at_target(sweep: list[dict[str, Any]], target_ms: float) -> float | None:
    """Best goodput among the usable levels whose p99 met the target: 0 when none met it, None when
    no level is usable (nothing to judge)."""
    levels = usable(sweep)
    if not levels:
        return None
    return max((s["goodput_rps"] for s in levels if s["p99_ms"] <= target_ms), default=0.0)


def capacity(service: dict[str, Any], target_ms: float) -> float:
    """Capacity at the target for choosing overload rates: the best usable goodput at the target;
    if there is none, the lowest offered rate (so the overload runs still say something)."""
    sweep = service.get("sweep", [])
    best = goodput_at_target(sweep, target_ms)
    return best if best else float(min((s["offered_rps"] for s in sweep), default=50.0))


def overload_rates(capacity_rps: float) -> dict[str, int]:
    return {f"{factor:g}x": round(factor * capacity_rps) for factor in OVERLOAD_FACTORS}


def burst_background_rps(capacity_rps: float) -> int:
    return max(1, round(BURST_BACKGROUND_SHARE * capacity_rps))


def _rps(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} rps"


def _ms(value: float) -> str:
    return "none" if math.isnan(value) else f"{value:,.1f} ms"


def _target(name: str, measured: str, verdict: str, **numbers: Any) -> dict[str, Any]:
    return {"target": name, "measured": measured, "verdict": verdict, "numbers": numbers}


def _excluded(sweep: list[dict[str, Any]]) -> str:
    limited = [rate_key(s["offered_rps"]) for s in sweep if s.get("generator_limited", True)]
    return f"; generator-limited, left out: {', '.join(map(str, limited))} rps" if limited else ""


def judge(online: dict[str, Any], target_ms: float) -> dict[str, Any]:
    """Every online target with its verdict; `online` must already be marked (`mark_service`)."""
    tandem = online.get("tandem", {})
    sweep = tandem.get("sweep", [])
    ours = goodput_at_target(sweep, target_ms)
    postgres = goodput_at_target(online.get("tandem_postgres", {}).get("sweep", []), target_ms)
    targets = [_goodput_target(sweep, ours, postgres, target_ms)]
    targets += _overload_targets(tandem, ours, target_ms)
    targets.append(_burst_target(tandem))
    targets.append(_stock_target(online.get("stock_bentoml", {}), ours, target_ms))
    targets.append(_native_target(ours, online.get("tandem_mounted", {}), target_ms))
    return {
        "target_p99_ms": target_ms,
        "generator_limit_p99_ms": GENERATOR_LIMIT_P99_MS,
        "ceiling_p99_ms_by_rate": {str(k): v for k, v in sorted(ceiling_p99_by_rate(online).items())},
        "goodput_at_target_rps": {
            name: goodput_at_target(service.get("sweep", []), target_ms)
            for name, service in online.items()
            if "sweep" in service
        },
        "targets": targets,
    }


def _goodput_target(
    sweep: list[dict[str, Any]], ours: float | None, postgres: float | None, target_ms: float
) -> dict[str, Any]:
    name = f"goodput at p99 <= {target_ms:.0f} ms >= {GOODPUT_TARGET_RPS:,.0f} rps (embedded SQLite)"
    measured = f"{_rps(ours)} (PostgreSQL: {_rps(postgres)}){_excluded(sweep)}"
    if ours is not None and ours >= GOODPUT_TARGET_RPS:
        verdict = MET
    elif any(s["offered_rps"] >= GOODPUT_TARGET_RPS for s in usable(sweep)):
        verdict = MISSED  # tried, by a trustworthy level, at a rate that could have met it
    else:
        verdict = NOT_MEASURABLE  # no usable level offered enough load to tell
        measured += f"; no usable level offered >= {GOODPUT_TARGET_RPS:,.0f} rps"
    return _target(name, measured, verdict, sqlite_rps=ours, postgres_rps=postgres)


def _overload_targets(tandem: dict[str, Any], best: float | None, target_ms: float) -> list[dict[str, Any]]:
    runs: dict[str, dict[str, Any]] = tandem.get("overload", {})
    checks = [
        (
            f"past capacity: accepted p99 <= {target_ms:.0f} ms",
            lambda o: _ms(o["p99_ms"]),
            lambda o: o["p99_ms"] <= target_ms,  # NaN (nothing accepted) misses
        ),
        (
            f"past capacity: shed p99 <= {SHED_P99_MS:.0f} ms, every shed answer with Retry-After",
            lambda o: f"{o['shed']} shed, p99 {_ms(o['shed_p99_ms'])}, {o['shed_without_retry_after']} no Retry-After",
            lambda o: (o["shed"] == 0 or o["shed_p99_ms"] <= SHED_P99_MS) and o["shed_without_retry_after"] == 0,
        ),
        (
            f"past capacity: goodput >= {OVERLOAD_GOODPUT_SHARE:.0%} of the best ({_rps(best)})",
            lambda o: _rps(o["goodput_rps"]),
            lambda o: best is not None and best > 0 and o["goodput_rps"] >= OVERLOAD_GOODPUT_SHARE * best,
        ),
        (
            "past capacity: 0 client timeouts, 0 connection errors",
            lambda o: f"{o['client_timeouts']} timeouts, {o['connection_errors']} connection errors",
            lambda o: o["client_timeouts"] == 0 and o["connection_errors"] == 0,
        ),
    ]
    targets = []
    for name, show, ok in checks:
        parts, verdicts = [], {}
        for factor, run in runs.items():
            head = f"{factor} ({run['offered_rps']:,.0f} rps)"
            if run.get("generator_limited", True):
                parts.append(f"{head}: generator-limited")
                verdicts[factor] = NOT_MEASURABLE
            else:
                verdicts[factor] = MET if ok(run) else MISSED
                parts.append(f"{head}: {show(run)}" + ("" if verdicts[factor] == MET else " (missed)"))
        judged = [v for v in verdicts.values() if v != NOT_MEASURABLE]
        verdict = NOT_MEASURABLE if not judged else (MET if all(v == MET for v in judged) else MISSED)
        if not runs:
            parts = ["did not run"]
        targets.append(_target(name, "; ".join(parts), verdict, by_factor=verdicts))
    return targets


def _burst_target(tandem: dict[str, Any]) -> dict[str, Any]:
    name = f"a burst of {BURST_SIZE} at moderate load: 0 shed, p99 <= {BURST_P99_MS:.0f} ms"
    burst = tandem.get("burst_64")
    if not burst:
        return _target(name, "did not run", NOT_MEASURABLE)
    b, background = burst["burst"], burst["background"]
    ceiling = burst.get("ceiling_burst_p99_ms")
    measured = (
        f"{b['shed']} shed, p99 {_ms(b['p99_ms'])} over {background['offered_rps']:,.0f} rps background "
        f"(do-nothing ceiling, same burst: {'not run' if ceiling is None else _ms(ceiling)})"
    )
    if burst.get("generator_limited", True):
        return _target(name, measured + "; generator-limited at the background rate", NOT_MEASURABLE)
    if ceiling is None or not ceiling <= BURST_P99_MS:
        return _target(name, measured + "; the generator alone misses the p99", NOT_MEASURABLE)
    ok = b["shed"] == 0 and b["ok"] == BURST_SIZE and b["p99_ms"] <= BURST_P99_MS
    return _target(name, measured, MET if ok else MISSED, shed=b["shed"], p99_ms=b["p99_ms"])


def _stock_target(stock: dict[str, Any], ours: float | None, target_ms: float) -> dict[str, Any]:
    name = f"goodput at the target >= {STOCK_RATIO:g}x stock BentoML"
    sweep = stock.get("sweep", [])
    theirs = goodput_at_target(sweep, target_ms)
    measured = f"{_rps(ours)} vs {_rps(theirs)}"
    if ours is None or theirs is None:
        return _target(name, measured + "; no usable level", NOT_MEASURABLE)
    if theirs > 0:
        ratio = ours / theirs
        return _target(name, f"{ratio:.1f}x ({measured})", MET if ratio >= STOCK_RATIO else MISSED, ratio=ratio)
    # Stock met the target at no usable level: its goodput at the target is below its lowest one.
    lowest = min(s["offered_rps"] for s in usable(sweep))
    bound = ours / lowest
    measured = f"> {bound:.1f}x ({_rps(ours)}; stock met the target at no usable level, the lowest {lowest:,.0f} rps)"
    return _target(name, measured, MET if bound >= STOCK_RATIO else NOT_MEASURABLE, ratio_lower_bound=bound)


def _native_target(native: float | None, mounted_service: dict[str, Any], target_ms: float) -> dict[str, Any]:
    name = f"issue 15: native @bentoml.api costs <= {NATIVE_COST_LIMIT:.0%} of goodput vs the mounted route"
    mounted = goodput_at_target(mounted_service.get("sweep", []), target_ms)
    measured = f"native {_rps(native)} vs mounted {_rps(mounted)}"
    if native is None or not mounted:
        return _target(name, measured + "; not comparable", NOT_MEASURABLE, native_rps=native, mounted_rps=mounted)
    ratio = native / mounted
    cost = 1 - ratio
    measured += f" (ratio {ratio:.2f}, {'costs' if cost >= 0 else 'gains'} {abs(cost):.0%})"
    return _target(
        name,
        measured,
        MET if cost <= NATIVE_COST_LIMIT else MISSED,
        native_rps=native,
        mounted_rps=mounted,
        ratio=ratio,
    )
