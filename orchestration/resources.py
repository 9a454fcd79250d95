"""Typed resources: configuration resolves when a run starts (EnvVar), never at import."""

from __future__ import annotations

from datetime import date

import polars as pl
from dagster import ConfigurableResource, InitResourceContext
from pydantic import PrivateAttr
from sqlalchemy.engine import Engine

from inference.demo import DemoConfig, generate_day
from inference.migrate import upgrade
from inference.model import RiskModel
from inference.settings import TandemSettings
from inference.store import make_engine
from tandem import modelstore


class DatabaseResource(ConfigurableResource):
    """The result store. One engine per run, created at setup and disposed at teardown.

    `url` unset means DATABASE_URL, read when the run starts, or else the embedded default (a
    SQLite file under TANDEM_DATA_DIR). The pool is
    kept small on purpose: a backfill runs many of these at once (see the `database` pool).
    """

    url: str | None = None
    pool_size: int = 2

    _engine: Engine | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        url = self.url or TandemSettings().resolved_database_url()
        kwargs = {} if url.startswith("sqlite") else {"pool_size": self.pool_size, "max_overflow": 1}
        self._engine = make_engine(url, **kwargs)
        upgrade(self._engine)

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("DatabaseResource used outside a run (setup_for_execution not called)")
        return self._engine


class ModelStoreResource(ConfigurableResource):
    """The BentoML model store; the production model is loaded at most once per run."""

    model_name: str = "risk_model"

    _loaded: tuple[RiskModel, str] | None = PrivateAttr(default=None)

    def production(self) -> tuple[RiskModel, str]:
        if self._loaded is None:
            self._loaded = modelstore.load_production(self.model_name)
        return self._loaded

    def production_tag(self) -> str | None:
        return modelstore.production_tag(self.model_name)


class DemoSourceResource(ConfigurableResource):
    """The default transaction source: the deterministic generator (same day, same rows).

    A field left unset takes TANDEM_DEMO_SEED / TANDEM_DEMO_ROWS_PER_DAY / TANDEM_DEMO_POISON_RATE
    (TandemSettings), read when the run asks for records, so a deployment sizes its demo source
    from the environment like every other knob.
    """

    seed: int | None = None
    rows_per_day: int | None = None
    poison_rate: float | None = None

    def demo_config(self) -> DemoConfig:
        settings = TandemSettings()
        return DemoConfig(
            seed=settings.demo_seed if self.seed is None else self.seed,
            rows_per_day=settings.demo_rows_per_day if self.rows_per_day is None else self.rows_per_day,
            poison_rate=settings.demo_poison_rate if self.poison_rate is None else self.poison_rate,
        )

    def records_for(self, day: date) -> pl.DataFrame:
        return generate_day(day, self.demo_config())
