"""The /api/v1 client lives in forgeboard_client (the Django-free client distribution); this name stays for imports."""

from forgeboard_client.client import ApiError, ForgeboardClient

__all__ = ["ApiError", "ForgeboardClient"]
