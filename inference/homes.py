"""Where Tandem keeps local state: the one default for TANDEM_DATA_DIR, BENTOML_HOME and DAGSTER_HOME.

Unset, all three are folders of one data directory: `<checkout>/data` when the code runs from a
checkout (pyproject.toml and workspace.yaml beside the packages), whatever the current directory,
so a plain `tandem` or `dagster` command reads what `make run` wrote; `./data` when Tandem is
installed as a package; under it, `<module>` for a TANDEM_MODEL_SPEC other than the default. A set
TANDEM_DATA_DIR moves the other two with it unless they are set too.

The packages tandem/ and orchestration/ call `apply_default_homes()` when imported, so every entry
point (the `tandem` CLI, the Dagster code location, `make run`, the BentoML service through tandem/)
has the defaults before bentoml reads BENTOML_HOME, which it does once per process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from inference.spec.loading import DEFAULT_SPEC_PATH

DATA_DIR = "TANDEM_DATA_DIR"
BENTOML_HOME = "BENTOML_HOME"
DAGSTER_HOME = "DAGSTER_HOME"
# Which of the three took the default, for this process's children too: once a default is in the
# environment it looks set, and an error's hint must still tell a default from a choice.
DEFAULTED = "TANDEM_HOMES_DEFAULTED"
MODEL_SPEC = "TANDEM_MODEL_SPEC"


@dataclass(frozen=True)
class Homes:
    data_dir: Path
    bentoml_home: Path
    dagster_home: Path
    defaulted: frozenset[str]  # the variables that were unset, so took the default

    def model_store_hint(self, looked_in: str | Path | None = None) -> str:
        """Where the model store was looked for and why there, for an error that found nothing."""
        where = Path(looked_in) if looked_in is not None else self.bentoml_home
        if where != self.bentoml_home:
            home = self.bentoml_home
            return f"the model store at {where} (read before BENTOML_HOME was set; export BENTOML_HOME={home})"
        if BENTOML_HOME in self.defaulted:
            return f"the model store at {where} (BENTOML_HOME unset: the default, under {self.data_dir})"
        default = (default_data_dir() if DATA_DIR in self.defaulted else self.data_dir) / "bentoml"
        return f"the model store at {where} (from BENTOML_HOME; unset, it would be {default})"


def project_root() -> Path | None:
    """The checkout this code runs from, or None when it runs from an installed package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "workspace.yaml").is_file() else None


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`data` for the default spec, `data/<module>` for any other TANDEM_MODEL_SPEC: a database, a
    landing folder and a model store belong to one spec, so changing the setting starts clean."""
    environ = os.environ if environ is None else environ
    data = (project_root() or Path.cwd()) / "data"
    spec = environ.get(MODEL_SPEC, "").strip()
    return data if spec in ("", DEFAULT_SPEC_PATH) else data / spec.partition(":")[0]


def resolve_homes(environ: Mapping[str, str] | None = None) -> Homes:
    """The three homes as `environ` (the process environment by default) gives them, defaults filled in."""
    environ = os.environ if environ is None else environ
    unset = {name for name in (DATA_DIR, BENTOML_HOME, DAGSTER_HOME) if not environ.get(name)}
    defaulted = frozenset(unset | set(filter(None, environ.get(DEFAULTED, "").split(","))))
    # Absolute: Dagster refuses a relative DAGSTER_HOME, and a child process may start elsewhere.
    data_dir = Path(environ[DATA_DIR]).resolve() if DATA_DIR not in unset else default_data_dir(environ)
    return Homes(
        data_dir=data_dir,
        bentoml_home=Path(environ[BENTOML_HOME]) if BENTOML_HOME not in unset else data_dir / "bentoml",
        dagster_home=Path(environ[DAGSTER_HOME]) if DAGSTER_HOME not in unset else data_dir / "dagster",
        defaulted=defaulted,
    )


def apply_default_homes(environ: MutableMapping[str, str] | None = None) -> Homes:
    """Set each unset home variable to its default, so that the frameworks and child processes read
    the same folders; returns the homes. A set variable is never changed."""
    environ = os.environ if environ is None else environ
    homes = resolve_homes(environ)
    values = {DATA_DIR: homes.data_dir, BENTOML_HOME: homes.bentoml_home, DAGSTER_HOME: homes.dagster_home}
    for name in homes.defaulted:
        if not environ.get(name):
            environ[name] = str(values[name])
    if homes.defaulted:
        environ[DEFAULTED] = ",".join(sorted(homes.defaulted))
    return homes
