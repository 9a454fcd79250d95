"""The dependency rules (docs/development.md, "Layout"; the contracts in pyproject.toml), enforced by
import-linter rather than by goodwill."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.shared import run_child

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), f"import-linter is not installed next to {sys.executable}"
    result = run_child([str(lint_imports), "--config", str(REPO_ROOT / "pyproject.toml")], cwd=REPO_ROOT, timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout
