"""What a plain `manage.py migrate` also does, so that it alone leaves a working platform."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS

CHANNELS_DATABASE = "channels"  # the embedded default's SQLite channel layer (settings.py)


def finish_migrate(*, using: str, verbosity: int, plan: list | None = None,
                   stdout: Any = None, **_: Any) -> None:  # noqa: ANN401 - an OutputWrapper; the signal's rest
    """The database cache's table (the embedded default's rate-limit counters) and, in the embedded default, the
    channel layer's own database (live streams need its table), which `migrate` leaves alone unless named.

    A post_migrate handler; a flush (between transactional tests) sends that signal too, with no plan."""
    if plan is None:
        return
    # Only where it is routed; quiet at the default verbosity, where it would say the table already exists each time.
    call_command("createcachetable", database=using, verbosity=max(verbosity - 1, 0), stdout=stdout)
    if using == DEFAULT_DB_ALIAS and CHANNELS_DATABASE in settings.DATABASES:
        if verbosity and stdout:
            stdout.write(f"The channel layer's database ({CHANNELS_DATABASE}):")
        call_command("migrate", database=CHANNELS_DATABASE, interactive=False, verbosity=verbosity, stdout=stdout)
