"""`forgeboard ci` lives in forgeboard_client (the Django-free client distribution); this name stays for imports."""

from forgeboard_client.ci import PASSING, add_parser, build_args, junit_xml, main, run_suite

__all__ = ["PASSING", "add_parser", "build_args", "junit_xml", "main", "run_suite"]
