from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "forgeboard.accounts"
    label = "accounts"

    def ready(self) -> None:
        from forgeboard.accounts import backends  # noqa: F401 - connects the failed-login counter
