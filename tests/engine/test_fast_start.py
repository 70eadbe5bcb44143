"""A Monarch run's controller starts spawning procs before it has loaded any model code: the recipes and the
actor classes they spawn import no torchtitan and no HF folder loader (actors/__init__.py), and neither does
the reward proc's scoring; the model procs import it where they build their model."""

from __future__ import annotations

import json
import subprocess
import sys

from workers.engine.actors.procs import REPO_ROOT

MODEL_CODE = ("torchtitan", "workers.engine.models.hf_folder", "workers.engine.models.titan",
              "workers.engine.models.attention")


def _imported_by(*modules: str) -> set[str]:
    """The top-level names among MODEL_CODE that importing `modules` in a fresh interpreter loads."""
    script = (f"import json, sys\nfor m in {list(modules)!r}:\n    __import__(m)\n"
              f"print(json.dumps(sorted(n for n in sys.modules if n in {list(MODEL_CODE)!r})))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_controller_and_its_actor_classes_import_no_model_code() -> None:
    assert _imported_by("workers.engine.recipes.grpo_monarch", "workers.engine.recipes.sft_monarch",
                        "workers.engine.actors.generator", "workers.engine.actors.reference",
                        "workers.engine.actors.reward", "workers.engine.actors.trainer",
                        "workers.engine.actors.sft_trainer", "workers.engine.scoring") == set()


def test_the_single_process_recipe_does_import_it() -> None:
    # the check above can fail: the single-process recipe builds its model in the controller
    assert _imported_by("workers.engine.recipes.grpo") >= {"torchtitan", "workers.engine.models.hf_folder"}
