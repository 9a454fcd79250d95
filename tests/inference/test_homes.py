"""The one default for the three homes (inference/homes.py), read by every entry point."""

from __future__ import annotations

from pathlib import Path

from inference.homes import DEFAULTED, apply_default_homes, project_root, resolve_homes

REPO = Path(__file__).resolve().parents[2]


def test_unset_the_homes_are_the_checkouts_data_folder_whatever_the_current_directory() -> None:
    assert project_root() == REPO
    homes = resolve_homes({})
    assert (homes.data_dir, homes.bentoml_home, homes.dagster_home) == (
        REPO / "data",
        REPO / "data" / "bentoml",
        REPO / "data" / "dagster",
    )


def test_a_data_dir_moves_the_other_two_and_a_set_home_stays(tmp_path: Path) -> None:
    homes = resolve_homes({"TANDEM_DATA_DIR": str(tmp_path), "DAGSTER_HOME": "/srv/dagster"})
    assert homes.bentoml_home == tmp_path / "bentoml"
    assert homes.dagster_home == Path("/srv/dagster")
    assert homes.defaulted == {"BENTOML_HOME"}


def test_applied_defaults_are_remembered_for_child_processes(tmp_path: Path) -> None:
    environ = {"BENTOML_HOME": str(tmp_path / "models")}
    applied = apply_default_homes(environ)
    assert environ["TANDEM_DATA_DIR"] == str(REPO / "data")
    assert environ["BENTOML_HOME"] == str(tmp_path / "models")
    assert environ[DEFAULTED] == "DAGSTER_HOME,TANDEM_DATA_DIR"
    # A child sees three set variables, and still knows which were defaults.
    assert resolve_homes(dict(environ)).defaulted == applied.defaulted == {"TANDEM_DATA_DIR", "DAGSTER_HOME"}


def test_the_hint_says_where_the_store_was_and_why_there(tmp_path: Path) -> None:
    defaulted = resolve_homes({})
    assert defaulted.model_store_hint() == (
        f"the model store at {REPO / 'data' / 'bentoml'} (BENTOML_HOME unset: the default, under {REPO / 'data'})"
    )
    chosen = resolve_homes({"BENTOML_HOME": str(tmp_path)})
    assert chosen.model_store_hint() == (
        f"the model store at {tmp_path} (from BENTOML_HOME; unset, it would be {REPO / 'data' / 'bentoml'})"
    )
    early = defaulted.model_store_hint(tmp_path / "bentoml")
    assert f"export BENTOML_HOME={REPO / 'data' / 'bentoml'}" in early


def test_another_spec_keeps_its_state_in_a_folder_of_its_own() -> None:
    root = project_root()
    assert root is not None
    reference = resolve_homes({"TANDEM_MODEL_SPEC": "tandem_specs.transactions:SPEC"})
    other = resolve_homes({"TANDEM_MODEL_SPEC": "tandem_specs.diabetes:SPEC"})

    assert reference.data_dir == root / "data"
    assert other.data_dir == root / "data" / "tandem_specs.diabetes"
    assert other.bentoml_home == other.data_dir / "bentoml"
