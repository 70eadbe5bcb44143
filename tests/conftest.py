"""What every test directory shares."""

from tests.support.flush import retry_flush_on_deadlock


def pytest_configure(config) -> None:
    retry_flush_on_deadlock()
