"""Configs at the edges their schema allows, each of which once validated and then ended in a traceback: now refused
at validation or preflight, naming the field and why."""

from __future__ import annotations

import pytest

from workers.engine.config import MAX_THREADS_PER_PROCESS, ConfigError, load_config

GRPO = "recipe: grpo\nmodel: {path: /x}\n"


def _field_errors(config_text: str, *overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config(config_text, overrides=list(overrides))
    return {e.field: e.message for e in caught.value.errors}


def test_threads_per_process_stops_at_more_cores_than_a_host_has() -> None:
    # 2**31 - 1 threads validated, then OpenMP tried to allocate 432 GiB and the run died without a field
    assert "trainer.threads_per_process" in _field_errors(GRPO, "trainer.threads_per_process=2147483647")
    config = load_config(GRPO, overrides=[f"trainer.threads_per_process={MAX_THREADS_PER_PROCESS}"])
    assert config.trainer.threads_per_process == MAX_THREADS_PER_PROCESS
