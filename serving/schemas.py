"""The HTTP contract of /score: pydantic models that are also the BentoML API's input and output
specs (its /docs.json, docs page and clients); serving/openapi.py builds the documents from them."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

import bentoml
from pydantic import BaseModel, ConfigDict, Field

from inference.spec import load_spec
from inference.spec.api import RecordBase, record_model

# The spec the service scores: the reference's until TANDEM_MODEL_SPEC (0012 step 8).
RECORD_SPEC = load_spec()
RECORD_ID = RECORD_SPEC.id.name
if TYPE_CHECKING:  # the fields exist at run time only: a type checker knows the base
    Transaction = RecordBase
else:
    Transaction = record_model(RECORD_SPEC)

DEADLINE_HEADER = "X-Deadline-Ms"
IDEMPOTENCY_HEADER = "Idempotency-Key"
REQUEST_ID_HEADER = "X-Request-ID"


class ScoreRequest(bentoml.IODescriptor):
    model_config = ConfigDict(extra="forbid")

    transactions: list[Transaction] = Field(min_length=1, description="Transactions to score, in answer order.")
    idempotency_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="The Idempotency-Key header, for clients that cannot set headers (BentoML's); "
        "the header wins when both are sent and equal, and they must not differ.",
    )
    deadline_ms: float | None = Field(
        default=None, gt=0, description="The X-Deadline-Ms header, for clients that cannot set headers."
    )


class ItemError(BaseModel):
    reason: str = Field(description="A reject reason code (e.g. model_error, nonfinite_score).")
    detail: str | None = None


class ItemResult(BaseModel):
    transaction_id: str
    status: Literal["scored", "error"]
    score: float | None = Field(default=None, description="Fraud probability in [0, 1].")
    model_version: str
    path: Literal["online", "batch"] = Field(description="Which path produced the answer (a stored batch row).")
    request_id: str | None = Field(description="The request that produced the answer (lineage), maybe an earlier one.")
    batch_id: str | None = None
    produced_at: datetime
    input_hash: str | None = None
    degraded: bool = Field(default=False, description="Scored without account history: the database was down.")
    unseen_fields: list[str] = Field(
        default_factory=list,
        description="Fields (sorted; among merchant_category, country, currency) whose value the model was not "
        "trained on: well-formed, so scored through the model's 'unknown' bucket, with less to go on.",
    )
    error: ItemError | None = None


class ScoreResponse(bentoml.IODescriptor):
    request_id: str
    results: list[ItemResult]


class ErrorBody(BaseModel):
    error: str
    detail: Any = None
