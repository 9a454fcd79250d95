"""Lineage: both paths' answers are kept, an online answer is never rewritten, and "why does
transaction X have score Y" lists every answer, the current one, and the cause of any difference
between an online answer and the batch one."""

from __future__ import annotations

import json
from datetime import date, timedelta
from typing import Any

import polars as pl
import pytest
from sqlalchemy.engine import Engine

from inference.agreement import Cause
from inference.batch import ingest_day
from inference.contract import describe_rejection
from inference.lineage import cli_run_id, explain
from inference.records import validate
from inference.sources.common import conform
from inference.store import RejectStage, ResultPath, quarantine, read_predictions, upsert_records, utc_now
from tandem import cli
from tests.answers import answer, write_answers
from tests.inference.support import frame_of, record
from tests.reference import REFERENCE

DAY = date(2026, 11, 5)
TX = "tx-lineage"
T0 = utc_now() - timedelta(hours=1)


def _at(minutes: int) -> dict[str, Any]:
    return {"produced_at": T0 + timedelta(minutes=minutes)}


def _batch(score: float, input_hash: str, minutes: int = 10, **changes: Any) -> dict[str, Any]:
    return answer(
        TX, path="batch", score=score, input_hash=input_hash, partition_key=DAY.isoformat(), **_at(minutes), **changes
    )


def _online(score: float, input_hash: str, minutes: int = 0, **changes: Any) -> dict[str, Any]:
    return answer(TX, path="online", score=score, input_hash=input_hash, request_id="req-9", **_at(minutes), **changes)


def _store_record(engine: Engine, **changes: Any) -> str:
    with engine.begin() as conn:
        upsert_records(REFERENCE, conn, validate(REFERENCE, frame_of(record(transaction_id=TX, **changes))), DAY)
    return str(explain(REFERENCE, engine, TX, dagster_ui_url="http://ui").current_input_hash)


def _stored(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return read_predictions(conn, record_id=TX).sort("path", "produced_at").to_dicts()


@pytest.fixture
def stored_hash(engine: Engine) -> str:
    return _store_record(engine)


def test_a_batch_scored_by_tandem_demo_names_its_run_without_a_dagster_link(engine: Engine, stored_hash: str) -> None:
    """Such a run is no Dagster run: its link was a page that does not exist."""
    run_id = cli_run_id()
    assert write_answers(engine, _batch(0.25, stored_hash, run_id=run_id)) == 1
    (result,) = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui:3000/").results
    assert (result.producer, result.dagster_run_url) == (f"tandem demo run {run_id} partition {DAY.isoformat()}", None)


@pytest.mark.parametrize("online_first", [True, False], ids=["online-then-batch", "batch-then-online"])
def test_both_answers_are_kept_whichever_path_writes_first(
    engine: Engine, stored_hash: str, online_first: bool
) -> None:
    online, batch = _online(0.25, stored_hash), _batch(0.25 + 1e-7, stored_hash)
    for row in (online, batch) if online_first else (batch, online):
        assert write_answers(engine, row) == 1

    stored = _stored(engine)
    assert [(row["path"], row["score"]) for row in stored] == [("batch", 0.25 + 1e-7), ("online", 0.25)]
    report = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui:3000/")
    by_path = {result.path: result for result in report.results}
    assert by_path.keys() == {"batch", "online"}
    assert by_path["batch"].dagster_run_url == "http://ui:3000/runs/run-1"
    assert by_path["batch"].producer == f"dagster run run-1 partition {DAY.isoformat()}"
    assert by_path["online"].producer == "request req-9 batch batch-of-req-9"
    assert (by_path["online"].batch_score, by_path["online"].versus_batch) == (0.25 + 1e-7, Cause.AGREE.value)
    assert (by_path["batch"].batch_score, by_path["batch"].versus_batch) == (None, None)
    assert all(result.input_is_current for result in report.results)


def test_an_online_answer_is_rewritten_neither_by_batch_nor_by_a_later_online_answer(
    engine: Engine, stored_hash: str
) -> None:
    write_answers(engine, _online(0.25, stored_hash))
    (first,) = _stored(engine)

    assert write_answers(engine, _batch(0.6, stored_hash)) == 1  # beside it
    assert write_answers(engine, _online(0.7, stored_hash, minutes=5)) == 0  # same input and history: a replay
    assert write_answers(engine, _batch(0.6, stored_hash, run_id="run-2")) == 0  # a batch rerun of the same answer
    # The account's history changed before the client retried: a second answer, kept beside the first.
    assert write_answers(engine, _online(0.3, stored_hash, minutes=6, history_hash="history-2")) == 1

    stored = _stored(engine)
    assert [(row["path"], row["score"]) for row in stored] == [("batch", 0.6), ("online", 0.25), ("online", 0.3)]
    assert stored[1] == first
    causes = [result.versus_batch for result in explain(REFERENCE, engine, TX, dagster_ui_url="http://ui").results]
    # The first online answer read the same history as batch and still differs: a skew bug, named so.
    assert sorted(cause for cause in causes if cause) == [Cause.HISTORY_CHANGED.value, Cause.UNEXPLAINED.value]


def test_a_corrected_input_rewrites_the_batch_row_and_keeps_the_online_rows(engine: Engine, stored_hash: str) -> None:
    write_answers(engine, _online(0.25, stored_hash), _batch(0.25, stored_hash))
    online_before = [row for row in _stored(engine) if row["path"] == "online"]

    corrected = _store_record(engine, amount=4250.0)
    assert corrected != stored_hash
    assert write_answers(engine, _batch(0.4, corrected, minutes=20, run_id="run-2")) == 1

    stored = _stored(engine)
    (batch,) = (row for row in stored if row["path"] == "batch")
    assert (batch["score"], batch["input_hash"], batch["run_id"]) == (0.4, corrected, "run-2")
    assert [row for row in stored if row["path"] == "online"] == online_before
    report = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui")
    assert report.current_input_hash == corrected
    (online,) = (result for result in report.results if result.path == "online")
    assert not online.input_is_current
    assert (online.batch_score, online.versus_batch) == (0.4, Cause.INPUT_CORRECTED.value)
    assert report.current is not None and report.current.path == "batch"


def test_the_current_answer(engine: Engine, stored_hash: str) -> None:
    # Online answers only: the newest for the stored record's content, not the newest overall.
    write_answers(
        engine,
        _online(0.2, stored_hash, minutes=0),
        _online(0.3, stored_hash, minutes=1, history_hash="history-2"),
        _online(0.9, "a-body-the-store-never-had", minutes=2),
    )
    report = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui")
    assert [result.current for result in report.results] == [False, True, False]
    assert report.current is not None and report.current.score == 0.3

    # A batch answer for the current content wins over every online one, however new they are.
    write_answers(engine, _batch(0.25, stored_hash, minutes=-30))
    report = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui")
    assert sum(result.current for result in report.results) == 1
    assert report.current is not None and (report.current.path, report.current.score) == ("batch", 0.25)


def test_after_a_rollback_the_production_models_batch_answer_is_current(engine: Engine, stored_hash: str) -> None:
    """v1, then v2 promoted and the day rescored, then a rollback to v1 and the day rescored again:
    that last rescore is the same answer again and rewrites nothing, so the newest batch row is the
    retired v2's. The answer that stands is v1's, the production model's."""
    write_answers(
        engine,
        _batch(0.25, stored_hash, minutes=0, model_version="risk:v1", run_id="nightly"),
        _batch(0.6, stored_hash, minutes=5, model_version="risk:v2", run_id="after-promotion"),
    )
    assert write_answers(engine, _batch(0.25, stored_hash, minutes=9, model_version="risk:v1", run_id="rollback")) == 0

    report = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui", production_version="risk:v1")
    assert report.current is not None and (report.current.model_version, report.current.score) == ("risk:v1", 0.25)
    # A production version that never answered it leaves the newest answer current.
    newest = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui", production_version="risk:v3").current
    assert newest is not None and newest.model_version == "risk:v2"


def test_without_a_stored_record_the_newest_answer_is_current(engine: Engine) -> None:
    write_answers(engine, _online(0.2, "input-a", minutes=0), _online(0.3, "input-b", minutes=1))
    report = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui")
    assert report.current_input_hash is None
    assert [(result.score, result.current) for result in report.results] == [(0.2, False), (0.3, True)]


def test_a_degraded_answer_says_so(engine: Engine, stored_hash: str) -> None:
    write_answers(engine, _online(0.5, stored_hash, degraded=True), _batch(0.25, stored_hash))
    (online,) = (
        result
        for result in explain(REFERENCE, engine, TX, dagster_ui_url="http://ui").results
        if result.path == "online"
    )
    assert online.degraded and online.history_hash is None
    assert online.versus_batch == Cause.DEGRADED.value


def test_an_online_answer_without_a_stored_record_is_not_called_superseded(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's first request scores a transaction no source holds: nothing superseded its
    input, so neither the report nor the CLI may say so."""
    write_answers(engine, _online(0.25, "hash-of-the-request"))
    (online,) = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui").results
    assert online.current and online.input_is_current is None
    monkeypatch.setenv("DATABASE_URL", engine.url.render_as_string(hide_password=False))
    assert cli.main(["lineage", TX]) == 0
    online_line = next(line for line in capsys.readouterr().out.splitlines() if "via online" in line)
    assert online_line.endswith("CURRENT") and "superseded" not in online_line


def test_the_cli_answers_in_text_and_json(
    engine: Engine, stored_hash: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_answers(engine, _online(0.25, stored_hash), _batch(0.25, stored_hash))
    monkeypatch.setenv("DATABASE_URL", engine.url.render_as_string(hide_password=False))
    assert cli.main(["lineage", TX]) == 0
    text = capsys.readouterr().out
    batch_line = next(line for line in text.splitlines() if "via batch" in line)
    online_line = next(line for line in text.splitlines() if "via online" in line)
    assert "(dagster run run-1" in batch_line and batch_line.endswith("CURRENT")
    assert "(request req-9 batch batch-of-req-9)" in online_line and "CURRENT" not in online_line
    assert "batch path: 0.250000: agree" in text

    assert cli.main(["lineage", TX, "--json"]) == 0
    answer_json = json.loads(capsys.readouterr().out)
    results = {result["path"]: result for result in answer_json["results"]}
    assert (results["batch"]["current"], results["online"]["current"]) == (True, False)
    assert (results["online"]["batch_score"], results["online"]["versus_batch"]) == (0.25, "agree")
    assert cli.main(["lineage", "no-such-transaction"]) == 1


REFUSED = "tx-refused"


def _refuse_at_ingest_and_online(engine: Engine) -> None:
    """`REFUSED` refused by the batch path's ingest (a decimal-comma amount in a CSV cell) and, earlier,
    by an online request (a malformed currency)."""
    with engine.begin() as conn:
        online = validate(REFERENCE, frame_of(record(transaction_id=REFUSED, currency="US$")))
        quarantine(REFERENCE, conn, online, path=ResultPath.ONLINE, stage=RejectStage.SCORE, request_id="req-7")
    cells = pl.DataFrame({name: [str(value)] for name, value in record(transaction_id=REFUSED).items()})
    unparsable = conform(REFERENCE, cells.with_columns(amount=pl.lit("12,50")), "day.csv", typed=False)
    ingest_day(REFERENCE, engine, unparsable, DAY)


def test_a_rejected_id_says_where_when_and_why(engine: Engine) -> None:
    """Before, an id refused before it was stored had no lineage at all ("no such transaction")."""
    _refuse_at_ingest_and_online(engine)

    report = explain(REFERENCE, engine, REFUSED, dagster_ui_url="http://ui")

    assert report.found and not report.source_found and not report.results
    online, ingest = report.rejections
    assert (online.reason, online.where, online.request_id) == (
        "bad_currency",
        "online score of request req-7",
        "req-7",
    )
    assert (ingest.reason, ingest.where) == ("amount_unparsable", f"batch ingest of partition {DAY.isoformat()}")
    assert json.loads(ingest.received)["amount"] == "12,50"
    assert (ingest.seen_count, ingest.resolved, ingest.resolution) == (1, False, None)
    assert online.first_seen <= ingest.first_seen


def test_the_cli_says_a_rejected_id_was_rejected_where_and_why(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _refuse_at_ingest_and_online(engine)
    monkeypatch.setenv("DATABASE_URL", engine.url.render_as_string(hide_password=False))

    assert cli.main(["lineage", REFUSED]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{REFUSED}: no stored record"
    assert "  REJECTED at online score of request req-7: bad_currency" in lines
    assert f"  REJECTED at batch ingest of partition {DAY.isoformat()}: amount_unparsable" in lines
    assert any(line.startswith("    received: ") and '"amount": "12,50"' in line for line in lines)

    assert cli.main(["lineage", REFUSED, "--json"]) == 0
    answer_json = json.loads(capsys.readouterr().out)
    assert [(r["reason"], r["stage"], r["partition_key"]) for r in answer_json["rejections"]] == [
        ("bad_currency", "score", None),
        ("amount_unparsable", "ingest", DAY.isoformat()),
    ]
    assert answer_json["results"] == [] and answer_json["source_found"] is False


def test_a_record_refused_at_scoring_has_its_record_and_its_rejection(engine: Engine, stored_hash: str) -> None:
    """Stored, then refused by the batch run: the partition, the run and the reason, beside the record."""
    with engine.begin() as conn:
        refused = validate(REFERENCE, frame_of(record(transaction_id=TX, country="usa")))
        quarantine(
            REFERENCE,
            conn,
            refused,
            path=ResultPath.BATCH,
            stage=RejectStage.SCORE,
            partition_key=DAY.isoformat(),
            run_id="run-3",
        )

    report = explain(REFERENCE, engine, TX, dagster_ui_url="http://ui/")

    assert report.source_found and not report.results
    (rejection,) = report.rejections
    assert rejection.where == f"batch score of partition {DAY.isoformat()} (dagster run run-3)"
    assert (rejection.reason, rejection.dagster_run_url) == ("malformed_country", "http://ui/runs/run-3")


def test_the_cli_names_a_rejections_reason_once(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Scoring's detail starts with its reason (`describe_rejection`), and the CLI printed the
    reason again in front: "amount_not_finite: amount_not_finite: amount=inf"."""
    refused = validate(REFERENCE, frame_of(record(transaction_id=TX, amount=float("inf"))))
    detail = describe_rejection(REFERENCE, refused["reject_reason"][0], refused.row(0, named=True))
    with engine.begin() as conn:
        quarantine(
            REFERENCE,
            conn,
            refused.with_columns(reject_detail=pl.lit(detail)),
            path=ResultPath.BATCH,
            stage=RejectStage.SCORE,
            partition_key=DAY.isoformat(),
            run_id="run-3",
        )
    monkeypatch.setenv("DATABASE_URL", engine.url.render_as_string(hide_password=False))
    assert cli.main(["lineage", TX]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "REJECTED" in line]
    assert line.endswith(": amount_not_finite: amount=inf"), line
    assert line.count("amount_not_finite") == 1, line


def test_the_cli_says_a_withdrawn_record_left_its_day_and_why(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record the re-sent day no longer holds has no stored record: the CLI says where it went."""
    ingest_day(REFERENCE, engine, frame_of(record(transaction_id=TX), record(transaction_id="tx-other")), DAY)
    ingest_day(REFERENCE, engine, frame_of(record(transaction_id="tx-other")), DAY, run_id="run-resent")
    monkeypatch.setenv("DATABASE_URL", engine.url.render_as_string(hide_password=False))
    monkeypatch.setenv("TANDEM_DAGSTER_UI_URL", "http://ui")

    assert cli.main(["lineage", TX]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{TX}: withdrawn from partition {DAY.isoformat()} at ")
    assert lines[0].endswith("the re-sent day no longer holds it (its batch answers went with it)")
    assert lines[1] == "  run: http://ui/runs/run-resent"

    assert cli.main(["lineage", TX, "--json"]) == 0
    withdrawn = json.loads(capsys.readouterr().out)["withdrawn"]
    assert (withdrawn["partition_key"], withdrawn["reason"], withdrawn["run_id"]) == (
        DAY.isoformat(),
        "not_resent",
        "run-resent",
    )
