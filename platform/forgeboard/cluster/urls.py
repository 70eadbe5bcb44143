"""The node agent API, included under /api/agent/ by the project's URLconf."""

from django.urls import path

from forgeboard.cluster import api

app_name = "agent_api"

urlpatterns = [
    path("v1/hosts/register", api.register, name="register"),
    path("v1/hosts/heartbeat", api.heartbeat, name="heartbeat"),
]
