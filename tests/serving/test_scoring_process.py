"""The scoring process's executor (serving/scoring_process.py) against a real child process: the
event loop's calls and other threads' calls, errors, death, shutdown and termination."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from concurrent.futures import CancelledError
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import pytest
import uvloop

from serving.scoring_process import RemoteTraceback, ScoringProcess, run_on
from tests.shared import until

T = TypeVar("T")

CONTEXT = multiprocessing.get_context("forkserver")
# BentoML serves on uvloop, which makes a descriptor it watches non-blocking; asyncio's own loop does not.
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def on_loop(kind: str, work: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=LOOPS[kind]) as runner:
        return runner.run(work)


@pytest.fixture
def process() -> Iterator[ScoringProcess]:
    scoring = ScoringProcess(CONTEXT)
    yield scoring
    scoring.terminate()


@pytest.fixture
def spawned() -> Iterator[ScoringProcess]:
    """A process whose exit code is its own: under a fork server the code is relayed by the
    server, and reads 255 when the server's status pipe is gone (some earlier test's doing)."""
    scoring = ScoringProcess(multiprocessing.get_context("spawn"))
    yield scoring
    scoring.terminate()


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_calls_from_the_loop_and_from_threads_get_their_own_answers(process: ScoringProcess, loop: str) -> None:
    assert process.submit(math.sqrt, 9.0).result(timeout=30) == 3.0

    async def body() -> list[float]:
        from_threads = [asyncio.wrap_future(process.submit(math.sqrt, float(n * n))) for n in range(5)]
        from_loop = [run_on(process, math.sqrt, float(n * n)) for n in range(5, 10)]
        return await asyncio.gather(*from_threads, *from_loop)

    assert on_loop(loop, body()) == [float(n) for n in range(10)]
    assert process.submit(os.getpid).result(timeout=5) == process.pid != os.getpid()


def test_answers_larger_than_the_socket_buffer_arrive_whole_both_ways(process: ScoringProcess) -> None:
    big = os.urandom(6 * 2**20)

    async def body() -> list[bytes]:
        # After uvloop has made the descriptor non-blocking, a thread's call reads and writes it too.
        return [await run_on(process, bytes, big), await asyncio.wrap_future(process.submit(bytes, big))]

    assert on_loop("uvloop", body()) == [big, big]


def test_an_error_comes_back_as_itself_with_the_child_traceback(process: ScoringProcess) -> None:
    with pytest.raises(ValueError, match="math domain error") as raised:
        asyncio.run(run_on(process, math.sqrt, -1.0))
    assert isinstance(raised.value.__cause__, RemoteTraceback)
    assert "Traceback" in str(raised.value.__cause__)
    assert asyncio.run(run_on(process, math.sqrt, 4.0)) == 2.0, "the process serves on"


def test_an_answer_that_cannot_be_pickled_fails_that_call_alone(process: ScoringProcess) -> None:
    with pytest.raises(RuntimeError, match="could not be sent back"):
        process.submit(threading.Lock).result(timeout=30)
    assert process.submit(math.sqrt, 16.0).result(timeout=5) == 4.0


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_cancelled_wait_leaves_the_pipe_in_step(process: ScoringProcess, loop: str) -> None:
    async def body() -> float:
        waiting = asyncio.ensure_future(run_on(process, time.sleep, 0.3))
        await asyncio.sleep(0.05)
        waiting.cancel()
        # The next call waits for the cancelled one's answer to be read, then gets its own.
        return await run_on(process, math.sqrt, 25.0)

    assert on_loop(loop, body()) == 5.0


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_killed_process_fails_the_call_in_flight_and_every_later_one(process: ScoringProcess, loop: str) -> None:
    process.submit(abs, 1).result(timeout=30)

    async def body() -> None:
        waiting = asyncio.ensure_future(run_on(process, time.sleep, 60))
        await asyncio.sleep(0.2)
        os.kill(process.pid or 0, 9)
        with pytest.raises(BrokenProcessPool):
            await asyncio.wait_for(waiting, timeout=10)
        with pytest.raises(BrokenProcessPool):
            await run_on(process, abs, 1)

    on_loop(loop, body())
    with pytest.raises(BrokenProcessPool):
        process.submit(abs, 1)


def test_an_initializer_that_fails_breaks_the_process_with_its_reason() -> None:
    scoring = ScoringProcess(CONTEXT, initializer=int, initargs=("not a number",))
    try:
        with pytest.raises(BrokenProcessPool, match="failed to start: ValueError"):
            scoring.submit(abs, 1).result(timeout=30)
        with pytest.raises(BrokenProcessPool):
            asyncio.run(run_on(scoring, abs, 1))
    finally:
        scoring.terminate()


def test_terminate_stops_a_process_stuck_in_its_initializer() -> None:
    scoring = ScoringProcess(CONTEXT, initializer=time.sleep, initargs=(600,))
    pending = scoring.submit(abs, 1)
    started = time.monotonic()
    scoring.terminate()
    assert time.monotonic() - started < 12
    assert not scoring.process.is_alive()
    with pytest.raises((BrokenProcessPool, CancelledError)):
        pending.result(timeout=10)


def test_shutdown_finishes_what_is_queued_then_ends_the_process(spawned: ScoringProcess) -> None:
    process = spawned
    first = process.submit(time.sleep, 0.2)
    second = process.submit(math.sqrt, 36.0)
    process.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="after shutdown"):
        process.submit(abs, 1)
    assert first.result(timeout=10) is None
    assert second.result(timeout=10) == 6.0
    # Not join(): the shutdown's own thread is joining it, and of two joins one may see no status.
    until(lambda: process.process.exitcode is not None)
    assert process.process.exitcode == 0


def test_shutdown_with_wait_returns_once_the_process_has_exited(spawned: ScoringProcess) -> None:
    process = spawned

    async def body() -> None:
        assert await run_on(process, abs, -3) == 3
        await asyncio.to_thread(process.shutdown, True)

    asyncio.run(body())
    assert process.process.exitcode == 0


def test_an_answer_to_another_call_is_refused_and_breaks_the_process(process: ScoringProcess) -> None:
    # Whatever put the pipe out of step, one batch's scores must never be handed to another's requests.
    with pytest.raises(BrokenProcessPool, match="answered call 6 when call 7 was due"):
        process._checked((6, "ok", [0.5]), 7)
    with pytest.raises(BrokenProcessPool):
        process.submit(abs, 1)
