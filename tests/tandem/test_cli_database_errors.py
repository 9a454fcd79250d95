"""A DATABASE_URL, TANDEM_DATA_DIR or other setting the CLI cannot use, or a rejection id that names
nothing, is the user's mistake: one line on stderr and a non-zero exit, never a traceback, and
never the password."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import pytest
import sqlalchemy as sa
from pydantic import AfterValidator, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.migrate import upgrade
from inference.settings import settings_error, without_password
from inference.store import make_engine, rejected_records
from tandem.cli import main
from tests.reference import REFERENCE
from tests.shared import free_port, fresh_postgres_database


@pytest.fixture(autouse=True)
def _own_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))


def _one_line_error(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str, *argv: str) -> str:
    monkeypatch.setenv("DATABASE_URL", url)
    code = main(list(argv or ("lineage", "tx-1")))
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert (code, captured.out) == (1, "")
    assert len(err) == 1, err
    assert err[0].startswith("tandem: ") and "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize("argv", [("lineage", "tx-1"), ("rejects", "fixed", "1")])
def test_an_unreachable_database_is_one_line_without_the_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...]
) -> None:
    url = f"postgresql://tandem:s3cret@127.0.0.1:{free_port()}/tandem"
    said = _one_line_error(capsys, monkeypatch, url, *argv)
    assert "is unavailable" in said and "127.0.0.1" in said
    assert "s3cret" not in said


@pytest.mark.parametrize("url", ["not a url", "postgres//user@host/db"])
def test_text_that_is_no_url_is_one_line_and_not_echoed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    said = _one_line_error(capsys, monkeypatch, url)
    assert "DATABASE_URL: not a database URL" in said
    assert url not in said


def test_a_backend_the_store_does_not_write_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    said = _one_line_error(capsys, monkeypatch, "mysql://root@127.0.0.1:3306/test")
    assert said.startswith("tandem: DATABASE_URL: ") and "PostgreSQL" in said and "mysql://" in said


def test_make_engine_refuses_a_missing_driver_as_a_value_error() -> None:
    with pytest.raises(ValueError, match="not installed"):
        make_engine("postgresql+pg8000://user@127.0.0.1/db")


def test_make_engine_refuses_text_that_is_no_url_without_echoing_it() -> None:
    with pytest.raises(ValueError, match="not a database URL") as refused:
        make_engine("user:s3cret@nowhere")
    assert "s3cret" not in str(refused.value) and refused.value.__cause__ is None


def test_a_data_dir_that_is_a_file_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "afile").touch()
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "afile"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    code = main(["lineage", "tx-1"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0] == f"tandem: no store at sqlite:///{tmp_path / 'afile'}/tandem.db: nothing was ever stored there " + (
        "(DATABASE_URL, TANDEM_DATA_DIR)"
    )
    # A command that makes the store says why it cannot.
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'afile'}/tandem.db")
    code = main(["demo"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"tandem: {tmp_path / 'afile'}: File exists (the folder of sqlite:///")


def test_a_command_that_reads_the_store_refuses_one_never_made(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A typo in a SQLite path made a new store there, migrated it, and answered "no such record"."""
    typo = tmp_path / "no-such-folder" / "tandem.db"
    for argv in (["lineage", "tx-1"], ["rejects", "fixed", "1"]):
        said = _one_line_error(capsys, monkeypatch, f"sqlite:///{typo}", *argv)
        assert (
            said
            == f"tandem: no store at sqlite:///{typo}: nothing was ever stored there (DATABASE_URL, TANDEM_DATA_DIR)"
        )
    assert not typo.parent.exists()


def test_a_file_that_is_no_database_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("not a database, and long enough to have a header\n" * 4)
    said = _one_line_error(capsys, monkeypatch, f"sqlite:///{tmp_path / 'notes.txt'}")
    assert said.endswith("is unavailable: file is not a database")


@pytest.mark.parametrize("rejection_id", ["99999999999999999999", str(2**31), "0", "-3", "12a"])
def test_a_rejection_id_outside_the_column_is_refused_by_argparse(
    capsys: pytest.CaptureFixture[str], rejection_id: str
) -> None:
    # Passed on, SQLite raised OverflowError and PostgreSQL a DataError with the statement: tracebacks.
    with pytest.raises(SystemExit) as refused:
        main(["rejects", "fixed", "1", rejection_id])
    assert refused.value.code == 2
    assert f"not a rejection id: {rejection_id}" in capsys.readouterr().err.replace("'", "")


def _rejections(url: str, count: int) -> list[int]:
    engine = make_engine(url)
    upgrade(engine, REFERENCE)
    now = datetime.now(UTC)
    with engine.begin() as conn:
        for n in range(count):
            conn.execute(
                rejected_records.insert().values(
                    rejection_key=f"key-{n}",
                    path="batch",
                    stage="score",
                    reason="bad",
                    payload="{}",
                    input_hash="h",
                    first_seen=now,
                    last_seen=now,
                )
            )
        ids = list(conn.execute(sa.select(rejected_records.c.rejection_id)).scalars())
    engine.dispose()
    return sorted(ids)


def _resolved(url: str) -> dict[int, bool]:
    engine = make_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(rejected_records.c.rejection_id, rejected_records.c.resolved)).all()
    engine.dispose()
    return {rejection_id: resolved for rejection_id, resolved in rows}


def test_rejects_fixed_with_an_id_that_names_no_rejection_marks_nothing_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, sqlite_url: str
) -> None:
    monkeypatch.setenv("DATABASE_URL", sqlite_url)
    first, second = _rejections(sqlite_url, 2)

    # It said "0 rejection(s) marked fixed" and exited 0: the typo went unnoticed.
    code = main(["rejects", "fixed", str(first), "424242"])
    captured = capsys.readouterr()
    assert (code, captured.out, captured.err) == (1, "", "tandem: no rejection 424242: nothing marked fixed\n")
    assert _resolved(sqlite_url) == {first: False, second: False}

    assert main(["rejects", "fixed", str(first)]) == 0
    assert capsys.readouterr().out == "1 rejection(s) marked fixed\n"
    # Marked twice, or once by someone else: the operator's word stands, and is no error.
    assert main(["rejects", "fixed", str(first), str(second), str(second)]) == 0
    assert capsys.readouterr().out == "1 rejection(s) marked fixed, 1 already fixed\n"
    assert _resolved(sqlite_url) == {first: True, second: True}


def test_a_bad_setting_is_one_line_naming_its_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It said "tandem: month must be in 1..12", naming neither the value nor where it came from.
    monkeypatch.setenv("TANDEM_DEMO_START_DATE", "2026-13-01")
    code = main(["demo"])
    captured = capsys.readouterr()
    assert (code, captured.out) == (1, "")
    assert captured.err.startswith("tandem: TANDEM_DEMO_START_DATE='2026-13-01': Input should be a valid date")
    assert len(captured.err.splitlines()) == 1


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("not a url", "tandem: DATABASE_URL: not a database URL; --dialect names the SQL to print"),
        (
            "mysql://root@127.0.0.1:3306/test",
            "tandem: DATABASE_URL: a mysql database; Tandem's store is PostgreSQL or SQLite",
        ),
    ],
)
def test_store_ddl_speaks_the_dialect_of_database_url_or_refuses_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str, expected: str
) -> None:
    assert _one_line_error(capsys, monkeypatch, url, "store", "ddl") == expected
    monkeypatch.setenv("DATABASE_URL", "sqlite:///tandem.db")
    assert main(["store", "ddl"]) == 0
    assert "CREATE TABLE transactions (" in capsys.readouterr().out


@pytest.mark.parametrize(
    "url", ["sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite:///t.db?mode=memory&uri=true"]
)
def test_an_in_memory_sqlite_database_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str
) -> None:
    """Each process opens the store anew: `tandem demo` on one trained and promoted a model, then
    failed for want of the tables its first step had written into a database already gone."""
    monkeypatch.setenv("BENTOML_HOME", str(tmp_path / "bentoml"))
    said = _one_line_error(capsys, monkeypatch, url, "demo")
    assert said.startswith(f"tandem: DATABASE_URL={url!r}: an in-memory SQLite database is lost")
    assert not (tmp_path / "bentoml" / "models").exists(), "nothing was trained or promoted"


def test_an_empty_model_name_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was taken as is: "no production version of ''"."""
    monkeypatch.setenv("TANDEM_MODEL_NAME", "")
    monkeypatch.delenv("DATABASE_URL", raising=False)
    code = main(["models", "list"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("tandem: TANDEM_MODEL_NAME='': "), err


@pytest.mark.parametrize(
    "url", ["postgresql://tandem:s3cret@127.0.0.1:abc/tandem", "postgresql://tandem:s3cret@[::1/x"]
)
def test_a_url_that_does_not_parse_is_one_line_without_the_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """A port that is no number was echoed whole, password and all: make_url raises ValueError."""
    said = _one_line_error(capsys, monkeypatch, url)
    assert said.startswith("tandem: DATABASE_URL: ") and "s3cret" not in said


def test_a_settings_refusal_masks_the_password_of_every_url_it_names() -> None:
    class WithUrls(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="PROBE_")
        source_url: Annotated[str, AfterValidator(_refuse)]
        replica_url: Annotated[str, AfterValidator(_refuse)]

    with pytest.raises(ValidationError) as refused:
        WithUrls(source_url="postgresql+psycopg://reader:s3cret@db:5432/x", replica_url="mysql://r:pa:ss@h/y")
    said = settings_error(refused.value, WithUrls)
    assert "PROBE_SOURCE_URL='postgresql+psycopg://reader:***@db:5432/x'" in said
    assert "PROBE_REPLICA_URL='mysql://r:***@h/y'" in said
    assert "s3cret" not in said and "pa:ss" not in said
    assert (
        without_password("sqlite:////srv/x.db and https://host/a:b@c") == "sqlite:////srv/x.db and https://host/a:b@c"
    )


def _refuse(value: str) -> str:
    raise ValueError("refused")


@pytest.mark.parametrize(("option", "said"), [("connect_timeout=abc", "connect_timeout"), ("foo=bar", '"foo"')])
def test_a_bad_connection_option_in_the_url_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, option: str, said: str
) -> None:
    """The driver raises ProgrammingError while connecting, which was taken for a bug: a traceback."""
    line = _one_line_error(capsys, monkeypatch, f"postgresql://tandem:s3cret@127.0.0.1:{free_port()}/t?{option}")
    assert said in line and "s3cret" not in line


@pytest.mark.postgres
def test_a_postgresql_database_without_tandems_tables_is_no_store(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, postgres_admin_url: str
) -> None:
    with fresh_postgres_database(postgres_admin_url) as url:
        said = _one_line_error(capsys, monkeypatch, url, "lineage", "tx-1")
        with sa.create_engine(url).connect() as conn:
            assert sa.inspect(conn).get_table_names() == [], "nothing was made in it"
    assert said.endswith(": the database holds no Tandem tables (DATABASE_URL)") and "no store at postgresql" in said
