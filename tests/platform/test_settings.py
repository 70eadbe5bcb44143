"""Settings come from the environment, strictly: a bad value is an error that names the variable."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from forgeboard.cli import web_server_argv
from forgeboard.env import Env, database_from_url
from tests.support.processes import REPO_DIR, platform_env

PRODUCTION = {
    "FORGEBOARD_ENV": "production",
    "FORGEBOARD_SECRET_KEY": "k" * 20 + "-production-secret-for-the-deploy-check-0123456789",
    "FORGEBOARD_ALLOWED_HOSTS": "forgeboard.example.com",
}


@pytest.mark.parametrize(
    ("environ", "call", "message"),
    [
        ({"X": "maybe"}, lambda e: e.bool("X", False), "X: expected true or false, got 'maybe'"),
        ({"X": "12a"}, lambda e: e.int("X", 1), "X: expected an integer, got '12a'"),
        ({"X": "-1"}, lambda e: e.int("X", 1, minimum=0), "X: must be at least 0"),
        ({"X": "blue"}, lambda e: e.choice("X", ("json", "text"), "text"), "X: expected one of json, text"),
        ({"X": "mysql://h/db"}, lambda e: e.url("X", ("postgres",)), "X: expected a URL with scheme postgres"),
        ({}, lambda e: e.str("X", required=True), "X is required"),
        ({"X": "a", "X_FILE": "/f"}, lambda e: e.secret("X"), "X and X_FILE are both set"),
        ({"X_FILE": "/nonexistent/secret"}, lambda e: e.secret("X"), "X_FILE: cannot read '/nonexistent/secret'"),
    ],
)
def test_bad_values_name_the_variable(environ, call, message):
    with pytest.raises(ImproperlyConfigured, match=message.replace("(", r"\(")):
        call(Env(environ))


def test_values_parse():
    env = Env({"B": "Yes", "I": " 42 ", "L": "a, b,,c", "C": "json"})
    assert env.bool("B", False) is True
    assert env.int("I", 0) == 42
    assert env.list("L") == ["a", "b", "c"]
    assert env.choice("C", ("json", "text"), "text") == "json"
    assert env.bool("MISSING", True) is True


def test_secret_from_file(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    assert Env({"TOKEN_FILE": str(secret)}).secret("TOKEN") == "s3cret"
    secret.write_text("")
    with pytest.raises(ImproperlyConfigured, match="is empty"):
        Env({"TOKEN_FILE": str(secret)}).secret("TOKEN")


def test_database_url_gives_psycopg_settings():
    db = database_from_url("postgres://fb:pw@db.internal:6543/forgeboard", conn_max_age=30)
    assert db == {
        "ENGINE": "django.db.backends.postgresql", "NAME": "forgeboard", "USER": "fb", "PASSWORD": "pw",
        "HOST": "db.internal", "PORT": "6543", "CONN_MAX_AGE": 30, "CONN_HEALTH_CHECKS": True,
    }
    with pytest.raises(ImproperlyConfigured, match="names no database"):
        database_from_url("postgres://host/", conn_max_age=0)


def test_a_pool_size_pools_connections_instead_of_keeping_them():
    db = database_from_url("postgres://fb@db.internal/forgeboard", conn_max_age=60, pool_size=8)
    assert db["OPTIONS"] == {"pool": {"min_size": 1, "max_size": 8, "timeout": 30}}
    assert db["CONN_MAX_AGE"] == 0  # Django refuses a pool with persistent connections


def test_cache_objects_share_one_redis_pool_per_url():
    from django.core.cache.backends.redis import RedisCache

    params = {"OPTIONS": {"pool_class": "forgeboard.redis_pool.SharedConnectionPool"}}
    first = RedisCache("redis://127.0.0.1:6379/3", params)._cache._get_connection_pool(write=True)
    second = RedisCache("redis://127.0.0.1:6379/3", params)._cache._get_connection_pool(write=True)
    other = RedisCache("redis://127.0.0.1:6379/4", params)._cache._get_connection_pool(write=True)
    assert first is second
    assert other is not first and other.connection_kwargs["db"] == 4


def _manage(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = platform_env(**env)
    return subprocess.run([sys.executable, str(REPO_DIR / "manage.py"), *args], env=environ,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.django_db
def test_check_deploy_passes_with_production_settings():
    result = _manage(["check", "--deploy", "--fail-level", "WARNING"], **PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


@pytest.mark.parametrize("deployment", ["Dockerfile", "compose.yaml", "k8s/web.yaml", "systemd/forgeboard-web.service"])
def test_every_deployment_runs_the_web_server_as_forgeboard_serve_does(deployment):
    argv = web_server_argv(host="0.0.0.0", port=8000)
    options = " ".join(argv[argv.index("--lifespan"):])  # what follows the address: limits, logs, proxies
    command = re.sub(r'[\s\[\]",]+', " ", (REPO_DIR / "infra" / deployment).read_text())  # JSON lists or shell
    assert options in command


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FORGEBOARD_SECRET_KEY": ""}, "FORGEBOARD_SECRET_KEY is required"),
        ({"FORGEBOARD_SECRET_KEY": "short"}, "FORGEBOARD_SECRET_KEY: must be at least 50 characters"),
        ({"FORGEBOARD_ALLOWED_HOSTS": ""}, "FORGEBOARD_ALLOWED_HOSTS is required in production"),
        ({"FORGEBOARD_HSTS_SECONDS": "a year"}, "FORGEBOARD_HSTS_SECONDS: expected an integer"),
        ({"FORGEBOARD_LOG_FORMAT": "xml"}, "FORGEBOARD_LOG_FORMAT: expected one of json, text"),
        ({"REDIS_URL": "http://cache"}, "REDIS_URL: expected a URL with scheme redis or rediss"),
        ({"FORGEBOARD_TRUSTED_PROXIES": "10.0.0.0/8, ingress"},
         "FORGEBOARD_TRUSTED_PROXIES: expected IP addresses or CIDRs, got 'ingress'"),
        ({"FORGEBOARD_LOGIN_FAILURE_WINDOW_S": "5"}, "FORGEBOARD_LOGIN_FAILURE_WINDOW_S: must be at least 10"),
        ({"FORGEBOARD_EXPORT_TIMEOUT_S": "3600", "FORGEBOARD_EXPORT_LOST_AFTER_S": "3000"},
         "FORGEBOARD_EXPORT_LOST_AFTER_S: must be at least FORGEBOARD_EXPORT_TIMEOUT_S + 60 (3660), got 3000"),
        ({"FORGEBOARD_K8S_RUN_VOLUME_CLAIM": "Runs_Volume"},
         "FORGEBOARD_K8S_RUN_VOLUME_CLAIM: expected a PersistentVolumeClaim name (a DNS subdomain"),
        ({"FORGEBOARD_K8S_RUN_FS_GROUP": "forgeboard"}, "FORGEBOARD_K8S_RUN_FS_GROUP: expected an integer, got 'forgeboard'"),
        ({"FORGEBOARD_K8S_RUN_FS_GROUP": "-1"}, "FORGEBOARD_K8S_RUN_FS_GROUP: must be at least 0, got -1"),
        ({"FORGEBOARD_K8S_RUN_FS_GROUP": "2147483648"}, "FORGEBOARD_K8S_RUN_FS_GROUP: must be at most 2147483647"),
    ],
)
def test_bad_production_environment_stops_startup_naming_the_variable(env, message):
    result = _manage(["check"], **(PRODUCTION | env))
    assert result.returncode != 0
    assert message in result.stderr


def test_the_kubernetes_run_fs_group_is_unset_by_default_and_read_as_an_integer(settings):
    assert settings.K8S_RUN_FS_GROUP is None
    read = _manage(["shell", "-c", "from django.conf import settings; print(repr(settings.K8S_RUN_FS_GROUP))"],
                   **(PRODUCTION | {"FORGEBOARD_K8S_RUN_FS_GROUP": " 2000 "}))
    assert read.returncode == 0, read.stderr
    assert read.stdout.splitlines()[-1] == "2000"


def test_production_logs_are_json_with_request_and_run(caplog):
    import json
    import logging

    from forgeboard.logs import ContextFilter, JsonFormatter, request_id_var, run_log_context

    record = logging.LogRecord("forgeboard.test", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    token = request_id_var.set("req-123")
    try:
        with run_log_context(7):
            ContextFilter().filter(record)
    finally:
        request_id_var.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "hello world"
    assert (line["request_id"], line["run_id"], line["level"]) == ("req-123", 7, "INFO")


def test_requests_get_an_id_header(client, db):
    response = client.get("/healthz", HTTP_X_REQUEST_ID="abc-123")
    assert response.status_code == 200
    assert response["X-Request-ID"] == "abc-123"
    spoofed = client.get("/healthz", HTTP_X_REQUEST_ID="bad id\nwith newline")
    assert spoofed["X-Request-ID"] != "bad id\nwith newline" and len(spoofed["X-Request-ID"]) == 32


def test_an_api_token_in_a_logged_query_string_is_redacted():
    import logging

    from forgeboard.logs import RedactTokens

    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5", "/ws/runs/7/?after_seq=3&token=fb_abc_SECRET&x=1"), None)
    assert RedactTokens().filter(record)
    line = record.getMessage()
    assert "SECRET" not in line and "/ws/runs/7/?after_seq=3&token=[redacted]&x=1" in line
