"""Registers and promotes the deployment's production model: `python -m tests.e2e.model_setup`.

Run as a child process with the deployment's BENTOML_HOME: BentoML fixes its home once per process,
and the test session's home (tests/conftest.py) is not the deployment's. Prints the production tag.
"""

from __future__ import annotations

import torch

from inference.model import ModelConfig, RiskModel, TrainingReport
from tandem import modelstore

MODEL_NAME = "risk_model"


def register_production_model() -> str:
    """An untrained but deterministic model; what it scores is not the point, that it is served is."""
    torch.manual_seed(0)
    model = RiskModel(ModelConfig()).eval()
    report = TrainingReport(
        auc=0.5,
        train_rows=0,
        holdout_rows=0,
        epochs=0,
        parameter_count=model.parameter_count,
        flops_per_item=model.flops_per_item(),
    )
    tag = modelstore.register(model, report, name=MODEL_NAME, code_version="e2e")
    modelstore.promote(tag)
    return tag


if __name__ == "__main__":
    print(register_production_model(), flush=True)
