"""The scoring process: the model, the feature pipeline and the store reads, away from the event
loop. In a thread of the server process, polars and torch hold the GIL long enough to stall it.
"""

from __future__ import annotations

import functools
import gc
import logging
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from inference.contract import TorchPredictor
from inference.model import load_model
from inference.spec import LoadedSpec, load_spec
from inference.store import make_engine, warm_history_statements
from serving.breaker import CircuitBreaker, StatementBound
from serving.scoring import BatchResult, ItemSpec, ScoringCore, ping_store
from serving.scoring_process import ScoringProcess

logger = logging.getLogger(__name__)

# The scoring process calls plain functions; this is the one piece of per-process state they share.
_core: ScoringCore | None = None


@dataclass(frozen=True)
class WorkerConfig:
    # The spec's import path: the scoring process loads it itself (a LoadedSpec holds functions).
    spec_path: str
    model_dir: str
    model_version: str
    database_url: str
    forward_batch_size: int
    code_version: str
    torch_threads: int
    breaker_failure_threshold: int
    breaker_reset_s: float
    engine_options: dict[str, Any] = field(default_factory=dict)
    statement_bound_s: float | None = None  # see breaker.StatementBound; None: unbounded
    nice: int = 0  # the challenger's shadow process runs at 19: the champion's process goes first


def initialize(config: WorkerConfig) -> None:
    global _core  # noqa: PLW0603 - set once, when the pool starts this process
    if config.nice:
        os.nice(config.nice)
    torch.set_num_threads(config.torch_threads)
    # Each version is scored with the history length it was trained with, whatever the settings say.
    spec = load_spec(config.spec_path)
    predictor = TorchPredictor(
        model=load_model(Path(config.model_dir), spec),
        model_version=config.model_version,
        spec=spec,
        forward_batch_size=config.forward_batch_size,
    )
    # No ping per checkout: a batch's reads retry once on a dropped connection (`read_reconnecting`).
    # Autocommit: this process only reads, a statement at a time, so a batch's reads need no BEGIN
    # and ROLLBACK round trips around them.
    options = {**config.engine_options, "pool_pre_ping": False, "isolation_level": "AUTOCOMMIT"}
    engine = make_engine(config.database_url, **options)
    breaker = CircuitBreaker(
        config.breaker_failure_threshold, config.breaker_reset_s, probe=functools.partial(ping_store, engine)
    )
    if config.statement_bound_s is not None:
        StatementBound(config.statement_bound_s, on_cut=breaker.trip).watch(engine)
    if spec.history_entity(predictor.history_length) is not None:
        _prepare_history_reads(spec, engine, config.forward_batch_size)
    _core = ScoringCore(spec, predictor, engine, breaker, code_version=config.code_version)
    # The libraries and the model live as long as the process: full collections need not scan them.
    gc.freeze()


def _prepare_history_reads(spec: LoadedSpec, engine: Engine, targets: int) -> None:
    try:
        with engine.connect() as conn:
            warm_history_statements(spec, conn, targets)
    except SQLAlchemyError as error:  # the store may be down at start: batches then score without history
        logger.warning("could not prepare the history reads: %s", error)


def score(specs: list[ItemSpec]) -> BatchResult:
    if _core is None:
        raise RuntimeError("scoring process not initialised")
    return _core.score(specs)


def start_pool(config: WorkerConfig) -> ScoringProcess:
    # Read by polars when the fork server imports it. One thread: a batch is many small operations,
    # and waking a second thread for each costs CPU the event loop needs, for no less latency.
    os.environ.setdefault("POLARS_MAX_THREADS", "1")
    # Not fork: the server process runs threads and an event loop. The fork server imports this
    # module once, so a later version's pool forks ready-made instead of importing beside the serving one.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return ScoringProcess(context, initializer=initialize, initargs=(config,))
