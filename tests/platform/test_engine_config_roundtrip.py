"""The config an engine receives from the control plane is the config its user wrote.

For every example config, and the drills example with drills of every kind: when the launch's validation takes
the user's YAML and overrides, the engine's config.yaml (`engine_config_yaml`) validates too, in the engine and
in the control plane, to the same RunConfig (its paths the resolved ones, no restarts). The snapshot's full dump
(every default filled in) validates to it as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forgeboard.cluster.models import Device, DeviceKind, Host
from forgeboard.experiments.services import experiment_create, validate_run_config
from forgeboard.runs.services import run_launch
from workers.engine.config import RunConfig, config_to_yaml, load_config
from workers.engine.operations import DURATION_KINDS, UPDATE_KINDS, DrillKind
from workers.launch.local import engine_config_yaml

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))
MODEL = "/models/tiny-qwen3"  # validation resolves a path; nothing is opened

_seconds = st.floats(min_value=0.1, max_value=120, allow_nan=False).map(lambda x: round(x, 2))
_schedules = st.one_of(st.none(), st.builds(lambda s: {"at_step": s}, st.integers(1, 50)),
                       st.builds(lambda s: {"every_s": s}, _seconds),
                       st.builds(lambda seed, rate: {"random_seed": seed, "rate_per_min": rate},
                                 st.integers(0, 99), st.floats(0.1, 60, allow_nan=False).map(lambda x: round(x, 2))))


@st.composite
def _drill(draw: st.DrawFn) -> dict:
    """A drill the drills example (2 generator replicas, a reward, one trainer rank) can take."""
    kind = draw(st.sampled_from(get_args(DrillKind)))
    role = "trainer" if kind in UPDATE_KINDS else draw(st.sampled_from(["generator", "trainer", "reward"]))
    drill: dict = {"kind": kind, "role": role, "schedule": draw(_schedules)}
    if role == "generator" and draw(st.booleans()):
        drill["replica"] = draw(st.integers(0, 1))
    if kind in DURATION_KINDS and draw(st.booleans()):
        drill["duration_s"] = draw(_seconds)
    extra = {"latency": ("latency_ms", 200.0), "bandwidth": ("bandwidth_mbps", 50.0), "slow_host": ("duty_cycle", 0.5)}
    if kind in extra:
        drill[extra[kind][0]] = extra[kind][1]
    return drill


def _expected(config: RunConfig, artifact_paths: dict[str, str]) -> dict:
    """The user's config with its resolved paths and no restarts: what the engine must get."""
    expected = json.loads(config.model_dump_json())
    for field, path in artifact_paths.items():
        section, key = field.split(".")
        expected[section][key] = path
    for section in ("model", "data"):
        expected[section]["artifact"] = None
    return expected | {"max_restarts": 0}


def _assert_round_trip(*, team, experiment, text: str, overrides: list[str]) -> None:
    user = validate_run_config(yaml_text=text, overrides=overrides, recipe=experiment.recipe, project=team.project)
    run = run_launch(actor=team.member, experiment=experiment, config_yaml=text, overrides=overrides)
    engine_text = engine_config_yaml(run)
    engine = load_config(engine_text)  # what the engine's CLI does with its config.yaml
    assert json.loads(engine.model_dump_json()) == _expected(user, run.artifact_paths)
    again = validate_run_config(yaml_text=engine_text, recipe=experiment.recipe, project=team.project)
    assert again == engine
    assert load_config(config_to_yaml(user)) == user  # the snapshot's full dump, defaults and all
    assert RunConfig.model_validate(run.config.parsed) == user


def _gpu_host() -> None:
    """A host that can run the GPU examples (8 GPUs), so that every example validates."""
    host = Host.objects.create(hostname="gpu-1")
    for index in range(8):
        Device.objects.create(host=host, kind=DeviceKind.GPU, index=index, model="H200")


def test_every_example_reaches_its_engine_as_written(team):
    _gpu_host()
    experiments = {recipe: experiment_create(actor=team.owner, project=team.project, name=f"ex-{recipe}", recipe=recipe)
                   for recipe in ("grpo", "sft")}
    assert len(EXAMPLES) >= 6
    for path in EXAMPLES:
        text = path.read_text()
        recipe = yaml.safe_load(text)["recipe"]
        _assert_round_trip(team=team, experiment=experiments[recipe], text=text,
                           overrides=[f"model.path={MODEL}", "trainer.steps=3"])


def test_drills_of_every_kind_reach_the_engine_as_written(team):
    text = (EXAMPLES[0].parent / "cpu_demo_grpo_drills.yaml").read_text()
    assert "kind: kill" in text and "duration_s" in text  # the example that the full dump used to break

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(drills=st.lists(_drill(), min_size=1, max_size=4))
    def round_trip(drills: list[dict]) -> None:
        _assert_round_trip(team=team, experiment=team.experiment, text=text,
                           overrides=[f"model.path={MODEL}", f"drills={json.dumps(drills)}"])

    round_trip()
