"""The Predictor interface both paths use: a frame in, one result or one rejection per row out.

Validation, history, features, the forward pass and per-item isolation live here once. The batch
path calls it with a whole chunk and in-memory history; the service with an adaptive batch and
history fetched from the store. What differs between the paths is only how they call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import polars as pl

from inference.features import FeatureBatch, build_features
from inference.model import LoadedModel, score_batch
from inference.records import hash_inputs, reason_fields, validate
from inference.spec import GenericReason, LoadedSpec

# One row per input row, in input order.
RESULT_SCHEMA: dict[str, pl.DataType] = {
    # The spec's record id, under the name the core tables key it by.
    "record_id": pl.String(),
    "score": pl.Float64(),
    "reject_reason": pl.String(),
    "reject_detail": pl.String(),
    "input_hash": pl.String(),
    # Digest of the stored records the features read as history; null for a rejected row.
    "history_hash": pl.String(),
    # Comma-separated, sorted names of the categorical fields whose value is outside the training
    # vocabulary, scored through the model's unknown bucket; null when none and for a rejected row.
    "unseen_fields": pl.String(),
}


class HistorySource(Protocol):
    """Where an entity's earlier records come from: a frame in memory, or the store.

    A source may say `targets_are_history = True` (FrameHistory: the targets are rows of the frame,
    so an earlier target is a later one's history); any other source is read alone for each target.
    """

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        """Valid rows (RAW columns + event_ts) holding at least each target's last
        `history_length` earlier rows of its entity."""
        ...


class FrameHistory:
    """History from a frame already in memory (a partition, or a test's fixture), validated once."""

    targets_are_history = True

    def __init__(self, spec: LoadedSpec, frame: pl.DataFrame) -> None:
        checked = frame if "reject_reason" in frame.columns else validate(spec, frame)
        valid = checked.filter(pl.col("reject_reason").is_null())
        # Stored rows carry their hash already; a frame from elsewhere gets the same one computed.
        self.valid_rows = valid if "input_hash" in valid.columns else valid.with_columns(hash_inputs(spec, valid))

    def history_for(self, targets: pl.DataFrame, history_length: int) -> pl.DataFrame:
        return self.valid_rows


class Predictor(Protocol):
    model_version: str

    def predict(self, frame: pl.DataFrame, history: HistorySource) -> pl.DataFrame:
        """Score a RAW_SCHEMA frame (or `validate()`'s output of one, with or without
        `input_hash`); returns RESULT_SCHEMA, one row per input row."""
        ...


ForwardFn = Callable[[FeatureBatch], np.ndarray]


@dataclass(frozen=True)
class PreparedBatch:
    """A frame validated, hashed and featurised, not yet through the model (`TorchPredictor.prepare`)."""

    record_ids: pl.Series
    input_hashes: pl.Series
    reasons: list[str | None]  # validation reasons, one per input row
    details: list[str | None]
    history_hashes: list[str | None]
    unseen: list[str | None]
    valid_positions: np.ndarray  # input rows that passed validation, in order
    features: FeatureBatch | None  # of the valid rows; None when there are none

    def __len__(self) -> int:
        return len(self.reasons)


@runtime_checkable
class StagedPredictor(Predictor, Protocol):
    """A Predictor whose `predict` is `complete(prepare(...))`, so a caller can run the two halves
    in different threads (the batch pipeline featurises chunk n+1 while chunk n is scored)."""

    def prepare(self, frame: pl.DataFrame, history: HistorySource) -> PreparedBatch: ...

    def complete(self, prepared: PreparedBatch) -> pl.DataFrame: ...


@dataclass
class TorchPredictor:
    """The one Predictor implementation, over a spec's model.

    `forward_batch_size` bounds the tensor size of one forward call; the batch path uses large
    values (throughput), the service scores whatever its adaptive batch holds.
    """

    model: LoadedModel
    model_version: str
    forward_batch_size: int = 4096
    forward: ForwardFn | None = None
    # Required, and by name: the spec the frames are validated, hashed and featurised by.
    spec: LoadedSpec = field(kw_only=True)

    @property
    def history_length(self) -> int:
        """K, the history rows per target: the model's own, the one it was trained with. Scoring
        with another K changes every score silently, so no caller can choose it."""
        return self.model.history_length

    def _forward(self, features: FeatureBatch) -> np.ndarray:
        if self.forward is not None:
            return self.forward(features)
        return score_batch(self.model, features)

    def predict(self, frame: pl.DataFrame, history: HistorySource) -> pl.DataFrame:
        return self.complete(self.prepare(frame, history))

    def prepare(self, frame: pl.DataFrame, history: HistorySource) -> PreparedBatch:
        """The first half of `predict`: validation, hashing, history and features; no forward.

        The batch path runs it for the next chunk while `complete` scores the current one; the
        service calls `predict`, which is exactly `complete(prepare(...))`.
        """
        # A caller that validated and hashed the frame already (the service does, to look up
        # stored answers first) passes validate()'s output with input_hash: not done twice.
        checked = frame if "reject_reason" in frame.columns else validate(self.spec, frame)
        if "input_hash" not in checked.columns:
            checked = checked.with_columns(hash_inputs(self.spec, checked))
        history_hashes: list[str | None] = [None] * checked.height
        unseen: list[str | None] = [None] * checked.height
        reasons: list[str | None] = checked["reject_reason"].to_list()
        details: list[str | None] = [None] * checked.height
        rejected = np.array([reason is not None for reason in reasons], dtype=bool)
        # Only rejected rows need a sentence, so only they are materialised as Python rows.
        for position in np.flatnonzero(rejected).tolist():
            row = checked.row(position, named=True)
            details[position] = describe_rejection(self.spec, row["reject_reason"], row)
        valid_positions = np.flatnonzero(~rejected)
        features = None
        if valid_positions.size:
            # Selecting rows is a polars query of its own: skipped when every row is valid.
            valid = checked if valid_positions.size == checked.height else checked[valid_positions]
            features = build_features(
                self.spec,
                valid,
                history.history_for(valid, self.history_length),
                self.history_length,
                targets_read_each_other=getattr(history, "targets_are_history", False),
            )
            if features.history_digests is None:
                raise ValueError("history rows carry no input_hash; the score's inputs could not be recorded")
            for position, digest, fields in zip(
                valid_positions.tolist(), features.history_digests, features.unseen, strict=True
            ):
                history_hashes[position] = digest
                unseen[position] = fields
        return PreparedBatch(
            record_ids=checked[self.spec.id.name],
            input_hashes=checked["input_hash"],
            reasons=reasons,
            details=details,
            history_hashes=history_hashes,
            unseen=unseen,
            valid_positions=valid_positions,
            features=features,
        )

    def complete(self, prepared: PreparedBatch) -> pl.DataFrame:
        """The second half of `predict`: the forward passes (bounded by `forward_batch_size`,
        each item isolated) and the result frame, RESULT_SCHEMA, one row per input row."""
        scores = np.full(len(prepared.reasons), np.nan)
        reasons, details = list(prepared.reasons), list(prepared.details)
        features, valid_positions = prepared.features, prepared.valid_positions
        if features is not None:
            for start in range(0, len(features), self.forward_batch_size):
                part = features.slice(start, start + self.forward_batch_size)
                part_scores, failures = self.score_isolated(part)
                for offset, failure in failures.items():
                    position = int(valid_positions[start + offset])
                    reasons[position] = failure[0].value
                    details[position] = failure[1]
                scores[valid_positions[start : start + len(part)]] = part_scores
        # A failed item (rejected, or failed in the model) has no score, history hash or unseen fields.
        failed = [reason is not None for reason in reasons]
        scores[np.array(failed, dtype=bool)] = np.nan
        return pl.DataFrame(
            {
                "record_id": prepared.record_ids,
                "score": pl.Series(scores, nan_to_null=True),
                "reject_reason": pl.Series(reasons, dtype=pl.String),
                "reject_detail": pl.Series(details, dtype=pl.String),
                "input_hash": prepared.input_hashes,
                "history_hash": pl.Series(
                    [None if no else digest for no, digest in zip(failed, prepared.history_hashes, strict=True)],
                    dtype=pl.String,
                ),
                "unseen_fields": pl.Series(
                    [None if no else fields for no, fields in zip(failed, prepared.unseen, strict=True)],
                    dtype=pl.String,
                ),
            },
            schema=RESULT_SCHEMA,
        )

    def score_isolated(self, features: FeatureBatch) -> tuple[np.ndarray, dict[int, tuple[GenericReason, str]]]:
        """Scores for a batch where one bad item fails only itself.

        A failed forward is bisected until the failing items are alone, so k poison items cost
        O(k log n) extra forwards and every other item still gets its score. A non-finite score
        fails only its own item.
        """
        scores = np.full(len(features), np.nan)
        failures: dict[int, tuple[GenericReason, str]] = {}
        pending = [(0, len(features))]
        while pending:
            start, stop = pending.pop()
            try:
                scores[start:stop] = self._forward(features.slice(start, stop))
            except Exception as error:  # noqa: BLE001 - any model failure is isolated, then reported
                if stop - start == 1:
                    failures[start] = (GenericReason.MODEL_ERROR, f"{type(error).__name__}: {error}"[:500])
                else:
                    middle = (start + stop) // 2
                    pending += [(start, middle), (middle, stop)]
        for position in np.flatnonzero(~np.isfinite(scores) | (scores < 0) | (scores > 1)):
            if int(position) not in failures:
                failures[int(position)] = (GenericReason.NONFINITE_SCORE, f"model returned {scores[position]!r}")
        scores[list(failures)] = np.nan
        return scores, failures


def describe_rejection(ls: LoadedSpec, reason: str, row: dict[str, object]) -> str:
    """A human sentence for a validation reason, naming the offending values."""
    fields = reason_fields(ls).get(reason, ("record",))
    return f"{reason}: " + " ".join(f"{name}={row.get(name)!r}" for name in fields)
