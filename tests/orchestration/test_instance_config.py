"""The two Dagster instance files: in step with each other, valid, and usable on PostgreSQL."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import AssetKey, AssetsDefinition, DagsterInstance, DagsterRunStatus
from dagster._core.instance.config import dagster_instance_config

from orchestration.platform import dagster_postgres_url, prepare_instance
from tests.orchestration.support import batch_resources, run_partition

CONFIG_DIR = Path(__file__).resolve().parents[2] / "orchestration"
EMBEDDED = CONFIG_DIR / "dagster.yaml"
POSTGRES = CONFIG_DIR / "dagster-postgres.yaml"


def _load(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text()))


def _install(source: Path, home: Path) -> Path:
    """A DAGSTER_HOME-style folder holding `source` as its dagster.yaml."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, home / "dagster.yaml")
    return home


def test_the_two_files_differ_only_in_storage() -> None:
    embedded, postgres = _load(EMBEDDED), _load(POSTGRES)

    assert "storage" not in embedded  # SQLite under DAGSTER_HOME, Dagster's default
    assert postgres.pop("storage") == {"postgres": {"postgres_url": {"env": "DAGSTER_POSTGRES_URL"}}}
    assert postgres == embedded


def test_the_settings_that_protect_the_database_are_there() -> None:
    config = _load(EMBEDDED)

    assert config["concurrency"]["pools"]["default_limit"] >= 1
    assert config["concurrency"]["runs"]["max_concurrent_runs"] >= 1
    # Run retries for lost workers only; step failures belong to the assets' RetryPolicy.
    assert config["run_retries"]["enabled"] is True
    assert config["run_retries"]["retry_on_asset_or_op_failure"] is False


@pytest.mark.parametrize("source", [EMBEDDED, POSTGRES], ids=["embedded", "postgres"])
def test_each_file_validates_as_instance_config(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGSTER_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/unused")

    config, custom_class = dagster_instance_config(str(_install(source, tmp_path / "home")))

    assert custom_class is None
    assert config["concurrency"] == _load(source)["concurrency"]


def test_postgres_url_is_pinned_to_the_driver_dagster_postgres_needs() -> None:
    assert (
        dagster_postgres_url("postgresql://u:p%40ss@db:5432/dagster")
        == "postgresql+psycopg2://u:p%40ss@db:5432/dagster"
    )
    assert dagster_postgres_url("postgresql+psycopg://u@db/dagster") == "postgresql+psycopg2://u@db/dagster"
    assert dagster_postgres_url("postgresql+psycopg2://u@db/dagster") == "postgresql+psycopg2://u@db/dagster"


def _materialize_on(instance: DagsterInstance, assets: list[AssetsDefinition], sqlite_url: str) -> None:
    result = run_partition(assets, batch_resources(sqlite_url, rows_per_day=300), instance, selection=["transactions"])
    assert result.success
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.status == DagsterRunStatus.SUCCESS
    assert instance.get_latest_materialization_event(AssetKey("transactions")) is not None


def test_embedded_instance_opens_and_runs(
    assets: list[AssetsDefinition], sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DAGSTER_POSTGRES_URL", raising=False)
    installed = prepare_instance(tmp_path / "home")

    assert installed.read_text() == EMBEDDED.read_text()
    with DagsterInstance.from_config(str(installed.parent)) as instance:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        _materialize_on(instance, assets, sqlite_url)


@pytest.mark.postgres
def test_postgres_instance_opens_and_runs(
    assets: list[AssetsDefinition], postgres_url: str, sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `make run` path: DAGSTER_POSTGRES_URL as a user writes it, the file installed by the platform."""
    monkeypatch.setenv("DAGSTER_POSTGRES_URL", postgres_url)
    installed = prepare_instance(tmp_path / "home")

    assert installed.read_text() == POSTGRES.read_text()
    with DagsterInstance.from_config(str(installed.parent)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 2
        _materialize_on(instance, assets, sqlite_url)
