"""Stock BentoML: a plain `batchable=True` API with default settings, doing the same work per
request as Tandem's service (validation, history, features, model, result write) the way a
typical service does it: validate the batch, score the batch, write the batch; any exception
fails the whole adaptive batch, which is BentoML's behaviour being measured."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import bentoml
import polars as pl
import pydantic

from inference.features import build_features
from inference.model import load_model, score_batch
from inference.records import EVENT_TS_DTYPE, hash_inputs, raw_frame, validate
from inference.settings import TandemSettings
from inference.spec import configured_spec
from inference.spec.api import record_model
from inference.store import ResultPath, StoreHistory, make_engine, upsert_predictions, utc_now
from tandem import modelstore
from tandem.version import code_version

_SETTINGS = TandemSettings()
RECORD_SPEC = configured_spec()
_RECORD = record_model(RECORD_SPEC)
_ID = RECORD_SPEC.id.name
# The body a plain batchable API takes: one list, under the spec's plural. BentoML hands a batchable
# API its batch as the one argument, whatever the field is named.
_REQUEST_FIELDS: dict[str, Any] = {RECORD_SPEC.spec.plural: (list[dict[str, Any]], ...)}
_REQUEST = pydantic.create_model("StockRequest", __base__=bentoml.IODescriptor, **_REQUEST_FIELDS)
_TAG = modelstore.production_tag(_SETTINGS.model_name) or f"{_SETTINGS.model_name}:latest"


@bentoml.service
class StockScorer:
    model_ref = bentoml.models.BentoModel(_TAG)

    def __init__(self) -> None:
        self.model = load_model(Path(self.model_ref.path), RECORD_SPEC)
        self.version = str(self.model_ref.tag)
        self.engine = make_engine(_SETTINGS.resolved_database_url())
        self.history = StoreHistory(RECORD_SPEC, self.engine)

    @bentoml.api(batchable=True, input_spec=_REQUEST)
    def score(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records = [_RECORD(**record).to_raw() for record in batch]  # raises on poison: whole batch fails
        checked = validate(RECORD_SPEC, raw_frame(RECORD_SPEC, records)).drop("reject_reason")
        # With input hashes, the features digest the history they read.
        checked = checked.with_columns(hash_inputs(RECORD_SPEC, checked))
        k = self.model.history_length  # the K it was trained with
        features = build_features(RECORD_SPEC, checked, self.history.history_for(checked, k), k)
        scores = score_batch(self.model, features)
        request_id = uuid.uuid4().hex
        rows = pl.DataFrame(
            {
                "record_id": checked[_ID],
                "model_version": self.version,
                "score": scores,
                "path": ResultPath.ONLINE.value,
                "run_id": None,
                "partition_key": None,
                "request_id": request_id,
                "batch_id": request_id,
                "code_version": code_version(),
                "input_hash": checked["input_hash"],
                "history_hash": features.history_digests,
                "idempotency_key": None,
                "produced_at": pl.Series([utc_now()] * checked.height, dtype=EVENT_TS_DTYPE),
                "latency_ms": None,
            },
            schema_overrides={
                "run_id": pl.String,
                "partition_key": pl.String,
                "history_hash": pl.String,
                "idempotency_key": pl.String,
                "latency_ms": pl.Float64,
            },
        )
        with self.engine.begin() as conn:
            upsert_predictions(conn, rows)
        return [{_ID: record_id, "score": float(s)} for record_id, s in zip(checked[_ID], scores, strict=True)]
