"""Stage threads joined by bounded queues, for the batch path's partition pipeline.

Written by hand: the stages are a handful of threads over polars, numpy, torch and psycopg (which
release the GIL), and neither concurrent.futures nor asyncio stops every stage at the first
failure and bounds each hand-over; this does both in one small class.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_POLL_S = 0.05
_T = TypeVar("_T")
Channel = queue.Queue[Any]  # one bounded hand-over between two stages


class Aborted(Exception):
    """Raised inside a stage when another stage failed: stop, the partition is not written."""


class End:
    """Marks the end of the stream on a queue."""


END = End()


class Pipeline:
    """Stage threads joined by bounded queues; the first failure stops every stage.

    A stage blocked on a full or empty queue wakes up within _POLL_S of a failure elsewhere, so
    no thread outlives `close()` by more than the item it is working on.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth  # items each queue between two stages may hold
        self.aborted = threading.Event()
        self.failure: BaseException | None = None
        self.threads: list[threading.Thread] = []
        self.busy: dict[str, float] = {}
        self._lock = threading.Lock()

    def channel(self) -> Channel:
        return queue.Queue(maxsize=self.depth)

    def put(self, channel: Channel, item: Any) -> None:
        while not self.aborted.is_set():
            try:
                channel.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue
        raise Aborted

    def get(self, channel: Channel) -> Any:
        while not self.aborted.is_set():
            try:
                return channel.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        raise Aborted

    def acquire(self, permits: threading.Semaphore) -> None:
        while not self.aborted.is_set():
            if permits.acquire(timeout=_POLL_S):
                return
        raise Aborted

    def items(self, channel: Channel) -> Iterator[Any]:
        while not isinstance(item := self.get(channel), End):
            yield item

    def timed(self, stage: str, started: float) -> None:
        with self._lock:
            self.busy[stage] = self.busy.get(stage, 0.0) + time.perf_counter() - started

    def timing(self, stage: str, step: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        began = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            self.timed(stage, began)

    def start(self, stage: str, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except Aborted:
                pass
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread by close()
                self.fail(error)

        thread = threading.Thread(target=run, name=f"tandem-batch-{stage}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = error
        self.aborted.set()

    def close(self) -> None:
        """Stop every stage (a no-op for stages already done) and wait for each to return."""
        self.aborted.set()
        for thread in self.threads:
            thread.join()
