"""The deployment under test: two fresh PostgreSQL databases (Tandem's tables, Dagster's instance),
a model store with a production model, real `dagster-webserver` + `dagster-daemon` processes, and
the alert webhook they post failed runs to.

Slow (minutes), so it runs only when asked: TANDEM_RUN_E2E=1, or CI=true. Started once for the
package: the test modules are one operator's day on it, in SCENARIO's order.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import Engine

from inference.migrate import upgrade
from inference.store import make_engine
from tests.e2e.browser import CHROMIUM_ARGS, chromium_path
from tests.e2e.deployment import (
    ARTIFACTS,
    BIN,
    DEMO_POISON_RATE,
    DEMO_ROWS_PER_DAY,
    REPO,
    RESCORE_WINDOW_ENV,
    SENSOR_INTERVAL_SECONDS,
    Deployment,
    WebhookReceiver,
    fresh_database,
    rescore_window_days,
)
from tests.e2e.graphql import REPOSITORIES, Repository, wait_for_production_model
from tests.e2e.week import LOCATION, SCORING_ASSETS, BackfillOutcome, run_asset_backfill
from tests.reference import REFERENCE
from tests.shared import free_port, run_child

E2E_DIR = Path(__file__).resolve().parent
RUN_E2E = os.environ.get("TANDEM_RUN_E2E") == "1" or os.environ.get("CI", "").lower() == "true"
STARTUP_TIMEOUT_S = 180


# One deployment serves the package (package-scoped fixtures: minutes to start), and its modules
# are the order of an operator's day on it: each reads what the one before left behind.
SCENARIO = ("test_backfill.py", "test_rollout.py", "test_surfaces.py")


def _in_scenario_order(items: list[pytest.Item]) -> None:
    """Put this package's tests in SCENARIO's module order, in place; every other test keeps its place."""
    here = [index for index, item in enumerate(items) if item.path.parent == E2E_DIR]
    unknown = sorted({items[index].path.name for index in here} - set(SCENARIO))
    if unknown:
        raise pytest.UsageError(f"tests/e2e modules {unknown} are not in SCENARIO (tests/e2e/conftest.py)")
    ordered = sorted((items[index] for index in here), key=lambda item: SCENARIO.index(item.path.name))
    for index, item in zip(here, ordered, strict=True):
        items[index] = item


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _in_scenario_order(items)
    if RUN_E2E:
        return
    skip = pytest.mark.skip(reason="end-to-end deployment test: set TANDEM_RUN_E2E=1 (CI=true runs it)")
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(skip)


def _register_model(env: dict[str, str]) -> str:
    completed = run_child([sys.executable, "-m", "tests.e2e.model_setup"], cwd=REPO, env=env, timeout_s=180)
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


@pytest.fixture(scope="package")
def alert_receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
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
        upgrade(engine, REFERENCE)
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
            RESCORE_WINDOW_ENV: str(rescore_window_days()),
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


@pytest.fixture(scope="package")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the package's screenshots go (copied on with TANDEM_E2E_ARTIFACTS: see deployment.py)."""
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="package")
def engine(deployment: Deployment) -> Iterator[Engine]:
    connected = make_engine(deployment.database_url)
    yield connected
    connected.dispose()


@pytest.fixture(scope="package")
def repository(deployment: Deployment) -> Repository:
    result = deployment.graphql(REPOSITORIES)["repositoriesOrError"]
    assert result["__typename"] == "RepositoryConnection", result
    found = [node for node in result["nodes"] if node["location"]["name"] == LOCATION]
    assert len(found) == 1, f"expected one repository in location {LOCATION!r}: {result['nodes']}"
    node = found[0]
    return Repository(
        location=LOCATION,
        name=node["name"],
        sensors={sensor["name"]: sensor["sensorState"]["status"] for sensor in node["sensors"]},
    )


@pytest.fixture(scope="package")
def ingested(deployment: Deployment, repository: Repository) -> BackfillOutcome:
    """The fresh deployment's week, ingested: an asset backfill of `transactions`."""
    # Scoring records which production model it read; the observer reports it within a tick.
    wait_for_production_model(deployment, deployment.production_tag)
    return run_asset_backfill(deployment, ["transactions"], "e2e: ingest the demo week")


@pytest.fixture(scope="package")
def backfill(deployment: Deployment, ingested: BackfillOutcome) -> BackfillOutcome:
    """docs/batch.md's UI backfill: predictions and path_agreement over the week, as the UI launches it."""
    return run_asset_backfill(deployment, SCORING_ASSETS, "e2e: score the demo week")


@pytest.fixture(scope="package")
def browser_page(deployment: Deployment) -> Iterator[Any]:
    """One headless Chromium page on the deployment's UI, its onboarding dialog dismissed."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install playwright (the wheel carries its driver)")
    # The onboarding dialog ("Join the Dagster community") would cover the page; this is its Skip.
    assert deployment.graphql("mutation { setNuxSeen }")["setNuxSeen"] is True
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1600, "height": 1000})
        finally:
            browser.close()
