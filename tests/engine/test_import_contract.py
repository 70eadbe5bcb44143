"""The import contract: no import cycle, and no arrow from a lower layer to a higher one.

Read statically from the source (tests/support/import_graph.py), every import counted, also one inside a
function: the engine imports nothing of the control plane or its launchers, the actors nothing of the recipes or
the Monarch controller's parts, those parts nothing of the recipes, and the control plane reaches Celery only
through its dispatch module.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.import_graph import Import, cycles, describe_cycles, graph, imports_of, modules_under, within

REPO = Path(__file__).resolve().parents[2]
PLATFORM = REPO / "platform"
DISPATCH = "forgeboard.dispatch"  # the one control-plane module that may import the Celery app and its tasks
ENGINE_MUST_NOT_IMPORT = ("forgeboard", "django", "celery", "workers.celery", "workers.tasks", "workers.launch",
                          "workers.agent")

MODULES = {**modules_under(REPO, "workers"), **modules_under(PLATFORM, "forgeboard"),
           **modules_under(PLATFORM, "forgeboard_client")}
IMPORTS = imports_of(MODULES)


def _arrows(imports: list[Import], *, from_: tuple[str, ...], to: tuple[str, ...],
            allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted({str(imp) for imp in imports if within(imp.importer, from_) and within(imp.imported, to)
                   and imp.importer not in allowed})


def test_the_engine_has_no_import_cycle() -> None:
    engine = [name for name in MODULES if within(name, ["workers.engine"])]
    found = cycles(graph(IMPORTS, modules=engine))
    assert not found, describe_cycles(found, IMPORTS)


def test_the_project_has_no_import_cycle() -> None:
    found = cycles(graph(IMPORTS, modules=MODULES))
    assert not found, describe_cycles(found, IMPORTS)


def test_the_engine_imports_no_control_plane_launcher_or_celery() -> None:
    assert _arrows(IMPORTS, from_=("workers.engine",), to=ENGINE_MUST_NOT_IMPORT) == []


def test_the_actors_import_no_recipe() -> None:
    assert _arrows(IMPORTS, from_=("workers.engine.actors",), to=("workers.engine.recipes",)) == []


def test_the_controller_sits_between_the_actors_and_the_recipes() -> None:
    """actors -> the Monarch controller's parts (workers.engine.controller) -> recipes/grpo_monarch.py and
    recipes/sft_monarch.py."""
    assert _arrows(IMPORTS, from_=("workers.engine.controller",), to=("workers.engine.recipes",)) == []
    assert _arrows(IMPORTS, from_=("workers.engine.actors",), to=("workers.engine.controller",)) == []
    outside = ("workers.engine.recipes.grpo_monarch", "workers.engine.recipes.sft_monarch", "workers.engine.controller")
    users = {imp.importer for imp in IMPORTS if within(imp.imported, ("workers.engine.controller",))
             and not within(imp.importer, outside)}
    assert {user for user in users if user.startswith("workers.")} == set(), "only the Monarch recipes wire the parts"


def test_the_control_plane_reaches_celery_only_through_its_dispatch_module() -> None:
    assert DISPATCH in MODULES
    assert _arrows(IMPORTS, from_=("forgeboard",), to=("workers.celery", "workers.tasks"), allowed=(DISPATCH,)) == []


def test_the_checker_finds_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def later():\n    from . import a\n",  # a cycle through a function-level relative import
        "low/__init__.py": "",
        "low/c.py": "import os\n\n\ndef f():\n    from ..high import d\n",  # low -> high: upward
        "high.py": "from pkg.low.c import f\nimport django.db\n",
    }.items():
        (package / name).write_text(text)
    modules = modules_under(tmp_path, "pkg")
    imports = imports_of(modules)

    assert cycles(graph(imports, modules=modules)) == [["pkg.a", "pkg.b"], ["pkg.high", "pkg.low.c"]]
    assert "cycle of 2 modules: pkg.a, pkg.b\n    pkg.a -> pkg.b (a.py:1)\n    pkg.b -> pkg.a (b.py:2)" in \
        describe_cycles(cycles(graph(imports, modules=modules)), imports)
    assert _arrows(imports, from_=("pkg.low",), to=("pkg.high",)) == ["pkg.low.c -> pkg.high (c.py:5)"]
    assert _arrows(imports, from_=("pkg",), to=("django",)) == ["pkg.high -> django.db (high.py:2)"]
    assert _arrows(imports, from_=("pkg",), to=("django",), allowed=("pkg.high",)) == []
