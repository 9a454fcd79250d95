"""`make run`: prepare the Dagster instance, materialize the demo days, then run the platform.

Starts the Dagster webserver, the Dagster daemon and the BentoML service as child processes and
stops all of them on Ctrl-C (SIGINT) or SIGTERM. Written by hand because it is a dev launcher:
three processes, one signal handler, no supervisor needed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from dagster import AssetsDefinition, DagsterInstance, materialize
from pydantic import ValidationError
from pydantic_settings import BaseSettings
from sqlalchemy.engine import make_url

from inference.demo import day_range
from inference.homes import resolve_homes
from inference.settings import TandemSettings, settings_error
from inference.spec import LoadedSpec, configured_spec
from inference.store import store_url
from orchestration.instance import instance_config
from orchestration.sensors import SensorSettings
from orchestration.settings import OrchestrationSettings, PlatformSettings
from tandem import modelstore

ROOT = Path(__file__).resolve().parent.parent


def curl_example(ls: LoadedSpec, host: str, port: int) -> str:
    """A request of the spec's `example` record, under the id `demo-1`."""
    body = json.dumps({ls.spec.plural: [{**ls.spec.example(), ls.id.name: "demo-1"}]})
    return f"curl -s -X POST http://{host}:{port}/score -H 'Content-Type: application/json' -d '{body}'"


def _say(message: str) -> None:
    print(f"[tandem] {message}", flush=True)


def dagster_postgres_url(url: str) -> str:
    """`url` with the psycopg2 driver, the only one dagster-postgres works with.

    SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which binds parameters server-side;
    dagster-postgres's event log sends `NOTIFY run_events, :id`, which PostgreSQL then rejects, so
    no run could record an event.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        return url
    return parsed.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


def prepare_instance(dagster_home: Path) -> Path:
    """Install the instance config: PostgreSQL storage when DAGSTER_POSTGRES_URL is set.

    Also pins that URL to the psycopg2 driver, for this process and the ones it starts.
    """
    dagster_home.mkdir(parents=True, exist_ok=True)
    postgres_url = os.environ.get("DAGSTER_POSTGRES_URL")
    if postgres_url:
        os.environ["DAGSTER_POSTGRES_URL"] = dagster_postgres_url(postgres_url)
    target = dagster_home / "dagster.yaml"
    shutil.copyfile(instance_config(), target)
    return target


# Dagster's console logger prints every engine event at DEBUG; the launcher shows progress itself.
_QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def materialize_demo(settings: TandemSettings) -> int:
    """Run the demo days through the real Dagster instance, so the runs show up in the UI; returns
    how many of those runs failed."""
    # Here, not at the top: importing the code location reads its settings, and main() has checked
    # them first, so that a bad one is a line naming the variable rather than a traceback.
    from orchestration.definitions import defs

    days = [d.isoformat() for d in day_range(settings.demo_start_date, settings.demo_days)]
    assets = [asset for asset in defs.assets or [] if isinstance(asset, AssetsDefinition)]
    resources = dict(defs.resources or {})
    totals = {"scored": 0, "rejected": 0, "failed": 0}
    with DagsterInstance.get() as instance:

        def run(selection: str, partition_key: str | None = None) -> dict[str, Any]:
            started = time.perf_counter()
            result = materialize(
                assets,
                selection=[selection],
                partition_key=partition_key,
                instance=instance,
                resources=resources,
                run_config=_QUIET,
                raise_on_error=False,
            )
            materializations = result.asset_materializations_for_node(selection)
            values = {k: v.value for k, v in materializations[0].metadata.items()} if materializations else {}
            label = f"{selection}[{partition_key}]" if partition_key else selection
            status = "ok" if result.success else f"FAILED (run {result.run_id}; see the Dagster UI)"
            totals["failed"] += 0 if result.success else 1
            _say(f"{label} {status} in {time.perf_counter() - started:.1f}s {_brief(values)}")
            return values

        spec = configured_spec().spec
        for key in days:
            run(spec.name, key)
        _say(f"{spec.model_name}: training, evaluating, registering (about a minute)")
        run(spec.model_name)
        for key in days:
            scored = run("predictions", key)
            totals["scored"] += int(scored.get("scored", 0))
            totals["rejected"] += int(scored.get("rejected", 0))
    _say(
        f"summary: {len(days)} days, {totals['scored']:,} scored, {totals['rejected']:,} quarantined, "
        f"{totals['failed']} failed runs; production model {modelstore.production_tag(settings.model_name)}"
    )
    return totals["failed"]


def _brief(values: dict[str, Any]) -> str:
    shown = (
        "rows_stored",
        "rejected_at_ingest",
        "version_tag",
        "auc",
        "promoted",
        "scored",
        "rejected",
        "rows_per_second",
    )
    parts = [
        f"{name}={values[name]:.4g}" if isinstance(values[name], float) else f"{name}={values[name]}"
        for name in shown
        if name in values
    ]
    return f"({', '.join(parts)})" if parts else ""


def _wait_for(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status < 500:
                    return True
        except OSError:
            time.sleep(1)
    return False


LOCATION = "tandem"  # workspace.yaml's name for the code location


def code_server_workspace(port: int) -> str:
    """A workspace that loads the code location from the one code server `make run` starts."""
    return f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {port}\n      location_name: {LOCATION}\n"


def platform_commands(settings: PlatformSettings, *, code_port: int, workspace: Path) -> dict[str, list[str]]:
    """The child processes, in start order.

    The webserver and the daemon load the code location from one `dagster code-server`, not each
    from workspace.yaml: given a module, the daemon starts a code server of its own and replaces it
    every 60 s (Dagster's RELOAD_WORKSPACE_INTERVAL), so the location was imported again each minute
    and each old server warned "No heartbeat received in 20 seconds, shutting down" as it went.
    The daemon logs at WARNING: at INFO it says two lines per sensor tick, even when nothing is due.
    """
    bin_dir = Path(sys.executable).parent
    host = settings.host
    return {
        "dagster-code-server": [
            *(str(bin_dir / "dagster"), "code-server", "start", "-m", "orchestration.definitions"),
            *("--location-name", LOCATION, "-h", "127.0.0.1", "-p", str(code_port)),
        ],
        "dagster-webserver": [
            *(str(bin_dir / "dagster-webserver"), "-w", str(workspace)),
            *("-h", host, "-p", str(settings.dagster_port)),
        ],
        "dagster-daemon": [str(bin_dir / "dagster-daemon"), "run", "-w", str(workspace), "--log-level", "warning"],
        "bentoml": [
            *(str(bin_dir / "bentoml"), "serve", "serving.service:TandemScorer"),
            *("--host", host, "--port", str(settings.service_port)),
        ],
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _code_server_ready(server: subprocess.Popen[bytes], port: int, seconds: float) -> bool:
    """Whether the code server answers its health check within `seconds` (False once it exited)."""
    health = [str(Path(sys.executable).parent / "dagster"), "api", "grpc-health-check", "-p", str(port)]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and server.poll() is None:
        if subprocess.run(health, cwd=ROOT, capture_output=True, check=False).returncode == 0:
            return True
        time.sleep(1)
    return False


def serve_forever(settings: PlatformSettings | None = None) -> int:
    settings = settings or PlatformSettings()
    host, dagster_port, service_port = settings.host, settings.dagster_port, settings.service_port
    code_port = _free_port()
    workspace = resolve_homes().dagster_home / "platform-workspace.yaml"
    workspace.write_text(code_server_workspace(code_port))
    children: dict[str, subprocess.Popen[bytes]] = {}

    def stop(signum: int, _frame: FrameType | None) -> None:
        _say(f"stopping ({signal.Signals(signum).name})")
        for process in children.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in children.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        sys.exit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    for name, argv in platform_commands(settings, code_port=code_port, workspace=workspace).items():
        children[name] = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
        if name == "dagster-code-server" and not _code_server_ready(children[name], code_port, 120):
            _say("the Dagster code server is not answering; starting the rest, its error shows in the UI")
    if _wait_for(f"http://{host}:{dagster_port}/server_info", 120):
        _say(f"Dagster UI:      http://{host}:{dagster_port}  (asset graph: /asset-groups)")
    if _wait_for(f"http://{host}:{service_port}/readyz", 120):
        _say(f"Scoring service: http://{host}:{service_port}  (OpenAPI: /openapi.json, metrics: /metrics)")
        _say(f"try: {curl_example(configured_spec(), host, service_port)}")
    _say("Ctrl-C stops everything")
    while True:
        for name, process in children.items():
            if process.poll() is not None:
                _say(f"{name} exited with {process.returncode}; stopping the rest")
                stop(signal.SIGTERM, None)
        time.sleep(1)


def _checked_settings() -> tuple[TandemSettings, PlatformSettings] | None:
    """Every settings class the launcher and its code location read, checked before any work."""
    read: dict[str, type[BaseSettings]] = {
        settings.__name__: settings
        for settings in (TandemSettings, PlatformSettings, OrchestrationSettings, SensorSettings)
    }
    try:
        OrchestrationSettings(), SensorSettings()
        settings = TandemSettings()
        # Refused here, in one line: each demo run would fail on it in Dagster, then serve anyway.
        store_url(settings.resolved_database_url())
        return settings, PlatformSettings()
    except ValidationError as error:
        print(f"[tandem] {settings_error(error, read[error.title])}", file=sys.stderr, flush=True)
    except ValueError as error:
        print(f"[tandem] DATABASE_URL: {error}", file=sys.stderr, flush=True)
    return None


def main(argv: list[str] | None = None) -> int:
    checked = _checked_settings()
    if checked is None:
        return 1
    settings, platform_settings = checked
    # The homes were settled when the orchestration package was imported (inference/homes.py).
    dagster_home = resolve_homes().dagster_home
    _say(f"Dagster instance config: {prepare_instance(dagster_home)}")
    failed = materialize_demo(settings)
    if "--no-serve" in (sys.argv[1:] if argv is None else argv):
        # Exit 0 after failed runs told a script or CI that the demo worked.
        if failed:
            _say(f"{failed} demo run(s) failed: exit status 1 (their logs are in DAGSTER_HOME, {dagster_home})")
        return 1 if failed else 0
    if failed:
        _say(f"{failed} demo run(s) failed; serving anyway, so that the Dagster UI shows why")
    return serve_forever(platform_settings)


if __name__ == "__main__":
    sys.exit(main())
