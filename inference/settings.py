"""Runtime configuration, resolved from the environment when asked for, never at import time."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from inference.features import MAX_HISTORY_LENGTH
from inference.homes import default_data_dir
from inference.sources import DEFAULT_PATTERN, SourceFormat
from inference.spec import configured_spec


# TANDEM_HISTORY_LENGTH, validated here once for every settings class that reads it. It is the K a
# new model is trained with, the spec's own when unset; scoring always uses the K the scored model
# was trained with (its config), so changing the setting never changes a deployed model's scores.
def _history_needs_an_entity(history_length: int) -> int:
    """K > 0 needs an entity whose earlier records are the history: refused when the settings load,
    not when a training run reaches the features."""
    spec = configured_spec()
    if history_length > 0 and spec.entity is None:
        raise ValueError(f"spec {spec.path} has no entity, so K must be 0")
    return history_length


HistoryLength = Annotated[
    int,
    Field(
        ge=0,
        le=MAX_HISTORY_LENGTH,
        description="K for training: the entity's earlier records each record reads; unset, the spec's",
    ),
    AfterValidator(_history_needs_an_entity),
]


def spec_history_length() -> int:
    """The default of every HistoryLength setting: the K the spec declares."""
    return configured_spec().spec.history_length


# The demo source's size and poison, bounded alike as TANDEM_DEMO_* and as the source resource's
# config (assets/resources.py).
DemoRowsPerDay = Annotated[int, Field(ge=1)]
DemoPoisonRate = Annotated[float, Field(ge=0.0, le=1.0)]


class TandemSettings(BaseSettings):
    """One place for every knob; `DATABASE_URL` alone switches SQLite to PostgreSQL."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(
        default_factory=default_data_dir, description="Local state: SQLite file, outbox (inference/homes.py)."
    )
    database_url: str | None = Field(
        default=None,
        validation_alias="DATABASE_URL",
        description="SQLAlchemy URL; unset means a SQLite file under data_dir.",
    )
    model_name: str = Field(
        default_factory=lambda: configured_spec().spec.model_name,
        min_length=1,
        description="the BentoML model name; unset: the spec's model_name",
    )
    dagster_ui_url: str = Field(default="http://127.0.0.1:3000", description="for links in lineage answers")
    history_length: HistoryLength = Field(default_factory=spec_history_length, validate_default=True)
    demo_seed: int = 7
    # Aliased so that a refusal names the variable ("month must be in 1..12" named nothing).
    demo_start_date: date = Field(default=date(2026, 11, 1), validation_alias="TANDEM_DEMO_START_DATE")
    demo_days: int = Field(default=7, ge=1)
    demo_rows_per_day: DemoRowsPerDay = 20_000
    demo_poison_rate: DemoPoisonRate = 0.01
    source: Literal["demo", "files", "sql"] = Field(
        default="demo", description="where `transactions` reads a day: the demo generator, files, or a SQL query"
    )
    source_location: str | None = Field(
        default=None, description="landing directory or object-store URL; unset means data_dir/landing"
    )
    source_pattern: str = Field(default=DEFAULT_PATTERN, description="one file (or folder, ending in /) per day")
    source_format: SourceFormat | None = Field(default=None, description="unset: from the file extension")
    source_url: str | None = Field(default=None, description="SQLAlchemy URL of the source database (sql)")
    source_query: str | None = Field(default=None, description="SQL with :start, :end (UTC, [start, end)) and :day")

    @field_validator("database_url")
    @classmethod
    def _kept_beyond_the_process(cls, url: str | None) -> str | None:
        """Every command and process opens the store anew: an in-memory SQLite database would take
        a run's results with it when the process ends, and its run would still say it succeeded."""
        try:
            parsed = make_url(url) if url else None
        except (ArgumentError, ValueError):  # ValueError: a port that is no number
            return url  # not a URL: refused, naming the variable, where the store is opened
        if parsed is not None and parsed.get_backend_name() == "sqlite":
            database = parsed.database or ""
            if (
                database in ("", ":memory:")
                or database.startswith("file::memory:")
                or "memory" in parsed.query.values()
            ):
                raise ValueError(
                    "an in-memory SQLite database is lost when each process ends; name a file "
                    "(sqlite:////absolute/path/tandem.db) or leave DATABASE_URL unset for the default"
                )
        return url

    @model_validator(mode="after")
    def _source_complete(self) -> Self:
        if self.source == "sql" and not (self.source_url and self.source_query):
            raise ValueError(
                "TANDEM_SOURCE=sql needs TANDEM_SOURCE_URL (a SQLAlchemy URL) and TANDEM_SOURCE_QUERY "
                "(a query over :start and :end, the day's UTC window [start, end), or :day)"
            )
        return self

    def resolved_source_location(self) -> str:
        return self.source_location or str((self.data_dir / "landing").resolve())

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'tandem.db').resolve()}"


def get_settings() -> TandemSettings:
    return TandemSettings()


# The password of a URL's credentials ("scheme://user:password@"), matched as text: a URL that
# fails to parse is refused too, and its text is echoed where the terminal and the logs keep it.
URL_PASSWORD = re.compile(r"(?P<user>://[^/?#@:]*):[^/?#@]*@")


def without_password(text: str) -> str:
    """`text` with any URL's password masked, as SQLAlchemy renders one: `user:***@`."""
    return URL_PASSWORD.sub(r"\g<user>:***@", text)


def settings_error(error: ValidationError, settings: type[BaseSettings]) -> str:
    """A settings class's refusal on one line, naming each environment variable it refused (for a
    command line: pydantic's own text spans lines, and names a field, not the variable)."""
    prefix = str(settings.model_config.get("env_prefix", ""))

    def variable(location: tuple[int | str, ...]) -> str:
        field = str(location[0])
        # An aliased field is reported under its alias, the variable's whole name.
        return f"{prefix}{field}".upper() if field in settings.model_fields else field

    return without_password(refusal_line(error, variable))


def refusal_line(error: ValidationError, name: Callable[[tuple[int | str, ...]], str]) -> str:
    """pydantic's refusal on one line: `name=value: why` for each refused value, `name: why` for a
    missing one, a model validator's message as it is (it names what it compares)."""
    said = []
    for refused in error.errors(include_url=False):
        message = refused["msg"].removeprefix("Value error, ")
        if not refused["loc"]:
            said.append(message)
        elif refused["type"] == "missing":
            said.append(f"{name(refused['loc'])}: {message}")
        else:
            said.append(f"{name(refused['loc'])}={refused['input']!r}: {message}")
    return "; ".join(said)
