"""The gate is served in front of BentoML's own middlewares (serving/middleware_order.py), on the
real BentoML app factory: its refusals run in the server's own task, with no timeout task, timer
or tracing in front of them. BentoML's timeout is served as `Backstop`: what a client sees is the
same, and no timer outlives its request."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import typing

import bentoml
import httpx
import pytest
from _bentoml_impl.server.app import ServiceAppFactory
from bentoml._internal.server.http.traffic import TimeoutMiddleware
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.middleware_order import Backstop, bind_api_methods, serve_outermost


class Refuses:
    """A gate of the test's own: answers /refuse itself and notes the task it ran in."""

    tasks: typing.ClassVar[list[asyncio.Task[typing.Any] | None]] = []

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/refuse":
            await self.app(scope, receive, send)
            return
        Refuses.tasks.append(asyncio.current_task())
        await send({"type": "http.response.start", "status": 503, "headers": [(b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": b"{}"})


class Inner:
    """Another user middleware, left where BentoML puts it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


@bentoml.service(traffic={"timeout": 10})
class Toy:
    def __init__(self) -> None:
        bind_api_methods(self)

    @bentoml.api
    def echo(self, text: str) -> str:
        return text


toy = typing.cast("bentoml.Service[Toy]", Toy)
toy.add_asgi_middleware(Refuses)
toy.add_asgi_middleware(Inner)


@pytest.fixture(scope="module")
def ordered() -> list[type]:
    toy.inject_config()
    # BentoML's own list, whether or not the service module (imported by other tests in the same
    # process) has already served its gate outermost.
    listing = typing.cast("property", ServiceAppFactory.__dict__["middlewares"]).fget
    stock_middlewares = typing.cast(
        "typing.Callable[[ServiceAppFactory], list[typing.Any]]", getattr(listing, "__wrapped__", listing)
    )
    stock = [m.cls for m in stock_middlewares(ServiceAppFactory(toy))]
    serve_outermost(Refuses)
    serve_outermost(Refuses)  # twice: still one reordering
    after = [m.cls for m in ServiceAppFactory(toy).middlewares]
    # BentoML's own order (the stock list has the user middlewares after its timeout).
    assert stock.index(TimeoutMiddleware) < stock.index(Refuses) < stock.index(Inner)
    return after


def test_the_gate_comes_first_and_everything_else_keeps_its_order(ordered: list[type]) -> None:
    assert ordered[0] is Refuses
    assert ordered.count(Refuses) == 1
    assert TimeoutMiddleware not in ordered, "BentoML's timeout is served as Backstop, in its place"
    assert ordered.count(Backstop) == 1
    assert ordered.index(Backstop) < ordered.index(Inner)


def test_a_refusal_runs_in_the_servers_task_not_behind_bentomls_timeout(ordered: list[type]) -> None:
    app = toy.to_asgi()
    Refuses.tasks.clear()

    async def refused() -> tuple[httpx.Response, asyncio.Task[typing.Any] | None]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toy") as client:
            return await client.post("/refuse", json={}), asyncio.current_task()

    response, server_task = asyncio.run(refused())
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    # httpx's ASGI transport awaits the app in the caller's task: behind BentoML's timeout the gate
    # would run in a task of its own.
    assert Refuses.tasks == [server_task]


async def _answers(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _live_timers() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is asyncio.TimerHandle and not o.cancelled())


def _get(app: ASGIApp, path: str = "/") -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toy") as client:
            return await client.get(path)

    return asyncio.run(call())


def _timers_left_by(app: ASGIApp, requests: int) -> int:
    async def call() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toy") as client:
            before = _live_timers()
            for _ in range(requests):
                assert (await client.get("/")).text == "ok"
            return _live_timers() - before

    return asyncio.run(call())


def test_no_timer_outlives_its_request() -> None:
    """BentoML's timeout leaves each request's timer scheduled for the whole timeout (and, with it,
    a future and a copy of the request's context for the collector to walk); Backstop stops it
    once the response starts."""
    assert _timers_left_by(TimeoutMiddleware(_answers, timeout=10), 20) == 20
    assert _timers_left_by(Backstop(_answers, timeout=10), 20) == 0


def test_a_request_with_no_response_by_the_timeout_is_cancelled_and_answered_504() -> None:
    cancelled: list[bool] = []

    async def stuck(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def swallows_its_cancellation(scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)

    started = time.perf_counter()
    response = _get(Backstop(stuck, timeout=0.2))
    assert time.perf_counter() - started < 5
    assert response.status_code == 504
    assert response.json() == {"error": "Not able to process the request in 0.2 seconds"}
    assert cancelled == [True]
    assert _get(Backstop(swallows_its_cancellation, timeout=0.2)).status_code == 504


def test_a_response_started_in_time_is_not_cut_off() -> None:
    async def slow_body(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.4)  # past the timeout, after the response started
        await send({"type": "http.response.body", "body": b"all of it"})

    response = _get(Backstop(slow_body, timeout=0.2))
    assert response.status_code == 200
    assert response.text == "all of it"


def test_an_error_before_any_response_is_raised_at_once_not_held_for_the_timeout() -> None:
    async def fails(scope: Scope, receive: Receive, send: Send) -> None:
        raise ValueError("broken endpoint")

    async def times_out_itself(scope: Scope, receive: Receive, send: Send) -> None:
        raise TimeoutError("the endpoint's own timeout")

    started = time.perf_counter()
    with pytest.raises(ValueError, match="broken endpoint"):
        _get(Backstop(fails, timeout=10))
    with pytest.raises(TimeoutError, match="the endpoint's own timeout"):  # not the backstop's: no 504
        _get(Backstop(times_out_itself, timeout=10))
    assert time.perf_counter() - started < 5


def test_api_methods_are_bound_once_and_still_served(ordered: list[type]) -> None:
    """BentoML's descriptor builds a new caller on every lookup (every request); bound, the
    instance answers with one caller, and BentoML's endpoint still serves through it."""
    service_class = typing.cast("type[typing.Any]", toy.inner)
    unbound = object.__new__(service_class)
    assert unbound.echo is not unbound.echo
    bound = service_class()
    assert bound.echo is bound.echo
    assert bound.echo("hi") == bound.echo.local("hi") == "hi"
    with TestClient(toy.to_asgi()) as client:  # runs the lifespan: BentoML builds the instance
        response = client.post("/echo", json={"text": "hello"})
    assert response.status_code == 200
    assert response.text == "hello"
