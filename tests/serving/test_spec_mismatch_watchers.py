"""A watcher that meets a version of another spec keeps serving what it serves and logs the refusal
in one line, before any scoring process starts for it.

The store is the real BentoML store (BENTOML_HOME is the session's temporary folder); `load` does
what the service's `load_version` does first, `modelstore.check_spec` against the spec it runs,
then starts a hand-written scoring step instead of a scoring process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from sqlalchemy.engine import Engine

from inference.model import CONFIG_FILE, WEIGHTS_FILE, TrainingReport
from inference.spec import configured_spec, load_spec
from serving.backends import ScoringBackend
from serving.lifecycle import ChallengerWatcher, ModelWatcher
from serving.runtime import OnlineScorer
from serving.scoring import BatchResult, ItemSpec
from tandem import modelstore
from tests.inference.support import TINY_MODEL
from tests.serving.support import FakeClock, scored_batch, started_scorer
from tests.shared import reference_model
from tests.specs.tiny import TinyModel


class Store:
    """A model name of its own with a reference version serving and a tiny-spec version beside it."""

    def __init__(self, tmp_path: Path) -> None:
        self.name = f"risk_watch_{uuid.uuid4().hex[:10]}"
        torch.manual_seed(0)
        model = reference_model(TINY_MODEL)
        report = TrainingReport(0.5, 10, 5, 1, model.parameter_count, None)
        self.reference = modelstore.register(model, report, name=self.name, code_version="test")
        folder = tmp_path / "tiny"
        folder.mkdir()
        torch.save(TinyModel({"history_length": 2}).state_dict(), folder / WEIGHTS_FILE)
        (folder / CONFIG_FILE).write_text(json.dumps({"history_length": 2}))
        self.foreign = modelstore.register_dir(
            folder, name=self.name, code_version="test", spec=load_spec("tests.specs.tiny:SPEC")
        )
        self.started: list[str] = []

    def load(self, tag: str) -> ScoringBackend:
        resolved = modelstore.check_spec(tag, configured_spec())
        self.started.append(resolved)
        return ScoringBackend(resolved, ThreadPoolExecutor(max_workers=1), ScoringStep(resolved))


class ScoringStep:
    def __init__(self, version: str) -> None:
        self.version = version

    def __call__(self, specs: list[ItemSpec]) -> BatchResult:
        return scored_batch(specs, model_version=self.version, batch_id=uuid.uuid4().hex, score=0.5)


async def serving(store: Store, engine: Engine, tmp_path: Path) -> OnlineScorer:
    return await started_scorer(
        ScoringStep(store.reference), engine, tmp_path / "outbox.sqlite3", model_version=store.reference
    )


def refusal_logged(caplog: pytest.LogCaptureFixture, store: Store) -> list[logging.LogRecord]:
    with pytest.raises(modelstore.SpecMismatch) as refused:
        modelstore.check_spec(store.foreign)
    line = str(refused.value)
    return [record for record in caplog.records if record.getMessage().startswith(f"{line}; ")]


def test_the_model_watcher_keeps_serving_when_production_is_another_specs_version(
    sqlite_engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path)
    pointer: dict[str, str | None] = {"tag": store.reference}
    clock = FakeClock(1000.0)

    async def scenario() -> None:
        scorer = await serving(store, sqlite_engine, tmp_path)
        watcher = ModelWatcher(
            scorer,
            production_tag=lambda: pointer["tag"],
            load=store.load,
            interval_s=0.02,
            load_timeout_s=5.0,
            retry_max_s=1.0,
            clock=clock,
        )
        try:
            pointer["tag"] = store.foreign
            assert await watcher.poll_once() == "failed"
            assert scorer.model_version == store.reference
            assert store.started == [], "refused before any scoring process started"
            failed = scorer.metrics.registry.get_sample_value("tandem_serving_model_swaps_total", {"outcome": "failed"})
            assert failed == 1
            assert await watcher.poll_once() is None, "backed off like any version that failed"
        finally:
            await scorer.close()
            scorer.executor.shutdown(wait=True)

    with caplog.at_level(logging.ERROR, logger="serving.lifecycle"):
        asyncio.run(scenario())
    (logged,) = refusal_logged(caplog, store)
    assert logged.getMessage().endswith(f"; still serving {store.reference} (attempt 1)")
    assert logged.exc_info is None and "\n" not in logged.getMessage()


def test_the_challenger_watcher_does_not_shadow_another_specs_version(
    sqlite_engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path)
    pointer: dict[str, str | None] = {"tag": None}

    async def scenario() -> None:
        scorer = await serving(store, sqlite_engine, tmp_path)
        watcher = ChallengerWatcher(
            scorer.shadow,
            challenger_tag=lambda: pointer["tag"],
            load=store.load,
            interval_s=60,
            load_timeout_s=10,
            retry_max_s=60,
        )
        try:
            pointer["tag"] = store.foreign
            assert await watcher.poll_once() == "failed"
            assert scorer.shadow.backend is None and store.started == []
            assert scorer.model_version == store.reference
        finally:
            await watcher.close()
            await scorer.close()
            scorer.executor.shutdown(wait=True)

    with caplog.at_level(logging.ERROR, logger="serving.lifecycle"):
        asyncio.run(scenario())
    (logged,) = refusal_logged(caplog, store)
    assert logged.getMessage().endswith("; not shadowing it (attempt 1)") and logged.exc_info is None
