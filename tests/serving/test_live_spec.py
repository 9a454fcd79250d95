"""A real `bentoml serve` of another spec (TANDEM_MODEL_SPEC=tandem_specs.diabetes:SPEC: no entity,
K = 0, id `patient_id`), its model trained through the core: BentoML's client and plain HTTP send
`patients` and get answers named by `patient_id`; a malformed patient is refused with its field."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date, timedelta
from http import HTTPStatus
from typing import Any

import bentoml
import httpx
import polars as pl
import pytest
from bentoml.exceptions import BentoMLException

from inference.features import build_features
from inference.model import fit
from inference.spec import load_spec
from tandem import modelstore
from tandem_specs.diabetes.data import landing_day
from tests.serving.support import LiveServer, serve
from tests.shared import fresh_postgres_database

pytestmark = [pytest.mark.live, pytest.mark.postgres]

DIABETES = load_spec("tandem_specs.diabetes:SPEC")
START = date(2026, 11, 1)
DAYS = 7


def week() -> list[pl.DataFrame]:
    return [landing_day(START + timedelta(days=d), seed=7, start=START, days=DAYS) for d in range(DAYS)]


def trained_version() -> str:
    """The spec's model fitted through the core on six days (K = 0), held out on the seventh,
    registered with the spec and promoted."""
    days = [day.with_columns(event_ts=pl.col("visit_time").str.to_datetime(time_zone="UTC")) for day in week()]
    train, holdout = pl.concat(days[:-1]), days[-1]
    model, report = fit(
        DIABETES,
        build_features(DIABETES, train, train.head(0), 0),
        train["progressed"].to_numpy(),
        build_features(DIABETES, holdout, holdout.head(0), 0),
        holdout["progressed"].to_numpy(),
        config=DIABETES.spec.model_config(0),
        seed=7,
        epochs=20,
        batch_size=64,
        learning_rate=1e-2,
    )
    tag = modelstore.register(model, report, name=DIABETES.spec.model_name, code_version="test", spec=DIABETES)
    modelstore.promote(tag, spec=DIABETES)
    return tag


def patients(count: int) -> list[dict[str, Any]]:
    """Visits as a request sends them (no label), the held-out day's first."""
    return pl.concat(week()[::-1]).drop("progressed").head(count).to_dicts()


@pytest.fixture(scope="module")
def server(postgres_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    trained_version()
    data_dir = tmp_path_factory.mktemp("diabetes")
    with fresh_postgres_database(postgres_admin_url, prefix="tandem_diabetes") as url:
        env = {
            "TANDEM_MODEL_SPEC": DIABETES.path,
            "TANDEM_MODEL_NAME": DIABETES.spec.model_name,
            "DATABASE_URL": url,
            "TANDEM_DATA_DIR": str(data_dir),
        }
        with serve(LiveServer, env, data_dir / "serve.log") as live:
            yield live


def test_bentomls_client_sends_patients_and_gets_answers_by_patient_id(server: LiveServer) -> None:
    sent = patients(3)
    with bentoml.SyncHTTPClient(server.url) as client:
        answer = client.score(patients=sent)
        results = answer["results"]
        assert [r["patient_id"] for r in results] == [p["patient_id"] for p in sent]
        assert all(r["status"] == "scored" and 0.0 <= r["score"] <= 1.0 for r in results), results
        assert all(r["path"] == "online" and not r["degraded"] for r in results)
        with pytest.raises(BentoMLException) as invalid:
            client.score(patients=[{**sent[0], "sex": "male"}])
        assert invalid.value.error_code == HTTPStatus.UNPROCESSABLE_ENTITY and "sex" in str(invalid.value)


def test_plain_http_scores_patients_and_refuses_a_malformed_one_with_its_reason(server: LiveServer) -> None:
    sent = patients(5)[3:]
    answer = httpx.post(f"{server.url}/score", json={"patients": sent}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert [r["patient_id"] for r in answer.json()["results"]] == [p["patient_id"] for p in sent]
    unseen = httpx.post(f"{server.url}/score", json={"patients": [{**sent[0], "sex": "3"}]}, timeout=30)
    assert unseen.status_code == 200 and unseen.json()["results"][0]["unseen_fields"] == ["sex"]
    refused = httpx.post(f"{server.url}/score", json={"patients": [{**sent[0], "bmi": -4.0}]}, timeout=30)
    assert refused.status_code == 422, refused.text
    (problem,) = refused.json()["detail"]
    assert problem["loc"] == ["patients", 0, "bmi"] and "greater than or equal to 0" in problem["msg"]
    other = httpx.post(f"{server.url}/score", json={"transactions": sent}, timeout=30)
    assert other.status_code == 422
    too_many = httpx.post(f"{server.url}/score", json={"patients": patients(257)}, timeout=30)
    assert too_many.status_code == 413 and too_many.json()["error"] == "too_many_patients"


def test_the_documents_show_the_specs_request(server: LiveServer) -> None:
    for path in ("/docs.json", "/openapi.json"):
        schemas = httpx.get(f"{server.url}{path}", timeout=30).json()["components"]["schemas"]
        assert "patients" in schemas["ScoreRequest"]["properties"], path
        assert list(schemas["Patient"]["properties"]) == list(DIABETES.field_names), path
        assert "Transaction" not in schemas, path
    document = httpx.get(f"{server.url}/docs.json", timeout=30).json()
    assert "/lineage/{patient_id}" in document["paths"]
    assert document["info"]["title"] == DIABETES.spec.title
