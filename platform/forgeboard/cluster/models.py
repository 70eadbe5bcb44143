"""The cluster inventory: hosts and their devices, as node agents report them."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class HostIntent(models.TextChoices):
    """What an operator wants of a host; only a schedulable host is given new work. Set by operators only."""

    SCHEDULABLE = "schedulable", "Schedulable"
    DRAINING = "draining", "Draining"
    CORDONED = "cordoned", "Cordoned"


class HostLiveness(models.TextChoices):
    """Whether a host is alive: down once its heartbeats stop, up again at its next heartbeat or registration."""

    UP = "up", "Up"
    DOWN = "down", "Down"


class HostState(models.TextChoices):
    """A host in one word (`Host.state`): down when it is down, else the operator's intent (up when schedulable)."""

    UP = "up", "Up"
    DRAINING = "draining", "Draining"
    CORDONED = "cordoned", "Cordoned"
    DOWN = "down", "Down"


_STATE_OF_INTENT = {HostIntent.SCHEDULABLE: HostState.UP, HostIntent.DRAINING: HostState.DRAINING,
                    HostIntent.CORDONED: HostState.CORDONED}


class Health(models.TextChoices):
    HEALTHY = "healthy", "Healthy"
    DEGRADED = "degraded", "Degraded"
    UNHEALTHY = "unhealthy", "Unhealthy"
    UNKNOWN = "unknown", "Unknown"


def scheduler_state_unavailable(state: str) -> bool:
    """A scheduler's node state ("down (not responding)", "idle (drain)") in which it will not run work there: down,
    drained, failing, or not heard from (unknown)."""
    return any(word in state for word in ("down", "drain", "fail", "unknown"))


class Host(models.Model):
    hostname = models.CharField(max_length=255, unique=True)
    pool = models.CharField(max_length=100, default="default", help_text="Node pool; each has its Celery queue")
    labels = models.JSONField(default=dict, blank=True)
    intent = models.CharField(max_length=16, choices=HostIntent.choices, default=HostIntent.SCHEDULABLE)
    liveness = models.CharField(max_length=8, choices=HostLiveness.choices, default=HostLiveness.UP)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.UNKNOWN)
    cpu_count = models.PositiveIntegerField(default=0)
    memory_bytes = models.BigIntegerField(default=0)
    cpu_utilization = models.FloatField(null=True, blank=True)
    memory_utilization = models.FloatField(null=True, blank=True)
    agent_version = models.CharField(max_length=50, blank=True)
    agent_token = models.ForeignKey(
        "AgentToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="hosts",
        help_text="The agent token that registered the host: no other token reports for it until this one is revoked")
    registered_at = models.DateTimeField(auto_now_add=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # A cluster scheduler's view of this host as a node (SLURM's sinfo), written by the worker that follows its jobs.
    scheduler_state = models.CharField(max_length=64, blank=True, help_text="e.g. 'idle', 'down (not responding)'")
    scheduler_reason = models.CharField(max_length=255, blank=True)
    scheduler_checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["hostname"]
        constraints = [
            models.CheckConstraint(condition=models.Q(intent__in=HostIntent.values), name="host_intent_valid"),
            models.CheckConstraint(condition=models.Q(liveness__in=HostLiveness.values), name="host_liveness_valid"),
            models.CheckConstraint(condition=models.Q(health__in=Health.values), name="host_health_valid"),
        ]

    def __str__(self) -> str:
        return self.hostname

    @property
    def state(self) -> HostState:
        return HostState.DOWN if self.liveness == HostLiveness.DOWN else _STATE_OF_INTENT[HostIntent(self.intent)]

    @property
    def scheduler_unavailable(self) -> bool:
        return scheduler_state_unavailable(self.scheduler_state)


class DeviceKind(models.TextChoices):
    GPU = "gpu", "GPU"
    CPU = "cpu", "CPU"


class Device(models.Model):
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="devices")
    kind = models.CharField(max_length=8, choices=DeviceKind.choices)
    index = models.PositiveIntegerField()
    model = models.CharField(max_length=200)
    memory_bytes = models.BigIntegerField(default=0)
    uuid = models.CharField(max_length=100, blank=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.UNKNOWN)
    utilization = models.FloatField(null=True, blank=True)
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["host", "kind", "index"]
        constraints = [
            models.UniqueConstraint(fields=["host", "kind", "index"], name="device_unique_index"),
            models.CheckConstraint(condition=models.Q(kind__in=DeviceKind.values), name="device_kind_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.host}:{self.kind}{self.index} {self.model}"


class AgentToken(models.Model):
    """A node agent's bearer token `fba_<prefix>_<secret>`; only a SHA-256 of the whole token is stored."""

    name = models.CharField(max_length=100, unique=True)
    prefix = models.CharField(max_length=16, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL,
                                   related_name="agent_tokens")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} (fba_{self.prefix}_…)"
