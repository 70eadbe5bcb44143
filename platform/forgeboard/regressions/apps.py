from django.apps import AppConfig


class RegressionsConfig(AppConfig):
    name = "forgeboard.regressions"
    label = "regressions"
