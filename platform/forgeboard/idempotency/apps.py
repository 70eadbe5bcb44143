from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "forgeboard.idempotency"
    label = "idempotency"
