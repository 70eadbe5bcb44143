from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "forgeboard.runs"
    label = "runs"
