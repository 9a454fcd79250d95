"""The one rule for transient database errors (`is_transient_db_error`), on real errors: a
refused or cut connection, a timeout and a locked database may succeed later; a missing table or
column, refused data and a bug never will."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from inference.migrate import upgrade
from inference.store import (
    BatchProducer,
    is_transient_db_error,
    make_engine,
    prediction_frame,
    prediction_rows,
    predictions,
    upsert_predictions,
    utc_now,
)
from tests.reference import REFERENCE
from tests.shared import set_connections_allowed, unreachable_database_url


def raised(engine: Engine, statement: sa.Executable) -> BaseException:
    with pytest.raises(Exception) as caught, engine.begin() as conn:
        conn.execute(statement)
    return caught.value


@contextmanager
def disposed(engine: Engine) -> Iterator[Engine]:
    try:
        yield engine
    finally:
        engine.dispose()


def a_batch_row() -> sa.Executable:
    row = {
        "record_id": "t1",
        "score": 0.5,
        "input_hash": "h",
        "history_hash": "d",
        "unseen_fields": None,
    }
    values = prediction_rows(
        row, producer=BatchProducer("run", "2026-11-03", "test"), model_version="m:1", produced_at=utc_now()
    )
    return sa.insert(predictions).values(answer_key="", **values)


# ------------------------------------------------------------------ transient
def test_a_refused_connection_is_transient() -> None:
    with disposed(make_engine(unreachable_database_url())) as engine:
        error = raised(engine, sa.select(1))
    assert isinstance(error, sa.exc.OperationalError)
    assert is_transient_db_error(error)


def test_a_refused_connection_at_the_driver_is_transient() -> None:
    # The staging COPY runs on the driver's cursor, so psycopg's own errors reach the rule unwrapped.
    url = make_url(unreachable_database_url()).set(drivername="postgresql").render_as_string(hide_password=False)
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(url, connect_timeout=5)
    assert is_transient_db_error(caught.value)


def test_a_pool_with_no_connection_to_give_in_time_is_transient(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url, pool_size=1, max_overflow=0, pool_timeout=0.05)
    with disposed(engine), engine.connect(), pytest.raises(sa.exc.TimeoutError) as caught:
        engine.connect()
    assert is_transient_db_error(caught.value)


def test_a_locked_sqlite_database_is_transient(sqlite_url: str) -> None:
    with disposed(make_engine(sqlite_url)) as engine:
        upgrade(engine, REFERENCE)
    impatient = sa.create_engine(sqlite_url, connect_args={"timeout": 0.05})
    with disposed(impatient), impatient.connect() as holder:
        holder.exec_driver_sql("BEGIN IMMEDIATE")  # the write lock, held
        error = raised(impatient, a_batch_row())
        holder.rollback()
    assert "database is locked" in str(error)
    assert is_transient_db_error(error)


@pytest.mark.postgres
def test_postgres_refusing_and_cutting_connections_is_transient(postgres_admin_url: str, postgres_url: str) -> None:
    database = str(make_url(postgres_url).database)
    with disposed(make_engine(postgres_url)) as engine:
        upgrade(engine, REFERENCE)
        with engine.connect() as open_before:
            set_connections_allowed(postgres_admin_url, database, False)
            try:
                with pytest.raises(sa.exc.DBAPIError) as cut:
                    open_before.execute(sa.select(1))
                refused = raised(engine, sa.select(1))
            finally:
                set_connections_allowed(postgres_admin_url, database, True)
    assert cut.value.connection_invalidated
    assert is_transient_db_error(cut.value)
    assert isinstance(refused, sa.exc.OperationalError)
    assert is_transient_db_error(refused)


@pytest.mark.postgres
def test_a_statement_timeout_is_transient(postgres_url: str) -> None:
    options = {"connect_args": {"options": "-c statement_timeout=50"}}
    with disposed(make_engine(postgres_url, **options)) as engine:
        error = raised(engine, sa.select(sa.func.pg_sleep(2)))
    assert "statement timeout" in str(error)
    assert is_transient_db_error(error)


# ------------------------------------------------------------------ not transient
def test_a_sqlite_file_without_tables_is_a_missing_migration_not_an_outage(tmp_path: Path) -> None:
    with disposed(make_engine(f"sqlite:///{tmp_path / 'unmigrated.db'}")) as engine:
        read = raised(engine, sa.select(predictions))
        written = raised(engine, a_batch_row())
    for error in (read, written):
        assert "no such table" in str(error)
        assert isinstance(error, sa.exc.OperationalError), "SQLite reports it as operational"
        assert not is_transient_db_error(error)


def test_a_sqlite_table_missing_a_column_is_not_transient(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = sa.MetaData()
    sa.Table("predictions", old, sa.Column("record_id", sa.Text, primary_key=True))
    with disposed(make_engine(url)) as engine:
        old.create_all(engine)
        read = raised(engine, sa.select(predictions))
        written = raised(engine, a_batch_row())
    assert "no such column" in str(read)
    assert "has no column named" in str(written)
    assert not is_transient_db_error(read)
    assert not is_transient_db_error(written)


@pytest.mark.postgres
def test_a_postgres_database_without_tables_is_not_transient(postgres_url: str) -> None:
    with disposed(make_engine(postgres_url)) as engine:
        error = raised(engine, sa.select(predictions))
    assert isinstance(error, sa.exc.ProgrammingError)
    assert not is_transient_db_error(error)


def test_refused_data_and_bugs_are_not_transient(sqlite_url: str) -> None:
    with disposed(make_engine(sqlite_url)) as engine:
        upgrade(engine, REFERENCE)
        with engine.begin() as conn:
            conn.execute(a_batch_row())
        duplicate = raised(engine, a_batch_row())
        with pytest.raises(Exception) as bad_path, engine.begin() as conn:
            upsert_predictions(conn, prediction_frame_with_path("sideways"))
    assert isinstance(duplicate, sa.exc.IntegrityError)
    assert not is_transient_db_error(duplicate)
    assert isinstance(bad_path.value, sa.exc.IntegrityError), "the CHECK on path"
    assert not is_transient_db_error(bad_path.value)
    assert not is_transient_db_error(ValueError("a bug fails identically on every attempt"))
    assert not is_transient_db_error(FileNotFoundError("model.pt"))


def prediction_frame_with_path(path: str) -> pl.DataFrame:
    return prediction_frame(
        [
            {
                "record_id": "t2",
                "model_version": "m:1",
                "score": 0.5,
                "path": path,
                "code_version": "test",
                "input_hash": "h",
                "history_hash": "d",
                "produced_at": utc_now(),
            }
        ]
    )
