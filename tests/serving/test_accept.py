"""`serving.accept`: a uvloop server on an open socket accepts every pending connection at each
wake-up (libuv itself accepts one per iteration), survives running out of descriptors, and is
still an ordinary uvicorn server to its clients and at shutdown."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import uvicorn
import uvloop
from starlette.types import Receive, Scope, Send
from uvicorn import config as uvicorn_config

from serving import accept
from serving.accept import GreedyServer, accepting_loop_factory, serve_accepting


class Counting(asyncio.Protocol):
    made: ClassVar[list[Counting]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        Counting.made.append(self)


@pytest.fixture
def counting() -> Iterator[type[Counting]]:
    Counting.made = []
    yield Counting
    for protocol in Counting.made:
        protocol.transport.close()


def listening_socket(cls: type[socket.socket] = socket.socket) -> socket.socket:
    sock = cls(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def connect_many(sock: socket.socket, count: int) -> list[socket.socket]:
    """`count` connections the kernel has completed, all waiting in `sock`'s accept queue."""
    return [socket.create_connection(sock.getsockname(), timeout=5) for _ in range(count)]


def test_the_loop_uvicorn_gets_accepts_every_pending_connection_within_a_few_iterations(
    counting: type[Counting],
) -> None:
    loop = accepting_loop_factory()()
    assert isinstance(loop, uvloop.Loop)
    sock = listening_socket()
    clients = connect_many(sock, 60)
    try:

        async def serve_briefly() -> None:
            server = await loop.create_server(counting, sock=sock, backlog=128)
            assert isinstance(server, GreedyServer)
            # libuv alone accepts one connection per iteration: 60 would need 60 of them.
            for _ in range(8):
                await asyncio.sleep(0)
            server.close()
            await server.wait_closed()

        loop.run_until_complete(serve_briefly())
        assert len(counting.made) == 60
    finally:
        for client in clients:
            client.close()
        sock.close()
        loop.close()


def test_other_servers_are_the_loops_own() -> None:
    loop = accepting_loop_factory()()

    async def on_a_port() -> object:
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        server.close()
        await server.wait_closed()
        return server

    try:
        assert not isinstance(loop.run_until_complete(on_a_port()), GreedyServer)
    finally:
        loop.close()


class FailsOnce(socket.socket):
    """A listening socket whose first accept() fails with `error`."""

    error: ClassVar[OSError] = OSError(errno.EMFILE, "Too many open files")
    failures: ClassVar[int] = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if FailsOnce.failures == 0:
            FailsOnce.failures += 1
            raise FailsOnce.error
        return super().accept()


def serve_until_connected(sock: socket.socket, counting: type[Counting]) -> float:
    """Serve `sock` on an accepting loop until a connection is made (5 s at most); the seconds taken."""
    loop = accepting_loop_factory()()
    try:

        async def serve() -> float:
            started = time.monotonic()
            server = await loop.create_server(counting, sock=sock, backlog=128)
            while not counting.made and time.monotonic() - started < 5:
                await asyncio.sleep(0.01)
            server.close()
            await server.wait_closed()
            return time.monotonic() - started

        return loop.run_until_complete(serve())
    finally:
        loop.close()


@pytest.mark.parametrize(
    ("error", "pause_s"),
    [(OSError(errno.EMFILE, "Too many open files"), 0.6), (ConnectionAbortedError(errno.ECONNABORTED, "aborted"), 0.0)],
)
def test_a_failed_accept_leaves_the_waiting_connection_to_be_taken(
    counting: type[Counting], monkeypatch: pytest.MonkeyPatch, error: OSError, pause_s: float
) -> None:
    """Out of descriptors: accepting pauses (no accept() spin), then takes the connection that
    waited in the listen queue. A connection aborted before it was accepted: the next is taken at once."""
    monkeypatch.setattr(accept, "RETRY_AFTER_RESOURCE_ERROR_S", 0.6)
    monkeypatch.setattr(FailsOnce, "error", error)
    monkeypatch.setattr(FailsOnce, "failures", 0)
    sock = listening_socket(FailsOnce)
    clients = connect_many(sock, 1)
    try:
        took = serve_until_connected(sock, counting)
        assert FailsOnce.failures == 1
        assert len(counting.made) == 1
        assert took >= pause_s
        if not pause_s:
            assert took < 0.5, "no pause for a connection the peer aborted"
    finally:
        for client in clients:
            client.close()
        sock.close()


async def echo_path(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def test_uvicorn_on_a_given_socket_as_bentomls_worker_runs_it_serves_and_shuts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(uvicorn_config, "LOOP_FACTORIES", dict(uvicorn_config.LOOP_FACTORIES))
    serve_accepting()
    sock = listening_socket()
    config = uvicorn.Config(echo_path, log_config=None, lifespan="off")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not running.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        assert all(isinstance(server, GreedyServer) for server in running.servers)
        port = sock.getsockname()[1]
        for path in ("/a", "/b"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                client.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
                answer = b""
                while chunk := client.recv(4096):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(path.encode())
    finally:
        running.should_exit = True
        thread.join(10)
    assert not thread.is_alive(), "uvicorn's shutdown finished with the greedy server"


def test_serve_accepting_makes_it_uvicorns_default_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn_config, "LOOP_FACTORIES", dict(uvicorn_config.LOOP_FACTORIES))
    serve_accepting()
    serve_accepting()  # idempotent
    factory = uvicorn.Config(echo_path).get_loop_factory()
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.create_server.__qualname__.startswith("install.")
    finally:
        loop.close()


def test_serve_accepting_refuses_a_uvicorn_it_was_not_written_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uvicorn_config, "LOOP_FACTORIES", {"auto": "somewhere.else:factory"})
    with pytest.raises(RuntimeError, match="LOOP_FACTORIES"):
        serve_accepting()
