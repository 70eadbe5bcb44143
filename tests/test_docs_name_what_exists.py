"""The docs name only what exists. In every tracked Markdown file, each path named in a code span or as a word ending
in a path suffix (in prose or a code block) must exist, and so must the name of each "`path.py` → `name`",
"`path.py` (`name` ...)" or "`path.py` `name`" pair: a top-level def, class or assignment of that file, or
"Class.member". In every docstring under workers/ and platform/, each name ending in .py must exist, and its pairs too.

What counts as a path: a name without spaces, "*", "<", ">", "{", "}", "$", "=", "|" or ":" (URLs, globs,
placeholders, commands, settings), not starting with "/", "~" or "-", that ends in a path suffix (in Markdown also
"/"), or starts with one of the repository's top-level folders. So metric names such as `data/train_tokens` are not.
A path resolves against the naming file's folder and its parent, the folders in BASES, and, for a code span, the
folders of the paths named in code spans before it in the same paragraph (a table row or a list item is a paragraph of
its own): "`frontend/static/js/` (`run_page.js`)". A path that git ignores (made at run time: `var/`,
`infra/secrets/`) is not checked.
"""

from __future__ import annotations

import ast
import posixpath
import re
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[1]
PATH_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".js", ".html", ".md", ".toml")
BASES = ("", "workers/engine", "platform/forgeboard", "platform")
DOCSTRING_ROOTS = ("workers/", "platform/")
DOCUMENTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
VENDORED = ("node_modules", "vendor")
NOT_IN_A_PATH = re.compile(r"[\s*<>{}$=|:]")
CODE_SPAN = re.compile(r"`([^`]+)`")
FENCED_BLOCK = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.MULTILINE | re.DOTALL)
BARE_PATH = re.compile(rf"(?<![\w./-])[\w./-]+(?:{'|'.join(map(re.escape, PATH_SUFFIXES))})(?![\w/-])")
NAME_PAIR = re.compile(r"`(?P<path>[^`\s]+\.py)`(?:\s*→\s*|\s*\(\s*|\s+)`(?P<name>[A-Za-z_][\w.]*)`")


@cache
def tracked() -> tuple[frozenset[str], frozenset[str]]:
    """The files git tracks and the folders that hold them, as repository-relative posix paths."""
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_DIR, capture_output=True, text=True, check=True)
    files = frozenset(p for p in listing.stdout.split("\0") if p)
    folders = {posixpath.dirname(p) for p in files}
    for folder in list(folders):
        while folder:
            folder = posixpath.dirname(folder)
            folders.add(folder)
    return files, frozenset(folders)


def top_level_folders() -> tuple[str, ...]:
    return tuple(sorted(f + "/" for f in tracked()[1] if f and "/" not in f))


def git_ignores(paths: list[str]) -> set[str]:
    if not paths:
        return set()
    result = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO_DIR, input="\n".join(paths),
                            capture_output=True, text=True, check=False)  # exit 1: none ignored
    return set(result.stdout.split())


def looks_like_a_path(name: str, endings: tuple[str, ...]) -> bool:
    if NOT_IN_A_PATH.search(name) or name.startswith(("/", "~", "-")):
        return False
    return name.endswith(endings) or name.startswith(top_level_folders())


def resolve(name: str, folders: list[str]) -> tuple[str | None, list[str]]:
    """The tracked file or folder that name is under one of folders, else None; and every candidate tried."""
    files, dirs = tracked()
    candidates = []
    for folder in folders:
        candidate = posixpath.normpath(posixpath.join(folder, name))
        if candidate.startswith(".."):
            continue
        candidates.append(candidate + "/" if name.endswith("/") else candidate)
        if candidate in files or candidate in dirs:
            return candidates[-1], candidates
    return None, candidates


@cache
def defined_names(path: str) -> frozenset[str]:
    """A module's top-level functions, classes and assignments, and each class's as "Class.member"."""
    tree = ast.parse((REPO_DIR / path).read_text())
    names: set[str] = set()

    def collect(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef) and not prefix:
                    collect(node.body, node.name + ".")
            elif isinstance(node, ast.Assign):
                names.update(prefix + t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(prefix + node.target.id)
            elif isinstance(node, (ast.If, ast.Try)):
                collect(node.body + node.orelse + getattr(node, "finalbody", []), prefix)

    collect(tree.body, "")
    return frozenset(names)


@dataclass
class Miss:
    source: str
    line: int
    reference: str
    why: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: `{self.reference}` {self.why}"


@dataclass
class Checker:
    """The references of one text (a Markdown file or a docstring) whose own folders are own_folders."""

    source: str
    first_line: int
    own_folders: list[str]
    endings: tuple[str, ...]
    misses: list[Miss] = field(default_factory=list)
    ignorable: list[tuple[Miss, list[str]]] = field(default_factory=list)

    def check_path(self, name: str, line: int, context: list[str]) -> str | None:
        found, candidates = resolve(name, [*self.own_folders, *BASES, *context])
        if found is None:
            self.ignorable.append((Miss(self.source, line, name, "names no file or folder in the repository"),
                                   candidates))
        return found

    def check_paragraph(self, text: str, first_line: int) -> None:
        def line_of(offset: int) -> int:
            return first_line + text.count("\n", 0, offset)

        context: list[str] = []
        resolved: dict[int, str] = {}
        for span in CODE_SPAN.finditer(text):
            name = span.group(1)
            if looks_like_a_path(name, self.endings):
                found = self.check_path(name, line_of(span.start()), context)
                if found:
                    resolved[span.start()] = found
                    context.append(found.rstrip("/") if name.endswith("/") else posixpath.dirname(found))
        for pair in NAME_PAIR.finditer(text):
            path, name = resolved.get(pair.start()), pair.group("name")
            if path and not name.endswith(PATH_SUFFIXES) and name not in defined_names(path):
                self.misses.append(Miss(self.source, line_of(pair.start("name")), name,
                                        f"is not defined in {path} (no top-level def, class or assignment)"))
        self.check_words(CODE_SPAN.sub(lambda span: re.sub(r"[^\n]", " ", span.group(0)), text), first_line)

    def check_text(self, text: str) -> None:
        """Each paragraph apart: blank lines end one, and each table row or list item starts one."""
        line = self.first_line
        for part in re.split(r"(\n\s*\n|\n(?=\s*(?:\||- |\d+\. )))", text):
            if part and not part.isspace():
                self.check_paragraph(part, line)
            line += part.count("\n")

    def check_words(self, text: str, first_line: int) -> None:
        """Names ending in a path suffix outside code spans: prose, code blocks, commands."""
        for word in BARE_PATH.finditer(text):
            if looks_like_a_path(word.group(0), self.endings):
                self.check_path(word.group(0), first_line + text.count("\n", 0, word.start()), [])

    def result(self) -> list[Miss]:
        ignored = git_ignores([c for _, candidates in self.ignorable for c in candidates])
        missing = [m for m, candidates in self.ignorable if not ignored & set(candidates)]
        return sorted([*self.misses, *missing], key=lambda m: m.line)


def markdown_misses(text: str, *, source: str, folder: str) -> list[Miss]:
    """A Markdown file's references: its code spans and words ending in a path suffix, and those words in its fenced
    code blocks."""
    checker = Checker(source, 1, [folder, posixpath.dirname(folder)], (*PATH_SUFFIXES, "/"))
    checker.check_text(FENCED_BLOCK.sub(lambda block: re.sub(r"[^\n]", " ", block.group(0)), text))
    for block in FENCED_BLOCK.finditer(text):
        checker.check_words(block.group(0), 1 + text.count("\n", 0, block.start()))
    return checker.result()


def docstring_misses(source_text: str, *, source: str, folder: str) -> list[Miss]:
    """Every docstring's (module, class, function) names ending in .py, in code spans or not, and its pairs."""
    misses = []
    tree = ast.parse(source_text)
    for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, DOCUMENTED))]:
        docstring = ast.get_docstring(node, clean=False)
        if docstring is not None:
            checker = Checker(source, node.body[0].lineno, [folder, posixpath.dirname(folder)], (".py",))
            checker.check_text(docstring)
            misses += checker.result()
    return misses


def tracked_markdown() -> list[str]:
    return sorted(p for p in tracked()[0] if p.endswith(".md") and not set(p.split("/")) & set(VENDORED))


def tracked_modules() -> list[str]:
    return sorted(p for p in tracked()[0] if p.endswith(".py") and p.startswith(DOCSTRING_ROOTS))


def test_every_markdown_file_names_only_what_exists() -> None:
    files = tracked_markdown()
    assert "README.md" in files and "workers/engine/README.md" in files
    misses = [m for path in files
              for m in markdown_misses((REPO_DIR / path).read_text(), source=path, folder=posixpath.dirname(path))]
    assert not misses, "stale references:\n" + "\n".join(map(str, misses))


def test_every_docstring_names_only_files_that_exist() -> None:
    modules = tracked_modules()
    assert "workers/engine/recipes/grpo_monarch.py" in modules
    misses = [m for path in modules
              for m in docstring_misses((REPO_DIR / path).read_text(), source=path, folder=posixpath.dirname(path))]
    assert not misses, "stale references:\n" + "\n".join(map(str, misses))


def test_the_checks_find_a_stale_reference_and_pass_a_good_one(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "| where | `workers/engine/config.py` → `RunConfig`; `workers/engine/gone_away.py` |\n"
        "| class | `workers/engine/actors/hosts.py` (`Hosts.spawn_across`: one mesh) |\n"
        "| names | `workers/engine/config.py` (`NoSuchThing`: moved) and `controller/` (`state.py`, `lost.py`) |\n"
        "\n"
        "Not paths: `https://x.example/a.py`, `timeline/*`, `/ws/runs/<id>/`, `data/train_tokens`, `var/x/y.py`,\n"
        "`python -m workers.engine train`, `run:<id>@step:<n>`.\n"
        "\n"
        "    python tests/test_code_health.py examples/configs/nowhere.yaml\n"
    )
    misses = markdown_misses(readme.read_text(), source="README.md", folder="")
    assert [(m.line, m.reference) for m in misses] == [
        (1, "workers/engine/gone_away.py"), (3, "NoSuchThing"), (3, "lost.py"), (8, "examples/configs/nowhere.yaml")]

    module = tmp_path / "module.py"
    module.write_text('"""Over `controller/state.py` and `step_end.py`,\nnot `controller/stale.py`."""\n\n\n'
                      'def f():\n    """As in tests/engine/test_step_end.py, not tests/engine/test_gone.py."""\n')
    misses = docstring_misses(module.read_text(), source="module.py", folder="workers/engine/recipes")
    assert [(m.line, m.reference) for m in misses] == [(2, "controller/stale.py"), (6, "tests/engine/test_gone.py")]
