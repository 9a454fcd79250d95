"""The README's commands from a plain shell: no TANDEM_DATA_DIR, BENTOML_HOME or DAGSTER_HOME set.

Each test runs a copy of the project (its packages, pyproject.toml and workspace.yaml) in a
temporary folder, as a checkout, with a HOME of its own so that nothing lands in the real one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
from dagster import DagsterInstance, DagsterRunStatus

from tests.serving.support import free_port
from tests.shared import run_child, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROJECT_PARTS = ("inference", "tandem", "assets", "orchestration", "serving", "pyproject.toml", "workspace.yaml")
DAY = "2026-11-03"


def checkout(root: Path) -> Path:
    project = root / "project"
    for part in PROJECT_PARTS:
        source = REPO / part
        if source.is_dir():
            shutil.copytree(source, project / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            project.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, project / part)
    return project


def write_landing_day(landing: Path) -> Path:
    """The README's example file, for DAY."""
    landing.mkdir()
    (landing / f"{DAY}.csv").write_text(
        "transaction_id,account_id,amount,currency,merchant_category,country,event_time\n"
        "shop-000101,customer-42,42.50,EUR,grocery,DE,2026-11-03T09:30:00+01:00\n"
    )
    return landing


def plain_shell(project: Path, home: Path, **extra: str) -> dict[str, str]:
    """A shell with the virtualenv active and no Tandem, Dagster or BentoML variable."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("TANDEM_", "DAGSTER_", "BENTOML_")) and name != "DATABASE_URL"
    }
    home.mkdir(parents=True, exist_ok=True)
    return env | {
        "HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONPATH": str(project),  # the copy, not the checkout the virtualenv was installed from
        "TANDEM_CODE_VERSION": "test",
        **extra,
    }


def test_bring_your_own_data_after_make_run_from_a_plain_shell(tmp_path: Path) -> None:
    # It failed with "no production version of 'risk_model'": `make run` had trained one in the
    # homes the Makefile set, and `dagster` outside make looked in others.
    project = checkout(tmp_path)
    small_demo = {"TANDEM_DEMO_DAYS": "2", "TANDEM_DEMO_ROWS_PER_DAY": "300"}
    shell = plain_shell(project, tmp_path / "home")

    make_run = run_child(
        [sys.executable, "-m", "orchestration.platform", "--no-serve"],
        cwd=project,
        env=shell | small_demo,
        timeout_s=600,
    )
    assert make_run.returncode == 0, make_run.stdout + make_run.stderr
    assert (project / "data" / "bentoml" / "models" / "risk_model").is_dir()

    landing = write_landing_day(tmp_path / "landing")
    materialized = run_child(
        [
            str(BIN / "dagster"),
            *("asset", "materialize", "-m", "orchestration.definitions"),
            *("--select", "transactions,predictions", "--partition", DAY),
        ],
        cwd=project,
        env=shell | {"TANDEM_SOURCE": "files", "TANDEM_SOURCE_LOCATION": str(landing)},
        timeout_s=300,
    )
    assert materialized.returncode == 0, materialized.stdout + materialized.stderr

    # The run is in the instance `make run` used, where the UI and the daemon see it.
    with DagsterInstance.from_config(str(project / "data" / "dagster")) as instance:
        runs = [run for run in instance.get_runs() if run.tags.get("dagster/partition") == DAY]
    assert [run.status for run in runs] == [DagsterRunStatus.SUCCESS]

    # From any directory, a checkout's command reads the checkout's data.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lineage = run_child(
        [sys.executable, "-m", "tandem.cli", "lineage", "shop-000101", "--json"],
        cwd=elsewhere,
        env=shell,
        timeout_s=120,
    )
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr
    answers = json.loads(lineage.stdout)
    assert [answer["path"] for answer in answers["results"]] == ["batch"], answers
    assert not (elsewhere / "data").exists()

    # `bentoml serve` opens its store before it imports the service: with BENTOML_HOME unset that is
    # ~/bentoml, and the service refuses in one line naming the variable and Tandem's store.
    serve = [str(BIN / "bentoml"), "serve", "serving.service:TandemScorer", "--host", "127.0.0.1"]
    refused = run_child([*serve, "--port", str(free_port())], cwd=project, env=shell, timeout_s=180)
    assert refused.returncode != 0
    assert f"export BENTOML_HOME={project / 'data' / 'bentoml'}" in refused.stdout + refused.stderr

    # As the README shows it, with the variable set, it serves the same model.
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        server = subprocess.Popen(
            [*serve, "--port", str(port)],
            cwd=project,
            env={**shell, "BENTOML_HOME": str(project / "data" / "bentoml")},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until_ready(f"http://127.0.0.1:{port}/readyz", server, timeout_s=180, log=log.read_text)
        served = httpx.post(
            f"http://127.0.0.1:{port}/score",
            json={
                "transactions": [
                    {
                        "transaction_id": "shop-000102",
                        "account_id": "customer-42",
                        "amount": 12.5,
                        "currency": "EUR",
                        "merchant_category": "grocery",
                        "country": "DE",
                        "event_time": "2026-11-04T09:30:00Z",
                    }
                ]
            },
            timeout=30,
        )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert served.status_code == 200, served.text
    assert served.json()["results"][0]["model_version"] == answers["results"][0]["model_version"]


def test_no_model_fails_before_the_ingest_naming_the_store_it_looked_in(tmp_path: Path) -> None:
    # It ingested the day first, then failed with "train one with `tandem demo`", which in that
    # shell trained one where the failing command did not look.
    project = checkout(tmp_path)
    landing = write_landing_day(tmp_path / "landing")
    materialized = run_child(
        [
            str(BIN / "dagster"),
            *("asset", "materialize", "-m", "orchestration.definitions"),
            *("--select", "transactions,predictions", "--partition", DAY),
        ],
        cwd=project,
        env=plain_shell(project, tmp_path / "home")
        | {"TANDEM_SOURCE": "files", "TANDEM_SOURCE_LOCATION": str(landing)},
        timeout_s=300,
    )
    assert materialized.returncode != 0
    said = materialized.stdout + materialized.stderr
    store = project / "data" / "bentoml"
    assert f"no production version of 'risk_model' in the model store at {store} (BENTOML_HOME unset" in said, said
    assert "(nothing ingested)" in said, said
    database = project / "data" / "tandem.db"
    if database.exists():
        with sqlite3.connect(database) as conn:
            assert conn.execute("SELECT count(*) FROM transactions").fetchone() == (0,)
