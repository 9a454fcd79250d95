"""Pending connections accepted by the batch at each wake-up of the listening socket, on uvloop too.

libuv accepts one connection per event-loop iteration since 1.45 (libuv #3696: in the common case
the second accept() only finds EAGAIN). At the step into overload a client without a bounded pool
opens a connection for every request in flight; here that left 20-40 connections in the listen
queue for 0.4 s at 1,400 and 2,800 rps, and every request on them (the refused ones too) waited
that out before Python saw it (bench/findings.md). asyncio's own loop accepts up to the backlog
per wake-up, but runs the rest slower. No setting of uvicorn, uvloop or BentoML changes this, so
the loop uvicorn makes for BentoML's worker accepts the way asyncio does and hands each connection
to uvloop as an accepted socket: the transports, the protocol and everything after are unchanged.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

from serving.uvicorn_defaults import replace_auto

logger = logging.getLogger(__name__)

_STOCK_AUTO = "uvicorn.loops.auto:auto_loop_factory"
_THIS = f"{__name__}:accepting_loop_factory"
# Out of descriptors or memory: accepting again at once would spin. asyncio waits a second too
# (asyncio.constants.ACCEPT_RETRY_DELAY); the connections wait in the listen queue meanwhile.
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RETRY_AFTER_RESOURCE_ERROR_S = 1.0
# With several workers on one listening socket (BentoML's `workers`), each wakes for the same
# connections: a bound per wake-up leaves the rest to the others or to the next iteration, where
# accepting up to the whole backlog (asyncio's rule) would let whichever worker runs first take them all.
MAX_ACCEPTS_PER_WAKE = 32

ProtocolFactory = Callable[[], asyncio.Protocol]


def serve_accepting() -> None:
    """uvicorn servers configured from now on in this process with the default `loop="auto"` (as
    BentoML's worker configures them) accept up to `MAX_ACCEPTS_PER_WAKE` pending connections per
    wake-up of the listening socket. Idempotent.
    Raises RuntimeError where this uvicorn resolves its loop some other way, so that an upgrade
    fails the start instead of quietly going back to one accept per iteration."""
    replace_auto("LOOP_FACTORIES", _STOCK_AUTO, _THIS, "serving/accept.py")


def accepting_loop_factory(use_subprocess: bool = False) -> Callable[[], asyncio.AbstractEventLoop]:
    """uvicorn's own choice of loop (uvloop where installed), whose servers on a given socket
    accept greedily. asyncio's loop already does, and is left as it is."""
    from uvicorn.loops.auto import auto_loop_factory

    stock_factory = auto_loop_factory(use_subprocess=use_subprocess)

    def new_loop() -> asyncio.AbstractEventLoop:
        loop = stock_factory()
        if type(loop).__module__.startswith("uvloop"):
            install(loop)
        return loop

    return new_loop


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Servers this loop creates on an open socket (`create_server(sock=...)`, how uvicorn serves
    BentoML's socket) accept greedily; every other `create_server` call is the loop's own."""
    stock = loop.create_server

    async def create_server(protocol_factory: ProtocolFactory, *args: Any, **kwargs: Any) -> Any:
        sock = kwargs.get("sock")
        if args or sock is None or kwargs.get("ssl") is not None or sock.type != socket.SOCK_STREAM:
            return await stock(protocol_factory, *args, **kwargs)
        return GreedyServer(loop, protocol_factory, sock, backlog=kwargs.get("backlog") or 100)

    loop.create_server = create_server  # type: ignore[method-assign,assignment]


class GreedyServer:
    """What uvicorn uses of an `asyncio.Server` given a socket (close, wait_closed), accepting up to
    `MAX_ACCEPTS_PER_WAKE` connections each time the listening socket is readable."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, protocol_factory: ProtocolFactory, sock: socket.socket, *, backlog: int
    ) -> None:
        self._loop = loop
        self._protocol_factory = protocol_factory
        self._sock = sock
        self._handshakes: set[asyncio.Task[Any]] = set()
        self._serving = True
        sock.setblocking(False)
        sock.listen(backlog)
        loop.add_reader(sock.fileno(), self._accept_pending)

    def _accept_pending(self) -> None:
        for _ in range(MAX_ACCEPTS_PER_WAKE):
            try:
                connection, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # the peer gave up before we accepted: the next may not have
                continue
            except OSError as error:
                if error.errno in _RESOURCE_ERRORS:
                    logger.error("accept() failed (%s); accepting again in %.0f s", error, RETRY_AFTER_RESOURCE_ERROR_S)
                    self._loop.remove_reader(self._sock.fileno())
                    self._loop.call_later(RETRY_AFTER_RESOURCE_ERROR_S, self._resume)
                else:  # as asyncio's loop does: logged, and the next wake-up tries again
                    logger.exception("accept() failed")
                return
            connection.setblocking(False)
            handshake = self._loop.create_task(self._connect(connection))
            self._handshakes.add(handshake)
            handshake.add_done_callback(self._handshakes.discard)

    async def _connect(self, connection: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._protocol_factory, connection)
        except Exception:
            logger.exception("an accepted connection could not be set up; it is closed")
            connection.close()

    def _resume(self) -> None:
        if self._serving:
            self._loop.add_reader(self._sock.fileno(), self._accept_pending)

    def close(self) -> None:
        if self._serving:
            self._serving = False
            self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        if self._handshakes:
            await asyncio.gather(*self._handshakes, return_exceptions=True)
