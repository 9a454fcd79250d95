"""`ModelSpec`: what a team declares to run its model on both paths (docs/spec.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
from torch import nn

from inference.spec.demo import DemoHook
from inference.spec.fields import Field, Label, RecordRule
from inference.spec.timeline import Timeline


@dataclass(frozen=True)
class ModelSpec:
    """One model's records and the model that scores them.

    `fields` are in column order (also the input hash's order): exactly one `RecordId`, at most
    one `EntityKey` (required when `history_length` > 0), exactly one `EventTime`, and any
    `Numeric` and `Categorical` fields.
    """

    # The records asset and the name a database belongs to ("transactions").
    name: str
    # The BentoML model name and the training asset ("risk_model").
    model_name: str
    # Bumped when the meaning of the model's inputs changes; part of the schema digest.
    version: str
    fields: tuple[Field, ...]
    # K for newly trained models: earlier records of the entity each record reads (0: none).
    history_length: int
    # Extra timeline columns, as polars expressions over the fields and `event_ts`, computed in the
    # one query that builds the timeline (per-row work belongs here, not in `features`).
    encode: Callable[[], Mapping[str, pl.Expr]]
    # The timeline's targets -> the model's inputs: arrays with N rows, in forward's argument order.
    features: Callable[[Timeline], tuple[np.ndarray, ...]]
    # config -> module: the model to load weights into or to train; forward(*arrays) returns one
    # logit per item.
    model: Callable[[Mapping[str, Any]], nn.Module]
    # K -> the default config for a new model, holding "history_length".
    model_config: Callable[[int], dict[str, Any]]
    # A valid record as a request sends it: for the API documents, warm-up and curl.
    example: Callable[[], dict[str, Any]]
    label: Label | None = None
    # (training arrays, seed) -> the arrays the model is fitted on: e.g. a seeded share of
    # categorical values masked into the unknown bucket, so that bucket is learnt. Seeded alike,
    # a retrain is reproducible.
    augment_training: Callable[[tuple[np.ndarray, ...], int], tuple[np.ndarray, ...]] | None = None
    # How Tandem trains a new version unless a run says otherwise: a few large batches suit
    # thousands of records a day, a small dataset needs more and smaller steps.
    train_epochs: int = 2
    train_batch_size: int = 512
    # The record table (default: `name`).
    table: str | None = None
    # The request's list field and the record's schema name in the API documents.
    plural: str = "records"
    record_name: str = "Record"
    rules: tuple[RecordRule, ...] = ()
    # Validation's order of reason codes (the first broken rule names a record's reason).
    reason_order: tuple[str, ...] | None = None
    # (the loaded spec, day, DemoSettings) -> the day's records, written to the landing location
    # by the demo source and `tandem demo`. None: the spec has no demo, its records come from files
    # or SQL.
    demo: DemoHook | None = None
    title: str = "Tandem scorer"
    description: str = ""
    # What a score means, in the API documents' words.
    score_description: str = "The model's probability of the label in [0, 1]."
