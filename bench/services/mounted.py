"""Tandem with `POST /score` as a route of the mounted Starlette app, as it was served before it
became a `@bentoml.api` method: the same gate, scorer and answer, without BentoML's API path.
The benchmark runs both side by side to measure what the native API costs."""

from __future__ import annotations

import bentoml

from bench.services.score_route import with_score_route
from serving.service import RiskScorer, current_scorer


@bentoml.asgi_app(with_score_route(current_scorer), path="/")
@bentoml.service(**RiskScorer.config)
class MountedScorer(RiskScorer.inner):  # type: ignore[name-defined, misc]
    score = None  # not an API here: the mounted app's /score answers instead
