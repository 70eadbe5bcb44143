from __future__ import annotations

from typing import Annotated

from ninja import Schema
from ninja.pagination import LimitOffsetPagination
from pydantic import Field

MAX_PAGE = 500
MAX_OFFSET = 10**9


class Pages(LimitOffsetPagination):
    """limit/offset with bounds on both (an unbounded offset would overflow the database's integer)."""

    class Input(Schema):
        limit: Annotated[int, Field(ge=1, le=MAX_PAGE)] = 100
        offset: Annotated[int, Field(ge=0, le=MAX_OFFSET)] = 0
