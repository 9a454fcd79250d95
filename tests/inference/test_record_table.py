"""The spec's record table (0012, section 2): generated from the spec, equal for the reference to
the table migrations 0001-0007 built, created on start, compared on every start and never altered;
a database belongs to one spec. Also what the store reads for a spec without an entity."""

from __future__ import annotations

import dataclasses
from datetime import UTC, date, datetime

import polars as pl
import pytest
import sqlalchemy as sa
import torch
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Engine

from inference.batch import ingest_day, score_partition
from inference.contract import TorchPredictor
from inference.lineage import explain
from inference.migrate import StoreMismatch, upgrade, upgrade_core
from inference.model import default_model
from inference.parity import check_parity
from inference.records import raw_frame, validate
from inference.spec import Categorical, LoadedSpec, Numeric, load_spec, schema_digest
from inference.store import (
    BatchProducer,
    fetch_history,
    make_engine,
    partition_counts,
    prediction_rows,
    prior_history,
    record_table,
    record_table_ddl,
    stale_scored_partitions,
    tandem_spec,
    upsert_predictions,
    upsert_records,
    utc_now,
)
from tandem.cli import main
from tests.reference import REFERENCE

TINY = load_spec("tests.specs.tiny:SPEC")
DIABETES = load_spec("tandem_specs.diabetes:SPEC")
DAY = date(2026, 11, 1)


def record_table_diffs(engine: Engine, ls: LoadedSpec) -> list[tuple[str, str]]:
    """What autogenerate finds between the database's record table and the spec's, by operation
    and name (types and comments included): [] if none."""
    rt = record_table(ls)

    def the_record_table(name: str | None, type_: str, parent_names: object) -> bool:
        return type_ != "table" or name == rt.name

    with engine.connect() as conn:
        options = {"compare_type": True, "include_name": the_record_table}
        context = MigrationContext.configure(conn, opts=options)
        diffs = compare_metadata(context, rt.table.metadata)
    return sorted((diff[0], str(diff[1].name)) for diff in diffs if isinstance(diff, tuple))


def changed(ls: LoadedSpec, **changes: object) -> LoadedSpec:
    """`ls` with its spec changed, loaded as the same path."""
    spec = dataclasses.replace(ls.spec, **changes)  # type: ignore[arg-type]
    return LoadedSpec(path=ls.path, spec=spec, digest=schema_digest(spec))


def test_the_reference_table_is_the_one_migrations_built_but_for_its_index_name(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade_core(engine, "0007")
        assert record_table_diffs(engine, REFERENCE) == [
            ("add_index", "ix_transactions_entity_event"),
            ("remove_index", "ix_transactions_account_event"),
        ]
        upgrade(engine, REFERENCE)
        assert record_table_diffs(engine, REFERENCE) == []
    finally:
        engine.dispose()


def test_head_creates_the_record_table_and_names_the_spec(engine: Engine) -> None:
    assert record_table_diffs(engine, REFERENCE) == []
    with engine.connect() as conn:
        owner = conn.execute(sa.select(tandem_spec.c.name, tandem_spec.c.spec_path, tandem_spec.c.record_table)).all()
    assert owner == [("transactions", REFERENCE.path, "transactions")]
    upgrade(engine, REFERENCE)  # every start: equal, nothing done
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(tandem_spec)).scalar_one() == 1


def test_a_changed_record_schema_is_refused_in_one_line(engine: Engine) -> None:
    fields = tuple(
        Categorical("amount", vocabulary=("small",)) if field.name == "amount" else field
        for field in REFERENCE.spec.fields
        if field.name != "country"
    )
    mcc = changed(REFERENCE, fields=(*fields, Numeric("mcc")))
    with pytest.raises(StoreMismatch) as refused:
        upgrade(engine, mcc)
    assert str(refused.value) == (
        f"record table 'transactions' does not match spec {REFERENCE.path}: 'amount' is FLOAT, the spec says "
        "TEXT; missing column 'mcc'; column 'country' is not in the spec; a changed record schema takes a new "
        "table (set ModelSpec.table, e.g. 'transactions_v2', and backfill it from the source) or alter it "
        "yourself (`tandem store ddl` prints the statements)"
    )
    # A new table for the changed schema is created beside the old one.
    upgrade(engine, changed(mcc, table="transactions_v2"))
    assert {"transactions", "transactions_v2"} <= set(sa.inspect(engine).get_table_names())


def test_another_specs_database_is_refused_in_one_line(engine: Engine) -> None:
    with pytest.raises(StoreMismatch) as refused:
        upgrade(engine, TINY)
    assert str(refused.value) == (
        f"this database (DATABASE_URL) belongs to spec 'transactions' ({REFERENCE.path}), not to 'readings' "
        f"({TINY.path}); point DATABASE_URL at a database of its own for each spec"
    )
    assert "readings" not in sa.inspect(engine).get_table_names()


def test_a_spec_without_an_entity_has_no_entity_index_and_no_previous_position(database_url: str) -> None:
    rt = record_table(DIABETES)
    assert (rt.entity, rt.previous_entity) == (None, None)
    assert not any(c.name.startswith("previous_") for c in rt.table.columns)
    assert sorted(str(index.name) for index in rt.table.indexes) == [
        "ix_patients_ingested_at",
        "ix_patients_partition_date",
    ]
    engine = make_engine(database_url)
    try:
        upgrade(engine, DIABETES)
        assert record_table_diffs(engine, DIABETES) == []
        indexes = {index["name"] for index in sa.inspect(engine).get_indexes("patients")}
        assert indexes == {"ix_patients_ingested_at", "ix_patients_partition_date"}
    finally:
        engine.dispose()


def patients(*changes: dict[str, object]) -> pl.DataFrame:
    example = DIABETES.spec.example()
    rows = [{**example, "patient_id": f"patient-{i:04d}", **change} for i, change in enumerate(changes)]
    return validate(DIABETES, pl.DataFrame(rows, schema=dict(record_table(DIABETES).raw_schema)))


def test_without_an_entity_a_change_makes_stale_its_own_partition_only(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade(engine, DIABETES)
        days = [DAY, date(2026, 11, 2)]
        with engine.begin() as conn:
            for day in days:
                stored = patients({"visit_time": f"{day}T08:00:00Z"}, {"visit_time": f"{day}T09:00:00Z"})
                stored = stored.with_columns(pl.col("patient_id") + f"-{day}")
                upsert_records(DIABETES, conn, stored, day)
                scored = stored.select(
                    record_id="patient_id",
                    score=pl.lit(0.5),
                    input_hash=pl.lit("old"),
                    history_hash=pl.lit("0"),
                    unseen_fields=pl.lit(None, dtype=pl.String),
                )
                producer = BatchProducer("run", day.isoformat(), "test")
                rows = prediction_rows(scored, producer=producer, model_version="m:1", produced_at=utc_now())
                upsert_predictions(conn, rows)
        with engine.connect() as conn:
            stale = stale_scored_partitions(DIABETES, conn, changed_after=None, history_length=0)
            targets = patients({}).with_columns(event_ts=pl.lit(datetime(2026, 11, 3, tzinfo=UTC)))
            assert fetch_history(DIABETES, conn, targets, 4).is_empty()
            assert prior_history(DIABETES, conn, targets, date(2026, 11, 3), 4).is_empty()
        # Every stored record's hash differs from its answer's ("old"): each day is stale, alone.
        assert [change.partition_key for change in stale] == [day.isoformat() for day in days]
    finally:
        engine.dispose()


def test_a_spec_without_an_entity_runs_the_batch_path(database_url: str) -> None:
    """Ingest, score (the stream, the merge, the quarantine), the asset checks' counts, parity and
    lineage, for a spec with no entity, no history and a label."""
    example = DIABETES.spec.example()
    records = [{**example, "patient_id": f"p-{i}", "visit_time": f"{DAY}T{8 + i % 10:02d}:00:00Z"} for i in range(30)]
    records.append({**example, "patient_id": "p-bad", "sex": "x"})
    frame = raw_frame(DIABETES, records).with_columns(progressed=pl.Series([i % 2 for i in range(len(records))]))
    torch.manual_seed(0)
    predictor = TorchPredictor(model=default_model(DIABETES), model_version="diabetes:1", spec=DIABETES)
    engine = make_engine(database_url)
    try:
        upgrade(engine, DIABETES)
        assert ingest_day(DIABETES, engine, frame, DAY).rows_stored == 31
        producer = BatchProducer("run", DAY.isoformat(), "test")
        report = score_partition(DIABETES, engine, predictor, DAY, producer=producer, history_length=0)
        assert (report.scored, dict(report.rejected_by_reason)) == (30, {"malformed_sex": 1})
        with engine.connect() as conn:
            counts = partition_counts(
                DIABETES, conn, partition_date=DAY, partition_key=DAY.isoformat(), model_version="diabetes:1"
            )
        assert (counts.input_rows, counts.scored, counts.rejected, counts.stale_answers) == (31, 30, 1, 0)
        assert check_parity(DIABETES, engine, predictor, partition_key=DAY.isoformat(), sample_size=8).mismatched == []
        lineage = explain(DIABETES, engine, "p-3", dagster_ui_url="http://ui")
        assert lineage.current is not None and lineage.current.history_hash == "0" * 16

        # The day re-sent without p-3 and the quarantined p-bad: both leave the store, p-bad's
        # rejection is over, and the day (alone: no entity) is stale.
        before = utc_now()
        resent = frame.filter(~pl.col("patient_id").is_in(["p-3", "p-bad"]))
        assert ingest_day(DIABETES, engine, resent, DAY).rows_withdrawn == 2
        with engine.connect() as conn:
            counts = partition_counts(
                DIABETES, conn, partition_date=DAY, partition_key=DAY.isoformat(), model_version="diabetes:1"
            )
            stale = stale_scored_partitions(DIABETES, conn, changed_after=before, history_length=0)
        assert (counts.input_rows, counts.scored, counts.rejected, counts.stale_answers) == (29, 29, 0, 0)
        assert [(change.partition_key, change.unanswered) for change in stale] == [(DAY.isoformat(), True)]
        withdrawn = explain(DIABETES, engine, "p-bad", dagster_ui_url="http://ui")
        assert withdrawn.withdrawn is not None and withdrawn.withdrawn.reason == "not_resent"
        assert [(r.reason, r.resolved, r.resolution) for r in withdrawn.rejections] == [
            ("malformed_sex", True, "superseded")
        ]
    finally:
        engine.dispose()


def test_store_ddl_prints_the_record_tables_statements(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "ddl", "--dialect", "postgresql"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "CREATE TABLE transactions ("
    for statement in record_table_ddl(REFERENCE, postgresql.dialect()):
        assert f"{statement};" in out
    assert "CREATE INDEX ix_transactions_entity_event ON transactions (account_id, event_ts, transaction_id);" in out
    assert "COMMENT ON COLUMN transactions.label_fraud IS 'ground truth where known (demo data)';" in out


def test_the_cli_refuses_another_specs_database_in_one_line(
    sqlite_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(sqlite_url)
    upgrade(engine, TINY)
    engine.dispose()
    monkeypatch.setenv("DATABASE_URL", sqlite_url)
    assert main(["lineage", "r-1"]) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err.splitlines()) == (
        "",
        [
            f"tandem: this database (DATABASE_URL) belongs to spec 'readings' ({TINY.path}), not to "
            f"'transactions' ({REFERENCE.path}); point DATABASE_URL at a database of its own for each spec"
        ],
    )
