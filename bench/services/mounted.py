"""Tandem with `POST /score` as a route of the mounted Starlette app, as it was served before it
became a `@bentoml.api` method: the same gate, scorer and answer, without BentoML's API path.
The benchmark runs both side by side to measure what the native API costs."""

from __future__ import annotations

import bentoml

from serving.app import build_app
from serving.service import RiskScorer, current_scorer


@bentoml.asgi_app(build_app(current_scorer, score_route=True), path="/")
@bentoml.service(**RiskScorer.config)
class MountedScorer(RiskScorer.inner):  # type: ignore[name-defined, misc]
    score = None  # not an API here: the mounted app's /score answers instead
