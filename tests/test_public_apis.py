"""Product code uses the frameworks' public APIs only: no private module or name of another package
is imported, and nothing is assigned into another package's modules or classes. A patch release may
change anything private without a word; this keeps such a change from reaching the product unseen."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("inference", "tandem", "assets", "orchestration", "serving")
# The one adapter for an essential value with no public hook, each with its decision record.
ADAPTERS = {"tandem/bentoml_home.py": "docs/decisions/0011-bentoml-home-adapter.md"}
# Python's own modules are the platform, not a package a patch release changes under us.
OWN = {*PRODUCT_PACKAGES, "__future__", *sys.stdlib_module_names}


def _private(dotted: str) -> bool:
    return any(
        part.startswith("_") and not (part.startswith("__") and part.endswith("__")) for part in dotted.split(".")
    )


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def violations(source: str) -> Iterator[str]:
    """Each private import of another package and each assignment into one, as `line: what`."""
    tree = ast.parse(source)
    foreign: set[str] = set()  # names bound to another package's modules, classes and functions
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OWN:
                    continue
                if _private(alias.name):
                    yield f"{node.lineno}: import {alias.name}"
                foreign.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module.split(".")[0] in OWN:
                continue
            if _private(node.module):
                yield f"{node.lineno}: from {node.module} import ..."
            for alias in node.names:
                if _private(alias.name):
                    yield f"{node.lineno}: from {node.module} import {alias.name}"
                foreign.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and _root(node.args[0]) in foreign:
                yield f"{node.lineno}: {node.func.id} on {_root(node.args[0])}"
            continue
        for target in targets:
            if isinstance(target, ast.Attribute | ast.Subscript) and _root(target) in foreign:
                yield f"{node.lineno}: assigns into {ast.unparse(target)}"


def product_modules() -> list[Path]:
    return sorted(path for package in PRODUCT_PACKAGES for path in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", product_modules(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_product_code_uses_public_apis_only(path: Path) -> None:
    name = path.relative_to(ROOT).as_posix()
    found = list(violations(path.read_text()))
    if name in ADAPTERS:
        assert found, f"{name} no longer needs a private name: it is no adapter, drop it from ADAPTERS"
        assert name in (ROOT / ADAPTERS[name]).read_text(), f"{ADAPTERS[name]} must name {name}"
        return
    assert not found, f"{name}: " + "; ".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from _bentoml_impl.server.app import ServiceAppFactory",
        "from bentoml._internal.server.http.traffic import TimeoutMiddleware",
        "import uvicorn.protocols.http.httptools_impl as _h\nfrom uvicorn.main import _private_thing",
        "from uvicorn.config import HTTP_PROTOCOLS\nHTTP_PROTOCOLS['auto'] = 'x'",
        "import uvicorn\nuvicorn.config.LOOP_SETUPS['auto'] = 'x'",
        "from bentoml import Service\nService.middlewares = property(lambda self: [])",
        "from starlette.applications import Starlette\nsetattr(Starlette, 'build_middleware_stack', None)",
    ],
)
def test_the_rule_catches_private_imports_and_patches(source: str) -> None:
    assert list(violations(source)), source


def test_the_rule_lets_public_use_and_own_assignments_pass() -> None:
    source = (
        "import bentoml\nfrom starlette.requests import Request\nfrom serving._x import y\n"
        "class Own:\n    pass\nOwn.value = 1\nscope = {}\nscope['state'] = {}\n"
        "def f(request: Request) -> None:\n    request.state.call = 1\n"
    )
    assert list(violations(source)) == []
