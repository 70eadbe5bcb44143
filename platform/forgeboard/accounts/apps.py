from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "forgeboard.accounts"
    label = "accounts"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from forgeboard.accounts import backends  # noqa: F401 - connects the failed-login counter
        from forgeboard.after_migrate import finish_migrate

        post_migrate.connect(finish_migrate, sender=self)  # sent once per app with models: once per migrate here
