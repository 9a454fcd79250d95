"""The fields a spec declares, each with the role it plays in the core.

A field's role decides what the core does with it: the record id keys results and idempotency,
the entity key groups history, the event time orders it and picks the partition, a numeric or a
categorical is validated and handed to the spec's features. The label never arrives in a request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

# After stripping surrounding whitespace: 1-64 ASCII letters, digits, spaces and `_ - & / .`, room
# for names such as "ev_charging", "Home & Garden" or "b2b/saas", none for markup, quotes, control
# characters or the debris of a mis-split CSV line. ASCII only, so a look-alike Unicode letter
# cannot open a second spelling of one value.
TEXT_PATTERN = r"^[A-Za-z0-9 _&/.-]{1,64}$"
ID_MAX_LENGTH = 64


@dataclass(frozen=True)
class RecordId:
    """The record's id: results, lineage and idempotency are keyed by it."""

    name: str
    max_length: int = ID_MAX_LENGTH


@dataclass(frozen=True)
class EntityKey:
    """The entity whose earlier records are a record's history (an account, a device)."""

    name: str
    max_length: int = ID_MAX_LENGTH


@dataclass(frozen=True)
class EventTime:
    """When the record happened (RFC 3339 text with an offset): orders history, picks the day."""

    name: str


@dataclass(frozen=True)
class Numeric:
    """A number. `minimum`/`maximum` bound it (refused outside them, with the codes `below` and
    `above`, by default `{name}_below_minimum` and `{name}_above_maximum`)."""

    name: str
    minimum: float | None = None
    maximum: float | None = None
    below: str | None = None
    above: str | None = None

    @property
    def below_code(self) -> str:
        return self.below or f"{self.name}_below_minimum"

    @property
    def above_code(self) -> str:
        return self.above or f"{self.name}_above_maximum"

    @property
    def unparsable_code(self) -> str:
        return f"{self.name}_unparsable"

    @property
    def not_finite_code(self) -> str:
        return f"{self.name}_not_finite"


@dataclass(frozen=True)
class Categorical:
    """Text from a vocabulary. A well-formed value outside the vocabulary (it matches `pattern`)
    is scored through the unknown bucket and flagged, never refused: tomorrow's new value is drift
    to watch, not poison. One that is malformed is refused with `malformed` (default
    `malformed_{name}`)."""

    name: str
    vocabulary: tuple[str, ...]
    pattern: str = TEXT_PATTERN
    max_length: int = 64
    malformed: str | None = None

    @property
    def malformed_code(self) -> str:
        return self.malformed or f"malformed_{self.name}"


@dataclass(frozen=True)
class Label:
    """The outcome a model learns (0 or 1), stored beside the record; never in a request."""

    name: str


@dataclass(frozen=True)
class RecordRule:
    """A spec's own validation rule: `refuses()` is a polars expression over the record's stripped
    columns, true where a row breaks it. Both paths run it; online the item gets its error."""

    code: str
    field: str
    refuses: Callable[[], pl.Expr]


Field = RecordId | EntityKey | EventTime | Numeric | Categorical
