"""The deployment under test: two fresh PostgreSQL databases (Tandem's tables, Dagster's instance),
a model store with a production model, real `dagster-webserver` + `dagster-daemon` processes, and
the alert webhook they post failed runs to.

Slow (minutes), so it runs only when asked: TANDEM_RUN_E2E=1, or CI=true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from inference.migrate import upgrade
from inference.store import make_engine
from tests.e2e.deployment import (
    ARTIFACTS,
    BIN,
    DEMO_POISON_RATE,
    DEMO_ROWS_PER_DAY,
    REPO,
    SENSOR_INTERVAL_SECONDS,
    Deployment,
    WebhookReceiver,
    free_port,
    fresh_database,
    rescore_window_days,
)

RUN_E2E = os.environ.get("TANDEM_RUN_E2E") == "1" or os.environ.get("CI", "").lower() == "true"
STARTUP_TIMEOUT_S = 180


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if RUN_E2E:
        return
    skip = pytest.mark.skip(reason="end-to-end deployment test: set TANDEM_RUN_E2E=1 (CI=true runs it)")
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(skip)


def _register_model(env: dict[str, str]) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.e2e.model_setup"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if completed.returncode != 0:
        pytest.fail(f"registering the production model failed:\n{completed.stderr[-4000:]}")
    return completed.stdout.strip().splitlines()[-1]


def _location_loaded(deployment: Deployment) -> bool | None:
    data = deployment.graphql(
        """
        query { workspaceOrError { __typename
          ... on Workspace { locationEntries { name loadStatus
            locationOrLoadError { __typename ... on PythonError { message stack } } } }
          ... on PythonError { message } } }
        """
    )
    entries = data["workspaceOrError"].get("locationEntries") or []
    for entry in entries:
        error = entry["locationOrLoadError"]
        if error and error["__typename"] == "PythonError":
            pytest.fail(f"code location {entry['name']} failed to load: {error['message']}\n{''.join(error['stack'])}")
    loaded = [entry for entry in entries if entry["loadStatus"] == "LOADED" and entry["locationOrLoadError"]]
    return True if loaded and len(loaded) == len(entries) else None


@pytest.fixture(scope="module")
def alert_receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def deployment(
    postgres_admin_url: str, tmp_path_factory: pytest.TempPathFactory, alert_receiver: WebhookReceiver
) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("e2e")
    # The servers log into this session's own folder (a test reads the daemon's log), copied to
    # test-artifacts/e2e-logs when the deployment stops, for CI to keep.
    log_dir = root / "logs"
    log_dir.mkdir()
    with ExitStack() as teardown:
        teardown.callback(shutil.copytree, log_dir, ARTIFACTS / "e2e-logs", dirs_exist_ok=True)
        database_url = teardown.enter_context(fresh_database(postgres_admin_url, "tandem_e2e"))
        dagster_url = teardown.enter_context(fresh_database(postgres_admin_url, "tandem_e2e_dagster"))

        # The deploy step before any process starts: bring the schema to head once. (Every run and
        # sensor also calls `upgrade`, which is a no-op on a current schema; on an empty database
        # several first runs at once would race to create it.)
        engine = make_engine(database_url)
        upgrade(engine)
        engine.dispose()

        dagster_home = root / "dagster_home"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DAGSTER_POSTGRES_URL", dagster_url)
            from orchestration.platform import prepare_instance

            prepare_instance(dagster_home)
            # prepare_instance may pin the URL to the driver dagster-postgres needs; children get that one.
            dagster_url = os.environ["DAGSTER_POSTGRES_URL"]

        port = free_port()
        env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "DAGSTER_POSTGRES_URL": dagster_url,
            "DAGSTER_HOME": str(dagster_home),
            "BENTOML_HOME": str(root / "bentoml"),
            "TANDEM_DATA_DIR": str(root / "data"),
            "TANDEM_CODE_VERSION": "e2e",
            "TANDEM_SENSOR_INTERVAL_SECONDS": str(SENSOR_INTERVAL_SECONDS),
            "TANDEM_DEMO_ROWS_PER_DAY": str(DEMO_ROWS_PER_DAY),
            "TANDEM_DEMO_POISON_RATE": str(DEMO_POISON_RATE),
            "TANDEM_SENSOR_PROMOTION_RESCORE_PARTITIONS": str(rescore_window_days()),
            "TANDEM_ALERT_WEBHOOK_URL": alert_receiver.url,
            "TANDEM_DAGSTER_UI_URL": f"http://127.0.0.1:{port}",
            "PYTHONUNBUFFERED": "1",
        }
        production_tag = _register_model(env)

        deployment = Deployment(
            url=f"http://127.0.0.1:{port}",
            env=env,
            log_dir=log_dir,
            database_url=database_url,
            production_tag=production_tag,
        )
        teardown.callback(deployment.stop)
        deployment.start(
            "dagster-webserver",
            [str(BIN / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        )
        deployment.start("dagster-daemon", [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"])

        def server_info() -> bool | None:
            return True if httpx.get(f"{deployment.url}/server_info", timeout=5).status_code == 200 else None

        deployment.wait_until("the webserver's /server_info", server_info, timeout=STARTUP_TIMEOUT_S, interval=1)
        deployment.wait_until(
            "the tandem code location to load", lambda: _location_loaded(deployment), timeout=STARTUP_TIMEOUT_S
        )
        yield deployment


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this module's screenshots go (copied on with TANDEM_E2E_ARTIFACTS: see deployment.py)."""
    return tmp_path_factory.mktemp("screenshots")
