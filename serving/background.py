"""One asyncio task owned by an object: started on the running loop, cancelled and awaited on stop
(asyncio's task groups cannot be started in one call and stopped in another)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    def __init__(self, name: str) -> None:
        self.name = name
        self._task: asyncio.Task[None] | None = None

    def start(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._task = asyncio.get_running_loop().create_task(run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended; a task never started is a no-op."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
