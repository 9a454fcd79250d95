"""deploy/service: schema-valid Kubernetes objects that agree with the service's real routes,
settings and metrics."""

from __future__ import annotations

import re
from typing import Any

import pytest
from starlette.routing import Route

from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.deploy.support import (
    DEPLOY,
    KUBERNETES_VERSION,
    MONITORING_DIR,
    ROOT,
    SERVICE_DIR,
    exported_metric_names,
    has_module,
    load_yaml,
    service_manifests,
)

MANIFESTS = service_manifests()
KUSTOMIZATION = load_yaml(SERVICE_DIR / "kustomization.yaml")
SERVICE_PORT = 3001


def _generated_configmaps() -> list[dict[str, Any]]:
    """The ConfigMaps kustomize would generate (name without its hash suffix)."""
    configmaps = []
    for generator in KUSTOMIZATION.get("configMapGenerator", []):
        data = dict(literal.split("=", 1) for literal in generator.get("literals", []))
        configmaps.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}
        )
    return configmaps


def _container() -> dict[str, Any]:
    containers = MANIFESTS["Deployment/tandem-scorer"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_kustomization_lists_every_manifest_in_the_folder() -> None:
    listed = set(KUSTOMIZATION["resources"])
    on_disk = {path.name for path in SERVICE_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= {
        key.split("/")[0] for key in MANIFESTS
    }


@pytest.mark.parametrize("key", sorted(MANIFESTS))
def test_manifest_matches_the_kubernetes_schema(key: str) -> None:
    if not has_module("kubernetes_validate"):
        pytest.skip(
            "kubernetes-validate is not installed: no offline Kubernetes JSON schemas (kubeconform is not "
            "available either); the structural tests in this module still run"
        )
    import kubernetes_validate

    # strict: unknown fields (typos such as `readinesProbe`) fail too.
    kubernetes_validate.validate(MANIFESTS[key], KUBERNETES_VERSION, strict=True)


def test_generated_configmap_matches_the_kubernetes_schema() -> None:
    if not has_module("kubernetes_validate"):
        pytest.skip("kubernetes-validate is not installed")
    import kubernetes_validate

    for configmap in _generated_configmaps():
        kubernetes_validate.validate(configmap, KUBERNETES_VERSION, strict=True)


def test_every_object_has_api_version_kind_and_name() -> None:
    # The structural floor that holds even without the schemas.
    for key, manifest in MANIFESTS.items():
        assert isinstance(manifest.get("apiVersion"), str), key
        assert manifest["metadata"]["name"], key
    assert MANIFESTS["HorizontalPodAutoscaler/tandem-scorer"]["apiVersion"] == "autoscaling/v2"
    assert MANIFESTS["PodDisruptionBudget/tandem-scorer"]["apiVersion"] == "policy/v1"


def test_configmap_keys_are_real_serving_settings_with_valid_values(monkeypatch: pytest.MonkeyPatch) -> None:
    (configmap,) = [c for c in _generated_configmaps() if c["metadata"]["name"] == "tandem-serving"]
    fields = {f"TANDEM_SERVING_{name.upper()}" for name in ServingSettings.model_fields}
    unknown = set(configmap["data"]) - fields
    assert not unknown, f"not settings of serving/settings.py: {sorted(unknown)}"
    for name, value in configmap["data"].items():
        monkeypatch.setenv(name, value)
    settings = ServingSettings()  # raises if a value is out of range
    assert settings.p99_target_ms == 50.0
    # An empty MODEL_TAG must mean "follow the production pointer", which the service tests by truthiness.
    assert not settings.model_tag
    assert _container()["envFrom"] == [{"configMapRef": {"name": "tandem-serving"}}]


def test_probes_hit_the_routes_bentoml_serves() -> None:
    container = _container()
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": SERVICE_PORT}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == "http"


def test_the_metrics_route_the_pods_advertise_exists() -> None:
    from serving.app import build_app

    # The app the service mounts beside its /score API method.
    app = build_app(lambda: None)  # type: ignore[arg-type, return-value]
    routes = {route.path for route in app.routes if isinstance(route, Route)}
    assert "/metrics" in routes
    annotations = MANIFESTS["Deployment/tandem-scorer"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(SERVICE_PORT)


def test_server_listens_on_all_interfaces_on_the_container_port() -> None:
    # serving/service.py binds 127.0.0.1 for local use; in a pod the kubelet and the Service need 0.0.0.0.
    command = _container()["command"]
    assert command[:3] == ["bentoml", "serve", "serving.service:TandemScorer"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--port") + 1] == str(SERVICE_PORT)


def test_database_url_comes_from_a_secret() -> None:
    env = {item["name"]: item for item in _container()["env"]}
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "tandem-database", "key": "DATABASE_URL"}
    assert "value" not in env["DATABASE_URL"]


def test_bentoml_home_is_per_pod_and_the_model_store_is_mounted_read_only_into_it() -> None:
    container = _container()
    pod = MANIFESTS["Deployment/tandem-scorer"]["spec"]["template"]["spec"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    home = env["BENTOML_HOME"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    # `bentoml serve` wipes $BENTOML_HOME/prometheus_multiproc_dir: it must not be a shared volume.
    assert "emptyDir" in volumes[mounts[home]["name"]]
    for sub_path in ("models", "tandem"):  # the versions, and the production pointer (tandem/modelstore.py)
        mount = mounts[f"{home}/{sub_path}"]
        assert mount["subPath"] == sub_path
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == "tandem-model-store"
    assert MANIFESTS["PersistentVolumeClaim/tandem-model-store"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert env["TANDEM_DATA_DIR"] in mounts, "the outbox directory needs a writable volume"


def test_resources_are_guaranteed() -> None:
    resources = _container()["resources"]
    assert resources["requests"] == resources["limits"]
    assert {"cpu", "memory"} <= set(resources["requests"])


def test_selectors_match_the_pod_labels() -> None:
    labels = MANIFESTS["Deployment/tandem-scorer"]["spec"]["template"]["metadata"]["labels"]
    selectors = [
        MANIFESTS["Deployment/tandem-scorer"]["spec"]["selector"]["matchLabels"],
        MANIFESTS["Service/tandem-scorer"]["spec"]["selector"],
        MANIFESTS["PodDisruptionBudget/tandem-scorer"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= labels.items()
    port = MANIFESTS["Service/tandem-scorer"]["spec"]["ports"][0]
    assert port["targetPort"] == "http"


def test_rollout_never_drops_below_the_ready_pods() -> None:
    deployment = MANIFESTS["Deployment/tandem-scorer"]["spec"]
    assert deployment["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert "replicas" not in deployment, "the HPA owns replicas"
    hpa = MANIFESTS["HorizontalPodAutoscaler/tandem-scorer"]["spec"]
    assert hpa["minReplicas"] >= 2
    assert MANIFESTS["PodDisruptionBudget/tandem-scorer"]["spec"]["maxUnavailable"] < hpa["minReplicas"]


def test_hpa_scales_on_service_metrics_served_by_the_adapter_and_on_cpu() -> None:
    hpa = MANIFESTS["HorizontalPodAutoscaler/tandem-scorer"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tandem-scorer"}
    pod_metrics = {m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"}
    resources = {m["resource"]["name"] for m in hpa["metrics"] if m["type"] == "Resource"}
    assert "tandem_serving_queue_depth" in pod_metrics
    assert resources == {"cpu"}

    adapter = load_yaml(MONITORING_DIR / "prometheus-adapter-rules.yaml")["rules"]["custom"]
    served = {rule["name"]["as"]: rule for rule in adapter}
    assert pod_metrics <= set(served), "every Pods metric needs a prometheus-adapter rule"
    exported = exported_metric_names()
    for rule in adapter:
        series = rule["seriesQuery"].split("{", 1)[0]
        assert series in exported, f"adapter rule reads {series}, which serving/metrics.py does not export"
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_grace_period_covers_prestop_deadlines_the_final_drain_and_the_writer_flush(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM to SIGKILL must hold, in order: the preStop pause, the in-flight requests' default
    deadline, the last outbox drain (serving/service.py stop_scorer) and the writer's flush."""
    (configmap,) = [c for c in _generated_configmaps() if c["metadata"]["name"] == "tandem-serving"]
    for name, value in configmap["data"].items():
        monkeypatch.setenv(name, value)
    settings = ServingSettings()
    assert "TANDEM_SERVING_SHUTDOWN_DRAIN_S" in configmap["data"], "make the drain bound explicit where the pod is"
    pre_stop = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    writer = (ROOT / "serving" / "writer.py").read_text()
    flush = re.search(r"self\._thread\.join\(timeout=(\d+(?:\.\d+)?)\)", writer)
    assert flush, "ResultWriter.close no longer bounds its join: update this test"
    needed = float(pre_stop[1]) + settings.request_timeout_ms / 1000 + settings.shutdown_drain_s + float(flush.group(1))
    grace = MANIFESTS["Deployment/tandem-scorer"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert settings.shutdown_drain_s > 0
    assert grace >= needed, f"terminationGracePeriodSeconds {grace} < {needed} s of orderly shutdown"


def test_bearer_token_comes_from_an_optional_secret_that_is_never_committed() -> None:
    env = {item["name"]: item for item in _container()["env"]}
    variable = "TANDEM_SERVING_AUTH_TOKEN"
    assert SecuritySettings.model_config["env_prefix"] + "AUTH_TOKEN" == variable
    assert "auth_token" in SecuritySettings.model_fields
    assert "value" not in env[variable]
    reference = env[variable]["valueFrom"]["secretKeyRef"]
    # Optional: auth is optional in serving/security.py; without the Secret the pod starts with auth off.
    assert reference == {"name": "tandem-serving-auth", "key": variable, "optional": True}
    # How to create it is documented next to the manifests, and no Secret is committed anywhere.
    assert f"create secret generic {reference['name']}" in (SERVICE_DIR / "kustomization.yaml").read_text()
    assert all(not key.startswith("Secret/") for key in MANIFESTS)
    for path in DEPLOY.rglob("*.yaml"):
        assert not re.search(r"^kind:\s*Secret\s*$", path.read_text(), flags=re.MULTILINE), path


def test_configmap_declares_one_worker_per_pod_and_the_slo() -> None:
    (configmap,) = [c for c in _generated_configmaps() if c["metadata"]["name"] == "tandem-serving"]
    data = configmap["data"]
    # Two CPUs per pod: one worker (event loop + scoring process); scale out with replicas.
    assert data["TANDEM_SERVING_WORKERS"] == "1"
    assert _container()["resources"]["limits"]["cpu"] == "2"
    assert (
        float(data["TANDEM_SERVING_AVAILABILITY_TARGET"]) == ServingSettings.model_fields["availability_target"].default
    )
    assert int(data["TANDEM_SERVING_SLO_WINDOW_DAYS"]) == ServingSettings.model_fields["slo_window_days"].default
