"""Bring your own model (README.md's section and its guide, docs/byom.md), followed as written: the
guide's spec and data script, taken from the page itself, in a package outside the repository, under
the environment its `export` line sets; then its commands as subprocesses (`tandem spec`, `make
run`'s ingest, train and score without serving, the retrain, one backfilled day, `bentoml serve`,
its curl and BentoML client calls, `tandem lineage`). A command the guide no longer gives, or the
README's summary of it, fails the test, so neither can drift from what works.

Slow (about a minute and a half: four Dagster runs and a served model), so its live steps run
when the end-to-end tests do: TANDEM_RUN_E2E=1, or CI=true.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
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
GUIDE = (REPO / "docs" / "byom.md").read_text()
# The guide's commands as one line each: a continued line (`\` and a newline) joined to the next.
GUIDE_LINES = re.sub(r"\\\n\s*", "", GUIDE)
RUN = os.environ.get("TANDEM_RUN_E2E") == "1" or os.environ.get("CI", "").lower() == "true"
COMMAND_TIMEOUT_S = 300

# The live steps' marks; the check of the README's summary against the guide runs everywhere.
LIVE = (
    pytest.mark.live,
    pytest.mark.skipif(not RUN, reason="follows the guide through Dagster and BentoML: set TANDEM_RUN_E2E=1"),
)


def live(test: Callable[..., None]) -> Callable[..., None]:
    for mark in LIVE:
        test = mark(test)
    return test


def block(marker: str, page: str = GUIDE) -> str:
    """The fenced block that follows `<!-- byom: {marker} -->` on `page` (the guide)."""
    found = re.search(rf"<!-- byom: {re.escape(marker)} -->\n```\w+\n(.*?)```\n", page, re.S)
    assert found, f"no fenced block after <!-- byom: {marker} -->"
    return found.group(1)


def guide_command(command: str) -> list[str]:
    """`command`, split as a shell would; fails unless docs/byom.md gives it as written."""
    assert command in GUIDE_LINES, f"docs/byom.md no longer says: {command}"
    return shlex.split(command)


def exported(home: Path) -> dict[str, str]:
    """The variables the guide's `export` line sets, its `~/byom` being `home`."""
    (line,) = [line for line in GUIDE_LINES.splitlines() if line.startswith("export PYTHONPATH=")]
    pairs = (word.split("=", 1) for word in shlex.split(line.replace("~/byom", str(home)))[1:])
    return dict(pairs)


def test_the_readmes_summary_gives_the_guides_commands() -> None:
    summary = [line.split("#")[0].strip() for line in block("summary", README).splitlines()]
    assert [line for line in summary if line not in GUIDE_LINES] == []
    assert "[docs/byom.md](docs/byom.md)" in README
    assert "TANDEM_MODEL_SPEC=tandem_specs.diabetes:SPEC make run" in README


@dataclass(frozen=True)
class Byom:
    """The user's folder (`~/byom` in the README) and the environment every command runs in."""

    home: Path
    env: dict[str, str]

    def run(self, command: str, *, argv: list[str] | None = None) -> str:
        """`command` from the guide (or `argv` in its place), run at the repository's root; its stdout."""
        words = guide_command(command)
        done = run_child(argv or [str(BIN / words[0]), *words[1:]], cwd=REPO, env=self.env, timeout_s=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout


def written_as_the_readme_says(home: Path) -> None:
    (home / "sensors").mkdir(parents=True)
    (home / "sensors" / "__init__.py").write_text(block("sensors/__init__.py"))
    (home / "write_days.py").write_text(block("write_days.py"))


@pytest.fixture(scope="module")
def byom(tmp_path_factory: pytest.TempPathFactory) -> Byom:
    """Steps 1 to 4: the spec and its data written, checked, trained, retrained and one day backfilled."""
    root = tmp_path_factory.mktemp("byom")
    home, state = root / "byom", root / "state"
    written_as_the_readme_says(home)
    env = {
        **os.environ,
        **exported(home),
        # The guide's default, data/sensors of the checkout, moved out of it; the homes below it
        # with it, so that no `.env` is written into the checkout either.
        "TANDEM_DATA_DIR": str(state),
        "DAGSTER_HOME": str(state / "dagster"),
        "BENTOML_HOME": str(state / "bentoml"),
    }
    # The checkout on the path beside the user's package, as an installed Tandem would be.
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO)])
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


@live
def test_the_retrained_model_is_production_and_learnt_the_readings(byom: Byom) -> None:
    assert "about 0.86 AUC" in GUIDE
    assert production_auc(byom) > 0.8


@pytest.fixture(scope="module")
def server(byom: Byom) -> Iterator[LiveServer]:
    # What `make run` serves, on a port of its own.
    with serve(LiveServer, byom.env, byom.home / "serve.log") as live:
        yield live


def curl_body() -> dict[str, Any]:
    """The JSON the guide's curl sends."""
    sent = re.search(r"-d '(.*)'", block("curl"), re.S)
    assert sent, "docs/byom.md's curl sends no -d '...' body"
    return dict(json.loads(sent.group(1)))


@live
def test_curl_and_bentomls_client_score_readings_by_reading_id(server: LiveServer) -> None:
    answer = httpx.post(f"{server.url}/score", json=curl_body(), timeout=30)
    assert answer.status_code == 200, answer.text
    (result,) = answer.json()["results"]
    assert result["reading_id"] == "r-live-1" and result["status"] == "scored" and 0 <= result["score"] <= 1
    client_code = block("client").replace("http://127.0.0.1:3001", server.url)
    namespace: dict[str, Any] = {}
    # The guide's own client example, run as a reader would run it.
    exec(client_code, namespace)
    (by_client,) = namespace["answer"]["results"]
    assert by_client["reading_id"] == "r-live-2" and by_client["status"] == "scored"


@live
def test_a_reading_the_spec_refuses_is_a_422_naming_its_field(server: LiveServer) -> None:
    refused = httpx.post(
        f"{server.url}/score", json={"readings": [{**curl_body()["readings"][0], "vibration": -1}]}, timeout=30
    )
    assert refused.status_code == 422, refused.text
    assert '`["readings", 0, "vibration"]`' in GUIDE
    assert [problem["loc"] for problem in refused.json()["detail"]] == [["readings", 0, "vibration"]]


@live
def test_lineage_explains_an_online_answer_with_history_and_a_backfilled_one(byom: Byom, server: LiveServer) -> None:
    assert httpx.post(f"{server.url}/score", json=curl_body(), timeout=30).status_code == 200
    online = byom.run("tandem lineage r-live-1")
    # press-07's stored readings were its history: a history hash other than the empty one.
    assert "via online" in online and "history 0000000000000000" not in online, online
    batch = byom.run("tandem lineage r-20261108-0000")
    assert "via batch" in batch and "partition 2026-11-08" in batch, batch
