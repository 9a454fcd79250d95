"""The HTTP contract of /score: pydantic models that are also the BentoML API's input and output
specs (its /docs.json, docs page and clients), and that generate Tandem's /openapi.json."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import bentoml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from inference.lineage import TransactionLineage
from inference.records import COUNTRIES, CURRENCIES, ID_MAX_LENGTH, MERCHANT_CATEGORIES, Transaction

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


def openapi_document(*, bearer_auth: bool = False) -> dict[str, Any]:
    """OpenAPI 3.1 for the routes of the scoring app (BentoML documents only its own @api routes).

    `bearer_auth`: the service was started with a token, so /score and /lineage declare it.
    """
    components: dict[str, Any] = {}

    def ref(model: type[Any]) -> dict[str, str]:
        schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in schema.pop("$defs", {}).items():
            components[name] = definition
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def body(model: type[Any], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
        answer: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": ref(model)}}}
        if headers:
            answer["headers"] = headers
        return answer

    retry_after = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait before retrying."}}
    unauthorized = {
        "WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer: the scheme to authenticate with."}
    }
    guarded: dict[str, Any] = {"security": [{"bearer": []}]} if bearer_auth else {}
    security_schemes = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}} if bearer_auth else {}
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
                            "description": (
                                "Milliseconds the client will wait; no work starts after it passes. "
                                "A longer one is cut to the service's longest (9000 by default; see the README)."
                            ),
                        },
                        {
                            "name": IDEMPOTENCY_HEADER,
                            "in": "header",
                            "required": False,
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                            "description": "Names one request body (Stripe's semantics): a retry with the "
                            "same key and body gets the first answer and writes nothing; the same key with "
                            "another body is refused with 422 idempotency_key_reused. Without a key only a "
                            "truly identical input and account history is answered from earlier.",
                        },
                    ],
                    "requestBody": {"required": True, "content": {"application/json": {"schema": ref(ScoreRequest)}}},
                    **guarded,
                    "responses": {
                        "200": body(ScoreResponse, "One result per transaction, scored or failed with a reason."),
                        "400": body(ErrorBody, "A malformed header."),
                        "401": body(ErrorBody, "A token is configured and the request lacks it.", unauthorized),
                        "409": body(
                            ErrorBody,
                            "idempotency_key_in_progress: another request with this key is still being answered.",
                            retry_after,
                        ),
                        "408": body(ErrorBody, "body_timeout: the body did not arrive within the request's deadline."),
                        "413": body(ErrorBody, "The body is over the size limit, or too many transactions."),
                        "422": body(
                            ErrorBody,
                            "Schema-invalid input (or malformed JSON): the field and the reason; or "
                            "idempotency_key_reused: the key was used with another request body.",
                        ),
                        "503": body(
                            ErrorBody,
                            "Shed: the predicted wait exceeds the target or deadline (with Retry-After); "
                            "or the scoring process died (the service reports not alive).",
                            retry_after,
                        ),
                        "504": body(ErrorBody, "The deadline passed before an answer was ready."),
                    },
                }
            },
            "/lineage/{transaction_id}": {
                "get": {
                    "summary": "Why does this transaction have this score",
                    "description": (
                        "Every stored result of one transaction: path, producer (Dagster run and partition, "
                        "or online request and batch), model and code version, input hash, cross-path agreement."
                    ),
                    "parameters": [
                        {
                            "name": "transaction_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "minLength": 1, "maxLength": ID_MAX_LENGTH},
                        }
                    ],
                    **guarded,
                    "responses": {
                        "200": body(TransactionLineage, "The source record's state and every result."),
                        "401": body(ErrorBody, "A token is configured and the request lacks it.", unauthorized),
                        "404": body(ErrorBody, "No source record and no result for this id."),
                        "422": body(ErrorBody, "Not a possible transaction id."),
                        "503": body(ErrorBody, "The result store is unreachable."),
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
        "components": {"schemas": _with_value_sets(components), **security_schemes},
    }


def _with_value_sets(components: dict[str, Any]) -> dict[str, Any]:
    """List the training vocabularies as examples, not as an `enum`: any value of the field's
    pattern is accepted (an unseen one is scored through the unknown bucket and flagged), and
    the known ones show clients (and fuzzers such as schemathesis) what the model knows best."""
    properties = components["Transaction"]["properties"]
    for name, values in (("currency", CURRENCIES), ("merchant_category", MERCHANT_CATEGORIES), ("country", COUNTRIES)):
        properties[name] = {**properties[name], "examples": list(values)}
    return components
