from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "forgeboard.accounts"
    label = "accounts"
