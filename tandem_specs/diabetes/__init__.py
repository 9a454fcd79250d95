"""A second spec of another shape: diabetes progression, one record per patient visit, no history.

Real data that ships with scikit-learn (`load_diabetes`, 442 patients), spread over demo days by
an event time assigned here. `TANDEM_MODEL_SPEC=tandem_specs.diabetes:SPEC`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn

from inference.spec import (
    Categorical,
    DemoSettings,
    EventTime,
    Label,
    LoadedSpec,
    ModelSpec,
    Numeric,
    RecordId,
    Timeline,
)

# The measurements, with the mean and standard deviation of the 442 patients (frozen: a model's
# inputs must not move when the data it is scored on does).
MEASUREMENTS: dict[str, tuple[float, float]] = {
    "age": (48.5181, 13.0942),
    "bmi": (26.3758, 4.4131),
    "bp": (94.647, 13.8156),
    "s1": (189.1403, 34.5689),
    "s2": (115.4391, 30.3787),
    "s3": (49.7885, 12.9196),
    "s4": (4.0702, 1.289),
    "s5": (4.6414, 0.5218),
    "s6": (91.2602, 11.4833),
}
SEXES = ("1", "2")
HIDDEN = 32


def encode() -> dict[str, pl.Expr]:
    return {f"{name}_z": (pl.col(name) - mean) * (1.0 / std) for name, (mean, std) in MEASUREMENTS.items()}


def features(timeline: Timeline) -> tuple[np.ndarray, ...]:
    """(sex index int64 [N], standardised measurements float32 [N, 9])."""
    rows = timeline.rows
    measured = np.stack([timeline.column(f"{name}_z")[rows] for name in MEASUREMENTS], axis=1)
    return timeline.column("sex_idx")[rows].astype(np.int64), measured.astype(np.float32)


class ProgressionModel(nn.Module):
    """An embedding of sex (with its unknown bucket) beside the measurements, one hidden layer."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.sex = nn.Embedding(len(SEXES) + 1, 4)
        self.hidden = nn.Sequential(nn.Linear(4 + len(MEASUREMENTS), int(config.get("hidden", HIDDEN))), nn.ReLU())
        self.out = nn.Linear(int(config.get("hidden", HIDDEN)), 1)

    def forward(self, sex_idx: torch.Tensor, measured: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(torch.cat([self.sex(sex_idx), measured], dim=1))).squeeze(1)


def model_config(history_length: int) -> dict[str, Any]:
    return {"history_length": history_length, "hidden": HIDDEN}


def example() -> dict[str, Any]:
    return {
        "patient_id": "patient-0000",
        "age": 59.0,
        "sex": "2",
        "bmi": 32.1,
        "bp": 101.0,
        "s1": 157.0,
        "s2": 93.2,
        "s3": 38.0,
        "s4": 4.0,
        "s5": 4.8598,
        "s6": 87.0,
        "visit_time": "2026-11-01T08:00:00Z",
    }


def demo(ls: LoadedSpec, day: date, settings: DemoSettings) -> pl.DataFrame:
    """The demo hook (`data.demo`), imported when called: the data comes from scikit-learn, which
    only the demo needs."""
    from tandem_specs.diabetes.data import demo as landed

    return landed(ls, day, settings)


SPEC = ModelSpec(
    name="patients",
    model_name="progression_model",
    version="1",
    fields=(
        RecordId("patient_id"),
        Numeric("age", minimum=0.0, maximum=120.0),
        Categorical("sex", vocabulary=SEXES, pattern=r"^[0-9]$", max_length=1),
        *(Numeric(name, minimum=0.0) for name in MEASUREMENTS if name != "age"),
        EventTime("visit_time"),
    ),
    history_length=0,
    encode=encode,
    features=features,
    model=ProgressionModel,
    model_config=model_config,
    example=example,
    label=Label("progressed"),
    demo=demo,
    # 442 patients: about 60 steps of 64 per epoch's worth of data, not two of 512.
    train_epochs=60,
    train_batch_size=64,
    plural="patients",
    record_name="Patient",
    title="Tandem diabetes progression scorer",
    score_description="Probability of progression a year on (above 140) in [0, 1].",
    description="Scores a patient visit for disease progression a year on (above 140 on the diabetes "
    "dataset's scale), from its ten baseline measurements.",
)
