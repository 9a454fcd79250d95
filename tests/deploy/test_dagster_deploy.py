"""deploy/dagster: the Kubernetes instance config loads as a Dagster instance config, and the Helm
values render the same queue, retries and monitoring as orchestration/dagster.yaml."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from dagster._config import Shape, process_config, validate_config
from dagster._core.errors import DagsterInvalidConfigError
from dagster._core.instance.config import dagster_instance_config, validate_concurrency_config

from tests.deploy.support import DAGSTER_DIR, KUBERNETES_VERSION, ROOT, has_module, load_yaml

INSTANCE_FILE = DAGSTER_DIR / "dagster.yaml"
VALUES = load_yaml(DAGSTER_DIR / "values.yaml")
LOCAL_INSTANCE = load_yaml(ROOT / "orchestration" / "dagster.yaml")
POSTGRES_ENV = {
    "DAGSTER_PG_HOST": "postgres.example",
    "DAGSTER_PG_PORT": "5432",
    "DAGSTER_PG_DB": "dagster",
    "DAGSTER_PG_USERNAME": "dagster",
    "DAGSTER_PG_PASSWORD": "not-a-secret",
}


@pytest.fixture
def instance_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    for name, value in POSTGRES_ENV.items():
        monkeypatch.setenv(name, value)
    shutil.copyfile(INSTANCE_FILE, tmp_path / "dagster.yaml")
    config, custom_class = dagster_instance_config(str(tmp_path))
    assert custom_class is None
    return dict(config)


def test_instance_config_loads(instance_config: dict[str, Any]) -> None:
    # Every section is validated against dagster's instance schema here, run_launcher included as a
    # configurable class (module/class/config); its own fields are checked below with dagster-k8s.
    assert instance_config["run_launcher"]["class"] == "K8sRunLauncher"
    assert instance_config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert set(instance_config["storage"]) == {"postgres"}


def test_postgres_storage_resolves_from_the_environment(instance_config: dict[str, Any]) -> None:
    from dagster_postgres import DagsterPostgresStorage

    result = process_config(DagsterPostgresStorage.config_type(), instance_config["storage"]["postgres"])
    assert result.success, result.errors
    assert result.value is not None
    assert result.value["postgres_db"]["password"] == POSTGRES_ENV["DAGSTER_PG_PASSWORD"]
    assert result.value["postgres_db"]["port"] == 5432
    # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; dagster-postgres needs psycopg2.
    assert result.value["postgres_db"]["scheme"] == "postgresql+psycopg2"
    assert VALUES["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"


def test_k8s_run_launcher_config_matches_dagster_k8s(instance_config: dict[str, Any]) -> None:
    if not has_module("dagster_k8s"):
        pytest.skip("dagster-k8s is not installed: the run_launcher config was only checked as a configurable class")
    from dagster_k8s import K8sRunLauncher

    result = validate_config(Shape(K8sRunLauncher.config_type()), instance_config["run_launcher"]["config"])
    assert result.success, result.errors


def test_run_pod_volumes_and_resources_are_valid_kubernetes(instance_config: dict[str, Any]) -> None:
    if not has_module("kubernetes_validate"):
        pytest.skip("kubernetes-validate is not installed")
    import kubernetes_validate

    launcher = instance_config["run_launcher"]["config"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "run-pod", "labels": launcher["labels"]},
        "spec": {
            "volumes": launcher["volumes"],
            "containers": [
                {
                    "name": "dagster",
                    "image": "tandem",
                    "volumeMounts": launcher["volume_mounts"],
                    "resources": launcher["resources"],
                    "env": [
                        dict(zip(("name", "value"), item.split("=", 1), strict=True)) for item in launcher["env_vars"]
                    ],
                }
            ],
        },
    }
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("section", ["concurrency", "run_retries", "run_monitoring", "telemetry"])
def test_sections_match_the_local_instance(instance_config: dict[str, Any], section: str) -> None:
    local = LOCAL_INSTANCE[section]
    deployed = instance_config[section]
    # The Kubernetes instance may add keys (run_monitoring.max_resume_run_attempts: 0, the default,
    # made explicit), never change one.
    assert {key: deployed[key] for key in local} == local


def test_run_retries_never_multiply_with_step_retries(instance_config: dict[str, Any]) -> None:
    assert instance_config["run_retries"]["retry_on_asset_or_op_failure"] is False
    assert instance_config["run_monitoring"].get("max_resume_run_attempts", 0) == 0


def test_queue_limits_live_only_under_concurrency(instance_config: dict[str, Any]) -> None:
    coordinator = instance_config["run_coordinator"].get("config", {})
    assert "max_concurrent_runs" not in coordinator
    assert "tag_concurrency_limits" not in coordinator


# ---------------------------------------------------------------------------------------- Helm values


def _rendered_by_chart() -> dict[str, Any]:
    """The parts of the instance the chart renders from these values (templates/configmap-instance.yaml
    and _helpers.tpl map camelCase values to the snake_case instance keys)."""
    daemon = VALUES["dagsterDaemon"]
    queued = daemon["runCoordinator"]["config"]["queuedRunCoordinator"]
    names = {
        "maxConcurrentRuns": "max_concurrent_runs",
        "tagConcurrencyLimits": "tag_concurrency_limits",
        "dequeueIntervalSeconds": "dequeue_interval_seconds",
        "dequeueUseThreads": "dequeue_use_threads",
        "dequeueNumWorkers": "dequeue_num_workers",
    }
    monitoring_names = {
        "enabled": "enabled",
        "startTimeoutSeconds": "start_timeout_seconds",
        "maxRuntimeSeconds": "max_runtime_seconds",
        "pollIntervalSeconds": "poll_interval_seconds",
        "maxResumeRunAttempts": "max_resume_run_attempts",
        "freeSlotsAfterRunEndSeconds": "free_slots_after_run_end_seconds",
    }
    retries = daemon["runRetries"]
    return {
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": {names[key]: value for key, value in queued.items() if value is not None},
        },
        "run_monitoring": {monitoring_names[key]: value for key, value in daemon["runMonitoring"].items()},
        "run_retries": {
            "enabled": retries["enabled"],
            "max_retries": retries["maxRetries"],
            "retry_on_asset_or_op_failure": retries["retryOnAssetOrOpFailure"],
        },
        **VALUES["additionalInstanceConfig"],
    }


def test_helm_values_render_the_same_instance_behaviour(instance_config: dict[str, Any]) -> None:
    rendered = _rendered_by_chart()
    for section in ("concurrency", "run_retries", "run_monitoring"):
        assert rendered[section] == instance_config[section], section
    assert rendered["run_coordinator"] == instance_config["run_coordinator"]


def test_helm_values_pass_dagsters_concurrency_rules() -> None:
    rendered = _rendered_by_chart()
    validate_concurrency_config(rendered)  # raises on max_concurrent_runs in two places
    conflicting = dict(rendered)
    conflicting["run_coordinator"] = {
        **rendered["run_coordinator"],
        "config": {**rendered["run_coordinator"]["config"], "max_concurrent_runs": 4},
    }
    with pytest.raises(DagsterInvalidConfigError):
        validate_concurrency_config(conflicting)


def test_helm_uses_the_k8s_run_launcher_and_external_postgres() -> None:
    assert VALUES["runLauncher"]["type"] == "K8sRunLauncher"
    assert VALUES["postgresql"]["enabled"] is False
    assert VALUES["generatePostgresqlPasswordSecret"] is False
    assert VALUES["global"]["postgresqlSecretName"] == "dagster-postgresql-secret"
    launcher = load_yaml(INSTANCE_FILE)["run_launcher"]["config"]
    assert launcher["postgres_password_secret"] == VALUES["global"]["postgresqlSecretName"]
    assert launcher["dagster_home"] == VALUES["global"]["dagsterHome"]
    assert VALUES["dagsterDaemon"]["enabled"] is True


def test_user_code_deployment_serves_the_one_composition_root() -> None:
    (deployment,) = VALUES["dagster-user-deployments"]["deployments"]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "orchestration.definitions"]
    assert has_module("orchestration.definitions")
    (location,) = load_yaml(ROOT / "workspace.yaml")["load_from"]
    # The chart names the code location after the deployment; the runbook's `-l tandem` relies on it.
    assert location["python_module"]["module_name"] == "orchestration.definitions"
    assert location["python_module"]["location_name"] == deployment["name"] == "tandem"
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True
    env = {item["name"]: item.get("value") for item in deployment["env"]}
    assert env["BENTOML_HOME"] in {mount["mountPath"] for mount in deployment["volumeMounts"]}
    assert {"name": "tandem-database"} in deployment["envSecrets"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in deployment["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"tandem-model-store"}


def test_helm_daemon_keys_are_known_to_the_chart() -> None:
    # Field names of the chart's Daemon model (helm/dagster/schema/.../subschema/daemon.py), which
    # forbids extra keys.
    known = {
        "enabled", "image", "runCoordinator", "heartbeatTolerance", "env", "envConfigMaps", "envSecrets",
        "deploymentLabels", "labels", "nodeSelector", "affinity", "tolerations", "podSecurityContext",
        "securityContext", "resources", "checkDbReadyInitContainer", "livenessProbe", "readinessProbe",
        "startupProbe", "annotations", "runMonitoring", "runRetries", "sensors", "schedules", "backfills",
        "schedulerName", "logFormat", "volumeMounts", "volumes", "initContainerResources", "extraContainers",
        "extraPrependedInitContainers",
    }  # fmt: skip
    assert set(VALUES["dagsterDaemon"]) <= known
    queued_known = {
        "maxConcurrentRuns", "tagConcurrencyLimits", "dequeueIntervalSeconds", "dequeueNumWorkers",
        "dequeueUseThreads", "blockOpConcurrencyLimitedRuns",
    }  # fmt: skip
    assert set(VALUES["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]) <= queued_known
