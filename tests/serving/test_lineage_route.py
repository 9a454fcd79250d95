"""GET /lineage/{id} says what `tandem lineage ID` says, a rejection included; 404 only for an id
nothing is known of."""

from __future__ import annotations

from urllib.parse import quote

import polars as pl
import pytest
from sqlalchemy.engine import Engine
from starlette.testclient import TestClient

from inference.batch import ingest_day
from inference.sources.common import conform
from serving.app import build_app
from serving.security import SecuritySettings
from tests.inference.support import DAY, record
from tests.reference import REFERENCE


class _Scorer:
    """What the lineage route reads of the scorer: the spec, the store and the production version."""

    def __init__(self, engine: Engine) -> None:
        self.spec = REFERENCE
        self.engine = engine
        self.model_version = "risk:v1"


@pytest.fixture
def client(sqlite_engine: Engine) -> TestClient:
    scorer = _Scorer(sqlite_engine)
    return TestClient(build_app(lambda: scorer, security=SecuritySettings(auth_token=None)))  # type: ignore[arg-type, return-value]


def test_a_rejected_id_is_answered_with_where_and_why(client: TestClient, sqlite_engine: Engine) -> None:
    cells = pl.DataFrame({name: [str(value)] for name, value in record(transaction_id="tx-bad").items()})
    unparsable = conform(REFERENCE, cells.with_columns(amount=pl.lit("12;50")), "day.csv", typed=False)
    ingest_day(REFERENCE, sqlite_engine, unparsable, DAY)

    answer = client.get("/lineage/tx-bad")

    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["source_found"], body["results"]) == (False, [])
    (rejection,) = body["rejections"]
    assert (rejection["reason"], rejection["stage"], rejection["path"]) == ("amount_unparsable", "ingest", "batch")
    assert rejection["where"] == f"batch ingest of partition {DAY.isoformat()}"
    assert '"amount": "12;50"' in rejection["received"]


def test_an_id_nothing_is_known_of_is_404(client: TestClient) -> None:
    answer = client.get("/lineage/tx-unknown")

    assert answer.status_code == 404
    assert answer.json()["error"] == "not_found"


def test_an_id_is_looked_up_as_it_was_stored_without_surrounding_whitespace(
    client: TestClient, sqlite_engine: Engine
) -> None:
    cells = pl.DataFrame({name: [str(value)] for name, value in record(transaction_id="tx-padded").items()})
    ingest_day(
        REFERENCE, sqlite_engine, conform(REFERENCE, cells.with_columns(amount=pl.lit("x")), "d.csv", typed=False), DAY
    )

    assert client.get("/lineage/%C2%A0tx-padded%20").status_code == 200


@pytest.mark.parametrize("record_id", ["tx/with/slashes", "tx\nwith a newline", "tx\twith\u2028separators"])
def test_an_id_of_any_characters_is_looked_up(client: TestClient, sqlite_engine: Engine, record_id: str) -> None:
    """An id with a newline was scored and stored, and its lineage was Starlette's plain-text 404:
    the `path` convertor's ".*" does not match a newline."""
    cells = pl.DataFrame({name: [str(value)] for name, value in record(transaction_id=record_id).items()})
    ingest_day(
        REFERENCE, sqlite_engine, conform(REFERENCE, cells.with_columns(amount=pl.lit("x")), "d.csv", typed=False), DAY
    )

    answer = client.get("/lineage/" + quote(record_id, safe="/"))

    assert answer.status_code == 200, answer.text
    assert answer.json()["record_id"] == record_id
