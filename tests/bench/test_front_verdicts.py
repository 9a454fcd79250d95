"""Issue 14's targets are judged for the service behind HAProxy as well, against its own capacity,
and a front that did not run is said to be unmeasured, never met."""

from __future__ import annotations

from typing import Any

from bench.online_targets import FRONT_SUFFIX, MET, MISSED, NOT_MEASURABLE, judge, mark_service

TARGET_MS = 50.0


def level(rps: float, p99_ms: float, goodput: float, **more: Any) -> dict[str, Any]:
    return {"offered_rps": rps, "p99_ms": p99_ms, "goodput_rps": goodput, **more}


def overload(rps: float, p99_ms: float, goodput: float, shed_p99_ms: float) -> dict[str, Any]:
    return level(
        rps,
        p99_ms,
        goodput,
        shed=100,
        shed_p99_ms=shed_p99_ms,
        shed_without_retry_after=0,
        client_timeouts=0,
        connection_errors=0,
    )


def services(front: dict[str, Any], front_postgres: dict[str, Any] | None = None) -> dict[str, Any]:
    ceiling_rates = [300, 600, 1000, 1500, 2000, 4000]
    online = {
        "do_nothing": {"sweep": [level(r, 1.0, r) for r in ceiling_rates]},
        "tandem": {"sweep": [level(1000, 45.0, 1000)]},
        "tandem_postgres": {"sweep": [level(300, 20.0, 300), level(600, 70.0, 400)]},
        "stock_bentoml": {"sweep": [level(300, 40.0, 100)]},
        "tandem_front": front,
    }
    if front_postgres is not None:
        online["tandem_front_postgres"] = front_postgres
    ceiling = {int(s["offered_rps"]): s["p99_ms"] for s in online["do_nothing"]["sweep"]}
    for service in online.values():
        mark_service(service, ceiling)
    return online


def front_rows(online: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        t["target"].removesuffix(FRONT_SUFFIX): t
        for t in judge(online, TARGET_MS)["targets"]
        if FRONT_SUFFIX in t["target"]
    }


def test_the_front_is_judged_against_its_own_capacity() -> None:
    front = {
        "sweep": [level(1000, 40.0, 1000)],
        "overload": {
            "1.5x": overload(1500, 45.0, 950, 8.0),
            "2x": overload(2000, 48.0, 920, 9.0),
            "4x": overload(4000, 62.0, 800, 9.5),
        },
        "burst_64": {
            "background_rps": 300,
            "background": level(300, 30.0, 300),
            "burst": level(300, 90.0, 64, shed=0, ok=64),
            "ceiling_burst_p99_ms": 20.0,
        },
    }
    rows = front_rows(services(front))
    assert rows["goodput at p99 <= 50 ms >= 800 rps (embedded SQLite)"]["verdict"] == MET
    accepted = rows["past capacity: accepted p99 <= 50 ms"]
    assert accepted["verdict"] == MISSED and accepted["numbers"]["by_factor"] == {"1.5x": MET, "2x": MET, "4x": MISSED}
    assert rows["past capacity: shed p99 <= 10 ms, every shed answer with Retry-After"]["verdict"] == MET
    goodput = next(row for name, row in rows.items() if name.startswith("past capacity: goodput"))
    assert goodput["verdict"] == MISSED  # 800 < 90% of 1,000
    assert rows["a burst of 64 at moderate load: 0 shed, p99 <= 100 ms"]["verdict"] == MET
    assert rows["goodput at the target >= 8x stock BentoML"]["numbers"]["ratio"] == 10.0


def test_the_fronts_postgresql_figure_is_its_own() -> None:
    front = {"sweep": [level(1000, 40.0, 1000)]}
    goodput = "goodput at p99 <= 50 ms >= 800 rps (embedded SQLite)"
    on_postgres = {"sweep": [level(300, 30.0, 300), level(600, 45.0, 590), level(1000, 80.0, 700)]}
    assert front_rows(services(front, on_postgres))[goodput]["numbers"] == {"sqlite_rps": 1000, "postgres_rps": 590}
    # Without its own run, the front is not credited with the service alone's PostgreSQL figure.
    assert front_rows(services(front))[goodput]["numbers"]["postgres_rps"] is None


def test_a_front_that_did_not_run_is_not_measured() -> None:
    rows = front_rows(services({"label": "front", "error": "haproxy is not installed"}))
    assert list(rows.values()) == [
        {
            "target": "issue 14's targets" + FRONT_SUFFIX,
            "measured": "haproxy is not installed",
            "verdict": NOT_MEASURABLE,
            "numbers": {},
        }
    ]
