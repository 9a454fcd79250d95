"""A spec's model, whatever it is: built from its config, saved, loaded, trained and run.

A saved model is two files, `weights.pt` (the state_dict) and `config.json` (the config the spec's
`model` hook builds it from, with `history_length`): loadable without pickled code, unlike a
whole-module save.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn

from inference.features import FeatureBatch
from inference.spec import LoadedSpec

WEIGHTS_FILE = "weights.pt"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class LoadedModel:
    """A module of a spec's model and the config it was built from."""

    module: nn.Module
    config: Mapping[str, Any] = field(hash=False)

    @property
    def history_length(self) -> int:
        """K, the history records each target reads: the one the model was trained with. Scoring
        with another K changes every score silently, so no caller can choose it."""
        return int(self.config["history_length"])

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def build_model(spec: LoadedSpec, config: Mapping[str, Any]) -> LoadedModel:
    """A new, untrained model of `spec` from `config` (which holds `history_length`)."""
    if not isinstance(config.get("history_length"), int):
        raise ValueError(f'a model config needs "history_length", a whole number: {dict(config)!r}')
    return LoadedModel(spec.spec.model(config), dict(config))


def default_model(spec: LoadedSpec) -> LoadedModel:
    """A new, untrained model of `spec` with its default config at the spec's K."""
    return build_model(spec, spec.spec.model_config(spec.spec.history_length))


def untrained_report(model: LoadedModel) -> TrainingReport:
    """The report of a model registered without training (benchmarks, tests): AUC unknown."""
    flops = getattr(model.module, "flops_per_item", None)
    return TrainingReport(float("nan"), 0, 0, 0, model.parameter_count, int(flops()) if callable(flops) else None)


def score_batch(model: LoadedModel, features: FeatureBatch) -> np.ndarray:
    """Probabilities (float64) for a batch; raises if the forward pass fails."""
    with torch.inference_mode():
        logits = model.module(*features.tensors())
        return torch.sigmoid(logits).double().numpy()


def save_model(model: LoadedModel, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.module.state_dict(), directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(dict(model.config), sort_keys=True))


class IncompatibleModelError(ValueError):
    """A stored model whose tensors do not fit the spec's model (another vocabulary, another layout)."""


def read_config(directory: Path) -> dict[str, Any]:
    """A saved model's config (its history_length among them), without reading its weights."""
    config: dict[str, Any] = json.loads((directory / CONFIG_FILE).read_text())
    return config


def load_model(directory: Path, spec: LoadedSpec) -> LoadedModel:
    """A saved model, built by `spec`'s `model` hook from its config, its weights loaded."""
    model = build_model(spec, read_config(directory))
    stored = torch.load(directory / WEIGHTS_FILE, weights_only=True)
    _check_compatible(model.module, stored, directory, spec)
    model.module.load_state_dict(stored)
    model.module.eval()
    return model


def state_dict_problems(module: nn.Module, stored: Mapping[str, torch.Tensor]) -> list[str]:
    """What keeps `stored` from loading into `module`: missing and unexpected tensors, then shapes."""
    expected = module.state_dict()
    missing = sorted(expected.keys() - stored.keys())
    unexpected = sorted(stored.keys() - expected.keys())
    problems = [f"missing {_some(missing)}"] if missing else []
    problems += [f"unexpected {_some(unexpected)}"] if unexpected else []
    problems += [
        f"{key} is {tuple(stored[key].shape)}, expected {tuple(tensor.shape)}"
        for key, tensor in expected.items()
        if key in stored and stored[key].shape != tensor.shape
    ]
    return problems


def _some(keys: list[str], shown: int = 5) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _check_compatible(module: nn.Module, stored: dict[str, torch.Tensor], directory: Path, spec: LoadedSpec) -> None:
    """Fail in one line naming the cause, before `load_state_dict`'s multi-line size-mismatch dump.

    An embedding with a different row count means the model was trained on another categorical
    vocabulary (models saved before the unknown bucket have one row fewer per field): its rows
    would mean other values, so it is refused rather than loaded partially.
    """
    problems = state_dict_problems(module, stored)
    if not problems:
        return
    retrain = f"retrain it with this code (the {spec.spec.model_name} asset or `tandem demo`)"
    expected = module.state_dict()
    # Only where every tensor is there: then a row count alone that differs is another vocabulary.
    for name, tensor in expected.items() if expected.keys() == stored.keys() else ():
        found = stored[name].shape
        if "embedding" in name and found[1:] == tensor.shape[1:] and found[0] != tensor.shape[0]:
            raise IncompatibleModelError(
                f"model at {directory} was trained on another categorical vocabulary: {name} has {found[0]} rows, "
                f"this code expects {tensor.shape[0]} (each field's vocabulary plus an 'unknown' bucket); {retrain}"
            )
    raise IncompatibleModelError(
        f"model at {directory} does not fit {spec.path}'s model: {'; '.join(problems)}; {retrain}"
    )


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC as the Mann-Whitney statistic (ties averaged); avoids a scikit-learn dependency."""
    frame = pl.DataFrame({"score": scores, "label": labels.astype(np.int8)})
    positives = int(frame["label"].sum())
    negatives = frame.height - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    rank_sum = frame.select(pl.col("score").rank("average").filter(pl.col("label") == 1).sum()).item()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


@dataclass(frozen=True)
class TrainingReport:
    auc: float
    train_rows: int
    holdout_rows: int
    epochs: int
    parameter_count: int
    flops_per_item: int | None  # a module's own `flops_per_item()`, where it has one


def fit(
    spec: LoadedSpec,
    train: FeatureBatch,
    train_labels: np.ndarray,
    holdout: FeatureBatch,
    holdout_labels: np.ndarray,
    *,
    config: Mapping[str, Any],
    seed: int,
    epochs: int = 2,
    batch_size: int = 512,
    learning_rate: float = 1e-3,
) -> tuple[LoadedModel, TrainingReport]:
    """Train a new model of `spec` on binary labels (Adam, BCE on logits). Deterministic for a given
    seed and thread count: seeded init and a seeded shuffle."""
    torch.manual_seed(seed)
    model = build_model(spec, config)
    optimiser = torch.optim.Adam(model.module.parameters(), lr=learning_rate)
    loss_fn = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(seed)
    labels = torch.from_numpy(train_labels.astype(np.float32))
    model.module.train()
    for _ in range(epochs):
        order = torch.randperm(len(train), generator=generator).numpy()
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            optimiser.zero_grad()
            loss = loss_fn(model.module(*train.take(rows).tensors()), labels[rows])
            loss.backward()
            optimiser.step()
    model.module.eval()
    holdout_scores = (
        np.concatenate([score_batch(model, holdout.slice(s, s + 8192)) for s in range(0, len(holdout), 8192)])
        if len(holdout)
        else np.array([])
    )
    report = dataclasses.replace(
        untrained_report(model),
        auc=auc(holdout_scores, holdout_labels),
        train_rows=len(train),
        holdout_rows=len(holdout),
        epochs=epochs,
    )
    return model, report
