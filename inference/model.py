"""The risk model: embeddings for categoricals, an encoder over the account history, an MLP head.

It is deliberately wide (about 2M parameters, about 6 MFLOP per item) so that, on a CPU, scoring
one item at a time is bound by reading weights and batching pays several times over; that is
the property both serving paths are designed around.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import polars as pl
import torch
from torch import nn

from inference.features import FeatureBatch
from inference.spec import load_spec

WEIGHTS_FILE = "weights.pt"
# The widths of the reference spec's numeric inputs (tandem_specs/transactions/features.py).
CURRENT_NUMERIC_WIDTH = 8
HISTORY_NUMERIC_WIDTH = 4


def embedding_sizes() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the current record's, the history items') embedding rows, from the reference spec's
    vocabularies: each vocabulary plus its unknown bucket (history items: plus the empty slot);
    the current record also embeds its hour and weekday."""
    size = {field.name: len(field.vocabulary) + 1 for field in load_spec().categoricals}
    current = (size["currency"], size["merchant_category"], size["country"], 24, 7)
    return current, (size["merchant_category"] + 1, size["country"] + 1)


CONFIG_FILE = "config.json"
_Module = TypeVar("_Module", bound=nn.Module)


@dataclass(frozen=True)
class ModelConfig:
    history_length: int = 16
    embedding_dim: int = 16
    history_dim: int = 256
    hidden_dim: int = 1024
    head_tail_dim: int = 256


class RiskModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        e = config.embedding_dim
        current_sizes, history_sizes = embedding_sizes()
        self.current_embeddings = nn.ModuleList(nn.Embedding(size, e) for size in current_sizes)
        self.current_numeric = nn.Sequential(nn.Linear(CURRENT_NUMERIC_WIDTH, 4 * e), nn.ReLU())
        self.history_embeddings = nn.ModuleList(nn.Embedding(size, e, padding_idx=0) for size in history_sizes)
        item_width = e * len(history_sizes) + HISTORY_NUMERIC_WIDTH
        self.history_encoder = nn.Sequential(
            nn.Linear(item_width, config.history_dim),
            nn.ReLU(),
            nn.Linear(config.history_dim, config.history_dim),
            nn.ReLU(),
        )
        head_width = e * len(current_sizes) + 4 * e + 2 * config.history_dim
        self.head = nn.Sequential(
            nn.Linear(head_width, config.hidden_dim),
            nn.ReLU(),
            nn.Linear(config.hidden_dim, config.hidden_dim),
            nn.ReLU(),
            nn.Linear(config.hidden_dim, config.head_tail_dim),
            nn.ReLU(),
            nn.Linear(config.head_tail_dim, 1),
        )

    def forward(
        self,
        current_categorical: torch.Tensor,
        current_numeric: torch.Tensor,
        history_categorical: torch.Tensor,
        history_numeric: torch.Tensor,
        history_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Logits, one per item."""
        current = torch.cat(
            [emb(current_categorical[:, i]) for i, emb in enumerate(self.current_embeddings)]
            + [self.current_numeric(current_numeric)],
            dim=1,
        )
        items = torch.cat(
            [emb(history_categorical[:, :, i]) for i, emb in enumerate(self.history_embeddings)] + [history_numeric],
            dim=2,
        )
        encoded = self.history_encoder(items)
        mask = history_mask.unsqueeze(-1)
        count = mask.sum(dim=1).clamp(min=1)
        mean = (encoded * mask).sum(dim=1) / count
        # Encoded items are post-ReLU (>= 0), so zeroing padded slots leaves the max unchanged.
        peak = (encoded * mask).amax(dim=1)
        return self.head(torch.cat([current, mean, peak], dim=1)).squeeze(1)

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_item(self) -> int:
        """Multiply-adds x 2 of the dense layers; embeddings and pooling are negligible."""
        k = self.config.history_length
        history = sum(2 * m.in_features * m.out_features for m in self.history_encoder if isinstance(m, nn.Linear))
        dense = sum(2 * m.in_features * m.out_features for m in self.head if isinstance(m, nn.Linear))
        numeric = sum(2 * m.in_features * m.out_features for m in self.current_numeric if isinstance(m, nn.Linear))
        return k * history + dense + numeric


def score_batch(model: RiskModel, features: FeatureBatch) -> np.ndarray:
    """Probabilities (float64) for a batch; raises if the forward pass fails."""
    with torch.inference_mode():
        logits = model(*features.tensors())
        return torch.sigmoid(logits).double().numpy()


def save_model(model: RiskModel, directory: Path) -> None:
    """state_dict + config: loadable without pickled code, unlike a whole-module save."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(model.config), sort_keys=True))


class IncompatibleModelError(ValueError):
    """A stored model whose tensors do not fit this code's model (another vocabulary, another layout)."""


def read_config(directory: Path) -> ModelConfig:
    """A saved model's config (its history_length among them), without reading its weights."""
    return ModelConfig(**json.loads((directory / CONFIG_FILE).read_text()))


def load_model(directory: Path) -> RiskModel:
    return _load_weights(RiskModel(read_config(directory)), directory)


def load_module(directory: Path, build: Callable[[Mapping[str, Any]], nn.Module]) -> nn.Module:
    """A saved model built by `build` (a spec's `model` hook) from its config.json, weights loaded."""
    return _load_weights(build(json.loads((directory / CONFIG_FILE).read_text())), directory)


def _load_weights(model: _Module, directory: Path) -> _Module:
    stored = torch.load(directory / WEIGHTS_FILE, weights_only=True)
    _check_compatible(model, stored, directory)
    model.load_state_dict(stored)
    model.eval()
    return model


def _check_compatible(model: nn.Module, stored: dict[str, torch.Tensor], directory: Path) -> None:
    """Fail in one line naming the cause, before `load_state_dict`'s multi-line size-mismatch dump.

    An embedding with a different row count means the model was trained on another categorical
    vocabulary (models saved before the unknown bucket have one row fewer per field): its rows
    would mean other values, so it is refused rather than loaded partially.
    """
    expected = model.state_dict()
    missing = sorted(expected.keys() - stored.keys())
    unexpected = sorted(stored.keys() - expected.keys())
    if missing or unexpected:
        raise IncompatibleModelError(
            f"model at {directory} has another layout (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "retrain it with this code (the risk_model asset or `tandem demo`)"
        )
    for name, tensor in expected.items():
        found = tuple(stored[name].shape)
        if found == tuple(tensor.shape):
            continue
        if "embeddings" in name:
            raise IncompatibleModelError(
                f"model at {directory} was trained on another categorical vocabulary: {name} has {found[0]} rows, "
                f"this code expects {tensor.shape[0]} (each field's vocabulary plus an 'unknown' bucket); "
                "retrain it with this code (the risk_model asset or `tandem demo`)"
            )
        raise IncompatibleModelError(
            f"model at {directory} does not fit this code: {name} is {found}, expected {tuple(tensor.shape)}; "
            "retrain it with this code (the risk_model asset or `tandem demo`)"
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
    flops_per_item: int


def train_model(
    train: FeatureBatch,
    train_labels: np.ndarray,
    holdout: FeatureBatch,
    holdout_labels: np.ndarray,
    *,
    config: ModelConfig,
    seed: int,
    epochs: int = 2,
    batch_size: int = 512,
    learning_rate: float = 1e-3,
) -> tuple[RiskModel, TrainingReport]:
    """Deterministic for a given seed and thread count: seeded init and a seeded shuffle."""
    torch.manual_seed(seed)
    model = RiskModel(config)
    optimiser = torch.optim.Adam(model.parameters(), lr=learning_rate)
    loss_fn = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(seed)
    labels = torch.from_numpy(train_labels.astype(np.float32))
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(train), generator=generator).numpy()
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            optimiser.zero_grad()
            loss = loss_fn(model(*train.take(rows).tensors()), labels[rows])
            loss.backward()
            optimiser.step()
    model.eval()
    holdout_scores = (
        np.concatenate([score_batch(model, holdout.slice(s, s + 8192)) for s in range(0, len(holdout), 8192)])
        if len(holdout)
        else np.array([])
    )
    report = TrainingReport(
        auc=auc(holdout_scores, holdout_labels),
        train_rows=len(train),
        holdout_rows=len(holdout),
        epochs=epochs,
        parameter_count=model.parameter_count,
        flops_per_item=model.flops_per_item(),
    )
    return model, report
