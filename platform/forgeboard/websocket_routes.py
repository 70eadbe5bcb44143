from django.urls import path, re_path

from forgeboard.telemetry.consumers import ProjectStreamConsumer, RunStreamConsumer, UnknownPathConsumer

websocket_urlpatterns = [
    path("ws/runs/<int:run_id>/", RunStreamConsumer.as_asgi()),
    path("ws/projects/<slug:slug>/", ProjectStreamConsumer.as_asgi()),
    re_path(r"", UnknownPathConsumer.as_asgi()),  # last: any other path, instead of an exception
]
