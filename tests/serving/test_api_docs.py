"""The API documents itself: every answer /score gives, with its error body, the request limits,
Tandem's description and the production model's version, in /openapi.json and in BentoML's
/docs.json (which BentoML's docs page renders)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

import serving
from serving.openapi import ApiDocs, Limits, amend_bentoml_document, limits_of, openapi_document
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.reference import REFERENCE

EVERY_SCORE_ANSWER = {"200", "400", "401", "408", "409", "413", "415", "422", "503", "504"}
LIMITS = limits_of(REFERENCE, ServingSettings.model_construct(), SecuritySettings.model_construct())


def bentoml_like_spec() -> dict[str, Any]:
    """The shape of BentoML 1.4's document: its default title and readme, 200/400/404/500 only."""
    return {
        "openapi": "3.0.2",
        "info": {
            "title": "TandemScorer",
            "description": "This is a Machine Learning Service created with BentoML.",
            "version": "None",
        },
        "paths": {
            "/score": {
                "post": {
                    "responses": {"200": {"description": "ok"}, "400": {}, "404": {}, "500": {}},
                    "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/x/ScoreRequest"}}}},
                }
            },
            "/readyz": {"get": {"responses": {"200": {}}}},
        },
        "components": {"schemas": {"BentoOwn": {"type": "object"}}},
    }


def test_the_limits_are_the_services_own_defaults() -> None:
    assert (
        Limits(
            plural="transactions",
            max_records=256,
            max_body_bytes=1024 * 1024,
            default_deadline_ms=2000.0,
            max_deadline_ms=9000.0,
            p99_target_ms=50.0,
        )
        == LIMITS
    )
    text = LIMITS.describe()
    assert "256 transactions" in text and "1,048,576 bytes" in text and "9000 ms" in text


def test_openapi_lists_every_answer_of_score_with_an_error_body() -> None:
    document = openapi_document(REFERENCE, LIMITS, model_version="risk_model:abc")
    responses = document["paths"]["/score"]["post"]["responses"]
    assert set(responses) == EVERY_SCORE_ANSWER
    for status in EVERY_SCORE_ANSWER - {"200"}:
        schema = responses[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorBody"}, status
    assert "Retry-After" in responses["503"]["headers"] and "Retry-After" in responses["409"]["headers"]
    assert document["info"]["version"] == "risk_model:abc"
    assert "256 transactions" in document["info"]["description"]


def test_bentomls_document_gets_tandems_answers_description_and_version() -> None:
    ours = openapi_document(REFERENCE, LIMITS, model_version="risk_model:abc")
    amended = amend_bentoml_document(bentoml_like_spec(), ours)
    assert amended["info"]["title"] == "Tandem risk scorer"
    assert "created with BentoML" not in amended["info"]["description"]
    assert amended["info"]["version"] == "risk_model:abc"
    post = amended["paths"]["/score"]["post"]
    assert set(post["responses"]) == EVERY_SCORE_ANSWER, "BentoML's 404/500 are not answers /score gives"
    assert post["responses"]["200"] == {"description": "ok"}, "BentoML's own 200 schema stays"
    assert post["requestBody"] == bentoml_like_spec()["paths"]["/score"]["post"]["requestBody"]
    assert {p["name"] for p in post["parameters"]} == {"X-Deadline-Ms", "Idempotency-Key"}
    assert "/lineage/{transaction_id}" in amended["paths"] and "/readyz" in amended["paths"]
    assert {"ErrorBody", "BentoOwn"} <= set(amended["components"]["schemas"])
    assert set(amended["paths"]["/readyz"]["get"]["responses"]) == {"200", "503"}
    assert "security" not in post and "securitySchemes" not in amended["components"]


def test_with_a_token_bentomls_document_declares_it_so_its_docs_page_can_send_it() -> None:
    ours = openapi_document(REFERENCE, LIMITS, bearer_auth=True, model_version="v")
    amended = amend_bentoml_document(bentoml_like_spec(), ours)
    assert amended["paths"]["/score"]["post"]["security"] == [{"bearer": []}]
    assert amended["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert amended["paths"]["/lineage/{transaction_id}"]["get"]["security"] == [{"bearer": []}]


def test_the_middleware_amends_docs_json_and_passes_everything_else() -> None:
    async def docs(_: Request) -> Response:
        return JSONResponse(bentoml_like_spec())

    async def other(_: Request) -> Response:
        return JSONResponse({"untouched": True})

    app = Starlette(routes=[Route("/docs.json", docs), Route("/other", other)])
    wrapped = ApiDocs(app, document=lambda: openapi_document(REFERENCE, LIMITS, model_version="v9"))
    with TestClient(wrapped) as client:
        answer = client.get("/docs.json")
        assert answer.status_code == 200
        assert int(answer.headers["content-length"]) == len(answer.content)
        assert answer.json()["info"]["version"] == "v9"
        assert client.get("/other").json() == {"untouched": True}


def _score_refusal_codes() -> set[tuple[str, str]]:
    """(status, error code) of every refusal the /score path builds: the gate's, the edge's, and
    the overload and outage refusals; the error code as the client reads it."""
    found = set()
    for module in ("gate", "security", "refusals", "idempotency"):
        tree = ast.parse((Path(serving.__file__).parent / f"{module}.py").read_text())
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) in ("Refused", "cls"):
                status, code = call.args[:2]
                assert isinstance(status, ast.Constant)
                text = ast.unparse(code).strip("'\"f").replace("{plural}", REFERENCE.spec.plural)
                found.add((str(status.value), text))
    return found


def test_every_refusal_of_score_is_documented_under_its_status_with_its_code() -> None:
    """The 413 was documented as "body_too_large" where the service answers "payload_too_large"."""
    responses = openapi_document(REFERENCE, LIMITS, model_version="v")["paths"]["/score"]["post"]["responses"]
    codes = _score_refusal_codes() - {("400", "client_disconnected")}  # the client left: nobody reads it
    assert {("413", "payload_too_large"), ("413", "too_many_transactions"), ("503", "store_unavailable")} <= codes
    for status, code in codes:
        assert code in responses[status]["description"], (status, code)
