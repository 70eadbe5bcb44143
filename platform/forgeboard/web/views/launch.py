"""The Launch page: pick or create an experiment, edit a config (validated live), place it, launch; and cloning a run.

Thin: reads through selectors, writes through `experiment_create` and `run_launch` (which check the role and
audit). Bad input comes back at its field: config problems with their YAML line, the rest by form field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods
from yaml.nodes import MappingNode, ScalarNode

from forgeboard.accounts.models import Project, Role
from forgeboard.accounts.permissions import project_role, require_project_role
from forgeboard.api.configs import ConfigProblem, config_problems, yaml_line_of
from forgeboard.cluster.selectors import hosts_with_devices
from forgeboard.errors import PermissionDenied, ServiceError, ValidationFailed
from forgeboard.experiments.models import Experiment, Recipe
from forgeboard.experiments.selectors import experiments_for_project
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.web.errors import error_page, project_or_404, run_or_404

NEW_EXPERIMENT = "new"
# The roles whose processes a recipe starts (see runs/scheduling.py:run_demand): pinning a run to hosts pins these.
PLACEMENT_ROLES = {"sft": ["trainer"], "grpo": ["trainer", "generator", "reference", "reward", "replay_buffer"]}
_PLACEMENT_OVERRIDE = re.compile(r"^placement\.(\w+)\.hosts=(.*)$")
PRESET_LABELS = {"cpu_demo_sft": "CPU demo: tiny Qwen3, SFT", "cpu_demo_grpo": "CPU demo: tiny Qwen3, GRPO",
                 "qwen3_1_7b_grpo": "Qwen3 1.7B, GRPO (one GPU)", "llama3_8b_grpo": "Llama 3.1 8B, GRPO (one GPU)"}
VIEWER_NOTICE = "Viewers cannot launch runs: ask an owner of this project for the member role."


@dataclass(frozen=True)
class Preset:
    key: str
    label: str
    recipe: str
    yaml: str


@dataclass
class LaunchForm:
    """What the page shows in its fields, and the problems found with them."""

    experiment: str = ""
    new_name: str = ""
    new_recipe: str = Recipe.GRPO.value
    preset: str = ""
    config_yaml: str = ""
    overrides: str = ""
    priority: str = "0"
    hosts: list[str] = field(default_factory=list)
    errors: dict[str, list[str]] = field(default_factory=dict)
    config_errors: list[ConfigProblem] = field(default_factory=list)

    def add(self, name: str, message: str) -> None:
        self.errors.setdefault(name, []).append(message)

    @property
    def yaml_errors(self) -> list[ConfigProblem]:
        """Config problems shown at the editor; those set by an override are shown at the overrides."""
        return [p for p in self.config_errors if not (p.override or p.field == "overrides")]

    @property
    def override_errors(self) -> list[ConfigProblem]:
        return [p for p in self.config_errors if p.override or p.field == "overrides"]


def demo_model_dir() -> Path:
    """Where the CPU demo's tiny Qwen3 lives (seed_demo --launch builds it)."""
    return Path(settings.DATA_DIR) / "models" / "tiny-qwen3"


def _set_yaml_scalar(text: str, path: list[str], value: str) -> str:
    """The YAML text with the scalar at `path` replaced, comments and layout kept."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    for part in path:
        if not isinstance(node, MappingNode):
            return text
        node = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
    if not isinstance(node, ScalarNode):
        return text
    literal = value if re.fullmatch(r"[\w./-]+", value) else json.dumps(value)
    return text[:node.start_mark.index] + literal + text[node.end_mark.index:]


def launch_presets() -> list[Preset]:
    """Model presets from examples/configs; the CPU demo ones point model.path at the demo model folder (inside the
    default artifact roots, FORGEBOARD_ARTIFACT_ROOTS; seed_demo also registers it as the demo project's `tiny-qwen3`)."""
    presets = []
    for path in sorted((Path(settings.REPO_DIR) / "examples" / "configs").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        recipe = str((yaml.safe_load(text) or {}).get("recipe", ""))
        if path.stem.startswith("cpu_demo"):
            text = _set_yaml_scalar(text, ["model", "path"], str(demo_model_dir()))
        label = PRESET_LABELS.get(path.stem, f"{path.stem.replace('_', ' ')} ({recipe})")
        presets.append(Preset(key=path.stem, label=label, recipe=recipe, yaml=text))
    return sorted(presets, key=lambda p: (not p.key.startswith("cpu_demo"), p.key))


def placement_overrides(*, recipe: str, hosts: list[str]) -> list[str]:
    """Overrides that pin every role of the recipe to these hosts (nothing when no host is chosen)."""
    if not hosts:
        return []
    return [f"placement.{role}.hosts={json.dumps(hosts)}" for role in PLACEMENT_ROLES.get(recipe, ["trainer"])]


def _split_overrides(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _context(request: HttpRequest, *, project: Project, form: LaunchForm, clone_of: Run | None = None) -> dict:
    role = project_role(actor=request.user, project=project)
    can_launch = role is not None and role.rank >= Role.MEMBER.rank
    experiments = list(experiments_for_project(project=project).order_by("name"))
    presets = launch_presets()
    return {
        "project": project,
        "role": role,
        "can_launch": can_launch,
        "viewer_notice": VIEWER_NOTICE,
        "experiments": experiments,
        "recipes": Recipe.choices,
        "presets": presets,
        "presets_json": [{"key": p.key, "label": p.label, "recipe": p.recipe, "yaml": p.yaml} for p in presets],
        "placement_roles": PLACEMENT_ROLES,
        "hosts": list(hosts_with_devices().order_by("hostname")),
        "form": form,
        "config_lines": range(1, form.config_yaml.count("\n") + 2),
        "clone_of": clone_of,
        "demo_model": demo_model_dir(),
        "demo_model_missing": not (demo_model_dir() / "config.json").is_file(),
        "new_experiment": NEW_EXPERIMENT,
    }


def _initial_form(project: Project, *, experiment_id: str = "") -> LaunchForm:
    experiments = experiments_for_project(project=project).order_by("name")
    chosen = next((e for e in experiments if str(e.pk) == experiment_id), None) or experiments.first()
    recipe = chosen.recipe if chosen else Recipe.GRPO.value
    preset = next((p for p in launch_presets() if p.recipe == recipe), None)
    return LaunchForm(experiment=str(chosen.pk) if chosen else NEW_EXPERIMENT, new_recipe=recipe,
                      preset=preset.key if preset else "", config_yaml=preset.yaml if preset else "")


def _clone_form(run: Run) -> LaunchForm:
    """The cloned run's YAML and overrides; its host pinning goes back into the hosts choice (when those hosts
    are still in the inventory; otherwise the override line is kept as it was)."""
    known = set(hosts_with_devices().values_list("hostname", flat=True))
    hosts: list[str] = []
    overrides = []
    for line in run.config.overrides:
        match = _PLACEMENT_OVERRIDE.match(line)
        try:
            pinned = json.loads(match.group(2)) if match else None
        except ValueError:
            pinned = None
        if isinstance(pinned, list) and pinned and all(isinstance(h, str) and h in known for h in pinned):
            hosts.extend(h for h in pinned if h not in hosts)
        else:
            overrides.append(line)
    return LaunchForm(experiment=str(run.experiment_id), new_recipe=run.experiment.recipe, config_yaml=run.config.yaml_text,
                      overrides="\n".join(overrides), priority=str(run.priority), hosts=hosts)


def _form_from_post(request: HttpRequest) -> LaunchForm:
    post = request.POST
    return LaunchForm(
        experiment=post.get("experiment", ""), new_name=post.get("new_name", ""),
        new_recipe=post.get("new_recipe", ""), preset=post.get("preset", ""),
        config_yaml=post.get("config_yaml", "").replace("\r\n", "\n"), overrides=post.get("overrides", ""),
        priority=post.get("priority", "0").strip() or "0", hosts=post.getlist("hosts"),
    )


def _submit(request: HttpRequest, *, project: Project, form: LaunchForm, parent: Run | None) -> Run | None:
    """Check every field, then create the experiment (if new) and launch, all or nothing; None if the form has errors."""
    experiment: Experiment | None = None
    if form.experiment == NEW_EXPERIMENT:
        if form.new_recipe not in Recipe.values:
            form.add("new_recipe", f"choose one of {', '.join(Recipe.values)}")
        if not form.new_name.strip():
            form.add("new_name", "name the new experiment")
        recipe = form.new_recipe
    else:
        experiment = experiments_for_project(project=project).filter(pk=form.experiment).first() \
            if form.experiment.isdigit() and len(form.experiment) < 19 else None
        if experiment is None:
            form.add("experiment", "choose an experiment of this project, or create one")
        recipe = experiment.recipe if experiment else ""
    try:
        priority = int(form.priority)
    except ValueError:
        priority = None
    if priority is None or not -100 <= priority <= 100:
        form.add("priority", "must be a whole number from -100 to 100")
    known = set(hosts_with_devices().values_list("hostname", flat=True))
    unknown = [h for h in form.hosts if h not in known]
    if unknown:
        form.add("hosts", f"not in the cluster inventory: {', '.join(unknown)}")
    overrides = _split_overrides(form.overrides) + placement_overrides(recipe=recipe, hosts=form.hosts)
    if recipe in Recipe.values:
        form.config_errors = config_problems(yaml_text=form.config_yaml, overrides=overrides, recipe=recipe,
                                             project=project)
    if form.errors or form.config_errors:
        return None
    try:
        with transaction.atomic():
            if experiment is None:
                experiment = experiment_create(actor=request.user, project=project, name=form.new_name, recipe=recipe)
            return run_launch(actor=request.user, experiment=experiment, config_yaml=form.config_yaml,
                              overrides=overrides, priority=priority, parent=parent)
    except ValidationFailed as exc:
        for problem in exc.problems:
            name = {"name": "new_name", "recipe": "new_recipe"}.get(problem.field, problem.field)
            if name.startswith("config"):
                path = name.removeprefix("config").removeprefix(".")
                form.config_errors.append(ConfigProblem(path, problem.message, line=yaml_line_of(form.config_yaml, path)))
            else:
                form.add(name if name in {"new_name", "new_recipe", "priority", "overrides"} else "form", problem.message)
        if not exc.problems:
            form.add("form", exc.message)
        return None


def _launch_page(request: HttpRequest, *, project: Project, clone_of: Run | None = None) -> HttpResponse:
    if request.method == "GET":
        form = _clone_form(clone_of) if clone_of else _initial_form(project, experiment_id=request.GET.get("experiment", ""))
        return render(request, "web/launch.html", _context(request, project=project, form=form, clone_of=clone_of))
    try:
        require_project_role(actor=request.user, project=project, minimum=Role.MEMBER, action="launching runs")
    except PermissionDenied as exc:  # a viewer's forged POST: refused before anything is read or stored
        return error_page(request, exc)
    form = _form_from_post(request)
    try:
        run = _submit(request, project=project, form=form, parent=clone_of)
    except ServiceError as exc:  # refused by a service (e.g. the role changed meanwhile)
        return error_page(request, exc)
    if run is None:
        context = _context(request, project=project, form=form, clone_of=clone_of)
        return render(request, "web/launch.html", context, status=400)
    messages.success(request, f"Launched {run.experiment.name} #{run.number}: queued.")
    return redirect("run_detail", run.pk)


@login_required
@require_http_methods(["GET", "POST"])
def launch(request: HttpRequest, slug: str) -> HttpResponse:
    project = project_or_404(request, slug)
    return _launch_page(request, project=project)


@login_required
@require_http_methods(["GET", "POST"])
def clone(request: HttpRequest, run_id: int) -> HttpResponse:
    run = run_or_404(request, run_id)
    return _launch_page(request, project=run.experiment.project, clone_of=run)
