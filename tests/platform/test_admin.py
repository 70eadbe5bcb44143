"""Every model registered in the admin has a working list page and add page for an administrator."""

from __future__ import annotations

import pytest
from django.contrib import admin

from forgeboard.accounts.models import User

REGISTERED = sorted(f"{m._meta.app_label}/{m._meta.model_name}" for m in admin.site._registry)


@pytest.mark.parametrize("model", REGISTERED)
def test_admin_pages_load(client, team, model):
    client.force_login(User.objects.create_superuser("admin", password="pw-admin-1"))
    assert client.get(f"/admin/{model}/").status_code == 200
    add = client.get(f"/admin/{model}/add/")
    assert add.status_code in (200, 403)


def test_forgeboard_models_are_in_the_admin():
    for model in ["accounts/project", "accounts/apitoken", "experiments/experiment", "runs/run", "runs/command",
                  "cluster/host", "audit/auditevent", "telemetry/runevent"]:
        assert model in REGISTERED
