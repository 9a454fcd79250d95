"""Scoring backends: one model version's scoring step, its warm-up, and the switch between two
versions that takes effect between two batches (hot swap, a replaced scoring process)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from inference.spec import LoadedSpec
from inference.spec.api import record_model
from serving.batcher import ProcessFn
from serving.scoring import BatchResult, ItemSpec
from serving.scoring_process import run_on, terminate

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(frozen=True)
class ScoringBackend:
    """One model version's scoring step: the version, the pool it runs on and the function the pool calls."""

    model_version: str
    executor: Executor
    process: ProcessFn


class _BatchDispatch(Executor):
    """The batcher's executor: forwards to the serving version's pool and notes that a batch has
    started, so a switch waits for the end of that batch and its retries."""

    def __init__(self, target: Executor) -> None:
        self.target = target
        self.busy = False

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        self.busy = True
        return self.target.submit(fn, *args, **kwargs)

    async def run_on_loop(self, fn: Callable[..., _T], /, *args: Any) -> _T:
        self.busy = True
        return await run_on(self.target, fn, *args)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.target.shutdown(wait, cancel_futures=cancel_futures)

    def terminate(self) -> None:
        terminate(self.target)


class BackendSwitch:
    """The backend that serves, and a pending switch to another one, which takes effect in
    `between_batches`; `on_switch(backend)` tells the owner in the same synchronous step.
    """

    def __init__(self, serving: ScoringBackend, on_switch: Callable[[ScoringBackend], None]) -> None:
        self.serving = serving
        self.dispatch = _BatchDispatch(serving.executor)
        self._on_switch = on_switch
        self._pending: tuple[ScoringBackend, asyncio.Future[ScoringBackend]] | None = None

    def swap(self, backend: ScoringBackend) -> asyncio.Future[ScoringBackend]:
        """Serve `backend` (already warm) from the next batch on: at once when idle, else when the
        running batch ends. Resolves to the replaced backend; cancelling it withdraws the swap.

        The batch cost model carries over and retunes itself: a warm-up timed beside a serving pool
        overstates the cost, which would shed requests right after the swap.
        """
        if self._pending is not None:
            raise RuntimeError("a model swap is already pending")
        done: asyncio.Future[ScoringBackend] = asyncio.get_running_loop().create_future()
        self._pending = (backend, done)
        done.add_done_callback(self._withdraw)
        if not self.dispatch.busy:
            self._apply()
        return done

    def between_batches(self) -> None:
        self.dispatch.busy = False
        self._apply()

    def _withdraw(self, done: asyncio.Future[ScoringBackend]) -> None:
        if done.cancelled() and self._pending is not None and self._pending[1] is done:
            self._pending = None

    def _apply(self) -> None:
        if self._pending is None:
            return
        backend, done = self._pending
        self._pending = None
        previous = self.serving
        # One synchronous step: no batch and no request sees half of each version.
        self.serving = backend
        self.dispatch.target = backend.executor
        self._on_switch(backend)
        logger.info("now serving %s (was %s)", backend.model_version, previous.model_version)
        done.set_result(previous)


def warm_up_backend(
    spec: LoadedSpec,
    backend: ScoringBackend,
    *,
    max_batch_size: int,
    rounds: int = 3,
    timeout_s: float | None = None,
) -> list[tuple[int, float]]:
    """Score copies of the spec's example record through the whole path (store reads included,
    writes excluded) at batch size 1 and the largest; returns (batch size, seconds) samples for
    the cost model. Raises if an answer is not a finite score, or TimeoutError past `timeout_s`.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def run(specs: list[ItemSpec]) -> BatchResult:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return backend.executor.submit(backend.process, specs).result(timeout=remaining)

    sizes = (1, max_batch_size)
    specs = [_warm_up_spec(spec, i) for i in range(max(sizes))]
    run(specs[:1])  # the first call pays lazy init (the process, the model, the connection)
    samples: list[tuple[int, float]] = []
    for _ in range(rounds):
        for n in sizes:
            started = time.perf_counter()
            outcome = run(specs[:n])
            samples.append((n, time.perf_counter() - started))
            if any(r.status != "scored" or r.score is None or not math.isfinite(r.score) for r in outcome.results):
                raise RuntimeError(f"warm-up inference failed: {outcome.results[0]}")
    return samples


def _warm_up_spec(spec: LoadedSpec, index: int) -> ItemSpec:
    """The example under its own id (and entity) and a minute of its own in 2000: no stored
    record is its history, and no answer of it is ever stored."""
    moment = datetime(2000, 1, 1, tzinfo=UTC) + timedelta(minutes=index)
    record_id = f"warm-up-{index}"
    values = {**spec.spec.example(), spec.id.name: record_id, spec.event_time.name: moment}
    if spec.entity is not None:
        values[spec.entity.name] = f"warm-up-entity-{index % 4}"
    record = record_model(spec).model_validate(values)
    return ItemSpec(raw=record.to_raw(), record_id=record_id, request_id="warm-up")
