"""The code version stamped on every result row."""

from __future__ import annotations

import functools
import os
import subprocess
from importlib import metadata
from pathlib import Path


@functools.cache
def code_version() -> str:
    """`TANDEM_CODE_VERSION` if set (images), else the git revision, else the package version."""
    if explicit := os.environ.get("TANDEM_CODE_VERSION"):
        return explicit
    package = metadata.version("tandem")
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return package
    return f"{package}+g{revision}" if revision else package
