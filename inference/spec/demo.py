"""The demo's parameters, and poison any spec's demo day can be given: rows validation refuses.

A spec's `demo` hook lands one day of its records (docs/spec.md). It may poison its rows its own
way (the reference does) or with `poison`, which breaks a row through what every spec declares.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from inference.spec.fields import GenericReason

if TYPE_CHECKING:
    from inference.spec.loading import LoadedSpec

# The column `poison` adds: the reason validation gives each poisoned row, null on a clean one.
POISON_REASON = "poison_reason"


@dataclass(frozen=True)
class DemoSettings:
    """What the demo is asked for (the TANDEM_DEMO_* settings): the seed, the window of days it
    covers from `start`, the rows a day (a hook may ignore it: real data has the rows it has) and
    the share of rows to poison."""

    seed: int = 7
    start: date = date(2026, 11, 1)
    days: int = 7
    rows_per_day: int = 20_000
    poison_rate: float = 0.01


# (the loaded spec, the day, the settings) -> the day's records: the fields in declaration order
# as a source hands them (numerics Float64, the rest text), the label when the spec has one, and
# any columns of the hook's own (not written to the landing location).
DemoHook = Callable[["LoadedSpec", date, DemoSettings], pl.DataFrame]

# Each kind of poison: (the spec, the frame, the row, its index among rows of its kind, the
# clean rows) -> (the column broken, its new value, the reason validation gives).
_Poisoner = Callable[["LoadedSpec", pl.DataFrame, int, int, np.ndarray], tuple[str, Any, str]]


def poison(frame: pl.DataFrame, ls: LoadedSpec, rng: np.random.Generator, rate: float) -> pl.DataFrame:
    """`frame` with about `rate` of its rows broken, one fault a row, dealt round-robin over the
    kinds the spec's fields allow: a missing or blank id, a duplicated id, a non-finite numeric, a
    malformed categorical, a missing or unparsable event time, a NUL character. Adds
    POISON_REASON. The first row is never poisoned, so a duplicated id copies an earlier clean one."""
    n = frame.height
    count = min(round(n * rate), n - 1)
    reasons: list[str | None] = [None] * n
    if count <= 0:
        return frame.with_columns(pl.Series(POISON_REASON, reasons, dtype=pl.String))
    rows = np.sort(rng.choice(np.arange(1, n), size=count, replace=False))
    clean = np.setdiff1d(np.arange(n), rows)
    kinds = _poisoners(ls)
    broken: dict[str, list[Any]] = {}
    for offset, row in enumerate(rows.tolist()):
        column, value, reason = kinds[offset % len(kinds)](ls, frame, row, offset // len(kinds), clean)
        broken.setdefault(column, frame[column].to_list())[row] = value
        reasons[row] = reason
    return frame.with_columns(
        *(pl.Series(name, values, dtype=frame[name].dtype) for name, values in broken.items()),
        pl.Series(POISON_REASON, reasons, dtype=pl.String),
    )


def _poisoners(ls: LoadedSpec) -> tuple[_Poisoner, ...]:
    kinds: list[_Poisoner] = [_missing_id, _duplicate_id]
    kinds += [_nonfinite_numeric] if ls.numerics else []
    kinds += [_malformed_categorical] if ls.categoricals else []
    return (*kinds, _bad_event_time, _nul_character)


def _missing_id(ls: LoadedSpec, frame: pl.DataFrame, row: int, index: int, clean: np.ndarray) -> tuple[str, Any, str]:
    return ls.id.name, (None, "   ")[index % 2], GenericReason.MISSING_FIELD.value


def _duplicate_id(ls: LoadedSpec, frame: pl.DataFrame, row: int, index: int, clean: np.ndarray) -> tuple[str, Any, str]:
    # The nearest clean row before this one: its id stays, so this row is the later of the two.
    original = int(clean[np.searchsorted(clean, row) - 1])
    return ls.id.name, frame[ls.id.name][original], GenericReason.DUPLICATE_ID.value


def _nonfinite_numeric(
    ls: LoadedSpec, frame: pl.DataFrame, row: int, index: int, clean: np.ndarray
) -> tuple[str, Any, str]:
    numeric = ls.numerics[index % len(ls.numerics)]
    value = (math.nan, math.inf, -math.inf)[index // len(ls.numerics) % 3]
    return numeric.name, value, numeric.not_finite_code


def _malformed_categorical(
    ls: LoadedSpec, frame: pl.DataFrame, row: int, index: int, clean: np.ndarray
) -> tuple[str, Any, str]:
    categorical = ls.categoricals[index % len(ls.categoricals)]
    # Too short and too long for any categorical (min_length is at least 1).
    value = ("", "x" * (categorical.max_length + 1))[index // len(ls.categoricals) % 2]
    return categorical.name, value, categorical.malformed_code


def _bad_event_time(
    ls: LoadedSpec, frame: pl.DataFrame, row: int, index: int, clean: np.ndarray
) -> tuple[str, Any, str]:
    value = (None, "yesterday", "2026-13-45T99:00:00Z")[index % 3]
    reason = GenericReason.TIMESTAMP_MISSING if value is None else GenericReason.TIMESTAMP_UNPARSABLE
    return ls.event_time.name, value, reason.value


def _nul_character(
    ls: LoadedSpec, frame: pl.DataFrame, row: int, index: int, clean: np.ndarray
) -> tuple[str, Any, str]:
    return ls.event_time.name, f"{frame[ls.event_time.name][row]}\x00", GenericReason.NUL_CHARACTER.value
