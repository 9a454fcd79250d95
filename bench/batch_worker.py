"""One batch-path measurement in its own process, so peak RSS and CPU time are this partition's."""

from __future__ import annotations

import argparse
import collections
import json
import resource
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import torch

from bench.precision import PRECISIONS, forward_in
from inference.batch import FORWARD_BATCH_SIZE, MODEL_WORKERS, BatchProducer, score_partition
from inference.contract import TorchPredictor
from inference.spec import configured_spec
from inference.store import make_engine
from tandem import modelstore


def _peak_rss_mb() -> float:
    """VmHWM of this process image. Not ru_maxrss: Linux keeps that across exec, so a worker
    started by a parent that had just ingested 1M rows would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StatementTimes:
    """Wall time per SQL statement text, summed over the run, from SQLAlchemy's cursor events (a
    COPY through the driver's own cursor is not among them)."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        self.lock = threading.Lock()  # the stages' threads run statements at once
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", self.before)
        sa.event.listen(sa.engine.Engine, "after_cursor_execute", self.after)

    def before(self, conn: sa.Connection, *_: Any) -> None:
        conn.info.setdefault("statement_started", []).append(time.perf_counter())

    def after(self, conn: sa.Connection, _cursor: Any, statement: str, *_: Any) -> None:
        seconds = time.perf_counter() - conn.info["statement_started"].pop()
        with self.lock:
            total = self.totals[" ".join(statement.split())[:100]]
            total[0] += 1
            total[1] += seconds

    def print(self, top: int = 12) -> None:
        for text, (count, seconds) in sorted(self.totals.items(), key=lambda item: -item[1][1])[:top]:
            print(f"{seconds:8.2f} s {int(count):6d}x  {text}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--day", required=True)
    parser.add_argument("--chunk-rows", type=int, default=8192)
    parser.add_argument("--forward-batch", type=int, default=FORWARD_BATCH_SIZE)
    parser.add_argument("--model-workers", type=int, default=MODEL_WORKERS)
    parser.add_argument("--sequential", action="store_true", help="one chunk after another (the reference)")
    parser.add_argument("--model-name", help="default: the spec's model (ModelSpec.model_name)")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="fp32", help="the forward pass's (bench/precision.py)"
    )
    parser.add_argument("--statements", action="store_true", help="each SQL statement's summed wall time, to stderr")
    args = parser.parse_args()
    statements = StatementTimes() if args.statements else None
    torch.set_num_threads(torch.get_num_threads())
    spec = configured_spec()
    model, version = modelstore.load_production(args.model_name or spec.spec.model_name)
    predictor = TorchPredictor(
        model=model,
        model_version=version,
        spec=spec,
        forward_batch_size=args.forward_batch,
        # fp32 is the predictor's own forward, exactly as production scores.
        forward=None if args.precision == "fp32" else forward_in(args.precision, model),
    )
    engine = make_engine(args.database_url)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    report = score_partition(
        spec,
        engine,
        predictor,
        date.fromisoformat(args.day),
        producer=BatchProducer(run_id="bench", partition_key=args.day, code_version="bench"),
        history_length=predictor.history_length,
        chunk_rows=args.chunk_rows,
        pipelined=not args.sequential,
        model_workers=args.model_workers,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if statements is not None:
        statements.print()
    print(
        json.dumps(
            {
                "rows": report.rows_in,
                "scored": report.scored,
                "rejected": report.rejected,
                "seconds": wall,
                "rows_per_second": report.rows_in / wall,
                "cpu_ms_per_record": cpu * 1000 / max(report.rows_in, 1),
                "peak_rss_mb": _peak_rss_mb(),
                "mode": "sequential" if args.sequential else "pipelined",
                "forward_batch": args.forward_batch,
                "precision": args.precision,
                "model_workers": 1 if args.sequential else args.model_workers,
                "torch_threads": torch.get_num_threads(),
                "stage_busy_s": report.stage_seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
