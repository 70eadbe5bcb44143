from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from forgeboard.cluster.models import Device, Host


def hosts_with_devices() -> QuerySet[Host]:
    return Host.objects.prefetch_related(Prefetch("devices", queryset=Device.objects.order_by("kind", "index")))
