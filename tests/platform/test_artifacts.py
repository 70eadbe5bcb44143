"""Artifacts instead of raw paths: project-scoped names, `run:` references, and raw paths only inside the roots."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command

from forgeboard.accounts.services import project_create
from forgeboard.artifacts.models import Artifact
from forgeboard.artifacts.services import artifact_register
from forgeboard.audit.models import AuditEvent
from forgeboard.errors import AlreadyExists, PermissionDenied, ValidationFailed
from forgeboard.experiments.models import ConfigSnapshot
from forgeboard.experiments.services import experiment_create
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from workers.launch.local import engine_allowed_paths, engine_config_yaml, run_dir, write_run_files

VALIDATE = "/api/v1/configs/validate"


def _model_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return folder


@pytest.fixture
def world(team, settings, tmp_path):
    """Roots with a model and a dataset; project beta (the outsider's) with a run and its own artifact."""
    settings.DATA_DIR = tmp_path / "data"
    root = tmp_path / "root"
    model = _model_folder(root / "tiny")
    other_model = _model_folder(root / "other")
    dataset = root / "train.jsonl"
    dataset.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(100)))
    (root / "escape").symlink_to("/etc")
    settings.ARTIFACT_ROOTS = [root]
    beta = project_create(actor=team.outsider, slug="beta", name="Beta")
    beta_experiment = experiment_create(actor=team.outsider, project=beta, name="math", recipe="grpo")
    beta_run = run_launch(actor=team.outsider, experiment=beta_experiment, config_yaml=_grpo(f"path: {other_model}"))
    artifact_register(actor=team.operator, project=beta, name="secret", kind="model", path=str(other_model))
    own_run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=_grpo(f"path: {model}"))
    return {"root": root, "model": model, "other_model": other_model, "dataset": dataset, "beta": beta,
            "beta_experiment": beta_experiment, "beta_run": beta_run, "own_run": own_run}


def _grpo(model: str, extra: str = "") -> str:
    return f"recipe: grpo\nmodel:\n  family: qwen3\n  {model}\ntrainer: {{steps: 2, batch_size: 2}}\n{extra}"


HOSTILE = {
    "another project's artifact": (lambda w: _grpo("artifact: beta/secret"), "model.artifact", "refers to project 'beta'"),
    "another project's name, unqualified": (lambda w: _grpo("artifact: secret"), "model.artifact",
                                            "no artifact 'secret' in project alpha"),
    "another project's run export": (lambda w: _grpo(f"artifact: run:{w['beta_run'].pk}@step:2"), "model.artifact",
                                     "no run"),
    "another project's run checkpoint": (
        lambda w: _grpo(f"path: {w['model']}", f"checkpoint: {{resume_from: 'run:{w['beta_run'].pk}@step:2'}}\n"),
        "checkpoint.resume_from", "no run"),
    "another run folder's path": (
        lambda w: _grpo(f"path: {run_dir(w['beta_run']) / 'exports' / 'step_2'}"), "model.path", "run folders"),
    "another run folder's checkpoint path": (
        lambda w: _grpo(f"path: {w['model']}", f"checkpoint: {{resume_from: {run_dir(w['beta_run']) / 'checkpoints'}}}\n"),
        "checkpoint.resume_from", "run folders"),
    "/etc/shadow": (lambda w: _grpo(f"path: {w['model']}", "data: {source: jsonl, path: /etc/shadow}\n"), "data.path",
                    "outside the artifact roots"),
    "../../etc": (lambda w: _grpo("path: ../../etc"), "model.path", "absolute path"),
    "root/../../etc": (lambda w: _grpo(f"path: {w['root']}/../../etc"), "model.path", "outside the artifact roots"),
    "symlink out of a root": (lambda w: _grpo(f"path: {w['root'] / 'escape'}"), "model.path", "resolved: /etc"),
    "checkpoint folder elsewhere": (lambda w: _grpo(f"path: {w['model']}", "checkpoint: {folder: /tmp/elsewhere}\n"),
                                    "checkpoint.folder", "inside the run's own folder"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_paths_are_refused_at_validate_with_field_and_line(client, team, world, case):
    make, field, message = HOSTILE[case]
    config = make(world)
    client.force_login(team.member)
    response = client.post(VALIDATE, {"recipe": "grpo", "project": "alpha", "yaml": config}, content_type="application/json")
    assert response.status_code == 200
    body = response.json()
    assert body["ok"] is False
    [problem] = [e for e in body["errors"] if e["field"] == field]
    assert message in problem["message"]
    assert problem["line"] is not None and field.split(".")[-1] in config.splitlines()[problem["line"] - 1]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_paths_are_refused_at_launch_and_nothing_is_stored(client, team, world, case):
    make, field, message = HOSTILE[case]
    client.force_login(team.member)
    runs, snapshots = Run.objects.count(), ConfigSnapshot.objects.count()
    response = client.post(f"/api/v1/experiments/{team.experiment.pk}/runs", {"config_yaml": make(world)},
                           content_type="application/json")
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == "validation_failed"
    assert any(e["field"] == f"config.{field}" and message in e["message"] for e in body["errors"])
    assert (Run.objects.count(), ConfigSnapshot.objects.count()) == (runs, snapshots)


def test_a_mistyped_artifact_name_is_answered_with_the_closest_and_the_projects_names(team, world):
    artifact_register(actor=team.operator, project=team.project, name="tiny-qwen3", kind="model", path=str(world["model"]))
    artifact_register(actor=team.operator, project=team.project, name="tiny-qwen3-sft", kind="model",
                      path=str(world["model"]))
    artifact_register(actor=team.operator, project=team.project, name="train", kind="dataset", path=str(world["dataset"]))
    with pytest.raises(ValidationFailed) as typo:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=_grpo("artifact: tiny-qwen3-sfx"))
    [problem] = [p for p in typo.value.problems if p.field.endswith("model.artifact")]
    assert problem.message == ("no artifact 'tiny-qwen3-sfx' in project alpha: did you mean 'tiny-qwen3-sft'? "
                               "Its models: tiny-qwen3, tiny-qwen3-sft")
    with pytest.raises(ValidationFailed) as unlike:  # nothing close: the names alone, of the kind asked for
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=_grpo("artifact: llama"))
    [problem] = [p for p in unlike.value.problems if p.field.endswith("model.artifact")]
    assert problem.message == "no artifact 'llama' in project alpha; its models: tiny-qwen3, tiny-qwen3-sft"
    for i in range(11):
        artifact_register(actor=team.operator, project=team.project, name=f"m{i:02d}", kind="model",
                          path=str(world["model"]))
    with pytest.raises(ValidationFailed) as many:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=_grpo("artifact: zzz"))
    [problem] = [p for p in many.value.problems if p.field.endswith("model.artifact")]
    assert problem.message.endswith("; its models: m00, m01, m02, m03, m04, m05, m06, m07, m08, m09 and 3 more")
    assert "secret" not in problem.message  # another project's names are not told


def test_own_artifact_and_own_run_resolve_and_the_engine_config_carries_the_paths(team, world):
    artifact_register(actor=team.operator, project=team.project, name="tiny", kind="model", path=str(world["model"]))
    artifact_register(actor=team.operator, project=team.project, name="train", kind="dataset", path=str(world["dataset"]))
    own = world["own_run"]
    config = _grpo("artifact: alpha/tiny", f"data: {{source: jsonl, artifact: train}}\n"
                                           f"checkpoint: {{resume_from: 'run:{own.pk}@step:2'}}\n")
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=config)
    checkpoint = run_dir(own) / "checkpoints" / "step_000002"
    assert run.artifact_paths == {"model.path": str(world["model"]), "data.path": str(world["dataset"]),
                                  "checkpoint.resume_from": str(checkpoint)}
    engine = yaml.safe_load(engine_config_yaml(run))
    # as written, the references replaced by their paths, no defaults restated
    assert engine["model"] == {"family": "qwen3", "path": str(world["model"])}
    assert engine["data"] == {"source": "jsonl", "path": str(world["dataset"])}
    assert engine["checkpoint"]["resume_from"] == str(checkpoint)
    folder = run_dir(run)
    write_run_files(run=run, folder=folder)
    written = yaml.safe_load((folder / "config.yaml").read_text())
    assert written["model"]["path"] == str(world["model"])
    # its own checkpoints win once it has some (a restarted attempt); the user's resume_from starts an attempt with none
    assert written["checkpoint"] == {"resume_from": str(checkpoint), "folder": str(folder / "checkpoints"),
                                     "resume_latest": True}
    allowed = engine_allowed_paths(run=run, run_folder=str(folder))
    assert allowed[:4] == [str(folder), str(world["model"]), str(world["dataset"]), str(checkpoint)]
    assert str(world["root"]) in allowed and str(run_dir(world["beta_run"])) not in allowed

    export = _grpo(f"artifact: run:{own.pk}@step:3")
    child = run_launch(actor=team.member, experiment=team.experiment, config_yaml=export)
    assert child.artifact_paths["model.path"] == str(run_dir(own) / "exports" / "step_3")


def test_resuming_another_recipes_run_is_refused_and_starting_from_its_weights_is_not(team, world):
    sft_experiment = experiment_create(actor=team.member, project=team.project, name="warm-start", recipe="sft")
    sft = run_launch(actor=team.member, experiment=sft_experiment,
                     config_yaml=f"recipe: sft\nmodel: {{family: qwen3, path: {world['model']}}}\n")
    with pytest.raises(ValidationFailed) as refused:
        run_launch(actor=team.member, experiment=team.experiment,
                   config_yaml=_grpo(f"path: {world['model']}", f"checkpoint: {{resume_from: 'run:{sft.pk}@step:2'}}\n"))
    [problem] = refused.value.problems
    assert problem.field == "config.checkpoint.resume_from"
    assert problem.message == (f"run {sft.pk} is an SFT run, and a GRPO run resumes only its own recipe's checkpoints; "
                               f"to start from its weights, use model.artifact: run:{sft.pk}@step:2")
    child = run_launch(actor=team.member, experiment=team.experiment, config_yaml=_grpo(f"artifact: run:{sft.pk}@step:2"))
    assert child.artifact_paths["model.path"] == str(run_dir(sft) / "exports" / "step_2")


def test_the_same_text_in_two_projects_resolves_to_each_projects_own_artifact(team, world):
    artifact_register(actor=team.operator, project=team.project, name="base", kind="model", path=str(world["model"]))
    artifact_register(actor=team.operator, project=world["beta"], name="base", kind="model",
                      path=str(world["other_model"]))
    config = _grpo("artifact: base")
    mine = run_launch(actor=team.member, experiment=team.experiment, config_yaml=config)
    theirs = run_launch(actor=team.outsider, experiment=world["beta_experiment"], config_yaml=config)
    assert mine.config_id == theirs.config_id  # one snapshot, deduplicated by its text
    assert yaml.safe_load(engine_config_yaml(mine))["model"]["path"] == str(world["model"])
    assert yaml.safe_load(engine_config_yaml(theirs))["model"]["path"] == str(world["other_model"])


def test_a_dataset_name_is_not_a_model(team, world):
    artifact_register(actor=team.operator, project=team.project, name="train", kind="dataset", path=str(world["dataset"]))
    with pytest.raises(ValidationFailed) as raised:
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=_grpo("artifact: train"))
    assert raised.value.problems[0].as_dict() == {"field": "config.model.artifact",
                                                  "message": "artifact 'train' is a dataset, not a model"}


def test_registering_checks_the_roots_and_the_operator_role_and_is_audited(team, world, tmp_path):
    with pytest.raises(PermissionDenied):
        artifact_register(actor=team.owner, project=team.project, name="tiny", kind="model", path=str(world["model"]))
    outside = _model_folder(tmp_path / "outside")
    for path, message in [(str(outside), "outside the artifact roots"), (str(world["root"] / "escape"), "resolved: /etc"),
                          ("relative/path", "absolute path"), (str(world["dataset"]), "not a Hugging Face model folder")]:
        with pytest.raises(ValidationFailed) as raised:
            artifact_register(actor=team.operator, project=team.project, name="tiny", kind="model", path=path)
        assert raised.value.problems[0].field == "path" and message in raised.value.problems[0].message
    link = world["root"] / "link-to-tiny"
    link.symlink_to(world["model"])
    artifact = artifact_register(actor=team.operator, project=team.project, name="tiny", kind="model", path=str(link))
    assert artifact.path == str(world["model"])  # stored resolved
    entry = AuditEvent.objects.get(action="artifact.register", project=team.project)
    assert entry.payload == {"name": "tiny", "kind": "model", "path": str(world["model"])}
    with pytest.raises(AlreadyExists, match="already exists"):
        artifact_register(actor=team.operator, project=team.project, name="tiny", kind="model", path=str(link))


def test_artifact_api_is_project_scoped_and_bounded(client, team, world):
    client.force_login(team.operator)
    assert client.get("/api/v1/projects/alpha/artifacts").status_code == 404  # not a member of alpha
    client.force_login(team.owner)
    from forgeboard.accounts.services import membership_set
    membership_set(actor=team.owner, project=team.project, user=team.operator, role="member")
    client.force_login(team.operator)
    created = client.post("/api/v1/projects/alpha/artifacts",
                          {"name": "tiny", "kind": "model", "path": str(world["model"]), "description": "a tiny one"},
                          content_type="application/json")
    assert created.status_code == 201, created.content
    assert created.json()["reference"] == "alpha/tiny" and created.json()["path"] == str(world["model"])
    again = client.post("/api/v1/projects/alpha/artifacts", {"name": "tiny", "kind": "model", "path": str(world["model"])},
                        content_type="application/json")
    assert again.status_code == 409 and again.json()["code"] == "conflict" and again.json()["errors"][0]["field"] == "name"
    refused = client.post("/api/v1/projects/alpha/artifacts", {"name": "etc", "kind": "model", "path": "/etc"},
                          content_type="application/json")
    assert refused.status_code == 400 and refused.json()["errors"][0]["field"] == "path"
    nul = client.post("/api/v1/projects/alpha/artifacts", {"name": "a\x00b", "kind": "model", "path": str(world["model"])},
                      content_type="application/json")
    assert nul.status_code == 400 and nul.json()["errors"]
    assert client.delete("/api/v1/projects/alpha/artifacts/a%00b").status_code == 404

    client.force_login(team.viewer)
    listed = client.get("/api/v1/projects/alpha/artifacts")
    assert listed.status_code == 200 and [a["name"] for a in listed.json()] == ["tiny"]
    assert client.post("/api/v1/projects/alpha/artifacts", {"name": "x", "kind": "model", "path": str(world["model"])},
                       content_type="application/json").status_code == 403
    client.force_login(team.outsider)
    assert client.get("/api/v1/projects/alpha/artifacts").status_code == 404
    assert [a["name"] for a in client.get("/api/v1/projects/beta/artifacts").json()] == ["secret"]
    client.force_login(team.operator)
    assert client.delete("/api/v1/projects/alpha/artifacts/tiny").status_code == 204
    assert not Artifact.objects.filter(project=team.project).exists()
    assert AuditEvent.objects.filter(action="artifact.delete").count() == 1
    schema = client.get("/api/v1/openapi.json").json()["components"]["schemas"]["ArtifactIn"]["properties"]
    assert schema["name"]["maxLength"] == 100 and schema["path"]["maxLength"] == 4096


def test_artifacts_page_lists_the_projects_artifacts_only(client, team, world):
    artifact_register(actor=team.operator, project=team.project, name="tiny", kind="model", path=str(world["model"]))
    client.force_login(team.viewer)
    page = client.get("/p/alpha/artifacts/")
    assert page.status_code == 200
    assert b"tiny" in page.content and str(world["model"]).encode() in page.content and b"secret" not in page.content
    assert b"Register an artifact" not in page.content
    assert b"/p/alpha/artifacts/" in client.get("/p/alpha/").content
    client.force_login(team.outsider)
    assert client.get("/p/alpha/artifacts/").status_code == 404


def test_artifacts_page_says_a_name_is_taken(client, team, world):
    from forgeboard.accounts.services import membership_set

    membership_set(actor=team.owner, project=team.project, user=team.operator, role="member")
    artifact_register(actor=team.operator, project=team.project, name="tiny", kind="model", path=str(world["model"]))
    client.force_login(team.operator)
    page = client.post("/p/alpha/artifacts/", {"name": "tiny", "kind": "model", "path": str(world["model"])}, follow=True)
    assert page.status_code == 200 and "an artifact named &#x27;tiny&#x27; already exists in alpha" in page.content.decode()
    assert Artifact.objects.filter(project=team.project).count() == 1


def test_artifact_command_registers_and_lists(team, world, capsys):
    call_command("artifact", "register", "alpha", "tiny", "--kind", "model", "--path", str(world["model"]),
                 "--operator", team.operator.username)
    call_command("artifact", "list", "alpha")
    assert f"tiny\tmodel\t{world['model']}" in capsys.readouterr().out
    with pytest.raises(CommandError, match="outside the artifact roots"):
        call_command("artifact", "register", "alpha", "etc", "--kind", "model", "--path", "/etc",
                     "--operator", team.operator.username)
    with pytest.raises(CommandError, match="operator role"):
        call_command("artifact", "register", "alpha", "t2", "--kind", "model", "--path", str(world["model"]),
                     "--operator", team.member.username)


def test_validate_without_a_project_says_references_need_one(client, team, world):
    client.force_login(team.member)
    response = client.post(VALIDATE, {"recipe": "grpo", "yaml": _grpo("artifact: tiny")}, content_type="application/json")
    assert response.json()["errors"][0]["field"] == "model.artifact"
    assert "needs the project" in response.json()["errors"][0]["message"]
    outsider = client.post(VALIDATE, {"recipe": "grpo", "project": "beta", "yaml": _grpo("artifact: secret")},
                           content_type="application/json")
    assert outsider.status_code == 404  # a member of alpha only


def test_the_run_data_folder_is_refused_even_when_a_root_contains_it(team, world, settings):
    settings.ARTIFACT_ROOTS = ["/"]
    inside_data = Path(settings.DATA_DIR) / "forgeboard.sqlite3"
    for config, field in [(_grpo(f"path: {run_dir(world['beta_run'])}"), "config.model.path"),
                          (_grpo(f"path: {world['model']}", f"data: {{source: jsonl, path: {inside_data}}}\n"),
                           "config.data.path")]:
        with pytest.raises(ValidationFailed) as raised:
            run_launch(actor=team.member, experiment=team.experiment, config_yaml=config)
        assert raised.value.problems[0].field == field
    assert os.path.realpath(world["model"]) == str(world["model"])


def test_every_launcher_hands_the_engine_its_allowed_paths(team, world, settings):
    from workers.launch.kubernetes import RUN_DIR, kubernetes_objects
    from workers.launch.kubernetes_backend import kubernetes_request
    from workers.launch.slurm import job_environment
    from workers.launch.slurm_backend import slurm_request

    settings.K8S_IMAGE = "registry.example/forgeboard:1"
    run = world["own_run"]
    folder = run_dir(run)
    expected = [str(folder), str(world["model"]), str(world["root"])]
    slurm = job_environment(slurm_request(run=run, folder=folder))
    assert json.loads(slurm["FORGEBOARD_ALLOWED_PATHS"]) == expected
    job = kubernetes_objects(kubernetes_request(run=run))[1]
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert json.loads(env["FORGEBOARD_ALLOWED_PATHS"]) == [RUN_DIR, str(world["model"]), str(world["root"])]
    assert container["workingDir"] == RUN_DIR


def test_the_local_launcher_sets_the_variable_for_its_supervisor_and_engine(team, world, monkeypatch):
    from workers.launch import local

    seen = {}

    class Started:
        pid = 4242

    def popen(argv, **kwargs):  # noqa: ANN001, ANN003, ANN202 - the process edge
        seen.update(kwargs["env"])
        return Started()

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    run = world["own_run"]
    assert local.start_local(run=run) == 4242
    assert json.loads(seen["FORGEBOARD_ALLOWED_PATHS"]) == [str(run_dir(run)), str(world["model"]), str(world["root"])]


def test_a_dataset_row_the_run_cannot_use_is_a_field_error_with_its_line_before_anything_is_queued(client, team, world):
    """The launch form's live check reads the JSONL as the engine would: the bad row's line and reason, at data."""
    world["dataset"].write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    artifact_register(actor=team.operator, project=team.project, name="rows", kind="dataset",
                      path=str(world["dataset"]))
    config = _grpo(f"path: {world['model']}", "data: {source: jsonl, artifact: rows, eval_size: 1}\n")
    client.force_login(team.member)
    answer = client.post(VALIDATE, {"yaml": config, "recipe": "grpo", "project": "alpha"},
                         content_type="application/json").json()
    problems = [(e["field"], e["message"]) for e in answer["errors"]]
    assert answer["ok"] is False
    [(field, message)] = [(f, m) for f, m in problems if "line 2" in m]
    assert field.startswith("data") and "'answer' is missing" in message, problems
    runs_before = Run.objects.count()
    with pytest.raises(ValidationFailed, match="line 2"):
        run_launch(actor=team.member, experiment=team.experiment, config_yaml=config)
    assert Run.objects.count() == runs_before

    world["dataset"].write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    mapped = _grpo(f"path: {world['model']}", "data: {source: jsonl, artifact: rows, eval_size: 1, "
                                              "fields: {prompt: question}}\n")
    answer = client.post(VALIDATE, {"yaml": mapped, "recipe": "grpo", "project": "alpha"},
                         content_type="application/json").json()
    assert any("line 1" in e["message"] for e in answer["errors"]), answer  # line 1 has no 'question'


def test_a_dataset_is_read_again_only_when_it_or_the_data_settings_change(team, world, monkeypatch):
    """The launch form validates on every pause in typing: the verdict on a file version is kept."""
    import workers.engine.tasks as tasks
    from forgeboard.experiments.services import validate_run_config

    reads: list[str] = []
    real = tasks.data_errors
    monkeypatch.setattr(tasks, "data_errors", lambda config: reads.append(config.data.path) or real(config))
    config = _grpo(f"path: {world['model']}", f"data: {{source: jsonl, path: {world['dataset']}}}\n")
    for _ in range(3):
        validate_run_config(yaml_text=config, recipe="grpo", project=team.project)
    assert len(reads) == 1
    validate_run_config(yaml_text=config, overrides=["data.eval_size=10"], recipe="grpo", project=team.project)
    assert len(reads) == 2, "other data settings: read again"
    world["dataset"].write_text('{"prompt": "1+1="}\n' * 100)
    with pytest.raises(ValidationFailed, match="line 1: 'answer' is missing"):
        validate_run_config(yaml_text=config, recipe="grpo", project=team.project)
    assert len(reads) == 3, "a changed file: read again"
