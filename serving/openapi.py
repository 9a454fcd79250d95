"""The service's API documents: Tandem's /openapi.json, and BentoML's /docs.json (which its docs
page at / renders) amended with what BentoML cannot know: every refusal the service gives with its
error body, the request limits, Tandem's description and the production model's version."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inference.lineage import RecordLineage
from inference.spec import LoadedSpec
from serving.schemas import DEADLINE_HEADER, IDEMPOTENCY_HEADER, ErrorBody, api_models
from serving.security import SecuritySettings
from serving.settings import ServingSettings

BENTOML_DOCS_PATH = "/docs.json"
RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait before retrying."}}
UNAUTHORIZED = {
    "WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer: the scheme to authenticate with."}
}


@dataclass(frozen=True)
class Limits:
    """What a client must know before sending: each is enforced with the status named in the docs."""

    plural: str  # what a request lists (the spec's `plural`)
    max_records: int
    max_body_bytes: int
    default_deadline_ms: float
    max_deadline_ms: float
    p99_target_ms: float

    def describe(self) -> str:
        return (
            f"Limits: at most {self.max_records} {self.plural} and {self.max_body_bytes:,} bytes of body per "
            f"request (413 beyond); a request's deadline is X-Deadline-Ms (or the body's deadline_ms), "
            f"{self.default_deadline_ms:g} ms when unset and at most {self.max_deadline_ms:g} ms; a request whose "
            f"expected wait exceeds its deadline or the declared p99 of {self.p99_target_ms:g} ms is refused at "
            "once with 503 and Retry-After."
        )


def limits_of(spec: LoadedSpec, serving: ServingSettings, security: SecuritySettings) -> Limits:
    return Limits(
        plural=spec.spec.plural,
        max_records=serving.max_records_per_request,
        max_body_bytes=security.max_body_bytes,
        default_deadline_ms=min(serving.request_timeout_ms, serving.max_deadline_ms),
        max_deadline_ms=serving.max_deadline_ms,
        p99_target_ms=serving.p99_target_ms,
    )


def description(spec: LoadedSpec) -> str:
    """The spec's own words, then what every spec's service does."""
    own = f"{spec.spec.description} " if spec.spec.description else ""
    return (
        f"{own}Online, Tandem answers each {_record(spec)} on its own (a bad item fails only itself), from a "
        "warm model behind a bounded queue; the same model scores every day in batch through "
        f"Dagster, and GET /lineage/{{{spec.id.name}}} says which answer each path gave. "
    )


def _record(spec: LoadedSpec) -> str:
    return spec.spec.record_name.lower()


class _Components:
    """The schemas a document refers to, gathered as the document is built."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}

    def ref(self, model: type[Any]) -> dict[str, str]:
        schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
        self.schemas.update(schema.pop("$defs", {}))
        self.schemas[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def body(self, model: type[Any], description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "description": description,
            "content": {"application/json": {"schema": self.ref(model)}},
        }
        return answer | ({"headers": headers} if headers else {})


def _score_refusals(components: _Components, limits: Limits) -> dict[str, Any]:
    error = components.body
    return {
        "400": error(
            ErrorBody, "bad_header / bad_request: a malformed header, or a key in the header and the body that differ."
        ),
        "401": error(ErrorBody, "unauthorized: a token is configured and the request lacks it.", UNAUTHORIZED),
        "408": error(ErrorBody, "body_timeout: the body did not arrive within the request's deadline."),
        "409": error(
            ErrorBody, "idempotency_key_in_progress: another request with this key is being answered.", RETRY_AFTER
        ),
        "413": error(
            ErrorBody,
            f"payload_too_large (a body over {limits.max_body_bytes:,} bytes) or too_many_{limits.plural} "
            f"(over {limits.max_records}).",
        ),
        "415": error(
            ErrorBody,
            "unsupported_media_type: a body declared other than application/json (or a +json type); "
            "unsupported_content_encoding: a compressed body (send it uncompressed).",
        ),
        "422": error(
            ErrorBody,
            "invalid_request: schema-invalid input or malformed JSON, naming each field and reason (the invalid "
            "items are quarantined); or idempotency_key_reused: the key was used with another request body.",
        ),
        "503": error(
            ErrorBody,
            "overloaded: the expected wait exceeds the deadline or the p99 target (detail.reason); "
            "unavailable: the scoring process died and a new one is starting; or store_unavailable: the "
            "answer under the Idempotency-Key could not be stored, so it is not given (retry).",
            RETRY_AFTER,
        ),
        "504": error(ErrorBody, "deadline_exceeded: the deadline passed before an answer was ready."),
    }


def _score_parameters(limits: Limits) -> list[dict[str, Any]]:
    return [
        {
            "name": DEADLINE_HEADER,
            "in": "header",
            "required": False,
            "schema": {"type": "number", "exclusiveMinimum": 0},
            "description": f"Milliseconds the client will wait; no work starts after it passes. Unset: "
            f"{limits.default_deadline_ms:g}; a longer one is cut to {limits.max_deadline_ms:g}.",
        },
        {
            "name": IDEMPOTENCY_HEADER,
            "in": "header",
            "required": False,
            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
            "description": "Names one request body (Stripe's semantics): a retry with the same key and body gets "
            "the first answer and writes nothing; the same key with another body is refused with 422 "
            "idempotency_key_reused. Without a key only a truly identical input and history is answered from earlier.",
        },
    ]


def _lineage_path(spec: LoadedSpec, components: _Components, guarded: dict[str, Any]) -> dict[str, Any]:
    error = components.body
    record = _record(spec)
    return {
        "get": {
            "summary": f"Why does this {record} have this score",
            "description": f"Every stored answer of one {record} (path, producer, model and code version, input "
            "and history hashes, which is current), every time it was rejected, where and why, and the re-sent "
            "day that withdrew it, if one did.",
            "parameters": [
                {
                    "name": spec.id.name,
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "minLength": 1, "maxLength": spec.id.max_length},
                }
            ],
            **guarded,
            "responses": {
                "200": error(RecordLineage, "The source record's state, every answer and every rejection."),
                "401": error(ErrorBody, "A token is configured and the request lacks it.", UNAUTHORIZED),
                "404": error(ErrorBody, "No record, answer, rejection or withdrawal for this id."),
                "422": error(ErrorBody, f"Not a possible {record} id."),
                "503": error(ErrorBody, "The result store is unreachable.", RETRY_AFTER),
            },
        }
    }


def openapi_document(
    spec: LoadedSpec, limits: Limits, *, bearer_auth: bool = False, model_version: str = "unknown"
) -> dict[str, Any]:
    """OpenAPI 3.1 for every route of the service. `bearer_auth`: /score and /lineage declare the token."""
    components = _Components()
    guarded: dict[str, Any] = {"security": [{"bearer": []}]} if bearer_auth else {}
    api, record = api_models(spec), _record(spec)
    score = {
        "summary": f"Score one or more {spec.spec.plural}",
        "description": f"Each {record} is answered on its own: a model failure or a non-finite score fails only "
        "that item. " + limits.describe(),
        "parameters": _score_parameters(limits),
        "requestBody": {"required": True, "content": {"application/json": {"schema": components.ref(api.request)}}},
        **guarded,
        "responses": {
            "200": components.body(api.response, f"One result per {record}, scored or failed with a reason."),
            **_score_refusals(components, limits),
        },
    }
    probe = {"get": {"summary": "Liveness", "responses": {"200": {"description": "alive"}}}}
    ready = {"200": {"description": "ready"}, "503": {"description": "not ready"}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": spec.spec.title,
            "version": model_version,
            "description": description(spec) + limits.describe(),
        },
        "paths": {
            "/score": {"post": score},
            f"/lineage/{{{spec.id.name}}}": _lineage_path(spec, components, guarded),
            "/livez": probe,
            "/readyz": {
                "get": {"summary": "Readiness: model warm, the store or the outbox usable", "responses": ready}
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "metrics"}}}},
        },
        "components": {
            "schemas": _with_value_sets(spec, components.schemas),
            **({"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}} if bearer_auth else {}),
        },
    }


def _with_value_sets(spec: LoadedSpec, schemas: dict[str, Any]) -> dict[str, Any]:
    """List the training vocabularies as examples, not as an `enum`: an unseen value is accepted
    (scored through the unknown bucket), and the known ones show clients what the model knows best."""
    properties = schemas[spec.spec.record_name]["properties"]
    for field in spec.categoricals:
        properties[field.name] = {**properties[field.name], "examples": list(field.vocabulary)}
    return schemas


def service_document(
    spec: LoadedSpec, serving: ServingSettings, security: SecuritySettings, model_version: str
) -> dict[str, Any]:
    """The service's /openapi.json, with the limits and token it runs with."""
    limits = limits_of(spec, serving, security)
    return openapi_document(spec, limits, bearer_auth=security.auth_token is not None, model_version=model_version)


def amend_bentoml_document(bentoml_spec: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """BentoML's document with Tandem's title, description and version, /score's refusals and
    headers, and the routes of the mounted app (BentoML documents only its own)."""
    amended = dict(bentoml_spec)
    amended["info"] = {**bentoml_spec.get("info", {}), **ours["info"]}
    paths = dict(bentoml_spec.get("paths", {}))
    score = dict(paths.get("/score", {}).get("post", {}))
    ours_score = ours["paths"]["/score"]["post"]
    score["description"] = ours_score["description"]
    score["parameters"] = ours_score["parameters"]
    if "security" in ours_score:  # the docs page's "Authorize" sends the token
        score["security"] = ours_score["security"]
    # BentoML's 200 and request body keep its own schemas; every other status is Tandem's answer.
    responses = {code: answer for code, answer in score.get("responses", {}).items() if str(code) == "200"}
    score["responses"] = responses | {code: a for code, a in ours_score["responses"].items() if code != "200"}
    paths["/score"] = {**paths.get("/score", {}), "post": score}
    paths.update({path: answer for path, answer in ours["paths"].items() if path.startswith("/lineage/")})
    paths["/readyz"] = ours["paths"]["/readyz"]  # BentoML declares its 200 only; not ready is a 503
    amended["paths"] = paths
    components = dict(bentoml_spec.get("components", {}))
    ours_schemas = ours["components"]["schemas"]
    components["schemas"] = {**ours_schemas, **components.get("schemas", {})}
    if "securitySchemes" in ours["components"]:
        components["securitySchemes"] = {
            **components.get("securitySchemes", {}),
            **ours["components"]["securitySchemes"],
        }
    amended["components"] = components
    return amended


class ApiDocs:
    """ASGI middleware (BentoML's public `add_asgi_middleware`) that amends BentoML's /docs.json on
    its way out; every other request passes untouched."""

    def __init__(self, app: ASGIApp, *, document: Callable[[], dict[str, Any]]) -> None:
        self.app = app
        self.document = document

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != BENTOML_DOCS_PATH or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, capture)
        assert start is not None, "BentoML answered /docs.json without a response"
        body = b"".join(chunks)
        if start["status"] == 200:
            body = json.dumps(amend_bentoml_document(json.loads(body), self.document())).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
