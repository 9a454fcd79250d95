"""The result writer tells a refused row (quarantine it, alone) from an unreachable database (keep
every row in the outbox), on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from inference.store import UNWRITABLE_RESULT, RejectStage, make_engine, predictions, rejected_records, utc_now
from serving.breaker import BreakerState, CircuitBreaker
from serving.metrics import ServingMetrics
from serving.outbox import Outbox
from serving.writer import ResultWriter
from tests.reference import REFERENCE
from tests.serving.support import FakeClock
from tests.shared import unreachable_database_url, until

MODEL = "risk_model:writer"


def rows(count: int, *, refused: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """Online result rows; those at `refused` positions name a path the table's CHECK refuses."""
    now = utc_now()
    return [
        {
            "record_id": f"w{i}",
            "model_version": MODEL,
            "score": 0.5,
            "path": "sideways" if i in refused else "online",
            "run_id": None,
            "partition_key": None,
            "request_id": "r",
            "batch_id": "b",
            "code_version": "test",
            "input_hash": f"h{i}",
            "history_hash": "0" * 16,
            "idempotency_key": f"w{i}:{MODEL}",
            "produced_at": now,
        }
        for i in range(count)
    ]


def writer_for(engine: Engine, tmp_path: Path, drain_chunk: int = 50, coalesce_s: float = 0.0) -> ResultWriter:
    breaker = CircuitBreaker(failure_threshold=1, reset_s=0.01)
    outbox = Outbox(tmp_path / "outbox.sqlite3")
    return ResultWriter(
        REFERENCE,
        engine,
        breaker,
        outbox,
        ServingMetrics(),
        drain_interval_s=0.01,
        drain_chunk=drain_chunk,
        coalesce_s=coalesce_s,
    )


def drained(writer: ResultWriter) -> None:
    until(lambda: not writer.outbox_depth, message=lambda: f"{writer.outbox_depth} rows still in the outbox")


def stored(engine: Engine) -> tuple[set[str], list[dict[str, Any]]]:
    with engine.connect() as conn:
        ids = set(conn.execute(sa.select(predictions.c.record_id)).scalars())
        rejections = [dict(row._mapping) for row in conn.execute(sa.select(rejected_records))]
    return ids, rejections


def test_a_refused_row_is_quarantined_alone_and_the_breaker_stays_closed(engine: Engine, tmp_path: Path) -> None:
    writer = writer_for(engine, tmp_path)
    writer.start()
    writer.submit_rows(rows(40, refused=frozenset({7, 31})))
    writer.flush()
    writer.close()

    ids, rejections = stored(engine)
    assert ids == {f"w{i}" for i in range(40)} - {"w7", "w31"}
    assert sorted(r["record_id"] for r in rejections) == ["w31", "w7"]
    for rejection in rejections:
        assert rejection["stage"] == RejectStage.WRITE.value
        assert rejection["reason"] == UNWRITABLE_RESULT
        assert "sideways" in rejection["payload"]
        assert rejection["detail"]
    assert writer.outbox_depth == 0
    assert writer.breaker.state is BreakerState.CLOSED


def test_batches_submitted_within_the_gathering_window_are_one_write(engine: Engine, tmp_path: Path) -> None:
    """Five adaptive batches' answers are one transaction; an answer given twice keeps its first
    row, as two writes in a row would; a quarantine job between them still lands."""
    commits: list[int] = []
    sa.event.listen(engine, "commit", lambda _conn: commits.append(1))
    writer = writer_for(engine, tmp_path, coalesce_s=0.5)
    writer.start()
    batches = [rows(30)[i * 6 : (i + 1) * 6] for i in range(5)]
    repeated = {**batches[0][0], "request_id": "second-request"}
    for batch in batches:
        writer.submit_rows(batch)
    writer.submit_rows([repeated])
    writer.flush()
    assert len(commits) == 1

    rejection = {**rows(1)[0], "transaction_id": "bad", "reject_reason": "bad_currency", "request_id": "r"}
    writer.submit_rows(rows(32)[30:])
    writer.submit_rejections([rejection])
    writer.submit_rows(rows(34)[32:])
    writer.flush()
    writer.close()

    ids, rejections = stored(engine)
    assert ids == {f"w{i}" for i in range(34)}
    assert [r["record_id"] for r in rejections] == ["bad"]
    with engine.connect() as conn:
        kept = conn.execute(sa.select(predictions.c.request_id).where(predictions.c.record_id == "w0")).scalars()
        assert list(kept) == ["r"]


def test_a_refused_row_in_the_outbox_no_longer_holds_back_the_rows_behind_it(engine: Engine, tmp_path: Path) -> None:
    # Rows spilled during an outage, one of them refused by the database once it is back.
    outbox = Outbox(tmp_path / "outbox.sqlite3")
    outbox.append(rows(30, refused=frozenset({0})))
    outbox.close()
    writer = writer_for(engine, tmp_path)
    assert writer.outbox_depth == 30
    writer.start()
    drained(writer)
    writer.close()

    ids, rejections = stored(engine)
    assert writer.outbox_depth == 0
    assert ids == {f"w{i}" for i in range(1, 30)}
    assert [r["record_id"] for r in rejections] == ["w0"]


def test_an_unreachable_database_keeps_every_row_for_later(engine: Engine, tmp_path: Path) -> None:
    """Rows submitted during an outage, in two lots, wait in the outbox; once the database is back
    they are drained, a few per chunk, and only the row the database refuses is quarantined."""
    dead = make_engine(unreachable_database_url())
    writer = writer_for(dead, tmp_path, drain_chunk=3)
    writer.start()
    submitted = rows(12, refused=frozenset({3}))
    writer.submit_rows(submitted[:5])
    writer.submit_rows(submitted[5:])
    writer.flush()
    # Nothing is quarantined for an outage, the refused row included: it is only known once the store answers.
    assert writer.outbox_depth == 12
    assert writer.breaker.state is not BreakerState.CLOSED

    writer.engine = engine
    drained(writer)
    writer.close()
    ids, rejections = stored(engine)
    assert ids == {f"w{i}" for i in range(12)} - {"w3"}
    assert [r["record_id"] for r in rejections] == ["w3"]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(predictions)).scalar_one() == 11, "each row once"


# ------------------------------------------------------------------ the last outbox drain at shutdown
def spilled_writer(engine: Engine, tmp_path: Path, breaker: CircuitBreaker) -> ResultWriter:
    """Seven rows in the outbox, the writer thread never started: nothing drains but close()."""
    outbox = Outbox(tmp_path / "outbox.sqlite3")
    outbox.append(rows(7))
    return ResultWriter(REFERENCE, engine, breaker, outbox, ServingMetrics(), drain_interval_s=60, drain_chunk=3)


def test_close_drains_the_outbox_into_the_database(engine: Engine, tmp_path: Path) -> None:
    writer = spilled_writer(engine, tmp_path, CircuitBreaker(failure_threshold=1, reset_s=60))
    assert writer.outbox_depth == 7
    assert writer.close(drain_s=30) == 7
    assert writer.outbox_depth == 0
    ids, _ = stored(engine)
    assert ids == {f"w{i}" for i in range(7)}


def test_close_gives_up_at_its_bound_and_keeps_the_rows(tmp_path: Path) -> None:
    dead = make_engine(unreachable_database_url())
    writer = spilled_writer(dead, tmp_path, CircuitBreaker(failure_threshold=1, reset_s=0.05))
    started = time.monotonic()
    assert writer.close(drain_s=0.5, retry_s=0.05) == 0
    assert time.monotonic() - started < 30, "bounded (generously: the machine is shared)"
    assert writer.outbox_depth == 7, "nothing is deleted that the database did not take"
    assert writer.outbox.depth() == 7


def test_close_without_a_drain_leaves_the_outbox_alone(engine: Engine, tmp_path: Path) -> None:
    writer = spilled_writer(engine, tmp_path, CircuitBreaker(failure_threshold=1, reset_s=60))
    assert writer.close() == 0
    assert writer.outbox_depth == 7


def test_close_of_a_running_writer_writes_what_was_submitted_before_it_drains(engine: Engine, tmp_path: Path) -> None:
    writer = spilled_writer(engine, tmp_path, CircuitBreaker(failure_threshold=1, reset_s=60))
    writer.start()
    writer.submit_rows(rows(12)[7:])
    writer.close(drain_s=30)
    ids, _ = stored(engine)
    assert ids == {f"w{i}" for i in range(12)}
    assert writer.outbox_depth == 0


def test_a_store_without_its_schema_keeps_every_row_in_the_outbox(tmp_path: Path) -> None:
    """A database nobody migrated refuses every row, and the quarantine too: the store is broken,
    not the rows, so they wait in the outbox instead of being dropped."""
    bare = make_engine(f"sqlite:///{tmp_path / 'unmigrated.db'}")
    writer = writer_for(bare, tmp_path)
    writer.start()
    writer.submit_rows(rows(5))
    writer.flush()
    writer.close()
    assert writer.outbox.depth() == 5
    bare.dispose()


class FlakyOutbox(Outbox):
    """An outbox whose next drain fails on its own SQLite file (locked past its timeout, a disk
    error): a local fault, which says nothing about the database."""

    fail_next_drain = False

    def drain(self, write: Any, chunk: int) -> int:
        if self.fail_next_drain:
            self.fail_next_drain = False
            raise sqlite3.OperationalError("database is locked")
        return int(super().drain(write, chunk))


def test_a_drain_that_fails_on_the_outbox_file_neither_stops_the_writer_nor_the_rows_after_it(
    engine: Engine, tmp_path: Path
) -> None:
    outbox = FlakyOutbox(tmp_path / "outbox.sqlite3")
    outbox.append(rows(1))  # left behind by an earlier outage
    outbox.fail_next_drain = True
    writer = ResultWriter(
        REFERENCE, engine, CircuitBreaker(2, 0.05), outbox, ServingMetrics(), drain_interval_s=0.01, drain_chunk=10
    )
    writer.start()
    until(lambda: not outbox.fail_next_drain, message="the idle writer never drained")
    writer.submit_rows(rows(3)[1:])
    flushing = threading.Thread(target=writer.flush, daemon=True)  # blocks for good on a dead writer
    flushing.start()
    flushing.join(timeout=10)
    assert not flushing.is_alive(), "the writer thread died with the drain: nothing after it is written"
    drained(writer)
    assert stored(engine)[0] == {"w0", "w1", "w2"}
    writer.close()


def test_a_drain_that_fails_on_the_outbox_file_does_not_hold_the_breakers_probe_for_good(
    engine: Engine, tmp_path: Path
) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(1, 1.0, clock=clock)
    outbox = FlakyOutbox(tmp_path / "outbox.sqlite3")
    writer = ResultWriter(REFERENCE, engine, breaker, outbox, ServingMetrics(), drain_interval_s=60, drain_chunk=10)
    breaker.record_failure()  # an outage: the breaker is open and a batch goes to the outbox
    writer._write(rows(1))
    clock.now = 2.0  # half-open: the next caller probes
    outbox.fail_next_drain = True
    with pytest.raises(sqlite3.OperationalError):
        writer.drain()
    assert breaker.state is BreakerState.HALF_OPEN
    clock.now = 3.0  # the failed drain's probe has gone unanswered for reset_s: given up
    assert writer.drain() == 1, "the failed drain kept the probe: every caller refused for good"
    assert breaker.state is BreakerState.CLOSED
