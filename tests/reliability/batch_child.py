"""Batch work in a process of its own, for the tests that kill it or race two of them.

python -m tests.reliability.batch_child hang-before-commit URL PARTITION TOTAL_ROWS
    score the partition with inference.batch.score_partition; after the chunk that completes
    TOTAL_ROWS (every row written, the merge transaction still open) print LAST_CHUNK_WRITTEN
    and sleep, so the parent can SIGKILL it before the commit.
python -m tests.reliability.batch_child materialize URL PARTITION
    materialize the predictions partition through Dagster (its RetryPolicy included); print
    READY once imported and set up, then wait for a line on stdin, so two children start the
    run at the same moment.
"""

from __future__ import annotations

import sys
import time
from datetime import date

from dagster import DagsterInstance

from inference.batch import BatchProducer, ChunkProgress, score_partition
from inference.contract import TorchPredictor
from inference.store import make_engine
from tandem import modelstore
from tests.orchestration.support import batch_assets, batch_resources, run_partition
from tests.reference import REFERENCE
from tests.reliability.support import CHUNK_ROWS, HISTORY_LENGTH, MODEL_NAME, RUN_CONFIG

LAST_CHUNK = "LAST_CHUNK_WRITTEN"


def hang_before_commit(url: str, partition_key: str, total_rows: int) -> None:
    model, version = modelstore.load_production(MODEL_NAME)
    predictor = TorchPredictor(model, version, forward_batch_size=CHUNK_ROWS, spec=REFERENCE)
    engine = make_engine(url)

    def on_chunk(progress: ChunkProgress) -> None:
        print(f"chunk {progress.chunk}: {progress.rows_done} rows", flush=True)
        if progress.rows_done >= total_rows:
            print(LAST_CHUNK, flush=True)
            time.sleep(600)

    score_partition(
        REFERENCE,
        engine,
        predictor,
        date.fromisoformat(partition_key),
        producer=BatchProducer(run_id="killed-run", partition_key=partition_key, code_version="test"),
        history_length=HISTORY_LENGTH,
        chunk_rows=CHUNK_ROWS,
        on_chunk=on_chunk,
    )
    print("COMMITTED", flush=True)  # never reached when the parent kills in time


def materialize_partition(url: str, partition_key: str) -> int:
    assets = batch_assets()
    resources = batch_resources(url, model_name=MODEL_NAME)
    print("READY", flush=True)
    sys.stdin.readline()
    started = time.time()
    with DagsterInstance.ephemeral() as instance:
        result = run_partition(
            assets,
            resources,
            instance,
            partition_key=partition_key,
            selection=("predictions",),
            run_config=RUN_CONFIG,
            raise_on_error=False,
        )
    print(f"RUN {started} {time.time()} {'SUCCESS' if result.success else 'FAILURE'}", flush=True)
    return 0 if result.success else 1


def main(argv: list[str]) -> int:
    mode, url, partition_key, *rest = argv
    if mode == "hang-before-commit":
        hang_before_commit(url, partition_key, int(rest[0]))
        return 0
    if mode == "materialize":
        return materialize_partition(url, partition_key)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
