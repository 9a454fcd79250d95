"""The HTTP contract of /score: pydantic models that also generate its OpenAPI document."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inference.records import Transaction

DEADLINE_HEADER = "X-Deadline-Ms"
IDEMPOTENCY_HEADER = "Idempotency-Key"
REQUEST_ID_HEADER = "X-Request-ID"


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    transactions: list[Transaction] = Field(min_length=1, description="Transactions to score, in answer order.")


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
    error: ItemError | None = None


class ScoreResponse(BaseModel):
    request_id: str
    results: list[ItemResult]


class ErrorBody(BaseModel):
    error: str
    detail: Any = None


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for the routes of the scoring app (BentoML documents only its own @api routes)."""
    components: dict[str, Any] = {}

    def ref(model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            components[name] = definition
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def body(model: type[BaseModel], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
        answer: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": ref(model)}}}
        if headers:
            answer["headers"] = headers
        return answer

    retry_after = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait before retrying."}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tandem risk scorer", "version": "1"},
        "paths": {
            "/score": {
                "post": {
                    "summary": "Score one or more transactions",
                    "description": (
                        "Each transaction is answered on its own: a model failure or a non-finite score "
                        "fails only that item. Schema errors reject the request with 422 before it is queued."
                    ),
                    "parameters": [
                        {
                            "name": DEADLINE_HEADER,
                            "in": "header",
                            "required": False,
                            "schema": {"type": "number", "exclusiveMinimum": 0},
                            "description": "Milliseconds the client will wait; no work starts after it passes.",
                        },
                        {
                            "name": IDEMPOTENCY_HEADER,
                            "in": "header",
                            "required": False,
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                            "description": "Retries with the same key get the stored answer and write nothing. "
                            "Default: transaction id + model version.",
                        },
                    ],
                    "requestBody": {"required": True, "content": {"application/json": {"schema": ref(ScoreRequest)}}},
                    "responses": {
                        "200": body(ScoreResponse, "One result per transaction, scored or failed with a reason."),
                        "400": body(ErrorBody, "A malformed header."),
                        "422": body(ErrorBody, "Schema-invalid input: the field and the reason."),
                        "503": body(ErrorBody, "Shed: the predicted wait exceeds the target or deadline.", retry_after),
                        "504": body(ErrorBody, "The deadline passed before an answer was ready."),
                    },
                }
            },
            "/livez": {"get": {"summary": "Liveness", "responses": {"200": {"description": "alive"}}}},
            "/readyz": {
                "get": {
                    "summary": "Readiness: model warm, and the database or the outbox usable",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "metrics"}}}},
        },
        "components": {"schemas": components},
    }
