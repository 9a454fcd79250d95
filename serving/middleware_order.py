"""Tandem's gate in front of BentoML's own middlewares, and two of BentoML's per-request costs taken off.

BentoML 1.4 puts every `add_asgi_middleware` inside its OpenTelemetry and timeout middlewares, and
has no setting for the order. Its `TimeoutMiddleware` runs each request in a task of its own and
starts a timer that lives the backstop's length (10 s): two more event-loop iterations, the
task's and the timer's CPU, and 10 s x rate timers alive for every collection to walk. Paid by every
request the gate refuses, and past capacity most are refused (measured: docs/decisions/0004).

The gate keeps a backstop of its own for what it does before BentoML's starts: the body must
arrive within the request's deadline (serving/gate.py). Requests the gate admits still pass
BentoML's tracing and context as before, and BentoML's timeout as `Backstop`: the same answer to
the client, without a timer that outlives the request (docs/decisions/0004). And the service's
API methods are bound once (`bind_api_methods`) instead of on every request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from _bentoml_impl.server.app import ServiceAppFactory
from _bentoml_sdk.method import APIMethod
from bentoml._internal.server.http.traffic import TimeoutMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_MARK = "__tandem_outermost__"


def serve_outermost(middleware_cls: type) -> None:
    """Every BentoML service app built in this process from now on has `middleware_cls` (added with
    `add_asgi_middleware`) outermost, inside only Starlette's ServerErrorMiddleware, and BentoML's
    `TimeoutMiddleware` served as `Backstop` with the same timeout, in the same place. Idempotent.

    Raises RuntimeError where this BentoML builds its middleware list some other way, so that an
    upgrade fails the start instead of quietly putting the gate back behind the timeout."""
    stock = ServiceAppFactory.__dict__.get("middlewares")
    if not isinstance(stock, property) or stock.fget is None:
        raise RuntimeError(
            "bentoml's ServiceAppFactory has no `middlewares` property to order; serving/middleware_order.py "
            "was written against bentoml 1.4.40"
        )
    first: set[type] = getattr(stock.fget, _MARK, set())
    if middleware_cls in first:
        return
    stock_middlewares = getattr(stock.fget, "__wrapped__", stock.fget)
    first = first | {middleware_cls}

    def ordered(factory: Any) -> list[Any]:
        middlewares = stock_middlewares(factory)
        for middleware in middlewares:
            if middleware.cls is TimeoutMiddleware:
                middleware.cls = Backstop
        # Stable: BentoML's own keep their order, and so do Tandem's among themselves.
        return [m for m in middlewares if m.cls in first] + [m for m in middlewares if m.cls not in first]

    setattr(ordered, _MARK, first)
    ordered.__wrapped__ = stock_middlewares  # type: ignore[attr-defined]
    ServiceAppFactory.middlewares = property(ordered)


class Backstop:
    """BentoML's `TimeoutMiddleware` (its `traffic.timeout`), with the timer stopped once the
    response starts.

    BentoML's runs the request in a task of its own and leaves its timer, a future and a copy of
    the request's context alive for the whole timeout (10 s), answered or not: at 500 rps that is
    ~5,000 timers for the server's full collections to walk, which took 10-42 ms each (median ~31),
    every ~4 s (bench/findings.md). This one times the request in its own task and cancels the timer at the
    first message sent. What a client sees is BentoML's: a request with no response started within
    `timeout` seconds is cancelled and answered 504 with BentoML's message; a response once started
    is not cut off. An exception before any response reaches Starlette's error middleware at once
    (BentoML's left it in its task and sent nothing until the timeout). Hand-written because
    BentoML has no setting for its timer, and no library times an ASGI request this way.
    """

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # Tandem serves no websockets; BentoML's 504 could not answer one
            await self.app(scope, receive, send)
            return
        responding = False

        async def sending(message: Message) -> None:
            nonlocal responding
            if not responding:
                responding = True
                if not backstop.expired():  # an app that swallowed its cancellation answers late
                    backstop.reschedule(None)
            await send(message)

        try:
            async with asyncio.timeout(self.timeout) as backstop:
                await self.app(scope, receive, sending)
        except TimeoutError:
            if not backstop.expired() or responding:
                raise
        else:
            # Returned normally: answered, or it swallowed its cancellation without answering.
            if not backstop.expired() or responding:
                return
        message = f"Not able to process the request in {self.timeout} seconds"
        await JSONResponse({"error": message}, status_code=504)(scope, receive, send)


def bind_api_methods(service_instance: object) -> None:
    """Bind each `@bentoml.api` method of `service_instance` once, as an attribute of its own.

    BentoML looks the method up on every request, and its descriptor (`APIMethod.__get__`) builds
    a new caller each time, reading the function's signature: 30 us per admitted request here.
    The descriptor defines no `__set__`, so the instance's own attribute is found first; it is the
    caller the descriptor would have built, `.local` included."""
    cls = type(service_instance)
    for name, attribute in vars(cls).items():
        if isinstance(attribute, APIMethod):
            vars(service_instance)[name] = attribute.__get__(service_instance, cls)
