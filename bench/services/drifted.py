"""The drifted baseline: the nightly batch function behind an endpoint, model loaded on every call.

This is what a batch job becomes when nobody redesigns it: correct, and slow for the wrong reasons.
"""

from __future__ import annotations

import uuid

import polars as pl
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from inference.contract import TorchPredictor
from inference.records import raw_frame
from inference.settings import TandemSettings
from inference.store import OnlineProducer, StoreHistory, make_engine, prediction_rows, upsert_predictions, utc_now
from tandem import modelstore
from tandem.version import code_version


def _score_like_the_nightly_job(records: list[dict[str, object]]) -> list[dict[str, object]]:
    settings = TandemSettings()
    engine = make_engine(settings.resolved_database_url())
    model, version = modelstore.load_production(settings.model_name)  # per call: the drift
    predictor = TorchPredictor(model=model, model_version=version)
    results = predictor.predict(raw_frame(records), StoreHistory(engine))
    request_id = uuid.uuid4().hex
    scored = results.filter(pl.col("reject_reason").is_null())
    rows = prediction_rows(
        scored,
        producer=OnlineProducer(request_id=request_id, batch_id=request_id, code_version=code_version()),
        model_version=version,
        produced_at=utc_now(),
    )
    with engine.begin() as conn:
        upsert_predictions(conn, rows)
    engine.dispose()
    return results.select("transaction_id", "score", "reject_reason").to_dicts()


async def score(request: Request) -> JSONResponse:
    body = await request.json()
    results = await run_in_threadpool(_score_like_the_nightly_job, body["transactions"])
    status = 200 if all(r["reject_reason"] is None for r in results) else 422
    return JSONResponse({"results": results}, status_code=status)


async def ready(_request: Request) -> JSONResponse:
    return JSONResponse({"ready": True})


app = Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/readyz", ready)])
