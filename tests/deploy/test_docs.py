"""docs/ and the PR template: the review question comes first, and every name the operations docs
use (settings, metrics, alerts, sensors, jobs, asset checks, CLI commands) exists in the code."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import AliasChoices
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from serving.security import SecuritySettings
from serving.settings import ServingSettings
from tests.deploy.support import DEPLOY, DOCS, MONITORING_DIR, ROOT, exported_metric_names, load_yaml
from tests.reference import REFERENCE

REVIEW_QUESTION = "Does this change move a code path between batch and online, and did we decide that?"
PR_TEMPLATE = ROOT / ".github" / "pull_request_template.md"
CHECKLIST = DOCS / "design-review-checklist.md"
DECISION = DOCS / "decisions" / "0001-online-path-is-an-online-service.md"
RUNBOOK = (DOCS / "runbook.md").read_text()
SLO = (DOCS / "slo.md").read_text()
OPERATIONS_TEXT = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [*DOCS.rglob("*.md"), *DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.json")]
}

# Names docs/slo.md asks the service for (its "Gaps" section); they must not exist yet, and must
# only be mentioned as requests. When the service adds one, move it out of here. (Empty: every
# earlier request, from the availability target to the in-flight gauge, is exported now.)
REQUESTED_SETTINGS: set[str] = set()
REQUESTED_METRICS: set[str] = set()


def _checklist_items(text: str) -> list[str]:
    return [line.removeprefix("- [ ]").strip() for line in text.splitlines() if line.startswith("- [ ]")]


def _code(text: str) -> str:
    """The fenced code blocks and inline code spans of a Markdown text."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    return "\n".join([*blocks, *spans])


def test_pr_template_asks_the_review_question_first() -> None:
    text = PR_TEMPLATE.read_text()
    items = _checklist_items(text)
    assert items, "the PR template has no checklist"
    assert items[0] == REVIEW_QUESTION
    first_question = next(line for line in text.splitlines() if line.rstrip().endswith("?"))
    assert REVIEW_QUESTION in first_question, "nothing may be asked before the review question"


def test_checklist_doc_asks_it_first_and_matches_the_template() -> None:
    items = _checklist_items(CHECKLIST.read_text())
    assert items[0] == REVIEW_QUESTION
    assert items == _checklist_items(PR_TEMPLATE.read_text())


def test_decision_record_has_its_sections_and_commitments() -> None:
    text = DECISION.read_text()
    assert text.startswith("# 0001 — Tandem's online path is an online service")
    for heading in ("## Context", "## Decision", "## What this commits us to", "## Consequences"):
        assert heading in text
    for commitment in ("Warm model", "Bounded admission", "declared p99 target", "Per-item isolation",
                       "Idempotency", "Deadlines", "Outbox"):  # fmt: skip
        assert commitment.lower() in text.lower(), commitment


def test_slo_declares_the_score_targets_the_service_enforces() -> None:
    # The numbers the document declares are the service's defaults, read from the settings, so a
    # default changed without the SLO (or the other way round) fails here.
    default = {name: field.default for name, field in ServingSettings.model_fields.items()}
    availability = f"{default['availability_target'] * 100:g} %"
    assert re.search(rf"POST /score.*{re.escape(availability)}", SLO)
    assert f"p99 ≤ {default['p99_target_ms']:g} ms" in SLO
    assert f"rolling {default['slo_window_days']} days" in SLO
    for name in (
        "TANDEM_SERVING_P99_TARGET_MS",
        "tandem_serving_p99_target_seconds",
        "TANDEM_SERVING_AVAILABILITY_TARGET",
        "tandem_serving_availability_target",
        "TANDEM_SERVING_SLO_WINDOW_DAYS",
        "tandem_serving_slo_window_seconds",
        "tandem_serving_requests_over_target_total",
        'le="0.05"',
    ):
        assert name in SLO, name
    assert "## Gaps" in SLO


@pytest.mark.parametrize("path", sorted(OPERATIONS_TEXT))
def test_settings_named_in_docs_and_deploy_exist(path: str) -> None:
    real = {
        name
        for settings in (ServingSettings, SecuritySettings)
        for name in [*_variables(settings), *_older_names(settings)]
    }
    assert not REQUESTED_SETTINGS & real, "a requested setting exists now: update docs/slo.md and this test"
    named = set(re.findall(r"TANDEM_SERVING_[A-Z0-9_]+", OPERATIONS_TEXT[path]))
    unknown = named - real - REQUESTED_SETTINGS
    assert not unknown, f"{path} names settings serving/settings.py does not have: {sorted(unknown)}"
    if path != "docs/slo.md":
        assert not named & REQUESTED_SETTINGS, f"{path} relies on a setting that does not exist yet"


@pytest.mark.parametrize("path", sorted(OPERATIONS_TEXT))
def test_metrics_named_in_docs_and_deploy_exist(path: str) -> None:
    exported = exported_metric_names()
    assert not REQUESTED_METRICS & exported, "a requested metric exists now: update docs/slo.md and this test"
    named = set(re.findall(r"\btandem_serving_[a-z0-9_]+", OPERATIONS_TEXT[path]))
    # The HPA's adapter-derived metric is named in the adapter rules, not exported by the service.
    derived = {
        rule["name"]["as"] for rule in load_yaml(MONITORING_DIR / "prometheus-adapter-rules.yaml")["rules"]["custom"]
    }
    unknown = named - exported - derived - REQUESTED_METRICS
    assert not unknown, f"{path} names metrics serving/metrics.py does not export: {sorted(unknown)}"
    if path != "docs/slo.md":
        assert not named & REQUESTED_METRICS, f"{path} relies on a metric that does not exist yet"


def test_alerts_named_in_docs_exist() -> None:
    rules = load_yaml(MONITORING_DIR / "alerts.yaml")
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    for text in (RUNBOOK, SLO):
        named = set(re.findall(r"\bTandem[A-Z][A-Za-z0-9]+\b", text)) - {"TandemSettings"}
        assert named, "no alert named"
        assert named <= alerts, f"not in alerts.yaml: {sorted(named - alerts)}"


def test_dagster_names_in_the_runbook_exist() -> None:
    from dagster import DailyPartitionsDefinition

    from assets.batch import build_batch_assets
    from orchestration.definitions import defs
    from orchestration.sensors import (
        DAILY_JOB,
        RESCORE_JOB,
        SensorSettings,
        build_online_observer,
        build_production_model_observer,
        build_sensors,
    )

    settings = SensorSettings()
    partitions = DailyPartitionsDefinition(start_date="2026-11-01")
    # The ones an operator acts on in the runbook's scenarios must be there; any it names must exist.
    sensors = {
        s.name
        for s in [
            *build_sensors(settings, partitions=partitions),
            build_online_observer(settings),
            build_production_model_observer(settings),
        ]
    } | {"scoring_automation_sensor"}
    defined = {s.name for s in defs.sensors}
    assert sensors <= defined
    assets = build_batch_assets(REFERENCE, partitions, 16)
    checks = {spec.name for asset in assets for spec in asset.check_specs}
    code = _code(RUNBOOK)
    for name in sensors:
        assert name in RUNBOOK, f"runbook never mentions sensor {name}"
    for name in set(re.findall(r"\b\w+_(?:sensor|observer)\b", code)):
        assert name in defined, name
    for name in checks:
        assert name in RUNBOOK, f"runbook never mentions asset check {name}"
        assert name in SLO, f"slo.md never mentions asset check {name}"
    for name in set(re.findall(r"-j (\w+)", code)):
        assert name in {DAILY_JOB, RESCORE_JOB}, name
    assert [schedule.name for schedule in defs.schedules or []] == ["daily_scoring_schedule"]
    assert "daily_scoring_schedule" in RUNBOOK


def _commands(prefix: str, text: str = RUNBOOK) -> set[tuple[str, ...]]:
    found = set()
    for line in _code(text).replace("\\\n", " ").splitlines():
        for match in re.finditer(rf"(?:^|[\s(]){prefix} ([^|;&)#]*)", line):
            words = []
            for token in shlex.split(match.group(1).replace("$WS", ""), posix=True):
                if not re.fullmatch(r"[a-z][a-z-]*", token):
                    break
                words.append(token)
            if words:
                found.add(tuple(words))
    return found


def test_tandem_cli_commands_in_the_runbook_exist(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import main

    commands = _commands("tandem")
    assert {("models", "rollback"), ("models", "list"), ("rejects", "fixed")} <= commands
    for words in commands:
        with pytest.raises(SystemExit) as exited:
            main([*words, "--help"])
        assert exited.value.code == 0, f"`tandem {' '.join(words)}` is not a command"
    capsys.readouterr()


def test_dagster_cli_commands_in_the_runbook_exist() -> None:
    from dagster._cli import cli

    commands = _commands("dagster")
    assert ("job", "backfill") in commands
    runner = CliRunner()
    for words in commands:
        result = runner.invoke(cli, [*words, "--help"])
        assert result.exit_code == 0, f"`dagster {' '.join(words)}`: {result.output}"
    backfill_help = runner.invoke(cli, ["job", "backfill", "--help"]).output
    for option in ("--partitions", "--noprompt", "--workspace", "--location", "--job"):
        assert option in backfill_help


# --- README.md and the reference pages in docs/ ------------------------------------------------

README = ROOT / "README.md"
README_MAX_LINES = 200
CONFIGURATION = DOCS / "configuration.md"
BATCH = DOCS / "batch.md"
# Every Markdown page a reader can reach from the README: its links are checked.
LINKED_PAGES = [README, *sorted(DOCS.rglob("*.md"))]
# Variables the docs may name that no settings class reads: other tools' (BentoML, Dagster), the
# code version images stamp (tandem/version.py), and the test suite's switches.
OTHER_VARIABLES = {
    "BENTOML_HOME",
    "DAGSTER_HOME",
    "DAGSTER_POSTGRES_URL",
    "TANDEM_CODE_VERSION",
    "TANDEM_TEST_POSTGRES_URL",
    "TANDEM_REQUIRE_POSTGRES",
    "TANDEM_RUN_E2E",
    "TANDEM_E2E_ARTIFACTS",
}
# A decision record not built yet proposes Tandem settings; naming them is its point. Once its
# status changes, its variables must exist as any page's do.
PROPOSED_STATUS = "- Status: Proposed: not built yet"


def _settings_classes() -> dict[str, list[type[BaseSettings]]]:
    """The settings classes by where their variables are documented: docs/configuration.md for the
    core, the batch path and `make run`; serving/README.md (and a few in configuration.md) for the
    online path's."""
    from assets.settings import DeadlineSettings
    from inference.challenger import PromotionGate
    from inference.settings import TandemSettings
    from inference.spec.loading import SpecSettings
    from orchestration.alerts import AlertSettings
    from orchestration.sensors import SensorSettings
    from orchestration.settings import OrchestrationSettings, PlatformSettings

    core: list[type[BaseSettings]] = [
        TandemSettings,
        SpecSettings,
        OrchestrationSettings,
        PlatformSettings,
        SensorSettings,
        AlertSettings,
        DeadlineSettings,
        PromotionGate,
    ]
    return {"configuration": core, "serving": [ServingSettings, SecuritySettings]}


def _variables(settings: type[BaseSettings]) -> dict[str, object]:
    """Each environment variable a settings class reads, with its default."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    found: dict[str, object] = {}
    for name, field in settings.model_fields.items():
        # A field read under several names (AliasChoices) is documented under its first.
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            alias = alias.choices[0]
        found[alias if isinstance(alias, str) else f"{prefix}{name}".upper()] = field.default
    return found


def _older_names(settings: type[BaseSettings]) -> set[str]:
    """The names a renamed setting is still read under (an AliasChoices' later choices)."""
    return {
        str(choice)
        for field in settings.model_fields.values()
        if isinstance(field.validation_alias, AliasChoices)
        for choice in field.validation_alias.choices[1:]
    }


def _all_variables() -> dict[str, object]:
    return {
        name: default
        for group in _settings_classes().values()
        for s in group
        for name, default in _variables(s).items()
    }


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def _links(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def test_readme_is_a_guide_under_200_lines_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; reference material belongs in docs/"
    for command in ("make run", "make test"):
        assert command in text, command
    assert "127.0.0.1:3000" in text and "127.0.0.1:3001" in text


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_that_exist(page: Path) -> None:
    broken = []
    for link in _links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        resolved = (page.parent / target).resolve() if target else page
        if not resolved.exists():
            broken.append(f"{link}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{link}: no heading #{anchor} in {resolved.name}")
    assert not broken, broken


def test_readme_states_the_request_limits_the_service_enforces() -> None:
    text = README.read_text()
    serving, security = ServingSettings.model_fields, SecuritySettings.model_fields
    assert f"at most {serving['max_records_per_request'].default} records" in text
    assert "TANDEM_SERVING_MAX_RECORDS_PER_REQUEST" in text
    assert security["max_body_bytes"].default == 1024 * 1024
    assert "1 MiB" in text and "TANDEM_SERVING_MAX_BODY_BYTES" in text


def test_readme_says_which_request_id_an_idempotent_replay_repeats() -> None:
    # Only the item-level request_id (the producer of the answer) is replayed; the top-level one and
    # the X-Request-ID header name the exchange (tests/serving/test_live.py checks the behaviour).
    text = " ".join(README.read_text().split())
    assert "in each result, the same `request_id`" in text
    assert "The top-level `request_id` and the `X-Request-ID` header name this HTTP exchange" in text


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_environment_variables_named_in_the_docs_exist(page: Path) -> None:
    real = (
        set(_all_variables())
        | OTHER_VARIABLES
        | {old for group in _settings_classes().values() for s in group for old in _older_names(s)}
    )
    named = set(re.findall(r"\b(?:TANDEM|DAGSTER|BENTOML)_[A-Z0-9_]*[A-Z0-9]\b|\bDATABASE_URL\b", page.read_text()))
    unknown = {name for name in named - real if not any(variable.startswith(f"{name}_") for variable in real)}
    if PROPOSED_STATUS in page.read_text():
        unknown = {name for name in unknown if not name.startswith("TANDEM_")}
    assert not unknown, f"no settings class reads {sorted(unknown)}"


def test_configuration_page_lists_every_core_and_batch_setting_with_its_default() -> None:
    text = CONFIGURATION.read_text()
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`[A-Z0-9_]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1]
    for settings in _settings_classes()["configuration"]:
        for variable, default in _variables(settings).items():
            assert variable in rows, f"docs/configuration.md has no row for {variable} ({settings.__name__})"
            said = rows[variable]
            # A default computed when read (a factory: the checkout's data folder) is said in words.
            if isinstance(default, bool) or default is None or default is PydanticUndefined:
                continue
            if isinstance(default, int | float):
                number = re.match(r"[\d,.]+", said)
                assert number and float(number.group().replace(",", "")) == default, (variable, said, default)
            elif hasattr(default, "isoformat"):
                assert default.isoformat() in said, (variable, said, default)
            else:
                assert str(default) in said, (variable, said, default)
    # The online path's rows, where there are any, say the service's defaults too.
    serving = {name: default for s in _settings_classes()["serving"] for name, default in _variables(s).items()}
    for variable, said in rows.items():
        if (
            variable in serving
            and isinstance(serving[variable], int | float)
            and not isinstance(serving[variable], bool)
        ):
            number = re.match(r"[\d,.]+", said)
            assert number and float(number.group().replace(",", "")) == serving[variable], (variable, said)


def test_batch_page_documents_every_asset_check_sensor_job_and_schedule() -> None:
    from orchestration.definitions import defs

    text = BATCH.read_text()
    graph = defs.resolve_asset_graph()
    names = {
        *(key.to_user_string() for key in graph.get_all_asset_keys()),
        *(key.name for key in graph.asset_check_keys),
        *(sensor.name for sensor in defs.sensors or []),
        *(job.name for job in defs.jobs or []),
        *(schedule.name for schedule in defs.schedules or []),
    }
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert not missing, f"docs/batch.md does not document {missing}"
    code = _code(text)
    for name in set(re.findall(r"\b\w+_(?:sensor|observer|schedule)\b", code)):
        assert name in names, f"docs/batch.md names {name}, which orchestration/definitions.py does not define"


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_tandem_commands_in_the_readme_and_docs_exist(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import main

    for words in _commands("tandem", page.read_text()):
        with pytest.raises(SystemExit) as exited:
            main([*words, "--help"])
        assert exited.value.code == 0, f"`tandem {' '.join(words)}` is not a command"
    capsys.readouterr()
