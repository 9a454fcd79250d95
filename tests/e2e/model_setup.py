"""Registers and promotes the deployment's production model: `python -m tests.e2e.model_setup`.

Run as a child process with the deployment's BENTOML_HOME: BentoML fixes its home once per process,
and the test session's home (tests/conftest.py) is not the deployment's. Prints the production tag.
"""

from __future__ import annotations

from tests.shared import register_untrained_model

MODEL_NAME = "risk_model"


def register_production_model() -> str:
    return register_untrained_model(MODEL_NAME, code_version="e2e")


if __name__ == "__main__":
    print(register_production_model(), flush=True)
