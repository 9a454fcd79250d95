"""The demo through the spec: its `demo` hook lands a day; the core asks for days and writes them.

A spec generates its own records (the reference's generator is `tandem_specs.transactions.demo`);
what every spec shares, its poison, is `inference.spec.poison`.
"""

from __future__ import annotations

from datetime import date, timedelta
from typing import TYPE_CHECKING

import polars as pl

from inference.spec import DemoSettings, LoadedSpec

if TYPE_CHECKING:  # inference.settings imports the sources, which write the demo's days
    from inference.settings import TandemSettings


class NoDemo(ValueError):
    """The spec declares no demo: its records come from files or a SQL query."""


def day_range(start: date, days: int) -> list[date]:
    return [start + timedelta(days=offset) for offset in range(days)]


def demo_settings(settings: TandemSettings) -> DemoSettings:
    """The TANDEM_DEMO_* settings as the spec's demo hook takes them."""
    return DemoSettings(
        seed=settings.demo_seed,
        start=settings.demo_start_date,
        days=settings.demo_days,
        rows_per_day=settings.demo_rows_per_day,
        poison_rate=settings.demo_poison_rate,
    )


def demo_day(ls: LoadedSpec, day: date, settings: DemoSettings) -> pl.DataFrame:
    """One day of the spec's demo records, as its hook lands them (with any columns of its own)."""
    if ls.spec.demo is None:
        raise NoDemo(f"spec {ls.path!r} has no demo (ModelSpec.demo): read its records from files or a SQL query")
    return ls.spec.demo(ls, day, settings)
