"""The fields a spec declares, each with the role it plays in the core.

A field's role decides what the core does with it: the record id keys results and idempotency,
the entity key groups history, the event time orders it and picks the partition, a numeric or a
categorical is validated and handed to the spec's features. The label never arrives in a request.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

# After stripping surrounding whitespace: 1-64 ASCII letters, digits, spaces and `_ - & / .`, room
# for names such as "ev_charging", "Home & Garden" or "b2b/saas", none for markup, quotes, control
# characters or the debris of a mis-split CSV line. ASCII only, so a look-alike Unicode letter
# cannot open a second spelling of one value.
TEXT_PATTERN = r"^[A-Za-z0-9 _&/.-]{1,64}$"
ID_MAX_LENGTH = 64
# RFC 3339 date-time text (a `T`, seconds, and `Z` or a numeric offset), checked alike by both
# validators before their own parsers. Each parser alone takes forms the other refuses: pydantic an
# epoch number or "2026-11-01 12:00:00Z", polars "2026-11-01T1:00:00Z", a leading space or a leap
# second. A record is valid on both paths or on neither. ASCII digits only, and no year 0, which
# polars would parse and Python's datetime cannot hold (Rust's regex has no look-ahead to say it).
EVENT_TIME_PATTERN = (
    r"^([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-[0-9]{2}-[0-9]{2}"
    r"T[0-9]{2}:[0-9]{2}:[0-5][0-9](\.[0-9]+)?([Zz]|[+-][0-9]{2}:?[0-9]{2})$"
)


class GenericReason(enum.StrEnum):
    """The reason codes every spec has, beside those its fields and rules declare."""

    # A NUL character in a text field: PostgreSQL text cannot hold one, so the record cannot be
    # stored (one such row failed the whole day's COPY, at every retry); online it is a 422.
    NUL_CHARACTER = "nul_character"
    # The record id or entity key null, blank or longer than its max_length.
    MISSING_FIELD = "missing_field"
    DUPLICATE_ID = "duplicate_id"
    TIMESTAMP_MISSING = "timestamp_missing"
    TIMESTAMP_UNPARSABLE = "timestamp_unparsable"
    # Scoring's own: the model raised, or returned no finite score.
    MODEL_ERROR = "model_error"
    NONFINITE_SCORE = "nonfinite_score"


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
    to watch, not poison. One that is malformed (after stripping surrounding whitespace, it does
    not match `pattern` or has fewer than `min_length` or more than `max_length` characters) is
    refused with `malformed` (default `malformed_{name}`)."""

    name: str
    vocabulary: tuple[str, ...]
    pattern: str = TEXT_PATTERN
    max_length: int = 64
    min_length: int = 1
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
