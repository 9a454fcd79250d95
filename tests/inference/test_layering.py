"""The dependency rules (README.md, "Layout"; the contracts in pyproject.toml), enforced by
import-linter rather than by goodwill."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), f"import-linter is not installed next to {sys.executable}"
    result = subprocess.run(
        [str(lint_imports), "--config", str(REPO_ROOT / "pyproject.toml")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout
