"""One feature pipeline for a 1M-row partition and for a single online record.

The core builds the timeline (the sort, each target's K earlier records, the history digests,
the vocabulary indices and unseen flags); the spec's `features` hook turns it into the model's
inputs. Where the history comes from is a parameter (`history`): any frame holding the entities'
valid records. A partition passes its own rows plus the days before; the service passes rows
fetched from the store. Both feed the same sort-and-shift below, so a record's features are
identical either way (a property test holds us to it).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from inference.records import run_query
from inference.spec import LoadedSpec, Timeline

# The longest history a model may read (the digest has one weight per lag); settings validate K against it.
MAX_HISTORY_LENGTH = 256
# The history digest of a record that reads no history (K = 0, or no earlier record).
NO_HISTORY_DIGEST = "0" * 16
# One odd 64-bit weight per lag, derived from a fixed string so they never change with a library
# version: the digest is stored, and a digest that changed by itself would rewrite every score.
_LAG_WEIGHTS = np.array(
    [
        int.from_bytes(hashlib.sha256(f"tandem-history-lag-{i}".encode()).digest()[:8], "big") | 1
        for i in range(MAX_HISTORY_LENGTH)
    ],
    dtype=np.uint64,
)


@dataclass(frozen=True)
class FeatureBatch:
    """Model inputs for N records, rows in the order of the targets given."""

    record_ids: list[str]
    arrays: tuple[np.ndarray, ...]  # the spec's features, each [N, ...], in forward's argument order
    # Per row, the categoricals scored through their unknown bucket (sorted, comma-separated) or None.
    unseen: list[str | None]
    # Per row, a digest of the stored records its history was built from (see `build_features`).
    history_digests: list[str] | None = None

    def __len__(self) -> int:
        return len(self.record_ids)

    def slice(self, start: int, stop: int) -> FeatureBatch:
        return FeatureBatch(
            record_ids=self.record_ids[start:stop],
            arrays=tuple(array[start:stop] for array in self.arrays),
            unseen=self.unseen[start:stop],
            history_digests=None if self.history_digests is None else self.history_digests[start:stop],
        )

    def take(self, rows: np.ndarray) -> FeatureBatch:
        return FeatureBatch(
            record_ids=[self.record_ids[i] for i in rows],
            arrays=tuple(array[rows] for array in self.arrays),
            unseen=[self.unseen[i] for i in rows],
            history_digests=None if self.history_digests is None else [self.history_digests[i] for i in rows],
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Zero-copy views in the argument order of the model's forward."""
        return tuple(torch.from_numpy(array) for array in self.arrays)


def _index_of(column: str, vocabulary: tuple[str, ...]) -> pl.Expr:
    """The value's index in `vocabulary`, or len(vocabulary) (the unknown bucket) if not in it."""
    mapping = {value: index for index, value in enumerate(vocabulary)}
    # Stripped as validation and the API's model strip it, so " grocery " in a file is "grocery".
    return pl.col(column).str.strip_chars().replace_strict(mapping, default=len(vocabulary), return_dtype=pl.Int64)


@functools.cache
def _encoded_columns(spec: LoadedSpec) -> dict[str, pl.Expr]:
    """The timeline's computed columns, built once per spec (each vocabulary becomes a polars
    Series, and building them cost about a tenth of one online batch's features): one index per
    categorical, then the spec's own. Expressions are immutable, so every caller may share them."""
    indices = {f"{field.name}_idx": _index_of(field.name, field.vocabulary) for field in spec.categoricals}
    return {**indices, **spec.spec.encode()}


def build_features(
    spec: LoadedSpec,
    targets: pl.DataFrame,
    history: pl.DataFrame,
    history_length: int,
    *,
    targets_read_each_other: bool = True,
) -> FeatureBatch:
    """Features for every row of `targets` (valid rows: the spec's fields plus `event_ts`).

    `history` holds valid rows of the same entities; it may contain the targets themselves and
    rows after them. A target's history is the `history_length` rows of its entity that sort
    before it by (event_ts, id). With K = 0 (or no entity) nothing is read from `history`.

    `targets_read_each_other`: the targets are records of the history too (a stored partition, a
    training set), so an earlier target is history of a later one. False for the online path,
    where the targets are what concurrent requests sent: each target then reads `history` alone,
    so its answer does not depend on what else shared its adaptive batch.

    When both frames carry `input_hash`, each row also gets a digest of the input hashes of the
    records its history was built from, in order: the score depends on them as much as on the
    record itself, so a corrected, late or removed record changes the digest of every later
    record that read it.
    """
    k = history_length
    if not 0 <= k <= MAX_HISTORY_LENGTH or (k and spec.entity is None):
        raise ValueError(f"history_length {k} outside 0..{MAX_HISTORY_LENGTH}, or without an entity")
    with_digest = "input_hash" in targets.columns and (k == 0 or "input_hash" in history.columns)
    frame = _timeline(
        spec, targets, history, k, with_digest=with_digest, targets_read_each_other=targets_read_each_other
    )
    # From here on numpy: a few dozen vectorised operations on the target rows only. The same
    # steps as polars expressions cost ~7 ms of per-expression overhead for a single record.
    target_order = frame["target_order"].to_numpy()
    rows = np.flatnonzero(target_order >= 0)
    rows = rows[np.argsort(target_order[rows])]  # back to target order
    if rows.size != targets.height:
        # The ids below are the targets' own, so every target must be on the timeline exactly once.
        raise ValueError(f"{rows.size} timeline rows for {targets.height} targets")
    # [n, k] index of each target's b-th predecessor (b = 1..k), and whether it is of the same entity.
    back = rows[:, None] - np.arange(1, k + 1)[None, :]
    source = np.maximum(back, 0)
    timeline_run = frame["timeline_run"].to_numpy()
    valid = (back >= 0) & (timeline_run[source] == timeline_run[rows][:, None])
    timeline = Timeline(columns=frame, rows=rows, source=source, valid=valid)
    return FeatureBatch(
        record_ids=targets[spec.id.name].to_list(),
        arrays=tuple(spec.spec.features(timeline)),
        unseen=_unseen(spec, timeline),
        history_digests=(
            _history_digests(np.where(valid, frame["record_number"].to_numpy()[source], 0)) if with_digest else None
        ),
    )


def _timeline(
    spec: LoadedSpec,
    targets: pl.DataFrame,
    history: pl.DataFrame,
    k: int,
    *,
    with_digest: bool,
    targets_read_each_other: bool,
) -> pl.DataFrame:
    """Targets and their entities' history rows, encoded and sorted into timelines (one per
    entity, or one per target where targets must not read each other); `target_order` is a row's
    position in `targets`, -1 for a history row, and `timeline_run` numbers the timelines in order."""
    id_name = spec.id.name
    columns = [*spec.field_names, "event_ts", *(["input_hash"] if with_digest else [])]
    # One lazy query up to the timeline, then numpy: as eager operations, the same steps were a
    # dozen polars queries, each with a fixed cost larger than one online record's work.
    wanted = targets.lazy().select(columns).with_columns(target_position=pl.int_range(pl.len(), dtype=pl.Int64))
    if spec.history_entity(k) is None:
        # No history: each target is a timeline of its own, in target order.
        timeline_key, together = "target_position", wanted
    else:
        timeline_key, together = _with_history(spec, targets, history, wanted, columns, targets_read_each_other)
    timeline_query = (
        together.with_columns(**_encoded_columns(spec))
        .sort([timeline_key, "event_ts", id_name])
        .with_columns(
            timeline_run=(pl.col(timeline_key) != pl.col(timeline_key).shift(1)).fill_null(True).cum_sum(),
            target_order=pl.col("target_position").fill_null(-1),
        )
    )
    if with_digest:
        # 60 bits of the record's sha256 (hex), enough to tell versions of one record apart.
        timeline_query = timeline_query.with_columns(
            record_number=pl.col("input_hash").str.slice(0, 15).str.to_integer(base=16)
        )
    return run_query(timeline_query)


def _with_history(
    spec: LoadedSpec,
    targets: pl.DataFrame,
    history: pl.DataFrame,
    wanted: pl.LazyFrame,
    columns: list[str],
    targets_read_each_other: bool,
) -> tuple[str, pl.LazyFrame]:
    """(the timeline key, the targets beside their entities' history rows)."""
    assert spec.entity is not None
    id_name, entity = spec.id.name, spec.entity.name
    candidates = history.lazy().select(columns).join(wanted.select(entity).unique(), on=entity, how="semi")
    if targets_read_each_other or targets[entity].n_unique() == targets.height:
        # One timeline per entity: targets and history rows together. Targets of distinct
        # entities never meet on one, so read alone they need no timeline of their own (the common
        # online case); a stored row then gives way only to the same record of its own entity.
        superseded = [id_name] if targets_read_each_other else [id_name, entity]
        past = candidates.join(wanted.select(superseded), on=superseded, how="anti").with_columns(
            target_position=pl.lit(None, dtype=pl.Int64)
        )
        return entity, pl.concat([wanted, past])
    # One timeline per target: the target and its entity's history rows (at most a few K per
    # target online), never another target; a stored record other than the target itself stays.
    own = wanted.select(entity, timeline=pl.col("target_position"), own_id=pl.col(id_name))
    past = (
        candidates.join(own, on=entity)
        .filter(pl.col(id_name) != pl.col("own_id"))
        .select(*columns, target_position=pl.lit(None, dtype=pl.Int64), timeline=pl.col("timeline"))
    )
    return "timeline", pl.concat([wanted.with_columns(timeline=pl.col("target_position")), past])


@functools.cache
def _unseen_texts(spec: LoadedSpec) -> np.ndarray:
    """`unseen` text for each combination of unseen categoricals (sorted by name), indexed by a
    bitmask whose bit i is the i-th of them: a lookup instead of joining strings row by row."""
    names = sorted(field.name for field in spec.categoricals)
    return np.array(
        [
            ",".join(name for bit, name in enumerate(names) if mask >> bit & 1) or None
            for mask in range(1 << len(names))
        ],
        dtype=object,
    )


def _unseen(spec: LoadedSpec, timeline: Timeline) -> list[str | None]:
    """Per target, the categoricals scored through their unknown bucket, or None."""
    fields = sorted(spec.categoricals, key=lambda field: field.name)
    mask = np.zeros(timeline.rows.size, dtype=np.int64)
    for bit, field in enumerate(fields):
        unknown = timeline.column(f"{field.name}_idx")[timeline.rows] == len(field.vocabulary)
        mask |= unknown.astype(np.int64) << bit
    texts: list[str | None] = _unseen_texts(spec)[mask].tolist()
    return texts


def _history_digests(record_numbers: np.ndarray) -> list[str]:
    """A position-weighted sum of the history records' numbers, modulo 2**64 (numpy's uint64
    arithmetic wraps): vectorised, and with odd weights one changed record always changes it."""
    numbers = record_numbers.astype(np.uint64)
    digests = (numbers * _LAG_WEIGHTS[: numbers.shape[1]]).sum(axis=1, dtype=np.uint64)
    return [f"{value:016x}" for value in digests.tolist()]
