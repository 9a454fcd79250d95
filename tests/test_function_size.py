"""No function in a product package is longer than MAX_FUNCTION_LINES: past that a reader cannot
see a function's steps at a glance, and its parts want names of their own."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
# The product packages held to the limit: a new one joins once it has no longer function, never
# with per-function exemptions, which would let the next long function in unseen.
PACKAGES_HELD_TO_THE_LIMIT = ("inference", "serving", "tandem", "assets", "orchestration")
PRODUCT_PACKAGES = ("inference", "tandem", "assets", "orchestration", "serving")


def function_lengths(source: str) -> Iterator[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method in `source`, nested ones included,
    from its `def` line to its last line (decorators not counted)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def long_functions(package: str) -> list[str]:
    found = []
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        for name, line, lines in function_lengths(path.read_text()):
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(REPO_ROOT)}:{line} {name}: {lines} lines")
    return found


@pytest.mark.parametrize("package", PACKAGES_HELD_TO_THE_LIMIT)
def test_no_function_is_longer_than_the_limit(package: str) -> None:
    assert long_functions(package) == [], f"split these into named steps of at most {MAX_FUNCTION_LINES} lines"


def test_the_packages_held_to_the_limit_are_product_packages() -> None:
    assert set(PACKAGES_HELD_TO_THE_LIMIT) <= set(PRODUCT_PACKAGES)
    assert all((REPO_ROOT / package / "__init__.py").exists() for package in PACKAGES_HELD_TO_THE_LIMIT)


def test_a_function_is_measured_from_its_def_to_its_last_line() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # one line over with the def
    source = f"@decorated\ndef long():\n{body}\n\nclass C:\n    async def short(self):\n        return 1\n"
    assert sorted(function_lengths(source)) == [
        ("long", 2, MAX_FUNCTION_LINES + 1),
        ("short", MAX_FUNCTION_LINES + 6, 2),
    ]


# serving/ is the request path a newcomer reads first; past this a module holds two subjects.
MAX_SERVING_MODULE_LINES = 400


def test_no_serving_module_is_longer_than_the_limit() -> None:
    long_modules = {
        path.relative_to(REPO_ROOT).as_posix(): lines
        for path in sorted((REPO_ROOT / "serving").glob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_SERVING_MODULE_LINES
    }
    assert long_modules == {}, f"split these modules: {long_modules}"
