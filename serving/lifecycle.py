"""Model promotion without a restart: follow the production pointer, warm the new version up in a
scoring process of its own while the old one keeps answering, then swap between two batches.

A new process per version: a version that fails to load, scores NaN or hangs is found out where no
request depends on it. Rollback is the same move to an earlier version. Beside it, the schema check
a start had to leave for later because its database was down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Literal, TypeVar

from sqlalchemy.engine import Engine

from inference.migrate import upgrade
from inference.spec import LoadedSpec
from inference.store import is_transient_db_error
from serving.backends import ScoringBackend, warm_up_backend
from serving.background import BackgroundTask
from serving.runtime import OnlineScorer
from serving.shadow import ShadowScorer
from tandem.modelstore import SpecMismatch

logger = logging.getLogger(__name__)

SwapOutcome = Literal["succeeded", "failed"]
T = TypeVar("T")
LoadFn = Callable[[str], ScoringBackend]


def shutdown_now(executor: Executor) -> None:
    """Discard a pool nobody waits for; its pending work is cancelled."""
    executor.shutdown(wait=False, cancel_futures=True)


async def _to_the_end(work: Awaitable[T]) -> T:
    """Await `work`; cancelled meanwhile (closing mid-swap), still wait for it to end before passing
    the cancellation on, so a close returns only once the old pool's process has exited."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


class Superseded(Exception):
    """The backend a replacement was meant for no longer serves: another swap came first."""


async def bring_up(
    scorer: OnlineScorer,
    tag: str,
    *,
    load: LoadFn,
    load_timeout_s: float,
    discard: Callable[[Executor], None],
    replacing: ScoringBackend | None = None,
) -> tuple[ScoringBackend, list[tuple[int, float]]]:
    """Start a scoring pool for `tag`, warm it up off the event loop and make it the serving one;
    returns the backend it replaced and the warm-up timings. On failure or cancellation the new
    pool is discarded (it may be hung mid-load) and the serving one is left alone; likewise, with
    Superseded, when `replacing` (if given) is no longer the serving backend once the new one is warm.
    """
    backend: ScoringBackend | None = None
    swap: asyncio.Future[ScoringBackend] | None = None
    try:
        backend = await asyncio.to_thread(load, tag)
        samples = await asyncio.to_thread(
            warm_up_backend,
            scorer.spec,
            backend,
            max_batch_size=scorer.settings.max_batch_size,
            timeout_s=load_timeout_s,
        )
        # In one step of the event loop, as every swap: a promotion made meanwhile is never undone.
        if replacing is not None and scorer.backends.serving is not replacing:
            raise Superseded(f"{scorer.model_version} replaced {replacing.model_version} meanwhile")
        swap = scorer.swap(backend)
        return await swap, samples
    finally:
        applied = swap is not None and swap.done() and not swap.cancelled()
        if backend is not None and not applied:
            await asyncio.shield(asyncio.to_thread(discard, backend.executor))


class _Periodic:
    """A task that calls `tick` every `interval_s` until closed, surviving a failed tick."""

    name = "tandem-periodic"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._task = BackgroundTask(self.name)

    def start(self) -> None:
        self._task.start(self._run)

    async def close(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop the next
                logger.exception("%s: tick failed", self.name)

    async def tick(self) -> None:
        raise NotImplementedError


class _PointerFollower(_Periodic):
    """Follows a pointer of the model store and loads what it names, retrying a failed version with
    a doubling back-off (each try costs a process start on the serving pool's cores)."""

    def __init__(
        self,
        *,
        pointer: Callable[[], str | None],
        load: LoadFn,
        interval_s: float,
        load_timeout_s: float,
        retry_max_s: float,
        discard: Callable[[Executor], None] = shutdown_now,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`pointer` reads the tag (None: none set); `load` starts a scoring pool for a tag;
        `discard` disposes of a pool that failed."""
        super().__init__(interval_s)
        self.pointer = pointer
        self.load = load
        self.load_timeout_s = load_timeout_s
        self.retry_max_s = retry_max_s
        self.discard = discard
        self.clock = clock
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}

    async def tick(self) -> None:
        await self.poll_once()

    async def poll_once(self) -> str | None:
        raise NotImplementedError

    def _backing_off(self, tag: str) -> bool:
        return self.clock() < self._retry_at.get(tag, 0.0)

    def _failed(self, tag: str) -> int:
        """Count a failed attempt at `tag` and set its next try; returns the attempts so far."""
        failures = self._failures.get(tag, 0) + 1
        self._failures[tag] = failures
        self._retry_at[tag] = self.clock() + min(self.interval_s * 2 ** (failures - 1), self.retry_max_s)
        return failures

    def _succeeded(self, tag: str) -> None:
        self._failures.pop(tag, None)
        self._retry_at.pop(tag, None)


class ModelWatcher(_PointerFollower):
    name = "tandem-model-watcher"

    def __init__(self, scorer: OnlineScorer, *, production_tag: Callable[[], str | None], **follow: Any) -> None:
        super().__init__(pointer=production_tag, **follow)
        self.scorer = scorer

    async def poll_once(self) -> SwapOutcome | None:
        """Swap to the version the pointer names, if it is not the one serving and not in back-off."""
        tag = await asyncio.to_thread(self.pointer)
        if tag is None or tag == self.scorer.model_version or self._backing_off(tag):
            return None
        return await self.swap_to(tag)

    async def swap_to(self, tag: str) -> SwapOutcome:
        """Load and warm `tag` up off the event loop, then serve it; on failure the serving version
        is left alone and the attempt counted."""
        serving = self.scorer.model_version
        started = self.clock()
        logger.info("loading model %s to replace %s", tag, serving)
        try:
            previous, samples = await bring_up(
                self.scorer, tag, load=self.load, load_timeout_s=self.load_timeout_s, discard=self.discard
            )
        except SpecMismatch as error:  # refused before any process started: the line says it all
            self.scorer.metrics.model_swaps["failed"].inc()
            logger.error("%s; still serving %s (attempt %d)", error, serving, self._failed(tag))
            return "failed"
        except Exception:  # whatever broke the new version, the old one keeps serving
            self.scorer.metrics.model_swaps["failed"].inc()
            logger.exception(
                "model %s failed to load or warm up; still serving %s (attempt %d, next in %.0f s)",
                tag,
                serving,
                self._failed(tag),
                self._retry_at[tag] - self.clock(),
            )
            return "failed"
        self._succeeded(tag)
        self.scorer.metrics.model_swaps["succeeded"].inc()
        # The swap took effect between batches: nothing runs on the old pool any more.
        await _to_the_end(asyncio.to_thread(previous.executor.shutdown, True))
        largest = max(n for n, _ in samples)
        logger.info(
            "serving model %s (was %s): loaded, warmed up and swapped in %.1f s; batch of %d in %.0f ms",
            tag,
            serving,
            self.clock() - started,
            largest,
            min(seconds for n, seconds in samples if n == largest) * 1000,
        )
        return "succeeded"


class PoolSupervisor(_Periodic):
    """Replaces a scoring process that died (OOM kill, a native crash): requests are answered 503
    meanwhile; a new process for the serving version is warmed up and swapped in within about
    `interval_s`. Only repeated failures make `/livez` ask for a restart.
    """

    name = "tandem-pool-supervisor"

    def __init__(
        self,
        scorer: OnlineScorer,
        *,
        load: LoadFn,
        interval_s: float,
        load_timeout_s: float,
        discard: Callable[[Executor], None] = shutdown_now,
    ) -> None:
        super().__init__(interval_s)
        self.scorer = scorer
        self.load = load
        self.load_timeout_s = load_timeout_s
        self.discard = discard

    async def tick(self) -> None:
        if not self.scorer.check_scoring_process():
            await self.restore_once()

    async def restore_once(self) -> bool:
        """Start, warm up and swap in a new scoring process for the serving version; False when
        that failed, or when another version was swapped in meanwhile (the new process is discarded)."""
        serving = self.scorer.backends.serving
        tag = serving.model_version
        started = time.monotonic()
        try:
            dead, _ = await bring_up(
                self.scorer,
                tag,
                load=self.load,
                load_timeout_s=self.load_timeout_s,
                discard=self.discard,
                replacing=serving,
            )
        except Superseded as superseded:
            logger.info("not replacing the dead scoring process: %s", superseded)
            return False
        except Exception:
            attempt = self.scorer.restore_failed()
            logger.exception("could not replace the dead scoring process of %s (attempt %d)", tag, attempt)
            return False
        self.scorer.restored()
        # The dead pool's process is gone already; this only releases its bookkeeping.
        await asyncio.to_thread(self.discard, dead.executor)
        logger.warning("replaced the dead scoring process of %s in %.1f s", tag, time.monotonic() - started)
        return True


class ChallengerWatcher(_PointerFollower):
    """Follows the challenger pointer: a new challenger gets a low-priority scoring process of its
    own, is warmed up and handed to the ShadowScorer; a cleared one is let go. A challenger that
    fails to load only leaves shadowing off; the champion is never involved."""

    name = "tandem-challenger-watcher"

    def __init__(self, shadow: ShadowScorer, *, challenger_tag: Callable[[], str | None], **follow: Any) -> None:
        super().__init__(pointer=challenger_tag, **follow)
        self.shadow = shadow

    async def poll_once(self) -> str | None:
        """Shadow the version the pointer names; returns "started", "stopped", "failed" or None."""
        tag = await asyncio.to_thread(self.pointer)
        if tag == self.shadow.model_version:
            return None
        if tag is None:
            self._let_go(self.shadow.set_backend(None))
            logger.info("challenger cleared: shadowing stopped")
            return "stopped"
        if self._backing_off(tag):
            return None
        backend: ScoringBackend | None = None
        try:
            backend = await asyncio.to_thread(self.load, tag)
            await asyncio.to_thread(
                warm_up_backend,
                self.shadow.spec,
                backend,
                max_batch_size=self.shadow.limits.max_batch,
                rounds=1,
                timeout_s=self.load_timeout_s,
            )
        except SpecMismatch as error:  # refused before any process started: the line says it all
            logger.error("%s; not shadowing it (attempt %d)", error, self._failed(tag))
            return "failed"
        except Exception:
            if backend is not None:
                await asyncio.shield(asyncio.to_thread(self.discard, backend.executor))
            logger.exception(
                "challenger %s failed to load or warm up; not shadowing (attempt %d)", tag, self._failed(tag)
            )
            return "failed"
        self._succeeded(tag)
        self._let_go(self.shadow.set_backend(backend))
        share = self.shadow.settings.shadow_sample
        logger.info("shadowing challenger %s on %.0f%% of scored items", tag, 100 * share)
        return "started"

    def _let_go(self, previous: ScoringBackend | None) -> None:
        if previous is not None:
            # Not awaited: a shadow batch may still be running on it, and nobody waits for that.
            previous.executor.shutdown(wait=False, cancel_futures=True)

    async def close(self) -> None:
        await super().close()
        self._let_go(self.shadow.set_backend(None))


class DeferredMigration(_Periodic):
    """The schema check (`upgrade`) of a service that started while its database was down, retried
    every `interval_s` until the database answers. Meanwhile answers are degraded and their rows
    wait in the outbox, which the writer keeps while the schema is missing. A refusal other than an
    outage (another spec's database) ends the retries and sets `failed`: `/livez` then asks for a
    restart, whose start fails with the reason."""

    name = "tandem-deferred-migration"

    def __init__(self, engine: Engine, spec: LoadedSpec, *, interval_s: float) -> None:
        super().__init__(interval_s)
        self.engine = engine
        self.spec = spec
        self.checked = False
        self.failed: Exception | None = None

    async def tick(self) -> None:
        if self.checked or self.failed is not None:
            return
        try:
            await asyncio.to_thread(upgrade, self.engine, self.spec)
        except Exception as error:
            if not is_transient_db_error(error):
                self.failed = error
                raise
            logger.warning("database still unreachable; schema check retried in %g s", self.interval_s)
            return
        self.checked = True
        logger.warning("database reachable again: schema checked, the outbox drains")
