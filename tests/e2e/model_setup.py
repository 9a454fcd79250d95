"""Registers the deployment's models: `python -m tests.e2e.model_setup` registers and promotes the
production model; `--candidate` registers another version without promoting it (the test then
promotes it with `tandem models promote`, as an operator does), `--challenger` a third (the test
sets it with `tandem models challenge`). Prints the tag.

Run as a child process with the deployment's BENTOML_HOME: BentoML fixes its home once per process,
and the test session's home (tests/conftest.py) is not the deployment's.
"""

from __future__ import annotations

import sys

from tests.shared import register_untrained_model

MODEL_NAME = "risk_model"


def register_production_model() -> str:
    return register_untrained_model(MODEL_NAME, code_version="e2e")


def register_candidate_model() -> str:
    return register_untrained_model(MODEL_NAME, code_version="e2e", seed=1, promote=False)


def register_challenger_model() -> str:
    return register_untrained_model(MODEL_NAME, code_version="e2e", seed=2, promote=False)


if __name__ == "__main__":
    roles = {"--candidate": register_candidate_model, "--challenger": register_challenger_model}
    tag = roles.get(sys.argv[1] if len(sys.argv) > 1 else "", register_production_model)()
    print(tag, flush=True)
