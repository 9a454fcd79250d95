"""A DATABASE_URL the CLI cannot use is the user's mistake: one line on stderr and exit 1, never a
traceback, and never the password it holds."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from inference.store import make_engine
from tandem.cli import main


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed again on leaving: nothing listens there


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
    url = f"postgresql://tandem:s3cret@127.0.0.1:{_closed_port()}/tandem"
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
