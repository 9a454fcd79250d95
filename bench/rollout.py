"""The champion's p99 through a whole rollout: shadowing a challenger, then promoting it under load.

A phase of the shadow scenario (bench/shadow.py). One Tandem service shadows a fresh challenger at
the default 10% sample; open-loop load runs for the whole window, and part way through the
challenger is promoted (`modelstore.promote`, what `tandem models promote --from-challenger` does
once the gate passes). The service's ModelWatcher then loads and warms the new version in a process
of its own and swaps it in between batches, while the ChallengerWatcher stops the shadow process.
Every request of the window counts: the p99 must stay within the target through all of it.

The window's p99 is judged against the target only where the do-nothing ceiling vouches for the
rate; the swap must also finish inside the window, or the window did not measure it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench import online_targets
from bench.challenger import register_untrained, scrape_prefixed, wait_for_challenger
from bench.harness import TARGET_P99_MS, BenchEnv, fresh_bodies, say, settle, start_service, tandem_spec
from bench.loadgen import run_load

SAMPLE = 0.1
METRICS_POLL_S = 0.5  # the load generator shares this process: scrape gently


@dataclass(frozen=True)
class RolloutPlan:
    window_s: float
    promote_at_s: float

    @classmethod
    def for_mode(cls, quick: bool) -> RolloutPlan:
        # The swap (pointer poll every 2 s, a new scoring process, model load, warm-up) takes a few
        # seconds on two cores; the window leaves it room and runs on after it.
        return cls(15.0, 4.0) if quick else cls(30.0, 10.0)

    def estimate_s(self) -> float:
        return 25.0 + 5.0 + self.window_s + 5.0  # service start, challenger start, window, settle


def _swap_watch(port: int, tag: str, promote_at_s: float, deadline_s: float, outcome: dict[str, Any]) -> None:
    """Promote `tag` after `promote_at_s`, then note how long until the service serves it and has
    stopped shadowing (from /metrics)."""
    from tandem import modelstore

    time.sleep(promote_at_s)
    promoted = time.monotonic()
    modelstore.promote(tag)
    outcome["promoted_at_s"] = promote_at_s
    while time.monotonic() - promoted < deadline_s:
        metrics = scrape_prefixed(port, ("tandem_serving_model_info", "tandem_shadow_model_info"))
        serving = any(
            n == "tandem_serving_model_info" and dict(ls).get("model_version") == tag and v >= 1
            for (n, ls), v in metrics.items()
        )
        shadowing = any(n == "tandem_shadow_model_info" and v >= 1 for (n, ls), v in metrics.items())
        if serving and "serving_after_s" not in outcome:
            outcome["serving_after_s"] = round(time.monotonic() - promoted, 1)
        if serving and not shadowing:
            outcome["shadow_stopped_after_s"] = round(time.monotonic() - promoted, 1)
            return
        time.sleep(METRICS_POLL_S)


def rollout_run(
    bench: BenchEnv, rate: int, good: list[dict[str, Any]], champion: str, *, quick: bool
) -> dict[str, Any]:
    """Shadow a fresh challenger, promote it under `rate` rps, and put the champion back afterwards."""
    from tandem import modelstore

    plan = RolloutPlan.for_mode(quick)
    candidate = modelstore.challenge(register_untrained(bench.model_spec, 2))
    base = tandem_spec()
    spec = type(base)(
        "rollout",
        f"Tandem, shadow sample {SAMPLE:g}, promoted under load",
        base.argv,
        {**base.extra_env, "TANDEM_SERVING_SHADOW_SAMPLE": str(SAMPLE)},
    )
    run: dict[str, Any] = {"rate": rate, "candidate": candidate, "champion": champion, **plan.__dict__}
    service = start_service(spec, bench)
    if isinstance(service, str):
        modelstore.clear_challenger(candidate.split(":", 1)[0])
        return run | {"error": service}
    try:
        run["challenger_ready_s"] = round(wait_for_challenger(service, candidate), 1)
        body = fresh_bodies(bench.model_spec, good, "rollout")
        run_load(service.url, 20, 2.0, body)  # warm-up, as the shadow levels
        settle(service, body)
        swap: dict[str, Any] = {}
        watcher = threading.Thread(
            target=_swap_watch,
            args=(service.port, candidate, plan.promote_at_s, plan.window_s - plan.promote_at_s, swap),
            daemon=True,
        )
        cpu_before = service.cpu_seconds()
        watcher.start()
        result = run_load(service.url, rate, plan.window_s, body)
        watcher.join(timeout=10)
        cpu = service.cpu_seconds() - cpu_before
        run["window"] = result.summary(TARGET_P99_MS) | {
            "errors_5xx": sum(n for code, n in result.statuses.items() if code.startswith("5") and code != "503"),
            "cpu_ms_per_request": cpu * 1000 / max(result.sent, 1),
            "loadavg_1m": os.getloadavg()[0],
        }
        run["swap"] = swap
        w = run["window"]
        say(
            f"rollout @ {rate} rps over {plan.window_s:g} s, promoted at {plan.promote_at_s:g} s: "
            f"p50 {w['p50_ms']:.1f} p99 {w['p99_ms']:.1f} ms, goodput {w['goodput_rps']:.0f}, shed {w['shed']}, "
            f"5xx {w['errors_5xx']}; serving the new version after {swap.get('serving_after_s', 'never')} s, "
            f"shadow stopped after {swap.get('shadow_stopped_after_s', 'never')} s"
        )
    except RuntimeError as error:
        say(f"rollout: {error}")
        run["error"] = str(error)
    finally:
        service.stop()
        # The store as the other phases found it: the champion in production, no challenger.
        modelstore.promote(champion)
        modelstore.clear_challenger(champion.split(":", 1)[0])
    return run


def judge_rollout(run: dict[str, Any], ceiling: dict[int, float]) -> dict[str, Any]:
    """p99 within the target through the rollout, and no request refused or failed on its account."""
    name = "p99 within the target through a rollout (shadowing, then a promotion under load)"
    window = run.get("window")
    if window is None:
        return {"target": name, "measured": run.get("error", "did not run"), "verdict": online_targets.NOT_MEASURABLE}
    online_targets.mark(window, ceiling)
    swap = run.get("swap", {})
    measured = (
        f"{run['rate']} rps for {run['window_s']:g} s, promoted at {run['promote_at_s']:g} s: p99 "
        f"{window['p99_ms']:.1f} ms (target {TARGET_P99_MS:g}), shed {window['shed']}, 5xx {window['errors_5xx']}, "
        f"timeouts {window['client_timeouts']}; the new version served after {swap.get('serving_after_s', 'never')} s"
    )
    if window["generator_limited"]:
        return {"target": name, "measured": measured + " (generator-limited)", "verdict": online_targets.NOT_MEASURABLE}
    if "serving_after_s" not in swap:
        return {
            "target": name,
            "measured": measured + " (the swap did not finish inside the window)",
            "verdict": online_targets.NOT_MEASURABLE,
        }
    clean = not (window["shed"] or window["errors_5xx"] or window["client_timeouts"] or window["connection_errors"])
    met = window["p99_ms"] <= TARGET_P99_MS and clean
    return {"target": name, "measured": measured, "verdict": online_targets.MET if met else online_targets.MISSED}
