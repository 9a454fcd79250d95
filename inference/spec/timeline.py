"""`Timeline`: what the core hands a spec's `features` hook."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl


@dataclass(frozen=True)
class Timeline:
    """The targets and their entities' earlier records, sorted by (entity, event time, id).

    `columns` holds every timeline row: the spec's fields, `event_ts`, one `{name}_idx` per
    categorical (its vocabulary index, `len(vocabulary)` for a value outside it) and the columns
    of the spec's `encode`. Row `rows[i]` is target i; `source[i, b]` is the row of its (b+1)-th
    predecessor, meaningful where `valid[i, b]` (same entity, within K).
    """

    columns: pl.DataFrame
    rows: np.ndarray  # int64 [N]
    source: np.ndarray  # int64 [N, K]
    valid: np.ndarray  # bool [N, K]

    @property
    def k(self) -> int:
        return int(self.valid.shape[1])

    def column(self, name: str) -> np.ndarray:
        """Every timeline row's value of `name`, as numpy (index it with `rows` or `source`)."""
        return self.columns[name].to_numpy()
