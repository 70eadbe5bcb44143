"""Operator command payloads: typed, strict, with (field, reason) errors; drills in the run config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.engine.config import ConfigError, load_config
from workers.engine.operations import (FaultDrillRequest, LoadRedirectRequest, OperationError, PlacementChangeRequest,
                                       operation_json_schemas, parse_operation)

REPO = Path(__file__).resolve().parents[2]
MONARCH_GRPO = "recipe: grpo\nmodel: {path: /x}\nplacement: {backend: monarch}\n"


def _errors(kind: str, payload: object) -> dict[str, str]:
    with pytest.raises(OperationError) as caught:
        parse_operation(kind, payload)  # type: ignore[arg-type]
    return {e.field: e.message for e in caught.value.errors}


def test_valid_payloads_parse_to_typed_objects() -> None:
    drill = parse_operation("fault_drill", {"kind": "latency", "role": "generator", "replica": 1, "latency_ms": 50,
                                            "schedule": {"every_s": 10}})
    assert isinstance(drill, FaultDrillRequest)
    assert (drill.kind, drill.replica, drill.latency_ms, drill.duration_s, drill.schedule.every_s) == ("latency", 1, 50.0, 5.0, 10.0)
    kill = parse_operation("fault_drill", {"kind": "kill", "role": "trainer"})
    assert (kill.replica, kill.schedule) == (0, None)
    random = parse_operation("fault_drill", {"kind": "raise", "role": "reward",
                                             "schedule": {"random_seed": 3, "rate_per_min": 2}})
    assert random.schedule.random_seed == 3
    move = parse_operation("placement_change", {"action": "move", "replica": 0, "host": "node-b"})
    assert isinstance(move, PlacementChangeRequest) and (move.role, move.host) == ("generator", "node-b")
    reward = parse_operation("placement_change", {"action": "add", "role": "reward", "host": "node-b"})
    assert (reward.role, reward.action) == ("reward", "add")
    drain = parse_operation("load_redirect", {"action": "drain", "host": "node-a"})
    assert isinstance(drain, LoadRedirectRequest) and drain.action == "drain"


def test_each_problem_names_its_field() -> None:
    assert _errors("fault_drill", {"kind": "explode", "role": "generator", "bogus": 1}).keys() == {"kind", "bogus"}
    assert _errors("fault_drill", {"kind": "kill", "role": "generator", "bogus": 1})["bogus"] == "unknown key"
    assert "replica" in _errors("fault_drill", {"kind": "kill", "role": "generator", "replica": -1})
    assert _errors("fault_drill", {"kind": "latency", "role": "generator"}) == {"latency_ms": "required for kind 'latency'"}
    assert _errors("fault_drill", {"kind": "kill", "role": "generator", "duty_cycle": 0.5, "duration_s": 3}) == {
        "duty_cycle": "applies only to kind 'slow_host'", "duration_s": "does not apply to kind 'kill'"}
    assert "duty_cycle" in _errors("fault_drill", {"kind": "slow_host", "role": "trainer", "duty_cycle": 1.0})
    assert "duration_s" in _errors("fault_drill", {"kind": "hang", "role": "generator", "duration_s": 0})
    assert "exactly one" in _errors("fault_drill", {"kind": "kill", "role": "generator",
                                                    "schedule": {"at_step": 3, "every_s": 2}})["schedule"]
    assert "both" in _errors("fault_drill", {"kind": "kill", "role": "generator", "schedule": {"random_seed": 1}})["schedule"]
    assert _errors("placement_change", {"action": "move"}) == {"replica": "required for action 'move'",
                                                               "host": "required for action 'move'"}
    assert set(_errors("placement_change", {"action": "add", "host": "a", "role": "trainer"})) == {"role"}
    assert set(_errors("placement_change", {"action": "add", "host": "a", "replica": 2})) == {"replica"}
    assert "host" in _errors("placement_change", {"action": "remove", "replica": 0, "host": "a"})
    assert "host" in _errors("load_redirect", {"action": "drain", "host": "bad host!"})
    assert "action" in _errors("load_redirect", {"action": "evacuate", "host": "a"})
    assert "kind" in _errors("reboot", {})
    assert _errors("load_redirect", ["not", "a", "dict"]) == {"": "the payload of load_redirect must be an object"}


def test_a_nan_gradients_drill_is_the_trainers_only_and_takes_no_duration() -> None:
    drill = parse_operation("fault_drill", {"kind": "nan_gradients", "role": "trainer", "replica": 1,
                                            "schedule": {"at_step": 3}})
    assert isinstance(drill, FaultDrillRequest) and (drill.replica, drill.duration_s) == (1, None)
    assert FaultDrillRequest.model_validate(drill.model_dump()) == drill
    for role in ("generator", "reward", "reference"):
        assert _errors("fault_drill", {"kind": "nan_gradients", "role": role}) == {
            "role": f"kind 'nan_gradients' applies only to the trainer (a rank's gradients), not the {role}"}
    assert _errors("fault_drill", {"kind": "nan_gradients", "role": "trainer", "duration_s": 2}) == {
        "duration_s": "does not apply to kind 'nan_gradients'"}


def test_operation_errors_are_config_errors_with_field_pairs() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_operation("fault_drill", {"kind": "kill"})
    assert [(e.field, e.message) for e in caught.value.errors] == [("role", "Field required")]


def test_json_schemas_cover_the_three_commands() -> None:
    schemas = operation_json_schemas()
    assert set(schemas) == {"fault_drill", "placement_change", "load_redirect"}
    assert set(schemas["fault_drill"]["properties"]["kind"]["enum"]) == {"kill", "hang", "raise", "latency", "bandwidth",
                                                                          "slow_host", "nan_gradients"}
    assert schemas["fault_drill"]["additionalProperties"] is False
    json.dumps(schemas)


def test_run_config_carries_drills() -> None:
    config = load_config(MONARCH_GRPO + "generator: {replicas: 2}\n"
                         "drills:\n  - {kind: kill, role: generator, replica: 1, schedule: {at_step: 3}}\n"
                         "  - {kind: hang, role: trainer, duration_s: 2, schedule: {every_s: 30}}\n")
    assert [(d.kind, d.role, d.replica) for d in config.drills] == [("kill", "generator", 1), ("hang", "trainer", 0)]
    assert load_config(MONARCH_GRPO).drills == []


def test_config_drill_errors_are_field_level() -> None:
    def fields(text: str) -> dict[str, str]:
        with pytest.raises(ConfigError) as caught:
            load_config(text)
        return {e.field: e.message for e in caught.value.errors}

    assert fields(MONARCH_GRPO + "drills: [{kind: latency, role: generator}]\n") == {"drills.0.latency_ms": "required for kind 'latency'"}
    assert fields(MONARCH_GRPO + "drills: [{kind: kill, role: generator, replica: 3}]\n") == {
        "drills.0.replica": "generator has replicas 0..0"}
    assert "drills.0.role" in fields(MONARCH_GRPO + "drills: [{kind: kill, role: reference}]\n")
    assert "drills" in fields("recipe: grpo\nmodel: {path: /x}\ndrills: [{kind: kill, role: generator}]\n")


def test_schema_command_includes_drills_and_operations_stay_light() -> None:
    result = subprocess.run([sys.executable, "-m", "workers.engine", "schema"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, check=True)
    schema = json.loads(result.stdout)
    assert "drills" in schema["properties"] and "FaultDrillRequest" in schema["$defs"]
    probe = "import sys, workers.engine.operations\nprint(sorted({m.split('.')[0] for m in sys.modules}))"
    modules = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                             check=True).stdout
    assert all(name not in modules for name in ("'torch'", "'django'", "'monarch'", "'yaml'"))
