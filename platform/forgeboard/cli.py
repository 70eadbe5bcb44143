"""The `forgeboard` command. Imports Django only in the subcommands that need it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from forgeboard.stream_limits import CLIENT_FRAME_MAX_BYTES
from forgeboard.supervisor import Child, supervise

REPO_DIR = Path(__file__).resolve().parents[2]
WEBSOCKET_PROTOCOL = "forgeboard.websocket_protocol:WebSocketProtocol"


def _django_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DJANGO_SETTINGS_MODULE", "forgeboard.settings")
    paths = [str(REPO_DIR / "platform"), str(REPO_DIR)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def web_server_argv(*, host: str, port: int) -> list[str]:
    """The web server (HTTP and websockets): uvicorn on uvloop, which sends a websocket message straight to its
    socket (daphne's twisted reactor took two selector updates and a loop turn per message: with 100 live
    subscribers its p99 went past 100 ms). Channels does not speak ASGI lifespan."""
    return [sys.executable, "-m", "uvicorn", "--host", host, "--port", str(port), "--lifespan", "off",
            "--no-access-log", "--no-proxy-headers",  # X-Forwarded-For: trusted proxies only (api/ratelimit.py)
            "--ws", WEBSOCKET_PROTOCOL,  # answers a handshake too long to read (uvicorn's leaves it hanging)
            "--ws-max-size", str(CLIENT_FRAME_MAX_BYTES),  # a larger frame closes its stream (uvicorn's default: 16 MiB)
            "--timeout-graceful-shutdown", "5", "forgeboard.asgi:application"]


def _manage(*args: str) -> None:
    subprocess.run([sys.executable, str(REPO_DIR / "manage.py"), *args], env=_django_env(), check=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Migrate, seed the demo, then run the web server and a Celery worker (with beat) until interrupted,
    starting either again when it dies (forgeboard/supervisor.py)."""
    _manage("migrate", "--noinput")  # also the cache table and the channel layer's database (after_migrate.py)
    if args.demo:
        _manage("seed_demo", "--launch")
    env = _django_env()
    env.setdefault("FORGEBOARD_PUBLIC_URL", f"http://{args.host}:{args.port}")  # where engines report
    worker = Child("celery worker+beat", [
        sys.executable, "-m", "celery", "-A", "workers.celery", "worker", "--loglevel", "info",
        "--concurrency", str(args.worker_concurrency), "--queues", "default,launch", "--beat",
    ], env=env, cwd=REPO_DIR)
    web = Child("web server", web_server_argv(host=args.host, port=args.port),
                env={"FORGEBOARD_DB_POOL_SIZE": "8"} | env, cwd=REPO_DIR)
    children = [worker, web]
    if args.demo:  # sees the demo's SFT run through, starts GRPO from its export, and prints both runs' figures
        children.append(Child("demo chain", [sys.executable, str(REPO_DIR / "manage.py"), "seed_demo", "--follow"],
                              env=env, cwd=REPO_DIR, once=True))
    print(f"Forgeboard on http://{args.host}:{args.port}/ (log in as demo / forgeboard-demo); Ctrl-C stops it",
          flush=True)
    return supervise(children)  # restarts a child that dies; SIGTERM or Ctrl-C stops them all


def token_main(argv: list[str]) -> int:
    """`forgeboard token create|list|revoke --user U …`: API tokens, on the server host (accounts api_token)."""
    return subprocess.run([sys.executable, str(REPO_DIR / "manage.py"), "api_token", *argv],
                          env=_django_env()).returncode


def cmd_manage(args: argparse.Namespace) -> int:
    _manage(*args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forgeboard", description="Forgeboard control plane and tools")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="migrate, then run the web server and a Celery worker")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=int(os.environ.get("FORGEBOARD_PORT", "8000")))
    serve.add_argument("--worker-concurrency", type=int, default=2)
    serve.add_argument("--demo", action="store_true", help="seed the demo user, project and experiments")
    serve.set_defaults(func=cmd_serve)
    manage = sub.add_parser("manage", help="run a Django management command")
    manage.add_argument("rest", nargs=argparse.REMAINDER)
    manage.set_defaults(func=cmd_manage)
    from forgeboard.ci import add_parser as add_ci_parser

    add_ci_parser(sub)
    # Listed for --help; main() hands `agent ...` to workers/agent.py (Django-free) before parsing.
    sub.add_parser("agent", help="run the node agent: register this host and report its devices", add_help=False)
    sub.add_parser("token", help="create, list or revoke API tokens: token create --user U --project P --name N",
                   add_help=False)
    sub.add_parser("plan", help="a GRPO config's predicted step at 3, 12, 48, 192 GPUs and the best split: "
                                "plan --config FILE --gpus 3,12,48,192", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:  # its options are the agent's own, passed through untouched
        from workers.agent import main as agent_main

        return agent_main(argv[1:])
    if argv[:1] == ["token"]:
        return token_main(argv[1:])
    if argv[:1] == ["plan"]:  # the engine's what-if planner (Django-free)
        from workers.engine.cli import main as engine_main

        return engine_main(argv)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
