"""The Launch page, live config validation (/api/v1/configs/validate) and cloning a run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from django.conf import settings

from forgeboard.experiments.config_problems import config_problems, yaml_line_of
from forgeboard.cluster.models import Host, HostIntent
from forgeboard.experiments.models import Experiment
from forgeboard.runs.models import Run
from forgeboard.runs.services import run_launch
from forgeboard.web.views.launch import launch_presets

# trainer.steps is on line 7.
GRPO_YAML = """\
recipe: grpo
model:
  family: qwen3
  path: /models/tiny-qwen3
trainer:
  batch_size: 2
  steps: 5
grpo:
  group_size: 4
"""
VALIDATE = "/api/v1/configs/validate"


def _form(team, **fields) -> dict:
    return {"experiment": str(team.experiment.pk), "config_yaml": GRPO_YAML, "overrides": "", "priority": "0"} | fields


def _check(client, **body):
    return client.post(VALIDATE, data=json.dumps({"recipe": "grpo", "yaml": GRPO_YAML} | body),
                       content_type="application/json")


# --- the page ---------------------------------------------------------------------------------------------------


def test_member_sees_the_form_with_presets_and_experiments(client, team):
    client.force_login(team.member)
    page = client.get("/p/alpha/launch/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="config_yaml"' in html and 'name="overrides"' in html and 'name="priority"' in html
    assert f'<option value="{team.experiment.pk}" data-recipe="grpo"' in html
    assert "cpu_demo_sft" in html and "qwen3_1_7b_grpo" in html
    assert 'id="launch-button"' in html and "viewer-notice" not in html
    assert '<fieldset class="launch-fields" disabled' not in html


def test_launch_stores_the_run_with_its_config_and_redirects_to_it(client, team):
    client.force_login(team.member)
    response = client.post("/p/alpha/launch/", _form(team, overrides="trainer.steps=3\n\n# a comment\n", priority="7"))
    run = Run.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/runs/{run.pk}/"
    assert run.experiment == team.experiment and run.launched_by == team.member and run.priority == 7
    assert run.config.yaml_text == GRPO_YAML and run.config.overrides == ["trainer.steps=3"]
    assert run.config.parsed["trainer"]["steps"] == 3 and run.parent is None and run.state == "queued"


def test_launch_into_a_new_experiment_creates_it(client, team):
    client.force_login(team.member)
    sft = next(p for p in launch_presets() if p.key == "cpu_demo_sft")
    response = client.post("/p/alpha/launch/", _form(team, experiment="new", new_name="sft-try", new_recipe="sft",
                                                     config_yaml=sft.yaml, overrides="trainer.steps=2"))
    assert response.status_code == 302
    experiment = Experiment.objects.get(project=team.project, name="sft-try")
    assert experiment.recipe == "sft" and experiment.created_by == team.member
    run = Run.objects.get(experiment=experiment)
    assert run.config.parsed["model"]["path"] == str(Path(settings.DATA_DIR) / "models" / "tiny-qwen3")


def test_a_bad_field_comes_back_at_its_field_and_line_and_nothing_is_stored(client, team):
    client.force_login(team.member)
    response = client.post("/p/alpha/launch/", _form(team, config_yaml=GRPO_YAML.replace("steps: 5", "steps: 0")))
    assert response.status_code == 400 and Run.objects.count() == 0
    html = response.content.decode()
    assert 'data-field="trainer.steps" data-line="7"' in html
    assert "<code>trainer.steps</code> (line 7): Input should be greater than or equal to 1" in html
    assert 'aria-invalid="true"' in html and "steps: 0" in html  # the user's text is kept for fixing
    assert '<button type="submit" class="primary" id="launch-button" disabled>' in html


def test_malformed_yaml_comes_back_with_its_line(client, team):
    client.force_login(team.member)
    response = client.post("/p/alpha/launch/", _form(team, config_yaml="recipe: grpo\nmodel:\n  path: [unclosed\n"))
    assert response.status_code == 400 and Run.objects.count() == 0
    assert "malformed YAML" in response.content.decode() and 'data-line="' in response.content.decode()


def test_a_failed_launch_into_a_new_experiment_stores_no_experiment(client, team):
    client.force_login(team.member)
    response = client.post("/p/alpha/launch/", _form(team, experiment="new", new_name="half", new_recipe="grpo",
                                                     config_yaml=GRPO_YAML.replace("group_size: 4", "group_size: 1")))
    assert response.status_code == 400 and "grpo.group_size" in response.content.decode()
    assert not Experiment.objects.filter(name="half").exists() and Run.objects.count() == 0


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"priority": "high"}, "priority", "must be a whole number from -100 to 100"),
    ({"priority": "101"}, "priority", "must be a whole number from -100 to 100"),
    ({"experiment": "999999"}, "experiment", "choose an experiment of this project"),
    ({"experiment": "new", "new_name": " "}, "new_name", "name the new experiment"),
    ({"experiment": "new", "new_name": "x", "new_recipe": "ppo"}, "new_recipe", "choose one of"),
    ({"experiment": "new", "new_name": "math", "new_recipe": "grpo"}, "new_name", "an experiment named &#x27;math&#x27; already exists"),
    ({"experiment": "new", "new_name": "n" * 201, "new_recipe": "grpo"}, "new_name", "must be at most 200 characters"),
    ({"hosts": ["nowhere-1"]}, "hosts", "not in the cluster inventory: nowhere-1"),
    ({"overrides": "trainer.steps"}, "overrides", "must look like section.key=value"),
])
def test_bad_form_fields_come_back_at_their_field(client, team, fields, field, message):
    client.force_login(team.member)
    response = client.post("/p/alpha/launch/", _form(team, **fields))
    html = response.content.decode()
    assert response.status_code == 400 and Run.objects.count() == 0
    assert message in html
    if field == "overrides":
        errors = html.split('id="overrides-errors"')[1].split("</ul>")[0]
        assert message in errors and 'aria-invalid="true" aria-describedby="overrides-errors"' in html
    else:
        assert f'id="{field}-error">' in html and 'aria-invalid="true"' in html


def test_an_experiment_of_another_project_cannot_be_used(client, team):
    from forgeboard.accounts.services import project_create
    from forgeboard.experiments.services import experiment_create

    other = project_create(actor=team.outsider, slug="beta", name="Beta")
    foreign = experiment_create(actor=team.outsider, project=other, name="theirs", recipe="grpo")
    client.force_login(team.member)
    response = client.post("/p/alpha/launch/", _form(team, experiment=str(foreign.pk)))
    assert response.status_code == 400 and Run.objects.count() == 0


def test_chosen_hosts_pin_every_role_of_the_run(client, team):
    Host.objects.create(hostname="gpu-a")
    Host.objects.create(hostname="gpu-b", intent=HostIntent.DRAINING)
    client.force_login(team.member)
    page = client.get("/p/alpha/launch/").content.decode()
    assert 'name="hosts" value="gpu-a"' in page and 'name="hosts" value="gpu-b"' in page
    # Each choice says the host's pool, state and health, as the cluster page does.
    assert 'gpu-a <span class="muted">default · Up, unknown · 0 devices</span>' in page
    assert 'gpu-b <span class="muted">default · Draining, unknown · 0 devices</span>' in page
    response = client.post("/p/alpha/launch/", _form(team, hosts=["gpu-b"]))
    assert response.status_code == 302
    run = Run.objects.get()
    for role in ("trainer", "generator", "reference", "reward", "replay_buffer"):
        assert run.placement_plan[role]["hosts"] == ["gpu-b"]
        assert f'placement.{role}.hosts=["gpu-b"]' in run.config.overrides


def test_a_host_named_with_an_emoji_is_pinned_as_named(client, team):
    # The inventory takes any host name without spaces, so the choice keeps the emoji as it is.
    client.force_login(team.member)
    response = client.post("/p/alpha/launch/", _form(team, hosts=["\U0001f642"]))
    assert response.status_code == 400 and "not in the cluster inventory: \U0001f642" in response.content.decode()
    Host.objects.create(hostname="\U0001f642")
    response = client.post("/p/alpha/launch/", _form(team, hosts=["\U0001f642"]))
    assert response.status_code == 302
    run = Run.objects.get()
    assert run.placement_plan["trainer"]["hosts"] == ["\U0001f642"]
    assert 'placement.trainer.hosts=["\U0001f642"]' in run.config.overrides


def test_an_escaped_lone_surrogate_in_the_config_is_shown_at_its_field(client, team):
    client.force_login(team.member)
    escaped = GRPO_YAML + 'checkpoint:\n  folder: "s\\uD800t"\n'
    response = client.post("/p/alpha/launch/", _form(team, config_yaml=escaped))
    html = response.content.decode()
    assert response.status_code == 400 and "checkpoint.folder" in html and "lone surrogates" in html
    assert Run.objects.count() == 0


def test_viewer_sees_a_read_only_page(client, team):
    client.force_login(team.viewer)
    page = client.get("/p/alpha/launch/")
    html = page.content.decode()
    assert page.status_code == 200 and 'id="viewer-notice"' in html and "Viewers cannot launch runs" in html
    assert '<fieldset class="launch-fields" disabled>' in html
    assert '<button type="submit" class="primary" id="launch-button" disabled>' in html


@pytest.mark.parametrize("experiment", ["existing", "new"])
def test_viewer_post_is_refused_with_the_reason_and_stores_nothing(client, team, experiment):
    client.force_login(team.viewer)
    fields = _form(team) if experiment == "existing" else _form(team, experiment="new", new_name="sneaky",
                                                                 new_recipe="grpo")
    response = client.post("/p/alpha/launch/", fields)
    assert response.status_code == 403
    assert "launching runs needs the member role; you are a viewer" in response.content.decode()
    assert Run.objects.count() == 0 and not Experiment.objects.filter(name="sneaky").exists()


@pytest.mark.parametrize("method", ["get", "post"])
def test_outsider_gets_not_found(client, team, grpo_yaml, method):
    run = run_launch(actor=team.member, experiment=team.experiment, config_yaml=grpo_yaml)
    client.force_login(team.outsider)
    for url in ("/p/alpha/launch/", "/p/nope/launch/", f"/runs/{run.pk}/clone/", "/runs/99999999/clone/"):
        assert getattr(client, method)(url, _form(team)).status_code == 404, url
    assert Run.objects.count() == 1


def test_launch_page_needs_login(client, team):
    response = client.get("/p/alpha/launch/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


# --- cloning ----------------------------------------------------------------------------------------------------


def test_clone_prefills_the_runs_config_overrides_and_experiment(client, team):
    Host.objects.create(hostname="gpu-a")
    original = run_launch(actor=team.member, experiment=team.experiment, config_yaml=GRPO_YAML, priority=4,
                          overrides=["trainer.steps=2", 'placement.trainer.hosts=["gpu-a"]'])
    client.force_login(team.member)
    page = client.get(f"/runs/{original.pk}/clone/")
    html = page.content.decode()
    assert page.status_code == 200 and f"Cloning <a href=\"/runs/{original.pk}/\">math #1</a>" in html
    assert "group_size: 4" in html and ">trainer.steps=2</textarea>" in html
    assert f'<option value="{team.experiment.pk}" data-recipe="grpo" selected>' in html
    assert 'value="gpu-a" checked' in html and 'name="priority" type="number" min="-100" max="100" step="1" value="4"' in html


def test_clone_keeps_a_pinning_to_a_host_that_left_the_inventory_as_an_override(client, team):
    host = Host.objects.create(hostname="gpu-gone")
    original = run_launch(actor=team.member, experiment=team.experiment, config_yaml=GRPO_YAML,
                          overrides=['placement.trainer.hosts=["gpu-gone"]'])
    host.delete()
    client.force_login(team.member)
    html = client.get(f"/runs/{original.pk}/clone/").content.decode()
    assert '>placement.trainer.hosts=[&quot;gpu-gone&quot;]</textarea>' in html and "gpu-gone&quot;]" in html
    assert 'value="gpu-gone"' not in html


def test_launching_a_clone_records_its_parent(client, team):
    original = run_launch(actor=team.member, experiment=team.experiment, config_yaml=GRPO_YAML)
    client.force_login(team.member)
    response = client.post(f"/runs/{original.pk}/clone/", _form(team, overrides="trainer.steps=9"))
    clone = Run.objects.exclude(pk=original.pk).get()
    assert response.status_code == 302 and response["Location"] == f"/runs/{clone.pk}/"
    assert clone.parent == original and clone.number == 2 and clone.config.parsed["trainer"]["steps"] == 9


def test_viewer_may_read_a_clone_page_but_not_launch_it(client, team):
    original = run_launch(actor=team.member, experiment=team.experiment, config_yaml=GRPO_YAML)
    client.force_login(team.viewer)
    assert 'id="viewer-notice"' in client.get(f"/runs/{original.pk}/clone/").content.decode()
    assert client.post(f"/runs/{original.pk}/clone/", _form(team)).status_code == 403
    assert Run.objects.count() == 1


# --- presets ----------------------------------------------------------------------------------------------------


def _register_sft_model(team, tmp_path: Path) -> None:
    from forgeboard.artifacts.services import artifact_register

    folder = tmp_path / "tiny-qwen3-sft"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    artifact_register(actor=team.operator, project=team.project, name="tiny-qwen3-sft", kind="model", path=str(folder))


def test_every_preset_is_valid_for_its_recipe_and_the_grpo_demo_starts_from_the_sft_export(team, tmp_path):
    _register_sft_model(team, tmp_path)
    presets = {p.key: p for p in launch_presets()}
    assert {"cpu_demo_sft", "cpu_demo_grpo", "qwen3_1_7b_grpo", "llama3_8b_grpo"} <= set(presets)
    for preset in presets.values():  # (GPU presets: refused at validation on this CPU machine, issue #14 item 6)
        if preset.key.startswith("cpu_demo"):
            assert config_problems(yaml_text=preset.yaml, overrides=[], recipe=preset.recipe,
                                   project=team.project) == [], preset.key
    demo = str(Path(settings.DATA_DIR) / "models" / "tiny-qwen3")
    assert yaml.safe_load(presets["cpu_demo_sft"].yaml)["model"]["path"] == demo
    grpo_model = yaml.safe_load(presets["cpu_demo_grpo"].yaml)["model"]
    assert grpo_model == {"family": "qwen3", "artifact": "tiny-qwen3-sft"}, "not the raw random model"
    for key in ("cpu_demo_grpo_drills", "cpu_demo_grpo_two_hosts"):  # the Monarch demos start from it too
        assert yaml.safe_load(presets[key].yaml)["model"] == grpo_model, key
    for key in ("cpu_demo_sft", "cpu_demo_grpo"):
        assert presets[key].yaml.startswith("# CPU demo")  # the example's comments are kept


def test_the_grpo_demo_preset_says_it_needs_the_sft_export_and_offers_to_make_it(client, team, tmp_path):
    client.force_login(team.member)
    grpo = next(p for p in launch_presets() if p.key == "cpu_demo_grpo")
    problems = config_problems(yaml_text=grpo.yaml, overrides=[], recipe="grpo", project=team.project)
    assert [(p.field, p.message) for p in problems] == [("model.artifact", "no artifact 'tiny-qwen3-sft' in project alpha")]
    html = client.get("/p/alpha/launch/").content.decode()  # the first experiment is GRPO: its preset is the demo's
    assert 'id="preset-needs-sft" data-presets="cpu_demo_grpo cpu_demo_grpo_drills cpu_demo_grpo_two_hosts">' in html, "shown, not hidden"
    assert "needs the SFT demo's export, the model artifact <code>tiny-qwen3-sft</code>" in html
    assert 'id="launch-sft-demo-button"' in html

    # the offer: one click launches the SFT demo in a new SFT experiment
    sft = next(p for p in launch_presets() if p.key == "cpu_demo_sft")
    answer = client.post("/p/alpha/launch/", {"experiment": "new", "new_name": "arithmetic-sft", "new_recipe": "sft",
                                              "preset": "cpu_demo_sft", "priority": "0", "config_yaml": sft.yaml})
    run = Run.objects.get(experiment__name="arithmetic-sft")
    assert answer.status_code == 302 and answer["Location"] == f"/runs/{run.pk}/"
    html = client.get("/p/alpha/launch/").content.decode()
    assert '<input type="hidden" name="experiment" value="%d">' % run.experiment_id in html, "the SFT experiment now"

    _register_sft_model(team, tmp_path)
    html = client.get("/p/alpha/launch/").content.decode()
    assert "preset-needs-sft" not in html and "launch-sft-demo" not in html


def test_the_examples_are_parsed_once_and_an_edited_example_is_picked_up(client, team, settings, tmp_path, monkeypatch):
    shutil.copytree(Path(settings.REPO_DIR) / "examples" / "configs", tmp_path / "examples" / "configs")
    settings.REPO_DIR = tmp_path
    examples = sorted((tmp_path / "examples" / "configs").glob("*.yaml"))
    parsed: list[str] = []
    safe_load = yaml.safe_load
    monkeypatch.setattr(yaml, "safe_load", lambda text: parsed.append(text) or safe_load(text))
    client.force_login(team.member)

    first = client.get("/p/alpha/launch/")
    assert len(parsed) == len(examples), "each example parsed once, not once per use"
    second = client.get("/p/alpha/launch/")
    assert len(parsed) == len(examples), "unchanged examples are not parsed again"
    assert second.context["presets_json"] == first.context["presets_json"]
    assert second.content.decode().count("recipe: sft") == first.content.decode().count("recipe: sft") > 0

    # an edit that keeps the file's size (an editor saving a second later): the new text is on the page
    sft = tmp_path / "examples" / "configs" / "cpu_demo_sft.yaml"
    text = sft.read_text(encoding="utf-8")
    assert "max_operand: 20" in text
    sft.write_text(text.replace("max_operand: 20", "max_operand: 30"), encoding="utf-8")
    stat = sft.stat()
    os.utime(sft, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    edited = client.get("/p/alpha/launch/")
    assert len(parsed) == len(examples) + 1, "only the edited example is parsed again"
    preset = next(p for p in edited.context["presets_json"] if p["key"] == "cpu_demo_sft")
    assert "max_operand: 30" in preset["yaml"] and "max_operand: 20" not in preset["yaml"]
    assert yaml.safe_load(preset["yaml"])["model"]["path"] == str(Path(settings.DATA_DIR) / "models" / "tiny-qwen3")
    assert "max_operand: 30" in edited.content.decode()


# --- the validate API -------------------------------------------------------------------------------------------


def test_validate_a_good_config(client, team):
    client.force_login(team.member)
    response = _check(client)
    assert response.status_code == 200 and response.json() == {"ok": True, "errors": []}


def test_validate_a_bad_field_gives_its_path_and_line(client, team):
    client.force_login(team.member)
    response = _check(client, yaml=GRPO_YAML.replace("steps: 5", "steps: 0"))
    assert response.status_code == 200
    assert response.json() == {"ok": False, "errors": [
        {"field": "trainer.steps", "message": "Input should be greater than or equal to 1", "line": 7, "override": None}]}


def test_validate_unknown_key_and_wrong_type_point_at_their_lines(client, team):
    client.force_login(team.member)
    text = GRPO_YAML.replace("batch_size: 2", "batch_sise: 2").replace("group_size: 4", "group_size: four")
    errors = {e["field"]: e for e in _check(client, yaml=text).json()["errors"]}
    assert errors["trainer.batch_sise"]["line"] == 6 and errors["trainer.batch_sise"]["message"] == "unknown key"
    assert errors["grpo.group_size"]["line"] == 9 and "integer" in errors["grpo.group_size"]["message"]


def test_validate_a_field_set_by_an_override_points_at_the_override_and_nearest_parent(client, team):
    client.force_login(team.member)
    body = _check(client, overrides=["trainer.steps=3", "trainer.micro_batch_size=0"]).json()
    assert body["errors"] == [{"field": "trainer.micro_batch_size", "message": "Input should be greater than or equal to 1",
                               "line": 5, "override": 2}]


def test_validate_malformed_yaml(client, team):
    client.force_login(team.member)
    body = _check(client, yaml="recipe: grpo\nmodel:\n  path: [unclosed\n").json()
    assert body["ok"] is False and len(body["errors"]) == 1
    assert body["errors"][0]["field"] == "" and body["errors"][0]["message"].startswith("malformed YAML")
    assert body["errors"][0]["line"] == 4


def test_validate_refuses_aliases_with_their_line(client, team):
    client.force_login(team.member)
    body = _check(client, yaml="recipe: grpo\nmodel: &m\n  path: x\ndata: *m\n").json()
    assert body["errors"] == [{"field": "", "message": "YAML aliases (*name) are not allowed", "line": 4, "override": None}]


def test_validate_names_the_line_of_a_value_yaml_cannot_build(client, team):
    client.force_login(team.member)
    body = _check(client, yaml="recipe: grpo\nmodel:\n  path: x\ntrainer:\n  steps: !!int abc\n").json()
    assert body["ok"] is False
    assert [(e["field"], e["line"]) for e in body["errors"]] == [("", 5)]
    assert body["errors"][0]["message"].startswith("malformed YAML: invalid literal for int()")


def test_validate_a_recipe_mismatch_and_a_bad_override(client, team):
    client.force_login(team.member)
    mismatch = _check(client, recipe="sft").json()["errors"]
    assert mismatch == [{"field": "recipe", "message": "is 'grpo' but the experiment's recipe is 'sft'", "line": 1,
                         "override": None}]
    bad = _check(client, overrides=["trainer.steps=2", "no equals sign"]).json()["errors"]
    assert bad == [{"field": "overrides", "message": "'no equals sign' must look like section.key=value", "line": None,
                    "override": 2}]


@pytest.mark.parametrize(("body", "field"), [
    ({"recipe": "ppo"}, "recipe"),
    ({"yaml": 5}, "yaml"),
    ({"yaml": None}, "yaml"),
    ({"overrides": "trainer.steps=1"}, "overrides"),
    ({"overrides": [1]}, "overrides.0"),
])
def test_validate_wrong_types_are_refused_at_their_field(client, team, body, field):
    client.force_login(team.member)
    response = _check(client, **body)
    assert response.status_code == 400 and response.json()["code"] == "validation_failed"
    assert field in [e["field"] for e in response.json()["errors"]]


def test_validate_oversized_configs(client, team):
    client.force_login(team.member)
    too_long = _check(client, yaml="# " + "x" * 70_000)
    assert too_long.status_code == 400 and too_long.json()["errors"][0]["field"] == "yaml"
    too_many_bytes = _check(client, yaml=GRPO_YAML + "# " + "é" * 40_000 + "\n").json()  # < 64 Ki characters, > 64 KiB
    assert too_many_bytes["ok"] is False and "over the limit of 65536 bytes" in too_many_bytes["errors"][0]["message"]
    too_many_overrides = _check(client, overrides=["trainer.steps=1"] * 101)
    assert too_many_overrides.status_code == 400


def test_validate_needs_authentication(client, team):
    assert _check(client).status_code == 401


def test_validate_works_with_a_read_only_token(client, team):
    from forgeboard.accounts.services import api_token_create

    _, token = api_token_create(actor=team.member, project=team.project, name="ro", scope="read")
    response = client.post(VALIDATE, data=json.dumps({"recipe": "grpo", "yaml": GRPO_YAML}),
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200 and response.json()["ok"] is True


def test_yaml_line_of_finds_fields_list_items_and_nearest_parents():
    text = "a:\n  b: 1\n  list:\n    - x\n    - y\nc: 2\n"
    assert yaml_line_of(text, "a.b") == 2
    assert yaml_line_of(text, "a.list.1") == 5
    assert yaml_line_of(text, "a.missing.deeper") == 1
    assert yaml_line_of(text, "c") == 6
    assert yaml_line_of(text, "nowhere") is None
    assert yaml_line_of("a: [unclosed", "a") is None
