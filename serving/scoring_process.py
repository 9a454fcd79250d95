"""One scoring process that the event loop talks to over a pipe, with no thread in between.

`ProcessPoolExecutor` passes every call through two threads that wait for the server's GIL, which
the event loop holds while it parses requests. Here the event loop writes a batch to the pipe itself
and reads the answer when its selector says the pipe is readable; no library has an executor whose
result lands on the event loop without a thread.

Calls from other threads (warm-up, the shadow) go through one helper thread; one call is in the
pipe at a time. A process that dies fails the call in flight and every later one with
`BrokenProcessPool`, as the pool did.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import select
import struct
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.reduction import ForkingPickler
from typing import Any, ParamSpec, Protocol, TypeVar, runtime_checkable

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")

_JOIN_TIMEOUT_S = 5.0
_HEADER = struct.Struct("!Q")
_READ_CHUNK = 1 << 20
_STOP = "stop"  # the message that ends the child; calls are (number, fn, args, kwargs), answers tuples too
_INCOMPLETE = object()


class RemoteTraceback(Exception):
    """The scoring process's traceback of an error it sent back, as the error's cause."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


@runtime_checkable
class LoopRunner(Protocol):
    """An executor whose calls the running event loop can await without a thread hop."""

    async def run_on_loop(self, fn: Callable[..., _T], /, *args: Any) -> _T: ...


@runtime_checkable
class Terminable(Protocol):
    """An executor whose work can be stopped at once, whatever it is doing."""

    def terminate(self) -> None: ...


def terminate(executor: Executor) -> None:
    """Dispose of `executor` waiting for nothing: its process may be stuck (a load or a batch that
    never returns), so it is stopped rather than asked to finish; a thread pool's queue is cancelled."""
    if isinstance(executor, Terminable):
        executor.terminate()
    else:  # a thread pool (tests): a running thread cannot be stopped
        executor.shutdown(wait=False, cancel_futures=True)


def exited(executor: Executor) -> bool:
    """Whether `executor`'s scoring process has ended (killed, crashed, stopped); a thread pool never has."""
    return isinstance(executor, ScoringProcess) and not executor.process.is_alive()


async def run_on(executor: Executor, fn: Callable[..., _T], /, *args: Any) -> _T:
    """`fn(*args)` on `executor`, awaited: straight over the pipe where it is a `LoopRunner`,
    else through `run_in_executor` (a thread pool in tests)."""
    if isinstance(executor, LoopRunner):
        return await executor.run_on_loop(fn, *args)
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


class ScoringProcess(Executor):
    """A one-process executor whose process starts at once and runs `initializer(*initargs)` before
    its first call."""

    def __init__(
        self,
        mp_context: BaseContext,
        *,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        name: str = "tandem-scoring",
    ) -> None:
        self._conn, child = mp_context.Pipe(duplex=True)
        self.process = mp_context.Process(  # type: ignore[attr-defined]
            target=serve_calls, args=(child, initializer, initargs), name=name, daemon=True
        )
        self.process.start()
        child.close()  # the child's end lives in the child alone, so its death reads as EOF here
        self._fd = self._conn.fileno()
        self._inbox = Inbox()
        self._exchange = threading.Lock()  # held from a call's send to its answer
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-call")
        self._state = threading.Lock()  # shutdown and terminate, from any thread
        self._broken: str | None = None
        self._shut_down = False
        self._stopped = False
        self._calls = 0  # numbers each call, so an answer is only ever taken for its own call

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        self._check_usable()
        return self._helper.submit(self._call_blocking, fn, args, kwargs)

    async def run_on_loop(self, fn: Callable[..., _T], /, *args: Any) -> _T:
        self._check_usable()
        if not self._exchange.acquire(blocking=False):  # a thread's call is in the pipe: queue behind it
            return await asyncio.wrap_future(self.submit(fn, *args))
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        call = self._call(fn, args, {})
        try:
            loop.add_reader(self._fd, self._on_readable, loop, answer, call[0])
            self._send(call)
        except BaseException:
            loop.remove_reader(self._fd)
            self._exchange.release()
            raise
        # Cancelling the awaiting task leaves the exchange to finish: the answer is still read
        # (and dropped), so the pipe stays in step.
        return await answer

    def _on_readable(self, loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Any], number: int) -> None:
        # Reads what has arrived and returns to the loop until the whole answer is in: the loop
        # never waits on the child, even mid-write.
        try:
            alive = self._inbox.read_available(self._fd)
            reply = self._inbox.take() if alive else None
            if reply is _INCOMPLETE:
                return
            loop.remove_reader(self._fd)
            value = self._unwrap(self._checked(reply, number))
        except BaseException as error:  # noqa: BLE001 - handed to whoever awaits the answer
            loop.remove_reader(self._fd)
            if not answer.done():
                answer.set_exception(error)
        else:
            if not answer.done():
                answer.set_result(value)
        self._exchange.release()

    def _call_blocking(self, fn: Callable[..., _T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _T:
        with self._exchange:
            # Queued before a shutdown without cancel_futures: still run, as the pool's were.
            if self._broken is not None:
                raise BrokenProcessPool(self._broken)
            call = self._call(fn, args, kwargs)
            self._send(call)
            return self._unwrap(self._checked(read_message(self._fd, self._inbox), call[0]))

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        self._calls += 1
        return (self._calls, fn, args, kwargs)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise BrokenProcessPool(self._broken)
        if self._shut_down:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def _send(self, call: object) -> None:
        try:
            write_message(self._fd, call)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise self._break(f"the scoring process is gone ({type(error).__name__})") from error

    def _checked(self, reply: Any, number: int) -> tuple[Any, ...]:
        """The reply to call `number`, or BrokenProcessPool: for none (the child closed its end: it
        died), for the child's report that its initializer failed, and for the answer to another
        call, which would hand one batch's scores to another's requests."""
        if reply is None:
            raise self._break("the scoring process died before it answered")
        if reply[0] == "init_failed":
            raise self._break(f"the scoring process failed to start: {reply[1]}")
        if reply[0] != number:
            raise self._break(f"the scoring process answered call {reply[0]!r} when call {number} was due")
        return reply[1:]

    def _break(self, reason: str) -> BrokenProcessPool:
        if self._broken is None:
            self._broken = reason
            logger.error("%s (pid %s)", reason, self.process.pid)
        return BrokenProcessPool(self._broken)

    @staticmethod
    def _unwrap(reply: tuple[Any, ...]) -> Any:
        kind, value, *rest = reply
        if kind == "ok":
            return value
        if isinstance(value, BaseException):
            value.__cause__ = RemoteTraceback(rest[0] if rest else "")
            raise value
        raise RuntimeError(f"unexpected answer from the scoring process: {kind!r}")

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Let the call in the pipe (and, without `cancel_futures`, those queued) finish, then end
        the process; with `wait`, until it has exited. Not with `wait` on the event loop while the
        loop's own call is in flight: the loop is what would finish that call."""
        with self._state:
            first, self._shut_down = not self._shut_down, True
        if first:
            self._helper.shutdown(wait=False, cancel_futures=cancel_futures)
        if wait:
            self._stop()
        elif first:
            threading.Thread(target=self._stop, name="tandem-scoring-stop", daemon=True).start()

    def _stop(self) -> None:
        self._helper.shutdown(wait=True)  # the calls still queued (unless cancelled) go first
        with self._exchange:
            if self._broken is None and not self._stopped:
                self._stopped = True
                with contextlib.suppress(OSError):
                    write_message(self._fd, _STOP)
        self.process.join()

    def terminate(self) -> None:
        """Stop the process now, whatever it is doing (a load that never returns): the call in
        flight and every later one fail with BrokenProcessPool."""
        with self._state:
            self._shut_down = True
            if self._broken is None:
                self._broken = "the scoring process was stopped"
        self._helper.shutdown(wait=False, cancel_futures=True)
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=_JOIN_TIMEOUT_S)
        if self.process.is_alive():  # SIGTERM can land before the child's interpreter is up; SIGKILL cannot miss
            self.process.kill()
            self.process.join(timeout=_JOIN_TIMEOUT_S)


class Inbox:
    """The bytes read so far of the next message: a length (8 bytes) and a pickle."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def read_available(self, fd: int) -> bool:
        """Append what the socket holds now; False once the other end has closed it."""
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
        if not chunk:
            return False
        self._buffer += chunk
        return True

    def take(self) -> Any:
        """The next whole message, or `_INCOMPLETE` while it has not all arrived."""
        if len(self._buffer) < _HEADER.size:
            return _INCOMPLETE
        (size,) = _HEADER.unpack_from(self._buffer)
        end = _HEADER.size + size
        if len(self._buffer) < end:
            return _INCOMPLETE
        payload = bytes(self._buffer[_HEADER.size : end])
        del self._buffer[:end]
        return pickle.loads(payload)


def _wait_for(fd: int, event: int) -> None:
    """Until `fd` is ready for `event` or closed (poll, not select: a descriptor past 1,024,
    as a server with many connections hands out, is out of select's range)."""
    poller = select.poll()
    poller.register(fd, event)
    poller.poll()


def read_message(fd: int, inbox: Inbox) -> Any | None:
    """The next message, waiting for it; None once the other end has closed."""
    while (message := inbox.take()) is _INCOMPLETE:
        _wait_for(fd, select.POLLIN)
        if not inbox.read_available(fd):
            return None
    return message


def write_message(fd: int, message: object) -> None:
    """Write one message whole. The socket may be non-blocking (uvloop makes a descriptor it
    watches so), so a full buffer is waited out; the other end is reading by then."""
    payload = ForkingPickler.dumps(message)
    data = memoryview(_HEADER.pack(len(payload)) + bytes(payload))
    while data:
        try:
            written = os.write(fd, data)
        except BlockingIOError:
            _wait_for(fd, select.POLLOUT)
            continue
        data = data[written:]


def serve_calls(conn: Connection, initializer: Callable[..., object] | None, initargs: tuple[Any, ...]) -> None:
    """The scoring process's main loop: one call at a time, until told to stop or the parent is gone."""
    fd, inbox = conn.fileno(), Inbox()
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException as error:  # reported to the parent, which fails its calls
            logger.exception("the scoring process failed to initialise")
            write_message(fd, ("init_failed", f"{type(error).__name__}: {error}"))
            return
    while True:
        try:
            call = read_message(fd, inbox)
        except (OSError, KeyboardInterrupt):
            return
        if call is None or call == _STOP:
            return
        number, fn, args, kwargs = call
        try:
            reply: tuple[Any, ...] = (number, "ok", fn(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - sent back as the call's outcome
            reply = (number, "error", error, traceback.format_exc())
        try:
            write_message(fd, reply)
        except (BrokenPipeError, ConnectionResetError):
            return
        except Exception as error:  # noqa: BLE001 - an answer that cannot be pickled fails that call alone
            write_message(fd, (number, "error", RuntimeError(f"the answer could not be sent back: {error!r}"), ""))
