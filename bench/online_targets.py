"""The online targets of issue 46, judged from one run: pure functions of the results' dicts.

The run puts side by side, in rounds, the do-nothing ceiling, stock BentoML, Tandem and the
baseline (the code before issue 46's work, BASELINE_COMMIT), Tandem and the baseline on both
stores. Every load level is checked against the do-nothing ceiling at the same offered rate in
the same round: where the ceiling's p99 exceeds GENERATOR_LIMIT_P99_MS (or it did not run that
rate) the level is *generator-limited*, its figures the load generator's as much as the service's,
and no verdict uses it. A verdict with nothing left to stand on reads "not measurable", never met
or missed. Nothing here is asserted anywhere: a missed target is a finding.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

GENERATOR_LIMIT_P99_MS = 5.0
BASELINE_COMMIT = "972a628"


def baseline_label(commit: str) -> str:
    """How the report names the baseline's code: the default is the code before issue 46."""
    return f"{commit} (before issue 46)" if commit == BASELINE_COMMIT else f"{commit} (the baseline)"


# Each store's pair: (Tandem, the baseline), and how the report names the store.
STORES = {
    "embedded SQLite": ("tandem", "baseline"),
    "PostgreSQL": ("tandem_postgres", "baseline_postgres"),
}
# Measured past capacity: Tandem as deploy/ ships it (one plain `bentoml serve`), on both stores.
DEPLOYED = tuple(ours for ours, _ in STORES.values())
# Two services that pass the same load level differ in goodput by the few answers over the target:
# capacities this close (a share of the baseline's) are the same reading.
CAPACITY_RESOLUTION = 0.02
CPU_AT_CAPACITY_MS = 0.5
CPU_SHARE_OF_BASELINE = 0.5
LIGHT_LOAD_RPS = 100
CPU_AT_LIGHT_LOAD_MS = 2.0
OVERLOAD_FACTORS = (2.0, 4.0)
OVERLOAD_GOODPUT_SHARE = 0.8  # of capacity
OVERLOAD_P99_MS = 100.0
RSS_FLAT_RATIO = 1.1  # "RSS flat": a past-capacity level ends within this factor of where it began
BURST_SIZE = 64
BURST_BACKGROUND_SHARE = 0.3  # the burst's background load, as a share of capacity
BURST_P99_MS = 100.0
SERVING_MAX_LINES = 3_500
MODULE_MAX_LINES = 400
# Statuses that are not answers to judge as refusals: counted by their own target.
_NOT_REFUSALS = {"200", "timeout", "conn_error"}

MET, MISSED, NOT_MEASURABLE = "met", "missed", "not measurable"


# ---------------------------------------------------------------- generator check
def rate_key(rate: float) -> int:
    return round(rate)


def mark(entry: dict[str, Any], ceiling: dict[int, float]) -> None:
    """Add `generator_p99_ms` (None: the ceiling did not run this rate) and `generator_limited`."""
    p99 = ceiling.get(rate_key(entry["offered_rps"]))
    entry["generator_p99_ms"] = p99
    entry["generator_limited"] = p99 is None or not p99 <= GENERATOR_LIMIT_P99_MS  # NaN: limited


def usable(levels: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in levels if not s.get("generator_limited", True)]


def sweep_ceiling(sweep: list[dict[str, Any]]) -> dict[int, float]:
    return {rate_key(s["offered_rps"]): s["p99_ms"] for s in sweep}


def round_ceilings(online: dict[str, Any]) -> list[dict[int, float]]:
    """The do-nothing ceiling's p99 by offered rate, one map per round (empty: it did not run)."""
    return [sweep_ceiling(r.get("sweep", [])) for r in online.get("do_nothing", {}).get("rounds", [])]


def worst_ceiling(online: dict[str, Any]) -> dict[int, float]:
    """The ceiling's worst p99 at each rate over every reading of the run (its rounds and its run
    over the past-capacity rates): what levels outside the rounds are checked against."""
    ceiling = online.get("do_nothing", {})
    readings = [*(r.get("sweep", []) for r in ceiling.get("rounds", [])), ceiling.get("again", {}).get("sweep", [])]
    worst: dict[int, float] = {}
    for sweep in readings:
        for rate, p99 in sweep_ceiling(sweep).items():
            worst[rate] = p99 if rate not in worst else _worse(worst[rate], p99)
    return worst


def _worse(a: float, b: float) -> float:
    """The higher p99; NaN (the ceiling answered nothing) is the worst."""
    return a if math.isnan(a) else b if math.isnan(b) else max(a, b)


def mark_online(online: dict[str, Any]) -> None:
    """Mark every level of the run: a round's levels against that round's ceiling, the rest
    (past capacity, the burst's background, poison) against the worst ceiling reading."""
    rounds, worst = round_ceilings(online), worst_ceiling(online)
    for service in online.values():
        for index, run in enumerate(service.get("rounds", [])):
            for entry in run.get("sweep", []):
                mark(entry, rounds[index] if index < len(rounds) else {})
        past = service.get("past_capacity", {})
        for entry in past.get("overload", {}).values():
            mark(entry, worst)
        burst = past.get("burst_64")
        if burst:
            # The burst rides on background load: the rate the ceiling is checked at is the background's.
            mark(burst["background"], worst)
            burst["generator_limited"] = burst["background"]["generator_limited"]
        if "poison_2pct" in service:
            mark(service["poison_2pct"], worst)


# ---------------------------------------------------------------- capacity and its levels
def capacity_level(sweep: list[dict[str, Any]], target_ms: float) -> dict[str, Any] | None:
    """The usable level with the best goodput among those whose p99 met the target."""
    met = [s for s in usable(sweep) if s["p99_ms"] <= target_ms]
    return max(met, key=lambda s: s["goodput_rps"], default=None)


def goodput_at_target(sweep: list[dict[str, Any]], target_ms: float) -> float | None:
    """Best goodput among the usable levels whose p99 met the target: 0 when none met it, None when
    no level is usable (nothing to judge)."""
    if not usable(sweep):
        return None
    level = capacity_level(sweep, target_ms)
    return 0.0 if level is None else float(level["goodput_rps"])


def round_capacities(service: dict[str, Any], target_ms: float) -> list[float]:
    """Capacity in each round that had a usable level."""
    found = (goodput_at_target(r.get("sweep", []), target_ms) for r in service.get("rounds", []))
    return [c for c in found if c is not None]


def median_capacity(service: dict[str, Any], target_ms: float) -> float | None:
    capacities = round_capacities(service, target_ms)
    return statistics.median(capacities) if capacities else None


def cpu_per_served(level: dict[str, Any]) -> float:
    """CPU of the service's process tree per request answered 200 (older results: per request sent)."""
    return float(level.get("cpu_ms_per_served", level["cpu_ms_per_request"]))


def cpu_at_capacity(service: dict[str, Any], target_ms: float) -> list[float]:
    """CPU per served request at each round's capacity level (rounds without one left out)."""
    levels = (capacity_level(r.get("sweep", []), target_ms) for r in service.get("rounds", []))
    return [cpu_per_served(level) for level in levels if level is not None and level["goodput_rps"] > 0]


def cpu_at_rate(service: dict[str, Any], rate: float) -> list[float]:
    """CPU per served request at `rate` in each round where that level ran and is usable."""
    return [
        cpu_per_served(s)
        for r in service.get("rounds", [])
        for s in usable(r.get("sweep", []))
        if rate_key(s["offered_rps"]) == rate_key(rate) and s["ok"] > 0
    ]


def missed_in_a_row(levels: list[dict[str, Any]], target_ms: float, count: int) -> bool:
    """Whether the last `count` levels of a sweep all missed the p99 target (NaN: nothing answered)."""
    last = levels[-count:]
    return len(last) == count and all(not s["p99_ms"] <= target_ms for s in last)


def overload_rates(capacity_rps: float) -> dict[str, int]:
    return {f"{factor:g}x": round(factor * capacity_rps) for factor in OVERLOAD_FACTORS}


def burst_background_rps(capacity_rps: float) -> int:
    return max(1, round(BURST_BACKGROUND_SHARE * capacity_rps))


# ---------------------------------------------------------------- size
def package_size(package: Path) -> dict[str, int]:
    """Lines of each Python module under `package`, by path relative to its parent."""
    return {
        str(path.relative_to(package.parent)): len(path.read_text().splitlines())
        for path in sorted(package.rglob("*.py"))
    }


# ---------------------------------------------------------------- formatting
def _rps(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} rps"


def _ms(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:,.{digits}f} ms"


def _each(values: list[float], show: Callable[[float], str]) -> str:
    return ", ".join(show(v) for v in values) or "none"


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def _target(name: str, threshold: str, measured: str, verdict: str, **numbers: Any) -> dict[str, Any]:
    return {"target": name, "threshold": threshold, "measured": measured, "verdict": verdict, "numbers": numbers}


def _missing(online: dict[str, Any], name: str) -> str:
    """Why a service has nothing to judge."""
    service = online.get(name)
    if service is None:
        return f"{name} did not run"
    if "error" in service:
        return f"{service.get('label', name)}: {service['error']}"
    return f"{service.get('label', name)}: no round with a usable level"


# ---------------------------------------------------------------- verdicts
def judge(
    online: dict[str, Any],
    target_ms: float,
    serving_size: dict[str, int] | None = None,
    commit: str = BASELINE_COMMIT,
) -> dict[str, Any]:
    """Every issue-46 target with its verdict against the baseline `commit`; `online` must already
    be marked (`mark_online`)."""
    targets: list[dict[str, Any]] = []
    for store, (ours, theirs) in STORES.items():
        tandem, baseline = online.get(ours, {}), online.get(theirs, {})
        targets.append(_capacity_target(store, online, ours, theirs, target_ms, commit))
        targets += _cpu_targets(store, online, ours, theirs, target_ms, commit)
        targets.append(_light_load_target(store, tandem, baseline, online, ours, commit))
        targets += _past_capacity_targets(store, tandem.get("past_capacity", {}))
        targets.append(_burst_target(store, tandem.get("past_capacity", {})))
    targets += _size_targets(serving_size)
    return {
        "target_p99_ms": target_ms,
        "generator_limit_p99_ms": GENERATOR_LIMIT_P99_MS,
        "baseline_commit": commit,
        "ceiling_p99_ms_by_rate": {str(k): v for k, v in sorted(worst_ceiling(online).items())},
        # The median capacity over the rounds; bench/shadow.py reads Tandem's from a committed run.
        "goodput_at_target_rps": {
            name: median_capacity(service, target_ms) for name, service in online.items() if "rounds" in service
        },
        "capacity_by_round_rps": {
            name: round_capacities(service, target_ms) for name, service in online.items() if "rounds" in service
        },
        "targets": targets,
    }


def _capacity_target(
    store: str, online: dict[str, Any], ours: str, theirs: str, target_ms: float, commit: str
) -> dict[str, Any]:
    """Met when Tandem's median capacity is at least the baseline's, or short of it by no more than
    the wider of the two services' spreads over the rounds (max - min), or CAPACITY_RESOLUTION."""
    name = f"capacity at p99 <= {target_ms:.0f} ms, {store}"
    threshold = f">= {commit}'s, within the rounds' spread"
    mine, base = round_capacities(online.get(ours, {}), target_ms), round_capacities(online.get(theirs, {}), target_ms)
    if not mine or not base:
        missing = _missing(online, ours if not mine else theirs)
        return _target(name, threshold, missing, NOT_MEASURABLE, tandem_rps=mine, baseline_rps=base)
    ok, theirs_median = statistics.median(mine), statistics.median(base)
    spread = max(_spread(mine), _spread(base), CAPACITY_RESOLUTION * theirs_median)
    measured = (
        f"Tandem {_rps(ok)} (rounds {_each(mine, _rps)}) vs {commit} {_rps(theirs_median)} "
        f"(rounds {_each(base, _rps)}); spread {_rps(spread)}"
    )
    verdict = MET if ok >= theirs_median - spread else MISSED
    return _target(name, threshold, measured, verdict, tandem_rps=mine, baseline_rps=base, spread_rps=spread)


def _cpu_targets(
    store: str, online: dict[str, Any], ours: str, theirs: str, target_ms: float, commit: str
) -> list[dict[str, Any]]:
    """CPU per served request at the capacity level (each round's), median over the rounds: under
    an absolute bound, and under a share of the baseline's in the same run."""
    absolute = f"CPU per served request at capacity, {store}"
    relative = f"CPU per served request at capacity against {commit}, {store}"
    mine, base = cpu_at_capacity(online.get(ours, {}), target_ms), cpu_at_capacity(online.get(theirs, {}), target_ms)
    shown = f"Tandem {_ms(statistics.median(mine), 2) if mine else 'n/a'} (rounds {_each(mine, lambda v: _ms(v, 2))})"
    limit, share = f"<= {CPU_AT_CAPACITY_MS:g} ms", f"<= {CPU_SHARE_OF_BASELINE:.0%} of {commit}'s"
    if not mine:
        gone = _missing(online, ours)
        return [_target(absolute, limit, gone, NOT_MEASURABLE), _target(relative, share, gone, NOT_MEASURABLE)]
    ok = statistics.median(mine)
    first = _target(absolute, limit, shown, MET if ok <= CPU_AT_CAPACITY_MS else MISSED, tandem_ms=mine)
    if not base:
        return [first, _target(relative, share, f"{shown}; {_missing(online, theirs)}", NOT_MEASURABLE)]
    theirs_median = statistics.median(base)
    ratio = ok / theirs_median if theirs_median > 0 else math.inf
    measured = f"{shown} vs {commit} {_ms(theirs_median, 2)} (rounds {_each(base, lambda v: _ms(v, 2))}): {ratio:.0%}"
    verdict = MET if ratio <= CPU_SHARE_OF_BASELINE else MISSED
    return [first, _target(relative, share, measured, verdict, tandem_ms=mine, baseline_ms=base, ratio=ratio)]


def _light_load_target(
    store: str, tandem: dict[str, Any], baseline: dict[str, Any], online: dict[str, Any], ours: str, commit: str
) -> dict[str, Any]:
    name = f"CPU per served request at {LIGHT_LOAD_RPS} rps, {store}"
    threshold = f"<= {CPU_AT_LIGHT_LOAD_MS:g} ms"
    mine, base = cpu_at_rate(tandem, LIGHT_LOAD_RPS), cpu_at_rate(baseline, LIGHT_LOAD_RPS)
    if not mine:
        why = _missing(online, ours) if "rounds" not in tandem else f"no usable level at {LIGHT_LOAD_RPS} rps"
        return _target(name, threshold, why, NOT_MEASURABLE)
    ok = statistics.median(mine)
    measured = (
        f"Tandem {_ms(ok, 2)} (rounds {_each(mine, lambda v: _ms(v, 2))}); "
        f"{commit} {_ms(statistics.median(base), 2) if base else 'n/a'}"
    )
    return _target(name, threshold, measured, MET if ok <= CPU_AT_LIGHT_LOAD_MS else MISSED, tandem_ms=mine)


def _refusals(run: dict[str, Any]) -> str:
    others = {k: v for k, v in run["statuses"].items() if k not in _NOT_REFUSALS | {"503", "429"}}
    shown = f"{run['shed']} 503/429, {run['shed_without_retry_after']} without Retry-After"
    return shown + (f", other statuses {others}" if others else "")


def _refusals_ok(run: dict[str, Any]) -> bool:
    others = [k for k in run["statuses"] if k not in _NOT_REFUSALS | {"503", "429"}]
    return not others and run["shed_without_retry_after"] == 0


def _rss(run: dict[str, Any]) -> str:
    return f"RSS {run['rss_mb_before']:,.0f} -> {run['rss_mb_after']:,.0f} MB"


def _past_capacity_checks(capacity: float) -> list[tuple[str, str, Callable[[dict[str, Any]], str], Any]]:
    """(target, threshold, what to show of one level, whether that level met it)."""
    floor = OVERLOAD_GOODPUT_SHARE * capacity
    return [
        (
            "past capacity: goodput",
            f">= {OVERLOAD_GOODPUT_SHARE:.0%} of capacity ({_rps(capacity)}): {_rps(floor)}",
            lambda o: _rps(o["goodput_rps"]),
            lambda o: capacity > 0 and o["goodput_rps"] >= floor,
        ),
        (
            "past capacity: accepted p99",
            f"<= {OVERLOAD_P99_MS:.0f} ms",
            lambda o: _ms(o["p99_ms"]),
            lambda o: o["p99_ms"] <= OVERLOAD_P99_MS,  # NaN (nothing accepted) misses
        ),
        ("past capacity: refusals", "every one a 503 or 429 with Retry-After", _refusals, _refusals_ok),
        (
            "past capacity: timeouts, connection errors, memory",
            f"0, 0, RSS flat (within {RSS_FLAT_RATIO:g}x)",
            lambda o: f"{o['client_timeouts']} timeouts, {o['connection_errors']} connection errors, {_rss(o)}",
            lambda o: (
                o["client_timeouts"] == 0
                and o["connection_errors"] == 0
                and o["rss_mb_after"] <= RSS_FLAT_RATIO * o["rss_mb_before"]
            ),
        ),
    ]


def _past_capacity_targets(store: str, past: dict[str, Any]) -> list[dict[str, Any]]:
    """Each check must hold at every factor; a generator-limited factor is left out of it."""
    runs: dict[str, dict[str, Any]] = past.get("overload", {})
    targets = []
    for name, threshold, show, ok in _past_capacity_checks(past.get("capacity_rps", 0.0)):
        parts, verdicts = [], {}
        for factor, run in runs.items():
            head = f"{factor} ({run['offered_rps']:,.0f} rps)"
            if run.get("generator_limited", True):
                parts.append(f"{head}: generator-limited")
                verdicts[factor] = NOT_MEASURABLE
                continue
            verdicts[factor] = MET if ok(run) else MISSED
            parts.append(f"{head}: {show(run)}" + ("" if verdicts[factor] == MET else " (missed)"))
        judged = [v for v in verdicts.values() if v != NOT_MEASURABLE]
        verdict = NOT_MEASURABLE if not judged else (MET if all(v == MET for v in judged) else MISSED)
        measured = "; ".join(parts) if runs else past.get("error", "did not run")
        targets.append(_target(f"{name}, {store}", threshold, measured, verdict, by_factor=verdicts))
    return targets


def _burst_target(store: str, past: dict[str, Any]) -> dict[str, Any]:
    name = f"a burst of {BURST_SIZE} at {BURST_BACKGROUND_SHARE:.0%} load, {store}"
    threshold = f"0 shed, p99 <= {BURST_P99_MS:.0f} ms"
    burst = past.get("burst_64")
    if not burst:
        return _target(name, threshold, past.get("error", "did not run"), NOT_MEASURABLE)
    b, background = burst["burst"], burst["background"]
    ceiling = burst.get("ceiling_burst_p99_ms")
    measured = (
        f"{b['shed']} shed, p99 {_ms(b['p99_ms'])} over {background['offered_rps']:,.0f} rps "
        f"(the same burst on the ceiling: {'not run' if ceiling is None else _ms(ceiling)})"
    )
    if burst.get("generator_limited", True):
        return _target(name, threshold, measured + "; generator-limited at the background rate", NOT_MEASURABLE)
    if ceiling is None or not ceiling <= BURST_P99_MS:
        return _target(name, threshold, measured + "; the generator alone misses the p99", NOT_MEASURABLE)
    ok = b["shed"] == 0 and b["ok"] == BURST_SIZE and b["p99_ms"] <= BURST_P99_MS
    return _target(name, threshold, measured, MET if ok else MISSED, shed=b["shed"], p99_ms=b["p99_ms"])


def _size_targets(size: dict[str, int] | None) -> list[dict[str, Any]]:
    total_name, module_name = "size: serving/", "size: the longest module of serving/"
    total_limit, module_limit = f"<= about {SERVING_MAX_LINES:,} lines", f"<= {MODULE_MAX_LINES} lines"
    if not size:
        return [
            _target(total_name, total_limit, "not counted", NOT_MEASURABLE),
            _target(module_name, module_limit, "not counted", NOT_MEASURABLE),
        ]
    total = sum(size.values())
    over = {path: lines for path, lines in sorted(size.items(), key=lambda kv: -kv[1]) if lines > MODULE_MAX_LINES}
    longest = max(size, key=lambda path: size[path])
    measured = f"{longest}: {size[longest]:,} lines" + (
        f"; over the limit: {', '.join(f'{p} {n:,}' for p, n in over.items())}" if over else ""
    )
    return [
        _target(
            total_name,
            total_limit,
            f"{total:,} lines in {len(size)} modules",
            MET if total <= SERVING_MAX_LINES else MISSED,
            lines=total,
        ),
        _target(module_name, module_limit, measured, MISSED if over else MET, over=over),
    ]
