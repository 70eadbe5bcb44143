from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from forgeboard.cluster.models import AgentToken, Device, Host
from forgeboard.runs.models import Run
from forgeboard.runs.states import ACTIVE_STATES


def hosts_with_devices() -> QuerySet[Host]:
    return Host.objects.prefetch_related(Prefetch("devices", queryset=Device.objects.order_by("kind", "index")))


def active_run_ids_on_host(*, hostname: str) -> list[int]:
    """Ids of the runs placed on this host that are launching, running, paused or cancelling."""
    return list(Run.objects.filter(host=hostname, state__in=ACTIVE_STATES).order_by("pk").values_list("pk", flat=True))


def agent_tokens() -> QuerySet[AgentToken]:
    return AgentToken.objects.select_related("created_by").order_by("name")
