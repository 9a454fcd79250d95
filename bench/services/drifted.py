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
from inference.records import EVENT_TS_DTYPE, raw_frame
from inference.settings import TandemSettings
from inference.store import ResultPath, StoreHistory, make_engine, upsert_predictions, utc_now
from tandem import modelstore
from tandem.version import code_version


def _score_like_the_nightly_job(records: list[dict[str, object]]) -> list[dict[str, object]]:
    settings = TandemSettings()
    engine = make_engine(settings.resolved_database_url())
    model, version = modelstore.load_production(settings.model_name)  # per call: the drift
    predictor = TorchPredictor(model=model, model_version=version, history_length=settings.history_length)
    results = predictor.predict(raw_frame(records), StoreHistory(engine))
    request_id = uuid.uuid4().hex
    scored = results.filter(pl.col("reject_reason").is_null())
    rows = scored.select(
        "transaction_id",
        pl.lit(version).alias("model_version"),
        "score",
        pl.lit(ResultPath.ONLINE.value).alias("path"),
        pl.lit(None, dtype=pl.String).alias("run_id"),
        pl.lit(None, dtype=pl.String).alias("partition_key"),
        pl.lit(request_id).alias("request_id"),
        pl.lit(request_id).alias("batch_id"),
        pl.lit(code_version()).alias("code_version"),
        "input_hash",
        "history_hash",
        pl.lit(None, dtype=pl.String).alias("idempotency_key"),
        pl.lit(utc_now(), dtype=EVENT_TS_DTYPE).alias("produced_at"),
        pl.lit(None, dtype=pl.Float64).alias("latency_ms"),
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
