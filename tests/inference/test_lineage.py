"""Lineage: first writer wins, the other path's verdict is recorded beside it, and the answer to
"why does transaction X have score Y" names path, producer, versions and agreement."""

from __future__ import annotations

import json
from datetime import date
from typing import Any

import polars as pl
import pytest
from sqlalchemy.engine import Engine

from inference.lineage import explain
from inference.records import EVENT_TS_DTYPE, validate
from inference.store import read_predictions, upsert_predictions, upsert_transactions, utc_now
from tandem import cli
from tests.inference.support import frame_of, record

DAY = date(2026, 11, 5)


def _row(path: str, score: float, input_hash: str) -> dict[str, Any]:
    batch = path == "batch"
    return {
        "transaction_id": "tx-lineage",
        "model_version": "risk_model:v1",
        "score": score,
        "path": path,
        "run_id": "run-1" if batch else None,
        "partition_key": DAY.isoformat() if batch else None,
        "request_id": None if batch else "req-9",
        "batch_id": None if batch else "batch-9",
        "code_version": "test",
        "input_hash": input_hash,
        "history_hash": "0" * 16,
        "idempotency_key": None,
        "produced_at": utc_now(),
        "latency_ms": None if batch else 7.0,
    }


def _write(engine: Engine, *rows: dict[str, Any]) -> int:
    with engine.begin() as conn:
        return upsert_predictions(conn, pl.DataFrame(list(rows), schema_overrides={"produced_at": EVENT_TS_DTYPE}))


@pytest.fixture
def stored_hash(engine: Engine) -> str:
    with engine.begin() as conn:
        upsert_transactions(conn, validate(frame_of(record(transaction_id="tx-lineage"))), DAY)
    return str(explain(engine, "tx-lineage", dagster_ui_url="http://ui").current_input_hash)


def test_first_writer_wins_and_the_other_path_is_recorded(engine: Engine, stored_hash: str) -> None:
    assert _write(engine, _row("batch", 0.25, stored_hash)) == 1
    assert _write(engine, _row("batch", 0.99, stored_hash)) == 0  # a replay never rewrites history
    assert _write(engine, _row("online", 0.2501, stored_hash)) == 1
    assert _write(engine, _row("online", 0.7, stored_hash)) == 0  # recorded once

    (stored,) = read_predictions(engine.connect()).to_dicts()
    assert (stored["path"], stored["score"], stored["cross_path"], stored["cross_path_score"]) == (
        "batch",
        0.25,
        "online",
        0.2501,
    )
    report = explain(engine, "tx-lineage", dagster_ui_url="http://ui:3000/")
    (result,) = report.results
    assert result.dagster_run_url == "http://ui:3000/runs/run-1"
    assert result.producer == f"dagster run run-1 partition {DAY.isoformat()}"
    assert result.other_path_producer == "request req-9 batch batch-9"
    assert result.paths_agree is False  # 1e-4 apart: beyond the 1e-5 parity tolerance
    assert result.input_is_current


def test_a_corrected_input_rewrites_the_row_and_clears_the_verdict(engine: Engine, stored_hash: str) -> None:
    _write(
        engine,
        _row("batch", 0.25, stored_hash),
    )
    _write(engine, _row("online", 0.25, stored_hash))
    assert _write(engine, _row("online", 0.4, "corrected-hash")) == 1
    (stored,) = read_predictions(engine.connect()).to_dicts()
    assert (stored["path"], stored["score"], stored["cross_path"]) == ("online", 0.4, None)
    (result,) = explain(engine, "tx-lineage", dagster_ui_url="http://ui").results
    assert result.paths_agree is None
    assert not result.input_is_current  # the stored record still has the old content


def test_the_cli_answers_in_text_and_json(
    engine: Engine, stored_hash: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(
        engine,
        _row("batch", 0.25, stored_hash),
    )
    _write(engine, _row("online", 0.25, stored_hash))
    monkeypatch.setenv("DATABASE_URL", engine.url.render_as_string(hide_password=False))
    assert cli.main(["lineage", "tx-lineage"]) == 0
    text = capsys.readouterr().out
    assert "via batch (dagster run run-1" in text and "online path: 0.250000" in text and ": agree" in text
    assert cli.main(["lineage", "tx-lineage", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["results"][0]["paths_agree"] is True
    assert cli.main(["lineage", "no-such-transaction"]) == 1
