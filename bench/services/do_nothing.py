"""The HTTP ceiling: bare uvicorn + Starlette, a handler that parses the body and answers at once."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


async def score(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse(
        {"results": [{"transaction_id": t.get("transaction_id"), "score": 0.0} for t in body["transactions"]]}
    )


async def ready(_request: Request) -> JSONResponse:
    return JSONResponse({"ready": True})


app = Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/readyz", ready)])
