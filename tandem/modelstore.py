"""Model versions in the BentoML model store, and the production and challenger pointers beside it.

BentoML's store has versioned tags but no notion of "the version in production", so the pointers
are a small JSON file in BENTOML_HOME, replaced atomically; the production history makes rollback
the same move backwards. The challenger is the version scored beside production (shadowed online,
replayed in batch) until it is promoted or cleared.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bentoml

from inference.homes import resolve_homes
from inference.model import ModelConfig, RiskModel, TrainingReport, load_model, read_config, save_model
from tandem.bentoml_home import bentoml_home

MODEL_LABELS = {"owner": "tandem", "framework": "torch-state-dict"}


@dataclass(frozen=True)
class ModelVersion:
    tag: str
    metadata: dict[str, Any]
    created_at: str


def register(model: RiskModel, report: TrainingReport, *, name: str, code_version: str) -> str:
    """Save a trained model as a new version (state_dict + config); returns its tag."""
    with bentoml.models.create(
        name,
        labels=MODEL_LABELS,
        metadata={
            "auc": report.auc,
            "parameter_count": report.parameter_count,
            "flops_per_item": report.flops_per_item,
            "train_rows": report.train_rows,
            "holdout_rows": report.holdout_rows,
            "epochs": report.epochs,
            "code_version": code_version,
        },
    ) as stored:
        save_model(model, Path(stored.path))
    return str(stored.tag)


def load(tag: str) -> RiskModel:
    return load_model(Path(bentoml.models.get(tag).path))


def model_config(tag: str) -> ModelConfig:
    """A stored version's config, without loading its weights: cheap enough for a sensor tick."""
    return read_config(Path(bentoml.models.get(tag).path))


def versions(name: str) -> list[ModelVersion]:
    found = [
        ModelVersion(str(m.tag), dict(m.info.metadata), m.info.creation_time.isoformat())
        for m in bentoml.models.list(name)
    ]
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


def promote(tag: str) -> None:
    """Make `tag` the production version (it must exist in the store); a promoted challenger
    leaves the challenger slot."""
    resolved = str(bentoml.models.get(tag).tag)
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


def challenge(tag: str) -> str:
    """Make `tag` the challenger (it must exist in the store, and not be in production); returns it."""
    resolved = str(bentoml.models.get(tag).tag)
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


def rollback(name: str) -> str:
    """Point production back at the version promoted before the current one; returns it."""
    pointer = _read_pointer(name)
    previous = list(pointer["previous"])
    if not previous:
        raise LookupError(f"{name} has no earlier production version to roll back to")
    restored = previous.pop()
    challenger = None if pointer["challenger"] == restored else pointer["challenger"]
    _write_pointer(name, {"current": restored, "previous": previous, "challenger": challenger})
    return str(restored)


def load_production(name: str) -> tuple[RiskModel, str]:
    tag = production_tag(name)
    if tag is None:
        raise LookupError(missing_production(name))
    return load(tag), tag


def missing_production(name: str) -> str:
    """Why there is no production version: which store was looked in, and where that came from
    (a `dagster` or `tandem` command with another BENTOML_HOME than `make run` finds none)."""
    looked_in = bentoml_home()
    return (
        f"no production version of {name!r} in {resolve_homes().model_store_hint(looked_in)}: "
        "`make run`, `tandem demo` or the risk_model asset trains and promotes one there"
    )


def foreign_store() -> str | None:
    """Why the store BentoML opened is not Tandem's, or None: BentoML read its home before Tandem set
    the default (a plain `bentoml serve`), and serving whatever that other store holds would answer
    with a model no Tandem command trained or promoted."""
    opened, expected = bentoml_home().expanduser().resolve(), resolve_homes().bentoml_home.expanduser().resolve()
    if opened == expected:
        return None
    return f"BentoML opened the model store at {opened}, not Tandem's at {expected}: export BENTOML_HOME={expected}"
