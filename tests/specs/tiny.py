"""A small spec of another shape, for tests: an entity with K = 2, one numeric, one categorical
and one rule of its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn

from inference.spec import Categorical, EntityKey, EventTime, ModelSpec, Numeric, RecordId, RecordRule, Timeline

COLOURS = ("red", "green", "blue")


class TinyModel(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.history_length = int(config["history_length"])
        self.colour = nn.Embedding(len(COLOURS) + 1, 2)
        self.head = nn.Linear(3, 1)

    def forward(self, colour_idx: torch.Tensor, reading: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.colour(colour_idx), reading[:, None]], dim=1)).squeeze(1)


def encode() -> dict[str, pl.Expr]:
    return {"level_scaled": pl.col("level") * 0.01}


def features(timeline: Timeline) -> tuple[np.ndarray, ...]:
    """(colour index [N], the level beside the mean of the sensor's last K levels [N])."""
    level = timeline.column("level_scaled")
    earlier = np.where(timeline.valid, level[timeline.source], 0.0).sum(axis=1) / np.maximum(
        timeline.valid.sum(axis=1), 1
    )
    return (
        timeline.column("colour_idx")[timeline.rows].astype(np.int64),
        (level[timeline.rows] - earlier).astype(np.float32),
    )


SPEC = ModelSpec(
    name="readings",
    model_name="reading_model",
    version="1",
    fields=(
        RecordId("reading_id"),
        EntityKey("sensor_id"),
        Numeric("level", minimum=0.0, maximum=100.0),
        Categorical("colour", vocabulary=COLOURS, pattern=r"^[a-z]{1,16}$"),
        EventTime("taken_at"),
    ),
    history_length=2,
    encode=encode,
    features=features,
    model=TinyModel,
    model_config=lambda k: {"history_length": k},
    example=lambda: {
        "reading_id": "r-1",
        "sensor_id": "s-1",
        "level": 12.5,
        "colour": "red",
        "taken_at": "2026-11-01T08:00:00Z",
    },
    rules=(RecordRule("level_on_red", "level", lambda: (pl.col("colour") == "red") & (pl.col("level") > 90)),),
    plural="readings",
    record_name="Reading",
)
