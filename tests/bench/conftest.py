from tests.platform.conftest import grpo_yaml, running_run, team  # noqa: F401 - shared fixtures
