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
from typing import ClassVar

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


class OutOfDescriptorsOnce(socket.socket):
    """A listening socket whose first accept() fails as when the process has no descriptor left."""

    failures = 0

    def accept(self) -> tuple[socket.socket, object]:
        if OutOfDescriptorsOnce.failures == 0:
            OutOfDescriptorsOnce.failures += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_running_out_of_descriptors_pauses_accepting_then_takes_the_waiting_connection(
    counting: type[Counting], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accept, "RETRY_AFTER_RESOURCE_ERROR_S", 0.2)
    loop = accepting_loop_factory()()
    sock = listening_socket(OutOfDescriptorsOnce)
    OutOfDescriptorsOnce.failures = 0
    clients = connect_many(sock, 1)
    try:

        async def serve() -> float:
            started = time.monotonic()
            server = await loop.create_server(counting, sock=sock, backlog=128)
            while not counting.made and time.monotonic() - started < 5:
                await asyncio.sleep(0.01)
            server.close()
            await server.wait_closed()
            return time.monotonic() - started

        took = loop.run_until_complete(serve())
        assert OutOfDescriptorsOnce.failures == 1
        assert len(counting.made) == 1, "the connection waited in the listen queue, and was taken after the pause"
        assert took >= 0.2, "no accept() spin while out of descriptors"
    finally:
        for client in clients:
            client.close()
        sock.close()
        loop.close()


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
