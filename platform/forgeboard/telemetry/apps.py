from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    name = "forgeboard.telemetry"
    label = "telemetry"
