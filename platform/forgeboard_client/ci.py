"""`forgeboard ci run SUITE` (or `forgeboard-ci run SUITE`): launch a regression suite, wait for its verdict, write
JUnit XML.

Exit codes: 0 passed (warnings allowed), 1 a regression or a stage that did not finish, 2 a usage or API
error, 3 still running when --timeout ran out.
"""

from __future__ import annotations

import argparse
import os
import sys
from xml.etree import ElementTree

from forgeboard_client.client import ApiError, ForgeboardClient

PASSING = {"passed", "warned", "no_baseline"}


def junit_xml(result: dict) -> str:
    """One test suite per stage, one test case per check; a failed gate is a <failure>."""
    root = ElementTree.Element("testsuites", name=f"forgeboard:{result['suite']}")
    for stage in result["stages"]:
        failures = sum(c["verdict"] in ("failed", "error") for c in stage["checks"])
        suite = ElementTree.SubElement(root, "testsuite", name=stage["name"], tests=str(len(stage["checks"])),
                                       failures=str(failures))
        for check in stage["checks"]:
            case = ElementTree.SubElement(suite, "testcase", classname=f"{result['suite']}.{stage['name']}",
                                          name=check["name"])
            if check["verdict"] in ("failed", "error"):
                ElementTree.SubElement(case, "failure", message=check["detail"]).text = check["detail"]
            elif check["verdict"] in ("warned", "no_baseline"):
                ElementTree.SubElement(case, "system-out").text = f"{check['verdict']}: {check['detail']}"
    return ElementTree.tostring(root, encoding="unicode")


def run_suite(args: argparse.Namespace) -> int:
    if not args.project:
        print("forgeboard ci: name the project with --project or $FORGEBOARD_PROJECT", file=sys.stderr)
        return 2
    try:
        client = ForgeboardClient(args.url, args.token) if args.url and args.token else \
            ForgeboardClient.from_environment()
        started = client.launch_suite(args.project, args.suite)
        print(f"suite run {started['id']} launched: {started['status_url']}", flush=True)
        if not args.wait:
            return 0
        result = client.wait_suite_run(started["id"], timeout_s=args.timeout)
    except ApiError as exc:
        print(f"forgeboard ci: {exc}", file=sys.stderr)
        return 2
    for stage in result["stages"]:
        print(f"  stage {stage['name']}: {stage['verdict']} (run {stage['run_id']}, {stage['run_state']})")
        for check in stage["checks"]:
            print(f"    {check['verdict']:11s} {check['name']}: {check['detail']}")
    print(f"verdict: {result['verdict']}")
    if args.junit:
        with open(args.junit, "w", encoding="utf-8") as handle:
            handle.write(junit_xml(result))
    if result["verdict"] == "running":
        return 3
    return 0 if result["verdict"] in PASSING else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    ci = sub.add_parser("ci", help="regression suites for CI")
    _add_commands(ci.add_subparsers(dest="ci_command", required=True))


def _add_commands(ci_sub: argparse._SubParsersAction) -> None:
    run = ci_sub.add_parser("run", help="launch a suite and (with --wait) exit non-zero on a regression")
    run.add_argument("suite")
    run.add_argument("--project", default=os.environ.get("FORGEBOARD_PROJECT"),
                     help="project slug; default: $FORGEBOARD_PROJECT")
    run.add_argument("--url", help="default: $FORGEBOARD_URL")
    run.add_argument("--token", help="default: $FORGEBOARD_TOKEN")
    run.add_argument("--wait", action="store_true")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the verdict")
    run.add_argument("--junit", help="write a JUnit XML report here")
    run.set_defaults(func=run_suite)


def build_args(argv: list[str]) -> argparse.Namespace:
    """Parse `ci ...` arguments on their own (tests; the main command uses add_parser)."""
    parser = argparse.ArgumentParser(prog="forgeboard")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["ci", *argv])


def main(argv: list[str] | None = None) -> int:
    """`forgeboard-ci run SUITE …`: the client distribution's command (clients/python), without the server."""
    parser = argparse.ArgumentParser(prog="forgeboard-ci", description="Forgeboard regression suites for CI")
    _add_commands(parser.add_subparsers(dest="ci_command", required=True))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
