from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "forgeboard.alerts"
    label = "alerts"
