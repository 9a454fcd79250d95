"""/score's documents follow the spec: its records under its plural, each result named by its id
field, its categoricals in the result's words; the reference's names stay (the golden test holds its
schemas bit for bit)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from inference.spec import LoadedSpec, load_spec
from serving.openapi import service_document
from serving.schemas import api_models
from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.reference import REFERENCE

TINY = load_spec("tests.specs.tiny:SPEC")
DIABETES = load_spec("tandem_specs.diabetes:SPEC")


def document(spec: LoadedSpec) -> dict[str, Any]:
    return service_document(spec, ServingSettings(), SecuritySettings(), "v1")


@pytest.mark.parametrize(
    ("spec", "plural", "record", "id_name"),
    [
        (TINY, "readings", "Reading", "reading_id"),
        (DIABETES, "patients", "Patient", "patient_id"),
        (REFERENCE, "transactions", "Transaction", "transaction_id"),
    ],
    ids=["tiny", "diabetes", "reference"],
)
def test_the_document_lists_the_specs_records_and_names_results_by_its_id(
    spec: LoadedSpec, plural: str, record: str, id_name: str
) -> None:
    doc = document(spec)
    schemas = doc["components"]["schemas"]
    request = schemas["ScoreRequest"]
    assert list(request["properties"]) == [plural, "idempotency_key", "deadline_ms"]
    assert request["required"] == [plural] and request["additionalProperties"] is False
    assert request["properties"][plural]["items"] == {"$ref": f"#/components/schemas/{record}"}
    assert list(schemas[record]["properties"]) == list(spec.field_names)
    result = schemas["ItemResult"]
    assert next(iter(result["properties"])) == id_name and result["required"][0] == id_name
    assert schemas["ScoreResponse"]["properties"]["results"]["items"] == {"$ref": "#/components/schemas/ItemResult"}
    score = doc["paths"]["/score"]["post"]
    assert f"too_many_{plural}" in score["responses"]["413"]["description"]
    assert f"at most 256 {plural}" in score["description"]
    lineage = doc["paths"][f"/lineage/{{{id_name}}}"]["get"]
    assert lineage["parameters"][0]["name"] == id_name
    assert doc["info"]["title"] == spec.spec.title


def test_each_categorical_is_documented_with_its_vocabulary_and_named_in_unseen_fields() -> None:
    schemas = document(DIABETES)["components"]["schemas"]
    assert schemas["Patient"]["properties"]["sex"]["examples"] == ["1", "2"]
    assert "among sex)" in schemas["ItemResult"]["properties"]["unseen_fields"]["description"]
    numeric = schemas["Patient"]["properties"]["age"]
    assert numeric["minimum"] == 0.0 and numeric["maximum"] == 120.0
    tiny = document(TINY)["components"]["schemas"]
    assert tiny["Reading"]["properties"]["colour"]["examples"] == ["red", "green", "blue"]
    assert "among colour)" in tiny["ItemResult"]["properties"]["unseen_fields"]["description"]


def test_a_request_is_read_with_the_specs_record_model() -> None:
    models = api_models(DIABETES)
    patient = DIABETES.spec.example()
    parsed = models.request.model_validate({"patients": [patient]})
    (record,) = parsed.patients  # type: ignore[attr-defined]
    assert record.to_raw()["patient_id"] == "patient-0000"
    with pytest.raises(ValueError, match="transactions"):
        models.request.model_validate({"patients": [patient], "transactions": []})
    with pytest.raises(ValueError, match="age"):
        models.request.model_validate({"patients": [{**patient, "age": -1.0}]})


def test_a_result_crosses_to_and_from_the_scoring_process_as_its_specs_class() -> None:
    # Loaded here: the scoring process rebuilds a result from the spec its path loads now.
    for path in ("tests.specs.tiny:SPEC", "tandem_specs.diabetes:SPEC", "tandem_specs.transactions:SPEC"):
        spec = load_spec(path)
        result_model = api_models(spec).item_result
        result = result_model.for_record(
            "r-1",
            status="scored",
            score=0.5,
            model_version="v1",
            path="online",
            request_id="q",
            produced_at="2026-11-01T00:00:00Z",
        )
        again = pickle.loads(pickle.dumps(result))
        assert type(again) is result_model and again == result
        assert again.model_dump()[spec.id.name] == "r-1"


def test_the_models_are_built_once_per_spec_however_it_is_loaded() -> None:
    assert api_models(load_spec()) is api_models(load_spec("tandem_specs.transactions:SPEC"))
    assert api_models(TINY).request is not api_models(DIABETES).request
