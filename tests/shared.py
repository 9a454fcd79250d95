"""Helpers every test package uses: a throwaway PostgreSQL database, an untrained model version.

Plain functions without pytest, so child processes started by tests can import them too.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import torch
from sqlalchemy.engine import make_url

from inference.model import ModelConfig, RiskModel, TrainingReport
from tandem import modelstore


@contextmanager
def fresh_postgres_database(admin_url: str, prefix: str = "tandem_test") -> Iterator[str]:
    """An empty database of its own; dropped afterwards (forcibly, whoever is still connected)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def register_untrained_model(
    name: str, *, code_version: str = "test", seed: int = 0, config: ModelConfig | None = None, promote: bool = True
) -> str:
    """A deterministic, untrained model version in the BentoML store (promoted by default):
    what it scores is not the point of the tests that use it, that it is stored and served is."""
    torch.manual_seed(seed)
    model = RiskModel(config or ModelConfig()).eval()
    report = TrainingReport(
        auc=0.5,
        train_rows=0,
        holdout_rows=0,
        epochs=0,
        parameter_count=model.parameter_count,
        flops_per_item=model.flops_per_item(),
    )
    tag = modelstore.register(model, report, name=name, code_version=code_version)
    if promote:
        modelstore.promote(tag)
    return tag
