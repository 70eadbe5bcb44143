"""The CPU demo: its login, project and experiments, and the SFT-then-GRPO chain that tells its story.

The chain: the SFT demo run (examples/configs/cpu_demo_sft.yaml) in `arithmetic-sft`; once it succeeds, a GRPO run
(examples/configs/cpu_demo_grpo.yaml) in `arithmetic-grpo` from its last checkpoint, started by
`run_launch_from_checkpoint_request` (the same service as a checkpoint's "start a new run from here", so the GRPO run's
parent is the SFT run); the SFT export is also registered as the model artifact `tiny-qwen3-sft`, which the launch
page's GRPO preset starts from.
`demo_chain_advance` takes the next step and says where the chain stands: it keeps no state of its own, so a restart
of `forgeboard serve` picks the chain up where the runs are.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import transaction

from forgeboard.accounts.models import Project, User
from forgeboard.accounts.services import project_create
from forgeboard.artifacts.models import Artifact, ArtifactKind
from forgeboard.artifacts.services import artifact_register
from forgeboard.errors import NotFound, ServiceError
from forgeboard.experiments.models import Experiment
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.checkpoints import (
    ExportState,
    ExportStatus,
    checkpoint_export_status,
    checkpoints_on_disk,
    export_folder,
    run_launch_from_checkpoint_request,
)
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.runs.states import TERMINAL_STATES, RunState
from forgeboard.telemetry.models import EventKind, MetricPoint, MetricSeries, RunEvent

PROJECT_SLUG = "demo"
SFT_EXPERIMENT, GRPO_EXPERIMENT = "arithmetic-sft", "arithmetic-grpo"
DEMO_MODEL = "tiny-qwen3"  # the tiny random Qwen3 (make-tiny-model), in DATA_DIR/models (a default artifact root)
SFT_MODEL = "tiny-qwen3-sft"  # the SFT demo's export, copied into DATA_DIR/models: the GRPO preset's model
SFT_METRIC, GRPO_METRIC = "eval/accuracy", "eval/reward_mean"  # held-out figures the recipes report


class Phase:
    NONE = "none"  # no demo run yet
    SFT = "sft"  # the SFT run is queued or running
    EXPORTING = "exporting"  # its checkpoint is being exported; the GRPO run starts when that is done
    GRPO = "grpo"  # the GRPO run is queued or running
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class DemoChain:
    phase: str
    sft: Run | None = None
    grpo: Run | None = None
    step: int | None = None  # the SFT checkpoint the GRPO run starts from
    reason: str = ""  # why it failed

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.FAILED, Phase.NONE)


def demo_model_dir() -> Path:
    return Path(settings.DATA_DIR) / "models" / DEMO_MODEL


def demo_sft_model_dir() -> Path:
    return Path(settings.DATA_DIR) / "models" / SFT_MODEL


def _example(name: str) -> str:
    return (Path(settings.REPO_DIR) / "examples" / "configs" / f"{name}.yaml").read_text(encoding="utf-8")


@transaction.atomic
def demo_seed(*, username: str, password: str) -> tuple[User, bool]:
    """The demo user (an operator), the demo project and its two experiments; (the user, whether it was created)."""
    user = User.objects.filter(username=username).first()
    created = user is None
    if user is None:
        user = User.objects.create_user(username=username, password=password, is_operator=True)
    project = Project.objects.filter(slug=PROJECT_SLUG).first() or project_create(
        actor=user, slug=PROJECT_SLUG, name="Demo project", description="Tiny models on the CPU: SFT then GRPO."
    )
    for name, recipe in ((SFT_EXPERIMENT, "sft"), (GRPO_EXPERIMENT, "grpo")):
        if not Experiment.objects.filter(project=project, name=name).exists():
            experiment_create(actor=user, project=project, name=name, recipe=recipe, tags=["demo", "cpu"])
    return user, created


def _experiment(name: str) -> Experiment:
    return Experiment.objects.select_related("project").get(project__slug=PROJECT_SLUG, name=name)


def demo_sft_run() -> Run | None:
    """The demo's SFT run: the newest run of `arithmetic-sft` that did not start from another run."""
    return (Run.objects.filter(experiment__project__slug=PROJECT_SLUG, experiment__name=SFT_EXPERIMENT,
                               parent__isnull=True).select_related("experiment__project").order_by("-pk").first())


def demo_sft_launch(*, actor: User, overrides: Sequence[str] = ()) -> Run | None:
    """Queue the SFT demo run (building the tiny model first if needed); None when a demo chain is already under way
    or done (its SFT run queued, running or succeeded): a failed or cancelled one is tried again. `overrides` (tests
    shorten the run with them) apply after the example config's."""
    current = demo_sft_run()
    if current is not None and current.state not in (RunState.FAILED, RunState.CANCELLED):
        return None
    experiment = _experiment(SFT_EXPERIMENT)
    model = demo_model_dir()
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "workers.engine", "make-tiny-model", "--family", "qwen3",
                        "--out", str(model)], check=True, cwd=settings.REPO_DIR, capture_output=True)
    if not Artifact.objects.filter(project=experiment.project, name=DEMO_MODEL).exists():
        artifact_register(actor=actor, project=experiment.project, name=DEMO_MODEL, kind=ArtifactKind.MODEL,
                          path=str(model), description="the CPU demo's tiny random Qwen3 (make-tiny-model)")
    return run_launch(actor=actor, experiment=experiment, config_yaml=_example("cpu_demo_sft"),
                      overrides=["model.path=", f"model.artifact={DEMO_MODEL}", *overrides])


def _register_sft_model(*, actor: User, sft: Run, step: int) -> None:
    """Copy the SFT export into DATA_DIR/models and register it as `tiny-qwen3-sft` (once). A copy, since a run's
    folder is reached only by `run:` references, and the preset's model should outlive the run's files."""
    project = sft.experiment.project
    if Artifact.objects.filter(project=project, name=SFT_MODEL).exists():
        return
    target = demo_sft_model_dir()
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}")
    shutil.copytree(export_folder(run=sft, step=step), tmp)
    shutil.rmtree(target, ignore_errors=True)  # an earlier demo's, whose database is gone
    tmp.rename(target)
    artifact_register(actor=actor, project=project, name=SFT_MODEL, kind=ArtifactKind.MODEL, path=str(target),
                      description=f"the CPU demo's SFT warm start: {sft.experiment.name} #{sft.number}, step {step}")


def _child_failure(*, sft: Run, step: int) -> str:
    event = (RunEvent.objects.filter(run=sft, kind=EventKind.MESSAGE, payload__name="child_run_failed",
                                     payload__step=step).order_by("-seq").first())
    return str(event.payload.get("reason", "")) if event else ""


def _export_status(*, actor: User, sft: Run, step: int) -> ExportStatus | None:
    try:
        return checkpoint_export_status(actor=actor, run=sft, step=step)
    except NotFound:
        return None  # never asked for


def demo_chain_advance(*, actor: User, grpo_overrides: Sequence[str] = ()) -> DemoChain:
    """Take the chain's next step (start the GRPO run from the SFT run's last checkpoint; register the SFT export)
    and say where it stands. Idempotent: call it as often as you like."""
    sft = demo_sft_run()
    if sft is None:
        return DemoChain(Phase.NONE)
    if sft.state not in TERMINAL_STATES:
        return DemoChain(Phase.SFT, sft=sft)
    if sft.state != RunState.SUCCEEDED:
        return DemoChain(Phase.FAILED, sft=sft, reason=f"the SFT run {sft.state}: {sft.exit_reason}".rstrip(": "))
    saved = checkpoints_on_disk(run=sft)
    if not saved:
        return DemoChain(Phase.FAILED, sft=sft, reason="the SFT run left no checkpoint in its run folder")
    step = saved[-1].step
    grpo_experiment = _experiment(GRPO_EXPERIMENT)
    grpo = Run.objects.filter(parent=sft, experiment=grpo_experiment).order_by("-pk").first()
    status = _export_status(actor=actor, sft=sft, step=step)
    if status is not None and status.state == ExportState.DONE:
        _register_sft_model(actor=actor, sft=sft, step=step)
    if grpo is None:
        if status is None:
            try:
                started = run_launch_from_checkpoint_request(actor=actor, run=sft, step=step, experiment=grpo_experiment,
                                                             config_yaml=_example("cpu_demo_grpo"),
                                                             overrides=grpo_overrides)
            except ServiceError as exc:
                return DemoChain(Phase.FAILED, sft=sft, step=step, reason=exc.message)
            if isinstance(started, Run):
                return DemoChain(Phase.GRPO, sft=sft, grpo=started, step=step)
            return DemoChain(Phase.EXPORTING, sft=sft, step=step)
        if status.state == ExportState.FAILED:
            return DemoChain(Phase.FAILED, sft=sft, step=step, reason=f"exporting step {step}: {status.error}")
        if failure := _child_failure(sft=sft, step=step):
            return DemoChain(Phase.FAILED, sft=sft, step=step, reason=failure)
        return DemoChain(Phase.EXPORTING, sft=sft, step=step)
    if grpo.state not in TERMINAL_STATES:
        return DemoChain(Phase.GRPO, sft=sft, grpo=grpo, step=step)
    if grpo.state != RunState.SUCCEEDED:
        return DemoChain(Phase.FAILED, sft=sft, grpo=grpo, step=step,
                         reason=f"the GRPO run {grpo.state}: {grpo.exit_reason}".rstrip(": "))
    return DemoChain(Phase.DONE, sft=sft, grpo=grpo, step=step)


def metric_first_last(*, run: Run, key: str) -> tuple[float | None, float | None]:
    """A metric's value at its first and at its last step, from the run's stored metrics."""
    series = MetricSeries.objects.filter(run=run, key=key).first()
    if series is None:
        return None, None
    first = MetricPoint.objects.filter(series=series).order_by("step").values_list("value", flat=True).first()
    return first, series.last_value


def _figure(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def demo_chain_summary(chain: DemoChain, *, base_url: str = "") -> str:
    """One line for the start command: each run's state and its held-out figures."""
    if chain.sft is None:
        return "demo: no demo run"
    sft = chain.sft
    state = "done" if sft.state == RunState.SUCCEEDED else sft.state
    line = f"demo: SFT run {sft.experiment.name} #{sft.number} {state}"
    if sft.state == RunState.SUCCEEDED:
        line += f", held-out accuracy {_figure(metric_first_last(run=sft, key=SFT_METRIC)[1])}"
    if chain.grpo is not None:
        grpo = chain.grpo
        first, last = metric_first_last(run=grpo, key=GRPO_METRIC)
        state = "done" if grpo.state == RunState.SUCCEEDED else grpo.state
        line += (f" · GRPO run {grpo.experiment.name} #{grpo.number} (from SFT step {chain.step}) {state}"
                 + (f", held-out reward {_figure(first)} -> {_figure(last)}" if state == "done" else "")
                 + (f" · {base_url}/runs/{grpo.pk}/" if base_url else ""))
    elif chain.phase == Phase.EXPORTING:
        line += f" · exporting SFT step {chain.step}, then the GRPO run starts from it"
    if chain.reason:
        line += f" · {chain.reason}"
    return line
