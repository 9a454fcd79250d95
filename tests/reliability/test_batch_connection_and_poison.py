"""Faults in the batch path on PostgreSQL, through a Dagster materialization: its database
connection cut mid-partition, a partition with 5% poison.

The promise under test (inference/batch.py): one merge transaction per partition, so readers see
the old partition or the new one, never half; poison is quarantined, never a failed partition. A
run killed inside its merge transaction and racing runs are test_batch_crash_and_race.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import polars as pl
import psycopg
import pytest
from dagster import DagsterEventType, DagsterInstance

from tandem_specs.transactions.demo import EXPECTED_REASON, PoisonKind
from tests.orchestration.support import batch_assets, batch_resources, run_partition
from tests.reliability.support import (
    DAY,
    KEY,
    MODEL_NAME,
    RUN_CONFIG,
    _count,
    _ingest,
    _source,
    backends,
    database_name,
)

pytestmark = [pytest.mark.reliability, pytest.mark.postgres]

MEASURED: dict[str, Any] = {}


def _valid_stored_rows(url: str) -> int:
    return _count(url, "SELECT count(*) FROM transactions WHERE partition_date = %s AND reject_reason IS NULL", DAY)


# ------------------------------------------------------------------ connection cut mid-partition
class Killer(threading.Thread):
    """Terminates the run's writer backend once, as soon as it is seen writing predictions."""

    MARKERS = ("staging_predictions", "INSERT INTO predictions", "rejected_records")

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.database = database_name(url)
        self.stop = threading.Event()
        self.killed: dict[str, Any] | None = None

    def run(self) -> None:
        while not self.stop.is_set() and self.killed is None:
            for backend in backends(self.url, self.database):
                if backend["xact_start"] and any(m in (backend["query"] or "") for m in self.MARKERS):
                    with psycopg.connect(self.url, autocommit=True) as admin:
                        admin.execute("SELECT pg_terminate_backend(%s)", (backend["pid"],))
                    self.killed = {**backend, "at": time.perf_counter()}
                    return
            time.sleep(0.01)


class Reader(threading.Thread):
    """Polls the partition's prediction count from its own connection for the whole run."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.seen: list[int] = []

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set():
                row = conn.execute("SELECT count(*) FROM predictions WHERE partition_key = %s", (KEY,)).fetchone()
                self.seen.append(int(row[0]) if row else -1)
                time.sleep(0.005)


def test_connection_dropped_mid_partition_is_retried_and_readers_never_see_half(
    postgres_url: str, reliability_model: str
) -> None:
    _ingest(postgres_url, _source())
    expected = _valid_stored_rows(postgres_url)
    killer, reader = Killer(postgres_url), Reader(postgres_url)
    reader.start()
    killer.start()
    started = time.perf_counter()
    try:
        with DagsterInstance.ephemeral() as instance:
            result = run_partition(
                batch_assets(),
                batch_resources(postgres_url, model_name=MODEL_NAME),
                instance,
                partition_key=KEY,
                selection=("predictions",),
                run_config=RUN_CONFIG,
            )
    finally:
        killer.stop.set()
        reader.stop.set()
        killer.join(5)
        reader.join(5)
    took = time.perf_counter() - started

    assert killer.killed is not None, "the writer was never seen mid-partition"
    assert result.success
    retries = [e for e in result.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]
    assert len(retries) == 1, "the dropped connection is a transient error, retried by the RetryPolicy"
    error = retries[0].event_specific_data.error  # type: ignore[union-attr]
    assert "OperationalError" in str(error), error
    assert {e.event_type for e in result.all_events}.isdisjoint({DagsterEventType.STEP_FAILURE})
    assert set(reader.seen) <= {0, expected}, f"a reader saw a partial partition: {sorted(set(reader.seen))}"
    assert reader.seen[-1] == expected
    assert _count(postgres_url, "SELECT count(*) FROM predictions WHERE partition_key = %s", KEY) == expected
    checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
    assert checks["rows_accounted_for"] and checks["batch_answers_current"], checks
    MEASURED["connection_dropped"] = {
        "killed_backend_state": killer.killed["state"],
        "killed_during": (killer.killed["query"] or "")[:40],
        "step_retries": len(retries),
        "reader_polls": len(reader.seen),
        "distinct_counts_seen": sorted(set(reader.seen)),
        "run_seconds": round(took, 1),
    }


# ------------------------------------------------------------------ poison
def test_partition_with_five_percent_poison_lands_with_every_poison_row_quarantined(
    postgres_url: str, reliability_model: str
) -> None:
    rows, rate = 4000, 0.05
    source = _source(rows, rate)
    poison = source.filter(pl.col("poison_kind").is_not_null())
    assert poison.height == rows * rate
    with DagsterInstance.ephemeral() as instance:
        result = run_partition(
            batch_assets(),
            batch_resources(postgres_url, rows_per_day=rows, poison_rate=rate, model_name=MODEL_NAME),
            instance,
            partition_key=KEY,
            run_config=RUN_CONFIG,
        )
    assert result.success, "poison is quarantined, never a failed partition"

    expected = sorted(
        (tx, EXPECTED_REASON[PoisonKind(kind)])
        for tx, kind in zip(poison["transaction_id"], poison["poison_kind"], strict=True)
    )
    with psycopg.connect(postgres_url) as conn:
        quarantined = sorted(
            (str(tx), str(reason))
            for tx, reason in conn.execute(
                "SELECT record_id, reason FROM rejected_records WHERE partition_key = %s AND NOT resolved", (KEY,)
            )
        )
        scored_poison = conn.execute(
            "SELECT count(*) FROM predictions p JOIN transactions t ON t.transaction_id = p.record_id "
            "WHERE p.partition_key = %s AND t.reject_reason IS NOT NULL",
            (KEY,),
        ).fetchone()
    assert quarantined == expected, "every poison row, and nothing else, is quarantined with its reason"
    assert scored_poison == (0,)
    (materialization,) = result.asset_materializations_for_node("predictions")
    scored = materialization.metadata["scored"].value
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert checks["rows_accounted_for"].passed
    assert not checks["reject_rate_bounded"].passed and checks["reject_rate_bounded"].severity.value == "WARN"
    MEASURED["poison_5_percent"] = {
        "rows": rows,
        "poison_rows": poison.height,
        "quarantined": len(quarantined),
        "scored": scored,
        "run_succeeded": True,
    }
