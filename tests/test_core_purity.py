"""House rule 1: ``gossiprec/core`` is sans-IO. No module there imports an event loop, sockets, clocks,
global randomness, the OS or threads; time and randomness are injected by the pumps (agent, simulator).

The check parses every module with :mod:`ast` (nothing is imported), so it also catches imports inside
functions and ``from x import y`` forms.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "gossiprec" / "core"
FORBIDDEN = frozenset({
    "asyncio", "socket", "time", "random", "os", "threading", "uvloop", "selectors", "subprocess",
})
MODULES = sorted(CORE.rglob("*.py"))


def forbidden_imports(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """(line, module) for every import of a forbidden top-level module in ``source``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN:
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[0] in FORBIDDEN:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                if node.args[0].value.split(".")[0] in FORBIDDEN:
                    found.append((node.lineno, node.args[0].value))
    return found


def test_core_package_has_the_expected_modules() -> None:
    names = {p.name for p in MODULES}
    assert {"config.py", "wire.py", "broadcast.py", "awareness.py", "membership.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(CORE)) for p in MODULES])
def test_core_module_imports_no_io_clock_or_global_randomness(path: Path) -> None:
    bad = forbidden_imports(path.read_text(encoding="utf-8"), str(path))
    assert not bad, f"{path.name} imports {bad}: inject time/randomness and keep I/O in the pumps"


@pytest.mark.parametrize("source, expected", [
    ("import time", ["time"]),
    ("import os.path", ["os.path"]),
    ("import asyncio as aio", ["asyncio"]),
    ("from random import Random", ["random"]),
    ("from socket import socket, AF_INET", ["socket"]),
    ("def f():\n    import threading\n", ["threading"]),
    ("from subprocess import run", ["subprocess"]),
    ("import uvloop, selectors", ["uvloop", "selectors"]),
    ("x = __import__('time')", ["time"]),
    ("import math, heapq\nfrom dataclasses import dataclass\nfrom . import wire", []),
    ("import timeit\nfrom osgeo import gdal\nimport randomness", []),  # prefixes are not the modules
])
def test_checker_itself_finds_direct_from_and_nested_imports(source: str, expected: list[str]) -> None:
    assert [m for _, m in forbidden_imports(source)] == expected
