"""The `make run` launcher (orchestration/platform.py): the settings it refuses, and what its exit status says."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from orchestration import platform
from orchestration.settings import OrchestrationSettings, PlatformSettings


@pytest.mark.parametrize(("failed", "code"), [(0, 0), (3, 1)])
def test_no_serve_exits_non_zero_when_a_demo_run_failed(
    failed: int, code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It exited 0 after five failed runs: a script or CI took the demo for working.
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setattr(platform, "materialize_demo", lambda settings: failed)
    monkeypatch.setattr(platform, "serve_forever", lambda: pytest.fail("--no-serve served"))

    assert platform.main(["--no-serve"]) == code
    said = capsys.readouterr().out
    assert ("3 demo run(s) failed" in said) is bool(failed)


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("TANDEM_DAGSTER_PORT", "3000x", "valid integer"),
        ("TANDEM_SERVICE_PORT", "70000", "less than or equal to 65535"),
        ("TANDEM_PARTITIONS_START", "2026/11/01", "valid date"),
        ("TANDEM_DEMO_START_DATE", "2026-13-01", "valid date"),
        ("TANDEM_DEMO_ROWS_PER_DAY", "0", "greater than or equal to 1"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable_before_any_work(
    variable: str,
    value: str,
    said: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A traceback that named neither (Dagster's strptime; "month must be in 1..12"), or int() at import.
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(platform, "materialize_demo", lambda settings: pytest.fail("ran with a bad setting"))

    assert platform.main(["--no-serve"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"[tandem] {variable}={value!r}: ") and said in err[0]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgresql://tandem:s3cret@db:abc/tandem", "not a database URL: invalid literal"),
        ("not a url", "not a database URL (e.g."),
        ("mysql://root:s3cret@db/tandem", "not mysql://"),
    ],
)
def test_a_database_url_the_store_cannot_use_is_one_line_before_any_work(
    url: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each demo run failed on it inside Dagster and the launcher served anyway; a port that is no
    number was refused with the URL echoed, password and all."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setattr(platform, "materialize_demo", lambda settings: pytest.fail("ran with a bad DATABASE_URL"))

    assert platform.main(["--no-serve"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("[tandem] DATABASE_URL: ") and said in err[0] and "s3cret" not in err[0]


def test_the_code_location_names_a_bad_partitions_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dagster loads orchestration.definitions itself: there the variable is named by pydantic's own error.
    monkeypatch.setenv("TANDEM_PARTITIONS_START", "yesterday")
    with pytest.raises(ValidationError, match="TANDEM_PARTITIONS_START"):
        OrchestrationSettings()
    monkeypatch.setenv("TANDEM_PARTITIONS_START", "2026-12-01")
    assert OrchestrationSettings().partitions_start == date(2026, 12, 1)
    assert OrchestrationSettings(partitions_start="2026-11-02").partitions_start == date(2026, 11, 2)


def test_the_webserver_and_the_daemon_share_one_code_server_and_the_daemon_logs_warnings(tmp_path: Path) -> None:
    # Given workspace.yaml's module, the daemon started a code server of its own and replaced it
    # every minute: the code location was imported again each time, and each old server warned
    # "No heartbeat received in 20 seconds, shutting down". At INFO it logged every sensor tick.
    workspace = tmp_path / "workspace.yaml"
    commands = platform.platform_commands(
        PlatformSettings(dagster_port=3100, service_port=3101), code_port=4321, workspace=workspace
    )

    assert list(commands) == ["dagster-code-server", "dagster-webserver", "dagster-daemon", "bentoml"]
    server = commands["dagster-code-server"]
    assert server[1:5] == ["code-server", "start", "-m", "orchestration.definitions"]
    assert server[server.index("-p") + 1] == "4321" and "--heartbeat" not in server
    for name in ("dagster-webserver", "dagster-daemon"):
        argv = commands[name]
        assert argv[argv.index("-w") + 1] == str(workspace), name
    daemon = commands["dagster-daemon"]
    assert daemon[daemon.index("--log-level") + 1] == "warning"
    assert yaml.safe_load(platform.code_server_workspace(4321)) == {
        "load_from": [{"grpc_server": {"host": "127.0.0.1", "port": 4321, "location_name": "tandem"}}]
    }
