"""`bentoml build` packs the service and the production model by its class-scope BentoModel
reference, the built Bento serves /score, and the bentofile agrees with the Dockerfile and the
pyproject pins (the image is hand-written because one image runs both the Dagster code location
and the service; `bentoml containerize` would build the service alone)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.support import ROOT
from tests.reference import MERCHANT_CATEGORIES
from tests.serving.support import LiveServer, serve
from tests.shared import fresh_postgres_database, register_untrained_model, run_child, service_env

BENTOFILE = yaml.safe_load((ROOT / "bentofile.yaml").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
MODEL_NAME = "bento_test_model"


def _pins(requirements: list[str]) -> dict[str, str]:
    found = {}
    for requirement in requirements:
        name = re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0].lower()
        found[name] = requirement[len(name) :].split(";")[0].strip()
    return found


def test_the_bentofile_serves_what_the_dockerfile_serves_with_the_same_pins() -> None:
    assert f'"{BENTOFILE["service"]}"' in DOCKERFILE.split("CMD", 1)[1], "one service entry point"
    bento_pins = _pins(BENTOFILE["python"]["packages"])
    project_pins = _pins(PYPROJECT["project"]["dependencies"])
    for name, pin in bento_pins.items():
        assert project_pins.get(name) == pin, f"{name}: bentofile {pin!r}, pyproject {project_pins.get(name)!r}"
    # What the service imports at run time, beyond the framework itself, is in the Bento.
    for needed in ("torch", "bentoml", "polars", "sqlalchemy", "alembic", "prometheus-client", "pydantic-settings"):
        assert needed in bento_pins, needed


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A Bento built from the repository in a BentoML home of its own: (bento tag, model tag, home)."""
    home = tmp_path_factory.mktemp("bento-home")
    session_home = Path(os.environ["BENTOML_HOME"])
    tag = register_untrained_model(MODEL_NAME)
    # Built in a home holding this model and its production pointer only: the build is what is tested.
    shutil.copytree(session_home / "models" / MODEL_NAME, home / "models" / MODEL_NAME)
    for pointer in session_home.glob(f"**/*{MODEL_NAME}*.json"):
        target = home / pointer.relative_to(session_home)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pointer, target)
    env = {**os.environ, "BENTOML_HOME": str(home), "TANDEM_MODEL_NAME": MODEL_NAME, "BENTOML_DO_NOT_TRACK": "True"}
    result = run_child(
        [sys.executable, "-m", "bentoml", "build", "--output", "tag", str(ROOT)], cwd=ROOT, env=env, timeout_s=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    bento_tag = result.stdout.strip().splitlines()[-1].removeprefix("__tag__:")
    yield bento_tag, tag, home


def test_bentoml_build_packs_the_production_model_by_reference(built: tuple[str, str, Path]) -> None:
    bento_tag, model_tag, home = built
    name, version = bento_tag.split(":")
    manifest = yaml.safe_load((home / "bentos" / name / version / "bento.yaml").read_text())
    (service,) = manifest["services"]
    assert manifest["service"] == BENTOFILE["service"] and service["name"] == "TandemScorer"
    # The class-scope BentoModel: the version that was production when the Bento was built.
    assert [model["tag"] for model in service["models"]] == [model_tag]
    packed = home / "bentos" / name / version / "src"
    assert (packed / "serving" / "service.py").exists() and not (packed / "tests").exists()
    assert {api["route"] for api in manifest["schema"]["routes"]} >= {"/score"}


@pytest.mark.live
@pytest.mark.postgres
def test_the_built_bento_serves_score(built: tuple[str, str, Path], postgres_admin_url: str, tmp_path: Path) -> None:
    bento_tag, model_tag, home = built
    with fresh_postgres_database(postgres_admin_url, prefix="tandem_bento") as database_url:
        env = service_env(database_url=database_url, data_dir=tmp_path / "data", model_name=MODEL_NAME) | {
            "BENTOML_HOME": str(home),
            "TANDEM_SERVING_MODEL_POLL_INTERVAL_S": "0",
        }
        with serve(LiveServer, env, tmp_path / "serve.log", target=bento_tag) as server:
            row = {
                "transaction_id": "bento-1",
                "account_id": "acct-1",
                "amount": 12.5,
                "currency": "USD",
                "merchant_category": MERCHANT_CATEGORIES[0],
                "country": "US",
                "event_time": "2026-11-02T10:00:00Z",
            }
            answer = httpx.post(f"{server.url}/score", json={"transactions": [row]}, timeout=30)
            assert answer.status_code == 200, answer.text
            (result,) = answer.json()["results"]
            assert (result["status"], result["model_version"]) == ("scored", model_tag)
