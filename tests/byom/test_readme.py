"""README.md's "Bring your own model", followed as written: its spec and data script, taken from
the README itself, in a package outside the repository; then its commands as subprocesses (`tandem
spec`, `make run`'s ingest, train and score without serving, the retrain, one backfilled day,
`bentoml serve`, its curl and BentoML client calls, `tandem lineage`). A command the README no
longer gives fails the test, so the README cannot drift from what works.

Slow (about two minutes: four Dagster runs and a served model), so it runs when the end-to-end
tests do: TANDEM_RUN_E2E=1, or CI=true.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.support import LiveServer, serve
from tests.shared import run_child

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
README = (REPO / "README.md").read_text()
# The README's commands as one line each: a continued line (`\` and a newline) joined to the next.
README_LINES = re.sub(r"\\\n\s*", "", README)
RUN = os.environ.get("TANDEM_RUN_E2E") == "1" or os.environ.get("CI", "").lower() == "true"
COMMAND_TIMEOUT_S = 300

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(not RUN, reason="follows the README through Dagster and BentoML: set TANDEM_RUN_E2E=1"),
]


def readme_block(marker: str) -> str:
    """The fenced block that follows `<!-- byom: {marker} -->` in README.md."""
    found = re.search(rf"<!-- byom: {re.escape(marker)} -->\n```\w+\n(.*?)```\n", README, re.S)
    assert found, f"README.md has no fenced block after <!-- byom: {marker} -->"
    return found.group(1)


def readme_command(command: str) -> list[str]:
    """`command`, split as a shell would; fails unless README.md gives it as written."""
    assert command in README_LINES, f"README.md no longer says: {command}"
    return shlex.split(command)


@dataclass(frozen=True)
class Byom:
    """The user's folder (`~/byom` in the README) and the environment every command runs in."""

    home: Path
    env: dict[str, str]

    def run(self, command: str, *, argv: list[str] | None = None) -> str:
        """`command` from the README (or `argv` in its place), run at the repository's root; its stdout."""
        words = readme_command(command)
        done = run_child(argv or [str(BIN / words[0]), *words[1:]], cwd=REPO, env=self.env, timeout_s=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout


def written_as_the_readme_says(home: Path) -> None:
    (home / "sensors").mkdir(parents=True)
    (home / "sensors" / "__init__.py").write_text(readme_block("sensors/__init__.py"))
    (home / "write_days.py").write_text(readme_block("write_days.py"))


@pytest.fixture(scope="module")
def byom(tmp_path_factory: pytest.TempPathFactory) -> Byom:
    """Steps 1 to 4: the spec and its data written, checked, trained, retrained and one day backfilled."""
    root = tmp_path_factory.mktemp("byom")
    home, state = root / "byom", root / "state"
    written_as_the_readme_says(home)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(home), str(REPO)]),
        "TANDEM_MODEL_SPEC": "sensors:SPEC",
        "TANDEM_SOURCE": "files",
        "TANDEM_SOURCE_LOCATION": str(home / "landing"),
        # The README's default, data/sensors of the checkout, moved out of it; the homes below it
        # with it, so that no `.env` is written into the checkout either.
        "TANDEM_DATA_DIR": str(state),
        "DAGSTER_HOME": str(state / "dagster"),
        "BENTOML_HOME": str(state / "bentoml"),
    }
    user = Byom(home, env)
    (state / "dagster").mkdir(parents=True)
    script = "python ~/byom/write_days.py ~/byom/landing"
    user.run(script, argv=[sys.executable, str(home / "write_days.py"), str(home / "landing")])
    assert len(list((home / "landing").glob("2026-11-*.csv"))) == 14
    checked = user.run("tandem spec")
    assert checked.startswith("sensors:SPEC: readings scored by failure_model"), checked
    assert "8 earlier records of machine_id" in checked
    # `make run` without its serving half: the same launcher, the same Dagster runs.
    ran = user.run("make run", argv=[sys.executable, "-m", "orchestration.platform", "--no-serve"])
    assert "summary: 7 days, 14,000 scored, 0 quarantined, 0 failed runs" in ran, ran
    user.run(
        "dagster asset materialize -m orchestration.definitions --select failure_model "
        """--config-json '{"ops": {"failure_model": {"config": {"epochs": 40}}}}'"""
    )
    user.run(
        "dagster asset materialize -m orchestration.definitions --select readings,predictions --partition 2026-11-08"
    )
    return user


def production_auc(user: Byom) -> float:
    listed = run_child([str(BIN / "tandem"), "models", "list"], cwd=REPO, env=user.env, timeout_s=COMMAND_TIMEOUT_S)
    (current,) = [line for line in listed.stdout.splitlines() if line.startswith("*")]
    return float(current.rsplit("auc=", 1)[1])


def test_the_retrained_model_is_production_and_learnt_the_readings(byom: Byom) -> None:
    assert "about 0.86 AUC" in README
    assert production_auc(byom) > 0.8


@pytest.fixture(scope="module")
def server(byom: Byom) -> Iterator[LiveServer]:
    # What `make run` serves, on a port of its own.
    with serve(LiveServer, byom.env, byom.home / "serve.log") as live:
        yield live


def curl_body() -> dict[str, Any]:
    """The JSON the README's curl sends."""
    sent = re.search(r"-d '(.*)'", readme_block("curl"), re.S)
    assert sent, "README.md's curl sends no -d '...' body"
    return dict(json.loads(sent.group(1)))


def test_curl_and_bentomls_client_score_readings_by_reading_id(server: LiveServer) -> None:
    answer = httpx.post(f"{server.url}/score", json=curl_body(), timeout=30)
    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["results"]
    assert result["reading_id"] == "r-live-1" and result["status"] == "scored" and 0 <= result["score"] <= 1
    client_code = readme_block("client").replace("http://127.0.0.1:3001", server.url)
    namespace: dict[str, Any] = {}
    # The README's own client example, run as a reader would run it.
    exec(client_code, namespace)
    (by_client,) = namespace["answer"]["results"]
    assert by_client["reading_id"] == "r-live-2" and by_client["status"] == "scored"


def test_a_reading_the_spec_refuses_is_a_422_naming_its_field(server: LiveServer) -> None:
    refused = httpx.post(
        f"{server.url}/score", json={"readings": [{**curl_body()["readings"][0], "vibration": -1}]}, timeout=30
    )
    assert refused.status_code == 422, refused.text
    assert '`["readings", 0, "vibration"]`' in README
    assert [problem["loc"] for problem in refused.json()["detail"]] == [["readings", 0, "vibration"]]


def test_lineage_explains_an_online_answer_with_history_and_a_backfilled_one(byom: Byom, server: LiveServer) -> None:
    assert httpx.post(f"{server.url}/score", json=curl_body(), timeout=30).status_code == 200
    online = byom.run("tandem lineage r-live-1")
    # press-07's stored readings were its history: a history hash other than the empty one.
    assert "via online" in online and "history 0000000000000000" not in online, online
    batch = byom.run("tandem lineage r-20261108-0000")
    assert "via batch" in batch and "partition 2026-11-08" in batch, batch
