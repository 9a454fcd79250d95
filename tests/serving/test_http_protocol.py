"""`serving.http_protocol.ScreeningProtocol` on a real uvicorn server over real sockets: a request
the screen refuses is answered before any ASGI call, the connection stays usable (or is closed
where HTTP says so), and everything else reaches the app as with uvicorn's own protocol."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn import config as uvicorn_config

from serving import http_protocol
from serving.http_protocol import RawHeaders, ScreeningProtocol, screen_on_headers, serve_screening
from tests.serving.support import free_port


@dataclass
class App:
    """Answers every request with its path and body, after reading the whole body; counts calls."""

    calls: list[str] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append(scope["path"])
        answer = scope["path"].encode() + b" " + body
        length = [(b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": length})
        await send({"type": "http.response.body", "body": answer})


def refuse_when_asked(headers: RawHeaders) -> tuple[int, RawHeaders, bytes] | None:
    if (b"x-refuse", b"yes") not in headers:
        return None
    return 503, [(b"content-type", b"application/json"), (b"content-length", b"7"), (b"retry-after", b"1")], b'{"n":1}'


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, App]]:
    monkeypatch.setattr(http_protocol, "_screens", {})
    screen_on_headers("/score", refuse_when_asked)
    app = App()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=ScreeningProtocol, log_config=None, lifespan="off")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not running.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield port, app
    running.should_exit = True
    thread.join(10)


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: t", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Client:
    """One connection; a response read takes only its own bytes, what follows stays buffered."""

    def __init__(self, port: int) -> None:
        self.socket = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.reader = self.socket.makefile("rb")

    def sendall(self, data: bytes) -> None:
        self.socket.sendall(data)

    def read_response(self) -> tuple[int, dict[str, str], bytes]:
        status_line = self.reader.readline()
        assert status_line, "closed before a response"
        headers: dict[str, str] = {}
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        return int(status_line.split()[1]), headers, self.reader.read(int(headers["content-length"]))

    def closed_by_server(self) -> bool:
        try:
            return self.reader.read(1) == b""
        except ConnectionResetError:
            return True


@contextlib.contextmanager
def connect(port: int) -> Iterator[Client]:
    client = Client(port)
    try:
        yield client
    finally:
        client.reader.close()
        client.socket.close()


def test_a_refused_request_is_answered_without_the_app_and_the_connection_serves_the_next(
    server: tuple[int, App],
) -> None:
    port, app = server
    with connect(port) as connection:
        connection.sendall(post("/score", b'{"big": "' + b"x" * 50_000 + b'"}', "X-Refuse: yes"))
        status, headers, body = connection.read_response()
        assert (status, headers["retry-after"], body) == (503, "1", b'{"n":1}')
        assert "date" in headers, "uvicorn's default headers are kept"
        # The refused body was dropped by the parser, so the next request on the connection is whole.
        connection.sendall(post("/score", b"second"))
        assert connection.read_response()[::2] == (200, b"/score second")
    assert app.calls == ["/score"], "the refused request never reached the app"


def test_a_body_still_arriving_after_the_refusal_is_dropped(server: tuple[int, App]) -> None:
    port, app = server
    body = b"y" * 10_000
    with connect(port) as connection:
        request = post("/score", body, "X-Refuse: yes")
        connection.sendall(request[: len(request) - len(body)])
        assert connection.read_response()[0] == 503, "refused from the headers, before the body"
        connection.sendall(body)
        connection.sendall(post("/score", b"after"))
        assert connection.read_response()[::2] == (200, b"/score after")
    assert app.calls == ["/score"]


@pytest.mark.parametrize(
    ("extra", "version"),
    [(("Connection: close",), "1.1"), ((), "1.0"), (("Expect: 100-continue",), "1.1")],
    ids=["connection-close", "http-1.0", "expect-100-continue"],
)
def test_the_connection_is_closed_after_a_refusal_where_http_says_so(
    server: tuple[int, App], extra: tuple[str, ...], version: str
) -> None:
    port, app = server
    with connect(port) as connection:
        # With Expect the client holds the body back, which the server will never read.
        request = post("/score", b"body", "X-Refuse: yes", *extra, version=version)
        connection.sendall(request if "Expect: 100-continue" not in extra else request[:-4])
        status, headers, _ = connection.read_response()
        assert status == 503 and headers["connection"] == "close"
        assert connection.closed_by_server()
    assert app.calls == []


@pytest.mark.parametrize(
    "request_bytes",
    [
        post("/score", b"plain"),  # the screen says no
        post("/other", b"x", "X-Refuse: yes"),  # not a screened path
        b"GET /score HTTP/1.1\r\nHost: t\r\nX-Refuse: yes\r\n\r\n",  # not a POST
        post("/%73core", b"x", "X-Refuse: yes"),  # percent-encoded: left to the app
    ],
    ids=["screen-passes", "other-path", "get", "percent-encoded"],
)
def test_what_the_screen_does_not_refuse_reaches_the_app(server: tuple[int, App], request_bytes: bytes) -> None:
    port, app = server
    with connect(port) as connection:
        connection.sendall(request_bytes)
        assert connection.read_response()[0] == 200
    assert len(app.calls) == 1


def test_a_pipelined_request_is_left_to_the_app_so_answers_keep_their_order(server: tuple[int, App]) -> None:
    port, app = server
    with connect(port) as connection:
        connection.sendall(post("/score", b"first") + post("/score", b"second", "X-Refuse: yes"))
        assert connection.read_response()[::2] == (200, b"/score first")
        assert connection.read_response()[::2] == (200, b"/score second")
    assert app.calls == ["/score", "/score"]


def test_a_screen_that_fails_leaves_the_request_to_the_app(
    server: tuple[int, App], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, app = server

    def broken(headers: RawHeaders) -> tuple[int, RawHeaders, bytes] | None:
        raise RuntimeError("screen bug")

    screen_on_headers("/score", broken)
    with connect(port) as connection:
        connection.sendall(post("/score", b"x", "X-Refuse: yes"))
        assert connection.read_response()[0] == 200
    assert app.calls == ["/score"]


def test_serve_screening_makes_it_uvicorns_default_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(uvicorn_config.HTTP_PROTOCOLS, "auto", "uvicorn.protocols.http.auto:AutoHTTPProtocol")
    serve_screening()
    serve_screening()  # idempotent
    config = uvicorn.Config(App(), lifespan="off")
    config.load()
    assert config.http_protocol_class is ScreeningProtocol


def test_serve_screening_refuses_an_unknown_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(uvicorn_config.HTTP_PROTOCOLS, "auto", "somewhere.else:Protocol")
    with pytest.raises(RuntimeError, match="uvicorn"):
        serve_screening()
