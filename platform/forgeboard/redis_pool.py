"""One Redis connection pool per server URL per process, for Django's cache.

Django builds a cache object per request context under ASGI, and each would open a pool (and a
new TCP connection) of its own: every API request paid a Redis connect for its rate-limit check.
"""

from __future__ import annotations

import threading

import redis


class SharedConnectionPool(redis.ConnectionPool):
    _pools: dict[str, redis.ConnectionPool] = {}
    _lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs) -> redis.ConnectionPool:  # noqa: ANN003
        with cls._lock:
            if url not in cls._pools:
                cls._pools[url] = redis.ConnectionPool.from_url(url, **kwargs)
            return cls._pools[url]
