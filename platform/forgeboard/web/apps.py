from django.apps import AppConfig


class WebConfig(AppConfig):
    name = "forgeboard.web"
    label = "web"
