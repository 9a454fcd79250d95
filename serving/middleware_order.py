"""Tandem's gate in front of BentoML's own middlewares.

BentoML 1.4 puts every `add_asgi_middleware` inside its OpenTelemetry and timeout middlewares, and
has no setting for the order. Its `TimeoutMiddleware` runs each request in a task of its own and
starts a timer that lives the backstop's length (10 s): two more event-loop iterations, the
task's and the timer's CPU, and 10 s x rate timers alive for every collection to walk. Paid by every
request the gate refuses, and past capacity most are refused (measured: docs/decisions/0004).

The gate keeps a backstop of its own for what it does before BentoML's starts: the body must
arrive within the request's deadline (serving/gate.py). Requests the gate admits still pass
BentoML's timeout, tracing and context as before.
"""

from __future__ import annotations

from typing import Any

from _bentoml_impl.server.app import ServiceAppFactory

_MARK = "__tandem_outermost__"


def serve_outermost(middleware_cls: type) -> None:
    """Every BentoML service app built in this process from now on has `middleware_cls` (added with
    `add_asgi_middleware`) outermost, inside only Starlette's ServerErrorMiddleware. Idempotent.

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
        # Stable: BentoML's own keep their order, and so do Tandem's among themselves.
        return [m for m in middlewares if m.cls in first] + [m for m in middlewares if m.cls not in first]

    setattr(ordered, _MARK, first)
    ordered.__wrapped__ = stock_middlewares  # type: ignore[attr-defined]
    ServiceAppFactory.middlewares = property(ordered)
