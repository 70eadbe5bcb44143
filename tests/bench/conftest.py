from tests.platform.conftest import grpo_yaml, running_run, team  # noqa: F401 - shared fixtures
from tests.e2e.conftest import browser_context_args, browser_type_launch_args, server  # noqa: F401
