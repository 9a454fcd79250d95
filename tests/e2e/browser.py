"""A real browser on the deployment's UI: where Chromium is, how it is started, and the screenshots
each UI test keeps.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.deployment import (
    keep_screenshot,
)

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str:
    path = os.environ.get("TANDEM_E2E_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("Chromium not found: apt-get install -y chromium (or set TANDEM_E2E_CHROMIUM)")
    return path


def screenshot(page: Any, screenshots: Path, name: str) -> Path:
    path = screenshots / name
    page.screenshot(path=str(path))
    keep_screenshot(path)
    assert path.stat().st_size > 10_000
    return path
