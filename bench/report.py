"""report.md and its plots (bench/ for a full run), from the numbers one bench run measured."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

from bench import batch_baseline, loadgen, online_targets


def _pyplot() -> ModuleType:
    """matplotlib, imported when a plot is drawn: it is a bench extra, and the verdicts in this
    module are tested where only the dev extras are installed."""
    import matplotlib

    matplotlib.use("Agg")  # files only; this machine has no display
    import matplotlib.pyplot as plt

    return plt


def _generator(level: dict[str, Any]) -> str:
    """The do-nothing ceiling's p99 at a level's offered rate, and whether that limits the level."""
    p99 = level.get("generator_p99_ms")
    if p99 is None:
        return "not run, **generator-limited**"
    return f"{p99:.1f}, **generator-limited**" if level.get("generator_limited", True) else f"{p99:.1f}"


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _onset(level: dict[str, Any], prefix: str) -> str:
    """p99 of the level's first ONSET_S and of the rest (results written before they were kept: -)."""
    nan = float("nan")
    return f"{_ms(level.get(f'{prefix}onset_p99_ms', nan))} / {_ms(level.get(f'{prefix}after_onset_p99_ms', nan))}"


def _client_timeout(overload: dict[str, dict[str, Any]]) -> float:
    return max((float(o.get("client_timeout_s", 0)) for o in overload.values()), default=0.0)


def _online_verdict(verdict: str) -> str:
    return {"met": "met", "missed": "**missed**"}.get(verdict, f"_{verdict}_")


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def write_report(
    raw: dict[str, Any],
    batch: dict[str, Any],
    online: dict[str, Any],
    workers: dict[str, Any],
    target_ms: float,
    *,
    out: Path,
    quick: bool,
    seconds: float,
    phases: list[tuple[str, float, float]],
    shadow: dict[str, Any] | None = None,
    targets: dict[str, Any] | None = None,
    precision: dict[str, Any] | None = None,
) -> None:
    """`phases`: (name, estimated seconds, measured seconds) of the phases run so far; `shadow`:
    the shadow-scoring scenario's result (bench/shadow.py), when it ran; `targets`: the online
    verdicts (`online_targets.judge`), judged here when not given; `precision`: the fp32 / bf16
    comparison (bench/precision.py), when it ran."""
    _plot_latency(out, online, target_ms)
    _plot_batch(out, raw, batch)
    _plot_workers(out, workers, target_ms)
    forward = raw["items_per_second"]
    partitions = batch["partitions"]
    largest = max(partitions, key=int)
    verdicts = targets if targets is not None else online_targets.judge(online, target_ms)
    lines = [
        "# Tandem benchmark report",
        "",
        f"One run on this machine ({'quick mode' if quick else 'full mode'}, {seconds / 60:.1f} min), every figure",
        "measured side by side. Raw numbers: `results/*.json` next to this file. Regenerate: `make bench`",
        "(`make bench-quick` writes a quick run to a temporary directory instead).",
        "",
        *targets_section(verdicts),
        "## Raw model forward (the limit)",
        "",
        f"{raw['parameter_count']:,} parameters, {_flops(raw.get('flops_per_item'))}, {raw['threads']} threads.",
        "",
        f"| batch size | items/s, {raw['threads']} threads | items/s, 1 thread |{_again_header(raw)}",
        f"| ---: | ---: | ---: |{_again_header(raw, rule=True)}",
        *[
            f"| {size} | {rate:,.0f} | {_rate(raw.get('items_per_second_1_thread', {}).get(size))} |"
            f"{_again_cells(raw, size)}"
            for size, rate in forward.items()
        ],
        "",
        "## Batch path",
        "",
        *batch_section(raw, batch),
        "",
        f"Upsert into `predictions`: {batch['upsert']['insert_rows_per_second']:,.0f} rows/s new, "
        f"{batch['upsert']['replay_noop_rows_per_second']:,.0f} rows/s replayed (no-op).",
        "",
        "![batch throughput](batch_throughput.png)",
        "",
        *(precision_section(precision) if precision is not None else []),
        *online_section(online, target_ms),
    ]
    lines += _workers_section(workers, target_ms)
    lines += ["## Past capacity, bursts, poison", ""]
    for name in online_targets.DEPLOYED:
        lines += _past_capacity_section(online.get(name, {}).get("past_capacity", {}), online.get(name, {}))
    for name in ("tandem", "stock_bentoml"):
        if "poison_2pct" in online.get(name, {}):
            p = online[name]["poison_2pct"]
            lines.append(
                f"- 2% poison inputs at {p['offered_rps']:.0f} rps, {online[name]['label']}: "
                f"{p['collateral_failures']} collateral failures among good requests (statuses {p['statuses']})."
            )
    if shadow is not None:
        lines += ["", *shadow_section(shadow)]
    lines += ["", "## Other targets", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    if precision is not None:
        t = precision["verdict"]
        lines.append(f"| {t['target']} | {t['measured']} | {_precision_verdict(t['verdict'])} |")
    if shadow is not None:
        t = shadow["verdict"]
        lines.append(f"| {t['target']} | {t['measured']} | {_online_verdict(t['verdict'])} |")
    first: dict[str, Any] = next(iter(online.get("tandem", {}).get("rounds", [])), {})
    online_cpu = first["sweep"][0]["cpu_ms_per_request"] if first.get("sweep") else float("nan")
    batch_cpu = partitions[largest]["cpu_ms_per_record"]
    rows = [
        (
            "batch cost per record >= 10x below online (lowest load, first round)",
            f"{batch_cpu:.3f} vs {online_cpu:.2f} CPU ms",
            online_cpu >= 10 * batch_cpu,
        ),
        *batch_targets(raw, batch),
    ]
    lines += [f"| {name} | {measured} | {_verdict(ok)} |" for name, measured, ok in rows]
    against = batch_baseline.judge(batch.get("baseline"), _baseline_commit(batch))
    lines.append(f"| {against['target']} | {against['measured']} | {_online_verdict(against['verdict'])} |")
    lines += [
        "",
        "Why a target was missed, and what the numbers say beyond the verdicts: [findings.md](findings.md),",
        "written by hand against the committed run (a new run may move the numbers it quotes).",
        "",
    ]
    lines += [
        "## Run time",
        "",
        "| phase | estimated | took |",
        "| --- | ---: | ---: |",
        *[f"| {name} | {estimate:.0f} s | {took:.0f} s |" for name, estimate, took in phases],
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


def targets_section(verdicts: dict[str, Any]) -> list[str]:
    """Issue 46's targets: each with its threshold, the number measured and the verdict."""
    return [
        f"## Targets (issue 46), against {verdicts['baseline_commit']}",
        "",
        "| target | threshold | measured | verdict |",
        "| --- | --- | --- | --- |",
        *[
            f"| {t['target']} | {t['threshold']} | {t['measured']} | {_online_verdict(t['verdict'])} |"
            for t in verdicts["targets"]
        ],
        "",
        f"Each figure is the median over the rounds, every round beside it. Online verdicts use only load "
        f"levels where the do-nothing ceiling's p99 stayed <= {verdicts['generator_limit_p99_ms']:.0f} ms at "
        "the same offered rate; a verdict with no such level left reads _not measurable_, as does one whose "
        "baseline could not run. Raw: `results/online_targets.json`.",
        "",
    ]


def _median_cell(values: list[float], digits: int, unit: str = "") -> str:
    if not values:
        return "-"
    each = ", ".join(f"{v:,.{digits}f}" for v in values)
    return f"{statistics.median(values):,.{digits}f}{unit} ({each})"


def online_section(online: dict[str, Any], target_ms: float) -> list[str]:
    """The side-by-side table over the rounds, the generator check, the plot and every sweep."""
    rounds = max((len(s.get("rounds", [])) for s in online.values()), default=0)
    rate = online_targets.LIGHT_LOAD_RPS
    lines = [
        "## Online path (open-loop load, latency from the scheduled send time)",
        "",
        f"Declared p99 target: {target_ms:.0f} ms. {rounds} round(s); in each, every service starts afresh and "
        "runs its sweep, the ceiling first, Tandem and the baseline trading places from one round to the next. "
        "A sweep stops once two levels in a row missed the target. Capacity = the best goodput (answers within "
        "the target per second) at a usable level whose p99 met the target. CPU per served request = CPU of the "
        "service's process tree over the level, per request answered 200.",
        "",
        f"| service | capacity at p99 <= {target_ms:.0f} ms, rps: median (each round) | CPU ms / served request "
        f"at capacity | CPU ms / served request at {rate} rps |",
        "| --- | ---: | ---: | ---: |",
    ]
    for service in online.values():
        if "error" in service:
            lines.append(f"| {service['label']} | did not run: {service['error']} | | |")
            continue
        capacities = online_targets.round_capacities(service, target_ms)
        failed = [r["error"] for r in service.get("rounds", []) if "error" in r]
        lines.append(
            f"| {service['label']} | {_median_cell(capacities, 0)}"
            + (f"; {len(failed)} round(s) did not start" if failed else "")
            + f" | {_median_cell(online_targets.cpu_at_capacity(service, target_ms), 2)}"
            f" | {_median_cell(online_targets.cpu_at_rate(service, rate), 2)} |"
        )
    lines += ["", *_generator_section(online), "![latency vs offered load](online_latency.png)", ""]
    return lines + _sweeps_section(online)


def _sweeps_section(online: dict[str, Any]) -> list[str]:
    lines = ["### Sweeps", ""]
    for service in online.values():
        runs = [(i + 1, r) for i, r in enumerate(service.get("rounds", []))]
        if not runs:
            continue
        lines += [
            f"**{service['label']}**",
            "",
            "| round | offered rps | p50 ms | p99 ms | p99.9 ms | goodput rps | shed | timeouts | conn errors | "
            "CPU ms / served | ceiling p99 ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for number, run in runs:
            if "error" in run:
                lines.append(f"| {number} | did not start: {run['error']} | | | | | | | | | |")
            lines += [
                f"| {number} | {s['offered_rps']:.0f} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | "
                f"{s['p999_ms']:.1f} | {s['goodput_rps']:.0f} | {s['shed']} | {s['client_timeouts']} | "
                f"{s.get('connection_errors', 0)} | {online_targets.cpu_per_served(s):.2f} | {_generator(s)} |"
                for s in run.get("sweep", [])
            ]
        lines.append("")
    return lines


def _past_capacity_section(tandem: dict[str, Any], service: dict[str, Any]) -> list[str]:
    """One service's overload runs and its burst at 30% load (`tandem`: its `past_capacity`)."""
    label = service.get("label", "")
    lines: list[str] = []
    if "overload" in tandem:
        lines += [
            f"{label}, deployed as deploy/ ships it (one plain `bentoml serve`), past its capacity at the "
            f"target ({tandem['capacity_rps']:,.0f} rps, {tandem.get('capacity_source', 'measured in this run')}), "
            f"client timeout {_client_timeout(tandem['overload']):.0f} s:",
            "",
            "| load | offered rps | accepted p99 ms | first 0.5 s / after | goodput rps | statuses | "
            "shed p99 ms | first 0.5 s / after | shed without Retry-After | timeouts | conn errors | "
            "RSS MB before -> after | ceiling p99 ms |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *[
                f"| {factor} capacity | {o['offered_rps']:,.0f} | {o['p99_ms']:.1f} | {_onset(o, '')} | "
                f"{o['goodput_rps']:,.0f} | {_statuses(o)} | {_ms(o['shed_p99_ms'])} | {_onset(o, 'shed_')} | "
                f"{o['shed_without_retry_after']} | {o['client_timeouts']} | {o['connection_errors']} | "
                f"{o['rss_mb_before']:,.0f} -> {o['rss_mb_after']:,.0f} | {_generator(o)} |"
                for factor, o in tandem["overload"].items()
            ],
            "",
            f"The first {loadgen.ONSET_S:g} s / after: the p99 of the answers to requests sent in the level's "
            f"first {loadgen.ONSET_S:g} s, and of the rest. Each level starts from a settled service, so the "
            "first part is the step into overload, before admission's estimate of the wait has caught up "
            "(serving/README.md).",
            "",
        ]
    if "burst_64" in tandem:
        b, bg = tandem["burst_64"]["burst"], tandem["burst_64"]["background"]
        ceiling_burst = tandem["burst_64"].get("ceiling_burst_p99_ms")
        lines.append(
            f"- {label}, a burst of {online_targets.BURST_SIZE} requests within 1 ms, in the middle of "
            f"{bg['offered_rps']:,.0f} rps background load (~{online_targets.BURST_BACKGROUND_SHARE:.0%} of "
            f"capacity): {b['statuses']}, shed {b['shed']}, p99 {b['p99_ms']:.1f} ms; background p99 "
            f"{bg['p99_ms']:.1f} ms (ceiling p99 at that rate, ms: {_generator(bg)}; the same burst on the ceiling: "
            + ("not run" if ceiling_burst is None else f"p99 {ceiling_burst:.1f} ms")
            + ")."
        )
        lines.append("")
    return lines


def _statuses(level: dict[str, Any]) -> str:
    return ", ".join(f"{status}: {count}" for status, count in sorted(level["statuses"].items()))


def _runs(values: list[float]) -> str:
    return ", ".join(_ms(v) for v in values)


def shadow_section(shadow: dict[str, Any]) -> list[str]:
    """The shadow-scoring scenario (bench/shadow.py): the champion's p99 and goodput at each
    sample share, every repeat shown beside the median, and the verdict on the 10% target."""
    rates = [str(r) for r in shadow["rates"]]
    ceiling = shadow.get("ceiling_p99_ms_by_rate", {})
    lines = [
        "## Shadow scoring: what the challenger costs the champion",
        "",
        f"One Tandem service on {shadow['database']}, champion `{shadow['champion']}` in production, challenger "
        f"`{shadow['challenger']}` (untrained, same architecture) set with `modelstore.challenge`. Offered "
        f"{' and '.join(rates)} rps open loop ({' / '.join(f'{s:.0%}' for s in shadow['rate_shares'])} of "
        f"{shadow['capacity_rps']:,.0f} rps, from {shadow['capacity_source']}), {shadow['seconds_per_level']:g} s "
        f"per level. Each sample share is a service restart; order {', '.join(shadow['order'])}; figures are the "
        "median over the repeats, every repeat's p99 beside it. Shadow counters: the level's increase of "
        "`tandem_shadow_items_total` and `tandem_shadow_dropped_total` (read from /metrics once the shadow "
        "queue was empty). Load avg: the machine's 1-minute load average after each level (2 cores; the "
        "load generator and the service count in it). Raw: `results/online_shadow.json`.",
        "",
        "| sample | offered rps | p50 ms | p99 ms | p99 ms, each run | goodput rps | shed | 5xx | CPU ms/req "
        "| shadow sampled / scored / dropped (reasons) | ceiling p99 ms | load avg, each run |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    for sample, per_rate in shadow["by_setting"].items():
        for rate in rates:
            e = per_rate.get(rate)
            if not e or not e["repeats"]:
                lines.append(f"| {sample} | {rate} | did not run | | | | | | | | | |")
                continue
            s = e.get("shadow")
            counted = (
                "off"
                if s is None
                else f"{s['sampled']} / {s['scored']} / {s['dropped']}"
                + (f" ({', '.join(f'{k} {v}' for k, v in s['dropped_by_reason'].items())})" if s["dropped"] else "")
                + ("" if s["settled"] else ", queue not empty")
            )
            limited = ", **generator-limited**" if e["generator_limited"] else ""
            lines.append(
                f"| {sample} | {rate} | {_ms(e['p50_ms'])} | {_ms(e['p99_ms'])} | {_runs(e['p99_ms_runs'])} "
                f"| {e['goodput_rps']:.0f} | {e['shed']} | {e['errors_5xx']} | {e['cpu_ms_per_request']:.2f} "
                f"| {counted} | {_ms(ceiling.get(rate, float('nan')))}{limited} "
                f"| {', '.join(f'{v:.1f}' for v in e.get('loadavg_1m_runs', []))} |"
            )
    verdict = shadow["verdict"]
    lines += ["", f"**{verdict['target']}: {_online_verdict(verdict['verdict'])}.** {verdict['measured']}.", ""]
    lines += _shadow_cost(shadow, rates)
    rollout = shadow.get("rollout_verdict")
    if rollout:
        lines += ["", f"**{rollout['target']}: {_online_verdict(rollout['verdict'])}.** {rollout['measured']}.", ""]
    return lines


def _shadow_cost(shadow: dict[str, Any], rates: list[str]) -> list[str]:
    """The medians' differences against the 0% baseline, at each share and rate."""
    base = shadow["by_setting"].get("0", {})
    lines = []
    for sample, per_rate in shadow["by_setting"].items():
        if sample == "0":
            continue
        parts = []
        for rate in rates:
            e, b = per_rate.get(rate, {}), base.get(rate, {})
            if not e.get("repeats") or not b.get("repeats"):
                continue
            p99, goodput = e["p99_ms"] - b["p99_ms"], e["goodput_rps"] - b["goodput_rps"]
            cpu = e["cpu_ms_per_request"] - b["cpu_ms_per_request"]
            parts.append(f"{rate} rps: p99 {p99:+.1f} ms, goodput {goodput:+.0f} rps, CPU {cpu:+.2f} ms/req")
        if parts:
            lines.append(f"- Sample {sample} against 0 (medians): " + "; ".join(parts) + ".")
    return [*lines, ""] if lines else []


def _generator_section(online: dict[str, Any]) -> list[str]:
    """The do-nothing ceiling's p99 at every offered rate, each round: the generator's own check."""
    ceiling = online.get("do_nothing", {})
    limit = online_targets.GENERATOR_LIMIT_P99_MS
    lines = [
        "### Load generator check (the do-nothing ceiling at every offered rate)",
        "",
        f"A level is **generator-limited** where the do-nothing service's p99 at the same rate, in the same "
        f"round, exceeds {limit:.0f} ms (or the ceiling did not run it): the figures of every service there are "
        "the load generator's as much as the service's, and no verdict uses them. Past capacity, the burst's "
        "background and the poison mix are checked against the ceiling's worst reading at their rate, over "
        "the rounds and its last run (over the rates past capacity chose).",
        "",
    ]
    readings = [(f"round {i + 1}", r) for i, r in enumerate(ceiling.get("rounds", []))]
    readings += [("past-capacity rates", ceiling["again"])] if "again" in ceiling else []
    if not readings:
        return [*lines, "The ceiling did not run: every level is generator-limited.", ""]
    lines += ["| reading | p99 ms by offered rps (**over the limit**) |", "| --- | --- |"]
    for name, reading in readings:
        levels = reading.get("sweep", [])
        shown = ", ".join(
            f"{s['offered_rps']:,.0f}: "
            + (f"**{s['p99_ms']:.1f}**" if not s["p99_ms"] <= limit else f"{s['p99_ms']:.1f}")
            for s in levels
        )
        lines.append(f"| {name} | {shown or reading.get('error', 'did not run')} |")
    return [*lines, ""]


def _workers_section(workers: dict[str, Any], target_ms: float) -> list[str]:
    counts = workers["workers"]
    rates = workers["offered_rps"]
    lines = [
        "## Goodput against server processes (TANDEM_SERVING_WORKERS)",
        "",
        f"Tandem over the same sweep with {', '.join(counts)} workers on {workers['cpu_count']} cores; each "
        "worker is a server process with its own scoring process and model copy. The 1-worker "
        "row is the Tandem sweep above. RSS sums every process of the service.",
        "",
        "| workers | best goodput at p99 <= target | "
        + " | ".join(f"p99 ms @ {r}" for r in rates)
        + " | CPU ms / request (lowest load) | peak RSS MB |",
        "| ---: | ---: | " + " | ".join("---:" for _ in rates) + " | ---: | ---: |",
    ]
    for n, entry in counts.items():
        if "sweep" not in entry:
            lines.append(f"| {n} | did not run: {entry.get('error')} | " + " | ".join("" for _ in rates) + " | | |")
            continue
        p99 = entry["p99_ms_by_rate"]
        lines.append(
            f"| {n} | {entry['goodput_rps']:,.0f} rps | "
            + " | ".join(f"{p99[str(r)]:.1f}" if str(r) in p99 else "" for r in rates)
            + f" | {entry['sweep'][0]['cpu_ms_per_request']:.2f} | {entry['rss_mb_peak']:,.0f} |"
        )
    lines += [
        "",
        "![goodput vs offered load per worker count](online_workers.png)",
        "",
        "Hollow markers: load levels whose p99 missed the target (not counted as capacity).",
        "",
        _workers_reading(workers),
        "",
    ]
    return lines


def _workers_reading(workers: dict[str, Any]) -> str:
    """One sentence reading the scaling against the cores, whatever the numbers turned out to be."""
    measured = {int(n): e for n, e in workers["workers"].items() if "sweep" in e}
    cores = workers["cpu_count"]
    if 1 not in measured or len(measured) < 2 or measured[1]["goodput_rps"] == 0:
        return "Too few worker counts met the target to say how goodput scales with workers."
    single = measured[1]["goodput_rps"]
    scaling = ", ".join(f"{measured[n]['goodput_rps'] / single:.2f}x with {n}" for n in sorted(measured) if n > 1)
    best_more = max(measured[n]["goodput_rps"] for n in measured if n > 1) / single
    if best_more >= 1.15:
        reading = "one worker left CPU idle, and extra workers turned it into goodput until the cores ran out"
    elif best_more <= 0.87:
        reading = (
            "extra workers cost more than they add: the cores were already busy, and every worker brings "
            "its own event loop, scoring process and model copy to compete for them"
        )
    else:
        reading = "the cores, not the number of server processes, bound goodput"
    memory = ", ".join(f"{measured[n]['rss_mb_peak']:,.0f} MB with {n}" for n in sorted(measured))
    return (
        f"One worker is already two busy processes (event loop and scoring process), one per core on this "
        f"{cores}-core machine; relative to 1 worker, goodput was {scaling}, so {reading}. "
        f"Each worker adds a model copy whatever the goodput: peak RSS {memory}."
    )


def _plot_workers(out: Path, workers: dict[str, Any], target_ms: float) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 5))
    rates = workers["offered_rps"]
    axis.plot(rates, rates, color="grey", linestyle=":", label="every request within target")
    for n, entry in workers["workers"].items():
        sweep = entry.get("sweep")
        if not sweep:
            continue
        offered = [s["offered_rps"] for s in sweep]
        (line,) = axis.plot(offered, [s["goodput_rps"] for s in sweep], marker="o", label=f"{n} worker(s)")
        missed = [s for s in sweep if s["p99_ms"] > target_ms]
        # Hollow markers: load levels whose p99 missed the target, so they cannot count as capacity.
        axis.scatter(
            [s["offered_rps"] for s in missed],
            [s["goodput_rps"] for s in missed],
            s=90,
            facecolors="white",
            edgecolors=line.get_color(),
            zorder=3,
        )
    axis.set_xlabel("offered load (requests/s, open loop)")
    axis.set_ylabel(f"goodput (responses within {target_ms:.0f} ms, per s)")
    axis.set_title(f"Tandem goodput against offered load, by worker count ({workers['cpu_count']} cores)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "online_workers.png", dpi=110)
    plt.close(figure)


def _plot_latency(out: Path, online: dict[str, Any], target_ms: float) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 5.5))
    for service in online.values():
        colour = None
        for run in service.get("rounds", []):
            levels = run.get("sweep")
            if not levels:
                continue
            (line,) = axis.plot(
                [s["offered_rps"] for s in levels],
                [s["p99_ms"] for s in levels],
                marker="o",
                markersize=3,
                alpha=0.8,
                color=colour,
                label=service["label"] if colour is None else None,
            )
            colour = line.get_color()
            limited = [s for s in levels if s.get("generator_limited", True)]
            # Crosses: generator-limited levels (the ceiling's p99 over its limit there), in no verdict.
            axis.scatter(
                [s["offered_rps"] for s in limited], [s["p99_ms"] for s in limited], marker="x", s=60, color=colour
            )
    axis.axhline(target_ms, color="grey", linestyle="--", label=f"p99 target {target_ms:.0f} ms")
    axis.set_yscale("log")
    axis.set_xlabel("offered load (requests/s, open loop)")
    axis.set_ylabel("p99 latency of successful requests (ms)")
    axis.set_title("Online p99 against offered load, one line per round (x: generator-limited level)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "online_latency.png", dpi=110)
    plt.close(figure)


def _plot_batch(out: Path, raw: dict[str, Any], batch: dict[str, Any]) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 4))
    sequential = batch.get("sequential", {})
    labels = [
        *(f"raw forward\nbatch {k}" for k in raw["items_per_second"]),
        *(f"sequential\n{int(k):,} rows" for k in sequential),
        *(f"pipelined\n{int(k):,} rows" for k in batch["partitions"]),
    ]
    values = [
        *raw["items_per_second"].values(),
        *(r["rows_per_second"] for r in sequential.values()),
        *(r["rows_per_second"] for r in batch["partitions"].values()),
    ]
    colours = (
        ["#999999"] * len(raw["items_per_second"])
        + ["#aec7e8"] * len(sequential)
        + ["#1f77b4"] * len(batch["partitions"])
    )
    axis.bar(labels, values, color=colours)
    axis.set_ylabel("items / second")
    axis.set_title("Batch path end to end against the raw model limit")
    axis.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    figure.savefig(out / "batch_throughput.png", dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------- batch path
# Targets of the batch path (issue 18); reported, never asserted, and never lowered.
BATCH_SHARE_OF_BEST_FORWARD = 0.8
BATCH_RSS_RATIO_MAX = 1.2
BATCH_CPU_MS_PER_RECORD_MAX = 0.097


def _again_header(raw: dict[str, Any], *, rule: bool = False) -> str:
    """The raw forward table's columns for its second reading, after the batch path, if there is one."""
    if not raw.get("after_batch"):
        return ""
    return " ---: | ---: |" if rule else " after the batch path, 2 threads | after, 1 thread |"


def _again_cells(raw: dict[str, Any], size: str) -> str:
    again = raw.get("after_batch")
    if not again:
        return ""
    threads = _rate(again["items_per_second"].get(size))
    return f" {threads} | {_rate(again.get('items_per_second_1_thread', {}).get(size))} |"


def _rate(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def _flops(per_item: float | None) -> str:
    """A module that counts no FLOPs (`flops_per_item`) leaves the figure out."""
    return "FLOPs per item not counted by the model" if per_item is None else f"{per_item / 1e6:.1f} MFLOP per item"


def best_raw_forward(raw: dict[str, Any]) -> tuple[float, str]:
    """The best raw forward rate measured at any batch size and thread count, before or after the
    batch path (`raw["after_batch"]`), and where: this machine's speed drifts by a quarter within
    minutes, and the batch path's share must not be flattered by a forward pass measured slow."""
    measured: list[tuple[float, str]] = []
    for reading, when in ((raw, ""), (raw.get("after_batch"), ", after the batch path")):
        if not reading:
            continue
        measured += [
            (rate, f"batch {size}, {reading['threads']} threads{when}")
            for size, rate in reading["items_per_second"].items()
        ]
        measured += [
            (rate, f"batch {size}, 1 thread{when}")
            for size, rate in reading.get("items_per_second_1_thread", {}).items()
        ]
    return max(measured)


def _baseline_commit(batch: dict[str, Any]) -> str:
    return str(batch.get("baseline", {}).get("commit") or online_targets.BASELINE_COMMIT)


def batch_section(raw: dict[str, Any], batch: dict[str, Any]) -> list[str]:
    """The batch path's tables: pipelined against sequential per partition, and the forward batch sweep."""
    best, where = best_raw_forward(raw)
    sequential = batch.get("sequential", {})

    def row(rows: str, result: dict[str, Any]) -> str:
        busy = result.get("stage_busy_s", {})
        stages = ", ".join(f"{stage} {seconds:.1f}" for stage, seconds in busy.items())
        return (
            f"| {int(rows):,} | {result.get('mode', 'pipelined')} | {result.get('forward_batch', '')} "
            f"| {result.get('model_workers', '')} | {result['rows_per_second']:,.0f} "
            f"| {result['rows_per_second'] / best:.0%} | {result['cpu_ms_per_record']:.3f} "
            f"| {result['peak_rss_mb']:,.0f} | {stages} |"
        )

    lines = [
        f"Database: {batch['database']}. Each run scores the partition in its own process (peak RSS and CPU are",
        "that run's) and writes it as new rows. Pipelined and sequential run the same steps on the same partition,",
        f"one after the other. Share = rows/s against the best raw forward rate ({best:,.0f} items/s, {where}).",
        "Stage busy = seconds each stage worked (summed over model workers), not waiting on its neighbours.",
        "",
        "| partition rows | mode | forward batch | model workers | rows/s | share | CPU ms / record | peak RSS MB "
        "| stage busy s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for rows, result in batch["partitions"].items():
        lines.append(row(rows, result))
        if rows in sequential:
            lines.append(row(rows, sequential[rows]))
    sweep = batch.get("forward_batch_sweep", {})
    if sweep.get("runs"):
        lines += [
            "",
            f"Forward batch size, pipelined, {int(sweep['partition_rows']):,}-row partition:",
            "",
            "| forward batch | rows/s | CPU ms / record | peak RSS MB |",
            "| ---: | ---: | ---: | ---: |",
            *[
                f"| {size} | {r['rows_per_second']:,.0f} | {r['cpu_ms_per_record']:.3f} | {r['peak_rss_mb']:,.0f} |"
                for size, r in sweep["runs"].items()
            ],
        ]
    return lines + batch_baseline.section(batch.get("baseline"), _baseline_commit(batch))


def batch_targets(raw: dict[str, Any], batch: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for the batch path, judged on its largest partition."""
    forward = raw["items_per_second"]
    partitions = batch["partitions"]
    largest, smallest = max(partitions, key=int), min(partitions, key=int)
    rate = partitions[largest]["rows_per_second"]
    cpu = partitions[largest]["cpu_ms_per_record"]
    rss_ratio = partitions[largest]["peak_rss_mb"] / partitions[smallest]["peak_rss_mb"]
    best, where = best_raw_forward(raw)
    return [
        (
            f"batch end to end >= {BATCH_SHARE_OF_BEST_FORWARD:.0%} of the best raw forward ({int(largest):,} rows)",
            f"{rate:,.0f} vs {best:,.0f} items/s ({where}): {rate / best:.0%}",
            rate >= BATCH_SHARE_OF_BEST_FORWARD * best,
        ),
        (
            "batch end to end >= 50% of raw forward (batch 1024)",
            f"{rate:,.0f} vs {forward['1024']:,.0f} items/s",
            rate >= 0.5 * forward["1024"],
        ),
        (
            f"batch memory flat (largest within {BATCH_RSS_RATIO_MAX}x of smallest)",
            f"{rss_ratio:.2f}x",
            rss_ratio <= BATCH_RSS_RATIO_MAX,
        ),
        (
            f"batch CPU per record <= {BATCH_CPU_MS_PER_RECORD_MAX} ms ({int(largest):,} rows)",
            f"{cpu:.3f} ms",
            cpu <= BATCH_CPU_MS_PER_RECORD_MAX,
        ),
    ]


# ---------------------------------------------------------------- precision (bench/precision.py)
def _precision_verdict(verdict: str) -> str:
    return {"pays": "pays", "does not pay": "**does not pay**"}.get(verdict, f"_{verdict}_")


def _yes(value: Any) -> str:
    return "yes" if value else "no"


def _spread_cell(entry: dict[str, Any], digits: int = 0) -> str:
    """A median with the rounds' range, or '-' where nothing was measured."""
    if entry.get("median") is None:
        return "-"
    if len(entry.get("runs", [])) < 2:
        return f"{entry['median']:,.{digits}f}"
    return f"{entry['median']:,.{digits}f} ({entry['min']:,.{digits}f}-{entry['max']:,.{digits}f})"


def _difference_cells(d: dict[str, Any]) -> str:
    if not d.get("items"):
        return "- | - | - |"
    return f"{d['max_abs']:.2e} | {d['p99_abs']:.2e} | {d['flips']} of {d['items']:,} ({d['flip_share']:.3%}) |"


def precision_section(precision: dict[str, Any]) -> list[str]:
    """fp32 against bf16 (issue 49): the machine, the forward pass at each size with the score
    differences on a real day, the model stage, the end-to-end runs and the verdict."""
    hw = precision["hardware"]
    flags, onednn = hw["cpuinfo_flags"], hw["onednn_bf16"]
    fp32, bf16 = precision["forward"]["fp32"], precision["forward"]["bf16"]
    model, day = precision["model"], precision["scored_day"]
    lines = [
        "## fp32 and bf16 (issue 49)",
        "",
        f"{hw['cpu_model']}, {hw['cpu_count']} CPUs: AMX bf16 {_yes(flags['amx_bf16'])}, AVX-512 BF16 "
        f"{_yes(flags['avx512_bf16'])} (/proc/cpuinfo; `torch.cpu.get_capabilities()` agrees: amx_bf16 "
        f"{_yes(hw['torch_capabilities']['amx_bf16'])}, avx512_bf16 {_yes(hw['torch_capabilities']['avx512_bf16'])}). "
        f"torch {hw['torch_version']}, oneDNN {hw['onednn_version']} (available {_yes(hw['mkldnn_available'])}, "
        f"enabled {_yes(hw['mkldnn_enabled'])}); a bf16 Linear runs `{onednn['matmul_kernel']}` on "
        f'"{onednn["isa"]}" (oneDNN verbose), AMX {_yes(onednn["uses_amx"])}.',
        "",
        f'bf16 is `torch.autocast("cpu", dtype=torch.bfloat16)` around the forward pass, the sigmoid on the '
        f"logits in fp32. {precision['torch_threads']} torch thread(s), as each batch-path model worker "
        f"({precision['threads_note']}). Model: the reference, trained on {model['train_rows']:,} rows of the "
        f"bench's history (holdout AUC {model['auc']:.3f}). Scored day {day['date']}: {day['items']:,} items, "
        f"threshold {precision['decision_threshold']:g} (`inference.agreement.DECISION_THRESHOLD`). Items/s: "
        f"median of {precision['rounds']} ABAB rounds of {precision['seconds_per_reading']:g} s, range in "
        "brackets. Differences: |bf16 - fp32| of the same items at that batch size (batch 1 and 8 on a "
        "prefix of the day). Raw: `results/precision.json`.",
        "",
        *_precision_load(precision),
        "| batch | fp32 items/s | bf16 items/s | bf16 / fp32 | fp32 CPU ms/item | bf16 CPU ms/item "
        "| max abs difference | p99 abs difference | decisions flipped |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in fp32:
        a, b = fp32[size]["items_per_second"], bf16[size]["items_per_second"]
        ratio = b["median"] / a["median"] if a.get("median") and b.get("median") else float("nan")
        lines.append(
            f"| {size} | {_spread_cell(a)} | {_spread_cell(b)} | {ratio:.2f}x "
            f"| {_spread_cell(fp32[size]['cpu_ms_per_item'], 3)} | {_spread_cell(bf16[size]['cpu_ms_per_item'], 3)} "
            f"| {_difference_cells(precision['differences'][size])}"
        )
    lines += ["", *_precision_stage(precision), *_precision_end_to_end(precision)]
    verdict = precision["verdict"]
    lines += [f"**{verdict['target']}: {verdict['verdict']}.** {verdict['measured']}.", ""]
    return lines


def _precision_load(precision: dict[str, Any]) -> list[str]:
    load = precision.get("loadavg_1m")
    if not load:
        return []
    return [
        f"The machine's 1-minute load average at the phase's start / end: {load['start']:.1f} / {load['end']:.1f} "
        f"({precision['hardware']['cpu_count']} CPUs; other work on the machine counts in it).",
        "",
    ]


def _precision_stage(precision: dict[str, Any]) -> list[str]:
    stage, estimate = precision["model_stage"], precision["estimate"]
    a, b = stage["fp32"]["items_per_second"], stage["bf16"]["items_per_second"]
    line = (
        f"Model stage (`TorchPredictor.complete` on {stage['chunk_rows']:,}-row chunks, forward batch "
        f"{stage['forward_batch']}): fp32 {_spread_cell(a)}, bf16 {_spread_cell(b)} items/s"
    )
    if estimate.get("model_stage_ratio"):
        line += f", {estimate['model_stage_ratio']:.2f}x"
    lines = [line + ".", ""]
    for key, label in (("from_forward", "forward pass"), ("from_model_stage", "model stage")):
        if estimate.get(key):
            lines += [
                f"**An estimate**, not a measurement, from the {label}'s ratio at forward batch "
                f"{stage['forward_batch']}: with the forward pass {estimate['forward_share']:.0%} of the batch path's "
                f"CPU per record (findings.md) and nothing else changed, bf16 would take the batch path's CPU per "
                f"record to {estimate[key]['cpu_per_record_ratio']:.2f}x and, if it stays CPU-bound, its rows/s to "
                f"{estimate[key]['rows_per_second_ratio']:.2f}x of fp32's.",
                "",
            ]
    return lines


def _precision_end_to_end(precision: dict[str, Any]) -> list[str]:
    e2e = precision.get("end_to_end")
    if not e2e:
        return ["The batch path end to end did not run.", ""]
    lines = [
        f"The batch path end to end (`bench.batch_worker --precision`, {e2e['partition_rows']:,}-row partition, "
        "each run in its own process, ABAB; median, runs in brackets):",
        "",
        "| variant | rows/s | CPU ms/record | peak RSS MB |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in e2e["variants"]:
        lines.append(
            f"| {name} | {_spread_cell(e2e['rows_per_second'][name])} "
            f"| {_spread_cell(e2e['cpu_ms_per_record'][name], 3)} | {_spread_cell(e2e['peak_rss_mb'][name])} |"
        )
    d = e2e["stored_scores"]
    if d.get("items"):
        lines += [
            "",
            f"Stored scores of the partition, first bf16 run against the first fp32 run: {d['items']:,} "
            f"records, max abs difference {d['max_abs']:.2e}, p99 {d['p99_abs']:.2e}, {d['flips']} "
            f"decisions flipped ({d['flip_share']:.3%}).",
        ]
    judged = precision.get("verdict_by_variant", {})
    if judged:
        lines += ["", *[f"- {name}: {v['measured']} -> {v['verdict']}." for name, v in judged.items()]]
    return [*lines, ""]
