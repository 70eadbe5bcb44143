"""The cluster page: hosts, devices, what runs where; operators drain, cordon and restore hosts."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from forgeboard.accounts.permissions import require_operator
from forgeboard.cluster.models import HostIntent, HostLiveness
from forgeboard.cluster.selectors import ELSEWHERE_HOSTS_PER_RUN, cluster_overview, host_get
from forgeboard.cluster.services import host_set_intent
from forgeboard.errors import ServiceError, clean_text
from forgeboard.web.errors import error_page


def _is_operator(request: HttpRequest) -> bool:
    return bool(request.user.is_operator or request.user.is_superuser)


@login_required
@require_http_methods(["GET", "POST"])
def cluster(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        return _set_intent(request)
    overview = cluster_overview(viewer=request.user, now=timezone.now(),
                                stale_after_s=settings.HOST_HEARTBEAT_TIMEOUT_S / 2)
    return render(request, "web/cluster.html", {
        "hosts": overview.hosts, "elsewhere": overview.elsewhere, "unplaced": overview.unplaced,
        "elsewhere_more": overview.elsewhere_more, "elsewhere_per_run": ELSEWHERE_HOSTS_PER_RUN,
        "can_operate": _is_operator(request), "intents": HostIntent.choices,
        "stale_after_s": int(settings.HOST_HEARTBEAT_TIMEOUT_S / 2),
        "gpu_count": sum(1 for h in overview.hosts for d in h.devices if d.kind == "gpu"),
    })


def _set_intent(request: HttpRequest) -> HttpResponse:
    try:
        require_operator(actor=request.user, action="changing a host's state")
        host = host_get(hostname=request.POST.get("hostname", ""))
        reason = clean_text(field="reason", value=request.POST.get("reason", ""), max_length=500, required=False)
        host = host_set_intent(actor=request.user, host=host, intent=request.POST.get("intent", ""), reason=reason)
    except ServiceError as error:
        return error_page(request, error)
    done = f"{host.hostname} is now {host.get_intent_display().lower()}."
    if host.liveness == HostLiveness.DOWN:
        done += " It is down: nothing is placed there before its heartbeats resume."
    messages.success(request, done)
    return redirect("cluster")
