"""report.md and its plots (bench/ for a full run), from the numbers one bench run measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; this machine has no display
import matplotlib.pyplot as plt

from bench.loadgen import best_goodput


def _max_goodput(service: dict[str, Any], target_ms: float) -> float:
    return best_goodput(service.get("sweep", []), target_ms)


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
) -> None:
    """`phases`: (name, estimated seconds, measured seconds) of the phases run so far."""
    _plot_latency(out, online, target_ms)
    _plot_batch(out, raw, batch)
    _plot_workers(out, workers, target_ms)
    forward = raw["items_per_second"]
    partitions = batch["partitions"]
    largest = max(partitions, key=int)
    smallest = min(partitions, key=int)
    goodput = {name: _max_goodput(service, target_ms) for name, service in online.items()}
    lines = [
        "# Tandem benchmark report",
        "",
        f"One run on this machine ({'quick mode' if quick else 'full mode'}, {seconds / 60:.1f} min), every figure",
        "measured side by side. Raw numbers: `results/*.json` next to this file. Regenerate: `make bench`",
        "(`make bench-quick` writes a quick run to a temporary directory instead).",
        "",
        "## Raw model forward (the limit)",
        "",
        f"{raw['parameter_count']:,} parameters, {raw['flops_per_item'] / 1e6:.1f} MFLOP per item, "
        f"{raw['threads']} threads.",
        "",
        "| batch size | items/s |",
        "| ---: | ---: |",
        *[f"| {size} | {rate:,.0f} |" for size, rate in forward.items()],
        "",
        "## Batch path",
        "",
        f"Database: {batch['database']}. Each partition scored in its own process (peak RSS is that partition's).",
        "",
        "| partition rows | rows/s end to end | CPU ms / record | peak RSS MB |",
        "| ---: | ---: | ---: | ---: |",
        *[
            f"| {int(rows):,} | {r['rows_per_second']:,.0f} | {r['cpu_ms_per_record']:.3f} | {r['peak_rss_mb']:,.0f} |"
            for rows, r in partitions.items()
        ],
        "",
        f"Upsert into `predictions`: {batch['upsert']['insert_rows_per_second']:,.0f} rows/s new, "
        f"{batch['upsert']['replay_noop_rows_per_second']:,.0f} rows/s replayed (no-op).",
        "",
        "![batch throughput](batch_throughput.png)",
        "",
        "## Online path (open-loop load, latency from the scheduled send time)",
        "",
        f"Declared p99 target: {target_ms:.0f} ms. Goodput = responses within the target per second, at the best",
        "load level whose p99 met the target.",
        "",
        "| service | best goodput at p99 <= target | CPU ms / request (lowest load) |",
        "| --- | ---: | ---: |",
    ]
    for name, service in online.items():
        if "error" in service:
            lines.append(f"| {service['label']} | did not start: {service['error']} | |")
            continue
        cpu = service["sweep"][0]["cpu_ms_per_request"] if service["sweep"] else float("nan")
        lines.append(f"| {service['label']} | {goodput[name]:,.0f} rps | {cpu:.2f} |")
    lines += ["", "![latency vs offered load](online_latency.png)", "", "### Sweeps", ""]
    for service in online.values():
        if "sweep" not in service:
            continue
        lines += [
            f"**{service['label']}**",
            "",
            "| offered rps | p50 ms | p99 ms | p99.9 ms | goodput rps | shed | timeouts | CPU ms/req |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *[
                f"| {s['offered_rps']:.0f} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['p999_ms']:.1f} | "
                f"{s['goodput_rps']:.0f} | {s['shed']} | {s['client_timeouts']} | {s['cpu_ms_per_request']:.2f} |"
                for s in service["sweep"]
            ],
            "",
        ]
    lines += _workers_section(workers, target_ms)
    tandem = online.get("tandem", {})
    stock = online.get("stock_bentoml", {})
    lines += ["## Overload, bursts, poison", ""]
    if "overload_4x" in tandem:
        o = tandem["overload_4x"]
        lines.append(
            f"- Overload at {o['offered_rps']:.0f} rps (4x measured capacity): accepted p99 {o['p99_ms']:.1f} ms, "
            f"{o['shed']} shed with p99 {o['shed_p99_ms']:.1f} ms, {o['client_timeouts']} client timeouts, "
            f"RSS {o['rss_mb_before']:.0f} -> {o['rss_mb_after']:.0f} MB."
        )
    if "burst_64" in tandem:
        b = tandem["burst_64"]
        lines.append(
            f"- Burst of 64 simultaneous requests: {b['statuses']}, shed {b['shed']}, p99 {b['p99_ms']:.1f} ms."
        )
    for label, service in (("Tandem", tandem), ("stock BentoML", stock)):
        if "poison_2pct" in service:
            p = service["poison_2pct"]
            lines.append(
                f"- 2% poison inputs at {p['offered_rps']:.0f} rps, {label}: {p['collateral_failures']} collateral "
                f"failures among good requests (statuses {p['statuses']})."
            )
    lines += ["", "## Targets", "", "| target | measured | verdict |", "| --- | --- | --- |"]
    ceiling = goodput.get("do_nothing", 0.0)
    ours = goodput.get("tandem", 0.0)
    stock_goodput = goodput.get("stock_bentoml", 0.0)
    unbatched = goodput.get("tandem_unbatched", 0.0)
    batch_rate = partitions[largest]["rows_per_second"]
    online_cpu = tandem["sweep"][0]["cpu_ms_per_request"] if tandem.get("sweep") else float("nan")
    batch_cpu = partitions[largest]["cpu_ms_per_record"]
    rss_ratio = partitions[largest]["peak_rss_mb"] / partitions[smallest]["peak_rss_mb"]
    drifted_p99 = online.get("drifted", {}).get("sweep", [{}])[0].get("p99_ms", float("nan"))
    our_p99 = tandem["sweep"][0]["p99_ms"] if tandem.get("sweep") else float("nan")
    rows = [
        (
            "goodput >= 3x stock BentoML",
            f"{ours:,.1f} vs {stock_goodput:,.1f} rps",
            ours > 0 and ours >= 3 * stock_goodput,
        ),
        ("goodput >= half the do-nothing ceiling", f"{ours:,.1f} vs {ceiling:,.1f} rps", ours >= ceiling / 2),
        (
            "batching >= 3x unbatched at the target",
            f"{ours:,.1f} vs {unbatched:,.1f} rps",
            ours > 0 and ours >= 3 * unbatched,
        ),
        (
            "nothing shed in a 64-request burst",
            str(tandem.get("burst_64", {}).get("shed")),
            tandem.get("burst_64", {}).get("shed") == 0,
        ),
        (
            "zero collateral failures (Tandem)",
            str(tandem.get("poison_2pct", {}).get("collateral_failures")),
            tandem.get("poison_2pct", {}).get("collateral_failures") == 0,
        ),
        (
            "batch cost per record >= 10x below online",
            f"{batch_cpu:.3f} vs {online_cpu:.2f} CPU ms",
            online_cpu >= 10 * batch_cpu,
        ),
        (
            "batch end to end >= 50% of raw forward (batch 1024)",
            f"{batch_rate:,.0f} vs {forward['1024']:,.0f} items/s",
            batch_rate >= 0.5 * forward["1024"],
        ),
        ("batch memory flat (largest within 1.2x of smallest)", f"{rss_ratio:.2f}x", rss_ratio <= 1.2),
        (
            "drifted baseline p99 >= 20x ours (lowest load)",
            f"{drifted_p99:,.1f} vs {our_p99:,.1f} ms",
            drifted_p99 >= 20 * our_p99,
        ),
    ]
    lines += [f"| {name} | {measured} | {_verdict(ok)} |" for name, measured, ok in rows]
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
    figure, axis = plt.subplots(figsize=(8, 5))
    for service in online.values():
        sweep = service.get("sweep")
        if not sweep:
            continue
        axis.plot([s["offered_rps"] for s in sweep], [s["p99_ms"] for s in sweep], marker="o", label=service["label"])
    axis.axhline(target_ms, color="grey", linestyle="--", label=f"p99 target {target_ms:.0f} ms")
    axis.set_yscale("log")
    axis.set_xlabel("offered load (requests/s, open loop)")
    axis.set_ylabel("p99 latency of successful requests (ms)")
    axis.set_title("Online p99 latency against offered load")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "online_latency.png", dpi=110)
    plt.close(figure)


def _plot_batch(out: Path, raw: dict[str, Any], batch: dict[str, Any]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    labels = [f"raw forward\nbatch {k}" for k in raw["items_per_second"]] + [
        f"batch path\n{int(k):,} rows" for k in batch["partitions"]
    ]
    values = list(raw["items_per_second"].values()) + [r["rows_per_second"] for r in batch["partitions"].values()]
    axis.bar(labels, values, color=["#999999"] * len(raw["items_per_second"]) + ["#1f77b4"] * len(batch["partitions"]))
    axis.set_ylabel("items / second")
    axis.set_title("Batch path end to end against the raw model limit")
    axis.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    figure.savefig(out / "batch_throughput.png", dpi=110)
    plt.close(figure)
