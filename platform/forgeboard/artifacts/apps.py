from django.apps import AppConfig


class ArtifactsConfig(AppConfig):
    name = "forgeboard.artifacts"
    label = "artifacts"
