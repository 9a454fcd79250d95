"""The gate is served in front of BentoML's own middlewares (serving/middleware_order.py), on the
real BentoML app factory: its refusals run in the server's own task, with no timeout task, timer
or tracing in front of them."""

from __future__ import annotations

import asyncio
import typing

import bentoml
import httpx
import pytest
from _bentoml_impl.server.app import ServiceAppFactory
from bentoml._internal.server.http.traffic import TimeoutMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.middleware_order import serve_outermost


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
    @bentoml.api
    def echo(self, text: str) -> str:
        return text


toy = typing.cast("bentoml.Service[Toy]", Toy)
toy.add_asgi_middleware(Refuses)
toy.add_asgi_middleware(Inner)


@pytest.fixture(scope="module")
def ordered() -> list[type]:
    toy.inject_config()
    stock = [m.cls for m in ServiceAppFactory(toy).middlewares]
    serve_outermost(Refuses)
    serve_outermost(Refuses)  # twice: still one reordering
    after = [m.cls for m in ServiceAppFactory(toy).middlewares]
    # BentoML's own order (the stock list has the user middlewares after its timeout).
    assert stock.index(TimeoutMiddleware) < stock.index(Refuses) < stock.index(Inner)
    return after


def test_the_gate_comes_first_and_everything_else_keeps_its_order(ordered: list[type]) -> None:
    assert ordered[0] is Refuses
    assert ordered.count(Refuses) == 1
    assert TimeoutMiddleware in ordered
    assert ordered.index(TimeoutMiddleware) < ordered.index(Inner)


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
