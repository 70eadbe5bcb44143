from django.urls import path

from forgeboard.telemetry.consumers import ProjectStreamConsumer, RunStreamConsumer

websocket_urlpatterns = [
    path("ws/runs/<int:run_id>/", RunStreamConsumer.as_asgi()),
    path("ws/projects/<slug:slug>/", ProjectStreamConsumer.as_asgi()),
]
