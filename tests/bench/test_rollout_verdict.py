"""The rollout phase's verdict (bench/rollout.py): met only when the window measured a finished swap
at a rate the generator vouches for, within the p99 target, with nothing refused or failed."""

from __future__ import annotations

from typing import Any

from bench.online_targets import MET, MISSED, NOT_MEASURABLE
from bench.rollout import judge_rollout

RATE = 360
VOUCHED = {RATE: 1.8}  # the do-nothing ceiling's p99 at this rate, ms


def _run(p99_ms: float = 30.0, *, swapped: bool = True, **window: Any) -> dict[str, Any]:
    counts = {"shed": 0, "errors_5xx": 0, "client_timeouts": 0, "connection_errors": 0} | window
    return {
        "rate": RATE,
        "window_s": 30.0,
        "promote_at_s": 10.0,
        "window": {"offered_rps": RATE, "p99_ms": p99_ms, **counts},
        "swap": {"promoted_at_s": 10.0, **({"serving_after_s": 2.0} if swapped else {})},
    }


def test_a_clean_window_within_the_target_is_met() -> None:
    assert judge_rollout(_run(), VOUCHED)["verdict"] == MET


def test_a_window_over_the_target_or_with_a_refusal_is_missed() -> None:
    assert judge_rollout(_run(61.0), VOUCHED)["verdict"] == MISSED
    assert judge_rollout(_run(shed=3), VOUCHED)["verdict"] == MISSED
    assert judge_rollout(_run(errors_5xx=1), VOUCHED)["verdict"] == MISSED


def test_without_a_finished_swap_or_a_vouched_rate_nothing_is_judged() -> None:
    assert judge_rollout(_run(swapped=False), VOUCHED)["verdict"] == NOT_MEASURABLE
    assert judge_rollout(_run(), {RATE: 12.0})["verdict"] == NOT_MEASURABLE  # the generator's own p99
    assert judge_rollout({"error": "did not start"}, VOUCHED)["verdict"] == NOT_MEASURABLE
