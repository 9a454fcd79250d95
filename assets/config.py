"""The base of every asset's run config: a value its own validation refuses fails the step at once,
in one line naming each refused field."""

# No `from __future__ import annotations`: Dagster reads a Config subclass's annotations.
from typing import Any

from dagster import Config, Failure
from pydantic import ValidationError


def config_refusal(error: ValidationError) -> str:
    """`error` on one line: each refused field with its value and the reason (pydantic's own text
    spans lines and links to its docs)."""
    said = []
    for refused in error.errors(include_url=False):
        message = refused["msg"].removeprefix("Value error, ")
        field = ".".join(str(part) for part in refused["loc"])
        if not field:  # a model validator's: its message names the fields it compares
            said.append(message)
        elif refused["type"] == "missing":
            said.append(f"{field}: {message}")
        else:
            said.append(f"{field}={refused['input']!r}: {message}")
    return "invalid run config: " + "; ".join(said)


class AssetConfig(Config):
    """Every asset's run config derives from this."""

    def __init__(self, **config: Any) -> None:
        # Dagster checks only the types before the run; the bounds and validators run here, in the
        # step, where a plain error would be retried by its RetryPolicy on the same value.
        try:
            super().__init__(**config)
        except ValidationError as refused:
            raise Failure(description=config_refusal(refused), allow_retries=False) from refused
