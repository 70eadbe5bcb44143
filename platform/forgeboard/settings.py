"""Forgeboard settings: everything that varies comes from the environment, read here only.

infra/README.md lists every variable. Unset DATABASE_URL and REDIS_URL give the
embedded default: SQLite, a filesystem Celery broker and a SQLite channel layer.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from forgeboard.dispatch import (
    CLUSTER_MARK_DOWN_HOSTS,
    CLUSTER_PROBE,
    IDEMPOTENCY_PURGE,
    RUNS_POLL_JOBS,
    RUNS_RECONCILE,
    RUNS_SCHEDULE,
    pool_launch_queue,
)
from forgeboard.env import Env, database_from_url
from workers.engine.wire_limits import MAX_REQUEST_BYTES

env = Env()

REPO_DIR = Path(__file__).resolve().parents[2]
FORGEBOARD_ENV = env.choice("FORGEBOARD_ENV", ("development", "production", "test"), "development")
PRODUCTION = FORGEBOARD_ENV == "production"
# Tests keep their files apart, so they never touch a development server's database or channel layer.
DATA_DIR = Path(env.str("FORGEBOARD_DATA_DIR", str(REPO_DIR / ("var/test" if FORGEBOARD_ENV == "test" else "var"))))
DATA_DIR = DATA_DIR.resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = False if PRODUCTION else env.bool("FORGEBOARD_DEBUG", FORGEBOARD_ENV == "development")
SECRET_KEY = env.secret("FORGEBOARD_SECRET_KEY", required=PRODUCTION) or "dev-only-insecure-key-not-for-production"
if PRODUCTION and len(SECRET_KEY) < 50:
    raise ImproperlyConfigured("FORGEBOARD_SECRET_KEY: must be at least 50 characters in production")
ALLOWED_HOSTS = env.list("FORGEBOARD_ALLOWED_HOSTS", [] if PRODUCTION else ["127.0.0.1", "localhost", "testserver"])
if PRODUCTION and not ALLOWED_HOSTS:
    raise ImproperlyConfigured("FORGEBOARD_ALLOWED_HOSTS is required in production")
CSRF_TRUSTED_ORIGINS = env.list("FORGEBOARD_CSRF_TRUSTED_ORIGINS")
PUBLIC_URL = env.url("FORGEBOARD_PUBLIC_URL", ("http", "https")) or "http://127.0.0.1:8000"

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "ninja",  # /api/v1/docs from its own static Swagger UI (without it, from a CDN: blank on a machine offline)
    "forgeboard.accounts",
    "forgeboard.experiments",
    "forgeboard.runs",
    "forgeboard.telemetry",
    "forgeboard.cluster",
    "forgeboard.audit",
    "forgeboard.regressions",
    "forgeboard.alerts",
    "forgeboard.artifacts",
    "forgeboard.idempotency",
    "forgeboard.web",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "forgeboard.api_errors.ApiErrorShapeMiddleware",
    "forgeboard.body_limits.BodyLimitMiddleware",
    "forgeboard.request_refusals.RequestRefusalMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "forgeboard.logs.RequestContextMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "forgeboard.web.errors.DatabaseBusyMiddleware",
    "forgeboard.idempotency.middleware.IdempotencyMiddleware",
]

ROOT_URLCONF = "forgeboard.urls"
WSGI_APPLICATION = "forgeboard.wsgi.application"
ASGI_APPLICATION = "forgeboard.asgi.application"
AUTH_USER_MODEL = "accounts.User"
AUTHENTICATION_BACKENDS = ["forgeboard.accounts.backends.ThrottledModelBackend"]  # the failed-login brake
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_DIR / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- database -----------------------------------------------------------------------------
DATABASE_URL = env.url("DATABASE_URL", ("postgres", "postgresql", "sqlite"), secret=True)
CONN_MAX_AGE = env.int("FORGEBOARD_DB_CONN_MAX_AGE", 0 if FORGEBOARD_ENV == "test" else 60, minimum=0)
# Postgres connections pooled per process (psycopg_pool), for the web server: under ASGI every request
# runs in a thread of its own, so a persistent connection is never reused and each request would
# connect anew. `forgeboard serve` sets it for the web server; 0 keeps Django's per-thread connections
# (Celery workers and scripts, which fork or run one thread).
DB_POOL_SIZE = env.int("FORGEBOARD_DB_POOL_SIZE", 0, minimum=0)
_SQLITE_OPTIONS = {
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=10000;",
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
}
if DATABASE_URL and not DATABASE_URL.startswith("sqlite"):
    DATABASES = {"default": database_from_url(DATABASE_URL, conn_max_age=CONN_MAX_AGE, pool_size=DB_POOL_SIZE)}
else:
    _sqlite_path = Path(urlsplit(DATABASE_URL).path) if DATABASE_URL else DATA_DIR / "forgeboard.sqlite3"
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _sqlite_path,
            "OPTIONS": _SQLITE_OPTIONS,
            "TEST": {"NAME": DATA_DIR / "test-forgeboard.sqlite3"},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- broker and channel layer ---------------------------------------------------------------
REDIS_URL = env.url("REDIS_URL", ("redis", "rediss"), secret=True)
BROKER_DIR = DATA_DIR / "broker"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict = {}
    # redis-py 8 times out socket reads after 5 s by default: exactly the channel layer's blocking
    # receive (BZPOPMIN, 5 s), which then fails every idle websocket. Reads may block for longer.
    # core: a Redis list per subscriber; pubsub: one Redis PUBLISH per update, fanned out inside each
    # web process. With 100 subscribers on one uvicorn process core kept p99 at 34-52 ms and pubsub had
    # 130-150 ms tails in three runs of four (tests/bench/test_bench_streams.py). Either is best effort:
    # the database holds everything.
    _LAYER = env.str("FORGEBOARD_CHANNEL_LAYER", "core")
    if _LAYER not in ("pubsub", "core"):
        raise ImproperlyConfigured(f"FORGEBOARD_CHANNEL_LAYER: expected pubsub or core, got {_LAYER!r}")
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": f"channels_redis.{_LAYER}.Redis{'PubSub' if _LAYER == 'pubsub' else ''}ChannelLayer",
            # (a subscribed pubsub connection sits idle between updates: no read timeout there)
            "CONFIG": {"hosts": [{"address": REDIS_URL} | ({"socket_timeout": 30} if _LAYER == "core" else {})]},
        }
    }
else:
    # Embedded default: one folder for the broker's in and out works across processes.
    CELERY_BROKER_URL = "filesystem://localhost//"  # the transport ignores the host; kombu warns without one
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "messages"),
        "data_folder_out": str(BROKER_DIR / "messages"),
        "control_folder": str(BROKER_DIR / "control"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "store_processed": False,
    }
    for _folder in ("messages", "control", "processed"):
        (BROKER_DIR / _folder).mkdir(parents=True, exist_ok=True)
    INSTALLED_APPS.append("channels_lite")
    DATABASES["channels"] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": DATA_DIR / "channels.sqlite3",
        "OPTIONS": _SQLITE_OPTIONS,
        # Tests use the same file, so a web or worker process they start shares the test's channel layer.
        "TEST": {"NAME": DATA_DIR / "channels.sqlite3"},
    }
    DATABASE_ROUTERS = ["forgeboard.db_routers.EmbeddedChannelsRouter"]
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_lite.layers.core.SQLiteChannelLayer",
            "CONFIG": {"database": "channels", "expiry": 60},
        }
    }
# The cache holds API rate-limit counters, so it must be shared by every web process.
if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                          "OPTIONS": {"pool_class": "forgeboard.redis_pool.SharedConnectionPool"}}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.db.DatabaseCache", "LOCATION": "forgeboard_cache"}}
# Tests make thousands of calls a minute from one address; the tests of the limits set their own.
_UNLIMITED_IN_TESTS = 10**9 if FORGEBOARD_ENV == "test" else None
# How often an open live stream checks that its user or token may still read it (a revoked token or a removed member
# is told at once; a user deactivated in the admin, or a token that expired, within this many seconds).
STREAM_ACCESS_RECHECK_S = env.int("FORGEBOARD_STREAM_ACCESS_RECHECK_S", 30, minimum=1, maximum=3600)
API_RATE_PER_MINUTE = env.int("FORGEBOARD_API_RATE_PER_MINUTE", _UNLIMITED_IN_TESTS or 600, minimum=1)
API_AUTH_FAILURES_PER_MINUTE = env.int("FORGEBOARD_API_AUTH_FAILURES_PER_MINUTE", _UNLIMITED_IN_TESTS or 20, minimum=1)
# Failed logins: past these counts in one window a login is refused (429), even with the right password.
LOGIN_FAILURES_PER_ACCOUNT = env.int("FORGEBOARD_LOGIN_FAILURES_PER_ACCOUNT", _UNLIMITED_IN_TESTS or 10, minimum=1)
LOGIN_FAILURES_PER_ADDRESS = env.int("FORGEBOARD_LOGIN_FAILURES_PER_ADDRESS", _UNLIMITED_IN_TESTS or 100, minimum=1)
LOGIN_FAILURE_WINDOW_S = env.int("FORGEBOARD_LOGIN_FAILURE_WINDOW_S", 300, minimum=10, maximum=3600)
# Peers whose X-Forwarded-For names the client (reverse proxies, the ingress): addresses or CIDRs. Others' is ignored.
TRUSTED_PROXIES = env.networks("FORGEBOARD_TRUSTED_PROXIES")

CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The node pool of this worker's host: the worker also consumes `launch.<pool>`, where the runs
# allocated to hosts of that pool are started (see forgeboard/dispatch.py and runs/services.py).
WORKER_POOL = env.str("FORGEBOARD_WORKER_POOL", "default")
if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", WORKER_POOL):
    raise ImproperlyConfigured(
        f"FORGEBOARD_WORKER_POOL: expected 1-100 letters, digits, '.', '_' or '-', got {WORKER_POOL!r}")
# Webhooks may reach loopback, private, link-local and other non-public addresses (a lab network only).
WEBHOOK_ALLOW_PRIVATE = env.bool("FORGEBOARD_WEBHOOK_ALLOW_PRIVATE", False)
HOST_HEARTBEAT_TIMEOUT_S = env.int("FORGEBOARD_HOST_HEARTBEAT_TIMEOUT_S", 60, minimum=10)
# A recovery (after a fault drill or a real failure) slower than this fires drill_recovery_slow webhooks.
RECOVERY_ALERT_S = env.int("FORGEBOARD_RECOVERY_ALERT_S", 30, minimum=1)
# Concurrent CPU-only runs (engine controllers) per host; see runs/demand.py.
LOCAL_RUN_SLOTS = env.int("FORGEBOARD_LOCAL_RUN_SLOTS", 2, minimum=1)
# Checkpoint exports (runs/checkpoints.py). The exporter reads the whole checkpoint (an 8B model's weights and
# optimizer state in float32: ~100 GB) and writes the weights as safetensors: several minutes for a big model; it is
# killed after EXPORT_TIMEOUT_S. An export queued or running for EXPORT_LOST_AFTER_S is lost (its worker died, or its
# task message was lost): the run reconciler queues it again, at most EXPORT_REQUEUES times, then fails it. Past the
# timeout an export has surely stopped, so one taken for lost never runs beside the next.
EXPORT_TIMEOUT_S = env.int("FORGEBOARD_EXPORT_TIMEOUT_S", 1800, minimum=60)
EXPORT_LOST_AFTER_S = env.int("FORGEBOARD_EXPORT_LOST_AFTER_S", EXPORT_TIMEOUT_S + 300)
if EXPORT_LOST_AFTER_S < EXPORT_TIMEOUT_S + 60:
    raise ImproperlyConfigured(
        f"FORGEBOARD_EXPORT_LOST_AFTER_S: must be at least FORGEBOARD_EXPORT_TIMEOUT_S + 60 ({EXPORT_TIMEOUT_S + 60}), "
        f"got {EXPORT_LOST_AFTER_S}: an export still running must never be taken for lost")
EXPORT_REQUEUES = env.int("FORGEBOARD_EXPORT_REQUEUES", 2, minimum=0)
# The SLURM launch backend (workers/launch/slurm_backend.py): a worker with a partition set submits the
# runs whose config says placement.backend: slurm. FORGEBOARD_DATA_DIR must then be on a filesystem
# every node sees; give the nodes either a virtualenv or a container image (pyxis) with the project.
SLURM_PARTITION = env.str("FORGEBOARD_SLURM_PARTITION")
SLURM_VENV = env.str("FORGEBOARD_SLURM_VENV")
SLURM_IMAGE = env.str("FORGEBOARD_SLURM_IMAGE")
SLURM_ACCOUNT = env.str("FORGEBOARD_SLURM_ACCOUNT")
SLURM_QOS = env.str("FORGEBOARD_SLURM_QOS")
SLURM_TIME_LIMIT = env.str("FORGEBOARD_SLURM_TIME_LIMIT")
SLURM_GPUS_PER_NODE = env.int("FORGEBOARD_SLURM_GPUS_PER_NODE", 8, minimum=1)
SLURM_CPUS_PER_NODE = env.int("FORGEBOARD_SLURM_CPUS_PER_NODE", 16, minimum=1)
SLURM_MEMORY = env.str("FORGEBOARD_SLURM_MEMORY", "64G")
SLURM_MONARCH_PORT = env.int("FORGEBOARD_SLURM_MONARCH_PORT", 22222, minimum=1024, maximum=65535)  # each node's Monarch worker
SLURM_BIN_DIR = env.str("FORGEBOARD_SLURM_BIN_DIR")  # where sbatch, squeue, sacct and scancel are; unset: PATH
# A cluster run being cancelled whose engine has not stopped its job within this many seconds has the job
# removed by the scheduler (scancel, or the Kubernetes Job deleted).
JOB_CANCEL_GRACE_S = env.int("FORGEBOARD_JOB_CANCEL_GRACE_S", 120, minimum=0)
# A cluster run whose job the scheduler has running (time queued does not count) and whose engine has not reported
# in within this many seconds is taken for lost (workers/launch/jobs.py): its job is stopped, the run restarted or failed.
ENGINE_START_TIMEOUT_S = env.int("FORGEBOARD_ENGINE_START_TIMEOUT_S", 900, minimum=60)
# The Kubernetes launch backend (workers/launch/kubernetes_backend.py): a worker with an API URL and an
# image creates the objects of runs whose config says placement.backend: kubernetes.
K8S_API_URL = env.url("FORGEBOARD_K8S_API_URL", ("https", "http"))
K8S_NAMESPACE = env.str("FORGEBOARD_K8S_NAMESPACE", "forgeboard")
K8S_IMAGE = env.str("FORGEBOARD_K8S_IMAGE")
K8S_PYTHON = env.str("FORGEBOARD_K8S_PYTHON", "python")
K8S_TOKEN_FILE = env.str("FORGEBOARD_K8S_TOKEN_FILE", "/var/run/secrets/kubernetes.io/serviceaccount/token")
K8S_CA_FILE = env.str("FORGEBOARD_K8S_CA_FILE", "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
K8S_GPUS_PER_NODE = env.int("FORGEBOARD_K8S_GPUS_PER_NODE", 8, minimum=1)
K8S_CPUS_PER_NODE = env.int("FORGEBOARD_K8S_CPUS_PER_NODE", 16, minimum=1)
K8S_MEMORY = env.str("FORGEBOARD_K8S_MEMORY", "64Gi")
# The run pods' service account: the engine controller lists and watches its run's pods with it (infra/k8s/engine-rbac.yaml).
K8S_ENGINE_SERVICE_ACCOUNT = env.str("FORGEBOARD_K8S_ENGINE_SERVICE_ACCOUNT", "forgeboard-engine")
# A run's Job is deleted by the job poller once the run's end is recorded; the API server deletes one this many seconds
# after it finished all the same (ttlSecondsAfterFinished), a backstop for what the poller missed. 0: never.
K8S_JOB_TTL_S = env.int("FORGEBOARD_K8S_JOB_TTL_S", 7 * 24 * 3600, minimum=0)
# A PersistentVolumeClaim in the namespace (ReadWriteMany for runs of several pods) holding each run's folder
# (`run-<run id>`: its checkpoints), so that a restarted run resumes from its last checkpoint. Unset: an emptyDir.
K8S_RUN_VOLUME_CLAIM = env.str("FORGEBOARD_K8S_RUN_VOLUME_CLAIM") or None
if K8S_RUN_VOLUME_CLAIM and not (len(K8S_RUN_VOLUME_CLAIM) <= 253 and re.fullmatch(
        r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", K8S_RUN_VOLUME_CLAIM)):
    raise ImproperlyConfigured(
        "FORGEBOARD_K8S_RUN_VOLUME_CLAIM: expected a PersistentVolumeClaim name (a DNS subdomain: at most 253 "
        f"lowercase letters, digits, '-' and '.'), got {K8S_RUN_VOLUME_CLAIM!r}")
# The run pods' fsGroup (a gid): the run volume claim's folder made writable by that group, for an image running as
# non-root on a storage class that honours fsGroup. Unset: the pods set none.
K8S_RUN_FS_GROUP = (env.int("FORGEBOARD_K8S_RUN_FS_GROUP", 0, minimum=0, maximum=2**31 - 1)
                    if env.str("FORGEBOARD_K8S_RUN_FS_GROUP") is not None else None)
# Where a run config's raw paths (model.path, data.path, checkpoint.resume_from) and registered artifacts may
# point: folders on the workers' hosts (artifacts/resolver.py). A run's own files are reached by `run:` references.
# In tests "/" is a root too: every path is inside except DATA_DIR's (only roots inside DATA_DIR reach into it).
ARTIFACT_ROOTS = [Path(p) for p in env.list(
    "FORGEBOARD_ARTIFACT_ROOTS",
    ["/"] * (FORGEBOARD_ENV == "test") + [str(DATA_DIR / name) for name in ("models", "datasets", "artifacts")])]
CELERY_BEAT_SCHEDULE = {
    "schedule-runs": {"task": RUNS_SCHEDULE, "schedule": env.int("FORGEBOARD_SCHEDULE_SECONDS", 10, minimum=1)},
    "reconcile-runs": {"task": RUNS_RECONCILE, "schedule": env.int("FORGEBOARD_RECONCILE_SECONDS", 15, minimum=1)},
    "mark-down-hosts": {"task": CLUSTER_MARK_DOWN_HOSTS, "schedule": 30.0},
    "purge-idempotency-keys": {"task": IDEMPOTENCY_PURGE, "schedule": 3600.0},
}
POLL_JOBS_SECONDS = env.int("FORGEBOARD_POLL_JOBS_SECONDS", 30, minimum=5)
for _backend, _configured in (("slurm", SLURM_PARTITION), ("kubernetes", K8S_API_URL and K8S_IMAGE)):
    if _configured:  # followed by the workers that submit to that scheduler
        CELERY_BEAT_SCHEDULE[f"poll-{_backend}-jobs"] = {
            "task": RUNS_POLL_JOBS, "args": [_backend], "options": {"queue": pool_launch_queue(_backend)},
            "schedule": POLL_JOBS_SECONDS}
# Workers report their own hosts this often (cluster.probe), so a cluster without node agents has an
# inventory; 0 turns the probe off (the default in tests, whose inventory each test builds itself).
# Keep it well under FORGEBOARD_HOST_HEARTBEAT_TIMEOUT_S.
PROBE_SECONDS = env.int("FORGEBOARD_PROBE_SECONDS", 0 if FORGEBOARD_ENV == "test" else 20, minimum=0)
if PROBE_SECONDS:
    CELERY_BEAT_SCHEDULE["probe-hosts"] = {"task": CLUSTER_PROBE, "schedule": PROBE_SECONDS}
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

# --- security -------------------------------------------------------------------------------
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
if PRODUCTION:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = env.bool("FORGEBOARD_SECURE_SSL_REDIRECT", True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env.int("FORGEBOARD_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True

if FORGEBOARD_ENV == "test":
    # Hashing cost is irrelevant to what the tests check and would dominate their run time.
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 8}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

# --- static files ---------------------------------------------------------------------------
STATIC_URL = "/static/"
STATIC_ROOT = REPO_DIR / "staticfiles"
STATICFILES_DIRS = [REPO_DIR / "frontend" / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if PRODUCTION
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = not PRODUCTION

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

# --- logging --------------------------------------------------------------------------------
LOG_LEVEL = env.choice("FORGEBOARD_LOG_LEVEL", ("DEBUG", "INFO", "WARNING", "ERROR"), "INFO")
LOG_FORMAT = env.choice("FORGEBOARD_LOG_FORMAT", ("json", "text"), "json" if PRODUCTION else "text")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"context": {"()": "forgeboard.logs.ContextFilter"}},
    "formatters": {
        "json": {"()": "forgeboard.logs.JsonFormatter"},
        "text": {"format": "%(asctime)s %(levelname)s %(name)s [req=%(request_id)s run=%(run_id)s] %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "filters": ["context"]},
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}

# --- limits ---------------------------------------------------------------------------------
# One limit for every body (workers/engine/wire_limits.py), enforced by forgeboard.body_limits; Django's own is
# set to the same so that it is not a second, lower one.
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BYTES
CSRF_FAILURE_VIEW = "forgeboard.api_errors.csrf_failure"  # JSON on /api/ paths
