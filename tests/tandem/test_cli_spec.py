"""`tandem spec`: checks a spec and describes it, or refuses it in one line."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from inference.spec import load_spec
from tandem.cli import main
from tests.specs import tiny


def test_it_describes_the_reference_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"tandem_specs.transactions:SPEC: transactions scored by risk_model, spec version 1, "
        f"digest {load_spec().digest}"
    )
    assert lines[1].startswith("  history for new models: 16 earlier records of account_id;")
    roles = {line.split()[0]: " ".join(line.split()[1:]) for line in lines[2:]}
    assert roles == {
        "transaction_id": "record id",
        "account_id": "entity key",
        "amount": "numeric",
        "currency": "categorical (8 values)",
        "merchant_category": "categorical (24 values)",
        "country": "categorical (26 values)",
        "event_time": "event time",
        "label_fraud": "label",
    }


def test_it_describes_another_spec_by_its_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "tests.specs.tiny:SPEC"]) == 0
    out = capsys.readouterr().out
    assert "readings scored by reading_model" in out and "2 earlier records of sensor_id" in out


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("tests.specs.tiny", "spec 'tests.specs.tiny': expected package.module:attribute"),
        ("tests.specs.tiny:COLOURS", "spec 'tests.specs.tiny:COLOURS': COLOURS is a tuple, not an inference.spec"),
    ],
)
def test_a_path_that_is_no_spec_is_one_line(capsys: pytest.CaptureFixture[str], path: str, said: str) -> None:
    assert main(["spec", path]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"tandem: {said}") and captured.err.count("\n") == 1


def test_without_a_path_it_describes_the_spec_the_setting_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_MODEL_SPEC", "tests.specs.tiny:SPEC")
    assert main(["spec"]) == 0
    assert capsys.readouterr().out.startswith("tests.specs.tiny:SPEC: readings scored by reading_model")


@pytest.mark.parametrize("argv", [["spec"], ["lineage", "r-1"], ["models", "list"]])
def test_a_setting_that_names_no_spec_is_one_line_for_every_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    monkeypatch.setenv("TANDEM_MODEL_SPEC", "no_such_package:SPEC")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("tandem: TANDEM_MODEL_SPEC: spec 'no_such_package:SPEC': cannot import 'no_such_package'")
    assert err.count("\n") == 1


MISTYPED = "tandem_test_mistyped_spec"


@pytest.mark.parametrize(
    ("argv", "setting"),
    [(["spec", f"{MISTYPED}:SPEC"], None), (["spec"], f"{MISTYPED}:SPEC"), (["models", "list"], f"{MISTYPED}:SPEC")],
)
def test_a_wrongly_typed_spec_is_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], setting: str | None
) -> None:
    mistyped = types.ModuleType(MISTYPED)
    mistyped.SPEC = dataclasses.replace(tiny.SPEC, history_length="8")  # type: ignore[attr-defined,arg-type]
    monkeypatch.setitem(sys.modules, MISTYPED, mistyped)
    if setting is not None:
        monkeypatch.setenv("TANDEM_MODEL_SPEC", setting)
    load_spec.cache_clear()  # type: ignore[attr-defined]
    assert main(argv) == 1
    captured = capsys.readouterr()
    said = f"spec '{MISTYPED}:SPEC': history_length must be an int, got '8'"
    assert captured.out == ""
    assert captured.err == f"tandem: {'TANDEM_MODEL_SPEC: ' if setting else ''}{said}\n"
