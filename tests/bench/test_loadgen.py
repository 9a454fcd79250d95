"""The load generator measures the service, not its own process's garbage collector."""

from __future__ import annotations

import gc
import math
import socket
import threading
from typing import Any

import pytest

from bench.loadgen import ONSET_S, LoadResult, run_load
from tests.shared import free_port


def test_requests_are_made_with_the_generators_earlier_heap_frozen_and_it_is_thawed_after() -> None:
    frozen_while_sending: list[int] = []
    held_before = [{"object": index} for index in range(1000)]  # what the generator held before the load

    def body_for(index: int) -> tuple[dict[str, Any], bool]:
        frozen_while_sending.append(gc.get_freeze_count())
        return {"transactions": []}, False

    frozen_before = gc.get_freeze_count()
    result = run_load(f"http://127.0.0.1:{free_port()}/score", 200, 0.05, body_for, timeout_s=2)

    assert result.sent == 10 and result.connection_errors == 10  # nothing listens: every send failed fast
    assert len(frozen_while_sending) == 10
    assert min(frozen_while_sending) >= frozen_before + len(held_before)
    assert gc.get_freeze_count() == frozen_before


def test_the_generator_reports_its_own_cpu() -> None:
    result = run_load(f"http://127.0.0.1:{free_port()}/score", 200, 0.05, lambda _: ({"transactions": []}, False))
    summary = result.summary(50.0)
    assert result.generator_cpu_s > 0
    assert summary["generator_cores"] == result.generator_cpu_s / result.duration_s


class CannedServer:
    """Answers every request on a connection with `answer`, or never answers when it is None, and
    counts the connections it accepted."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            pending = b""
            while chunk := connection.recv(65536):
                pending += chunk
                while b"\r\n\r\n" in pending:
                    head, _, rest = pending.partition(b"\r\n\r\n")
                    length = int(
                        next(
                            line.split(b":")[1]
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length")
                        )
                    )
                    if len(rest) < length:
                        break
                    pending = rest[length:]
                    if self.answer is not None:
                        connection.sendall(self.answer)

    def close(self) -> None:
        self.listener.close()


def _response(status: str, *headers: str, body: bytes = b"{}") -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _load_against(
    answer: bytes | None, rate: float, seconds: float, *, poison_first: bool = False, **options: Any
) -> tuple[LoadResult, CannedServer]:
    """`run_load` against a server that answers every request with `answer` (None: never)."""

    def body(index: int) -> tuple[dict[str, Any], bool]:
        return {"transactions": []}, poison_first and index == 0

    server = CannedServer(answer)
    try:
        return run_load(f"http://127.0.0.1:{server.port}/score", rate, seconds, body, **options), server
    finally:
        server.close()


def test_answers_are_counted_by_status_on_reused_keep_alive_connections() -> None:
    result, server = _load_against(_response("200 OK"), 100, 0.5)
    assert result.statuses == {"200": 50} and len(result.latencies_ms) == 50
    assert server.connections < 10, "one request at a time per connection, idle ones reused"


def test_shed_answers_without_retry_after_are_counted() -> None:
    answers = _response("503 Service Unavailable") + _response("429 Too Many Requests", "Retry-After: 1")
    # Each request gets both: the second is stray bytes, and closes the connection.
    result, server = _load_against(answers, 50, 0.2)
    assert result.statuses.get("503", 0) == result.sent == 10
    assert result.shed_without_retry_after == 10 and len(result.shed_latencies_ms) == 10
    assert result.connection_errors == 0 and result.client_timeouts == 0
    assert server.connections == 10, "a connection that brought an answer nobody asked for is not reused"


def test_a_request_never_answered_is_a_timeout_and_its_connection_is_not_reused() -> None:
    result, server = _load_against(None, 50, 0.1, poison_first=True, timeout_s=0.3)
    assert result.client_timeouts == result.sent == 5 and result.statuses == {"timeout": 5}
    assert result.collateral_failures == 4, "the poison request's timeout is not collateral"
    assert server.connections == 5


def test_the_onset_of_a_level_is_reported_apart_from_the_rest() -> None:
    # Five slow answers to requests due in the first half second, 95 fast ones after: the level's
    # p99 is the onset's, and the split shows it.
    result = LoadResult(
        offered_rps=100,
        duration_s=1.0,
        sent=110,
        latencies_ms=[100.0] * 5 + [10.0] * 95,
        statuses={"200": 100, "503": 10},
        shed_latencies_ms=[30.0] * 10,
        client_timeouts=0,
        latency_sent_s=[0.1] * 5 + [ONSET_S + 0.2] * 95,
        shed_sent_s=[0.0] * 10,
    )
    summary = result.summary(50.0)
    assert summary["p99_ms"] > 90
    assert summary["onset_p99_ms"] == 100.0 and summary["after_onset_p99_ms"] == 10.0
    assert summary["shed_onset_p99_ms"] == 30.0 and math.isnan(summary["shed_after_onset_p99_ms"])
    assert "latency_sent_s" not in result.to_json()


def test_each_answer_is_placed_by_when_its_request_was_due() -> None:
    result, _ = _load_against(_response("200 OK"), 40, 1.0)
    assert len(result.latency_sent_s) == len(result.latencies_ms) == 40
    assert sorted(result.latency_sent_s) == pytest.approx([index / 40 for index in range(40)])
    summary = result.summary(50.0)
    for part in ("onset_p99_ms", "after_onset_p99_ms"):  # 20 answers each side of the half second
        assert 0 < summary[part] <= max(result.latencies_ms)
