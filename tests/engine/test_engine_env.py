"""The engine's environment variables: one table (workers/engine/env.py), the README's section is that table,
and every FORGEBOARD_ name in the engine's source is in it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from workers.engine.env import GPUS_PER_HOST_ENV, TORCH_THREADS_ENV, VARIABLES, EnvValueError, read_env, read_number

ENGINE = Path(__file__).resolve().parents[2] / "workers" / "engine"
SECTION = "## Environment variables"


def _readme_section() -> str:
    text = (ENGINE / "README.md").read_text()
    assert SECTION in text
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def _table() -> str:
    rows = [f"| `{v.name}` | {v.type} | {'' if v.default is None else f'`{v.default}`'} | {v.meaning} |"
            for v in VARIABLES.values()]
    return "\n".join(["| variable | type | default | meaning |", "|---|---|---|---|", *rows])


def test_the_readme_section_is_the_table() -> None:
    assert _table() in _readme_section(), f"the README's {SECTION!r} section should hold:\n{_table()}"


def test_every_forgeboard_name_in_the_engine_is_in_the_table() -> None:
    named = set()
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update(re.findall(r"\bFORGEBOARD_[A-Z0-9_]+\b", node.value))
    assert named and sorted(named - set(VARIABLES)) == []


def _environ_reads(tree: ast.AST) -> list[ast.expr]:
    """The keys of `os.environ.get(key)`, `os.getenv(key)` and `os.environ[key]` (read, not written)."""
    def is_environ(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
            and node.value.id == "os"

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                (node.func.attr == "get" and is_environ(node.func.value))
                or (node.func.attr == "getenv" and isinstance(node.func.value, ast.Name) and node.func.value.id == "os")):
            keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            keys.append(node.slice)
    return keys


def test_the_engine_reads_the_tables_variables_only_through_its_readers() -> None:
    direct = []
    for path in ENGINE.rglob("*.py"):
        if path.name == "env.py":
            continue
        for key in _environ_reads(ast.parse(path.read_text())):
            if (isinstance(key, ast.Constant) and key.value in VARIABLES) or \
                    (isinstance(key, ast.Name) and key.id.endswith("_ENV")):
                direct.append(f"{path.relative_to(ENGINE)}:{key.lineno}")
    assert direct == []


def test_a_bad_value_names_the_variable() -> None:
    assert read_number(GPUS_PER_HOST_ENV, {}) is None
    assert read_number(GPUS_PER_HOST_ENV, {GPUS_PER_HOST_ENV: " 8 "}) == 8
    assert read_number(TORCH_THREADS_ENV, {}) == 1  # the table's default
    with pytest.raises(EnvValueError, match=r"ENGINE_TORCH_THREADS: expected a number of threads, got '-2'"):
        read_number(TORCH_THREADS_ENV, {TORCH_THREADS_ENV: "-2"})
    with pytest.raises(KeyError):
        read_env("FORGEBOARD_NOT_IN_THE_TABLE", {})
