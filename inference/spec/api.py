"""The record model of a spec: one record as a request sends it, checked by pydantic with the rules
its fields declare (a `RecordRule` is `validate`'s alone, which both paths run)."""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from inference.records import format_event_time
from inference.spec.fields import EVENT_TIME_PATTERN
from inference.spec.loading import LoadedSpec

# fullmatch: `re`'s `$` alone would also accept a trailing newline, which polars refuses.
_EVENT_TIME = re.compile(EVENT_TIME_PATTERN)


class RecordBase(BaseModel):
    """What every spec's record model shares: no field beyond the spec's, text stripped."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    def to_raw(self) -> dict[str, Any]:
        """The record as a frame row holds it: the event time as canonical RFC 3339 text."""
        return {
            name: format_event_time(value) if isinstance(value, datetime) else value
            for name, value in self.model_dump().items()
        }


def a_number(value: Any, info: pydantic.ValidationInfo) -> Any:
    # pydantic alone reads true as 1.0; a frame (`raw_frame`, a CSV cell) has no number there.
    if isinstance(value, bool):
        raise ValueError(f"{info.field_name} must be a number, not a boolean")
    # A JSON number, as the schema says and an NDJSON line requires (a string is that row's
    # problem). Read leniently, pydantic took "1_000" as 1000 and "１２" as 12, which a CSV cell
    # with the same text is quarantined for.
    if isinstance(value, str):
        raise ValueError(f"{info.field_name} must be a number, not a string")
    return value


def _rfc3339_text(value: Any, info: pydantic.ValidationInfo) -> Any:
    if isinstance(value, datetime):  # a Python caller's own value; a request always sends text
        return value
    if not isinstance(value, str) or _EVENT_TIME.fullmatch(value) is None:
        raise ValueError(
            f"{info.field_name} must be RFC 3339 text with seconds and an offset (e.g. 2026-11-01T12:00:00Z)"
        )
    return value


def _aware_utc(value: datetime, info: pydantic.ValidationInfo) -> datetime:
    if value.tzinfo is None:
        raise ValueError(f"{info.field_name} must carry a timezone offset (e.g. 2026-11-01T12:00:00Z)")
    try:
        return value.astimezone(UTC)
    except OverflowError:  # not a ValueError: pydantic would let it out of validation as a crash
        raise ValueError(f"{info.field_name} is out of range in UTC (years 1-9999)") from None


@functools.cache
def record_model(ls: LoadedSpec) -> type[RecordBase]:
    """The spec's record model (`spec.record_name`), its fields in declaration order: ids and the
    entity 1..max_length characters, numerics finite floats within their bounds (never a boolean
    or a string), categoricals matching their pattern, the event time RFC 3339 text read in UTC."""
    fields: dict[str, Any] = {}
    for key in (ls.id, ls.entity):
        if key is not None:
            fields[key.name] = (str, Field(min_length=1, max_length=key.max_length))
    for numeric in ls.numerics:
        fields[numeric.name] = (float, Field(ge=numeric.minimum, le=numeric.maximum, allow_inf_nan=False))
    for categorical in ls.categoricals:
        constraints = Field(
            min_length=categorical.min_length, max_length=categorical.max_length, pattern=categorical.pattern
        )
        fields[categorical.name] = (str, constraints)
    fields[ls.event_time.name] = (datetime, ...)
    numerics = [numeric.name for numeric in ls.numerics]
    event_time = ls.event_time.name
    validators: dict[str, Any] = {
        "_rfc3339_text": field_validator(event_time, mode="before")(_rfc3339_text),
        "_aware_utc": field_validator(event_time)(_aware_utc),
    }
    if numerics:
        validators["_a_number"] = field_validator(*numerics, mode="before")(a_number)
    model: type[RecordBase] = pydantic.create_model(
        ls.spec.record_name,
        __base__=RecordBase,
        __doc__=f"One record, for the online path: the same field names as the `{ls.table}` table.",
        __module__=__name__,
        __validators__=validators,
        **{name: fields[name] for name in ls.field_names},
    )
    return model
