"""Security guarantees checked against the code and real runs: loopback binds by default, no
secret in logs or Dagster's event log and metadata, SQL only ever parameterised, the token only
ever compared in constant time and never shown.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dagster import DagsterInstance, serialize_value
from pydantic import SecretStr, ValidationError
from sqlalchemy.engine import make_url

from serving.metrics import ServingMetrics
from serving.security import BearerAuth, SecuritySettings
from serving.settings import ServingSettings
from tests.orchestration.support import batch_assets, batch_resources, run_partition
from tests.reliability.support import MODEL_NAME, ROOT, RUN_CONFIG, SecretDatabase

pytestmark = pytest.mark.reliability

PACKAGES = ("inference", "assets", "orchestration", "serving", "tandem", "bench")
SQL_KEYWORDS = ("SELECT", "INSERT", "UPDATE", "DELETE", "CREATE", "DROP", "ALTER", "TRUNCATE", "COPY", "GRANT", "WITH")
SQL_SINKS = {"execute", "executemany", "exec_driver_sql", "copy", "text"}
# Dynamic SQL that is allowed, and why: identifiers from our own code, never from input.
ALLOWED_DYNAMIC_SQL = {
    # COPY into a temporary staging twin: the table name comes from our SQLAlchemy metadata and
    # columns are quoted by the dialect's identifier preparer; values travel through COPY.
    ("inference/store/merge.py", "_copy_to_staging"),
    # COPY (a SQLAlchemy select) TO STDOUT: its values stay bound parameters, and the FORCE_QUOTE
    # columns are names from our own schema.
    ("inference/store/source_rows.py", "_copy_partition_rows"),
    # The benchmark harness creates and drops its own scratch database, named from a uuid.
    ("bench/harness.py", "fresh_database"),
    # Migration 0008 renames a column of the core tables it names itself (RENAME COLUMN, in place on
    # both databases).
    ("inference/migrations/versions/0008_record_id.py", "upgrade"),
    ("inference/migrations/versions/0008_record_id.py", "downgrade"),
}


# ------------------------------------------------------------------ bind addresses
def test_dagster_webserver_and_service_bind_loopback_by_default(
    monkeypatch: pytest.MonkeyPatch, reliability_model: str
) -> None:
    """What `make run` starts (orchestration/platform.py), argv captured instead of exec'd."""
    from dagster_webserver import cli as webserver_cli

    from orchestration import platform

    assert "TANDEM_HOST" not in os.environ
    started: dict[str, list[str]] = {}

    class Recorded:
        def __init__(self, argv: list[str], **_: Any) -> None:
            started[Path(argv[0]).name] = argv
            self.pid = -1
            self.returncode = 0

        def poll(self) -> int:
            return 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(platform.subprocess, "Popen", Recorded)
    monkeypatch.setattr(platform, "_wait_for", lambda url, seconds: False)
    monkeypatch.setattr(platform.signal, "signal", lambda *args: None)
    monkeypatch.setattr(platform.time, "sleep", lambda seconds: None)
    with pytest.raises(SystemExit):
        platform.serve_forever()

    webserver = started["dagster-webserver"]
    assert webserver[webserver.index("-h") + 1] == "127.0.0.1"
    bentoml_argv = started["bentoml"]
    assert bentoml_argv[bentoml_argv.index("--host") + 1] == "127.0.0.1"
    # And with no flag at all, both programs' own defaults are loopback too.
    assert webserver_cli.DEFAULT_WEBSERVER_HOST == "127.0.0.1"
    monkeypatch.setenv("TANDEM_MODEL_NAME", MODEL_NAME)
    monkeypatch.setenv("TANDEM_SERVING_MODEL_TAG", reliability_model)
    from serving.service import TandemScorer

    assert getattr(TandemScorer, "config")["http"]["host"] == "127.0.0.1"  # noqa: B009 - bentoml's Service


# ------------------------------------------------------------------ secrets in Dagster's records
def _dagster_records(instance: DagsterInstance, run_id: str) -> str:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    texts = [serialize_value(entry) for entry in instance.all_logs(run_id)]
    texts.append(serialize_value(run))
    return "\n".join(texts)


@pytest.fixture
def database_url_env(secret_db: SecretDatabase, monkeypatch: pytest.MonkeyPatch) -> Iterator[SecretDatabase]:
    # As in production: the resource has no url of its own and reads DATABASE_URL at run start.
    monkeypatch.setenv("DATABASE_URL", secret_db.url)
    yield secret_db


def test_database_password_never_reaches_dagster_logs_or_metadata(
    database_url_env: SecretDatabase,
    reliability_model: str,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    db = database_url_env
    assets = batch_assets()
    with DagsterInstance.ephemeral() as instance:
        ok = run_partition(
            assets,
            batch_resources(None, rows_per_day=1500, poison_rate=0.02, model_name=MODEL_NAME),
            instance,
            partition_key="2026-11-04",
            run_config=RUN_CONFIG,
        )
        assert ok.success
        (materialization,) = ok.asset_materializations_for_node("predictions")
        assert materialization.metadata["scored"].value
        records = _dagster_records(instance, ok.run_id)

        # A run that fails on the database: the error path must not print the URL either.
        missing = make_url(db.url).set(database=f"{db.name}_missing").render_as_string(hide_password=False)
        monkeypatch.setenv("DATABASE_URL", missing)
        failed = run_partition(
            assets,
            batch_resources(None, rows_per_day=1500, model_name=MODEL_NAME),
            instance,
            partition_key="2026-11-04",
            selection=("transactions",),
            raise_on_error=False,
        )
        assert not failed.success
        failure_records = _dagster_records(instance, failed.run_id)
    assert "does not exist" in failure_records, "the failure was recorded (so the check below means something)"
    captured = capfd.readouterr()
    everything = "\n".join([records, failure_records, captured.out, captured.err, caplog.text])
    assert db.password not in everything
    assert "scored" in records and db.name in failure_records


# ------------------------------------------------------------------ SQL only parameterised
def _dynamic_sql(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line, enclosing function, snippet) of SQL built from f-strings, % or .format()."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def function_of(node: ast.AST) -> str:
        """The enclosing functions, outermost first (`outer.inner`)."""
        names = []
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.append(node.name)
        return ".".join(reversed(names)) or "<module>"

    def leading_text(node: ast.AST) -> str:
        """The literal text a dynamic string starts with ("" when it starts with a value)."""
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
            return leading_text(node.left)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
            return leading_text(node.func.value)
        return ""

    def is_dynamic(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.JoinedStr)
            or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add))
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format")
        )

    for node in ast.walk(tree):
        # Any dynamic string that reads like SQL, wherever it is built...
        if is_dynamic(node) and not isinstance(parents.get(node), ast.JoinedStr | ast.BinOp):
            text = leading_text(node).lstrip().upper()
            if text.split(" ", 1)[0] in SQL_KEYWORDS:
                yield getattr(node, "lineno", 0), function_of(node), ast.unparse(node)[:120]
        # ...and any dynamic string handed to something that executes SQL.
        if isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in SQL_SINKS and is_dynamic(node.args[0]):
                yield node.lineno, function_of(node), ast.unparse(node.args[0])[:120]


def test_all_sql_is_parameterised_outside_the_documented_identifier_cases() -> None:
    found = {
        (path.relative_to(ROOT).as_posix(), line, function, snippet)
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, function, snippet in _dynamic_sql(path)
    }
    unexpected = sorted(hit for hit in found if (hit[0], hit[2].split(".")[0]) not in ALLOWED_DYNAMIC_SQL)
    assert not unexpected, "SQL built from strings (use SQLAlchemy or bound parameters):\n" + "\n".join(
        f"{path}:{line} in {function}: {snippet}" for path, line, function, snippet in unexpected
    )
    # The audit finds what it should: the documented staging identifiers are still seen.
    assert any(hit[0] == "inference/store/merge.py" and hit[2] == "_copy_to_staging" for hit in found)


def test_the_sql_audit_catches_an_injected_f_string(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def lookup(conn, tx):\n"
        "    conn.exec_driver_sql(f\"SELECT * FROM predictions WHERE transaction_id = '{tx}'\")\n"
        "    query = 'DELETE FROM predictions WHERE id = %s' % tx\n"
        "    conn.execute(sa.text('SELECT 1 WHERE x = ' + tx))\n"
    )
    assert sorted(line for line, _, _ in _dynamic_sql(planted)) == [2, 2, 3, 4, 4]


# ------------------------------------------------------------------ the token
def test_token_is_secret_compared_in_constant_time_and_resolved_at_first_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = SecuritySettings(auth_token=SecretStr("hunter2-token"))
    assert "hunter2-token" not in repr(settings) and "hunter2-token" not in str(settings.model_dump())
    assert SecuritySettings(auth_token="  ").auth_token is None  # type: ignore[arg-type]
    auth = BearerAuth(settings.auth_token)
    assert auth.check("Bearer hunter2-token") is None
    refusal = auth.check("Bearer hunter2-tokeN")
    assert refusal is not None and refusal.status == 401 and "hunter2" not in refusal.detail
    source = (ROOT / "serving" / "security.py").read_text()
    assert "hmac.compare_digest" in source and "== self._expected" not in source

    # The app object is built at import (BentoML needs it at class scope); the token is read from
    # the environment only when the first request arrives.
    from starlette.testclient import TestClient

    from serving.schemas import api_models
    from tests.reference import REFERENCE
    from tests.serving.score_route import with_score_route

    class Stub:
        spec = REFERENCE
        api = api_models(REFERENCE)
        metrics = ServingMetrics()
        settings = ServingSettings()
        model_version = "risk_model:stub"  # named in /openapi.json

        def alive(self) -> bool:
            return True

        def admit(self, deadline: float) -> Place:
            return Place()  # admitted: refused next for its token, its size or its body

        def finished(self, latency_s: float | None) -> None:
            pass

    class Place:
        """A `Reservation`'s part: given back once the request is refused for its body."""

        def release(self) -> None:
            pass

    monkeypatch.delenv("TANDEM_SERVING_AUTH_TOKEN", raising=False)
    app = with_score_route(Stub)  # type: ignore[arg-type]
    monkeypatch.setenv("TANDEM_SERVING_AUTH_TOKEN", "set-after-import")
    monkeypatch.setenv("TANDEM_SERVING_MAX_BODY_BYTES", "100")
    with TestClient(app) as client:
        assert client.post("/score", json={}).status_code == 401
        authorised = {"Authorization": "Bearer set-after-import"}
        assert client.post("/score", content=b"x" * 101, headers=authorised).status_code == 413
        answer: httpx.Response = client.post("/score", content=b"x" * 50, headers=authorised)
        assert answer.status_code == 422
        assert client.get("/openapi.json").json()["paths"]["/score"]["post"]["security"] == [{"bearer": []}]

    # Started (the lifespan BentoML runs for a mounted app), a bad setting fails the start itself.
    monkeypatch.setenv("TANDEM_SERVING_MAX_BODY_BYTES", "0")
    with pytest.raises(ValidationError), TestClient(with_score_route(Stub)):  # type: ignore[arg-type]
        pass


def test_serving_never_logs_a_settings_object_or_a_url() -> None:
    """Static: nothing in serving/ passes a URL or a settings object to a logger."""
    offenders = []
    for path in sorted((ROOT / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"debug", "info", "warning", "error", "exception", "critical"}
            ):
                text = ast.unparse(node)
                if any(word in text for word in ("url", "settings", "token", "password")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:120]}")
    assert not offenders, offenders
