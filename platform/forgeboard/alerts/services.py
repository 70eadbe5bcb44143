"""Alerts: webhooks a project owner registers, the deliveries that run failures and slow recoveries queue,
and one signed POST per delivery attempt (the `alerts.deliver` Celery task retries with backoff).

Webhooks reach public hosts only (unless FORGEBOARD_WEBHOOK_ALLOW_PRIVATE): a URL whose host is, or
resolves to, a loopback, private, link-local, multicast, reserved or otherwise non-public address is
refused when it is registered, and checked again before every attempt (DNS can change), which then
connects to the address it checked (no second lookup that could answer differently).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import secrets
import socket
from collections.abc import Sequence
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from forgeboard.accounts.models import Project, Role
from forgeboard.accounts.permissions import Actor, actor_user, require_project_role
from forgeboard.alerts.models import AlertEvent, Webhook, WebhookDelivery
from forgeboard.audit.services import audit_record
from forgeboard.dispatch import ALERTS_DELIVER, enqueue
from forgeboard.errors import ValidationFailed
from forgeboard.runs.models import Run
from forgeboard.runs.states import RunState
from workers.engine.wire_limits import unstorable_reason

SIGNATURE_HEADER = "X-Forgeboard-Signature"
EVENT_HEADER = "X-Forgeboard-Event"
DELIVERY_HEADER = "X-Forgeboard-Delivery"
MAX_URL_LENGTH = 2000
DELIVERY_TIMEOUT_S = 10.0
MAX_ERROR_CHARS = 2000
# Seconds before each retry of a failed delivery; after the last one the delivery is given up.
RETRY_DELAYS_S = (10, 30, 90, 270, 810)

_RUN_STATE_EVENTS = {RunState.FAILED: AlertEvent.RUN_FAILED, RunState.LOST: AlertEvent.RUN_LOST}


def sign(*, secret: str, body: bytes) -> str:
    """The signature header's value: `sha256=` + hex HMAC-SHA256 of the exact body bytes."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def _clean_url(url: object) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ValidationFailed.on("url", "is required")
    url = url.strip()
    if reason := unstorable_reason(url):
        raise ValidationFailed.on("url", reason)
    if len(url) > MAX_URL_LENGTH:
        raise ValidationFailed.on("url", f"at most {MAX_URL_LENGTH} characters")
    if urlsplit(url).scheme not in ("http", "https"):
        raise ValidationFailed.on("url", "must be an http:// or https:// URL")
    try:
        URLValidator(schemes=["http", "https"])(url)
    except ValidationError:
        raise ValidationFailed.on("url", "is not a valid URL") from None
    if urlsplit(url).username is not None:
        raise ValidationFailed.on("url", "must not carry a user name or password: the signature authenticates")
    _check_destination(url)
    return url


class UnsafeDestination(Exception):
    """The webhook's host is, or resolves to, an address that is not public."""


class Unresolved(Exception):
    """The webhook's host does not resolve (now)."""


IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _non_public(ip: IpAddress) -> str | None:
    """What kind of non-public address this is, or None for a public (globally routable unicast) one."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:
            return _non_public(embedded)
    for kind, flag in (("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified),
                       ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                       ("reserved", ip.is_reserved), ("private", ip.is_private)):
        if flag:
            return kind
    return None if ip.is_global else "non-public"


_getaddrinfo = socket.getaddrinfo  # one name for the tests to replace without touching httpx's own lookups


def public_addresses(host: str, port: int) -> list[str]:
    """Every address the host resolves to, all public, else UnsafeDestination naming the first that is not.

    `getaddrinfo` also reads the forms a URL validator may miss (`2130706433`, `0x7f.1`, `[::ffff:7f00:1]`).
    """
    try:
        infos = _getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise Unresolved(f"cannot resolve {host}: {exc}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise Unresolved(f"cannot resolve {host}: no addresses")
    for address in addresses:
        kind = _non_public(ipaddress.ip_address(address.split("%", 1)[0]))
        if kind is not None:
            shown = host if host == address else f"{host} resolves to {address}, which"
            raise UnsafeDestination(f"{shown} is a {kind} address: webhooks reach public hosts only")
    return addresses


def _url_port(parts: Any) -> int:
    try:
        port = parts.port
    except ValueError:
        port = None
    return port or (443 if parts.scheme == "https" else 80)


def _check_destination(url: str) -> None:
    """At registration: refuse a host that is or resolves to a non-public address (one that does not resolve
    now is accepted: every delivery attempt checks again)."""
    if settings.WEBHOOK_ALLOW_PRIVATE:
        return
    parts = urlsplit(url)
    try:
        public_addresses(parts.hostname or "", _url_port(parts))
    except UnsafeDestination as exc:
        raise ValidationFailed.on("url", str(exc)) from None
    except Unresolved:
        pass


def _clean_events(events: object) -> list[str]:
    if isinstance(events, str) or not isinstance(events, Sequence) or not events:
        raise ValidationFailed.on("events", f"choose one or more of {', '.join(AlertEvent.values)}")
    unknown = [e for e in events if e not in AlertEvent.values]
    if unknown:
        raise ValidationFailed.on("events", f"unknown {unknown[0]!r}: choose from {', '.join(AlertEvent.values)}")
    return sorted(set(events))


def webhook_create(
    *, actor: Actor, project: Project, url: str, events: Sequence[str], secret: str | None = None
) -> Webhook:
    """Register a webhook; without a secret one is minted. The secret is returned on the webhook, never audited."""
    require_project_role(actor=actor, project=project, minimum=Role.OWNER, action="adding webhooks")
    url = _clean_url(url)
    events = _clean_events(events)
    if secret is None:
        secret = secrets.token_urlsafe(32)
    elif not isinstance(secret, str) or not 16 <= len(secret) <= 128:
        raise ValidationFailed.on("secret", "16 to 128 characters")
    elif reason := unstorable_reason(secret):
        raise ValidationFailed.on("secret", reason)
    with transaction.atomic():
        webhook = Webhook.objects.create(project=project, url=url, events=events, secret=secret,
                                         created_by=actor_user(actor))
        audit_record(actor=actor, action="webhook.create", target=webhook, project=project,
                     payload={"url": url, "events": events})
    return webhook


def webhook_set_active(*, actor: Actor, webhook: Webhook, active: bool) -> Webhook:
    """Pause or resume a webhook; deliveries already queued for a paused one are not sent."""
    require_project_role(actor=actor, project=webhook.project, minimum=Role.OWNER, action="changing webhooks")
    if not isinstance(active, bool):
        raise ValidationFailed.on("active", "must be true or false")
    with transaction.atomic():
        webhook.active = active
        webhook.save(update_fields=["active"])
        audit_record(actor=actor, action="webhook.activate" if active else "webhook.deactivate", target=webhook,
                     project=webhook.project)
    return webhook


def _enqueue_delivery(delivery_id: int) -> None:
    enqueue(ALERTS_DELIVER, args=[delivery_id])


def _queue(*, project: Project, event: AlertEvent, payload: dict[str, Any]) -> list[WebhookDelivery]:
    """A delivery for each active webhook of the project subscribed to the event, sent once committed."""
    deliveries = []
    with transaction.atomic():
        for webhook in Webhook.objects.filter(project=project, active=True).order_by("pk"):
            if event in webhook.events:
                delivery = WebhookDelivery.objects.create(webhook=webhook, event=event, payload=payload)
                transaction.on_commit(partial(_enqueue_delivery, delivery.pk))
                deliveries.append(delivery)
    return deliveries


def _run_payload(run: Run) -> dict[str, Any]:
    return {
        "id": run.pk, "uid": str(run.uid), "number": run.number, "state": run.state,
        "experiment": run.experiment.name, "project": run.experiment.project.slug,
        "exit_reason": run.exit_reason, "restart_count": run.restart_count,
    }


def alerts_for_run_state(*, run: Run, state: RunState | str) -> list[WebhookDelivery]:
    """Queue run_failed / run_lost alerts when a run enters failed or lost; other states alert no one."""
    event = _RUN_STATE_EVENTS.get(RunState(state))
    if event is None:
        return []
    return _queue(project=run.experiment.project, event=event, payload={"run": _run_payload(run) | {"state": state}})


def alerts_for_recovery(*, run: Run, recovery_s: float, threshold_s: float) -> list[WebhookDelivery]:
    """Queue drill_recovery_slow alerts when a fault drill's recovery took longer than its threshold."""
    for name, value in (("recovery_s", recovery_s), ("threshold_s", threshold_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValidationFailed.on(name, "must be a finite number of seconds, 0 or more")
    if recovery_s <= threshold_s:
        return []
    payload = {"run": _run_payload(run), "recovery_s": recovery_s, "threshold_s": threshold_s}
    return _queue(project=run.experiment.project, event=AlertEvent.DRILL_RECOVERY_SLOW, payload=payload)


def delivery_body(delivery: WebhookDelivery) -> bytes:
    document = {"delivery": delivery.pk, "event": delivery.event, "created_at": delivery.created_at.isoformat(),
                **delivery.payload}
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode("utf-8")


def delivery_attempt(*, delivery_id: int) -> WebhookDelivery:
    """POST the delivery once and record the attempt. A delivered one, or one whose webhook is paused, is left alone."""
    delivery = WebhookDelivery.objects.select_related("webhook").get(pk=delivery_id)
    if delivery.delivered_at is not None or not delivery.webhook.active:
        return delivery
    body = delivery_body(delivery)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "Forgeboard-Webhooks/1",
        SIGNATURE_HEADER: sign(secret=delivery.webhook.secret, body=body),
        EVENT_HEADER: delivery.event,
        DELIVERY_HEADER: str(delivery.pk),
    }
    status: int | None = None
    try:
        url, extensions = _pinned(delivery.webhook.url, headers)
        with httpx.Client(timeout=DELIVERY_TIMEOUT_S, follow_redirects=False) as client:
            response = client.post(url, content=body, headers=headers, extensions=extensions)
        status = response.status_code
        error = "" if 200 <= status < 300 else f"HTTP {status}: {response.text[:500]}"
    except UnsafeDestination as exc:
        error = f"refused: {exc}"
    except Unresolved as exc:
        error = f"DNS: {exc}"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        attempts=F("attempts") + 1, status_code=status, last_error=error[:MAX_ERROR_CHARS],
        delivered_at=None if error else timezone.now(),
    )
    delivery.refresh_from_db()
    return delivery


def _pinned(url: str, headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The URL to connect to: its host replaced by the public address just checked (Host header and TLS
    server name keep the name, so virtual hosts and certificates work). Unchanged when private hosts are allowed."""
    if settings.WEBHOOK_ALLOW_PRIVATE:
        return url, {}
    parts = urlsplit(url)
    hostname, port = parts.hostname or "", _url_port(parts)
    address = public_addresses(hostname, port)[0]
    literal = f"[{address}]" if ":" in address else address
    default_port = 443 if parts.scheme == "https" else 80
    headers["Host"] = (f"[{hostname}]" if ":" in hostname else hostname) + ("" if port == default_port else f":{port}")
    pinned = parts._replace(netloc=f"{literal}:{port}").geturl()
    return pinned, ({"sni_hostname": hostname} if parts.scheme == "https" else {})
