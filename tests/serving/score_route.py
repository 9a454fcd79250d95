"""`POST /score` as a route of the mounted Starlette app rather than a `@bentoml.api` method: the
same gate, scorer and `answer` the service runs, driven in-process by tests without a server."""

from __future__ import annotations

from collections.abc import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from serving.app import answer, build_app
from serving.gate import ScoreGate, call_in
from serving.runtime import OnlineScorer
from serving.security import SecuritySettings


def with_score_route(get_scorer: Callable[[], OnlineScorer], *, security: SecuritySettings | None = None) -> Starlette:
    """The service's mounted app, plus `/score` behind the gate."""
    app = build_app(get_scorer, security=security)

    async def score(request: Request) -> Response:
        # The body the gate validated, parsed again as BentoML's API method would.
        scorer = get_scorer()
        parsed = scorer.api.request.model_validate_json(await request.body())
        records = getattr(parsed, scorer.spec.spec.plural)
        return await answer(call_in(request.scope), scorer, records, parsed.idempotency_key, parsed.deadline_ms)

    app.add_route("/score", score, methods=["POST"])
    app.add_middleware(ScoreGate, get_scorer=get_scorer, security=security)
    return app
