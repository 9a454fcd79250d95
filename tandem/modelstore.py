"""Model versions in the BentoML model store, and the production and challenger pointers beside it.

BentoML's store has versioned tags but no notion of "the version in production", so the pointers
are a small JSON file in BENTOML_HOME, replaced atomically; the production history makes rollback
the same move backwards. The challenger is the version scored beside production (shadowed online,
replayed in batch) until it is promoted or cleared.

Every version records the spec it was trained with (its import path and digest); a version is
never loaded, promoted or challenged under a spec of another digest (`check_spec`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bentoml
import torch

from inference.homes import resolve_homes
from inference.model import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoadedModel,
    TrainingReport,
    load_model,
    read_config,
    save_model,
    state_dict_problems,
)
from inference.spec import DEFAULT_SPEC_PATH, LoadedSpec, configured_spec
from tandem.bentoml_home import bentoml_home

MODEL_LABELS = {"owner": "tandem", "framework": "torch-state-dict"}
# The reference's digest when versions began to record their spec. A version registered before
# then has no spec metadata and was trained with the reference as it was: it is read as that.
# Frozen: once the reference's digest moves on, such versions are refused like another spec's.
LEGACY_SPEC_DIGEST = "2add5f75da48fcdd"


class SpecMismatch(ValueError):
    """A version trained with another spec than the one it would be loaded, promoted or challenged under."""


@dataclass(frozen=True)
class TrainedWith:
    """The spec a version was trained with, as its metadata records it."""

    path: str
    digest: str


def spec_metadata(spec: LoadedSpec, history_length: int) -> dict[str, Any]:
    return {
        "spec": spec.path,
        "spec_name": spec.spec.name,
        "spec_digest": spec.digest,
        "history_length": history_length,
    }


def trained_with(tag: str) -> TrainedWith:
    """A version's spec; one registered before versions recorded theirs is the legacy reference."""
    metadata = bentoml.models.get(tag).info.metadata
    return TrainedWith(
        path=str(metadata.get("spec", DEFAULT_SPEC_PATH)), digest=str(metadata.get("spec_digest", LEGACY_SPEC_DIGEST))
    )


def check_spec(tag: str, spec: LoadedSpec | None = None) -> str:
    """`tag`, resolved, if it was trained with `spec` (default: the configured one); else SpecMismatch.

    The digest decides, not the import path: a spec moved to another module still means the same tensors.
    """
    expected = spec or configured_spec()
    resolved = str(bentoml.models.get(tag).tag)
    found = trained_with(resolved)
    if found.digest != expected.digest:
        raise SpecMismatch(
            f"{resolved} was trained with spec {found.path} (digest {found.digest}), not {expected.path} "
            f"(digest {expected.digest}), the spec Tandem runs; promote a version trained with {expected.path}"
        )
    return resolved


@dataclass(frozen=True)
class ModelVersion:
    tag: str
    metadata: dict[str, Any]
    created_at: str


def register(
    model: LoadedModel, report: TrainingReport, *, name: str, code_version: str, spec: LoadedSpec | None = None
) -> str:
    """Save a model trained with `spec` (default: the configured one) as a new version (state_dict
    + config); returns its tag."""
    with bentoml.models.create(
        name,
        labels=MODEL_LABELS,
        metadata={
            "auc": report.auc,
            "parameter_count": report.parameter_count,
            "train_rows": report.train_rows,
            "holdout_rows": report.holdout_rows,
            "epochs": report.epochs,
            "code_version": code_version,
            **spec_metadata(spec or configured_spec(), model.history_length),
            # BentoML's metadata holds no null: a module without `flops_per_item()` records none.
            **({"flops_per_item": report.flops_per_item} if report.flops_per_item is not None else {}),
        },
    ) as stored:
        save_model(model, Path(stored.path))
    return str(stored.tag)


def register_dir(directory: Path, *, name: str, code_version: str, spec: LoadedSpec | None = None) -> str:
    """Register a model trained elsewhere: a folder with weights.pt and config.json as `save_model`
    writes them, checked by loading it into `spec`'s model (default: the configured spec's)."""
    expected = spec or configured_spec()
    config = _read_folder(directory)
    history_length = config.get("history_length")
    if type(history_length) is not int or history_length < 0:
        raise ValueError(f'{directory / CONFIG_FILE} needs "history_length", a whole number >= 0 (0: no history)')
    if history_length and expected.entity is None:
        raise ValueError(
            f"{directory / CONFIG_FILE} has history_length {history_length}, and {expected.path} has no entity"
        )
    _check_fits(directory, config, expected)
    with bentoml.models.create(
        name,
        labels=MODEL_LABELS,
        metadata={"code_version": code_version, **spec_metadata(expected, history_length)},
    ) as stored:
        for file in (WEIGHTS_FILE, CONFIG_FILE):
            shutil.copyfile(directory / file, Path(stored.path) / file)
    return str(stored.tag)


def _read_folder(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a folder (a model folder holds {WEIGHTS_FILE} and {CONFIG_FILE})")
    for file in (WEIGHTS_FILE, CONFIG_FILE):
        if not (directory / file).is_file():
            raise ValueError(f"{directory} has no {file} (a model folder holds {WEIGHTS_FILE} and {CONFIG_FILE})")
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{directory / CONFIG_FILE} is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{directory / CONFIG_FILE} holds a JSON {type(config).__name__}, not an object")
    return config


def _check_fits(directory: Path, config: dict[str, Any], spec: LoadedSpec) -> None:
    """One line naming what does not fit, before torch's multi-line load_state_dict report."""
    try:
        module = spec.spec.model(config)
    except Exception as error:  # noqa: BLE001 - any failure of a team's hook on this config is the config's problem
        raise ValueError(
            f"{spec.path}'s model cannot be built from {directory / CONFIG_FILE} ({type(error).__name__}: {error})"
        ) from None
    try:
        stored = torch.load(directory / WEIGHTS_FILE, weights_only=True)
    except Exception as error:  # noqa: BLE001 - a corrupt or foreign file: torch raises many kinds
        raise ValueError(
            f"{directory / WEIGHTS_FILE} is not a saved state_dict ({type(error).__name__}: {_load_reason(error)})"
        ) from None
    if not isinstance(stored, dict) or not all(isinstance(t, torch.Tensor) for t in stored.values()):
        raise ValueError(f"{directory / WEIGHTS_FILE} is not a state_dict (a dict of tensor names to tensors)")
    problems = state_dict_problems(module, stored)
    if problems:
        raise ValueError(f"{directory / WEIGHTS_FILE} does not fit {spec.path}'s model: {'; '.join(problems)}")


def _load_reason(error: Exception) -> str:
    """torch's reason in one line. A refused weights-only load leads with advice to load the file
    unsafely, which a registry of other teams' files must not give; its reason follows the marker."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().splitlines()[0]
        return f"not a file of tensors that torch.save wrote ({reason})"
    return (text.strip().splitlines() or [""])[0]


def load(tag: str, spec: LoadedSpec | None = None) -> LoadedModel:
    """A version, built by `spec`'s model hook (default: the configured spec) and its weights loaded."""
    expected = spec or configured_spec()
    return load_model(Path(bentoml.models.get(check_spec(tag, expected)).path), expected)


def model_config(tag: str, spec: LoadedSpec | None = None) -> dict[str, Any]:
    """A stored version's config, without loading its weights: cheap enough for a sensor tick."""
    return read_config(Path(bentoml.models.get(check_spec(tag, spec)).path))


def versions(name: str) -> list[ModelVersion]:
    """Every stored version of `name`, oldest first; none when nothing of that name was stored yet."""
    try:
        stored = bentoml.models.list(name)
    except bentoml.exceptions.NotFound:
        return []
    found = [ModelVersion(str(m.tag), dict(m.info.metadata), m.info.creation_time.isoformat()) for m in stored]
    return sorted(found, key=lambda v: v.created_at)


def _pointer_file(name: str) -> Path:
    return bentoml_home() / "tandem" / f"{name}.production.json"


def _read_pointer(name: str) -> dict[str, Any]:
    path = _pointer_file(name)
    if not path.exists():
        return {"current": None, "previous": [], "challenger": None}
    return {"challenger": None, **json.loads(path.read_text())}


def _write_pointer(name: str, pointer: dict[str, Any]) -> None:
    path = _pointer_file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".pointer-")
    with os.fdopen(handle, "w") as stream:
        json.dump(pointer, stream)
    # Atomic on POSIX: a reader sees the old pointer or the new one, never a torn file.
    os.replace(temporary, path)


def production_tag(name: str) -> str | None:
    current = _read_pointer(name)["current"]
    return str(current) if current else None


def promote(tag: str, spec: LoadedSpec | None = None) -> None:
    """Make `tag` the production version (it must exist in the store and be trained with `spec`,
    default: the configured one); a promoted challenger leaves the challenger slot."""
    resolved = check_spec(tag, spec)
    name = resolved.split(":", 1)[0]
    pointer = _read_pointer(name)
    challenger = None if pointer["challenger"] == resolved else pointer["challenger"]
    if pointer["current"] == resolved and challenger == pointer["challenger"]:
        return
    previous = list(pointer["previous"])
    if pointer["current"] and pointer["current"] != resolved:
        previous.append(pointer["current"])
    _write_pointer(name, {"current": resolved, "previous": previous, "challenger": challenger})


def challenger_tag(name: str) -> str | None:
    challenger = _read_pointer(name)["challenger"]
    return str(challenger) if challenger else None


def challenge(tag: str, spec: LoadedSpec | None = None) -> str:
    """Make `tag` the challenger (it must exist in the store, be trained with `spec`, default: the
    configured one, and not be in production); returns it."""
    resolved = check_spec(tag, spec)
    name = resolved.split(":", 1)[0]
    pointer = _read_pointer(name)
    if pointer["current"] == resolved:
        raise ValueError(f"{resolved} is in production already; a challenger is another version")
    _write_pointer(name, {**pointer, "challenger": resolved})
    return resolved


def clear_challenger(name: str) -> str | None:
    """Empty the challenger slot; returns the version that was in it."""
    pointer = _read_pointer(name)
    if pointer["challenger"] is not None:
        _write_pointer(name, {**pointer, "challenger": None})
    return str(pointer["challenger"]) if pointer["challenger"] else None


def rollback(name: str, spec: LoadedSpec | None = None) -> str:
    """Point production back at the version promoted before the current one (it must be trained
    with `spec`, default: the configured one); returns it."""
    pointer = _read_pointer(name)
    previous = list(pointer["previous"])
    if not previous:
        raise LookupError(f"{name} has no earlier production version to roll back to")
    restored = previous.pop()
    check_spec(restored, spec)
    challenger = None if pointer["challenger"] == restored else pointer["challenger"]
    _write_pointer(name, {"current": restored, "previous": previous, "challenger": challenger})
    return str(restored)


def load_production(name: str, spec: LoadedSpec | None = None) -> tuple[LoadedModel, str]:
    tag = production_tag(name)
    if tag is None:
        raise LookupError(missing_production(name))
    return load(tag, spec), tag


def missing_production(name: str) -> str:
    """Why there is no production version: which store was looked in, and where that came from
    (a `dagster` or `tandem` command with another BENTOML_HOME than `make run` finds none)."""
    looked_in = bentoml_home()
    return (
        f"no production version of {name!r} in {resolve_homes().model_store_hint(looked_in)}: "
        f"`make run`, `tandem demo` or the {configured_spec().spec.model_name} asset trains and promotes one there"
    )


def foreign_store() -> str | None:
    """Why the store BentoML opened is not Tandem's, or None: BentoML read its home before Tandem set
    the default (a plain `bentoml serve`), and serving whatever that other store holds would answer
    with a model no Tandem command trained or promoted."""
    opened, expected = bentoml_home().expanduser().resolve(), resolve_homes().bentoml_home.expanduser().resolve()
    if opened == expected:
        return None
    return f"BentoML opened the model store at {opened}, not Tandem's at {expected}: export BENTOML_HOME={expected}"
