"""The base of every asset's run config: a value its own validation refuses fails the step at once,
in one line naming each refused field."""

# No `from __future__ import annotations`: Dagster reads a Config subclass's annotations.
from typing import Any

from dagster import Config, Failure
from pydantic import ValidationError

from inference.settings import refusal_line


def config_refusal(error: ValidationError) -> str:
    """`error` on one line, each refused field by its path (pydantic's own text spans lines and
    links to its docs)."""
    return "invalid run config: " + refusal_line(error, lambda location: ".".join(map(str, location)))


class AssetConfig(Config):
    """Every asset's run config derives from this."""

    def __init__(self, **config: Any) -> None:
        # Dagster checks only the types before the run; the bounds and validators run here, in the
        # step, where a plain error would be retried by its RetryPolicy on the same value.
        try:
            super().__init__(**config)
        except ValidationError as refused:
            raise Failure(description=config_refusal(refused), allow_retries=False) from refused
