"""The HTTP ceiling: bare uvicorn + Starlette, a handler that parses the body and answers at once."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from inference.spec import configured_spec

# Read once at start, so a request pays for nothing the spec could add.
_SPEC = configured_spec()
_PLURAL, _ID = _SPEC.spec.plural, _SPEC.id.name


async def score(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"results": [{_ID: record.get(_ID), "score": 0.0} for record in body[_PLURAL]]})


async def ready(_request: Request) -> JSONResponse:
    return JSONResponse({"ready": True})


app = Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/readyz", ready)])
