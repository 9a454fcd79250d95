"""Typed resources: configuration resolves when a run starts (EnvVar), never at import.

They live in assets/, below orchestration/ that wires them into Definitions, because assets never
import orchestration/ (an import-linter contract).
"""

from __future__ import annotations

import dataclasses
from datetime import date
from typing import Literal, cast, get_args

import polars as pl
from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field, PrivateAttr, field_validator
from sqlalchemy.engine import Engine

from inference.demo import demo_settings
from inference.migrate import upgrade
from inference.model import LoadedModel
from inference.settings import DemoPoisonRate, DemoRowsPerDay, TandemSettings
from inference.sources import FileSource, SourceError, SourceFormat, SourceRead, SqlSource, write_demo_day
from inference.spec import DemoSettings, LoadedSpec, configured_spec
from inference.store import make_engine
from tandem import modelstore


class DatabaseResource(ConfigurableResource):
    """The result store. One engine per run, created at setup and disposed at teardown, and the
    spec whose records it holds (`inference.spec.configured_spec`), read once per run.

    `url` unset means DATABASE_URL, read when the run starts, or else the embedded default (a
    SQLite file under TANDEM_DATA_DIR). The pool is
    kept small on purpose: a backfill runs many of these at once (see the `database` pool).
    """

    url: str | None = None
    pool_size: int = 2

    _engine: Engine | None = PrivateAttr(default=None)
    _migrated: bool = PrivateAttr(default=False)
    _spec: LoadedSpec | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        url = self.url or TandemSettings().resolved_database_url()
        kwargs = {} if url.startswith("sqlite") else {"pool_size": self.pool_size, "max_overflow": 1}
        # No connection here (migrated at first use, below): a database down when the run started
        # failed the resources' setup, a run failure no step RetryPolicy sees, and run retries
        # relaunch at once, without backoff. At first use it is a step's transient error.
        self._engine = make_engine(url, **kwargs)
        self._migrated = False
        self._spec = configured_spec()

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("DatabaseResource used outside a run (setup_for_execution not called)")
        if not self._migrated:
            upgrade(self._engine, self.spec)
            self._migrated = True
        return self._engine

    @property
    def spec(self) -> LoadedSpec:
        """The spec Tandem runs: its record table is the one this store reads and writes."""
        if self._spec is None:
            self._spec = configured_spec()
        return self._spec


class ModelStoreResource(ConfigurableResource):
    """The BentoML model store; the production model is loaded at most once per run. A version is
    loaded, or its config read, only if it was trained with the spec Tandem runs (SpecMismatch)."""

    model_name: str = Field(description="the BentoML model name (TANDEM_MODEL_NAME, default the spec's)")

    _loaded: tuple[LoadedModel, str] | None = PrivateAttr(default=None)

    def production(self) -> tuple[LoadedModel, str]:
        if self._loaded is None:
            self._loaded = modelstore.load_production(self.model_name)
        return self._loaded

    def production_tag(self) -> str | None:
        return modelstore.production_tag(self.model_name)

    def challenger_tag(self) -> str | None:
        return modelstore.challenger_tag(self.model_name)

    def challenger(self) -> tuple[LoadedModel, str]:
        """The challenger, loaded; LookupError while the slot is empty."""
        tag = self.challenger_tag()
        if tag is None:
            raise LookupError(f"no challenger for {self.model_name!r}: `tandem models challenge TAG` sets one")
        return modelstore.load(tag), tag

    def history_length(self, tag: str) -> int:
        """The K version `tag` was trained with, read from its stored config (no weights loaded)."""
        return int(modelstore.model_config(tag)["history_length"])


SourceKind = Literal["demo", "files", "sql"]


class RecordSourceResource(ConfigurableResource):
    """Where the records asset (the spec's `name`) reads a day: files in a landing location, a SQL
    query, or the demo.

    A field left unset takes its TANDEM_SOURCE_* / TANDEM_DEMO_* value (TandemSettings), read when
    the run asks for records, never at import. The demo writes its generated day as a CSV file into
    the landing location first and then reads it back through the same FileSource as a user's
    files, so `make run` exercises the path a user's data takes.
    """

    # Plain strings (Dagster config has no Literal), checked below.
    kind: str | None = None
    location: str | None = None
    pattern: str | None = None
    format: str | None = None
    url: str | None = None
    query: str | None = None
    seed: int | None = None
    # Bounded as TANDEM_DEMO_*: unbounded, 0 rows a day or a poison rate of 1.5 ran and succeeded.
    rows_per_day: DemoRowsPerDay | None = None
    poison_rate: DemoPoisonRate | None = None

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str | None) -> str | None:
        if value is not None and value not in get_args(SourceKind):
            raise ValueError(f"kind must be one of {get_args(SourceKind)}, not {value!r}")
        return value

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        if value is not None and value not in get_args(SourceFormat):
            raise ValueError(f"format must be one of {get_args(SourceFormat)}, not {value!r}")
        return value

    def resolved_kind(self) -> SourceKind:
        return cast(SourceKind, self.kind) if self.kind else TandemSettings().source

    def demo_settings(self) -> DemoSettings:
        settings = demo_settings(TandemSettings())
        return dataclasses.replace(
            settings,
            seed=settings.seed if self.seed is None else self.seed,
            rows_per_day=settings.rows_per_day if self.rows_per_day is None else self.rows_per_day,
            poison_rate=settings.poison_rate if self.poison_rate is None else self.poison_rate,
        )

    def file_source(self) -> FileSource | None:
        """The landing location as files (demo and files); None for a SQL source."""
        kind = self.resolved_kind()
        if kind == "sql":
            return None
        settings = TandemSettings()
        return FileSource(
            configured_spec(),
            self.location or settings.resolved_source_location(),
            self.pattern or settings.source_pattern,
            # The demo writes CSV whatever the pattern's extension says.
            "csv" if kind == "demo" else (cast(SourceFormat | None, self.format) or settings.source_format),
        )

    def sql_source(self) -> SqlSource:
        settings = TandemSettings()
        url, query = self.url or settings.source_url, self.query or settings.source_query
        if not (url and query):
            raise SourceError("a sql source needs a url and a query (TANDEM_SOURCE_URL, TANDEM_SOURCE_QUERY)")
        return SqlSource(configured_spec(), url, query)

    def read(self, day: date) -> SourceRead:
        files = self.file_source()
        if files is None:
            return self.sql_source().read(day)
        if self.resolved_kind() == "demo":
            write_demo_day(configured_spec(), files.location, day, self.demo_settings(), files.pattern.text)
            return dataclasses.replace(files.read(day), kind="demo")
        return files.read(day)

    def records_for(self, day: date) -> pl.DataFrame:
        return self.read(day).frame
