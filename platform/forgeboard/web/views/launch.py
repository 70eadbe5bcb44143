"""The Launch page: pick or create an experiment, edit a config (validated live), place it, launch; cloning a run;
and starting a run of any recipe from a run's checkpoint.

Thin: reads through selectors; a launch is `run_launch_submit`'s (runs/launching.py: it checks the role, every
field and the config, once, then creates and audits). Bad input comes back at its field: config problems with
their YAML line, the rest by form field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods
from yaml.nodes import MappingNode, ScalarNode

from forgeboard.accounts.models import Project, Role
from forgeboard.artifacts.models import Artifact
from forgeboard.accounts.permissions import project_role
from forgeboard.experiments.config_problems import ConfigProblem, yaml_line_of
from forgeboard.cluster.selectors import hosts_with_devices
from forgeboard.errors import FieldProblem, NotFound, ServiceError, ValidationFailed
from forgeboard.experiments.models import Recipe
from forgeboard.experiments.selectors import experiments_for_project
from forgeboard.runs.checkpoints import (
    ExportStatus,
    checkpoints_on_disk,
    run_reference,
)
from forgeboard.runs.demo import SFT_MODEL, demo_model_dir
from forgeboard.runs.models import Run
from forgeboard.runs.planning import calibration_runs
from forgeboard.runs.launching import LaunchRefused, NewExperiment, run_launch_submit
from forgeboard.web.errors import error_page, project_or_404, run_or_404
from forgeboard.web.idempotent import idempotent_form
from workers.engine.config import RECIPE_ROLES
from workers.engine.planning.devices import DEVICE_NAMES

NEW_EXPERIMENT = "new"
# The roles whose processes a recipe starts (the engine's RECIPE_ROLES): pinning a run to hosts pins these.
PLACEMENT_ROLES = {str(recipe): list(roles) for recipe, roles in RECIPE_ROLES.items()}
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


def _model_path_to_artifact(text: str, artifact: str) -> str:
    """The YAML text with `model.path: ...` turned into `model.artifact: <artifact>`, comments and layout kept."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    model = next((v for k, v in node.value if getattr(k, "value", None) == "model"), None) \
        if isinstance(node, MappingNode) else None
    pair = next(((k, v) for k, v in model.value if k.value == "path"), None) if isinstance(model, MappingNode) else None
    if pair is None or not isinstance(pair[1], ScalarNode):
        return text
    key, value = pair
    return (text[:key.start_mark.index] + "artifact" + text[key.end_mark.index:value.start_mark.index] + artifact
            + text[value.end_mark.index:])


# The GRPO demo starts from the SFT demo's export (the demo chain registers it as this model artifact).
SFT_WARM_START_PRESETS = {"cpu_demo_grpo", "cpu_demo_grpo_drills", "cpu_demo_grpo_two_hosts"}
SFT_DEMO_PRESET = "cpu_demo_sft"


def launch_presets() -> list[Preset]:
    """Model presets from examples/configs. The CPU demo SFT preset points model.path at the demo model folder
    (inside the default artifact roots, FORGEBOARD_ARTIFACT_ROOTS; seed_demo also registers it as the demo project's
    `tiny-qwen3`); the GRPO demo preset starts from the SFT demo's export, the model artifact `tiny-qwen3-sft`."""
    paths = sorted((Path(settings.REPO_DIR) / "examples" / "configs").glob("*.yaml"))
    presets = [_example_preset(path) for path in paths]
    return sorted(presets, key=lambda p: (not p.key.startswith("cpu_demo"), p.key))


# Each example's preset, parsed once and kept while its file (modification time, size) and the demo model folder
# stay the same: parsing the examples took 30+ ms, and the launch page lists them all.
_parsed_examples: dict[Path, tuple[tuple[int, int, str], Preset]] = {}


def _example_preset(path: Path) -> Preset:
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size, str(demo_model_dir()))
    cached = _parsed_examples.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    text = path.read_text(encoding="utf-8")
    recipe = str((yaml.safe_load(text) or {}).get("recipe", ""))
    if path.stem in SFT_WARM_START_PRESETS:
        text = _model_path_to_artifact(text, SFT_MODEL)
    elif path.stem.startswith("cpu_demo"):
        text = _set_yaml_scalar(text, ["model", "path"], str(demo_model_dir()))
    label = PRESET_LABELS.get(path.stem, f"{path.stem.replace('_', ' ')} ({recipe})")
    preset = Preset(key=path.stem, label=label, recipe=recipe, yaml=text)
    _parsed_examples[path] = (stamp, preset)
    return preset


def _split_overrides(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _context(request: HttpRequest, *, project: Project, form: LaunchForm, clone_of: Run | None = None,
             checkpoint: int | None = None) -> dict:
    role = project_role(actor=request.user, project=project)
    can_launch = role is not None and role.rank >= Role.MEMBER.rank
    experiments = list(experiments_for_project(project=project).order_by("name"))
    presets = launch_presets()
    sft_demo = next((p for p in presets if p.key == SFT_DEMO_PRESET), None)
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
        "checkpoint": checkpoint,
        "checkpoint_reference": run_reference(run=clone_of, step=checkpoint) if checkpoint is not None else "",
        "checkpoint_overrides": "\n".join(checkpoint_overrides(run=clone_of, step=checkpoint)) if checkpoint is not None else "",
        "demo_model": demo_model_dir(),
        "sft_model": SFT_MODEL,
        "sft_model_missing": not Artifact.objects.filter(project=project, name=SFT_MODEL).exists(),
        "sft_warm_start_presets": sorted(SFT_WARM_START_PRESETS),
        "sft_demo": sft_demo,
        "sft_experiment": next((e for e in experiments if e.recipe == Recipe.SFT), None),
        "demo_model_missing": not (demo_model_dir() / "config.json").is_file(),
        "new_experiment": NEW_EXPERIMENT,
        "plan_devices": DEVICE_NAMES,
        "calibration_runs": calibration_runs(project=project),
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


# Overrides of a parent's starting point, which the checkpoint replaces.
_STARTING_POINT_KEYS = ("model.path=", "model.artifact=", "checkpoint.resume_from=")


def checkpoint_overrides(*, run: Run, step: int) -> list[str]:
    """What starts a config from a run's checkpoint: its export as the model, and no optimizer state to resume."""
    return ["model.path=", f"model.artifact={run_reference(run=run, step=step)}", "checkpoint.resume_from="]


def _checkpoint_form(project: Project, run: Run, step: int, *, experiment_id: str = "", preset_key: str = "") -> LaunchForm:
    """The parent's config and overrides (or, for another recipe, that recipe's first preset, or the preset asked
    for), in the parent's experiment unless another of the project's is asked for, starting from the checkpoint."""
    form = _clone_form(run)
    chosen = experiments_for_project(project=project).filter(pk=experiment_id).first() \
        if experiment_id.isdigit() and len(experiment_id) < 19 else None
    if chosen is not None:
        form.experiment, form.new_recipe = str(chosen.pk), chosen.recipe
    recipe = chosen.recipe if chosen else run.experiment.recipe
    presets = [p for p in launch_presets() if p.recipe == recipe]
    preset = next((p for p in presets if p.key == preset_key), None)
    if preset is None and recipe != run.experiment.recipe:
        preset = presets[0] if presets else None
    kept = [] if preset is not None else [  # the parent's own overrides go with the parent's config only
        line for line in form.overrides.splitlines() if line and not line.startswith(_STARTING_POINT_KEYS)]
    if preset is not None:
        form.preset, form.config_yaml = preset.key, preset.yaml
    lines = kept + checkpoint_overrides(run=run, step=step)
    form.overrides = "\n".join(lines)
    return form


def _form_from_post(request: HttpRequest) -> LaunchForm:
    post = request.POST
    return LaunchForm(
        experiment=post.get("experiment", ""), new_name=post.get("new_name", ""),
        new_recipe=post.get("new_recipe", ""), preset=post.get("preset", ""),
        config_yaml=post.get("config_yaml", "").replace("\r\n", "\n"), overrides=post.get("overrides", ""),
        priority=post.get("priority", "0").strip() or "0", hosts=post.getlist("hosts"),
    )


def _submit(request: HttpRequest, *, project: Project, form: LaunchForm, parent: Run | None,
            checkpoint: int | None = None) -> Run | ExportStatus | None:
    """The launch (`run_launch_submit`) of what the form says; None, with the problems on the form, if refused."""
    new_experiment, experiment = None, None
    if form.experiment == NEW_EXPERIMENT:
        new_experiment = NewExperiment(name=form.new_name, recipe=form.new_recipe)
    elif form.experiment.isdigit() and len(form.experiment) < 19:
        experiment = experiments_for_project(project=project).filter(pk=form.experiment).first()
    try:
        priority = int(form.priority)
    except ValueError:
        priority = None
    try:
        return run_launch_submit(actor=request.user, project=project, experiment=experiment,
                                 new_experiment=new_experiment, config_yaml=form.config_yaml,
                                 overrides=_split_overrides(form.overrides), hosts=form.hosts, priority=priority,
                                 parent=parent, checkpoint=checkpoint)
    except LaunchRefused as exc:
        _show_problems(form, exc.problems, fields=LAUNCH_FIELDS)
        form.config_errors = exc.config_problems
    except ValidationFailed as exc:  # refused once checked (a name taken meanwhile, the checkpoint's child config)
        _show_problems(form, exc.problems, fields=LAUNCHED_FIELDS)
        if not exc.problems:
            form.add("form", exc.message)
    return None


# The form fields that show the problems of a refused launch, and those of one refused once checked (else: the form).
LAUNCH_FIELDS = frozenset({"experiment", "new_name", "new_recipe", "priority", "hosts"})
LAUNCHED_FIELDS = frozenset({"new_name", "new_recipe", "priority", "overrides"})


def _show_problems(form: LaunchForm, problems: Sequence[FieldProblem], *, fields: frozenset[str]) -> None:
    for problem in problems:
        name = {"name": "new_name", "recipe": "new_recipe"}.get(problem.field, problem.field)
        if name.startswith("config"):
            path = name.removeprefix("config").removeprefix(".")
            form.config_errors.append(ConfigProblem(path, problem.message, line=yaml_line_of(form.config_yaml, path)))
        else:
            form.add(name if name in fields else "form", problem.message)


def _launch_page(request: HttpRequest, *, project: Project, clone_of: Run | None = None,
                 checkpoint: int | None = None) -> HttpResponse:
    if request.method == "GET":
        if clone_of is not None and checkpoint is not None:
            form = _checkpoint_form(project, clone_of, checkpoint, experiment_id=request.GET.get("experiment", ""),
                                    preset_key=request.GET.get("preset", ""))
        elif clone_of is not None:
            form = _clone_form(clone_of)
        else:
            form = _initial_form(project, experiment_id=request.GET.get("experiment", ""))
        return render(request, "web/launch.html", _context(request, project=project, form=form, clone_of=clone_of,
                                                           checkpoint=checkpoint))
    form = _form_from_post(request)
    try:
        run = _submit(request, project=project, form=form, parent=clone_of, checkpoint=checkpoint)
    except ServiceError as exc:  # refused by a service: a viewer's forged POST, before anything is read or stored
        return error_page(request, exc)
    if run is None:
        context = _context(request, project=project, form=form, clone_of=clone_of, checkpoint=checkpoint)
        return render(request, "web/launch.html", context, status=400)
    if isinstance(run, ExportStatus):
        assert clone_of is not None
        messages.info(request, f"exporting step {checkpoint}; the new run starts when the export is done (the "
                               "timeline says which run started)")
        return redirect("run_detail", clone_of.pk)
    messages.success(request, f"Launched {run.experiment.name} #{run.number}: queued.")
    return redirect("run_detail", run.pk)


@login_required
@require_http_methods(["GET", "POST"])
@idempotent_form
def launch(request: HttpRequest, slug: str) -> HttpResponse:
    project = project_or_404(request, slug)
    return _launch_page(request, project=project)


@login_required
@require_http_methods(["GET", "POST"])
@idempotent_form
def clone(request: HttpRequest, run_id: int) -> HttpResponse:
    run = run_or_404(request, run_id)
    return _launch_page(request, project=run.experiment.project, clone_of=run)


@login_required
@require_http_methods(["GET", "POST"])
@idempotent_form
def from_checkpoint(request: HttpRequest, run_id: int, step: int) -> HttpResponse:
    """The launch form starting from a checkpoint of the run: any experiment of the project, any recipe and config."""
    run = run_or_404(request, run_id)
    if step not in {c.step for c in checkpoints_on_disk(run=run)}:
        return error_page(request, NotFound(f"run {run.pk} has no checkpoint at step {step} in its run folder"))
    return _launch_page(request, project=run.experiment.project, clone_of=run, checkpoint=step)
