"""The diabetes dataset as daily landings: each patient's visit falls on one demo day.

scikit-learn ships the data; loading it opens no socket. Imported only by the spec's demo hook:
scoring never needs scikit-learn.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

import numpy as np
import polars as pl

from inference.spec import DemoSettings, LoadedSpec, poison
from tandem_specs.diabetes import MEASUREMENTS

# Patients who progressed: the dataset's target (a measure of progression a year on) above this.
PROGRESSED_ABOVE = 140.0
PROGRESSED = "progressed"
FIRST_VISIT = time(8, 0)
VISITING_HOURS = timedelta(hours=10)


def all_patients() -> pl.DataFrame:
    """Every patient as a record with its label, in the dataset's row order."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes(scaled=False)
    columns = {name: data.data[:, i] for i, name in enumerate(data.feature_names)}
    count = len(data.target)
    return pl.DataFrame(
        {
            "patient_id": [f"patient-{i:04d}" for i in range(count)],
            **{name: columns[name].astype(np.float64) for name in MEASUREMENTS},
            "sex": [str(int(value)) for value in columns["sex"]],
            PROGRESSED: (data.target > PROGRESSED_ABOVE).astype(np.int16),
        }
    )


def landing_day(day: date, *, seed: int, start: date, days: int) -> pl.DataFrame:
    """The visits of `day`: the patients in a seeded order, the p-th of n on day p * days // n
    after `start`, at equal steps through the visiting hours. Each patient lands on exactly one
    day of the window; a day outside it is empty, and a day regenerates alone."""
    patients = all_patients()
    count = patients.height
    order = np.random.default_rng(seed).permutation(count)
    offset = (day - start).days
    positions = [p for p in range(count) if p * days // count == offset] if 0 <= offset < days else []
    opening = datetime.combine(day, FIRST_VISIT, tzinfo=UTC)
    step = VISITING_HOURS / max(len(positions), 1)
    visits = [(opening + step * i).strftime("%Y-%m-%dT%H:%M:%SZ") for i in range(len(positions))]
    return patients[order[positions].tolist()].with_columns(visit_time=pl.Series(visits, dtype=pl.String))


def demo(ls: LoadedSpec, day: date, settings: DemoSettings) -> pl.DataFrame:
    """The spec's demo hook: `day`'s visits in field order with the label, poisoned at the
    settings' rate (`inference.spec.poison`, from its own seed per day). Every patient lands once
    in the window, so the settings' rows per day do not apply."""
    visits = landing_day(day, seed=settings.seed, start=settings.start, days=settings.days)
    frame = visits.select(*ls.field_names, PROGRESSED)
    return poison(frame, ls, np.random.default_rng([settings.seed, day.toordinal()]), settings.poison_rate)
