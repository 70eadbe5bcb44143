from django.apps import AppConfig


class ExperimentsConfig(AppConfig):
    name = "forgeboard.experiments"
    label = "experiments"
