"""The Dagster instance of a checkout: DAGSTER_HOME's folder, its dagster.yaml, and the `.env` file
through which a plain `dagster` command finds it.

The dagster CLI opens its instance before it loads any Tandem code, from DAGSTER_HOME or from a
`.env` file in the current directory; so the default of inference/homes.py reaches it only through
that file. Its line keeps an exported DAGSTER_HOME (`${DAGSTER_HOME:-...}`): Dagster lets `.env`
override the environment, and an unconditional value would move `make run`'s or a test's instance.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from inference.homes import DAGSTER_HOME, Homes, project_root

logger = logging.getLogger(__name__)

DOTENV_HEADER = "# Written by Tandem (orchestration/instance.py)"


def instance_config() -> Path:
    """The instance config for this environment: PostgreSQL storage when DAGSTER_POSTGRES_URL is set."""
    name = "dagster-postgres.yaml" if os.environ.get("DAGSTER_POSTGRES_URL") else "dagster.yaml"
    return Path(__file__).parent / name


def dotenv_text(dagster_home: Path) -> str:
    return (
        f"{DOTENV_HEADER}: the dagster CLI reads .env from the current directory, so this\n"
        "# points a plain `dagster` command in this checkout at the instance `make run` uses.\n"
        "# An exported DAGSTER_HOME still wins. Remove the header line to keep the file as your own.\n"
        f'DAGSTER_HOME="${{DAGSTER_HOME:-{dagster_home}}}"\n'
    )


def ensure_checkout_instance(homes: Homes) -> None:
    """Where DAGSTER_HOME takes the checkout's default: create that folder with its dagster.yaml
    (`make run` installs it afresh each start) and the checkout's `.env` naming it. A `.env` of the
    user's own (no header) is left alone."""
    root = project_root()
    if root is None or DAGSTER_HOME not in homes.defaulted:
        return
    dotenv = root / ".env"
    try:
        homes.dagster_home.mkdir(parents=True, exist_ok=True)
        config = homes.dagster_home / "dagster.yaml"
        if not config.exists():
            _replace(config, instance_config().read_text())
        wanted = dotenv_text(homes.dagster_home)
        current = dotenv.read_text() if dotenv.exists() else None
        if current is None or (current.startswith(DOTENV_HEADER) and current != wanted):
            _replace(dotenv, wanted)
        elif not current.startswith(DOTENV_HEADER) and DAGSTER_HOME not in current:
            logger.warning(
                "%s sets no DAGSTER_HOME: a plain `dagster` command here uses a temporary instance, not %s; "
                'add DAGSTER_HOME="${DAGSTER_HOME:-%s}" to it',
                dotenv,
                homes.dagster_home,
                homes.dagster_home,
            )
    except OSError as error:
        logger.warning(
            "cannot prepare the Dagster instance at %s (%s): export DAGSTER_HOME for the dagster CLI",
            homes.dagster_home,
            error,
        )


def _replace(path: Path, text: str) -> None:
    """Write `path` atomically: several processes of one checkout may start at once."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(handle, "w") as stream:
        stream.write(text)
    os.replace(temporary, path)
