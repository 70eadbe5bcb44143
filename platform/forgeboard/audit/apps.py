from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "forgeboard.audit"
    label = "audit"
