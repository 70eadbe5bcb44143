"""The project's import graph, read statically (ast), for the import-contract test.

Every import counts, also one inside a function or under TYPE_CHECKING: each is an arrow a reader
has to follow. Relative imports are resolved, and `from package import module` is an arrow to the module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a dotted name: a project module, or whatever a third-party import names
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.path.name}:{self.line})"


def modules_under(source_root: Path, package: str) -> dict[str, Path]:
    """Module name -> file for every .py of `package` under `source_root` (a package is its __init__.py)."""
    modules = {}
    for path in sorted((source_root / package).rglob("*.py")):
        parts = list(path.relative_to(source_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(modules: Mapping[str, Path]) -> list[Import]:
    """Every import in `modules`, each named by the project module it reaches when it reaches one."""
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _targets(node, package=package, known=modules):
                found.append(Import(importer=name, imported=target, path=path, line=node.lineno))
    return found


def _targets(node: ast.AST, *, package: str, known: Mapping[str, Path]) -> Iterable[str]:
    if isinstance(node, ast.Import):
        return [_known_prefix(alias.name, known) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else _known_prefix(module, known)
            for alias in node.names]


def _known_prefix(name: str, known: Mapping[str, Path]) -> str:
    """The longest project module `name` starts with (`import a.b.c` of module a.b: a.b), else `name` itself."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return name


def within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def graph(imports: Iterable[Import], *, modules: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the project modules (of `modules`) it imports."""
    names = set(modules)
    arrows: dict[str, set[str]] = {name: set() for name in names}
    for imp in imports:
        if imp.importer in names and imp.imported in names and imp.imported != imp.importer:
            arrows[imp.importer].add(imp.imported)
    return arrows


def cycles(arrows: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(arrows):
        if root in index:
            continue
        work = [(root, iter(sorted(arrows[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe_cycles(found: Sequence[list[str]], imports: Iterable[Import]) -> str:
    """Each cycle's modules, then the imports between them (what to cut)."""
    imports = list(imports)
    lines = []
    for component in found:
        members = set(component)
        lines.append(f"cycle of {len(component)} modules: {', '.join(component)}")
        lines += [f"    {arrow}" for arrow in dict.fromkeys(
            str(imp) for imp in imports if imp.importer in members and imp.imported in members
            and imp.importer != imp.imported)]
    return "\n".join(lines)
