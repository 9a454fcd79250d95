"""The scoring process: the model, the feature pipeline and the store reads, away from the event loop.

Scoring is mostly Python-orchestrated polars and torch; in a thread of the serving process it
holds the GIL often enough to stall the event loop, which then queues requests invisibly in the
socket backlog. A process of its own gives each of the two cores one job: HTTP and admission in
the server process, batches here.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.exc import SQLAlchemyError

from inference.contract import TorchPredictor
from inference.model import load_model
from inference.store import make_engine, warm_history_statements
from serving.breaker import CircuitBreaker
from serving.scoring import BatchResult, ItemSpec, ScoringCore
from serving.scoring_process import ScoringProcess

logger = logging.getLogger(__name__)

# The scoring process calls plain functions; this is the one piece of per-process state they share.
_core: ScoringCore | None = None


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    model_version: str
    database_url: str
    forward_batch_size: int
    code_version: str
    torch_threads: int
    breaker_failure_threshold: int
    breaker_reset_s: float
    engine_options: dict[str, Any] = field(default_factory=dict)
    nice: int = 0  # the challenger's shadow process runs at 19: the champion's process goes first


def initialize(config: WorkerConfig) -> None:
    global _core  # noqa: PLW0603 - set once, when the pool starts this process
    if config.nice:
        os.nice(config.nice)
    torch.set_num_threads(config.torch_threads)
    # Scored with the K the model was trained with (TorchPredictor.history_length), so a version
    # swapped in later is scored with its own K, whatever the settings say.
    predictor = TorchPredictor(
        model=load_model(Path(config.model_dir)),
        model_version=config.model_version,
        forward_batch_size=config.forward_batch_size,
    )
    # No ping per checkout: it was a round trip on each of a batch's two reads, which retry once
    # themselves on a connection the server dropped (`scoring.read_reconnecting`).
    engine = make_engine(config.database_url, **{**config.engine_options, "pool_pre_ping": False})
    try:
        with engine.connect() as conn:
            warm_history_statements(conn, config.forward_batch_size)
    except SQLAlchemyError as error:  # the store may be down at start: batches then score without history
        logger.warning("could not prepare the history reads: %s", error)
    breaker = CircuitBreaker(config.breaker_failure_threshold, config.breaker_reset_s)
    _core = ScoringCore(predictor, engine, breaker, code_version=config.code_version)
    # The imported libraries and the model live as long as the process: a full collection
    # scanning them paused scoring (bench/findings.md, "Measurements behind the code").
    gc.freeze()


def score(specs: list[ItemSpec]) -> BatchResult:
    if _core is None:
        raise RuntimeError("scoring process not initialised")
    return _core.score(specs)


def start_pool(config: WorkerConfig) -> ScoringProcess:
    # Read by polars when the fork server imports it (the server process's own polars is already
    # up). One thread: a batch is many small polars operations, and waking a second thread for
    # each cost more CPU for no less latency (bench/findings.md), CPU the event loop needs.
    os.environ.setdefault("POLARS_MAX_THREADS", "1")
    # Not fork: the server process already runs threads and an event loop. A fork server is a
    # fresh single-threaded process that imports this module (torch, polars, the store) once, so
    # the pool of a version promoted later forks ready-made instead of spending seconds of CPU
    # on imports beside the pool that is answering requests (spawn did, and p99 showed it).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return ScoringProcess(context, initializer=initialize, initargs=(config,))


def discard_pool(pool: Executor) -> None:
    """Dispose of a pool that failed to come up, waiting for nothing: its process may be stuck in
    a load that never returns, so it is terminated rather than asked to finish."""
    if isinstance(pool, ScoringProcess):
        pool.terminate()
    else:  # a thread pool (tests): nothing to terminate
        pool.shutdown(wait=False, cancel_futures=True)
