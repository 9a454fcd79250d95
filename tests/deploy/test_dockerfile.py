"""The Dockerfile (never built here) agrees with the manifests that run its image: the command, the
port, the working directory, the user, the state directories and the pinned versions."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

from tests.deploy.support import DAGSTER_DIR, ROOT, load_yaml, service_manifests

DOCKERFILE = (ROOT / "Dockerfile").read_text()
DOCKERIGNORE = (ROOT / ".dockerignore").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPLOYMENT = service_manifests()["Deployment/tandem-scorer"]
POD = DEPLOYMENT["spec"]["template"]["spec"]
(CONTAINER,) = POD["containers"]
VALUES = load_yaml(DAGSTER_DIR / "values.yaml")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; comments dropped, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    found = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), " ".join(rest.split())))
    return found


INSTRUCTIONS = _instructions(DOCKERFILE)


def _all(keyword: str) -> list[str]:
    return [rest for name, rest in INSTRUCTIONS if name == keyword]


def _one(keyword: str) -> str:
    (only,) = _all(keyword)
    return only


def _env() -> dict[str, str]:
    values: dict[str, str] = {}
    for rest in _all("ENV"):
        for key, value in re.findall(r"(\w+)=(\S*)", rest):
            values[key] = value
    return values


def _pin(requirement: str) -> str:
    (found,) = [d for d in PYPROJECT["project"]["dependencies"] if re.match(rf"{requirement}\b", d)]
    return found.replace(" ", "")


def test_base_image_is_the_python_the_project_requires() -> None:
    assert INSTRUCTIONS[0] == ("FROM", "python:3.11-slim")
    assert PYPROJECT["project"]["requires-python"].startswith(">=3.11,<3.12")


def test_cmd_is_the_deployment_command() -> None:
    cmd: Any = json.loads(_one("CMD"))  # exec form: no shell between the kubelet's SIGTERM and bentoml
    assert cmd == CONTAINER["command"]
    assert cmd[:3] == ["bentoml", "serve", "serving.service:TandemScorer"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_no_entrypoint_so_the_dagster_chart_args_replace_cmd() -> None:
    # The dagster-user-deployments chart sets only `args: [dagster, api, grpc, ...]`: with an
    # ENTRYPOINT they would be appended to it instead of replacing CMD.
    assert not _all("ENTRYPOINT")
    (location,) = VALUES["dagster-user-deployments"]["deployments"]
    assert (
        location["image"]["repository"]
        == DEPLOYMENT["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[0]
    )
    assert location["dagsterApiGrpcArgs"] == ["-m", "orchestration.definitions"]


def test_exposed_ports_are_the_container_and_code_location_ports() -> None:
    exposed = {int(port) for rest in _all("EXPOSE") for port in rest.split()}
    (container_port,) = [p["containerPort"] for p in CONTAINER["ports"]]
    cmd = json.loads(_one("CMD"))
    assert int(cmd[cmd.index("--port") + 1]) == container_port
    (location,) = VALUES["dagster-user-deployments"]["deployments"]
    assert exposed == {container_port, location["port"]}


def test_workdir_is_where_the_code_is_and_the_deployment_runs() -> None:
    workdir = _one("WORKDIR")
    assert workdir == CONTAINER["workingDir"] == "/app"
    assert f"COPY . {workdir}" in [f"COPY {rest}" for rest in _all("COPY")]


def test_user_is_the_deployment_security_context_and_not_root() -> None:
    user = _one("USER")
    uid, _, gid = user.partition(":")
    context = POD["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (int(uid), int(gid)) == (context["runAsUser"], context["runAsGroup"])
    assert int(uid) != 0
    # USER comes after every RUN that needs root (pip, useradd, chown).
    positions = [i for i, (name, _) in enumerate(INSTRUCTIONS) if name in {"RUN", "USER"}]
    assert INSTRUCTIONS[positions[-1]][0] == "USER"


def test_state_directories_match_the_deployment_env() -> None:
    env = _env()
    deployment_env = {item["name"]: item.get("value") for item in CONTAINER["env"]}
    for name in ("TANDEM_DATA_DIR", "BENTOML_HOME", "HOME"):
        assert env[name] == deployment_env[name], name
    created = " ".join(rest for rest in _all("RUN") if "mkdir" in rest)
    for name in ("TANDEM_DATA_DIR", "BENTOML_HOME"):
        assert env[name] in created, name
    assert VALUES["global"]["dagsterHome"] in created


def test_installs_the_pinned_cpu_torch_then_the_project() -> None:
    runs = _all("RUN")
    torch_pin = _pin("torch")
    (torch_step,) = [r for r in runs if "download.pytorch.org/whl/cpu" in r]
    assert torch_pin in torch_step.split()
    (project_step,) = [r for r in runs if re.search(r"pip install \.(\s|$)", r)]
    assert runs.index(torch_step) < runs.index(project_step), "torch first, so `pip install .` keeps the CPU wheel"
    # dagster-k8s for the run pods, on the release line of the pinned dagster-postgres.
    postgres_version = _pin("dagster-postgres").split("==")[1]
    assert f"dagster-k8s=={postgres_version}" in project_step.split()


def test_dockerignore_keeps_what_the_install_needs() -> None:
    ignored = {line.strip() for line in DOCKERIGNORE.splitlines() if line.strip() and not line.startswith("#")}
    needed = {
        "pyproject.toml",
        PYPROJECT["project"]["readme"],
        *PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"],
    }
    for name in needed:
        top = name.rstrip("*")
        assert top not in ignored and f"/{top}" not in ignored, (
            f".dockerignore drops {top}, which `pip install .` needs"
        )
        assert (ROOT / top).exists(), top
    assert {".git", ".venv", "data"} <= ignored
