"""Websocket routes. Live run and project streams are added by the run orchestration work."""

websocket_urlpatterns: list = []
