"""ASGI entry: HTTP through Django, websockets through Channels (routes added by the streaming app)."""

import logging
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "forgeboard.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from forgeboard.body_limits import BodyLimitASGI  # noqa: E402
from forgeboard.logs import RedactTokens  # noqa: E402
from forgeboard.websocket_routes import websocket_urlpatterns  # noqa: E402

logging.getLogger("uvicorn.error").addFilter(RedactTokens())  # its websocket lines carry the query string

application = ProtocolTypeRouter(
    {
        "http": BodyLimitASGI(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
