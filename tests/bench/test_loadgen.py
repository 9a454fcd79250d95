"""The load generator measures the service, not its own process's garbage collector."""

from __future__ import annotations

import gc
import socket
from typing import Any

from bench.loadgen import run_load


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_requests_are_made_with_the_generators_earlier_heap_frozen_and_it_is_thawed_after() -> None:
    frozen_while_sending: list[int] = []
    held_before = [{"object": index} for index in range(1000)]  # what the generator held before the load

    def body_for(index: int) -> tuple[dict[str, Any], bool]:
        frozen_while_sending.append(gc.get_freeze_count())
        return {"transactions": []}, False

    frozen_before = gc.get_freeze_count()
    result = run_load(f"http://127.0.0.1:{_closed_port()}/score", 200, 0.05, body_for, timeout_s=2)

    assert result.sent == 10 and result.connection_errors == 10  # nothing listens: every send failed fast
    assert len(frozen_while_sending) == 10
    assert min(frozen_while_sending) >= frozen_before + len(held_before)
    assert gc.get_freeze_count() == frozen_before


def test_the_generator_reports_its_own_cpu() -> None:
    result = run_load(f"http://127.0.0.1:{_closed_port()}/score", 200, 0.05, lambda _: ({"transactions": []}, False))
    summary = result.summary(50.0)
    assert result.generator_cpu_s > 0
    assert summary["generator_cores"] == result.generator_cpu_s / result.duration_s
