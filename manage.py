#!/usr/bin/env python
"""Django's command-line utility for Forgeboard."""

import os
import sys
from pathlib import Path


def main() -> None:
    # platform/ is a source root, not a package: put it on the path, after the standard library
    # entries cannot be shadowed because it holds no module named `platform`.
    sys.path.insert(0, str(Path(__file__).resolve().parent / "platform"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "forgeboard.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
