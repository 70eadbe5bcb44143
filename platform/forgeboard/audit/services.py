from __future__ import annotations

from typing import Any

from django.db import models

from forgeboard.accounts.models import Project
from forgeboard.accounts.permissions import Actor, actor_label, actor_user
from forgeboard.audit.models import AuditEvent


def audit_record(
    *,
    actor: Actor | None,
    action: str,
    target: models.Model,
    project: Project | None = None,
    payload: dict[str, Any] | None = None,
) -> AuditEvent:
    return AuditEvent.objects.create(
        actor=actor_user(actor) if actor is not None else None,
        actor_label=actor_label(actor) if actor is not None else "system",
        action=action,
        target_type=target._meta.label_lower,
        target_id=str(target.pk),
        project=project,
        payload=payload or {},
    )
