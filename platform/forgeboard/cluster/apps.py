from django.apps import AppConfig


class ClusterConfig(AppConfig):
    name = "forgeboard.cluster"
    label = "cluster"
