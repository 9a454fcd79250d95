"""A run worker SIGKILLed in the middle of a partition, then rerun, leaves what a clean run leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from dagster import AssetsDefinition, DagsterInstance

from tests.orchestration.support import (
    batch_resources,
    prediction_rows,
    predictions_config,
    rejection_rows,
    run_partition,
)

pytestmark = pytest.mark.reliability

ROOT = Path(__file__).resolve().parents[2]
# Big enough that scoring takes several seconds in chunks of 4096 (the smallest allowed).
ROWS = 20_000
RUN_CONFIG = predictions_config(chunk_rows=4096, parity_sample=8)
COMPARED = ("record_id", "model_version", "score", "input_hash")
# What a rejection says about its input, without the bookkeeping of when and by which run.
REJECTION_FACTS = ("record_id", "path", "stage", "partition_key", "reason", "detail", "payload", "input_hash")
CHUNK_LINE = "predictions - chunk 1:"

# The child inherits BENTOML_HOME from this session, so it scores with the same production model.
CHILD = textwrap.dedent(
    """
    import sys
    from dagster import DagsterInstance
    from tests.orchestration.support import batch_assets, batch_resources, run_partition
    from tests.orchestration.test_crash_recovery import ROWS, RUN_CONFIG

    with DagsterInstance.ephemeral() as instance:
        run_partition(
            batch_assets(),
            batch_resources(sys.argv[1], rows_per_day=ROWS),
            instance,
            selection=["predictions"],
            run_config=RUN_CONFIG,
        )
    """
)


class KilledRunWorker:
    """A run worker scoring the partition in a child process, SIGKILLed as soon as it logs a chunk.

    A thread watches the child's log, so the kill is immediate however busy the test itself is.
    """

    def __init__(self, database_url: str) -> None:
        self.lines: list[str] = []
        self.killed = False
        self.child = subprocess.Popen(
            [sys.executable, "-c", CHILD, database_url],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            self.lines.append(line)
            if CHUNK_LINE in line and not self.killed:
                os.kill(self.child.pid, signal.SIGKILL)
                self.killed = True

    def wait(self, timeout: float = 180) -> None:
        self.watcher.join(timeout)
        if self.watcher.is_alive():
            self.child.kill()
        self.child.wait(timeout=30)
        log = "".join(self.lines[-40:])
        assert self.killed, f"the child ended before it could be killed:\n{log}"
        assert self.child.returncode == -signal.SIGKILL, log
        assert not any("RUN_SUCCESS" in line for line in self.lines), log


@pytest.mark.timeout(300)
def test_sigkill_mid_partition_then_rerun_equals_a_clean_run(
    assets: list[AssetsDefinition],
    production_tag: str,
    instance: DagsterInstance,
    database_url: str,
    other_database_url: str,
) -> None:
    resources = batch_resources(database_url, rows_per_day=ROWS)
    run_partition(assets, resources, instance, selection=["transactions"])
    worker = KilledRunWorker(database_url)

    # The clean reference run, in its own database, while the child starts up and gets killed.
    run_partition(assets, batch_resources(other_database_url, rows_per_day=ROWS), instance, run_config=RUN_CONFIG)
    clean = prediction_rows(other_database_url, columns=COMPARED)
    clean_rejections = rejection_rows(other_database_url, columns=REJECTION_FACTS)
    assert len(clean) > ROWS * 0.95
    assert {row["model_version"] for row in clean} == {production_tag}
    worker.wait()

    # One merge transaction per partition: the old partition (none) or the whole new one.
    after_crash = prediction_rows(database_url, columns=COMPARED)
    assert len(after_crash) in (0, len(clean)), f"partial partition: {len(after_crash)} of {len(clean)} rows"
    scored_rejections = [r for r in rejection_rows(database_url, columns=REJECTION_FACTS) if r["stage"] == "score"]
    assert len(scored_rejections) in (0, sum(r["stage"] == "score" for r in clean_rejections))

    rerun = run_partition(assets, resources, instance, selection=["predictions"], run_config=RUN_CONFIG)

    assert rerun.success
    assert prediction_rows(database_url, columns=COMPARED) == clean
    assert rejection_rows(database_url, columns=REJECTION_FACTS) == clean_rejections
