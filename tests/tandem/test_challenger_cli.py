"""`tandem models challenge` and `tandem models promote --from-challenger`, driven in-process through
tandem.cli.main, and the challenger pointer beside production in the model store.

BENTOML_HOME is the session's temporary folder (tests/conftest.py); each test gets a model name
(TANDEM_MODEL_NAME) and a data folder (TANDEM_DATA_DIR, so the SQLite file the CLI reads) of its own.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
import torch
from sqlalchemy.engine import make_url

from inference.challenger import AUC_NOT_WORSE, ENOUGH_EVIDENCE
from inference.migrate import upgrade
from inference.model import TrainingReport
from inference.settings import TandemSettings
from inference.store import make_engine, record_challenger_report
from tandem import modelstore
from tandem.cli import main
from tests.inference.support import TINY_MODEL
from tests.reference import REFERENCE
from tests.shared import reference_model

RecordReport = Callable[..., int]


@dataclass
class Store:
    name: str
    champion: str
    challenger: str
    spare: str


def register(name: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = reference_model(TINY_MODEL)
    report = TrainingReport(0.5 + seed / 100, 10, 5, 1, model.parameter_count, None)
    return modelstore.register(model, report, name=name, code_version="test")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    name = f"risk_cli_{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("TANDEM_MODEL_NAME", name)
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    champion, challenger, spare = (register(name, seed) for seed in (1, 2, 3))
    modelstore.promote(champion)
    return Store(name, champion, challenger, spare)


@pytest.fixture
def report(store: Store) -> Iterator[RecordReport]:
    """Records a challenger_report verdict where the CLI reads it; returns its id."""
    engine = make_engine(TandemSettings().resolved_database_url())
    upgrade(engine, REFERENCE)

    def record(champion: str, challenger: str, failures: dict[str, str] | None = None) -> int:
        with engine.begin() as conn:
            return record_challenger_report(
                conn,
                champion=champion,
                challenger=challenger,
                created_at=datetime(2026, 11, 8, 9, 30, tzinfo=UTC),
                run_id="run-1",
                failures=failures or {},
                metrics={"pairs": 1000},
            )

    yield record
    engine.dispose()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def markers(capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    code, out, err = run(capsys, "models", "list")
    assert (code, err) == (0, [])
    return {line[2:].split("  ")[0]: line[0] for line in out}


def assert_one_line_error(err: list[str], *fragments: str) -> None:
    assert len(err) == 1, err
    assert err[0].startswith("tandem: ")
    assert "Traceback" not in err[0]
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])


def assert_promotion_refused(
    store: Store, capsys: pytest.CaptureFixture[str], *fragments: str, challenger: str | None, force: bool = False
) -> None:
    """`tandem models promote --from-challenger` (`--force` too if `force`) exits 1 with nothing on
    stdout and one line on stderr holding each of `fragments`, and moves neither pointer:
    production stays on the champion, the challenger slot on `challenger`."""
    code, out, err = run(capsys, "models", "promote", "--from-challenger", *(["--force"] if force else []))
    assert (code, out) == (1, [])
    assert_one_line_error(err, *fragments)
    assert modelstore.production_tag(store.name) == store.champion
    assert modelstore.challenger_tag(store.name) == challenger


# ------------------------------------------------------------------ challenge, clear, list
def test_challenge_clear_and_the_list_markers(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    assert markers(capsys) == {store.champion: "*", store.challenger: " ", store.spare: " "}

    assert run(capsys, "models", "challenge", store.challenger) == (0, [f"challenger -> {store.challenger}"], [])
    assert modelstore.challenger_tag(store.name) == store.challenger
    assert modelstore.production_tag(store.name) == store.champion
    assert markers(capsys) == {store.champion: "*", store.challenger: "c", store.spare: " "}

    assert run(capsys, "models", "challenge", store.spare) == (0, [f"challenger -> {store.spare}"], [])
    assert markers(capsys) == {store.champion: "*", store.challenger: " ", store.spare: "c"}

    assert run(capsys, "models", "challenge", "--clear") == (0, [f"challenger cleared (was {store.spare})"], [])
    assert modelstore.challenger_tag(store.name) is None
    assert run(capsys, "models", "challenge", "--clear") == (0, ["no challenger was set"], [])
    assert markers(capsys) == {store.champion: "*", store.challenger: " ", store.spare: " "}


def test_the_version_in_production_cannot_challenge(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "models", "challenge", store.champion)
    assert (code, out) == (1, [])
    assert_one_line_error(err, store.champion, "in production already")
    assert modelstore.challenger_tag(store.name) is None


@pytest.mark.parametrize("action", ["challenge", "promote"])
def test_an_unknown_tag_is_one_line_without_a_traceback(
    store: Store, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    code, out, err = run(capsys, "models", action, f"{store.name}:doesnotexist")
    assert (code, out) == (1, [])
    assert_one_line_error(err, f"{store.name}:doesnotexist", "not found")
    assert modelstore.production_tag(store.name) == store.champion
    assert modelstore.challenger_tag(store.name) is None

    code, _, err = run(capsys, "models", action, "Not A Tag!")
    assert code == 1
    assert_one_line_error(err, "not a valid BentoML tag")


@pytest.mark.parametrize(("action", "refused"), [("promote", "nothing promoted"), ("challenge", "no challenger set")])
def test_a_version_of_another_model_name_is_refused(
    store: Store, capsys: pytest.CaptureFixture[str], action: str, refused: str
) -> None:
    # The store keeps a pointer per name: promoted, another name's pointer moved and the command
    # said "production -> " the configured model's unchanged version, exiting 0.
    other_name = f"{store.name}_other"
    other = register(other_name, 4)
    code, out, err = run(capsys, "models", action, other)
    assert (code, out) == (1, [])
    assert_one_line_error(err, other, f"not of {store.name} (TANDEM_MODEL_NAME): {refused}")
    assert (modelstore.production_tag(store.name), modelstore.challenger_tag(store.name)) == (store.champion, None)
    assert (modelstore.production_tag(other_name), modelstore.challenger_tag(other_name)) == (None, None)


def test_a_malformed_tag_is_one_line_too(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "models", "challenge", f"{store.name}:a:b")
    assert code == 1
    assert_one_line_error(err, "Invalid Tag")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("models", "promote", "--force"), "one of the arguments"),
        (("models", "promote", "some:tag", "--force"), "--force goes with --from-challenger"),
        (("models", "promote", "some:tag", "--from-challenger"), "not allowed with"),
        (("models", "challenge"), "one of the arguments"),
        (("models", "challenge", "some:tag", "--clear"), "not allowed with"),
    ],
)
def test_usage_errors_exit_2(
    store: Store, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], said: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert said in captured.err and captured.out == ""
    assert modelstore.production_tag(store.name) == store.champion


# ------------------------------------------------------------------ promote --from-challenger: the gate
def test_no_challenger_nothing_to_promote(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    for force in (False, True):
        assert_promotion_refused(
            store, capsys, "no challenger to promote", "tandem models challenge TAG", challenger=None, force=force
        )


def test_refused_without_a_report_of_this_pair(
    store: Store, report: RecordReport, capsys: pytest.CaptureFixture[str]
) -> None:
    modelstore.challenge(store.challenger)
    # Reports that do not count: another champion, another challenger.
    report(store.spare, store.challenger)
    report(store.champion, store.spare)

    assert_promotion_refused(
        store,
        capsys,
        f"not promoting {store.challenger}",
        f"no challenger_report compares {store.challenger} with {store.champion}",
        "(--force promotes anyway)",
        challenger=store.challenger,
    )


def test_refused_after_a_failed_report_naming_the_failed_checks(
    store: Store, report: RecordReport, capsys: pytest.CaptureFixture[str]
) -> None:
    modelstore.challenge(store.challenger)
    report(store.champion, store.challenger)  # passed once, but the newest verdict is what counts
    failed = report(
        store.champion,
        store.challenger,
        {AUC_NOT_WORSE: "worse by 0.1234: challenger AUC 0.7000", ENOUGH_EVIDENCE: "12 labelled pairs"},
    )

    assert_promotion_refused(
        store,
        capsys,
        f"challenger_report {failed} (2026-11-08 09:30 UTC) failed",
        f"{AUC_NOT_WORSE}: worse by 0.1234: challenger AUC 0.7000",
        f"{ENOUGH_EVIDENCE}: 12 labelled pairs",
        challenger=store.challenger,
    )


def test_a_passing_report_promotes_and_empties_the_slot(
    store: Store, report: RecordReport, capsys: pytest.CaptureFixture[str]
) -> None:
    modelstore.challenge(store.challenger)
    report(store.champion, store.challenger, {AUC_NOT_WORSE: "worse"})
    passed = report(store.champion, store.challenger)

    code, out, err = run(capsys, "models", "promote", "--from-challenger")
    assert (code, err) == (0, [])
    assert out == [
        f"challenger_report {passed} passed every check of the gate",
        f"production -> {store.challenger} (was {store.champion}); challenger slot empty",
    ]
    assert modelstore.production_tag(store.name) == store.challenger
    assert modelstore.challenger_tag(store.name) is None
    assert markers(capsys) == {store.champion: " ", store.challenger: "*", store.spare: " "}
    # The former champion is one rollback away.
    assert run(capsys, "models", "rollback") == (0, [f"production -> {store.champion}"], [])


def test_force_promotes_past_a_failed_report_and_says_so(
    store: Store, report: RecordReport, capsys: pytest.CaptureFixture[str]
) -> None:
    modelstore.challenge(store.challenger)
    failed = report(store.champion, store.challenger, {AUC_NOT_WORSE: "worse by 0.1234"})

    code, out, err = run(capsys, "models", "promote", "--from-challenger", "--force")
    assert (code, err) == (0, [])
    assert len(out) == 2
    assert out[0].startswith(f"forced past the gate: challenger_report {failed} ")
    assert f"{AUC_NOT_WORSE}: worse by 0.1234" in out[0]
    assert out[1] == f"production -> {store.challenger} (was {store.champion}); challenger slot empty"
    assert modelstore.production_tag(store.name) == store.challenger
    assert modelstore.challenger_tag(store.name) is None


def test_force_promotes_without_any_report(
    store: Store, report: RecordReport, capsys: pytest.CaptureFixture[str]
) -> None:
    modelstore.challenge(store.spare)
    code, out, err = run(capsys, "models", "promote", "--from-challenger", "--force")
    assert (code, err) == (0, [])
    assert out[0].startswith(f"forced past the gate: no challenger_report compares {store.spare} with {store.champion}")
    assert modelstore.production_tag(store.name) == store.spare


# ------------------------------------------------------------------ the pointer itself
def test_a_plain_promote_keeps_another_challenger_and_clears_a_promoted_one(store: Store) -> None:
    modelstore.challenge(store.challenger)
    modelstore.promote(store.spare)
    assert modelstore.challenger_tag(store.name) == store.challenger, "promoting another version keeps the slot"
    modelstore.promote(store.challenger)
    assert modelstore.production_tag(store.name) == store.challenger
    assert modelstore.challenger_tag(store.name) is None


def test_rolling_back_onto_the_challenger_empties_the_slot(store: Store) -> None:
    modelstore.promote(store.spare)  # previous: [champion]
    modelstore.challenge(store.champion)
    assert modelstore.rollback(store.name) == store.champion
    assert modelstore.production_tag(store.name) == store.champion
    assert modelstore.challenger_tag(store.name) is None, "production and challenger are never the same version"


def test_a_pointer_written_before_challengers_reads_as_no_challenger(store: Store) -> None:
    pointer = Path(modelstore._pointer_file(store.name))
    pointer.write_text(json.dumps({"current": store.champion, "previous": []}))
    assert modelstore.challenger_tag(store.name) is None
    assert modelstore.clear_challenger(store.name) is None
    assert modelstore.challenge(store.challenger) == store.challenger
    assert json.loads(pointer.read_text()) == {
        "current": store.champion,
        "previous": [],
        "challenger": store.challenger,
    }
    modelstore.promote(store.spare)
    assert modelstore.challenger_tag(store.name) == store.challenger


@pytest.mark.postgres
def test_the_refusal_says_the_report_time_in_utc_whatever_the_database_time_zone(
    store: Store, postgres_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    database = make_url(postgres_url).database
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE \"{database}\" SET timezone TO 'Europe/Berlin'")
    monkeypatch.setenv("DATABASE_URL", postgres_url)
    engine = make_engine(postgres_url)
    upgrade(engine, REFERENCE)
    with engine.begin() as conn:
        failed = record_challenger_report(
            conn,
            champion=store.champion,
            challenger=store.challenger,
            created_at=datetime(2026, 11, 8, 9, 30, tzinfo=UTC),
            run_id=None,
            failures={AUC_NOT_WORSE: "worse"},
            metrics={},
        )
    engine.dispose()
    modelstore.challenge(store.challenger)

    assert_promotion_refused(
        store, capsys, f"challenger_report {failed} (2026-11-08 09:30 UTC) failed", challenger=store.challenger
    )


def test_listing_a_name_with_no_versions_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"risk_cli_empty_{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("TANDEM_MODEL_NAME", name)
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))

    code, out, err = run(capsys, "models", "list")

    assert (code, err) == (0, [])
    assert len(out) == 1 and f"no production version of {name!r}" in out[0]
    assert "risk_model asset trains" in out[0]  # the training asset the configured spec declares
    assert modelstore.versions(name) == []
