"""The folder BentoML itself opened as its home: the one adapter for a value BentoML resolves once per
process (BENTOML_HOME, else ~/bentoml) and exports no public name for (docs/decisions/0011).

Tandem's production and challenger pointers live beside BentoML's model store, so they must follow
the home BentoML really uses, not the environment variable, which a process may set too late.
tests/tandem/test_modelstore.py fails on the BentoML upgrade that moves it.
"""

from __future__ import annotations

from pathlib import Path

from bentoml._internal.configuration.containers import BentoMLContainer


def bentoml_home() -> Path:
    return Path(BentoMLContainer.bentoml_home.get())
