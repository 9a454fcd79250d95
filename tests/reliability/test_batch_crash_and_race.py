"""Faults in the batch path on PostgreSQL that a rerun or a racing run must repair: a run killed
inside its merge transaction, a correction upstream that changes other records' history, two runs
racing on one partition. Each ends compared with one clean run in a fresh database.

The promise under test (inference/batch.py): one merge transaction per partition, so readers see
the old partition or the new one, never half, and a rerun never duplicates. A connection cut
mid-partition and a partition with 5% poison are test_batch_connection_and_poison.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import polars as pl
import psycopg
import pytest

from inference.batch import BatchProducer, score_partition
from inference.contract import TorchPredictor
from inference.store import make_engine
from tandem import modelstore
from tests.reference import REFERENCE
from tests.reliability.batch_child import LAST_CHUNK
from tests.reliability.support import (
    CHUNK_ROWS,
    DAY,
    HISTORY_LENGTH,
    KEY,
    MODEL_NAME,
    ROOT,
    _count,
    _ingest,
    _source,
    backends,
    database_name,
    prediction_facts,
    rejection_facts,
)
from tests.shared import until

pytestmark = [pytest.mark.reliability, pytest.mark.postgres]

CORRECTED = 300
MEASURED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def predictor(reliability_model: str) -> TorchPredictor:
    model, version = modelstore.load_production(MODEL_NAME)
    assert version == reliability_model
    return TorchPredictor(model, version, forward_batch_size=CHUNK_ROWS, spec=REFERENCE)


def _score(url: str, predictor: TorchPredictor, run_id: str) -> None:
    engine = make_engine(url)
    try:
        score_partition(
            REFERENCE,
            engine,
            predictor,
            DAY,
            producer=BatchProducer(run_id=run_id, partition_key=KEY, code_version="test"),
            history_length=HISTORY_LENGTH,
            chunk_rows=CHUNK_ROWS,
        )
    finally:
        engine.dispose()


def _stored_rows(url: str) -> int:
    return _count(url, "SELECT count(*) FROM transactions WHERE partition_date = %s", DAY)


def _corrected(source: pl.DataFrame, *, last_of_account: bool = True, count: int = CORRECTED) -> pl.DataFrame:
    """A correction upstream: `count` valid records change amount (so their input hash).

    `last_of_account`: only records that are their account's last valid one of the day, so no
    other record's history (its features) changes and a rerun must equal a clean run exactly.
    Otherwise records with later ones after them, whose history the correction changes.
    """
    valid = source.filter(pl.col("poison_kind").is_null()).sort("account_id", "event_time", "transaction_id")
    rank = pl.int_range(pl.len()).over("account_id")
    later = pl.len().over("account_id") - 1 - rank
    chosen = valid.filter((later == 0) if last_of_account else (later >= 2))["transaction_id"].head(count)
    assert chosen.len() == count
    return source.with_columns(
        amount=pl.when(pl.col("transaction_id").is_in(chosen.implode()) & pl.col("poison_kind").is_null())
        .then(pl.col("amount") + 1.0)
        .otherwise(pl.col("amount"))
    )


# ------------------------------------------------------------------ SIGKILL inside the merge transaction
def test_sigkill_after_the_last_chunk_before_commit_then_rerun_equals_a_clean_run(
    postgres_url: str, reference_url: str, predictor: TorchPredictor
) -> None:
    source = _source()
    _ingest(postgres_url, source)
    _score(postgres_url, predictor, "old-run")
    old = prediction_facts(postgres_url, KEY)
    old_rejections = rejection_facts(postgres_url, KEY)
    corrected = _corrected(source)
    _ingest(postgres_url, corrected)

    total = _stored_rows(postgres_url)
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.batch_child", "hang-before-commit", postgres_url, KEY, str(total)],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reached = threading.Event()

    def watch() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            if LAST_CHUNK in line:
                reached.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        assert reached.wait(180), "".join(lines[-30:])
        to_last_chunk = time.perf_counter() - started
        # Every row is written, inside a transaction that is still open: the writer's backend.
        open_writers = [b for b in backends(postgres_url, database_name(postgres_url)) if b["xact_start"]]
        assert any(b["state"] == "idle in transaction" for b in open_writers), open_writers
        assert prediction_facts(postgres_url, KEY) == old, "uncommitted rows are invisible to readers"
        os.kill(child.pid, signal.SIGKILL)
        killed = time.perf_counter()
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not any("COMMITTED" in line for line in lines)
    until(
        lambda: not any(b["xact_start"] for b in backends(postgres_url, database_name(postgres_url))),
        timeout_s=15,
        interval_s=0.05,
        message="PostgreSQL kept the dead run's transaction open",
    )
    released_s = time.perf_counter() - killed

    # The crash left the old partition, whole.
    assert prediction_facts(postgres_url, KEY) == old
    assert rejection_facts(postgres_url, KEY) == old_rejections

    _score(postgres_url, predictor, "rerun")
    _ingest(reference_url, corrected)
    _score(reference_url, predictor, "clean-run")
    rerun, clean = prediction_facts(postgres_url, KEY), prediction_facts(reference_url, KEY)
    assert rerun == clean
    assert rejection_facts(postgres_url, KEY) == rejection_facts(reference_url, KEY)
    changed = {row["record_id"] for row in old} ^ {row["record_id"] for row in rerun}
    rehashed = sum(a["input_hash"] != b["input_hash"] for a, b in zip(old, rerun, strict=True))
    assert not changed and rehashed == CORRECTED, "the rerun really replaced the corrected rows"
    MEASURED["sigkill_before_commit"] = {
        "rows": len(clean),
        "child_to_last_chunk_s": round(to_last_chunk, 1),
        "backend_released_after_kill_s": round(released_s, 2),
        "rows_visible_after_crash": "old partition, identical",
        "rerun_equals_clean": True,
    }


def test_rerun_after_a_correction_rescores_records_whose_history_changed(
    postgres_url: str, reference_url: str, predictor: TorchPredictor
) -> None:
    source = _source(2000, 0.0)
    _ingest(postgres_url, source)
    _score(postgres_url, predictor, "old-run")
    corrected = _corrected(source, last_of_account=False, count=50)
    _ingest(postgres_url, corrected)
    _score(postgres_url, predictor, "rerun")
    _ingest(reference_url, corrected)
    _score(reference_url, predictor, "clean-run")
    rerun, clean = prediction_facts(postgres_url, KEY), prediction_facts(reference_url, KEY)
    stale = [a["record_id"] for a, b in zip(rerun, clean, strict=True) if a["score"] != b["score"]]
    MEASURED["stale_history_after_correction"] = {"corrected": 50, "stale_scores_after_rerun": len(stale)}
    assert not stale, f"{len(stale)} rows keep a score computed from the uncorrected history"


# ------------------------------------------------------------------ two runs at once
def test_two_runs_materializing_one_partition_at_once_agree_without_duplicates(
    postgres_url: str, reference_url: str, predictor: TorchPredictor
) -> None:
    _ingest(postgres_url, _source())
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.batch_child", "materialize", postgres_url, KEY],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs: list[list[str]] = [[], []]
    ready = [threading.Event(), threading.Event()]

    def watch(index: int) -> None:
        stdout = children[index].stdout
        assert stdout is not None
        for line in stdout:
            outputs[index].append(line)
            if line.startswith("READY"):
                ready[index].set()

    for index in range(2):
        threading.Thread(target=watch, args=(index,), daemon=True).start()
    try:
        for index in range(2):
            assert ready[index].wait(180), "".join(outputs[index][-30:])
        for child in children:  # the same moment: both runs race from the first chunk
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        for child in children:
            child.wait(timeout=240)
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=30)
    runs = []
    for index, child in enumerate(children):
        log = "".join(outputs[index][-40:])
        assert child.returncode == 0, log
        (line,) = [line for line in outputs[index] if line.startswith("RUN ")]
        _, start, end, status = line.split()
        assert status == "SUCCESS", log
        runs.append((float(start), float(end)))
    overlap = min(end for _, end in runs) - max(start for start, _ in runs)
    assert overlap > 0, f"the two runs did not overlap: {runs}"

    _ingest(reference_url, _source())
    _score(reference_url, predictor, "clean-run")
    raced, clean = prediction_facts(postgres_url, KEY), prediction_facts(reference_url, KEY)
    assert raced == clean, "two racing runs leave exactly what one clean run leaves"
    with psycopg.connect(postgres_url) as conn:
        duplicates = conn.execute(
            "SELECT count(*) FROM (SELECT record_id, reason, input_hash FROM rejected_records "
            "WHERE partition_key = %s GROUP BY 1, 2, 3 HAVING count(*) > 1) AS d",
            (KEY,),
        ).fetchone()
    assert duplicates == (0,)
    assert rejection_facts(postgres_url, KEY) == rejection_facts(reference_url, KEY)
    MEASURED["two_runs_at_once"] = {
        "rows": len(clean),
        "overlap_s": round(overlap, 1),
        "both_succeeded": True,
        "duplicates": 0,
    }
