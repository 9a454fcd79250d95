"""Every model version records the spec it was trained with, and is never loaded, promoted or
challenged under a spec of another digest; `tandem models register DIR` brings in a model trained
elsewhere, checked by loading it into the spec's model.

BENTOML_HOME is the session's temporary folder (tests/conftest.py); each test uses a model name of
its own (TANDEM_MODEL_NAME for the CLI), so versions and pointers never leak between tests.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import bentoml
import pytest
import torch

from inference.model import CONFIG_FILE, WEIGHTS_FILE, LoadedModel, TrainingReport, save_model
from inference.spec import DEFAULT_SPEC_PATH, EntityKey, LoadedSpec, load_spec, schema_digest
from tandem import modelstore
from tandem.cli import main
from tests.inference.support import TINY_MODEL
from tests.shared import reference_model
from tests.specs.tiny import TinyModel

TINY_PATH = "tests.specs.tiny:SPEC"


def tiny() -> LoadedSpec:
    return load_spec(TINY_PATH)


def seeded_reference(seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    return reference_model(TINY_MODEL)


def register_reference(name: str, seed: int = 0) -> str:
    model = seeded_reference(seed)
    report = TrainingReport(0.5, 10, 5, 1, model.parameter_count, None)
    return modelstore.register(model, report, name=name, code_version="test")


def tiny_folder(directory: Path, seed: int = 0) -> Path:
    """A model trained elsewhere with the tiny spec, saved as save_model writes a folder."""
    torch.manual_seed(seed)
    directory.mkdir(parents=True)
    torch.save(TinyModel({"history_length": 2}).state_dict(), directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps({"history_length": 2}))
    return directory


def register_tiny(name: str, tmp_path: Path) -> str:
    """A version of `name` trained with the tiny spec: what a store holds after the spec changed."""
    return modelstore.register_dir(tiny_folder(tmp_path / "tiny"), name=name, code_version="test", spec=tiny())


def register_legacy(name: str) -> str:
    """A version as register wrote it before versions recorded their spec."""
    model = seeded_reference()
    with bentoml.models.create(
        name, labels=modelstore.MODEL_LABELS, metadata={"auc": 0.5, "code_version": "old"}
    ) as stored:
        save_model(model, Path(stored.path))
    return str(stored.tag)


def mismatch(tag: str) -> str:
    reference = load_spec()
    return (
        f"{tag} was trained with spec {TINY_PATH} (digest {tiny().digest}), not {DEFAULT_SPEC_PATH} "
        f"(digest {reference.digest}), the spec Tandem runs; promote a version trained with {DEFAULT_SPEC_PATH}"
    )


@pytest.fixture
def name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"risk_spec_{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("TANDEM_MODEL_NAME", name)
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return name


def test_the_legacy_digest_is_the_references_digest_today() -> None:
    """When the reference's digest changes, this fails: LEGACY_SPEC_DIGEST stays as it is (versions
    registered before specs were trained with the old reference and must be refused), and this
    test changes to say so."""
    assert load_spec().digest == modelstore.LEGACY_SPEC_DIGEST


def test_a_version_records_the_spec_it_was_trained_with(name: str) -> None:
    tag = register_reference(name)
    metadata = bentoml.models.get(tag).info.metadata
    reference = load_spec()
    assert {key: metadata[key] for key in ("spec", "spec_name", "spec_digest", "history_length")} == {
        "spec": DEFAULT_SPEC_PATH,
        "spec_name": "transactions",
        "spec_digest": reference.digest,
        "history_length": TINY_MODEL.history_length,
    }
    assert modelstore.trained_with(tag) == modelstore.TrainedWith(DEFAULT_SPEC_PATH, reference.digest)
    assert modelstore.check_spec(tag) == tag


def test_another_specs_version_is_refused_by_promote_challenge_and_every_load(name: str, tmp_path: Path) -> None:
    champion = register_reference(name)
    modelstore.promote(champion)
    foreign = register_tiny(name, tmp_path)
    line = mismatch(foreign)
    for move in (modelstore.promote, modelstore.challenge, modelstore.load, modelstore.model_config):
        with pytest.raises(modelstore.SpecMismatch) as refused:
            move(foreign)
        assert str(refused.value) == line
    assert isinstance(refused.value, ValueError)
    assert (modelstore.production_tag(name), modelstore.challenger_tag(name)) == (champion, None)
    # Under its own spec it is a version like any other.
    assert modelstore.check_spec(foreign, tiny()) == foreign
    assert modelstore.challenge(foreign, tiny()) == foreign


def test_production_of_another_spec_is_refused_at_load_and_rollback(name: str, tmp_path: Path) -> None:
    foreign = register_tiny(name, tmp_path)
    modelstore.promote(foreign, tiny())
    with pytest.raises(modelstore.SpecMismatch, match=f"^{re.escape(mismatch(foreign))}$"):
        modelstore.load_production(name)
    current = register_reference(name)
    modelstore.promote(current)
    with pytest.raises(modelstore.SpecMismatch):
        modelstore.rollback(name)
    assert modelstore.production_tag(name) == current


@pytest.mark.parametrize("action", ["promote", "challenge"])
def test_the_cli_refuses_another_specs_version_in_one_line(
    action: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    champion = register_reference(name)
    modelstore.promote(champion)
    foreign = register_tiny(name, tmp_path)
    assert main(["models", action, foreign]) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"tandem: {mismatch(foreign)}\n")
    assert (modelstore.production_tag(name), modelstore.challenger_tag(name)) == (champion, None)


def test_a_legacy_version_is_read_as_the_reference(name: str) -> None:
    legacy = register_legacy(name)
    assert modelstore.trained_with(legacy) == modelstore.TrainedWith(DEFAULT_SPEC_PATH, modelstore.LEGACY_SPEC_DIGEST)
    modelstore.promote(legacy)
    model, tag = modelstore.load_production(name)
    assert tag == legacy and model.config == dataclasses.asdict(TINY_MODEL)
    assert modelstore.model_config(legacy) == dataclasses.asdict(TINY_MODEL)
    challenger = register_legacy(name)
    assert modelstore.challenge(challenger) == challenger


def test_a_legacy_version_is_refused_under_another_spec(name: str) -> None:
    legacy = register_legacy(name)
    with pytest.raises(modelstore.SpecMismatch, match=f"trained with spec {DEFAULT_SPEC_PATH} "):
        modelstore.promote(legacy, tiny())


def test_register_dir_round_trip_through_the_cli(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = seeded_reference(seed=3)
    save_model(model, tmp_path / "elsewhere")
    assert main(["models", "register", str(tmp_path / "elsewhere"), "--promote"]) == 0
    tag, promoted = capsys.readouterr().out.splitlines()
    assert tag.startswith(f"{name}:") and promoted == f"production -> {tag}"
    assert modelstore.production_tag(name) == tag
    metadata = bentoml.models.get(tag).info.metadata
    assert metadata["spec_digest"] == load_spec().digest and metadata["history_length"] == TINY_MODEL.history_length
    assert "auc" not in metadata
    loaded = modelstore.load(tag)
    assert loaded.config == model.config
    assert all(torch.equal(value, loaded.module.state_dict()[key]) for key, value in model.module.state_dict().items())
    assert main(["models", "list"]) == 0
    assert f"* {tag}" in capsys.readouterr().out


def test_register_dir_without_promote_leaves_production(name: str, tmp_path: Path) -> None:
    champion = register_reference(name)
    modelstore.promote(champion)
    save_model(seeded_reference(seed=4), tmp_path / "elsewhere")
    assert main(["models", "register", str(tmp_path / "elsewhere")]) == 0
    assert modelstore.production_tag(name) == champion
    assert len(modelstore.versions(name)) == 2


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(directory / WEIGHTS_FILE, weights_only=True)
    return loaded


def _without(directory: Path, key: str, **added: torch.Tensor) -> None:
    state = torch.load(directory / WEIGHTS_FILE, weights_only=True)
    torch.save({**added, **{k: v for k, v in state.items() if k != key}}, directory / WEIGHTS_FILE)


def _shorter(directory: Path, key: str) -> None:
    state = torch.load(directory / WEIGHTS_FILE, weights_only=True)
    torch.save({**state, key: state[key][:-1]}, directory / WEIGHTS_FILE)


# How a saved reference folder is spoiled, and the start of the line that refuses it.
REFUSALS: dict[str, tuple[Callable[[Path], object], str]] = {
    "missing folder": (lambda d: d.rename(d.with_name("gone")), "{d} is not a folder"),
    "missing weights": (lambda d: (d / WEIGHTS_FILE).unlink(), "{d} has no weights.pt"),
    "missing config": (lambda d: (d / CONFIG_FILE).unlink(), "{d} has no config.json"),
    "bad json": (
        lambda d: (d / CONFIG_FILE).write_text("{history_length: 8"),
        "{d}/config.json is not JSON (Expecting property name enclosed in double quotes",
    ),
    "json list": (lambda d: (d / CONFIG_FILE).write_text("[8]"), "{d}/config.json holds a JSON list, not an object"),
    "no history_length": (
        lambda d: (d / CONFIG_FILE).write_text(json.dumps({"embedding_dim": 4})),
        '{d}/config.json needs "history_length"',
    ),
    "config the model refuses": (
        lambda d: (d / CONFIG_FILE).write_text(json.dumps({"history_length": 8, "colour": 3})),
        f"{DEFAULT_SPEC_PATH}'s model cannot be built from {{d}}/config.json (TypeError: ",
    ),
    "not a state_dict": (
        lambda d: (d / WEIGHTS_FILE).write_bytes(b"not torch"),
        # torch's own first line advises loading the file unsafely; its reason comes after.
        "{d}/weights.pt is not a saved state_dict (UnpicklingError: not a file of tensors that torch.save wrote "
        "(Unsupported operand 110))",
    ),
    "wrong shape": (
        lambda d: _shorter(d, "head.0.bias"),
        f"{{d}}/weights.pt does not fit {DEFAULT_SPEC_PATH}'s model: head.0.bias is (63,), expected (64,)",
    ),
    "missing and unexpected keys": (
        lambda d: _without(d, "head.0.bias", **{"extra.weight": torch.zeros(2)}),
        f"{{d}}/weights.pt does not fit {DEFAULT_SPEC_PATH}'s model: missing head.0.bias; unexpected extra.weight",
    ),
}


def stored(name: str) -> list[str]:
    return [str(m.tag) for m in bentoml.models.list() if m.tag.name == name]


@pytest.mark.parametrize("how", REFUSALS)
def test_register_dir_refuses_a_bad_folder_in_one_line(
    how: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "elsewhere"
    save_model(seeded_reference(), directory)
    spoil, refusal = REFUSALS[how]
    spoil(directory)
    expected = refusal.format(d=directory)
    assert main(["models", "register", str(directory), "--promote"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"tandem: {expected}") and captured.err.count("\n") == 1, captured.err
    assert stored(name) == [] and modelstore.production_tag(name) is None


def test_register_dir_refuses_another_specs_model(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny-spec folder under the reference: its tensors name none of RiskModel's."""
    directory = tiny_folder(tmp_path / "tiny")
    assert main(["models", "register", str(directory)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tandem: {directory / WEIGHTS_FILE} does not fit {DEFAULT_SPEC_PATH}'s model: missing ")
    assert "; unexpected colour.weight, head.bias, head.weight" in err and err.count("\n") == 1
    assert stored(name) == []


def test_register_dir_refuses_history_without_an_entity(name: str, tmp_path: Path) -> None:
    spec = dataclasses.replace(
        tiny().spec, fields=tuple(f for f in tiny().spec.fields if not isinstance(f, EntityKey)), history_length=0
    )
    entityless = LoadedSpec(path="tests.specs.tiny:ENTITYLESS", spec=spec, digest=schema_digest(spec))
    directory = tiny_folder(tmp_path / "tiny")
    with pytest.raises(ValueError, match=r"has history_length 2, and tests\.specs\.tiny:ENTITYLESS has no entity"):
        modelstore.register_dir(directory, name=name, code_version="test", spec=entityless)
    (directory / CONFIG_FILE).write_text(json.dumps({"history_length": 0}))
    assert modelstore.register_dir(directory, name=name, code_version="test", spec=entityless).startswith(f"{name}:")
